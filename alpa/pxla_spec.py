"""Alpa's ``ShardingSpec``: jax 0.3's description of an array tiled over a device mesh.

jax 0.3 (``jax.interpreters.pxla``) described how an array lies on a mesh with two lists:

* ``sharding``, one entry per array dimension: ``NoSharding()`` (whole), or
  ``Chunked(chunks)`` (cut into ``prod(chunks)`` blocks along it, by one mesh axis per
  chunk count, the first the major one);
* ``mesh_mapping``, one entry per mesh axis, in the mesh's order: ``ShardedAxis(k)`` (the
  axis cuts by chunk count ``k`` of all the dimensions' chunk counts, numbered in
  dimension order) or ``Replicated(n)`` (the ``n`` devices along it hold the same block).

So ``ShardingSpec((Chunked([2]), NoSharding()), (ShardedAxis(0), Replicated(4)))`` is a
matrix whose rows are halved over a mesh ``(2, 4)``'s first axis and replicated over its
second: ``PartitionSpec("x", None)`` on that mesh, which is what this alpa places arrays
with (:func:`to_partition_spec`). ``ShardingSpec.indices(shape)`` gives, per device of the
mesh (an array of the mesh's shape), the index of the block it holds, as jax 0.3 did.

Alpa's programs build these (``LogicalDeviceMesh.make_tile_spec``), hand them to
``shard_args_to_arrays`` and ``DistributedArray.load``, and put them in the
``PlacementSpec`` s they give ``MeshDriverDataLoader``. JAX 0.10 removed the classes; they
are re-created here. A spec made elsewhere (by Alpa's own classes, or a copy of them) is
read by its fields' names, so either kind works wherever alpa takes one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: The names of a mapping's mesh axes: ``x``, ``y`` (a logical mesh's), then more.
AXIS_NAMES = ("x", "y", "z", "w")


@dataclass(frozen=True)
class NoSharding:
    """The dimension is whole on every device."""


@dataclass(frozen=True)
class Chunked:
    """The dimension is cut into ``prod(chunks)`` blocks, one mesh axis per entry."""

    chunks: tuple[int, ...]

    def __init__(self, chunks: Sequence[int]):
        object.__setattr__(self, "chunks", tuple(int(c) for c in chunks))


@dataclass(frozen=True)
class ShardedAxis:
    """The mesh axis cuts by chunk count ``axis`` (numbered over all dimensions)."""

    axis: int


@dataclass(frozen=True)
class Replicated:
    """The ``replicas`` devices along the mesh axis hold the same block."""

    replicas: int


@dataclass(frozen=True)
class ShardingSpec:
    """jax 0.3's ``pxla.ShardingSpec`` (module docstring)."""

    sharding: tuple[Any, ...]
    mesh_mapping: tuple[Any, ...]

    def __init__(self, sharding: Sequence[Any], mesh_mapping: Sequence[Any]):
        object.__setattr__(self, "sharding", tuple(sharding))
        object.__setattr__(self, "mesh_mapping", tuple(mesh_mapping))

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return read_spec(self)[0]

    def indices(self, shape: Sequence[int]) -> np.ndarray:
        """Per device of the mesh (an object array of the mesh's shape, row-major device
        order), the tuple of slices of the block it holds, as jax 0.3's ``indices``."""
        return spec_indices(self, shape)


# ----------------------------------------------------------------------------- reading


def _chunks(entry: Any) -> tuple[int, ...]:
    """A ``sharding`` entry's chunk counts (``()`` for a whole dimension)."""
    chunks = getattr(entry, "chunks", None)
    return () if chunks is None else tuple(int(c) for c in chunks)


def _axis(entry: Any) -> tuple[str, int]:
    """A ``mesh_mapping`` entry as ``("sharded", chunk index)`` or ``("replicated", n)``."""
    if hasattr(entry, "axis"):
        return "sharded", int(entry.axis)
    if hasattr(entry, "replicas"):
        return "replicated", int(entry.replicas)
    raise ValueError(
        f"a ShardingSpec's mesh_mapping holds ShardedAxis or Replicated, got {entry!r}"
    )


def is_sharding_spec(spec: Any) -> bool:
    """Whether ``spec`` is a jax-0.3 ``ShardingSpec`` (this module's, or one with its
    fields)."""
    return hasattr(spec, "sharding") and hasattr(spec, "mesh_mapping")


def read_spec(spec: Any) -> tuple[tuple[int, ...], list[list[int]]]:
    """``(mesh_shape, axes)``: the mesh's shape, and per array dimension the mesh axes
    that cut it, major first. Raises ``ValueError`` for a spec whose chunks are not each
    taken by exactly one mesh axis."""
    chunks = [(dim, c) for dim, entry in enumerate(spec.sharding) for c in _chunks(entry)]
    taken: dict[int, int] = {}
    mesh_shape = []
    for mesh_axis, entry in enumerate(spec.mesh_mapping):
        kind, value = _axis(entry)
        if kind == "replicated":
            mesh_shape.append(value)
            continue
        if not 0 <= value < len(chunks) or value in taken:
            raise ValueError(
                f"{spec!r}: ShardedAxis({value}) must name each of the {len(chunks)} chunk "
                "counts of its dimensions once"
            )
        taken[value] = mesh_axis
        mesh_shape.append(chunks[value][1])
    if len(taken) != len(chunks):
        raise ValueError(f"{spec!r}: {len(chunks) - len(taken)} chunk count(s) have no mesh axis")
    axes: list[list[int]] = [[] for _ in spec.sharding]
    for k in sorted(taken):
        axes[chunks[k][0]].append(taken[k])
    return tuple(mesh_shape), axes


def axis_names(num_axes: int) -> tuple[str, ...]:
    if num_axes > len(AXIS_NAMES):
        raise ValueError(f"a mesh of {num_axes} axes: at most {len(AXIS_NAMES)} are supported")
    return AXIS_NAMES[:num_axes]


def to_partition_spec(spec: Any) -> tuple[tuple[int, ...], tuple[str, ...], Any]:
    """``(mesh_shape, axis_names, PartitionSpec)`` of a jax-0.3 ``ShardingSpec``: the
    same blocks on the same devices of a mesh of that shape (devices in row-major order)."""
    from jax.sharding import PartitionSpec

    mesh_shape, axes = read_spec(spec)
    names = axis_names(len(mesh_shape))
    entries = []
    for dim_axes in axes:
        picked = tuple(names[a] for a in dim_axes)
        entries.append(None if not picked else picked[0] if len(picked) == 1 else picked)
    return mesh_shape, names, PartitionSpec(*entries)


def spec_indices(spec: Any, shape: Sequence[int]) -> np.ndarray:
    """jax 0.3's ``ShardingSpec.indices`` (see :meth:`ShardingSpec.indices`)."""
    shape = tuple(shape)
    if len(shape) != len(spec.sharding):
        raise ValueError(
            f"{spec!r} describes {len(spec.sharding)} dimensions, the array has shape {shape}"
        )
    per_dim, grid = [], []
    for size, entry in zip(shape, spec.sharding, strict=True):
        chunks = _chunks(entry)
        blocks = math.prod(chunks)
        if size % blocks:
            raise ValueError(f"dimension of size {size} does not split into {blocks} blocks")
        step = size // blocks
        per_dim.append(
            [slice(i * step, (i + 1) * step) for i in range(blocks)] if chunks else [slice(None)]
        )
        grid.extend(chunks)
    blocks = np.empty(math.prod(grid), dtype=object)
    for i, index in enumerate(itertools.product(*per_dim)):
        blocks[i] = index
    blocks = blocks.reshape(grid)
    mapping = [_axis(entry) for entry in spec.mesh_mapping]
    replicas = tuple(value for kind, value in mapping if kind == "replicated")
    # Each mesh axis takes an axis of the broadcast array: the next replica axis, or the
    # chunk grid's axis of its chunk count (after the replica axes).
    replica_axis = itertools.count()
    order = [
        next(replica_axis) if kind == "replicated" else len(replicas) + value
        for kind, value in mapping
    ]
    return np.broadcast_to(blocks, replicas + blocks.shape).transpose(order)


def tile_layout(
    aval: Any, indices: Sequence[Any] | None, spec: Any, num_devices: int
) -> tuple[tuple[int, ...], tuple[str, ...], Any]:
    """``(mesh_shape, axis_names, PartitionSpec)`` to place a value of ``aval`` on a mesh
    of ``num_devices`` devices as the jax-0.3 ``spec`` says (``shard_args_to_arrays``),
    after checking that the spec fits the mesh and the value, and that ``indices`` (per
    device, as Alpa's programs pass them; ``None`` to skip) are the spec's."""
    if not is_sharding_spec(spec):
        raise TypeError(
            f"expected a ShardingSpec (LogicalDeviceMesh.make_tile_spec gives one), got "
            f"{type(spec).__name__}: {spec!r}"
        )
    mesh_shape, names, partition = to_partition_spec(spec)
    if math.prod(mesh_shape) != num_devices:
        raise ValueError(
            f"{spec!r} lays the array over {math.prod(mesh_shape)} devices "
            f"(mesh {mesh_shape}), the mesh has {num_devices}"
        )
    expected = tuple(spec_indices(spec, aval.shape).flat)
    if indices is not None and tuple(indices) != expected:
        raise ValueError(
            f"the indices given for {spec!r} are not its blocks of shape {tuple(aval.shape)}: "
            f"expected spec.indices(shape).flatten(), {list(expected)}"
        )
    return mesh_shape, names, partition
