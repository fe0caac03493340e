"""Where a step's leaves live: a :class:`PlacementSpec` per leaf, and putting an array
there (locally a ``jax.sharding.Sharding``, on Ray a mesh and a ``Layout``); a leaf whose
rows live on several meshes is a :class:`StackedRows`. Used by the executables and by
the local runtime."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np


@dataclass(frozen=True)
class PlacementSpec:
    """Where one leaf lives: its abstract value, the meshes and the sharding on each.

    Attributes:
      aval: the leaf's abstract value (full batch).
      mesh_ids: the meshes that hold it (index of the stage mesh; a Ray mesh's id).
      sharding_specs: per mesh, its ``PartitionSpec`` over that mesh's logical axes.
      placements: per mesh, what puts a value there: a ``jax.sharding.Sharding`` on the
        local runtime, a ``(DistributedPhysicalDeviceMesh, Layout)`` pair on Ray. Empty
        for an output that no mesh holds (a value computed on the driver).
      rows: for a leaf a pipeline splits into its rows (``stacked_rows``), the
        ``PlacementSpec`` of each row: :func:`place` puts each row where its stage reads
        it (a :class:`StackedRows`). The fields above place the whole array on the
        first row's mesh (what reads only one placement, a ``FollowParallel``, uses).
    """

    aval: Any
    mesh_ids: tuple[int, ...]
    sharding_specs: tuple[Any, ...]
    placements: tuple[Any, ...] = field(default=(), compare=False)
    rows: tuple = field(default=(), compare=False)


def place(value: Any, spec: PlacementSpec) -> Any:
    """``value`` (a host or device array) placed where ``spec`` says the step reads it: on
    its first mesh, which is where the executable takes it from (a leaf read by several
    stages is copied to the others by the step). Local: a ``jax.Array`` in the planned
    sharding (not copied when it already is, :func:`is_placed`); Ray: a
    ``DistributedArray`` on the mesh's workers."""
    if not spec.placements:
        raise ValueError(f"no mesh holds a leaf of {spec.aval}: there is nowhere to place it")
    if spec.rows:  # each row on its own stage's mesh
        if isinstance(value, StackedRows) and len(value.rows) == len(spec.rows):
            rows = value.rows
        else:
            rows = [value[i] for i in range(len(spec.rows))]
        return StackedRows([place(x, s) for x, s in zip(rows, spec.rows, strict=True)])
    target = spec.placements[0]
    value = whole(value)
    if isinstance(target, tuple):  # Ray: (mesh, Layout)
        mesh, layout = target
        if getattr(value, "is_distributed_array", False) and value.mesh is mesh:
            if value.layout == layout:
                return value
        return mesh.put(np.asarray(value), layout)
    if is_placed(value, target):
        return value
    return jax.device_put(value, target)


def whole(x: Any) -> Any:
    """``x``, or, for a :class:`StackedRows` (rows on several meshes), its rows put
    together on the host: what a program of one mesh reads it as."""
    return np.asarray(x) if isinstance(x, StackedRows) else x


def is_placed(x: Any, sharding: Any) -> bool:
    """Whether ``x`` is an array already laid out as ``sharding`` asks: the same sharding,
    or an equivalent one (``P()`` and ``P(None, None)``; a 1-device mesh and that device).
    Such an input is used as it is, never copied."""
    if not isinstance(x, jax.Array):
        return False
    current = x.sharding
    return current == sharding or current.is_equivalent_to(sharding, x.ndim)


def leaf_placer(shardings: Sequence[Any]) -> Callable[[list], list]:
    """``place(leaves)``: each leaf in its sharding (``leaves[i]`` in ``shardings[i]``),
    moved with ``jax.device_put`` only when it is not already placed (:func:`is_placed`).
    The sharding an array was last accepted in is remembered per position, so a leaf that
    keeps arriving the same way costs an identity check."""
    accepted: list[Any] = [None] * len(shardings)

    def place(leaves: list) -> list:
        for i, (x, sharding) in enumerate(zip(leaves, shardings, strict=True)):
            if isinstance(x, jax.Array) and x.sharding is accepted[i]:
                continue
            x = leaves[i] = whole(x)
            if is_placed(x, sharding):
                accepted[i] = x.sharding
            else:
                leaves[i] = jax.device_put(x, sharding)
        return leaves

    return place


class StackedRows:
    """A stacked array (``[L, ...]``) held as its rows (``[...]`` each), each on the
    mesh of the pipeline stage that reads it: what a pipelined step returns for a stacked
    parameter it split by rows (``pipeline_parallel.stacked_rows``). Pass it back to the step and
    each row stays where it is; read it (``np.asarray``, ``jnp.asarray``, indexing) and
    the rows are put together (on the host)."""

    is_stacked_rows = True

    def __init__(self, rows: Sequence[Any]):
        if not rows:
            raise ValueError("StackedRows needs at least one row")
        self.rows = list(rows)
        first = self.rows[0]
        self.dtype = first.dtype
        self.shape = (len(self.rows), *first.shape)
        self.weak_type = bool(getattr(first, "weak_type", False))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None):
        del copy
        out = np.stack([np.asarray(r) for r in self.rows])
        return out if dtype is None else out.astype(dtype)

    def __jax_array__(self):
        # ``jnp.asarray(x)``: the rows are on several meshes, put together on the host.
        return jax.numpy.asarray(np.asarray(self))

    def __getitem__(self, index):
        return np.asarray(self)[index]

    def block_until_ready(self):
        for r in self.rows:
            jax.block_until_ready(r)
        return self

    def is_deleted(self) -> bool:
        return any(getattr(r, "is_deleted", lambda: False)() for r in self.rows)

    def delete(self) -> None:
        for r in self.rows:
            if hasattr(r, "delete"):
                r.delete()

    def __repr__(self) -> str:
        return f"StackedRows(shape={self.shape}, dtype={self.dtype}, rows={len(self.rows)})"
