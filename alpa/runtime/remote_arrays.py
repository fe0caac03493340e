"""Arrays a program loads onto the mesh workers itself, shard by shard: Alpa's weight loading.

Alpa's OPT serving loads its weights without passing them through the driver: for each
parameter it reserves a buffer name on the mesh that reads it
(:func:`create_remote_array_refs`), makes the driver's handle of the array to come
(``DistributedArray(mesh, aval, sharding_spec, remote_ref, indices)``, where ``indices``
are the slices each device holds), and runs a function on every mesh worker that reads
its devices' slices from disk and hands them over with ``worker.put_buffers(uuid,
datas)``, one array per local device. A parameter that several meshes read is a
:class:`ReplicatedDistributedArray`, one such array per mesh; a step reads the replica on
its own mesh.

Here the handle tells the workers what to expect (``expect_buffers``: the layout, shape
and dtype) when it is made, and each worker builds the array of the buffer once both the
expectation and its shards have arrived, in whichever order (a worker runs calls on
several threads). The layout is the handle's sharding spec when that is a
``worker_program.Layout``; for jax 0.3's ``ShardingSpec`` (``alpa.pxla_spec``) the mesh
view it describes; for a ``PartitionSpec`` (a ``PlacementSpec``'s ``sharding_specs``) the
logical view of the mesh on which it puts exactly ``indices`` on each device
(``Layout.shard_indices``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from alpa.runtime.worker_program import Layout

#: The axis names of a mesh's logical views (``alpa.device_mesh.MESH_AXIS_NAMES``).
_AXES = ("x", "y")
_counter = itertools.count()


@dataclass(frozen=True)
class RemoteArrayRef:
    """Alpa's handle of a buffer on a mesh's workers: its mesh and name (``uuid``)."""

    device_mesh: Any
    uuid: str


def create_remote_array_refs(device_mesh: Any, number: int = 1) -> tuple[list, list[str]]:
    """``number`` buffer names reserved on ``device_mesh``: ``(refs, uuids)``, as Alpa's;
    a worker stores a buffer under ``uuid`` with ``put_buffers(uuid, datas)``."""
    uuids = [f"remote-{next(_counter)}" for _ in range(number)]
    return [RemoteArrayRef(device_mesh, u) for u in uuids], uuids


def _normalized(indices: Sequence[Sequence[slice]], shape: Sequence[int]) -> list[tuple]:
    return [tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True)) for index in indices]


def layout_of(num_devices: int, spec: Any, shape: Sequence[int], indices: Any) -> Layout:
    """The logical view of a mesh of ``num_devices`` on which ``spec`` gives each device
    the slice ``indices`` lists (the first such view, ``(1, n)`` first; with no
    ``indices``, ``(1, n)``)."""
    if isinstance(spec, Layout):
        return spec
    from alpa.pxla_spec import is_sharding_spec, tile_layout

    if is_sharding_spec(spec):  # jax 0.3's, as Alpa's programs build them
        aval = SimpleNamespace(shape=tuple(shape))
        checked = None if indices is None else list(indices)
        mesh_shape, names, partition = tile_layout(aval, checked, spec, num_devices)
        return Layout(tuple(mesh_shape), tuple(names), partition)
    views = [(a, num_devices // a) for a in range(1, num_devices + 1) if num_devices % a == 0]
    views = [views[0], *reversed(views[1:])]  # (1, n), then (n, 1), ...
    if indices is None:
        return Layout(views[0], _AXES, spec)
    wanted = _normalized(indices, shape)
    for view in views:
        layout = Layout(view, _AXES, spec)
        if _normalized(layout.shard_indices(tuple(shape)), shape) == wanted:
            return layout
    raise ValueError(
        f"sharding spec {spec} puts no logical view of the {num_devices} devices' slices of "
        f"shape {tuple(shape)} where indices says (device 0: {wanted[0] if wanted else None})"
    )


def alpa_array_args(mesh: Any, aval: Any, spec: Any, ref: RemoteArrayRef, indices: Any):
    """``(name, shape, dtype, layout)`` of Alpa's ``DistributedArray(mesh, aval,
    sharding_spec, remote_ref, indices)``; the mesh's workers are told to expect it."""
    if not isinstance(ref, RemoteArrayRef):
        raise TypeError(
            "DistributedArray(mesh, aval, sharding_spec, remote_ref, indices): remote_ref "
            f"must come from create_remote_array_refs(mesh), got {type(ref).__name__}"
        )
    if ref.device_mesh is not mesh:
        raise ValueError("remote_ref was reserved on another mesh than the array's")
    shape, dtype = tuple(aval.shape), np.dtype(aval.dtype)
    layout = layout_of(mesh.num_devices, spec, shape, indices)
    mesh.call("expect_buffers", [ref.uuid], [layout], [shape], [dtype])
    return ref.uuid, shape, dtype, layout


class ReplicatedDistributedArray:
    """One array held on several meshes (a ``DistributedArray`` on each): what a
    pipeline's stages on different meshes all read, such as a tied embedding. A step
    reads the replica on its own mesh."""

    #: Read by ``alpa.tracing.abstractify`` and ``alpa.api``, as a DistributedArray's.
    is_distributed_array = True

    def __init__(self, device_meshes: Sequence[Any], arrays: Sequence[Any]):
        if len(device_meshes) != len(arrays) or not arrays:
            raise ValueError(
                f"ReplicatedDistributedArray needs one array per mesh, got {len(device_meshes)} "
                f"meshes and {len(arrays)} arrays"
            )
        self._by_mesh: dict[int, Any] = {}
        for mesh, array in zip(device_meshes, arrays, strict=True):
            self.add_replica(mesh, array)

    @property
    def replica(self) -> Any:
        """The first replica."""
        return next(iter(self._by_mesh.values()))

    def is_replicated_on_mesh(self, mesh: Any) -> bool:
        return id(mesh) in self._by_mesh

    def get_replica_on_mesh(self, mesh: Any) -> Any:
        if not self.is_replicated_on_mesh(mesh):
            raise RuntimeError(f"no replica of this array on {mesh}")
        return self._by_mesh[id(mesh)]

    def add_replica(self, mesh: Any, array: Any) -> None:
        if array.mesh is not mesh:
            raise ValueError(f"the array lives on mesh {array.mesh.mesh_id}, not on {mesh}")
        if self.is_replicated_on_mesh(mesh):
            raise RuntimeError(f"a replica on mesh {mesh.mesh_id} exists already")
        if self._by_mesh and (array.shape, array.dtype) != (self.shape, self.dtype):
            raise ValueError(
                f"a replica of shape {array.shape} {array.dtype} for an array of "
                f"{self.shape} {self.dtype}"
            )
        self._by_mesh[id(mesh)] = array

    shape = property(lambda self: self.replica.shape)
    dtype = property(lambda self: self.replica.dtype)
    weak_type = property(lambda self: self.replica.weak_type)
    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: math.prod(self.shape))

    @property
    def _value(self) -> np.ndarray:
        return self.replica._value

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self._value, dtype=dtype)

    def __repr__(self) -> str:
        meshes = [a.mesh.mesh_id for a in self._by_mesh.values()]
        return (
            f"ReplicatedDistributedArray(shape={self.shape}, dtype={self.dtype}, meshes={meshes})"
        )
