"""Gradient accumulation over contiguous micro-batches, with the row sums deferred.

**Semantics** (the same for every method, one-mesh and pipelined). With
``num_micro_batches = k`` a batch leaf of ``B`` rows is cut into ``k`` contiguous
micro-batches, micro-batch ``j`` being rows ``j·B/k .. (j+1)·B/k``. The compute part of
the step (everything up to the ``alpa.grad`` marker) runs on each micro-batch as the
serial program would, and the marked values are averaged,

    g = (1/k) · Σ_j compute(params, batch[j·B/k : (j+1)·B/k]),

before the apply part runs once on ``g``. Whatever the step computes over its batch
(BatchNorm statistics, a masked mean normalised by its mask's sum) is therefore computed
over a whole micro-batch, across the devices that hold it, never over one device's rows.

**Layout.** The data-parallel step receives each batch leaf split over the data axes in
``n`` contiguous blocks, one per device. Micro-batch ``j`` must itself be split over all
``n`` devices, so before the loop every batch leaf ``[B, ...]`` is reshaped to
``[k, B/k, ...]`` and laid out ``P(None, data)``: one all-to-all per batch leaf per step
(:func:`layout_change_cost` prices it), none inside the loop.

**Deferred row sums.** The loop body is the step's own jaxpr under the plan's sharding
constraints, so XLA's partitioner keeps its meaning. Left alone it would also reduce each
gradient across devices once per micro-batch: a gradient is a sum over the rows of the
micro-batch (``dot_general`` contracting the batch dimension, ``reduce_sum`` over it,
``conv_general_dilated`` contracting it, ``scatter-add`` of rows), and a sum over a dimension
split over the data axes compiles to an all-reduce. A row sum whose result reaches the
marker only through linear operations is instead *deferred*: each device computes the sum
over its own rows inside ``shard_map`` and keeps it as one slice of a value with a new
leading axis of size ``n`` (split over the data axes, so no communication), the linear
operations apply slice by slice, the loop accumulates the slices, and after the loop one
all-reduce sums them (``row_sums.py``: which values, and how they are computed). Since
``Σ_d L(p_d) = L(Σ_d p_d)`` for a linear ``L``, the result is the serial one. A row sum
that anything else reads (a BatchNorm mean feeds the normalisation) is reduced where it
is computed, as the serial program needs.

Which dimensions are batch dimensions (those whose size would shrink by the number of
data-parallel devices in a trace at the per-device micro-batch size) is read off the
jaxpr by ``tracing.batch_dims``, primitive by primitive; where that cannot follow every
value, off a second trace of the step at that size (``StepJaxpr.retrace``). Where that
fails or differs in structure, nothing is deferred; the step is still exact, with its
all-reduces inside the loop.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable

import jax
import numpy as np
from jax.extend.core import JaxprEqn, Var
from jax.sharding import NamedSharding, PartitionSpec

from alpa.shard_parallel.strategies.data_parallel import rows_per_example
from alpa.tracing import StepJaxpr
from alpa.tracing.batch_dims import static_batch_dims
from alpa.tracing.jaxpr_util import planned_bodies

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- layout


def stack_micro_batches(x, k: int, mesh, spec: PartitionSpec):
    """``x[B, ...]`` as ``[k, B/k, ...]``, each micro-batch laid out as ``spec`` says (the
    plan's spec of that leaf): micro-batch ``j`` is rows ``j·B/k .. (j+1)·B/k``."""
    stacked = x.reshape((k, x.shape[0] // k) + x.shape[1:])
    if mesh.size == 1:
        return stacked
    return jax.lax.with_sharding_constraint(
        stacked, NamedSharding(mesh, PartitionSpec(None, *spec))
    )


def layout_change_cost(traced: StepJaxpr, plan, num_micro_batches: int | None) -> float:
    """Seconds, under the alpha-beta model, of laying the batch out as ``k`` micro-batches:

        Σ_leaf Σ_{a ∈ axes(leaf)} all_to_all_cost(k · bytes(micro-batch of leaf) · n_a / n_leaf, a)

    over the batch leaves whose dim 0 the plan splits, ``axes(leaf)`` being the mesh axes
    it is split over, ``n_leaf`` their number of devices and ``n_a`` axis ``a``'s: each
    device's share of the whole leaf is exchanged once per step (an all-to-all is priced
    on the tensor its axis's devices exchange, ``n_a`` shares). An all-to-all over several
    axes is priced as one along each. Zero with one micro-batch: the layout is already the
    micro-batch's."""
    k = num_micro_batches or 1
    mesh = plan.logical_mesh
    if k == 1:
        return 0.0
    axis_names = tuple(mesh.axis_names)
    cost = 0.0
    for aval, is_batch, spec in zip(
        traced.in_avals, traced.batch_invars, plan.in_specs, strict=True
    ):
        first = spec[0] if is_batch and len(spec) else None
        if first is None:
            continue
        dims = [axis_names.index(a) for a in ((first,) if isinstance(first, str) else first)]
        n = int(np.prod([mesh.shape[d] for d in dims]))
        per_device = k * aval.size * np.dtype(aval.dtype).itemsize / n
        cost += sum(mesh.all_to_all_cost(per_device * mesh.shape[d], d) for d in dims)
    return cost


# ----------------------------------------------------------------------------- batch dims


def batch_dims(traced: StepJaxpr, num_data: int) -> dict[Var, tuple[int, ...] | None] | None:
    """Per variable of ``traced``'s jaxpr, the dimensions that hold rows of the batch:
    those whose size is ``num_data`` times smaller in a trace at the per-device batch size
    (``None`` for a variable whose sizes changed otherwise, or that nothing reads).
    ``None`` for a step that cannot be traced again (a sub-step of a pass), or whose
    batch does not split over ``num_data`` devices.

    Read off the jaxpr (``tracing.batch_dims``: each primitive's rule carries the rows
    from the batch arguments to every value) where it can follow every value that is
    read; otherwise off a second trace (:func:`retraced_batch_dims`). On GPT-39B the
    first takes 0.3 s, the second 4.7 s."""
    if traced.retrace is None or num_data == 1:
        return None
    with_rows = leaves_with_rows(traced)
    if any(b and a.shape[0] % num_data for a, b in zip(traced.in_avals, with_rows, strict=True)):
        return None  # the batch's rows do not split over num_data devices
    dims = static_batch_dims(traced.jaxpr, with_rows, num_data)
    if dims is not None or with_rows != tuple(traced.batch_invars):
        return dims  # a retrace would divide a PRNG key in the batch too
    return retraced_batch_dims(traced, num_data)


def leaves_with_rows(traced: StepJaxpr) -> tuple[bool, ...]:
    """Per input of ``traced``, whether it is a batch leaf with a row per example: a batch
    leaf whose dim 0 is another size than the batch's (a PRNG key, a step number in the
    batch dict: ``data_parallel.rows_per_example``) holds no batch dimension."""
    pairs = zip(traced.in_avals, traced.batch_invars, strict=True)
    return tuple(rows_per_example([a.shape[0] if b and a.ndim else None for a, b in pairs]))


def retraced_batch_dims(traced: StepJaxpr, num_data: int) -> dict | None:
    """:func:`batch_dims` off a trace at ``1 / num_data`` of the batch: ``None`` when
    there is none (a step written for one batch size fails it) or it differs from the
    first in structure."""
    if traced.retrace is None or num_data == 1:
        return None
    try:
        local = traced.retrace(num_data)
    except Exception as e:  # e.g. a step whose shapes assume its batch size
        logger.info("%s: no per-device trace (%s); no row sum is deferred", traced.name, e)
        return None
    glob_eqns, local_eqns = traced.jaxpr.eqns, local.jaxpr.eqns
    if len(glob_eqns) != len(local_eqns) or any(
        g.primitive is not p.primitive or len(g.outvars) != len(p.outvars)
        for g, p in zip(glob_eqns, local_eqns, strict=True)
    ):
        logger.info("%s: the per-device trace differs; no row sum is deferred", traced.name)
        return None

    def dims_of(glob_aval, local_aval) -> tuple[int, ...] | None:
        glob = tuple(getattr(glob_aval, "shape", ()))
        per_device = tuple(getattr(local_aval, "shape", ()))
        if len(glob) != len(per_device):
            return None
        sizes = list(zip(glob, per_device, strict=True))
        if any(a != b and a != b * num_data for a, b in sizes):
            return None
        return tuple(i for i, (a, b) in enumerate(sizes) if a != b)

    pairs = list(zip(traced.jaxpr.invars, local.jaxpr.invars, strict=True))
    pairs += [
        (v, u)
        for g, p in zip(glob_eqns, local_eqns, strict=True)
        for v, u in zip(g.outvars, p.outvars, strict=True)
    ]
    for g, p in zip(glob_eqns, local_eqns, strict=True):
        pairs += _body_pairs(g, p)
    return {v: dims_of(v.aval, u.aval) for v, u in pairs}


def _body_pairs(glob: JaxprEqn, local: JaxprEqn) -> list[tuple[Var, Var]]:
    """The values of the bodies of ``glob`` (``jaxpr_util.planned_bodies``: a scan's, a
    checkpoint's, a cond's branches', nested) paired with those of ``local``'s, where the
    two have the same structure."""
    pairs: list[tuple[Var, Var]] = []
    bodies, others = planned_bodies(glob), planned_bodies(local)
    if len(bodies) != len(others):
        return pairs
    for (_, a), (_, b) in zip(bodies, others, strict=True):
        if (
            len(a.invars) != len(b.invars)
            or len(a.eqns) != len(b.eqns)
            or any(
                e.primitive is not f.primitive or len(e.outvars) != len(f.outvars)
                for e, f in zip(a.eqns, b.eqns, strict=True)
            )
        ):
            continue
        pairs += zip(a.invars, b.invars, strict=True)
        for e, f in zip(a.eqns, b.eqns, strict=True):
            pairs += zip(e.outvars, f.outvars, strict=True)
            pairs += _body_pairs(e, f)
    return pairs


def batch_dims_for(traced: StepJaxpr, counts: Iterable[int]) -> dict[int, dict | None]:
    """:func:`batch_dims` for each of ``counts`` (data-parallel device counts), from one
    retrace where one suffices: at the least common multiple ``L`` of the counts, when
    ``L`` divides every batch leaf. A dimension that holds rows of the batch is ``L``
    times smaller there and ``n`` times smaller at ``n``, so the dimensions found are
    those of every count (a stage of 8 and one of 4 data-parallel devices cost one
    retrace of the step, not two). Counted one by one when that retrace fails or
    differs in structure."""
    counts = sorted({int(n) for n in counts if n > 1})
    if not counts:
        return {}
    common = functools.reduce(math.lcm, counts)
    sizes = [
        a.shape[0] if a.shape else 0
        for a, b in zip(traced.in_avals, traced.batch_invars, strict=True)
        if b
    ]
    if len(counts) > 1 and sizes and all(a and a % common == 0 for a in sizes):
        dims = batch_dims(traced, common)
        if dims is not None:
            return dict.fromkeys(counts, dims)
    return {n: batch_dims(traced, n) for n in counts}
