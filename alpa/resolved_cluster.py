"""One reading of a method's ``devices=``: the cluster it plans for and the devices it runs on.

Every parallel method takes ``devices=`` in one of several forms, and every one of them
turns it into the same record through :func:`resolve_cluster`:

============================================  ===========================================
``devices=``                                  what the method plans for and runs on
============================================  ===========================================
``None``                                      the cluster of ``alpa.init``: its local
                                              devices, or its Ray ``DeviceCluster``; for a
                                              pipeline, the part of it that
                                              ``set_global_virtual_physical_mesh`` chose
a list or tuple of jax devices                those devices, as one host
``LocalPhysicalDeviceMesh``                   its devices, as one host
``DistributedPhysicalDeviceMesh``             that mesh of Ray workers (its devices are
                                              theirs: ``devices`` is ``None``)
``DeviceCluster`` / ``LocalDeviceCluster``    the whole cluster (``alpa.get_global_cluster()``)
``LogicalDeviceMesh``                         the mesh it views (its physical mesh, else its
                                              devices as one host), and the view itself;
                                              one without devices is a cluster not here of
                                              one host
``VirtualPhysicalMesh`` / ``ClusterSpec``     a cluster that is not here: plans only
============================================  ===========================================

The result, :class:`ResolvedCluster`, says it once: ``spec`` is a ``ClusterSpec`` of the
planned shape (its ``num_nodes`` x ``num_devices_per_node`` *are* the planned hosts and
devices per host, whatever counts the spec it came from carried), ``devices`` the devices
of this process in order (``None`` when the cluster is not here or its devices belong to
Ray workers), and what runs the step: a physical mesh, or a Ray cluster that a pipeline
slices its stage meshes from. No host or device count travels beside the spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from alpa.cluster import (
    LocalDeviceCluster,
    get_global_physical_mesh,
    get_ray_cluster,
    global_virtual_mesh_if_set,
)
from alpa.device_mesh import (
    CLUSTER_PRESETS,
    ClusterSpec,
    LocalPhysicalDeviceMesh,
    LogicalDeviceMesh,
    PhysicalDeviceMesh,
    VirtualPhysicalMesh,
)
from alpa.runtime.ray_mesh import DeviceCluster, DistributedPhysicalDeviceMesh

#: What ``devices=`` may be, in the words of its error.
ACCEPTED = (
    "None, a list of jax devices, a LocalPhysicalDeviceMesh, a "
    "DistributedPhysicalDeviceMesh, a DeviceCluster (alpa.get_global_cluster()), a "
    "LogicalDeviceMesh, a VirtualPhysicalMesh or a ClusterSpec"
)


@dataclass(frozen=True)
class ResolvedCluster:
    """A method's ``devices=``, resolved (:func:`resolve_cluster`).

    ``spec``: the hardware and the planned shape, ``spec.num_nodes`` hosts of
    ``spec.num_devices_per_node`` devices. ``devices``: this process's devices, host by
    host, or ``None`` (a cluster that is not here, or Ray workers' devices). ``mesh``: the
    physical mesh the step runs on, when one is given or made (``None`` for a cluster that
    is not here and for a Ray cluster, whose meshes are made when asked for).
    ``ray_cluster``: the Ray cluster whose workers own the devices, when the step runs on
    it. ``view``: the ``LogicalDeviceMesh`` the user gave (its shape and alpha-beta).
    ``given``: the ``devices=`` value itself, for messages.
    """

    spec: ClusterSpec
    devices: tuple[Any, ...] | None = None
    mesh: PhysicalDeviceMesh | None = None
    ray_cluster: DeviceCluster | None = None
    view: LogicalDeviceMesh | None = None
    given: Any = field(default=None, compare=False, repr=False)

    @property
    def is_here(self) -> bool:
        """Whether the step can run: the devices are this process's or Ray workers'."""
        return self.mesh is not None or self.ray_cluster is not None

    def check_here(self) -> None:
        """Raise ``ValueError`` for a cluster that is not here (it can only be planned)."""
        if not self.is_here:
            raise ValueError(
                f"devices is {type(self.given).__name__} (a cluster that is not here, no "
                "devices): it can be planned for with parallelize(...).plan(*args), not run"
            )

    def physical_mesh(self) -> PhysicalDeviceMesh:
        """The one mesh of every planned device: the mesh given, else the Ray cluster's
        mesh of the planned shape (its first hosts and devices; the whole cluster's is
        ``alpa.get_global_physical_mesh()``); its workers start now."""
        if self.mesh is not None:
            return self.mesh
        self.check_here()
        hosts = tuple(range(self.spec.num_nodes))
        return self.ray_cluster.get_physical_mesh(hosts, self.spec.num_devices_per_node)

    def logical_mesh(self, mesh_shape=None, require_devices: bool = True) -> LogicalDeviceMesh:
        """The logical mesh a one-mesh method plans on: the view given (another
        ``mesh_shape`` views its mesh anew), else the view ``mesh_shape`` (default the
        planned shape) of the cluster. ``require_devices``: a cluster that is not here
        raises (:meth:`check_here`)."""
        if require_devices:
            self.check_here()
        view = self.view
        if view is not None and (mesh_shape is None or tuple(mesh_shape) == view.shape):
            return view
        if view is not None and self.mesh is None:
            return view  # a view of devices that are not here: its own shape
        if not self.is_here:
            virtual = VirtualPhysicalMesh(
                self.spec.num_nodes, self.spec.num_devices_per_node, cluster=self.spec
            )
            return virtual.get_logical_mesh(mesh_shape)
        return self.physical_mesh().get_logical_mesh(mesh_shape)


def resolve_cluster(devices: Any, use_global_virtual_mesh: bool = False) -> ResolvedCluster:
    """``devices`` (a method's argument; the forms in the module docstring) as a
    :class:`ResolvedCluster`.

    ``use_global_virtual_mesh``: ``devices=None`` plans on the mesh
    ``set_global_virtual_physical_mesh`` chose, when one was (Alpa's pipelines do; its
    one-mesh methods run on the whole cluster). A type not listed raises ``TypeError``
    naming the value and what is accepted."""
    if devices is None:
        chosen = global_virtual_mesh_if_set() if use_global_virtual_mesh else None
        return _global_cluster(chosen)
    if isinstance(devices, ClusterSpec):
        return _not_here(devices.get_virtual_physical_mesh(), devices)
    if isinstance(devices, VirtualPhysicalMesh):
        return _not_here(devices, devices)
    if isinstance(devices, LogicalDeviceMesh):
        return _of_view(devices)
    if isinstance(devices, DeviceCluster):
        return ResolvedCluster(devices.spec, ray_cluster=devices, given=devices)
    if isinstance(devices, LocalDeviceCluster):
        return _of_mesh(devices.get_physical_mesh(), devices)
    if isinstance(devices, PhysicalDeviceMesh):
        return _of_mesh(devices, devices)
    if isinstance(devices, str):
        raise TypeError(
            f"devices={devices!r} is a string; pass jax devices (jax.devices({devices!r})) "
            "or a mesh"
        )
    if isinstance(devices, list | tuple):
        return _of_mesh(LocalPhysicalDeviceMesh(devices), devices)
    raise TypeError(f"devices must be {ACCEPTED}, got {type(devices).__name__} {devices!r}")


def _shaped(spec: ClusterSpec, num_hosts: int, num_devices_per_host: int) -> ClusterSpec:
    """``spec`` with the planned shape (a spec's own counts may be another shape's: the
    cluster a mesh was sliced from)."""
    if (spec.num_nodes, spec.num_devices_per_node) == (num_hosts, num_devices_per_host):
        return spec
    return replace(spec, num_nodes=num_hosts, num_devices_per_node=num_devices_per_host)


def _of_mesh(mesh: PhysicalDeviceMesh, given: Any, view=None) -> ResolvedCluster:
    """A physical mesh: this process's devices, or Ray workers' (``devices`` ``None``);
    the mesh of a whole Ray cluster also names the cluster, which a pipeline slices."""
    spec = _shaped(mesh.spec, mesh.num_hosts, mesh.num_devices_per_host)
    devices = mesh.logical_devices
    devices = None if devices is None else tuple(devices)
    whole = isinstance(mesh, DistributedPhysicalDeviceMesh) and _is_whole(mesh)
    ray_cluster = mesh.cluster if whole else None
    return ResolvedCluster(spec, devices, mesh, ray_cluster, view, given)


def _is_whole(mesh: DistributedPhysicalDeviceMesh) -> bool:
    """Whether ``mesh`` is every device of its Ray cluster (a pipeline may slice it)."""
    cluster = mesh.cluster
    return (
        tuple(mesh.host_ids) == tuple(range(cluster.num_hosts))
        and mesh.num_devices_per_host == cluster.num_devices_per_host
    )


def _not_here(virtual: VirtualPhysicalMesh, given: Any) -> ResolvedCluster:
    """A cluster that is not here, of ``virtual``'s shape (a mesh without hardware: the
    CPU preset's)."""
    spec = virtual.cluster or CLUSTER_PRESETS["cpu"]
    return ResolvedCluster(
        _shaped(spec, virtual.num_hosts, virtual.num_devices_per_host), given=given
    )


def _of_view(view: LogicalDeviceMesh) -> ResolvedCluster:
    if view.physical_mesh is not None:
        return _of_mesh(view.physical_mesh, view, view)
    if view.devices is not None:
        return _of_mesh(LocalPhysicalDeviceMesh(view.devices), view, view)
    # Devices that are not here, on one host, priced at the view's own rates.
    spec = replace(
        CLUSTER_PRESETS["cpu"],
        num_nodes=1,
        num_devices_per_node=view.num_devices,
        device_flops=view.device_flops,
        memory_bandwidth=view.memory_bandwidth,
    )
    return ResolvedCluster(spec, view=view, given=view)


def _global_cluster(chosen: VirtualPhysicalMesh | None) -> ResolvedCluster:
    """The cluster of ``alpa.init`` (``chosen``: the part of it to plan on)."""
    ray_cluster = get_ray_cluster()
    if ray_cluster is not None:
        spec = ray_cluster.spec
        if chosen is None:
            return ResolvedCluster(spec, ray_cluster=ray_cluster)
        if (
            chosen.num_hosts > ray_cluster.num_hosts
            or chosen.num_devices_per_host > ray_cluster.num_devices_per_host
        ):
            raise ValueError(
                f"the global virtual mesh {chosen.shape} does not fit the Ray cluster of "
                f"{ray_cluster.num_hosts} x {ray_cluster.num_devices_per_host} devices"
            )
        # set_global_virtual_physical_mesh: the first hosts, the first devices of each.
        spec = _shaped(spec, chosen.num_hosts, chosen.num_devices_per_host)
        return ResolvedCluster(spec, ray_cluster=ray_cluster)
    local = get_global_physical_mesh()
    if chosen is None:
        return _of_mesh(local, None)
    if chosen.num_hosts != 1 or chosen.num_devices > local.num_devices:
        raise ValueError(
            f"the global virtual mesh {chosen.shape} does not fit the "
            f"{local.num_devices} local devices of alpa.init('local')"
        )
    return _of_mesh(local.slice_1d(0, chosen.num_devices), None)
