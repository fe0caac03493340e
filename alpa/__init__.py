"""alpa: automatic inter- and intra-operator parallelism for JAX.

``import alpa`` is the only import a user needs; this module re-exports the public API and
makes the submodules that Alpa's tutorials reach through the package (``alpa.util``,
``alpa.testing``, ``alpa.device_mesh``, ``alpa.parallel_method``, ``alpa.pipeline_parallel``,
``alpa.shard_parallel``, ``alpa.global_env``) attributes of it.
"""

# Submodules used as ``alpa.<name>.<attr>`` after a bare ``import alpa``.
from alpa import (  # noqa: F401
    device_mesh,
    global_env,
    parallel_method,
    pipeline_parallel,
    shard_parallel,
    testing,
    util,
)
from alpa.api import (
    get_global_physical_mesh,
    get_global_virtual_physical_mesh,
    grad,
    init,
    parallelize,
    shutdown,
    value_and_grad,
)
from alpa.device_mesh import (
    ClusterSpec,
    LocalPhysicalDeviceMesh,
    LogicalDeviceMesh,
    VirtualPhysicalMesh,
)
from alpa.global_env import global_config
from alpa.parallel_method import (
    DataParallel,
    ParallelMethod,
    ShardParallel,
    Zero2Parallel,
    Zero3Parallel,
)
from alpa.pipeline_parallel.layer_construction import ManualLayerOption
from alpa.pipeline_parallel.pipeshard_parallel import PipeshardParallel
from alpa.pipeline_parallel.primitive_def import mark_pipeline_boundary
from alpa.pipeline_parallel.stage_construction import ManualStageOption, UniformStageOption
from alpa.shard_parallel.auto_sharding import AutoShardingOption
from alpa.shard_parallel.manual_sharding import ManualShardingOption

__version__ = "0.1.0"

__all__ = [
    "AutoShardingOption",
    "ClusterSpec",
    "DataParallel",
    "LocalPhysicalDeviceMesh",
    "LogicalDeviceMesh",
    "ManualLayerOption",
    "ManualShardingOption",
    "ManualStageOption",
    "ParallelMethod",
    "PipeshardParallel",
    "ShardParallel",
    "UniformStageOption",
    "VirtualPhysicalMesh",
    "Zero2Parallel",
    "Zero3Parallel",
    "get_global_physical_mesh",
    "get_global_virtual_physical_mesh",
    "global_config",
    "grad",
    "init",
    "mark_pipeline_boundary",
    "parallelize",
    "shutdown",
    "value_and_grad",
]
