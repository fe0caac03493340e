"""A pipeline's split stacked leaf as the caller gets it: one ``jax.Array`` where a
sharding can say where its rows are.

A pipeline splits a stacked parameter ``[L, ...]`` into parts (a row ``[...]``, or a block
of rows ``[n, ...]``), each an input of the stage that reads it, on that stage's mesh
(``pipeline_parallel.stacked_rows``). The caller passes and gets back the whole leaf.

**One array.** When the stages' meshes have the same shape (hence as many devices), hold
the same number of rows each, each in one run of consecutive parts, and shard those rows
alike, one ``NamedSharding`` says where every row is: a mesh of shape ``(S, *stage
mesh)`` whose leading axis ``"stages"`` is the stages' meshes, and the stage's spec with
the row axis split over ``"stages"`` (:attr:`RowsLayout.joined`). The parts are then one
``jax.Array`` and nothing is copied: each device's shard *is* its stage's rows
(``jax.make_array_from_single_device_arrays`` over the parts' own buffers). Passed back to
the step, the array is cut into the parts the same way, from its shards; a stage that
holds several parts (a layer per part, several layers per stage) puts them together, and
cuts them again, with one compiled concatenation (or slice) on its own mesh.

**Otherwise** the leaf is a :class:`~alpa.runtime.stacked_array.StackedRows` (its parts,
each where its stage reads it), which JAX, flax and Python arithmetic take as an array.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from alpa.device_mesh import STAGE_AXIS_NAME as STAGE_AXIS
from alpa.runtime.stacked_array import StackedRows, stacked_parts


@dataclass(frozen=True)
class RowsLayout:
    """Where the parts of one split leaf live, and whether they are one array.

    Attributes:
      sizes: the rows of each part (a part of one row has no leading axis).
      shardings: per part, the sharding it is read (or written) in, on its stage's mesh.
      joined: the sharding of the whole leaf over every stage's devices, its leading axis
        split by stage (module docstring); ``None`` when no sharding can say it.
      groups: per stage mesh, in row order, the parts it holds (consecutive).
    """

    sizes: tuple[int, ...]
    shardings: tuple[Any, ...]
    joined: NamedSharding | None
    groups: tuple[tuple[int, ...], ...]


def rows_layout(sizes: Sequence[int], shardings: Sequence[Any], ndim: int) -> RowsLayout:
    """The :class:`RowsLayout` of a leaf of ``ndim`` dimensions cut into parts of
    ``sizes`` rows, each in its sharding (a ``NamedSharding``; anything else, a Ray
    placement, is never joined)."""
    return _layout(tuple(sizes), tuple(shardings), ndim)


@functools.lru_cache(maxsize=1024)
def _layout(sizes: tuple, shardings: tuple, ndim: int) -> RowsLayout:
    groups: list[list[int]] = []
    for i, s in enumerate(shardings):
        if groups and isinstance(s, NamedSharding) and s.mesh == shardings[groups[-1][0]].mesh:
            groups[-1].append(i)
        else:
            groups.append([i])
    groups_t = tuple(tuple(g) for g in groups)
    return RowsLayout(sizes, shardings, _joined(sizes, shardings, groups_t, ndim), groups_t)


def _joined(sizes: tuple, shardings: tuple, groups: tuple, ndim: int) -> NamedSharding | None:
    """The sharding over all the stages' devices whose leading axis is split by stage,
    or ``None`` (module docstring)."""
    if not all(isinstance(s, NamedSharding) for s in shardings):
        return None
    meshes = [shardings[g[0]].mesh for g in groups]
    first = meshes[0]
    devices = [d for m in meshes for d in m.devices.flat]
    if (
        STAGE_AXIS in first.axis_names
        or len(set(devices)) != len(devices)  # a mesh in two runs, or two meshes overlap
        or any(m.axis_names != first.axis_names or m.devices.shape != first.devices.shape
               for m in meshes)
        or len({sum(sizes[i] for i in g) for g in groups}) != 1
        or len({shardings[i].memory_kind for i in range(len(sizes))}) != 1
    ):  # fmt: skip
        return None
    specs = set()
    for g in groups:
        for i in g:
            row, inner = _row_and_inner(shardings[i].spec, sizes[i], ndim)
            if row is not None and len(g) > 1:
                return None  # rows split inside a stage holding several parts
            specs.add((row, inner))
    if len(specs) != 1:
        return None
    ((row, inner),) = specs
    mesh = Mesh(
        np.stack([m.devices for m in meshes]),
        (STAGE_AXIS, *first.axis_names),
        axis_types=(AxisType.Auto,) * (1 + len(first.axis_names)),
    )
    rows = STAGE_AXIS if row is None else (STAGE_AXIS, *_names(row))
    entries = [rows, *inner]
    while entries[-1] is None:  # P("stages", "y"), not P("stages", "y", None)
        entries.pop()
    return NamedSharding(mesh, PartitionSpec(*entries), memory_kind=shardings[0].memory_kind)


def _row_and_inner(spec: PartitionSpec, size: int, ndim: int) -> tuple[Any, tuple]:
    """A part's spec as ``(entry of its row axis, entries of the other axes)``; a row has
    no row axis (``None``)."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    if size == 1:  # a row: no row axis (one fewer dimension)
        return None, entries[: ndim - 1]
    return entries[0], entries[1:ndim]


def _names(entry) -> tuple:
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _stage_sharding(layout: RowsLayout, group: tuple[int, ...]) -> NamedSharding:
    """The sharding of one stage's rows (a block ``[rows, ...]``) on its mesh."""
    joined = layout.joined
    spec = tuple(joined.spec)
    row = spec[0][1:] if isinstance(spec[0], tuple) else ()
    mesh = layout.shardings[group[0]].mesh
    entry = None if not row else (row[0] if len(row) == 1 else row)
    return NamedSharding(mesh, PartitionSpec(entry, *spec[1:]), memory_kind=joined.memory_kind)


# ----------------------------------------------------------------------------- join, split


def join_parts(parts: Sequence[Any], layout: RowsLayout | None, shape: Sequence[int]) -> Any:
    """The caller's value of a split leaf of ``shape`` from its parts: one ``jax.Array``
    where ``layout.joined`` says so, else a ``StackedRows``."""
    if layout is None or layout.joined is None or not all(isinstance(p, jax.Array) for p in parts):
        return StackedRows(parts, None if layout is None else layout.sizes)
    by_device: dict = {}
    for group in layout.groups:
        block = _stage_block([parts[i] for i in group], layout, group)
        by_device.update((s.device, s.data) for s in block.addressable_shards)
    arrays = [by_device[d] for d in layout.joined.mesh.devices.flat]
    return jax.make_array_from_single_device_arrays(tuple(shape), layout.joined, arrays)


def split_leaf(x: Any, layout: RowsLayout | None) -> list:
    """A split leaf's parts, each in its sharding where ``layout`` has a joined one: an
    array in it is cut from its shards (nothing copied unless a stage holds several
    parts); any other value is placed in it first. Without one (or for a value that is
    not local), the parts as a ``StackedRows`` cut alike holds them, else slices."""
    sizes = None if layout is None else layout.sizes
    if isinstance(x, StackedRows) and x.sizes == sizes:
        return list(x.rows)
    if layout is None or layout.joined is None:
        return stacked_parts(x, sizes)
    joined = layout.joined
    if not (isinstance(x, jax.Array) and x.sharding == joined):
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(joined, x.ndim):
            pass
        elif isinstance(x, jax.Array | np.ndarray | np.generic | StackedRows):
            x = jax.device_put(np.asarray(x) if isinstance(x, StackedRows) else x, joined)
        else:
            return stacked_parts(x, sizes)
    by_device = {s.device: s.data for s in x.addressable_shards}
    parts: list = [None] * len(sizes)
    for group in layout.groups:
        sharding = _stage_sharding(layout, group)
        rows = sum(sizes[i] for i in group)
        shape = (rows, *x.shape[1:])
        arrays = [by_device[d] for d in sharding.mesh.devices.flat]
        if len(group) == 1 and sizes[group[0]] > 1:  # the stage's block is the part
            i = group[0]
            parts[i] = jax.make_array_from_single_device_arrays(shape, layout.shardings[i], arrays)
            continue
        block = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
        cut = _cutter(
            tuple(sizes[i] for i in group), sharding, tuple(layout.shardings[i] for i in group)
        )
        parts_here = cut(block)
        for i, part in zip(group, parts_here, strict=True):
            parts[i] = part
    return parts


def _stage_block(parts: list, layout: RowsLayout, group: tuple[int, ...]) -> jax.Array:
    """One stage's rows as one block ``[rows, ...]`` in its stage sharding: the part
    itself when it is one block, else its parts put together on the stage's mesh."""
    sizes = tuple(layout.sizes[i] for i in group)
    placed = [
        p if p.sharding.is_equivalent_to(layout.shardings[i], p.ndim)
        else jax.device_put(p, layout.shardings[i])
        for p, i in zip(parts, group, strict=True)
    ]  # fmt: skip
    if len(group) == 1 and sizes[0] > 1:
        return placed[0]
    return _concatenator(sizes, _stage_sharding(layout, group))(*placed)


@functools.lru_cache(maxsize=256)
def _concatenator(sizes: tuple, sharding: NamedSharding):
    def concat(*parts):
        blocks = [p[None] if n == 1 else p for p, n in zip(parts, sizes, strict=True)]
        return jax.numpy.concatenate(blocks)

    return jax.jit(concat, out_shardings=sharding)


@functools.lru_cache(maxsize=256)
def _cutter(sizes: tuple, sharding: NamedSharding, shardings: tuple):
    def cut(block):
        return tuple(stacked_parts(block, sizes))

    return jax.jit(cut, in_shardings=sharding, out_shardings=shardings)
