"""The branches of a ``lax.cond`` are planned together, and a ``while`` loop's body as a
scan's.

Each branch's equations are nodes of the strategy graph, priced as if every branch ran, and
each result of the ``cond`` is a node that every branch's value is resharded into, so the
branches return one sharding (``strategy_graph_bodies.BodyPlanning._add_cond``); the
lowering keeps the ``cond`` and pins each branch's values and results
(``constrained_eval._cond_with_constraints``).
Oracles, on the 8 virtual CPU devices:

* a ``cond`` of two copies of one column-parallel layer is planned as the step that runs
  both copies: the same ILP optimum, the same weight split;
* the numbers equal ``jax.jit``'s for either branch taken, differentiated through the
  ``cond`` too (its transpose is another ``cond``), and the program keeps its branches;
* a ``while`` loop is priced at ``WHILE_TRIP_COUNT`` (1) iterations: its plan and optimum
  are those of the step that runs its body once, and its numbers equal ``jax.jit``'s;
* ``optax.MultiSteps`` (its update is one ``cond``) shards the GPT's parameters and
  optimizer state as the plain chain does: at most 1.15x its bytes per device, and two
  steps equal ``jax.jit``'s.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import alpa
from alpa.model.gpt import FlaxGPTForLMModule, GPTConfig, get_gpt_train_state_and_step
from alpa.model.model_util import create_train_state
from alpa.shard_parallel.auto_sharding import solve_auto_sharding
from alpa.shard_parallel.strategies.strategy_graph_bodies import WHILE_TRIP_COUNT
from alpa.testing import assert_allclose
from alpa.testing import run_auto_sharded as _compile
from alpa.testing import unit_cost_mesh as _mesh
from alpa.tracing.trace import trace_step

H, B = 256, 8


def _column(x, w):
    return jnp.tanh(x @ w["a"])


def _two_layers(x, w):
    return jnp.tanh(x @ w["a"]) @ w["b"]


def _inputs(flag: bool = True):
    k = jax.random.split(jax.random.key(0), 3)
    w = {
        "a": jax.random.normal(k[0], (H, 4 * H)) * 0.1,
        "b": jax.random.normal(k[1], (4 * H, H)) * 0.1,
        "flag": jnp.array(flag),
    }
    return w, {"x": jax.random.normal(k[2], (B, H))}


def _solve(step, w, batch, shape):
    traced = trace_step(step, (w, batch), (), (1,), (), ("w", "batch"))
    return solve_auto_sharding(traced, _mesh(shape))


@pytest.mark.parametrize("shape", [(1, 8), (2, 4)])
def test_a_cond_is_planned_as_running_both_branches(shape):
    def with_cond(w, batch):  # two branch bodies of the same layer
        return lax.cond(w["flag"], _column, lambda x, w: _column(x, w), batch["x"], w)

    def both(w, batch):
        return _column(batch["x"], w), _column(batch["x"], w)

    w, batch = _inputs()
    planned = _solve(with_cond, w, batch, shape)
    reference = _solve(both, w, batch, shape)
    assert planned.solution.status == reference.solution.status == "optimal"
    assert planned.objective == pytest.approx(reference.objective, rel=1e-9)
    spec = planned.to_sharding_plan().in_specs[0]
    assert spec == reference.to_sharding_plan().in_specs[0] == P(None, "y")  # column split
    opaque = [row for row in planned.rows() if row[2] == "opaque"]
    assert not opaque, opaque


@pytest.mark.parametrize("flag", [True, False])
def test_cond_branches_agree_and_match_serial(flag):
    """Branches whose own plans would leave their results in different specs (a
    row-parallel pair of layers, an elementwise op of the input) return one sharding; the
    gradient goes through the ``cond``'s transpose."""

    def loss(w, batch):
        h = lax.cond(w["flag"], _two_layers, lambda x, w: jnp.sin(x) * 2.0, batch["x"], w)
        return jnp.mean(h**2)

    def step(w, batch):
        def weights_loss(a, b):
            return loss({"a": a, "b": b, "flag": w["flag"]}, batch)

        return jax.value_and_grad(weights_loss, argnums=(0, 1))(w["a"], w["b"])

    w, batch = _inputs(flag)
    out, executable = _compile(step, w, batch, (2, 4))
    assert_allclose(out, jax.jit(step)(w, batch), rtol=1e-4, atol=1e-6)
    hlo = executable.get_hlo_text()
    assert len(re.findall(r" conditional\(", hlo)) == 2  # forward and transposed
    plan = executable.plan
    assert plan.in_specs[0] != P()  # the weights are split inside the branches


@pytest.mark.parametrize("shape", [(1, 8), (2, 4)])
def test_a_while_loop_is_planned_as_one_iteration(shape):
    assert WHILE_TRIP_COUNT == 1

    def looped(w, batch):
        def body(carry):
            return _two_layers(carry[0], w), carry[1] + 1

        return lax.while_loop(lambda c: c[1] < w["n"], body, (batch["x"], 0))[0]

    def once(w, batch):
        return _two_layers(batch["x"], w)

    w, batch = _inputs()
    w["n"] = jnp.array(3)
    planned = _solve(looped, w, batch, shape)
    reference = _solve(once, w, batch, shape)
    assert planned.objective == pytest.approx(reference.objective, rel=1e-9)
    specs = planned.to_sharding_plan().in_specs[:2]
    assert specs == reference.to_sharding_plan().in_specs[:2]
    assert not [row for row in planned.rows() if row[2] == "opaque"]
    out, executable = _compile(looped, w, batch, shape)
    assert_allclose(out, jax.jit(looped)(w, batch), rtol=1e-4, atol=1e-4)
    assert len(re.findall(r" while\(", executable.get_hlo_text())) == 1


# ----------------------------------------------------------------------------- MultiSteps


def _gpt_state(multi_steps: bool):
    config = GPTConfig(hidden_size=256, num_layers=4, num_heads=4, seq_len=32, vocab_size=1024)
    _, batch, step = get_gpt_train_state_and_step(config, 2)
    # Adam's first update is lr * g / (|g| + eps): with the default eps (1e-8) an element
    # whose gradient is rounding noise moves by +-lr either way, so eps is raised to keep
    # the comparison with jax.jit well conditioned (memory is the same).
    tx = optax.adam(1e-3, eps=1e-3)
    if multi_steps:
        tx = optax.MultiSteps(tx, every_k_schedule=2)
    inputs = (batch["input_ids"], batch["position_ids"])
    return create_train_state(FlaxGPTForLMModule(config), inputs, tx, 0, False), batch, step


def _sharded_leaves(specs) -> int:
    return sum(any(a is not None for a in s.sharding_specs[0]) for s in jax.tree.leaves(specs))


def test_multi_steps_is_sharded_as_the_plain_chain():
    measured = {}
    for multi_steps in (False, True):
        state, batch, step = _gpt_state(multi_steps)
        p_step = alpa.parallelize(step, method=alpa.ShardParallel(), donate_argnums=())
        executable = p_step.get_executable(state, batch)
        specs = executable.get_input_placement_specs()[0]
        measured[multi_steps] = (
            executable.get_total_allocation_size(),
            _sharded_leaves(specs.params),
            _sharded_leaves(specs.opt_state),
        )
        if multi_steps:  # two steps: one accumulates, one applies the update
            ours, theirs = state, state
            for _ in range(2):
                ours, _ = p_step(ours, batch)
                theirs, _ = jax.jit(step)(theirs, batch)
            assert_allclose(ours.params, theirs.params, rtol=1e-4, atol=1e-4)
            assert_allclose(ours.opt_state, theirs.opt_state, rtol=1e-4, atol=1e-4)
    (plain_bytes, plain_params, _), (multi_bytes, multi_params, multi_state) = (
        measured[False],
        measured[True],
    )
    assert plain_params > 0  # the plain chain is split at this size
    assert multi_bytes <= 1.15 * plain_bytes, measured
    assert multi_params >= plain_params and multi_state > 0, measured
