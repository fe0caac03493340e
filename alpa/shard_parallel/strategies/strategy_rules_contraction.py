"""Strategies of contractions and indexing: dot_general, convolution, gather and scatter.

These ops do not follow an operand: each mesh axis picks a *role* independently, and the
strategies are all combinations (paper §4.1, Table 2). For ``dot_general`` the roles are a
batch dimension (split both operands and the result), a free dimension of either operand
(split it and the matching result dimension), or a contracting dimension (split both operands;
each device holds a partial sum, so the result is all-reduced over that axis; with
``prefer_reduce_scatter`` a variant reduce-scatters it into a split result dimension instead,
priced as the all-reduce less the all-gather that restores the result, as Alpa does).
Convolutions have the same three roles through their dimension numbers. For gather and
scatter the roles are an index (batch) dimension, a dimension the slices keep whole, and the
indexed dimension of the table (Megatron's vocabulary-parallel embedding).

Heavy ops (dot, convolution) must use every mesh axis unless ``allow_recompute_heavy_op``:
a strategy that leaves an axis unused repeats the same FLOPs on its devices.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from jax import lax
from jax.extend.core import JaxprEqn, Literal

from alpa.shard_parallel.strategies.sharding_spec import Spec, divides, format_spec, mesh_axes
from alpa.shard_parallel.strategies.strategy_rules import (
    NodeStrategies,
    RuleContext,
    Strategy,
    register,
    replicated_strategy,
    shape_of,
)

# A role places one mesh axis: (kind, index). ``dims`` of a role name, per operand and for the
# result, the dimension that the axis splits (or None).


def _combine(ctx: RuleContext, roles: list, num_tensors: int):
    """Yield ``(role_per_axis, specs)``: for every assignment of roles to the mesh axes,
    the spec of each tensor. ``roles`` holds ``(label, dims_per_tensor)``."""
    axes = mesh_axes(ctx.mesh)
    options = [None, *range(len(roles))]
    for assignment in itertools.product(options, repeat=len(axes)):
        chosen = [r for r in assignment if r is not None]
        if len(set(chosen)) != len(chosen) and not ctx.allow_mixed_mesh_shape:
            continue
        specs = [dict() for _ in range(num_tensors)]
        for axis, r in zip(axes, assignment, strict=True):
            if r is None:
                continue
            for t, dim in enumerate(roles[r][1]):
                if dim is None:
                    continue
                specs[t].setdefault(dim, []).append(axis)
        yield assignment, specs


def _to_spec(dims: dict, rank: int) -> Spec:
    return tuple(tuple(dims.get(d, ())) for d in range(rank))


def _uses_all_axes(assignment) -> bool:
    return all(r is not None for r in assignment)


def _heavy_filter(ctx: RuleContext, strategies: list[tuple[bool, Strategy]]) -> list[Strategy]:
    if ctx.allow_recompute_heavy_op or not any(full for full, _ in strategies):
        return [s for _, s in strategies]
    return [s for full, s in strategies if full]


def _contraction_strategies(eqn, ctx, roles, ranks, shapes, partial_roles, in_count, heavy=True):
    """Strategies from roles; tensors are the ``in_count`` operands then the result."""
    strategies = []
    out_shape = shapes[-1]
    for assignment, dims in _combine(ctx, roles, len(ranks)):
        specs = [_to_spec(d, r) for d, r in zip(dims, ranks, strict=True)]
        if not all(divides(s, sp, ctx.mesh) for s, sp in zip(shapes, specs, strict=True)):
            continue
        out = specs[-1]
        reduce_axes = [
            a
            for a, r in zip(mesh_axes(ctx.mesh), assignment, strict=True)
            if r is not None and roles[r][0] in partial_roles
        ]
        comm = ctx.all_reduce(eqn, out, reduce_axes)
        name = " x ".join(format_spec(s, ctx.mesh) for s in specs[:in_count])
        name += f" = {format_spec(out, ctx.mesh)}"
        if reduce_axes:
            name += " AR" + "".join(map(str, reduce_axes))
        full = _uses_all_axes(assignment)
        ins = tuple(specs[:in_count])
        strategies.append((full, Strategy(name, (out,), ins, comm, reduce_axes=tuple(reduce_axes))))
        if ctx.prefer_reduce_scatter and len(reduce_axes) == 1:
            axis = reduce_axes[0]
            for d in range(len(out)):
                scattered = tuple((*a, axis) if i == d else a for i, a in enumerate(out))
                if out[d] or not divides(out_shape, scattered, ctx.mesh):
                    continue
                # Priced as Alpa prices it: the all-reduce it replaces less the all-gather
                # that restores the whole result (its bandwidth term, no latency).
                per_device = ctx.out_bytes(eqn, 0, out)
                cost = ctx.mesh.all_reduce_cost(per_device, axis) - ctx.mesh.all_gather_cost(
                    per_device, axis
                )
                rs_name = name.replace(" AR", " RS") + f"->{format_spec(scattered, ctx.mesh)}"
                rs = Strategy(rs_name, (scattered,), ins, cost, reduce_axes=(axis,))
                strategies.append((full, rs))
                break
    if not heavy:
        return [s for _, s in strategies]
    return _heavy_filter(ctx, strategies)


def dot_free_dims(eqn: JaxprEqn) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per operand of a ``dot_general``, its free dimensions (neither contracted nor a
    batch dimension of the dot) as ``(operand dim, result dim)``: the result holds the
    batch dimensions, then the lhs's free ones, then the rhs's."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    lhs_free = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    rhs_free = [d for d in range(len(rhs)) if d not in rc and d not in rb]
    first_rhs = len(lb) + len(lhs_free)
    return (
        tuple((d, len(lb) + i) for i, d in enumerate(lhs_free)),
        tuple((d, first_rhs + i) for i, d in enumerate(rhs_free)),
    )


@register(lax.dot_general_p)
def dot_general_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    out = shape_of(eqn.outvars[0])
    lhs_free, rhs_free = dot_free_dims(eqn)
    roles = []
    for i, (a, b) in enumerate(zip(lb, rb, strict=True)):
        roles.append(("batch", (a, b, i)))
    for d, o in lhs_free:
        roles.append(("lhs", (d, None, o)))
    for d, o in rhs_free:
        roles.append(("rhs", (None, d, o)))
    for a, b in zip(lc, rc, strict=True):
        roles.append(("contract", (a, b, None)))
    strategies = _contraction_strategies(
        eqn, ctx, roles, (len(lhs), len(rhs), len(out)), (lhs, rhs, out), {"contract"}, 2
    )
    strategies = [_literal_free(eqn, s) for s in strategies]
    return NodeStrategies(tuple(strategies))


def _literal_free(eqn: JaxprEqn, strategy: Strategy) -> Strategy:
    if not any(isinstance(v, Literal) for v in eqn.invars):
        return strategy
    ins = tuple(
        None if isinstance(v, Literal) else s
        for v, s in zip(eqn.invars, strategy.in_specs, strict=True)
    )
    return replace(strategy, in_specs=ins)


@register(lax.conv_general_dilated_p)
def conv_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    """Roles through the dimension numbers (``*_spec[0]`` is the batch or output-feature
    dimension, ``*_spec[1]`` the feature or input-feature dimension; spatial dimensions stay
    whole). JAX's backward pass swaps them: the kernel gradient's lhs "batch" is the
    activations' channels and its contracted "feature" is the real batch, so splitting the
    batch there is a ``contract`` role (an all-reduce of the kernel gradient).

    * ungrouped: ``batch``, ``out_feature`` (Megatron's column split), ``contract`` (the
      input features, all-reduced);
    * ``feature_group_count = G`` (a grouped or depthwise convolution and its input
      gradient): ``batch``, and ``group``: whole groups per device, which splits the lhs
      features, the kernel's output features and the result's features alike;
    * ``batch_group_count = G`` (the kernel gradient of a grouped convolution): ``group``
      over the lhs "batch" and the output features, and ``contract`` over the real batch.

    A ``group`` role needs every mesh axis it may use to divide ``G``.
    """
    dn = eqn.params["dimension_numbers"]
    lhs, rhs = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    out = shape_of(eqn.outvars[0])
    feature_groups = eqn.params["feature_group_count"]
    batch_groups = eqn.params["batch_group_count"]
    batch = ("batch", (dn.lhs_spec[0], None, dn.out_spec[0]))
    out_feature = ("out_feature", (None, dn.rhs_spec[0], dn.out_spec[1]))
    contract = ("contract", (dn.lhs_spec[1], dn.rhs_spec[1], None))
    if feature_groups == 1 and batch_groups == 1:
        roles = [batch, out_feature, contract]
    elif feature_groups != 1:
        group_role = ("group", (dn.lhs_spec[1], dn.rhs_spec[0], dn.out_spec[1]))
        roles = [batch] + ([group_role] if _groups_fit(ctx, feature_groups) else [])
    else:
        group_role = ("group", (dn.lhs_spec[0], dn.rhs_spec[0], dn.out_spec[1]))
        roles = ([group_role] if _groups_fit(ctx, batch_groups) else []) + [contract]
    strategies = _contraction_strategies(
        eqn, ctx, roles, (len(lhs), len(rhs), len(out)), (lhs, rhs, out), {"contract"}, 2
    )
    return NodeStrategies(tuple(strategies))


def _groups_fit(ctx: RuleContext, groups: int) -> bool:
    """Whether any assignment of mesh axes to one role leaves whole groups per device."""
    sizes = [ctx.mesh.shape[a] for a in mesh_axes(ctx.mesh)]
    if ctx.allow_mixed_mesh_shape and groups % math.prod(sizes):
        return False
    return all(groups % n == 0 for n in sizes)


# ----------------------------------------------------------------------------- gather/scatter


def _index_batch_dims(indices_rank: int) -> list[int]:
    """Dimensions of the indices that index (all but the index vector, which is last)."""
    return list(range(indices_rank - 1))


@register(lax.gather_p)
def gather_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    dn = eqn.params["dimension_numbers"]
    operand, indices = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    out = shape_of(eqn.outvars[0])
    slice_sizes = eqn.params["slice_sizes"]
    out_batch = [d for d in range(len(out)) if d not in dn.offset_dims]
    operand_offset = [
        d for d in range(len(operand))
        if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims
    ]  # fmt: skip
    roles = []
    for t in _index_batch_dims(len(indices)):
        op_dim = None
        if t in dn.start_indices_batching_dims:
            op_dim = dn.operand_batching_dims[dn.start_indices_batching_dims.index(t)]
        roles.append(("index", (op_dim, t, out_batch[t])))
    for i, d in enumerate(operand_offset):
        if slice_sizes[d] == operand[d]:
            roles.append(("offset", (d, None, dn.offset_dims[i])))
    for d in dn.collapsed_slice_dims:
        if d in dn.start_index_map and d not in dn.operand_batching_dims:
            roles.append(("contract", (d, None, None)))
    strategies = _contraction_strategies(
        eqn, ctx, roles, (len(operand), len(indices), len(out)), (operand, indices, out),
        {"contract"}, 2, heavy=False,
    )  # fmt: skip
    return NodeStrategies(tuple(_literal_free(eqn, s) for s in strategies))


@register(lax.scatter_add_p, lax.scatter_p, lax.scatter_mul_p, lax.scatter_max_p,
          lax.scatter_min_p, lax.scatter_sub_p)  # fmt: skip
def scatter_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    dn = eqn.params["dimension_numbers"]
    operand, indices, updates = (shape_of(v) for v in eqn.invars[:3])
    update_scatter = [d for d in range(len(updates)) if d not in dn.update_window_dims]
    operand_window = [
        d for d in range(len(operand))
        if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims
    ]  # fmt: skip
    additive = eqn.primitive in (lax.scatter_add_p, lax.scatter_sub_p)
    # Tensors: operand, indices, updates, result (= operand's layout).
    roles = []
    for t in _index_batch_dims(len(indices)):
        if t in dn.scatter_indices_batching_dims:
            op_dim = dn.operand_batching_dims[dn.scatter_indices_batching_dims.index(t)]
            roles.append(("index", (op_dim, t, update_scatter[t], op_dim)))
        elif additive:
            roles.append(("contract", (None, t, update_scatter[t], None)))
    for i, d in enumerate(operand_window):
        if updates[dn.update_window_dims[i]] == operand[d]:
            roles.append(("window", (d, None, dn.update_window_dims[i], d)))
    for d in dn.inserted_window_dims:
        if d in dn.scatter_dims_to_operand_dims and d not in dn.operand_batching_dims:
            roles.append(("indexed", (d, None, None, d)))
    ranks = (len(operand), len(indices), len(updates), len(operand))
    strategies = _contraction_strategies(
        eqn, ctx, roles, ranks, (operand, indices, updates, operand), {"contract"}, 3, heavy=False
    )
    if not strategies:
        return replicated_strategy(eqn)
    return NodeStrategies(tuple(_literal_free(eqn, s) for s in strategies))
