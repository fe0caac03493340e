"""Strategies of random number generation: each device draws only its shard.

JAX's ``random_bits`` on a threefry key (``jax_threefry_partitionable``, the default since
JAX 0.5) computes element ``i`` of its result as ``threefry2x32(key, i)`` with ``i`` the
element's linear index in the *whole* result. The value of an element therefore does not
depend on how the result is split, and XLA's SPMD partitioner, given a split result,
partitions the counter iota and the threefry rounds with it: each device hashes only the
counters of its own shard, and the numbers equal the serial ones.

So ``random_bits`` is a generator: its result may take any spec. Its key operand is small
(one key, or one per row of a batch of keys) and is read in the spec of the result's
leading key dimensions, whole elsewhere. The key ops (``random_seed``, ``random_wrap``,
``random_unwrap``, ``random_fold_in``) follow their key operand; ``random_split`` draws
new keys like ``random_bits`` draws words, so it is a generator too.

The rules state no cost of their own: the strategy graph prices each strategy's work
(``strategy_costs.work_cost``), in which a replicated draw writes the whole result on every
device and a split one only its shard, and the ILP weighs that against the communication a
split draw may need downstream.
"""

from __future__ import annotations

from jax.extend.core import JaxprEqn, Literal

from alpa.shard_parallel.strategies.sharding_spec import Spec, enumerate_specs, format_spec
from alpa.shard_parallel.strategies.strategy_rules import (
    NodeStrategies,
    RuleContext,
    Strategy,
    follow,
    pick_followed,
    register,
    replicated_strategy,
    same_spec_operands,
    shape_of,
)


def _key_spec(spec: Spec, key_rank: int, operand_rank: int) -> Spec:
    """The operand's spec: the result's key dimensions as they are, the rest whole."""
    return tuple(spec[:key_rank]) + ((),) * (operand_rank - key_rank)


@register("random_bits", "random_split")
def draw_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    """Any result spec; the key read in the spec of the result's key dimensions."""
    key = eqn.invars[0]
    key_rank = len(shape_of(key))
    out_shape = shape_of(eqn.outvars[0])
    strategies = []
    for spec in enumerate_specs(out_shape, ctx.mesh, ctx.allow_mixed_mesh_shape):
        key_spec = None if isinstance(key, Literal) else _key_spec(spec, key_rank, key_rank)
        strategies.append(Strategy(format_spec(spec, ctx.mesh), (spec,), (key_spec,)))
    return NodeStrategies(tuple(strategies))


@register("random_seed", "random_fold_in")
def key_elementwise_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    """One key per seed (per key and message, broadcast): the result follows an operand
    of its shape."""
    shape = shape_of(eqn.outvars[0])
    index = pick_followed(eqn, ctx, shape)
    if index is None:
        return replicated_strategy(eqn)
    return follow(eqn, ctx, index, lambda s: (same_spec_operands(eqn, s, shape), (s,), 0.0))


@register("random_wrap")
def random_wrap_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    """``u32[*K, 2] -> key[*K]``: the key data's trailing dimensions stay whole."""
    key_rank = len(shape_of(eqn.outvars[0]))
    rank = len(shape_of(eqn.invars[0]))

    def derive(spec):
        kept = _key_spec(spec, key_rank, rank)
        return (kept,), (kept[:key_rank],), 0.0

    return follow(eqn, ctx, 0, derive)


@register("random_unwrap")
def random_unwrap_rule(eqn: JaxprEqn, ctx: RuleContext) -> NodeStrategies:
    """``key[*K] -> u32[*K, 2]``: the key data's trailing dimensions whole."""
    rank = len(shape_of(eqn.outvars[0]))
    return follow(eqn, ctx, 0, lambda s: ((s,), (tuple(s) + ((),) * (rank - len(s)),), 0.0))
