"""Packed collectives: many tensors reduce-scattered, or all-gathered, in one collective.

Packing is written out because XLA on CPU neither combines reduce-scatters or
all-gathers nor turns an all-reduce and a slice into a reduce-scatter (measured: ZeRO-2
on a 6-layer MLP compiled to one tuple all-reduce and 12 all-gathers). A packed
collective works on one buffer ``[n, M]`` per device, row ``i`` the concatenation of
device ``i``'s block of every tensor: a tensor split at dimension ``d`` is reshaped so
that ``d`` becomes ``(n, d/n)``, that ``n`` is moved first and the rest flattened. So
device ``i`` receives (or sends) exactly its blocks, and the program computes what the
unpacked one does.

Used by the lowering of a one-mesh plan (``gradient_sync``'s reductions at the
``alpa.grad`` marker, ZeRO's gathers) and by pipeline stages' programs
(``executables.stage_programs``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from alpa.device_mesh import entry_names, spec_entry
from alpa.shard_parallel.gradients.row_sums import partial_spec, sum_partials
from alpa.util import GRAD_SYNC_SCOPE


def _rows(x, dim: int, n: int):
    """``x`` whole as ``[n, M]``: row ``i`` is block ``i`` of ``x`` along ``dim``."""
    shape = x.shape
    x = x.reshape(shape[:dim] + (n, shape[dim] // n) + shape[dim + 1 :])
    return jnp.moveaxis(x, dim, 0).reshape(n, -1)


def _unrows(rows, shape: tuple[int, ...], dim: int, n: int):
    """The inverse of :func:`_rows`: ``[n, M]`` back to the whole tensor of ``shape``."""
    block = shape[:dim] + (shape[dim] // n,) + shape[dim + 1 :]
    x = jnp.moveaxis(rows.reshape((n,) + block), 0, dim)
    return x.reshape(shape)


def _offsets(sizes: Sequence[int]) -> list[int]:
    return list(np.cumsum([0, *sizes]))


def packed_reduce_scatter(partials: Sequence, specs: Sequence, mesh, data_axes) -> list:
    """``Σ_d p[d]`` of each per-device partial sum ``p`` (``[n, *shape]``, ``n`` split over
    ``data_axes``, the rest as ``specs[j]`` splits it over the other axes), in ``specs[j]``:
    one ``psum_scatter`` of all of them packed (module docstring). ``specs[j]`` splits one
    dimension over ``data_axes``, the minor axes of its entry (:func:`minor_scatter_dimension`):
    each device reduce-scatters its block of the sum over the other axes. Partials of one
    dtype only.

    A scalar with ``specs[j] = None`` (the loss) rides along whole: each device's row
    holds a copy of it, so each device receives the full sum, and the step needs no
    all-reduce of its own for it (``n`` copies of 4 bytes against one collective's
    latency)."""
    data_axes = tuple(data_axes)
    n = int(np.prod([mesh.shape[a] for a in data_axes]))
    dims = [None if s is None else minor_scatter_dimension(s, data_axes) for s in specs]

    def row(p, d):
        return jnp.broadcast_to(p.reshape(1, 1), (n, 1)) if d is None else _rows(p, d, n)

    def body(*locals_):
        blocks = [tuple(p.shape[1:]) for p in locals_]
        packed = jnp.concatenate([row(p[0], d) for p, d in zip(locals_, dims, strict=True)], 1)
        mine = jax.lax.psum_scatter(packed, data_axes, scatter_dimension=0, tiled=True)
        starts = _offsets(
            [1 if d is None else int(np.prod(b)) // n for b, d in zip(blocks, dims, strict=True)]
        )
        return tuple(
            mine[0, a].reshape(())
            if d is None
            else mine[0, a:b].reshape(s[:d] + (s[d] // n,) + s[d + 1 :])
            for a, b, s, d in zip(starts[:-1], starts[1:], blocks, dims, strict=True)
        )

    return list(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=tuple(
                PartitionSpec(spec_entry(data_axes)) if s is None else partial_spec(s, data_axes)
                for s in specs
            ),
            out_specs=tuple(PartitionSpec() if s is None else s for s in specs),
            check_vma=False,
        )(*partials)
    )


def packed_all_gather(values: Sequence, specs: Sequence, mesh, data_axes) -> list:
    """Each of ``values`` (in ``specs[j]``, which splits one dimension over ``data_axes``,
    the minor axes of its entry) whole over ``data_axes``, in ``specs[j]`` without them:
    one ``all_gather`` of all of them packed. Values of one dtype only."""
    data_axes = tuple(data_axes)
    n = int(np.prod([mesh.shape[a] for a in data_axes]))
    dims = [minor_scatter_dimension(s, data_axes) for s in specs]

    def body(*blocks):
        shapes = [tuple(b.shape) for b in blocks]
        packed = jnp.concatenate([b.reshape(1, -1) for b in blocks], axis=1)
        rows = jax.lax.all_gather(packed, data_axes, axis=0, tiled=True)
        starts = _offsets([int(np.prod(s)) for s in shapes])
        return tuple(
            _unrows(rows[:, a:b], s[:d] + (s[d] * n,) + s[d + 1 :], d, n)
            for a, b, s, d in zip(starts[:-1], starts[1:], shapes, dims, strict=True)
        )

    return list(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=tuple(specs),
            out_specs=tuple(without_axes(s, data_axes) for s in specs),
            check_vma=False,
        )(*values)
    )


def minor_scatter_dimension(spec: PartitionSpec | None, data_axes: tuple[str, ...]) -> int | None:
    """The dimension whose entry in ``spec`` ends with ``data_axes`` (split over them last,
    the device's block of it over the other axes split further), if one does."""
    k = len(data_axes)
    for d, axes in enumerate(spec or ()):
        names = entry_names(axes)
        if len(names) >= k and names[-k:] == tuple(data_axes):
            return d
    return None


def without_axes(spec: PartitionSpec, axes: Sequence[str]) -> PartitionSpec:
    """``spec`` with ``axes`` removed from its entries."""
    entries = []
    for entry in spec:
        kept = tuple(a for a in entry_names(entry) if a not in axes)
        entries.append(spec_entry(kept))
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _packs(indices: Sequence[int], values: Sequence, dims: Sequence, by_dimension: bool):
    """``indices`` grouped into packs: by dtype, and by ``dims[i]`` where ``by_dimension``."""
    groups: dict = {}
    for i in indices:
        key = (jnp.dtype(values[i].dtype), dims[i] if by_dimension else None)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def rides(ndim: int, dtype, scattered: Sequence) -> bool:
    """Whether a whole partial sum of rank ``ndim`` and ``dtype`` rides in the packed
    reduce-scatter of ``scattered`` (values or avals): a scalar (the loss), where a
    reduce-scatter of its dtype is packed. The lowering (:func:`reduce_partials`) and the
    pricing (``gradient_sync.written_sync``) both ask this."""
    return ndim == 0 and np.dtype(dtype) in {np.dtype(x.dtype) for x in scattered}


def reduce_partials(
    values, is_partial, specs, mesh, data_axes, may_ride=None, by_dimension=False
) -> list:
    """Each of ``values`` reduced as the plan wants it: a per-device partial sum
    (``is_partial``) whose wanted spec (``specs``) splits a dimension over ``data_axes``
    (the minor axes of its entry: :func:`minor_scatter_dimension`) is reduce-scattered,
    packed with the others of its dtype (and of its scattered dimension, where
    ``by_dimension``: ``gradient_sync.packs_by_dimension``); a scalar partial sum rides
    in the first such pack of its dtype where ``may_ride[i]`` (default: all; ``False`` for a
    value nothing reads, which XLA then drops); any other partial sum is all-reduced
    (``row_sums.sum_partials``); the rest are returned as they are."""
    may_ride = [True] * len(values) if may_ride is None else list(may_ride)
    with jax.named_scope(GRAD_SYNC_SCOPE):
        return _reduce_partials(
            values, is_partial, specs, mesh, tuple(data_axes), may_ride, by_dimension
        )


def _reduce_partials(values, is_partial, specs, mesh, data_axes, may_ride, by_dimension) -> list:
    out = list(values)
    dims = [minor_scatter_dimension(s, data_axes) for s in specs]
    wanted, whole = {}, []
    for i, (p, spec) in enumerate(zip(is_partial, specs, strict=True)):
        if not p:
            continue
        if dims[i] is None:
            whole.append(i)
        else:
            wanted[i] = spec
    scattered = [values[i] for i in wanted]
    packs = _packs(list(wanted), values, dims, by_dimension)
    for i in whole:
        # values are per-device partials, [n, *shape]: a scalar's is [n]
        if may_ride[i] and rides(values[i].ndim - 1, values[i].dtype, scattered):
            wanted[i] = None
            next(g for g in packs if values[g[0]].dtype == values[i].dtype).append(i)
        else:
            out[i] = sum_partials(values[i], mesh, data_axes, specs[i])
    for group in packs:
        sums = packed_reduce_scatter([values[i] for i in group], [wanted[i] for i in group],
                                     mesh, data_axes)  # fmt: skip
        for i, s in zip(group, sums, strict=True):
            out[i] = s
    return out


def gather_packed(
    values: list,
    specs: Mapping[int, tuple[PartitionSpec, tuple[str, ...]]],
    mesh,
    by_dimension: bool = False,
) -> list:
    """``values`` with those at the indices of ``specs`` (``(spec, axes)``: split in
    ``spec`` over ``axes`` as :func:`packed_all_gather` takes them) gathered whole over
    ``axes``, packed by dtype and axes (and by the dimension split, where
    ``by_dimension``: ``gradient_sync.packs_by_dimension``)."""
    out = list(values)
    groups: dict = {}
    for i, (spec, axes) in specs.items():
        dim = minor_scatter_dimension(spec, tuple(axes)) if by_dimension else None
        groups.setdefault((jnp.dtype(values[i].dtype), tuple(axes), dim), []).append(i)
    for (_, axes, _), group in groups.items():
        whole = packed_all_gather([values[i] for i in group], [specs[i][0] for i in group],
                                  mesh, axes)  # fmt: skip
        for i, w in zip(group, whole, strict=True):
            out[i] = w
    return out
