"""alpa: automatic inter- and intra-operator parallelism for JAX.

``import alpa`` is the only import a user needs: every public name below, and the submodules
that Alpa's tutorials reach through the package (``alpa.util``, ``alpa.testing``,
``alpa.device_mesh``, ``alpa.parallel_method``, ``alpa.pipeline_parallel``,
``alpa.shard_parallel``, ``alpa.global_env``), are attributes of it.

They are loaded on first use (PEP 562), so that importing one pass (``import
alpa.tracing``, ``import alpa.shard_parallel.auto_sharding``) loads that pass and what it
stands on, never the passes above it (imports point down only: ``docs/architecture.md``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "init": "alpa.cluster",
    "shutdown": "alpa.cluster",
    "get_global_physical_mesh": "alpa.cluster",
    "get_global_virtual_physical_mesh": "alpa.cluster",
    "get_global_cluster": "alpa.cluster",
    "get_global_num_devices": "alpa.cluster",
    "set_global_virtual_physical_mesh": "alpa.cluster",
    "clear_executable_cache": "alpa.api",
    "DataLoader": "alpa.data_loader",
    "MeshDriverDataLoader": "alpa.data_loader",
    "timers": "alpa.timer",
    "DeviceCluster": "alpa.runtime.ray_mesh",
    "DistributedArray": "alpa.runtime.ray_mesh",
    "StackedRows": "alpa.runtime.stacked_array",
    "DistributedPhysicalDeviceMesh": "alpa.runtime.ray_mesh",
    "prefetch": "alpa.runtime.ray_mesh",
    "grad": "alpa.api",
    "parallelize": "alpa.api",
    "value_and_grad": "alpa.api",
    "ClusterSpec": "alpa.device_mesh",
    "LocalPhysicalDeviceMesh": "alpa.device_mesh",
    "LogicalDeviceMesh": "alpa.device_mesh",
    "PhysicalDeviceMesh": "alpa.device_mesh",
    "VirtualPhysicalMesh": "alpa.device_mesh",
    "global_config": "alpa.global_env",
    "set_seed": "alpa.global_env",
    "DataParallel": "alpa.methods.shard_method",
    "get_3d_parallel_method": "alpa.methods.pipeshard_method",
    "ParallelMethod": "alpa.methods.shard_method",
    "CreateStateParallel": "alpa.methods.create_state_parallel",
    "FollowParallel": "alpa.methods.follow_parallel",
    "PipeshardParallel": "alpa.methods.pipeshard_method",
    "ShardParallel": "alpa.methods.shard_method",
    "Zero2Parallel": "alpa.methods.shard_method",
    "Zero3Parallel": "alpa.methods.shard_method",
    "ParallelPlan": "alpa.record.parallel_plan",
    "PlannedParallel": "alpa.methods.planned_parallel",
    "plan_to_method": "alpa.methods.planned_parallel",
    "AutoLayerOption": "alpa.pipeline_parallel.layers.layer_construction",
    "ManualLayerOption": "alpa.pipeline_parallel.layers.layer_construction",
    "automatic_remat": "alpa.pipeline_parallel.layers.remat",
    "manual_remat": "alpa.pipeline_parallel.layers.remat",
    "AutoStageOption": "alpa.pipeline_parallel.stages.stage_construction",
    "ManualStageOption": "alpa.pipeline_parallel.stages.stage_construction",
    "UniformStageOption": "alpa.pipeline_parallel.stages.stage_construction",
    "mark_pipeline_boundary": "alpa.tracing.primitive_def",
    "restore_checkpoint": "alpa.serialization",
    "save_checkpoint": "alpa.serialization",
    "AutoShardingOption": "alpa.shard_parallel.auto_sharding",
    "ManualShardingOption": "alpa.shard_parallel.strategies.manual_sharding",
}

# Submodules reachable as ``alpa.<name>`` after a bare ``import alpa``.
_SUBMODULES = (
    "api",
    "cluster",
    "create_state_parallel",
    "data_loader",
    "device_mesh",
    "executable",
    "follow_parallel",
    "global_env",
    "model",
    "parallel_method",
    "parallel_plan",
    "pipeline_parallel",
    "runtime",
    "serialization",
    "shard_parallel",
    "testing",
    "timer",
    "tracing",
    "util",
)

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"alpa.{name}")
    raise AttributeError(f"module 'alpa' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))


if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from alpa import (  # noqa: F401
        device_mesh,
        global_env,
        parallel_method,
        pipeline_parallel,
        shard_parallel,
        testing,
        util,
    )
    from alpa.api import clear_executable_cache, grad, parallelize, value_and_grad  # noqa: F401
    from alpa.cluster import (  # noqa: F401
        get_global_cluster,
        get_global_num_devices,
        get_global_physical_mesh,
        get_global_virtual_physical_mesh,
        init,
        set_global_virtual_physical_mesh,
        shutdown,
    )
    from alpa.data_loader import DataLoader, MeshDriverDataLoader  # noqa: F401
    from alpa.device_mesh import (  # noqa: F401
        ClusterSpec,
        LocalPhysicalDeviceMesh,
        LogicalDeviceMesh,
        PhysicalDeviceMesh,
        VirtualPhysicalMesh,
    )
    from alpa.global_env import global_config, set_seed  # noqa: F401
    from alpa.methods.create_state_parallel import CreateStateParallel  # noqa: F401
    from alpa.methods.follow_parallel import FollowParallel  # noqa: F401
    from alpa.methods.pipeshard_method import PipeshardParallel, get_3d_parallel_method  # noqa: F401
    from alpa.methods.planned_parallel import PlannedParallel, plan_to_method  # noqa: F401
    from alpa.methods.shard_method import (  # noqa: F401
        DataParallel,
        ParallelMethod,
        ShardParallel,
        Zero2Parallel,
        Zero3Parallel,
    )
    from alpa.pipeline_parallel.layers.layer_construction import (  # noqa: F401
        AutoLayerOption,
        ManualLayerOption,
    )
    from alpa.pipeline_parallel.layers.remat import automatic_remat, manual_remat  # noqa: F401
    from alpa.pipeline_parallel.stages.stage_construction import (  # noqa: F401
        AutoStageOption,
        ManualStageOption,
        UniformStageOption,
    )
    from alpa.record.parallel_plan import ParallelPlan  # noqa: F401
    from alpa.runtime.ray_mesh import (  # noqa: F401
        DeviceCluster,
        DistributedArray,
        DistributedPhysicalDeviceMesh,
        prefetch,
    )
    from alpa.runtime.stacked_array import StackedRows  # noqa: F401
    from alpa.serialization import restore_checkpoint, save_checkpoint  # noqa: F401
    from alpa.shard_parallel.auto_sharding import AutoShardingOption  # noqa: F401
    from alpa.shard_parallel.strategies.manual_sharding import ManualShardingOption  # noqa: F401
    from alpa.timer import timers  # noqa: F401
    from alpa.tracing.primitive_def import mark_pipeline_boundary  # noqa: F401
