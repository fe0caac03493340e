"""Sharding strategies per primitive: the registry and the rules for shape-preserving ops.

A *strategy* of an equation says how its outputs are split (``out_specs``), how each operand
must be split for the equation to run locally (``in_specs``; the strategy graph prices the
resharding from the operand's own spec), and what the equation then communicates by itself
(``comm_cost``: the all-reduce of a sharded contraction or reduction). Rules are looked up by
primitive in :data:`strategy_rules`; a primitive without a rule gets one replicated strategy
and one warning per planning call.

Most ops *follow* one operand: their strategies are in one-to-one correspondence with that
operand's, so the ILP can give both the same decision variable (graph shrinking, paper §4.2).
A following rule maps each spec of the followed operand to a strategy; dimensions the op
cannot keep split (a reduced ``argmax`` axis, a sliced or padded dimension) are dropped from
the required operand spec, which the graph prices as a resharding inside the merged node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn, Literal, Primitive

from alpa.device_mesh import LogicalDeviceMesh
from alpa.jax_internals import CUSTOM_DERIVATIVE_CALLS, REMAT_PRIMITIVES
from alpa.shard_parallel.strategies.sharding_spec import (
    Spec,
    enumerate_specs,
    format_spec,
    nbytes,
    num_shards,
    replicated,
)


@dataclass(frozen=True)
class Strategy:
    """One way to run one equation; ``in_specs[i]`` is ``None`` for a literal operand.

    ``reduce_axes`` are the mesh axes over which the equation reduces partial results (an
    all-reduce or reduce-scatter, priced in ``comm_cost`` with one latency each), so that
    the strategy graph can price XLA's combining of independent reductions.
    ``compute_cost`` is filled in by the strategy graph (the work on one device).
    """

    name: str
    out_specs: tuple[Spec, ...]
    in_specs: tuple[Spec | None, ...]
    comm_cost: float = 0.0
    compute_cost: float = 0.0
    reduce_axes: tuple[int, ...] = ()


@dataclass(frozen=True)
class NodeStrategies:
    """The strategies of one equation; ``follow`` is the operand they mirror one-to-one."""

    strategies: tuple[Strategy, ...]
    follow: int | None = None


@dataclass(frozen=True)
class RuleContext:
    """What a rule may read besides the equation.

    ``operand_specs[i]`` lists the output spec of operand ``i`` under each strategy of its
    producer (``None`` for a literal): a following rule returns one strategy per entry.
    """

    mesh: LogicalDeviceMesh
    allow_mixed_mesh_shape: bool
    allow_recompute_heavy_op: bool
    prefer_reduce_scatter: bool
    operand_specs: tuple[tuple[Spec, ...] | None, ...]

    def out_bytes(self, eqn: JaxprEqn, index: int, spec: Spec) -> float:
        aval = eqn.outvars[index].aval
        return nbytes(aval.shape, aval.dtype.itemsize) / num_shards(spec, self.mesh)

    def all_reduce(self, eqn: JaxprEqn, out_spec: Spec, axes: Sequence[int]) -> float:
        per_device = self.out_bytes(eqn, 0, out_spec)
        return sum(self.mesh.all_reduce_cost(per_device, a) for a in axes)


Rule = Callable[[JaxprEqn, RuleContext], NodeStrategies]

#: The registry: primitive -> rule.
strategy_rules: dict[Primitive, Rule] = {}
#: Rules of primitives that ``jax.lax`` does not export, by name.
strategy_rules_by_name: dict[str, Rule] = {}


def register(*primitives: Primitive | str) -> Callable[[Rule], Rule]:
    def wrap(rule: Rule) -> Rule:
        for prim in primitives:
            if isinstance(prim, str):
                strategy_rules_by_name[prim] = rule
            else:
                strategy_rules[prim] = rule
        return rule

    return wrap


def lookup_rule(primitive: Primitive) -> Rule | None:
    return strategy_rules.get(primitive) or strategy_rules_by_name.get(primitive.name)


# ----------------------------------------------------------------------------- helpers


def shape_of(var) -> tuple[int, ...]:
    return tuple(getattr(var.aval, "shape", ()))


def drop_dims(spec: Spec, dims) -> Spec:
    """``spec`` with the dimensions ``dims`` left whole."""
    dims = set(dims)
    return tuple(() if d in dims else axes for d, axes in enumerate(spec))


def replicated_strategy(eqn: JaxprEqn, name: str = "replicated") -> NodeStrategies:
    outs = tuple(replicated(len(shape_of(v))) for v in eqn.outvars)
    ins = tuple(
        None if isinstance(v, Literal) else replicated(len(shape_of(v))) for v in eqn.invars
    )
    return NodeStrategies((Strategy(name, outs, ins),))


def whole_value_strategy(var) -> Strategy:
    """The one strategy of a value that reads nothing (a constant or a literal given a
    node): whole on every device."""
    return Strategy("replicated", (replicated(len(var.aval.shape)),), ())


def generator_strategies(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    """An op without tensor operands may produce its output in any spec, for free."""
    out_shape = shape_of(eqn.outvars[0])
    ins = tuple(
        None if isinstance(v, Literal) else replicated(len(shape_of(v))) for v in eqn.invars
    )
    return NodeStrategies(
        tuple(
            Strategy(format_spec(spec, ctx.mesh), (spec,), ins)
            for spec in enumerate_specs(out_shape, ctx.mesh, ctx.allow_mixed_mesh_shape)
        )
    )


def pick_followed(eqn: JaxprEqn, ctx: RuleContext, shape: tuple[int, ...]) -> int | None:
    """The operand of ``shape`` with the most strategies (the first on ties)."""
    best, best_count = None, -1
    for i, v in enumerate(eqn.invars):
        specs = ctx.operand_specs[i]
        if specs is None or shape_of(v) != shape:
            continue
        if len(specs) > best_count:
            best, best_count = i, len(specs)
    return best


def follow(
    eqn: JaxprEqn,
    ctx: RuleContext,
    index: int,
    derive: Callable[[Spec], tuple],
) -> NodeStrategies:
    """One strategy per spec of operand ``index``: ``derive(spec) -> (ins, outs, comm)``,
    or ``(ins, outs, comm, reduce_axes)`` for a strategy that reduces partial results."""
    strategies = []
    for spec in ctx.operand_specs[index]:
        ins, outs, comm, *reduce_axes = derive(spec)
        name = format_spec(outs[0], ctx.mesh) if outs else "-"
        axes = tuple(reduce_axes[0]) if reduce_axes else ()
        strategies.append(Strategy(name, tuple(outs), tuple(ins), comm, reduce_axes=axes))
    return NodeStrategies(tuple(strategies), follow=index)


def same_spec_operands(eqn: JaxprEqn, spec: Spec, shape: tuple[int, ...]):
    """``spec`` for every operand of ``shape``; an operand of the same rank that is broadcast
    along size-1 dimensions keeps the rest of ``spec``; scalars are whole; ``None`` for
    literals."""
    ins = []
    for v in eqn.invars:
        operand = shape_of(v)
        if isinstance(v, Literal):
            ins.append(None)
        elif operand == shape:
            ins.append(spec)
        elif len(operand) == len(shape):
            ins.append(
                tuple(a if n == m else () for a, n, m in zip(spec, operand, shape, strict=True))
            )
        else:
            ins.append(replicated(len(operand)))
    return tuple(ins)


# ----------------------------------------------------------------------------- elementwise


ELEMENTWISE = [
    lax.abs_p, lax.acos_p, lax.acosh_p, lax.add_p, lax.and_p, lax.asin_p, lax.asinh_p,
    lax.atan2_p, lax.atan_p, lax.atanh_p, lax.cbrt_p, lax.ceil_p, lax.clamp_p, lax.clz_p,
    lax.convert_element_type_p, lax.copy_p, lax.cos_p, lax.cosh_p, lax.digamma_p, lax.div_p,
    lax.eq_p, lax.erf_inv_p, lax.erf_p, lax.erfc_p, lax.exp2_p, lax.exp_p, lax.expm1_p,
    lax.floor_p, lax.ge_p, lax.gt_p, lax.integer_pow_p, lax.is_finite_p, lax.le_p,
    lax.lgamma_p, lax.log1p_p, lax.log_p, lax.logistic_p, lax.lt_p, lax.max_p, lax.min_p,
    lax.mul_p, lax.ne_p, lax.neg_p, lax.nextafter_p, lax.not_p, lax.or_p, lax.pow_p,
    lax.reduce_precision_p, lax.rem_p, lax.round_p, lax.rsqrt_p, lax.select_n_p,
    lax.shift_left_p, lax.shift_right_arithmetic_p, lax.shift_right_logical_p, lax.sign_p,
    lax.sin_p, lax.sinh_p, lax.sqrt_p, lax.square_p, lax.sub_p, lax.tan_p, lax.tanh_p,
    lax.xor_p, lax.population_count_p, lax.bitcast_convert_type_p, lax.stop_gradient_p,
    "add_any", "threefry2x32", "erf_inv", "custom_lin",
]  # fmt: skip


@register(*ELEMENTWISE)
def elementwise_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    out_shape = shape_of(eqn.outvars[0])
    if any(shape_of(v) != out_shape for v in eqn.outvars):
        return replicated_strategy(eqn)
    index = pick_followed(eqn, ctx, out_shape)
    outs = len(eqn.outvars)
    if index is None and not out_shape:
        return replicated_strategy(eqn)
    if index is None:
        # Every operand is broadcast along some size-1 dimension (``[b, s, 1] * [1, 1, h]``
        # in a layer norm): any result spec, each operand split where its size matches.
        return NodeStrategies(
            tuple(
                Strategy(
                    format_spec(spec, ctx.mesh),
                    (spec,) * outs,
                    same_spec_operands(eqn, spec, out_shape),
                )
                for spec in enumerate_specs(out_shape, ctx.mesh, ctx.allow_mixed_mesh_shape)
            )
        )
    return follow(
        eqn, ctx, index, lambda s: (same_spec_operands(eqn, s, out_shape), (s,) * outs, 0.0)
    )


@register(lax.iota_p, lax.rng_uniform_p, "empty2")
def iota_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    """``iota`` and ``empty2`` (the uninitialized scalar a ``cond``'s transpose broadcasts
    into the residuals a branch does not compute) are generators."""
    if eqn.primitive is lax.rng_uniform_p:
        return replicated_strategy(eqn)
    return generator_strategies(eqn, ctx)


@register(
    lax.scan_p, lax.while_p, lax.cond_p, *sorted(REMAT_PRIMITIVES),
    *sorted(CUSTOM_DERIVATIVE_CALLS), lax.rng_bit_generator_p, lax.linear_solve_p,
)  # fmt: skip
def opaque_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    """Control flow and ``rng_bit_generator`` (whose numbers depend on the shape it is run
    at) run replicated; their bodies are XLA's. The threefry random primitives have rules in
    ``strategy_rules_random``. ``remat2`` and ``scan`` bodies are planned by the strategy
    graph; this rule serves only a body the graph cannot expand (one body object shared by
    two equations outside ``trace_step``)."""
    return replicated_strategy(eqn, name="opaque")


# ----------------------------------------------------------------------------- layout ops


@register(lax.broadcast_in_dim_p)
def broadcast_in_dim_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    """One strategy per spec of the *result*, not per spec of the operand.

    A new (or size-1 expanded) dimension may be split for free: each device materializes
    only its slice. Following the operand instead would leave the result replicated whenever
    the operand is (a batch-norm statistic of ``[channels]`` broadcast to the activations'
    ``[batch, h, w, channels]``), and every elementwise op that mixes it with a batch-split
    activation would then force an all-gather of that activation.
    """
    operand = eqn.invars[0]
    in_shape, out_shape = shape_of(operand), tuple(eqn.params["shape"])
    if isinstance(operand, Literal) or int(np.prod(in_shape)) == 1:
        return generator_strategies(eqn, ctx)
    dims = eqn.params["broadcast_dimensions"]
    rest = (None,) * (len(eqn.invars) - 1)
    strategies = []
    for spec in enumerate_specs(out_shape, ctx.mesh, ctx.allow_mixed_mesh_shape):
        kept = tuple(
            spec[dims[d]] if in_shape[d] == out_shape[dims[d]] else () for d in range(len(in_shape))
        )
        strategies.append(Strategy(format_spec(spec, ctx.mesh), (spec,), (kept, *rest)))
    return NodeStrategies(tuple(strategies))


def reshape_groups(in_shape, out_shape) -> list[tuple[list[int], list[int]]]:
    """Groups of input and output dimensions whose sizes have equal products, in order."""
    if 0 in in_shape or 0 in out_shape:
        return [(list(range(len(in_shape))), list(range(len(out_shape))))]
    groups, i, j = [], 0, 0
    while i < len(in_shape) and j < len(out_shape):
        gi, gj = [i], [j]
        pi, pj = in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                pi *= in_shape[i]
                gi.append(i)
                i += 1
            else:
                pj *= out_shape[j]
                gj.append(j)
                j += 1
        groups.append((gi, gj))
    if i < len(in_shape):
        groups.append((list(range(i, len(in_shape))), []))
    if j < len(out_shape):
        groups.append(([], list(range(j, len(out_shape)))))
    return groups


@register(lax.reshape_p)
def reshape_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    in_shape, out_shape = shape_of(eqn.invars[0]), tuple(eqn.params["new_sizes"])
    groups = reshape_groups(in_shape, out_shape)
    mesh = ctx.mesh

    def derive(spec):
        out = [()] * len(out_shape)
        keep = [()] * len(in_shape)
        for gi, gj in groups:
            major_in = next((d for d in gi if in_shape[d] > 1), None)
            major_out = next((d for d in gj if out_shape[d] > 1), None)
            if major_in is None or major_out is None or not spec[major_in]:
                continue
            axes = spec[major_in]
            shards = int(np.prod([mesh.shape[a] for a in axes]))
            if out_shape[major_out] % shards == 0:
                out[major_out] = axes
                keep[major_in] = axes
        ins = (tuple(keep),) + (None,) * (len(eqn.invars) - 1)
        return ins, (tuple(out),), 0.0

    return follow(eqn, ctx, 0, derive)


@register(lax.squeeze_p)
def squeeze_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    dims = {d % len(shape_of(eqn.invars[0])) for d in eqn.params["dimensions"]}
    return follow(
        eqn, ctx, 0,
        lambda s: ((s,), (tuple(a for d, a in enumerate(s) if d not in dims),), 0.0),
    )  # fmt: skip


@register(lax.transpose_p)
def transpose_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    perm = eqn.params["permutation"]
    return follow(eqn, ctx, 0, lambda s: ((s,), (tuple(s[p] for p in perm),), 0.0))


def _follow_keeping_whole(eqn, ctx, index, whole_dims, num_outs=1, others_same=True):
    """Follow operand ``index``; ``whole_dims`` are never split; all same-shape operands
    and every output take the operand's spec."""
    shape = shape_of(eqn.invars[index])

    def derive(spec):
        spec = drop_dims(spec, whole_dims)
        if others_same:
            ins = same_spec_operands(eqn, spec, shape)
        else:
            ins = tuple(spec if i == index else None for i in range(len(eqn.invars)))
        return ins, (spec,) * num_outs, 0.0

    return follow(eqn, ctx, index, derive)


@register(lax.slice_p, lax.dynamic_slice_p, lax.pad_p, lax.rev_p)
def slicing_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    in_shape = shape_of(eqn.invars[0])
    out_shape = shape_of(eqn.outvars[0])
    whole = {d for d in range(len(in_shape)) if in_shape[d] != out_shape[d]}
    if eqn.primitive is lax.rev_p:
        whole |= set(eqn.params["dimensions"])
    elif eqn.primitive is lax.slice_p and eqn.params.get("strides"):
        whole |= {d for d, s in enumerate(eqn.params["strides"]) if s != 1}
    return _follow_keeping_whole(eqn, ctx, 0, whole, others_same=False)


@register(lax.dynamic_update_slice_p)
def dynamic_update_slice_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    in_shape, upd_shape = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    whole = {d for d in range(len(in_shape)) if in_shape[d] != upd_shape[d]}

    def derive(spec):
        spec = drop_dims(spec, whole)
        return (spec, spec) + (None,) * (len(eqn.invars) - 2), (spec,), 0.0

    return follow(eqn, ctx, 0, derive)


@register(lax.concatenate_p)
def concatenate_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    dim = eqn.params["dimension"]
    candidates = [i for i, s in enumerate(ctx.operand_specs) if s is not None]
    if not candidates:
        return replicated_strategy(eqn)
    index = max(candidates, key=lambda i: (len(ctx.operand_specs[i]), -i))

    def derive(spec):
        spec = drop_dims(spec, {dim})
        ins = tuple(None if isinstance(v, Literal) else spec for v in eqn.invars)
        return ins, (spec,), 0.0

    return follow(eqn, ctx, index, derive)


@register(lax.split_p)
def split_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    return _follow_keeping_whole(eqn, ctx, 0, {eqn.params["axis"]}, num_outs=len(eqn.outvars))


@register(lax.cumsum_p, lax.cumprod_p, lax.cummax_p, lax.cummin_p, lax.cumlogsumexp_p)
def cumulative_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    return _follow_keeping_whole(eqn, ctx, 0, {eqn.params["axis"]})


@register(lax.sort_p)
def sort_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    index = pick_followed(eqn, ctx, shape_of(eqn.invars[0]))
    if index is None:
        return replicated_strategy(eqn)
    return _follow_keeping_whole(
        eqn, ctx, index, {eqn.params["dimension"]}, num_outs=len(eqn.outvars)
    )


@register(lax.top_k_p)
def top_k_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    last = len(shape_of(eqn.invars[0])) - 1
    return _follow_keeping_whole(eqn, ctx, 0, {last}, num_outs=len(eqn.outvars))


# ----------------------------------------------------------------------------- reductions


REDUCTIONS = [
    lax.reduce_sum_p, lax.reduce_max_p, lax.reduce_min_p, lax.reduce_prod_p,
    lax.reduce_and_p, lax.reduce_or_p, lax.reduce_xor_p, lax.argmax_p, lax.argmin_p,
]  # fmt: skip


@register(*REDUCTIONS)
def reduce_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    """A reduction over a split dimension ends in an all-reduce of the result; ``argmax``
    and ``argmin`` keep their reduced dimension whole instead."""
    axes_reduced = set(eqn.params["axes"])
    keeps_whole = eqn.primitive in (lax.argmax_p, lax.argmin_p)

    def derive(spec):
        if keeps_whole:
            spec = drop_dims(spec, axes_reduced)
        out = tuple(a for d, a in enumerate(spec) if d not in axes_reduced)
        mesh_axes = [a for d in axes_reduced for a in spec[d]]
        return (spec,), (out,), ctx.all_reduce(eqn, out, mesh_axes), mesh_axes

    return follow(eqn, ctx, 0, derive)


def _windowed_dims(params, rank) -> set[int]:
    whole = set()
    pads = params.get("padding") or ((0, 0),) * rank
    for d in range(rank):
        if params["window_dimensions"][d] != 1 or params["window_strides"][d] != 1:
            whole.add(d)
        if tuple(pads[d]) != (0, 0):
            whole.add(d)
        for key in ("base_dilation", "window_dilation"):
            if params.get(key) and params[key][d] != 1:
                whole.add(d)
    return whole


@register(lax.reduce_window_sum_p, lax.reduce_window_max_p, lax.reduce_window_min_p)
def reduce_window_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    whole = _windowed_dims(eqn.params, len(shape_of(eqn.invars[0])))
    return _follow_keeping_whole(eqn, ctx, 0, whole, others_same=False)


@register(lax.reduce_window_p)
def generic_reduce_window_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    n = len(eqn.outvars)
    whole = _windowed_dims(eqn.params, len(shape_of(eqn.invars[0])))

    def derive(spec):
        spec = drop_dims(spec, whole)
        ins = tuple(spec if i < n else replicated(0) for i in range(len(eqn.invars)))
        ins = tuple(
            None if isinstance(v, Literal) else s for v, s in zip(eqn.invars, ins, strict=True)
        )
        return ins, (spec,) * n, 0.0

    return follow(eqn, ctx, 0, derive)


@register(lax.select_and_scatter_add_p, lax.select_and_gather_add_p)
def select_and_window_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    """Max-pool gradients. Operands: scatter-add (source, operand), the result of the
    operand's shape; gather-add (tangents, operand), both of the input's shape. The
    windowed dims stay whole, so one spec serves both operands and the result."""
    whole = _windowed_dims(eqn.params, len(shape_of(eqn.invars[1])))

    def derive(spec):
        spec = drop_dims(spec, whole)
        return (spec, spec), (spec,), 0.0

    return follow(eqn, ctx, 1, derive)
