"""RayStepLauncher: the driver's side of a step on Ray mesh workers.

An executable compiled for Ray (one mesh for ShardParallel, one per stage for pipeshard)
hands the launcher one :class:`~alpa.runtime.worker_program.WorkerProgram` per mesh. The
launcher ships each program to its mesh's workers once, where it is compiled; a step is
then one ``run_step`` message per worker:

* the step's arguments each mesh reads: the name of a buffer the mesh holds (a
  ``DistributedArray`` from an earlier step, used in place), or a host array (put into
  Ray's object store once when it is large, so each node pulls it once);
* fresh names for the program's outputs, which come back as ``DistributedArray`` s;
* the names of donated inputs, which the workers drop.

A ``DistributedArray`` that lives on another mesh than the one reading it moves there
worker to worker first (``send_buffer`` / ``recv_buffer`` with the tile plan the launcher
asks the one tile planner for, ``resharding.worker_transfer_plan``), never through the
driver. ``bytes_sent_last_step`` counts what the driver sent: the host
arrays' bytes and the pickled messages.

If any worker fails, the others are told to abort the step, and the failure surfaces as
a ``RuntimeError`` naming the mesh and host (``ray_mesh.wait_workers``).
"""

from __future__ import annotations

import itertools
import pickle
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from alpa.runtime.placement import check_dummy_allowed, is_abstract
from alpa.runtime.ray_mesh import (
    DistributedArray,
    DistributedPhysicalDeviceMesh,
    shut_down_error,
    wait_workers,
)
from alpa.runtime.remote_arrays import ReplicatedDistributedArray
from alpa.runtime.resharding import worker_transfer_plan
from alpa.runtime.worker_program import DummyValue, Layout, WorkerOp, WorkerProgram

_program_ids = itertools.count()
_step_ids = itertools.count()

#: Host arrays at least this large go through Ray's object store (one copy per node);
#: smaller ones travel inside the message.
_PUT_THRESHOLD = 1 << 20


@dataclass(frozen=True)
class MeshOutput:
    """An output of a mesh's program, as the driver describes it."""

    shape: tuple[int, ...]
    dtype: Any
    weak_type: bool
    layout: Layout | None  # None: as the worker compiled output k of the program's fns[0]


class RayStepLauncher:
    """See the module docstring.

    Args:
      meshes: the meshes, one per program.
      programs: per mesh, its program.
      mesh_args: per mesh, ``(leaf, layout)`` for each step argument its program reads,
        in the order of the program's ``arg`` indices.
      mesh_outputs: per mesh, a :class:`MeshOutput` per program output.
      donated_leaves: step arguments whose buffers the step consumes.
    """

    def __init__(
        self,
        meshes: Sequence[DistributedPhysicalDeviceMesh],
        programs: Sequence[WorkerProgram],
        mesh_args: Sequence[Sequence[tuple[int, Layout]]],
        mesh_outputs: Sequence[Sequence[MeshOutput]],
        donated_leaves: frozenset[int],
    ):
        self.meshes = list(meshes)
        self.mesh_args = [list(a) for a in mesh_args]
        self.donated_leaves = donated_leaves
        self.program_id = next(_program_ids)
        self.bytes_sent_last_step = 0
        self.last_step_seconds: list[float] = []
        #: Per step run, per mesh, the seconds its slowest worker spent in the step.
        self.mesh_step_seconds: list[list[float]] = []
        peers = {(m.mesh_id, h): w for m in self.meshes for h, w in enumerate(m.workers)}
        calls = []  # (ref, label, mesh index)
        for i, (mesh, program) in enumerate(zip(self.meshes, programs, strict=True)):
            for host, worker in enumerate(mesh.workers):
                ref = worker.load_program.remote(self.program_id, program, peers)
                calls.append((ref, mesh.label(host), i))
        results = wait_workers([(ref, label) for ref, label, _ in calls])
        by_id = {m.mesh_id: m for m in self.meshes}
        for i, program in enumerate(programs):
            for peer in {ins.peer_mesh for ins in program.instructions if ins.op is WorkerOp.SEND}:
                ensure_nccl_group(self.meshes[i], by_id[peer])
        # Every worker of a mesh compiled the same programs; read each mesh's first report.
        reported = {}
        for (_, _, i), specs in zip(calls, results, strict=True):
            reported.setdefault(i, specs)
        self.mesh_outputs = [
            [
                out if out.layout is not None else replace(out, layout=reported[i][0][k])
                for k, out in enumerate(outputs)
            ]
            for i, outputs in enumerate(mesh_outputs)
        ]

    def launch(self, flat_args: Sequence[Any]) -> list[list[DistributedArray]]:
        """Run one step; per mesh, its outputs."""
        for mesh in self.meshes:  # a mesh with no workers would run nothing, silently
            if mesh.is_shut_down:
                raise shut_down_error("this parallelized function (compiled for it)", mesh)
        step_id = next(_step_ids)
        self._moved: list[DistributedArray] = []
        refs: dict[int, Any] = {}
        sent = 0
        calls = []
        outputs: list[list[DistributedArray]] = []
        consumed_arrays = []
        for i, mesh in enumerate(self.meshes):
            args = []
            consumed = []
            for leaf, layout in self.mesh_args[i]:
                x = flat_args[leaf]
                if isinstance(x, ReplicatedDistributedArray):  # the replica on this mesh
                    on = x.is_replicated_on_mesh(mesh)
                    x = x.get_replica_on_mesh(mesh) if on else x.replica
                if isinstance(x, DistributedArray) and x.mesh.is_shut_down:
                    if x._fetched is None:
                        x._check()  # raises: its data went with its mesh
                    x = x._fetched  # fetched before the shutdown: a host array now
                if isinstance(x, DistributedArray):
                    x._check()
                    if x.mesh is not mesh:
                        args.append(self._move(x, mesh, layout))
                        continue
                    args.append(x.name)
                    if leaf in self.donated_leaves:
                        consumed.append(x.name)
                        consumed_arrays.append(x)
                    continue
                if leaf not in refs and is_abstract(x):
                    refs[leaf] = _dummy(x)
                elif leaf not in refs:
                    value = np.asarray(x)
                    if value.nbytes >= _PUT_THRESHOLD:
                        import ray

                        refs[leaf] = ray.put(value)
                        sent += value.nbytes
                    else:
                        refs[leaf] = value
                args.append(refs[leaf])
            names = [uuid.uuid4().hex for _ in self.mesh_outputs[i]]
            outputs.append(
                [
                    DistributedArray(mesh, name, out.shape, out.dtype, out.layout, out.weak_type)
                    for name, out in zip(names, self.mesh_outputs[i], strict=True)
                ]
            )
            for host, worker in enumerate(mesh.workers):
                small = [a if isinstance(a, str | np.ndarray) else None for a in args]
                sent += len(pickle.dumps((self.program_id, step_id, names, consumed, small)))
                calls.append(
                    (
                        worker.run_step.remote(self.program_id, step_id, names, consumed, *args),
                        mesh.label(host),
                    )
                )
        for x in consumed_arrays:
            x._mark_donated()

        def abort(label, error):
            for mesh in self.meshes:
                for worker in mesh.workers:
                    worker.abort.remote(step_id, f"{label} failed: {error}")

        try:
            self.last_step_seconds = wait_workers(calls, on_failure=abort)
            seconds = iter(self.last_step_seconds)
            self.mesh_step_seconds.append(
                [max(next(seconds) for _ in mesh.workers) for mesh in self.meshes]
            )
        except RuntimeError:
            for out in outputs:  # the workers that finished the step hold these: free them
                for x in out:
                    x.delete()
            raise
        self.bytes_sent_last_step = sent
        self._moved = []
        for mesh in self.meshes:
            mesh.flush_deletes()  # after the step: a threaded worker may reorder calls
        return outputs

    def _move(self, x: DistributedArray, mesh: DistributedPhysicalDeviceMesh, layout: Layout):
        """Copy ``x`` onto ``mesh`` worker to worker; the name of the copy there (freed
        once the step that reads it is done and the copy is collected)."""
        copy = reshard_array(x, mesh, layout)
        self._moved.append(copy)
        return copy.name

    def unload(self) -> None:
        for mesh in self.meshes:
            if not mesh.is_shut_down:
                for worker in mesh.workers:
                    worker.unload_program.remote(self.program_id)


def _dummy(x: Any) -> DummyValue:
    """What the workers fill with dummy values for an abstract argument, if allowed."""
    check_dummy_allowed(x)
    return DummyValue(tuple(x.shape), np.dtype(x.dtype))


def reshard_array(
    x: DistributedArray, mesh: DistributedPhysicalDeviceMesh, layout: Layout
) -> DistributedArray:
    """``x`` copied onto ``mesh`` as ``layout``, worker to worker by the tile plan
    (``resharding.worker_transfer_plan``: each piece once per destination host; never
    through the driver)."""
    x._check()
    mesh._check_alive()
    plan = worker_transfer_plan(
        x.shape, x.dtype, x.layout, x.mesh.num_devices_per_host, layout, mesh.num_devices_per_host
    )
    ensure_nccl_group(x.mesh, mesh)
    tag = ("move", uuid.uuid4().hex)
    name = uuid.uuid4().hex
    calls = [
        (w.send_buffer.remote(x.name, plan, tag, mesh.mesh_id, mesh.workers), x.mesh.label(h))
        for h, w in enumerate(x.mesh.workers)
    ]
    calls += [
        (w.recv_buffer.remote(name, plan, tag, x.mesh.mesh_id), mesh.label(h))
        for h, w in enumerate(mesh.workers)
    ]
    wait_workers(calls)
    return DistributedArray(mesh, name, x.shape, x.dtype, layout, x.weak_type)


def ensure_nccl_group(
    src: DistributedPhysicalDeviceMesh, dst: DistributedPhysicalDeviceMesh
) -> bool:
    """Open the NCCL group of the mesh pair ``src -> dst`` once, when every worker of both
    meshes has NCCL (cupy and GPUs); then values from ``src`` to ``dst`` travel by NCCL
    send/recv between device buffers instead of through Ray. Whether the group is open."""
    if dst.mesh_id in src.nccl_peers:
        return True
    if not all(info.get("nccl") for info in src.worker_info + dst.worker_info):
        return False
    unique_id = wait_workers([(src.workers[0].nccl_unique_id.remote(), src.label(0))])[0]
    key = (src.mesh_id, dst.mesh_id, unique_id, src.shape, dst.shape)
    calls = [
        (w.init_nccl_group.remote(*key, h, None), src.label(h)) for h, w in enumerate(src.workers)
    ]
    calls += [
        (w.init_nccl_group.remote(*key, None, h), dst.label(h)) for h, w in enumerate(dst.workers)
    ]
    wait_workers(calls)
    src.nccl_peers.add(dst.mesh_id)
    return True
