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
all-reduce sums them. Since ``Σ_d L(p_d) = L(Σ_d p_d)`` for a linear ``L``, the result is the
serial one. A row sum that anything else reads (a BatchNorm mean feeds the normalisation)
is reduced where it is computed, as the serial program needs.

Which dimensions are batch dimensions (those whose size would shrink by the number of
data-parallel devices in a trace at the per-device micro-batch size) is read off the
jaxpr by ``tracing.batch_dims``, primitive by primitive; where that cannot follow every
value, off a second trace of the step at that size (``TracedStep.retrace``). Where that
fails or differs in structure, nothing is deferred; the step is still exact, with its
all-reduces inside the loop.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Collection, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Var
from jax.sharding import NamedSharding, PartitionSpec

from alpa.shard_parallel.data_parallel import batch_rows
from alpa.tracing import TracedStep, jaxpr_util
from alpa.tracing.batch_dims import static_batch_dims
from alpa.tracing.primitive_def import passes_through

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


def layout_change_cost(traced: TracedStep, plan, num_micro_batches: int | None) -> float:
    """Seconds, under the alpha-beta model, of laying the batch out as ``k`` micro-batches:

        Σ_leaf Σ_{a ∈ axes(leaf)} all_to_all_cost(k · bytes(micro-batch of leaf) / n_leaf, a)

    over the batch leaves whose dim 0 the plan splits, ``axes(leaf)`` being the mesh axes
    it is split over and ``n_leaf`` their number of devices: each device's share of the
    whole leaf is exchanged once per step. An all-to-all over several axes is priced as
    one along each. Zero with one micro-batch: the layout is already the micro-batch's."""
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
        cost += sum(mesh.all_to_all_cost(per_device, d) for d in dims)
    return cost


# ----------------------------------------------------------------------------- batch dims


def batch_dims(traced: TracedStep, num_data: int) -> dict[Var, tuple[int, ...] | None] | None:
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


def leaves_with_rows(traced: TracedStep) -> tuple[bool, ...]:
    """Per input of ``traced``, whether it is a batch leaf with a row per example: a batch
    leaf whose dim 0 is another size than the batch's (a PRNG key, a step number in the
    batch dict: ``data_parallel.batch_rows``) holds no batch dimension."""
    rows = batch_rows(traced)
    return tuple(
        bool(b) and aval.ndim > 0 and aval.shape[0] == rows
        for aval, b in zip(traced.in_avals, traced.batch_invars, strict=True)
    )


def retraced_batch_dims(traced: TracedStep, num_data: int) -> dict | None:
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
    return {v: dims_of(v.aval, u.aval) for v, u in pairs}


def batch_dims_for(traced: TracedStep, counts: Iterable[int]) -> dict[int, dict | None]:
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


# ----------------------------------------------------------------------------- deferral

# Row sums: out = Σ_rows f(row), for the batch dimensions as the rule checks them.


def _one_batch_dim(dims, v) -> int | None:
    d = dims.get(v, None) if isinstance(v, Var) else ()
    return d[0] if d is not None and len(d) == 1 else None


def _reduce_sum_is_row_sum(eqn: JaxprEqn, dims) -> bool:
    d = _one_batch_dim(dims, eqn.invars[0])
    return d is not None and d in eqn.params["axes"]


def _dot_is_row_sum(eqn: JaxprEqn, dims) -> bool:
    (lhs_c, rhs_c), _ = eqn.params["dimension_numbers"]
    a, b = (_one_batch_dim(dims, v) for v in eqn.invars)
    return a is not None and b is not None and (a, b) in zip(lhs_c, rhs_c, strict=True)


def _conv_is_row_sum(eqn: JaxprEqn, dims) -> bool:
    """The kernel gradient of a convolution: the batch is the contracted feature dim."""
    numbers = eqn.params["dimension_numbers"]
    if eqn.params["feature_group_count"] != 1 or eqn.params["batch_group_count"] != 1:
        return False
    a, b = (_one_batch_dim(dims, v) for v in eqn.invars)
    return a == numbers.lhs_spec[1] and b == numbers.rhs_spec[1]


def _scatter_add_is_row_sum(eqn: JaxprEqn, dims) -> bool:
    """Rows of updates added at their rows' indices (an embedding's gradient)."""
    operand, indices, updates = eqn.invars
    row = _one_batch_dim(dims, updates)
    return (
        dims.get(operand, ()) == ()
        and _one_batch_dim(dims, indices) is not None
        and row is not None
        and row not in eqn.params["dimension_numbers"].update_window_dims
    )


_ROW_SUMS: dict[str, Callable[[JaxprEqn, dict], bool]] = {
    "reduce_sum": _reduce_sum_is_row_sum,
    "dot_general": _dot_is_row_sum,
    "conv_general_dilated": _conv_is_row_sum,
    "scatter-add": _scatter_add_is_row_sum,
}

# Linear operations. Additive ones are linear in all their listed operands together (a
# replicated operand is carried by device 0's slice, zeros elsewhere); the others are
# linear in one listed operand while the rest stay replicated.
_ADDITIVE: dict[str, Callable[[int], bool]] = {
    "add": lambda i: True,
    "add_any": lambda i: True,
    "sub": lambda i: True,
    "concatenate": lambda i: True,
    "pad": lambda i: True,
    "select_n": lambda i: i > 0,
    "dynamic_update_slice": lambda i: i < 2,
}
_LINEAR_IN_ONE: dict[str, Callable[[int], bool]] = {
    **{
        name: (lambda i: i == 0)
        for name in (
            "neg",
            "convert_element_type",
            "reshape",
            "transpose",
            "squeeze",
            "broadcast_in_dim",
            "reduce_sum",
            "copy",
            "copy_p",
            "slice",
            "dynamic_slice",
            "rev",
            "cumsum",
            "div",
        )
    },
    "mul": lambda i: True,
    "dot_general": lambda i: True,
}


def _linear_positions(eqn: JaxprEqn) -> Callable[[int], bool] | None:
    name = eqn.primitive.name
    return _ADDITIVE.get(name) or _LINEAR_IN_ONE.get(name)


def _is_float(v) -> bool:
    return jnp.issubdtype(v.aval.dtype, jnp.inexact)


def deferrable(
    compute: Jaxpr,
    dims: dict,
    keep: Callable[[JaxprEqn], bool] | None = None,
    reduced: Collection[Var] = (),
) -> set[Var]:
    """The values of ``compute`` that can be carried as per-device partial sums: each is
    made by a row sum (one that ``keep`` accepts, when given) or by a linear operation of
    such values, is not in ``reduced`` (values something outside ``compute`` reads
    whole), and is read only by the marker (``compute.outvars``) or by linear operations,
    in an operand where they are linear, whose results are deferred too; a multiplication
    or contraction reads at most one of them.

    Found by removing values from all candidates: first those that break the conditions
    that only get harder as values leave the set, until none does; then, where a
    multiplication still reads two deferred values, both; and again."""
    uses: dict[Var, list[tuple[JaxprEqn, int]]] = {}
    for eqn in compute.eqns:
        for i, v in enumerate(eqn.invars):
            if isinstance(v, Var):
                uses.setdefault(v, []).append((eqn, i))
    producer = {v: eqn for eqn in compute.eqns for v in eqn.outvars}
    marked = {v for v in compute.outvars if isinstance(v, Var)}

    def row_sum(eqn: JaxprEqn) -> bool:
        return _is_row_sum(eqn, dims) and (keep is None or keep(eqn))

    deferred = {
        v
        for eqn in compute.eqns
        if passes_through(eqn)
        or (len(eqn.outvars) == 1 and (row_sum(eqn) or _linear_positions(eqn) is not None))
        for v in eqn.outvars
        if _is_float(v) and dims.get(v) == () and v not in reduced
    }

    def deferred_operands(eqn: JaxprEqn) -> list[Var]:
        return [u for u in eqn.invars if isinstance(u, Var) and u in deferred]

    def holds(v: Var) -> bool:
        eqn = producer[v]
        if passes_through(eqn):
            source = eqn.invars[eqn.outvars.index(v)]
            if not (isinstance(source, Var) and source in deferred):
                return False
        elif not deferred_operands(eqn) and not row_sum(eqn):
            return False
        for user, i in uses.get(v, ()):
            if passes_through(user):
                if user.outvars[i] not in deferred:
                    return False
                continue
            linear = _linear_positions(user)
            if linear is None or not linear(i) or not all(o in deferred for o in user.outvars):
                return False
        return v in marked or bool(uses.get(v))

    while True:
        broken = {v for v in deferred if not holds(v)}
        if not broken:
            broken = {
                u
                for eqn in compute.eqns
                if eqn.primitive.name not in _ADDITIVE
                and not passes_through(eqn)
                and len(deferred_operands(eqn)) > 1
                for u in deferred_operands(eqn)
            }
        if not broken:
            return deferred
        deferred -= broken


def _is_row_sum(eqn: JaxprEqn, dims) -> bool:
    rule = _ROW_SUMS.get(eqn.primitive.name)
    return rule is not None and rule(eqn, dims)


# ----------------------------------------------------------------------------- evaluation


def deferred_rules(
    eqns: Iterable[JaxprEqn],
    dims: dict,
    deferred: set[Var],
    mesh,
    data_axes: tuple[str, ...],
    var_specs: Mapping[Var, PartitionSpec] | None = None,
) -> dict[JaxprEqn, Callable[[list], list]]:
    """For each of ``eqns`` that makes a deferred value, the function that computes its
    partial sums (``[n, ...]``, split over ``data_axes``) from its operands, as
    ``eval_jaxpr_with_constraints``'s ``overrides``. A value the plan pins in
    ``var_specs`` keeps its split over the other mesh axes (a vocabulary-parallel
    embedding's gradient stays split over the model axis)."""
    n = int(np.prod([mesh.shape[a] for a in data_axes]))
    data = data_axes if len(data_axes) > 1 else data_axes[0]
    var_specs = var_specs or {}
    rules = {}
    for eqn in eqns:
        if passes_through(eqn):
            if any(v in deferred for v in eqn.outvars):
                rules[eqn] = list  # the identity, on partial sums and whole values alike
            continue
        if not eqn.outvars or eqn.outvars[0] not in deferred:
            continue
        partial_sharding = NamedSharding(
            mesh, partial_spec(var_specs.get(eqn.outvars[0]), data_axes)
        )
        partial_in = tuple(isinstance(v, Var) and v in deferred for v in eqn.invars)
        if any(partial_in):
            rules[eqn] = _linear_rule(eqn, partial_in, n, partial_sharding)
        else:
            rules[eqn] = _row_sum_rule(eqn, dims, mesh, data_axes, data, partial_sharding)
    return rules


def partial_spec(spec: PartitionSpec | None, data_axes: tuple[str, ...]) -> PartitionSpec:
    """The spec of a value's per-device partial sums ``[n, ...]``: ``n`` over the data
    axes, the value's own dimensions as ``spec`` splits them over the other axes."""
    data = tuple(data_axes) if len(data_axes) > 1 else data_axes[0]
    rest = []
    for axes in spec or ():
        axes = axes if isinstance(axes, tuple) else (axes,) if axes else ()
        kept = tuple(a for a in axes if a not in data_axes)
        rest.append(kept if len(kept) > 1 else kept[0] if kept else None)
    return PartitionSpec(data, *rest)


def bind_eqn(eqn: JaxprEqn, *operands):
    """``eqn`` bound on ``operands``: its result, the first where it has several."""
    out = jaxpr_util.bind_eqn(eqn, *operands)
    return out[0] if eqn.primitive.multiple_results else out


def _row_sum_rule(eqn: JaxprEqn, dims, mesh, data_axes, data, partial_sharding):
    in_specs = []
    for v in eqn.invars:
        d = _one_batch_dim(dims, v)
        spec = [None] * len(getattr(v.aval, "shape", ()))
        if d is not None:
            spec[d] = data
        in_specs.append(PartitionSpec(*spec))
    carried_by_first = [
        eqn.primitive.name == "scatter-add" and i == 0 for i in range(len(eqn.invars))
    ]

    def local(*operands):
        if any(carried_by_first):
            first = jax.lax.axis_index(data_axes) == 0
            operands = [
                jnp.where(first, x, jnp.zeros_like(x)) if c else x
                for x, c in zip(operands, carried_by_first, strict=True)
            ]
        return bind_eqn(eqn, *operands)[None]

    partial = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=PartitionSpec(data),
        axis_names=set(data_axes),
        check_vma=False,
    )

    def rule(operands):
        sums = partial(*[jnp.asarray(x) for x in operands])
        return [jax.lax.with_sharding_constraint(sums, partial_sharding)]

    return rule


def _linear_rule(eqn: JaxprEqn, partial_in, n: int, partial_sharding):
    additive = eqn.primitive.name in _ADDITIVE
    linear = _linear_positions(eqn)

    def rule(operands):
        operands, axes = list(operands), []
        for i, (x, p) in enumerate(zip(operands, partial_in, strict=True)):
            if not p and additive and linear(i):
                x = jnp.asarray(x)
                operands[i] = jnp.zeros((n,) + x.shape, x.dtype).at[0].set(x)
                p = True
            axes.append(0 if p else None)
        out = jax.vmap(lambda *xs: bind_eqn(eqn, *xs), in_axes=axes)(*operands)
        return [jax.lax.with_sharding_constraint(out, partial_sharding)]

    return rule


def sum_partials(x, mesh, data_axes: tuple[str, ...], spec: PartitionSpec | None = None):
    """``Σ_d x[d]`` of a deferred value: the one reduction of the step.

    An all-reduce; a reduce-scatter (``psum_scatter``) instead when ``spec``, the sharding
    the sum is wanted in, splits one dimension over exactly ``data_axes``: each device
    then receives only its block (ZeRO-2's sharded gradients). XLA on CPU never turns an
    all-reduce followed by a slice into a reduce-scatter (DESIGN §7), so the scatter is
    written out here; other axes of ``spec`` are left to the caller's constraint."""
    data = data_axes if len(data_axes) > 1 else data_axes[0]
    dim = scatter_dimension(spec, data_axes)
    if dim is None:
        body, out_spec = (lambda p: jax.lax.psum(p[0], data_axes)), PartitionSpec()
    else:

        def body(p):
            return jax.lax.psum_scatter(p[0], data_axes, scatter_dimension=dim, tiled=True)

        out_spec = PartitionSpec(*([None] * dim), data)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=PartitionSpec(data),
        out_specs=out_spec,
        axis_names=set(data_axes),
        check_vma=False,
    )(x)


def scatter_dimension(spec: PartitionSpec | None, data_axes: tuple[str, ...]) -> int | None:
    """The dimension that ``spec`` splits over exactly ``data_axes``, if one does."""
    for d, axes in enumerate(spec or ()):
        axes = axes if isinstance(axes, tuple) else (axes,)
        if axes == tuple(data_axes):
            return d
    return None
