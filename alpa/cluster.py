"""The cluster alpa runs on: ``init``, ``shutdown`` and the global mesh.

The one piece of process-wide state besides ``global_config``: the physical mesh that
``alpa.init`` connected to. It sits below the parallel methods, which read it when they
compile, so that nothing imports back up to ``alpa.api``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax

from alpa.device_mesh import LocalPhysicalDeviceMesh, VirtualPhysicalMesh

logger = logging.getLogger("alpa")

_global_physical_mesh: LocalPhysicalDeviceMesh | None = None


def init(
    cluster: str = "local",
    *,
    devices: Sequence[Any] | None = None,
    num_nodes: int | None = None,
    num_devices_per_node: int | None = None,
) -> None:
    """Connect alpa to a cluster. A second ``init`` before ``shutdown`` does nothing.

    Args:
      cluster: ``"local"``: the devices of this process (GPUs, or virtual CPU devices).
        ``"ray"`` is not available yet.
      devices: with ``"local"``, a subset of ``jax.devices()`` to use.
    """
    global _global_physical_mesh
    if cluster == "ray":
        raise NotImplementedError(
            "alpa.init(cluster='ray') is not available yet: the Ray runtime is a separate, "
            "upcoming feature. Use alpa.init('local') (the default) to run on the devices "
            "of this process."
        )
    if cluster != "local":
        raise ValueError(f"cluster must be 'local' or 'ray', got {cluster!r}")
    if num_nodes not in (None, 1):
        raise ValueError(f"cluster='local' has one node, got num_nodes={num_nodes!r}")
    if _global_physical_mesh is not None:
        return
    mesh = LocalPhysicalDeviceMesh(devices)
    if num_devices_per_node is not None and num_devices_per_node != mesh.num_devices:
        raise ValueError(
            f"num_devices_per_node={num_devices_per_node} but this process has "
            f"{mesh.num_devices} devices"
        )
    _global_physical_mesh = mesh


def shutdown() -> None:
    """Forget the cluster; a later ``init`` starts afresh."""
    global _global_physical_mesh
    _global_physical_mesh = None


def get_global_physical_mesh() -> LocalPhysicalDeviceMesh:
    """The mesh of ``init``; calls ``init("local")`` (and says so) if it was not called."""
    if _global_physical_mesh is None:
        logger.warning("alpa.init() was not called: using the %d local devices", len(jax.devices()))
        init("local")
    return _global_physical_mesh


def get_global_virtual_physical_mesh() -> VirtualPhysicalMesh:
    mesh = get_global_physical_mesh()
    return VirtualPhysicalMesh(mesh.num_hosts, mesh.num_devices_per_host, mesh.cluster)
