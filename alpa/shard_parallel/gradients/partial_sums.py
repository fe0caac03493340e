"""Lowering of an ``add`` of two partial results: computed on each device, reduced once.

A contraction whose contracted dimension is split leaves each device a partial result, and
the plan reduces it where it is computed. When two such results are only ever added (the
tied input and output embedding's gradient: a scatter-add plus a matmul) and both reduce
over the same mesh axes into the same spec, the ILP prices one reduction of their sum
(``strategy_costs.partial_sum_discount``). XLA reduces each operand of the add on its own
(measured on CPU: a tuple all-reduce of both), so the lowering writes the plan out in
``shard_map``: both producers run on each device's blocks of their operands, in the specs
their strategies read them, the partial results are added, and the sum is reduced once,
all-reduced or, over an axis that splits the result, reduce-scattered.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.extend.core import Jaxpr, JaxprEqn, Var
from jax.lax import GatherScatterMode
from jax.sharding import PartitionSpec

from alpa.device_mesh import entry_names
from alpa.jax_internals import bind_params, eqn_context
from alpa.shard_parallel.gradients.row_sums import bind_eqn
from alpa.shard_parallel.sharding_plan import PartialSum
from alpa.shard_parallel.strategies.strategy_costs import partial_chain


class _Pending:
    """A producer's operands and the chain of equations after it, held until the add
    computes them on each device's blocks."""

    def __init__(self, operands, chain=()):
        self.operands = list(operands)
        self.chain = tuple(chain)


def partial_sum_overrides(
    jaxpr: Jaxpr,
    partial_sums: Mapping[JaxprEqn, PartialSum],
    var_specs: Mapping,
    mesh,
    skip=frozenset(),
) -> dict[JaxprEqn, Callable[[list], list]]:
    """``eval_jaxpr_with_constraints``'s ``overrides`` for the plan's ``partial_sums``: each
    producer (and each equation of the chain after it) hands its operands on, and the add
    computes, sums and reduces. Adds with an equation in ``skip`` (already overridden:
    gradient accumulation's deferred row sums) are left as they are."""
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    reads = Counter(v for e in jaxpr.eqns for v in e.invars if isinstance(v, Var))
    reads.update(v for v in jaxpr.outvars if isinstance(v, Var))
    overrides: dict = {}
    for add, plan in partial_sums.items():
        out_spec = var_specs.get(add.outvars[0])
        chains = [partial_chain(v, producer.get, reads) for v in add.invars]
        if out_spec is None or None in chains:
            continue
        if any(e in skip for e in (add, *chains[0], *chains[1])):
            continue
        for root, *chain in chains:
            overrides[root] = lambda operands: [_Pending(operands)]
            for e in chain:
                overrides[e] = lambda operands, e=e: [
                    _Pending(operands[0].operands, (*operands[0].chain, e))
                ]
        overrides[add] = _sum_rule(add, [c[0] for c in chains], plan, out_spec, mesh)
    return overrides


def _sum_rule(add: JaxprEqn, producers, plan: PartialSum, out_spec: PartitionSpec, mesh):
    reduce_axes = plan.reduce_axes

    def local_result(eqn: JaxprEqn, operands, specs):
        if eqn.primitive.name != "scatter-add":
            return bind_eqn(eqn, *operands)
        # the scattered-into operand counts once
        first = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in reduce_axes]))
        operands = [jnp.where(first, operands[0], jnp.zeros_like(operands[0])),
                    *operands[1:]]  # fmt: skip
        return scatter_add_on_block(eqn, operands, specs[0], mesh)

    def reduce(y):
        for axis in reduce_axes:
            dim = next((d for d, axes in enumerate(out_spec) if axis in entry_names(axes)), None)
            if dim is None:
                y = jax.lax.psum(y, axis)
            else:
                y = jax.lax.psum_scatter(y, axis, scatter_dimension=dim, tiled=True)
        return y

    def rule(operands):
        pending = operands
        values = [x for p in pending for x in p.operands]
        specs = [s for specs in plan.operand_specs for s in specs]
        is_array = [s is not None for s in specs]  # a literal has no spec
        counts = [len(p.operands) for p in pending]

        def local(*arrays):
            it = iter(arrays)
            full = [next(it) if a else x for x, a in zip(values, is_array, strict=True)]
            first, second = full[: counts[0]], full[counts[0] :]
            results = []
            for root, p, ops, op_specs in zip(
                producers, pending, (first, second), plan.operand_specs, strict=True
            ):
                y = local_result(root, ops, op_specs)
                for e in p.chain:
                    y = bind_eqn(e, y)
                results.append(y)
            summed = bind_eqn(add, *results)
            return reduce(summed)

        return [
            jax.shard_map(
                local,
                mesh=mesh,
                in_specs=tuple(s for s, a in zip(specs, is_array, strict=True) if a),
                out_specs=out_spec,
                check_vma=False,
            )(*[jnp.asarray(x) for x, a in zip(values, is_array, strict=True) if a])
        ]

    return rule


def scatter_add_on_block(eqn: JaxprEqn, operands, table_spec, mesh):
    """A scatter-add run on this device's block of its table (inside ``shard_map``), the
    table split at indexed dimensions by ``table_spec`` (Megatron's vocabulary-parallel
    embedding gradient): the indices are global, so each index into a split dimension is
    shifted by the block's start, and an update whose row falls outside the block is
    dropped. Where the equation clips its indices, they are clipped to the whole table
    first, as it would. Indexed dimensions are window-1 (``inserted_window_dims``), as the
    ``indexed`` strategies that split them require."""
    numbers = eqn.params["dimension_numbers"]
    table, indices, *rest = operands
    columns = [indices[..., k] for k in range(indices.shape[-1])]
    shifted = False
    for k, d in enumerate(numbers.scatter_dims_to_operand_dims):
        axes = entry_names(table_spec[d]) if table_spec is not None and d < len(table_spec) else ()
        if not axes:
            continue
        block = table.shape[d]
        position = jnp.zeros((), indices.dtype)
        for a in axes:
            position = position * mesh.shape[a] + jax.lax.axis_index(a).astype(indices.dtype)
        if eqn.params["mode"] != GatherScatterMode.FILL_OR_DROP:
            whole = block * math.prod(mesh.shape[a] for a in axes)
            columns[k] = jnp.clip(columns[k], 0, whole - 1)
        columns[k] = columns[k] - position * block
        shifted = True
    if not shifted:
        return bind_eqn(eqn, *operands)
    params = bind_params(eqn)
    params["mode"] = GatherScatterMode.FILL_OR_DROP
    with eqn_context(eqn):
        return eqn.primitive.bind(table, jnp.stack(columns, -1), *rest, **params)
