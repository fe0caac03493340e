"""The cluster alpa runs on: ``init``, ``shutdown`` and the global mesh.

The one piece of process-wide state besides ``global_config``: the physical mesh that
``alpa.init`` connected to. It sits below the parallel methods, which read it when they
compile, so that nothing imports back up to ``alpa.api``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import jax

from alpa.device_mesh import LocalPhysicalDeviceMesh, VirtualPhysicalMesh
from alpa.flax_patches import install_flax_patches

logger = logging.getLogger("alpa")

_global_physical_mesh: Any = None  # LocalPhysicalDeviceMesh or, for Ray, built on demand
_global_cluster: Any = None  # alpa.runtime.ray_mesh.DeviceCluster under init("ray")
_started_ray = False
_init_args: tuple | None = None  # what the explicit alpa.init was called with
_global_virtual_mesh: VirtualPhysicalMesh | None = None  # set_global_virtual_physical_mesh
#: Counts the ``shutdown`` s: an executable compiled for the global cluster is for the
#: cluster of the generation it was compiled in (``generation()``).
_generation = 0


def init(
    cluster: str = "ray",
    cluster_address: str | None = None,
    num_nodes: int | None = None,
    num_devices_per_node: int | None = None,
    namespace: str = "alpa_default_space",
    *,
    devices: Sequence[Any] | None = None,
) -> None:
    """Connect alpa to a cluster. A second ``init`` before ``shutdown`` does nothing.

    Without any ``init``, the first ``parallelize`` call runs on the local devices (an
    implied ``init("local")``); an explicit ``alpa.init()`` is Alpa's, whose default
    cluster is Ray.

    Args:
      cluster: ``"ray"`` (the default, as Alpa's): the Ray cluster this process is
        connected to (``ray.init()`` called before), else the one at ``cluster_address``,
        else a running one (``address="auto"``), else a new local one; mesh workers own the
        devices (``docs/ray.md``). ``"local"``: the devices of this process (GPUs, or
        virtual CPU devices).
      cluster_address: with ``"ray"``, the address of the Ray cluster to connect to
        (``host:port`` of its head, or ``ray://host:port``). One where no gRPC server
        answers within ``global_config.ray_connect_timeout`` seconds (default 10) raises
        ``ConnectionError`` naming it; Ray alone would wait without limit.
      num_nodes: with ``"ray"``, use this many of its nodes (default all).
      num_devices_per_node: with ``"ray"``, devices per node (default: a GPU node's GPUs;
        :data:`alpa.runtime.ray_mesh.DEFAULT_CPU_DEVICES_PER_NODE` virtual devices on a
        CPU-only node). With ``"local"``, the first ``k`` local devices.
      namespace: with ``"ray"``, the Ray namespace of a Ray alpa starts or connects to.
      devices: with ``"local"``, a subset of ``jax.devices()`` to use
        (``num_devices_per_node=k`` takes the first ``k`` of them).
    """
    global _global_physical_mesh, _global_cluster, _init_args
    install_flax_patches()  # Alpa's additions to flax, which its programs use from here on
    args = (cluster, cluster_address, num_nodes, num_devices_per_node, namespace, devices)
    if _global_physical_mesh is not None or _global_cluster is not None:
        if _init_args is not None and args != _init_args:
            warnings.warn(
                f"alpa.init({cluster!r}, ...) is ignored: alpa is already initialized with "
                f"other arguments (cluster={_init_args[0]!r}); call alpa.shutdown() first",
                UserWarning,
                stacklevel=2,
            )
        return
    _init_args = args
    if cluster == "ray":
        if devices is not None:
            raise ValueError("devices= is for cluster='local'; Ray meshes own their devices")
        _global_cluster = _init_ray(cluster_address, num_nodes, num_devices_per_node, namespace)
        return
    if cluster != "local":
        raise ValueError(f"cluster must be 'local' or 'ray', got {cluster!r}")
    if num_nodes not in (None, 1):
        raise ValueError(f"cluster='local' has one node, got num_nodes={num_nodes!r}")
    if num_devices_per_node is not None:
        available = list(jax.devices() if devices is None else devices)
        if not isinstance(num_devices_per_node, int) or not (
            1 <= num_devices_per_node <= len(available)
        ):
            raise ValueError(
                f"num_devices_per_node={num_devices_per_node!r} but this process has "
                f"{len(available)} devices; expected an int in [1, {len(available)}]"
            )
        devices = available[:num_devices_per_node]  # the first k, as in Alpa
    _global_physical_mesh = LocalPhysicalDeviceMesh(devices)


def _init_ray(cluster_address, num_nodes, num_devices_per_node, namespace):
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is a dependency
        raise RuntimeError("alpa.init('ray') needs ray: pip install ray") from e
    from alpa.runtime.ray_mesh import DeviceCluster

    if not ray.is_initialized():
        address = cluster_address or _running_cluster()
        if cluster_address is not None:
            _check_reachable(cluster_address)
        try:
            if address is None:
                raise ConnectionError("no running Ray cluster")
            ray.init(address=address, namespace=namespace, log_to_driver=False)
        except ConnectionError:
            if cluster_address is not None:
                raise
            logger.warning("no running Ray cluster found: starting a local one")
            _start_local_ray(namespace)
    # A Ray alpa started runs on this machine with this Python: its workers import what
    # this process imports (a data loader's input_iter_func from a module on sys.path).
    import_path = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return DeviceCluster(num_nodes, num_devices_per_node, import_path if _started_ray else None)


def _running_cluster() -> str | None:
    """The address of the Ray cluster to join when ``alpa.init("ray")`` is given none:
    ``RAY_ADDRESS``, else the cluster ``ray start`` last started here (Alpa's
    ``ray.init(address="auto")``), if it answers; else ``None``. Ray's ``"auto"`` would also
    take any Ray process it finds on the machine, such as another program's private
    instance or one of a run that was killed or is shutting down, and wait for it
    without limit."""
    from ray._private.services import get_ray_address_from_environment

    try:
        address = get_ray_address_from_environment(None, None)
    except (ConnectionError, ValueError):
        return None
    if address is None:
        return None
    try:
        _check_reachable(address)
    except ConnectionError as e:
        logger.warning("the Ray cluster at %s does not answer (%s)", address, e)
        return None
    return address


def _start_local_ray(namespace: str) -> None:
    """Start a one-node Ray for this machine, reachable from it only: every one of its
    processes listens on the loopback address (:func:`_local_only_ray`); ``shutdown``
    stops it."""
    global _started_ray
    import ray

    _local_only_ray(True)
    try:
        ray.init(
            address="local",  # a new one, never a cluster some other process started
            namespace=namespace,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
        )
    except BaseException:
        _local_only_ray(False)
        raise
    _started_ray = True


#: Ray's switch for clusters that reach other machines (``ray_constants``): off, a node
#: address of 127.0.0.1 stays loopback and every Ray process listens there; on (Ray's
#: default on Linux), Ray resolves 127.0.0.1 to the machine's routable address and its
#: servers listen on every interface.
_RAY_CLUSTERS_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_saved_ray_clusters: tuple | None = None  # (the variable, Ray's constant) before alpa's Ray


def _local_only_ray(on: bool) -> None:
    """Make the Ray that alpa starts for this machine reachable from it only (``on``),
    or put back what was there before (``on=False``). Ray reads the switch from the
    environment when it is imported (its constant, which the driver's ``ray.init``
    reads) and its node processes inherit the variable; both are set while alpa's own
    Ray runs, so a cluster joined later (``alpa.init("ray", cluster_address=...)``, or
    ``ray.init`` by the user after ``alpa.shutdown()``) is as Ray makes it."""
    global _saved_ray_clusters
    from ray._private import ray_constants

    if on:
        _saved_ray_clusters = (
            os.environ.get(_RAY_CLUSTERS_VARIABLE),
            ray_constants.ENABLE_RAY_CLUSTER,
        )
        os.environ[_RAY_CLUSTERS_VARIABLE] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
        return
    if _saved_ray_clusters is None:
        return
    variable, constant = _saved_ray_clusters
    if variable is None:
        os.environ.pop(_RAY_CLUSTERS_VARIABLE, None)
    else:
        os.environ[_RAY_CLUSTERS_VARIABLE] = variable
    ray_constants.ENABLE_RAY_CLUSTER = constant
    _saved_ray_clusters = None


#: An HTTP/2 client's first bytes (RFC 9113 §3.4): the preface and an empty SETTINGS frame.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _check_reachable(address: str) -> None:
    """Raise ``ConnectionError`` naming ``address`` unless a gRPC server (Ray's GCS, or
    the Ray client server of ``ray://``) answers there within
    ``global_config.ray_connect_timeout``: ``ray.init`` retries an address that refuses
    or does not answer without limit. The check is HTTP/2's opening exchange, which every
    gRPC server answers with a SETTINGS frame."""
    from alpa.global_env import global_config

    if not isinstance(address, str):
        raise TypeError(f"cluster_address={address!r} ({type(address).__name__}) must be a str")
    if address in ("auto", "local"):
        return
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"cluster_address={address!r}: expected 'host:port' or 'ray://host:port'")
    limit = global_config.ray_connect_timeout
    deadline = time.monotonic() + limit
    try:
        with socket.create_connection((host, int(port)), timeout=limit) as sock:
            sock.sendall(_H2_PREFACE)
            header = b""
            while len(header) < 9:  # the server's first frame header
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                chunk = sock.recv(9 - len(header))
                if not chunk:
                    raise ConnectionError("the connection was closed without an answer")
                header += chunk
    except OSError as e:  # refused, unreachable, timed out, closed
        raise ConnectionError(
            f"alpa.init('ray', cluster_address={address!r}): no Ray cluster answered at "
            f"{host}:{port} within {limit:g} s (global_config.ray_connect_timeout): "
            f"{type(e).__name__}: {e}. Is the Ray head running there (ray start --head) and "
            "is this the address it printed?"
        ) from e


def shutdown() -> None:
    """Forget the cluster and kill its mesh workers; a later ``init`` starts afresh."""
    global _global_physical_mesh, _global_cluster, _started_ray, _global_virtual_mesh, _init_args
    _global_virtual_mesh = None
    _init_args = None
    _new_generation()
    if _global_cluster is not None:
        _global_cluster.shutdown()
        if _started_ray:
            import ray

            ray.shutdown()
            _local_only_ray(False)
            _started_ray = False
    _global_physical_mesh = None
    _global_cluster = None


def _new_generation() -> None:
    global _generation
    _generation += 1


def generation() -> int:
    """Which cluster the global one is: a number that changes at every ``shutdown`` (the
    next ``init``, explicit or implicit, is of the new one), so that what was compiled for
    the global cluster is compiled again for the next (``alpa.init("local",
    num_devices_per_node=4)`` after 8 devices)."""
    return _generation


def get_global_cluster():
    """The cluster of ``alpa.init``: the ``DeviceCluster`` of ``"ray"``, or under
    ``"local"`` a :class:`LocalDeviceCluster` of this process's devices (Alpa's programs
    slice meshes from it either way); ``None`` before ``init``."""
    if _global_cluster is not None:
        return _global_cluster
    if _global_physical_mesh is not None:
        return LocalDeviceCluster(_global_physical_mesh)
    return None


def get_ray_cluster():
    """The ``DeviceCluster`` of ``alpa.init("ray")``, else ``None``."""
    return _global_cluster


class LocalDeviceCluster:
    """The devices of ``alpa.init("local")`` with the cluster API of a Ray
    ``DeviceCluster``: one host of ``num_devices_per_host`` devices."""

    def __init__(self, mesh: LocalPhysicalDeviceMesh):
        self._mesh = mesh
        self.num_hosts = 1
        self.num_devices_per_host = mesh.num_devices
        self.spec = mesh.cluster

    @property
    def num_devices(self) -> int:
        return self.num_devices_per_host

    @property
    def host_info(self) -> list[dict]:
        """The one host, as a Ray ``DeviceCluster`` lists its nodes."""
        return self._mesh.host_info

    def _checked(self, host_ids, num_devices_per_host) -> int:
        if host_ids is not None and list(host_ids) != [0]:
            raise ValueError(
                f"host_ids must be [0] (alpa.init('local') has one host), got {list(host_ids)}"
            )
        per_host = num_devices_per_host or self.num_devices_per_host
        if isinstance(per_host, bool) or not 1 <= per_host <= self.num_devices_per_host:
            raise ValueError(
                f"num_devices_per_host must be in [1, {self.num_devices_per_host}], "
                f"got {num_devices_per_host!r}"
            )
        return per_host

    def get_physical_mesh(self, host_ids=None, num_devices_per_host=None):
        """The first ``num_devices_per_host`` local devices (default all)."""
        per_host = self._checked(host_ids, num_devices_per_host)
        return self._mesh.slice_1d(0, per_host) if per_host < self.num_devices else self._mesh

    def get_virtual_physical_mesh(self, host_ids=None, num_devices_per_host=None):
        """The first ``num_devices_per_host`` local devices as a mesh not yet sliced."""
        per_host = self._checked(host_ids, num_devices_per_host)
        return VirtualPhysicalMesh(1, per_host, replace(self.spec, num_devices_per_node=per_host))

    def __repr__(self) -> str:
        return f"LocalDeviceCluster(1 host x {self.num_devices_per_host} devices)"


def get_global_physical_mesh(create_if_not_exist: bool = True):
    """The mesh of ``init``: the local devices, or under Ray the mesh of every node's
    devices (its workers start on first use). Calls ``init("local")`` (and says so) if
    ``init`` was not called."""
    global _global_physical_mesh
    if _global_cluster is not None:
        return _global_cluster.get_physical_mesh()
    if _global_physical_mesh is None and create_if_not_exist:
        logger.warning("alpa.init() was not called: using the %d local devices", len(jax.devices()))
        init("local")
    return _global_physical_mesh


def get_global_virtual_physical_mesh() -> VirtualPhysicalMesh:
    """The cluster as a mesh not yet sliced (``set_global_virtual_physical_mesh``'s, if
    one was set)."""
    if _global_virtual_mesh is not None:
        return _global_virtual_mesh
    if _global_cluster is not None:
        return _global_cluster.get_virtual_physical_mesh()
    mesh = get_global_physical_mesh()
    return VirtualPhysicalMesh(mesh.num_hosts, mesh.num_devices_per_host, mesh.cluster)


def set_global_virtual_physical_mesh(mesh: VirtualPhysicalMesh | None) -> None:
    """Make ``get_global_virtual_physical_mesh()`` return ``mesh`` (``None``: derive it
    from the cluster again), as Alpa's scripts do to run pipelines on part of a cluster."""
    global _global_virtual_mesh
    if mesh is not None and not isinstance(mesh, VirtualPhysicalMesh):
        raise TypeError(f"mesh must be a VirtualPhysicalMesh or None, got {type(mesh).__name__}")
    _global_virtual_mesh = mesh


def get_global_num_devices() -> int:
    """Devices of the cluster ``alpa.init`` connected to."""
    if _global_cluster is not None:
        return _global_cluster.num_devices
    return get_global_physical_mesh().num_devices


def global_virtual_mesh_if_set() -> VirtualPhysicalMesh | None:
    """The mesh of ``set_global_virtual_physical_mesh``, or ``None``."""
    return _global_virtual_mesh


def mesh_by_id(mesh_id: int):
    """The mesh that ``PlacementSpec.mesh_ids`` names ``mesh_id``: under ``"local"`` the
    mesh of ``init`` (id 0), under Ray a running mesh of the cluster; a ``ValueError``
    naming the id and the meshes there are, otherwise."""
    if _global_cluster is not None:
        mesh = _global_cluster.mesh_by_id(mesh_id)
        known = sorted(m.mesh_id for m in _global_cluster._meshes.values() if not m.is_shut_down)
    else:
        local = get_global_physical_mesh()
        mesh = local if mesh_id == local.mesh_id else None
        known = [local.mesh_id]
    if mesh is None:
        raise ValueError(f"no mesh has id {mesh_id!r}; the meshes of alpa.init have ids {known}")
    return mesh
