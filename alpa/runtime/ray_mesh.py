"""The Ray cluster as alpa sees it: DeviceCluster, distributed meshes (and DistributedArray).

* :class:`DeviceCluster` is built from Ray's alive nodes: a GPU node contributes its GPUs;
  a CPU-only node contributes ``num_devices_per_node`` virtual CPU devices (default
  :data:`DEFAULT_CPU_DEVICES_PER_NODE`). It slices itself into meshes.
* :class:`DistributedPhysicalDeviceMesh` is the driver's view of a mesh whose devices
  belong to :class:`~alpa.runtime.ray_worker.MeshHostWorker` actors, one per host, pinned
  to their nodes. A mesh over several hosts is one multi-controller JAX program over its
  workers.
* ``DistributedArray`` (``alpa.runtime.distributed_array``) is the driver-side handle of
  a value living on such a mesh.

Every wait on workers goes through :func:`wait_workers`, which turns a dead actor or a
worker's exception into a ``RuntimeError`` naming the mesh and host, and aborts the step on
the workers still waiting for it, so a failure never hangs the driver; a worker that does
not answer within ``global_config.ray_worker_timeout`` is a failure too.

After ``alpa.shutdown()`` (or ``mesh.shutdown()``) a mesh has no workers: every use of it,
of an executable compiled for it or of a ``DistributedArray`` that lived on it raises at
once (:func:`shut_down_error`) instead of sending nothing and waiting.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from alpa.device_mesh import (
    CLUSTER_PRESETS,
    ClusterSpec,
    PhysicalDeviceMesh,
    VirtualPhysicalMesh,
)
from alpa.global_env import global_config
from alpa.runtime.distributed_array import (  # noqa: F401 (Alpa's path of prefetch)
    DistributedArray,
    RemoteArrayRef,
    prefetch,
    shut_down_error,
)
from alpa.runtime.worker_program import DummyValue, Layout

logger = logging.getLogger("alpa")

#: Virtual CPU devices per CPU-only node when ``alpa.init`` is not told
#: ``num_devices_per_node``.
DEFAULT_CPU_DEVICES_PER_NODE = 8

#: How long the driver waits between checks of the workers of a step.
_POLL_S = 1.0


# ----------------------------------------------------------------------------- waiting


def _unfinished(calls: list[tuple[Any, str]]) -> list[tuple[Any, str]]:
    """Those of Ray calls ``[(object_ref, label), ...]`` not finished yet (without waiting)."""
    import ray

    if not calls:
        return []
    refs = [ref for ref, _ in calls]
    _, running = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
    running = set(running)
    return [(ref, label) for ref, label in calls if ref in running]


def wait_workers(calls: Sequence[tuple[Any, str]], on_failure=None) -> list[Any]:
    """The results of Ray calls ``[(object_ref, label), ...]`` in order.

    A dead worker (``ray.kill``, a crash, a lost node), an exception inside a worker or a
    worker that has not answered after ``global_config.ray_worker_timeout`` seconds
    raises ``RuntimeError`` whose message starts with the call's label (its mesh and
    host); ``on_failure(label, error)`` runs first, to abort what other workers wait for.
    """
    import ray

    label_of = {ref: label for ref, label in calls}
    pending = list(label_of)
    limit = global_config.ray_worker_timeout
    deadline = time.monotonic() + limit
    while pending:
        if time.monotonic() > deadline:
            label = label_of[pending[0]]
            error = RuntimeError(
                f"{label}: no answer within {limit:g} s (global_config.ray_worker_timeout, "
                f"environment ALPA_RAY_WORKER_TIMEOUT); {len(pending)} call(s) still pending"
            )
            if on_failure is not None:
                on_failure(label, error)
            raise error
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                error = RuntimeError(
                    f"{label_of[ref]}: the mesh worker died (killed, crashed or its node "
                    f"was lost): {e}"
                )
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                error = RuntimeError(
                    f"{label_of[ref]}: {type(cause).__name__}: {cause}\n\n"
                    f"The worker's traceback:\n{e}"
                )
            else:
                continue
            if on_failure is not None:
                on_failure(label_of[ref], error)
            raise error from None
    return ray.get([ref for ref, _ in calls])


# ----------------------------------------------------------------------------- cluster


class DeviceCluster:
    """The devices of the Ray cluster alpa is connected to (see the module docstring).

    Attributes:
      host_info: per host, Ray's node record (``NodeID``, ``NodeManagerAddress``,
        ``Resources``).
      platform: ``"gpu"`` or ``"cpu"``.
      worker_env: environment variables every mesh worker starts with (a Ray that
        ``alpa.init`` started gives them this process's ``PYTHONPATH``).
    """

    def __init__(
        self,
        num_nodes: int | None = None,
        num_devices_per_node: int | None = None,
        worker_env: dict[str, str] | None = None,
    ):
        import ray

        nodes = [n for n in ray.nodes() if n["Alive"]]
        nodes.sort(key=lambda n: ("node:__internal_head__" not in n["Resources"], n["NodeID"]))
        if num_nodes is not None:
            if not isinstance(num_nodes, int) or num_nodes < 1:
                raise ValueError(f"num_nodes must be a positive int, got {num_nodes!r}")
            if num_nodes > len(nodes):
                raise ValueError(
                    f"num_nodes={num_nodes} but the Ray cluster has {len(nodes)} alive nodes"
                )
            nodes = nodes[:num_nodes]
        gpus = [int(n["Resources"].get("GPU", 0)) for n in nodes]
        self.platform = "gpu" if all(g > 0 for g in gpus) else "cpu"
        if self.platform == "gpu":
            per_node = num_devices_per_node or min(gpus)
            if per_node > min(gpus):
                raise ValueError(
                    f"num_devices_per_node={per_node} but a node of the cluster has "
                    f"{min(gpus)} GPUs"
                )
        else:
            if any(gpus):
                logger.warning("some Ray nodes have no GPU: alpa uses CPU devices on all")
            per_node = num_devices_per_node or DEFAULT_CPU_DEVICES_PER_NODE
        if not isinstance(per_node, int) or per_node < 1:
            raise ValueError(f"num_devices_per_node must be a positive int, got {per_node!r}")
        self.host_info = [
            {k: n[k] for k in ("NodeID", "NodeManagerAddress", "Resources")} for n in nodes
        ]
        self.worker_env = dict(worker_env or {})
        self.num_devices_per_host = per_node
        self._spec = self._cluster_spec(nodes)
        self._meshes: dict[tuple, DistributedPhysicalDeviceMesh] = {}
        self._mesh_ids = itertools.count()

    def _cluster_spec(self, nodes) -> ClusterSpec:
        base = CLUSTER_PRESETS["cpu"]
        if self.platform == "gpu":
            kinds = [k for k in nodes[0]["Resources"] if k.startswith("accelerator_type:")]
            kind = kinds[0].split(":", 1)[1].lower() if kinds else ""
            base = next(
                (spec for key, spec in CLUSTER_PRESETS.items() if key.split("-")[0] in kind),
                CLUSTER_PRESETS["a100-80gb"],
            )
        return replace(base, num_nodes=len(nodes), num_devices_per_node=self.num_devices_per_host)

    @property
    def spec(self) -> ClusterSpec:
        """The cluster's hardware: its preset, with the profile
        ``global_config.cluster_profile`` names (at the time of asking) for its devices."""
        from alpa.device_mesh import resolve_profile
        from alpa.global_env import global_config

        profile = global_config.cluster_profile
        if profile is None:
            return self._spec
        kind = "cpu" if self.platform == "cpu" else self._spec.name
        return self._spec.with_profile(
            resolve_profile(
                profile, kind, self.num_hosts, self.num_devices_per_host, "cluster_profile"
            )
        )

    @property
    def num_hosts(self) -> int:
        return len(self.host_info)

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.num_devices_per_host

    def get_physical_mesh(
        self,
        host_ids: Sequence[int] | None = None,
        num_devices_per_host: int | None = None,
        first_device: int = 0,
    ) -> DistributedPhysicalDeviceMesh:
        """The mesh of hosts ``host_ids`` (default all), ``num_devices_per_host`` devices
        each (default all) from device ``first_device`` of each host on; its workers start
        on first use and are reused after. Pipeline stages that share a host take
        different ``first_device`` s, hence different workers.

        On GPUs Ray gives each worker its own GPUs; a mesh for which a host has too few
        GPUs left raises (Ray would wait for them forever)."""
        host_ids = tuple(range(self.num_hosts) if host_ids is None else host_ids)
        per_host = num_devices_per_host or self.num_devices_per_host
        if not host_ids or any(not 0 <= h < self.num_hosts for h in host_ids):
            raise ValueError(f"host_ids must be in [0, {self.num_hosts}), got {list(host_ids)}")
        if not 1 <= per_host <= self.num_devices_per_host:
            raise ValueError(
                f"num_devices_per_host must be in [1, {self.num_devices_per_host}], got {per_host}"
            )
        if not 0 <= first_device <= self.num_devices_per_host - per_host:
            raise ValueError(
                f"first_device={first_device} leaves fewer than {per_host} of the "
                f"{self.num_devices_per_host} devices of a host"
            )
        key = (host_ids, per_host, first_device)
        mesh = self._meshes.get(key)
        if mesh is None or mesh.is_shut_down:
            if self.platform == "gpu":
                self._check_free_gpus(host_ids, per_host)
            mesh = DistributedPhysicalDeviceMesh(
                self, next(self._mesh_ids), host_ids, per_host, first_device
            )
            self._meshes[key] = mesh
        return mesh

    def _check_free_gpus(self, host_ids, per_host: int) -> None:
        for host in host_ids:
            used = sum(
                m.num_devices_per_host
                for m in self._meshes.values()
                if not m.is_shut_down and host in m.host_ids
            )
            if used + per_host > self.num_devices_per_host:
                raise RuntimeError(
                    f"host {host} has {self.num_devices_per_host - used} GPUs not held by "
                    f"another mesh, a new mesh needs {per_host}: shut down the meshes you no "
                    "longer use (mesh.shutdown(), or alpa.shutdown() and alpa.init again)"
                )

    def mesh_by_id(self, mesh_id: int) -> DistributedPhysicalDeviceMesh | None:
        """The running mesh of id ``mesh_id`` (a ``PlacementSpec``'s ``mesh_ids``), or
        ``None``."""
        for mesh in self._meshes.values():
            if mesh.mesh_id == mesh_id and not mesh.is_shut_down:
                return mesh
        return None

    def get_virtual_physical_mesh(
        self, host_ids: Sequence[int] | None = None, num_devices_per_host: int | None = None
    ) -> VirtualPhysicalMesh:
        num_hosts = self.num_hosts if host_ids is None else len(host_ids)
        per_host = num_devices_per_host or self.num_devices_per_host
        spec = replace(self.spec, num_nodes=num_hosts, num_devices_per_node=per_host)
        return VirtualPhysicalMesh(num_hosts, per_host, spec)

    def shutdown(self) -> None:
        """Kill every worker of every mesh."""
        for mesh in self._meshes.values():
            mesh.shutdown()
        self._meshes.clear()

    def __repr__(self) -> str:
        return (
            f"DeviceCluster({self.num_hosts} hosts x {self.num_devices_per_host} "
            f"{self.platform} devices)"
        )


# ----------------------------------------------------------------------------- mesh


def cpu_worker_xla_flags(devices: int) -> str:
    """The ``XLA_FLAGS`` of a CPU host worker with ``devices`` virtual devices: the
    driver's own flags (its code generation, its dumps), so that a worker compiles a
    program as the driver would, with the device count replaced by the host's."""
    count = "--xla_force_host_platform_device_count"
    own = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] != count]
    return " ".join([*own, f"{count}={devices}"])


def gpu_worker_env_vars() -> dict[str, str]:
    """The environment of a GPU host worker, from Alpa's settings of ``global_config``:
    XLA's memory fraction and preallocation, its autotuning level (after the driver's own
    ``XLA_FLAGS``), and NCCL over AWS EFA when ``use_aws_efa`` is set."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if f.split("=")[0] != "--xla_gpu_autotune_level"]
    flags.append(f"--xla_gpu_autotune_level={global_config.xla_gpu_autotune_level}")
    env = {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": str(global_config.xla_client_mem_fraction),
        "XLA_PYTHON_CLIENT_PREALLOCATE": global_config.xla_client_client_preallocate,
        "XLA_FLAGS": " ".join(flags),
    }
    if global_config.use_aws_efa:
        env.update(
            {
                "FI_PROVIDER": "efa",
                "FI_EFA_USE_DEVICE_RDMA": "1",
                "LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH", ""),
                "NCCL_PROTO": "simple",
            }
        )
    return env


class DistributedPhysicalDeviceMesh(PhysicalDeviceMesh):
    """Devices of ``host_ids`` (``num_devices_per_host`` each), owned by one
    ``MeshHostWorker`` per host."""

    def __init__(
        self,
        cluster: DeviceCluster,
        mesh_id: int,
        host_ids: tuple[int, ...],
        per_host: int,
        first_device: int = 0,
    ):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from alpa.runtime.ray_worker import BOOKKEEPING, MeshHostWorker

        self.cluster = cluster
        self.mesh_id = mesh_id
        self.host_ids = host_ids
        self.num_devices_per_host = per_host
        self.first_device = first_device  # of each host's devices, where this mesh starts
        self.is_shut_down = False
        self.nccl_peers: set[int] = set()  # destination meshes with an open NCCL group
        self._pending_deletes: list[str] = []
        self._deletes_in_flight: list[tuple[Any, str]] = []  # sent, not yet known applied
        actor_class = ray.remote(concurrency_groups={BOOKKEEPING: 1})(MeshHostWorker)
        self.workers = []
        for host, host_id in enumerate(host_ids):
            info = cluster.host_info[host_id]
            options = {
                "num_cpus": 0,
                "max_concurrency": 16,
                "scheduling_strategy": NodeAffinitySchedulingStrategy(info["NodeID"], soft=False),
                "name": f"alpa_mesh{mesh_id}_host{host}_{uuid.uuid4().hex[:6]}",
            }
            if cluster.platform == "gpu":
                options["num_gpus"] = per_host
                env = gpu_worker_env_vars()
            else:
                env = {"XLA_FLAGS": cpu_worker_xla_flags(per_host), "JAX_PLATFORMS": "cpu"}
            options["runtime_env"] = {"env_vars": {**cluster.worker_env, **env}}
            self.workers.append(
                actor_class.options(**options).remote(mesh_id, host, len(host_ids), per_host)
            )
        if len(self.workers) > 1:
            ip, port = wait_workers([(self.workers[0].free_port.remote(), self.label(0))])[0]
            wait_workers(
                [
                    (w.init_distributed.remote(f"{ip}:{port}", len(self.workers), i), self.label(i))
                    for i, w in enumerate(self.workers)
                ]
            )
        self.worker_info = wait_workers(
            [(w.describe.remote(), self.label(i)) for i, w in enumerate(self.workers)]
        )
        for i, info in enumerate(self.worker_info):
            if info["num_local_devices"] != per_host:
                raise RuntimeError(
                    f"{self.label(i)} sees {info['num_local_devices']} devices, expected {per_host}"
                )

    def label(self, host: int) -> str:
        node = self.cluster.host_info[self.host_ids[host]]
        return (
            f"mesh {self.mesh_id} host {host} (node {node['NodeManagerAddress']} "
            f"{node['NodeID'][:8]})"
        )

    @property
    def num_hosts(self) -> int:
        return len(self.host_ids)

    @property
    def host_info(self) -> list[dict]:
        return [self.cluster.host_info[h] for h in self.host_ids]

    def slice_2d(
        self, host_indices: Sequence[int], device_indices: Sequence[Sequence[int]]
    ) -> DistributedPhysicalDeviceMesh:
        """The mesh of the same contiguous devices on hosts ``host_indices`` (of this
        mesh), with its own workers."""
        first = list(device_indices[0]) if device_indices else []
        contiguous = first == list(range(first[0], first[0] + len(first))) if first else False
        if (
            len(device_indices) != len(host_indices)
            or not contiguous
            or any(list(d) != first for d in device_indices)
        ):
            raise ValueError(
                "a distributed mesh slices into the same contiguous devices on each host, "
                f"got device_indices={[list(d) for d in device_indices]}"
            )
        hosts = tuple(self.host_ids[h] for h in host_indices)
        return self.cluster.get_physical_mesh(hosts, len(first), self.first_device + first[0])

    @property
    def spec(self) -> ClusterSpec:
        return replace(
            self.cluster.spec,
            num_nodes=self.num_hosts,
            num_devices_per_node=self.num_devices_per_host,
        )

    def call(self, method: str, *args, on_failure=None) -> list[Any]:
        """Call ``method`` on every worker and wait for all of them."""
        self._check_alive()
        return wait_workers(
            [(getattr(w, method).remote(*args), self.label(i)) for i, w in enumerate(self.workers)],
            on_failure,
        )

    def put(self, value: Any, layout: Layout) -> DistributedArray:
        """A host array (or a ``DummyValue``, which the workers fill) placed on this mesh
        as ``layout`` (a ``Layout`` whose logical shape has this mesh's number of
        devices)."""
        if not isinstance(value, DummyValue):
            value = np.asarray(value)
        if math.prod(layout.mesh_shape) != self.num_devices:
            raise ValueError(
                f"layout mesh_shape {layout.mesh_shape} has {math.prod(layout.mesh_shape)} "
                f"devices, mesh {self.mesh_id} has {self.num_devices}"
            )
        name = uuid.uuid4().hex
        self.call("put", [name], [value], [layout])
        return DistributedArray(self, name, value.shape, value.dtype, layout)

    def tile_placement(self, mesh_shape, axis_names, partition_spec) -> tuple:
        return self, Layout(tuple(mesh_shape), tuple(axis_names), partition_spec)

    def put_tiled(self, value: Any, mesh_shape, axis_names, partition_spec) -> DistributedArray:
        _, layout = self.tile_placement(mesh_shape, axis_names, partition_spec)
        return self.put(np.asarray(value), layout)

    def get_remote_buffers(
        self, ary_refs: Any, host_local_ids: Any = None, batching: bool = False
    ) -> list:
        """Alpa's: for a ``RemoteArrayRef`` (``x.remote_ref``), every device's block of
        its buffer as a numpy array, in the mesh's device order (host by host; replicas
        included); for a list of them, a list of such lists. ``host_local_ids`` (a
        subset of ``(host, local device)`` pairs per ref) and ``batching`` (one call per
        host, as every fetch here is) are accepted as in Alpa."""
        single = not isinstance(ary_refs, list | tuple)
        refs = [ary_refs] if single else list(ary_refs)
        wanted = [None] * len(refs) if host_local_ids is None else host_local_ids
        if single and host_local_ids is not None:
            wanted = [host_local_ids]
        out = []
        for ref, ids in zip(refs, wanted, strict=True):
            if getattr(ref, "device_mesh", self) is not self:
                raise ValueError(f"{ref!r} lives on another mesh than mesh {self.mesh_id}")
            per_host = self.call("device_buffers", ref.uuid)
            if ids is None:
                out.append([b for host in per_host for b in host])
            else:
                out.append([per_host[h][d] for h, d in ids])
        del batching
        return out[0] if single else out

    def sync_move_workers(self) -> None:
        """Alpa's: wait for the shards ``DistributedArray.save`` left to move from a local
        cache. Saves here write straight to their folder and are done when they return,
        so there is nothing to wait for."""
        self._check_alive()

    def get_live_buffer_uuids(self) -> list[list[str]]:
        """Per host, the names of the buffers its worker holds (after the deletes sent so
        far, which are applied first)."""
        self.flush_deletes(wait=True)
        return self.call("get_live_buffer_uuids")

    def schedule_delete(self, name: str) -> None:
        """Forget buffer ``name`` on the workers (batched with the next ones)."""
        if self.is_shut_down:
            return
        self._pending_deletes.append(name)
        if len(self._pending_deletes) >= global_config.delete_remote_arrays_threshold:
            self.flush_deletes()

    def flush_deletes(self, wait: bool = False) -> None:
        """Send the pending deletes; with ``wait``, until the workers have applied them
        and every delete sent before (a threaded worker may run calls out of order)."""
        if self.is_shut_down:
            return
        if self._pending_deletes:
            names, self._pending_deletes = self._pending_deletes, []
            sent = [(w.delete.remote(names), self.label(h)) for h, w in enumerate(self.workers)]
            self._deletes_in_flight = _unfinished(self._deletes_in_flight) + sent
        if wait and self._deletes_in_flight:
            sent, self._deletes_in_flight = self._deletes_in_flight, []
            wait_workers(sent)

    def _check_alive(self) -> None:
        if self.is_shut_down:
            raise shut_down_error(f"mesh {self.mesh_id}", self)

    # Alpa's memory statistics (alpa.device_memory, on each worker) and synchronization.

    def sync_workers(self) -> None:
        """Wait until every computation launched on the mesh has finished and every
        delete sent to it has been applied (so the memory statistics read after it
        count neither a freed buffer nor one still being computed)."""
        self.flush_deletes(wait=True)
        self.call("sync")

    def get_memory_allocated(self) -> int:
        return max(self.call("memory_allocated"))

    def get_max_memory_allocated(self) -> int:
        return max(self.call("max_memory_allocated"))

    def reset_memory_stats(self) -> None:
        self.call("reset_memory_stats")

    def shutdown(self) -> None:
        import ray

        if self.is_shut_down:
            return
        self.is_shut_down = True
        for w in self.workers:
            ray.kill(w)
        self.workers = []

    def __repr__(self) -> str:
        return (
            f"DistributedPhysicalDeviceMesh(mesh {self.mesh_id}: {self.num_hosts} hosts x "
            f"{self.num_devices_per_host} {self.cluster.platform} devices)"
        )
