"""alpa: automatic inter- and intra-operator parallelism for JAX."""

from alpa.device_mesh import (
    ClusterSpec,
    LocalPhysicalDeviceMesh,
    LogicalDeviceMesh,
    VirtualPhysicalMesh,
)
from alpa.global_env import global_config

__version__ = "0.1.0"


def shutdown() -> None:  # replaced by alpa.api in the next commit
    pass
