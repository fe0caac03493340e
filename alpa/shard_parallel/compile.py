"""A step's ``ShardingPlan`` compiled by XLA on its mesh: ``shard_parallel/lowering.py``'s
step function, jitted with the plan's shardings and the step's donations. The one-mesh
executables wrap what this returns; the measured stage cost times it directly."""

from __future__ import annotations

import logging
import time

import jax
from jax.sharding import NamedSharding

from alpa.global_env import global_config
from alpa.shard_parallel.lowering import build_step_function
from alpa.shard_parallel.sharding_plan import ShardingPlan
from alpa.tracing import TracedStep

logger = logging.getLogger(__name__)


def full_batch_avals(traced: TracedStep, num_micro_batches: int | None):
    """Input avals at the size the caller passes: batch leaves times ``k`` on dim 0."""
    k = num_micro_batches or 1
    avals = []
    for aval, is_batch in zip(traced.in_avals, traced.batch_invars, strict=True):
        shape = aval.shape
        if is_batch and k > 1:
            shape = (shape[0] * k,) + tuple(shape[1:])
        avals.append(jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type))
    return avals


def donated_argnums(traced: TracedStep) -> tuple[int, ...]:
    """Positions, among the dynamic arguments, of those whose buffers are donated (a
    dynamic argument is donated as a whole, so its first leaf says)."""
    donated, start = [], 0
    for position, subtree in enumerate(traced.in_tree.children()):
        if subtree.num_leaves and traced.donated_invars[start]:
            donated.append(position)
        start += subtree.num_leaves
    return tuple(donated)


def compile_plan(traced: TracedStep, plan: ShardingPlan, num_micro_batches: int | None):
    """``(compiled, in_shardings)``: ``traced`` lowered with ``plan`` and compiled for the
    full batch (``num_micro_batches`` micro-batches of it); ``compiled`` takes the dynamic
    arguments as the user's pytrees."""
    mesh = plan.logical_mesh.get_jax_mesh()
    in_shardings = tuple(NamedSharding(mesh, s) for s in plan.in_specs)
    out_shardings = tuple(None if s is None else NamedSharding(mesh, s) for s in plan.out_specs)
    inner = build_step_function(traced, plan, mesh, num_micro_batches)
    in_tree, out_tree = traced.in_tree, traced.out_tree

    def step(*dynamic_args):
        return jax.tree.unflatten(out_tree, inner(*jax.tree.leaves(dynamic_args)))

    jitted = jax.jit(
        step,
        in_shardings=jax.tree.unflatten(in_tree, in_shardings),
        out_shardings=jax.tree.unflatten(out_tree, out_shardings),
        donate_argnums=donated_argnums(traced),
    )
    tic = time.perf_counter()
    lowered = jitted.lower(
        *jax.tree.unflatten(in_tree, full_batch_avals(traced, num_micro_batches))
    )
    compiled = lowered.compile()
    if global_config.print_compilation_time:
        logger.warning(
            "compiled %s (%s) in %.2f s", traced.name, plan.method, time.perf_counter() - tic
        )
    return compiled, in_shardings
