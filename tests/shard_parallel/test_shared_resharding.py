"""A resharding that several readers share is priced once (``shared_resharding``).

The lowering reshards a value once per spec that some reader needs, and every reader of
that spec takes the one copy. The ILP priced one resharding per reading edge; with a
resharding node per value that readers may read in one spec, it prices what the program
does. Oracles: the collectives in the compiled HLO, Alpa's closed form of the all-to-all,
and the same ILP without the nodes (never cheaper, and dearer by exactly the resharding
that two readers shared).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import alpa
from alpa.shard_parallel.auto_sharding import solve_auto_sharding
from alpa.shard_parallel.ilp import ilp_solver
from alpa.shard_parallel.strategies.strategy_graph import build_strategy_graph
from alpa.shard_parallel.strategies.strategy_graph_record import GraphOptions
from alpa.testing import assert_allclose, run_auto_sharded, unit_cost_mesh
from alpa.tracing.jaxpr_util import is_grad_marker
from alpa.util import count_communication_primitives

B, H = 1024, 16


def _mlp_step(params, batch):
    def loss_fn(p):
        h = jnp.maximum(batch["x"] @ p["w0"], 0.0)
        return jnp.mean((h @ p["w1"] - batch["y"]) ** 2)

    grads = jax.grad(loss_fn)(params)
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)


def _inputs():
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "w0": jax.random.normal(k[0], (H, H)) * 0.1,
        "w1": jax.random.normal(k[1], (H, H)) * 0.1,
    }
    batch = {"x": jax.random.normal(k[2], (B, H)), "y": jax.random.normal(k[3], (B, H))}
    return params, batch


def test_two_readers_of_one_spec_share_one_all_to_all():
    """``x`` (1024 x 16) arrives split by features over the 4 devices of a (1, 4) mesh. The
    plan is data parallel, so ``x`` moves to the batch split by one all-to-all, read there
    by the first matmul and by its kernel gradient. The program makes one all-to-all (and
    one all-reduce of both gradients); the plan prices one, at Alpa's closed form
    ``1 + 1.5 * 3/16 * 65536`` (the whole tensor the 4 devices exchange). Without the
    shared resharding node the ILP priced two."""
    params, batch = _inputs()
    user_mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("a", "b"))
    placed = dict(batch, x=jax.device_put(batch["x"], NamedSharding(user_mesh, P(None, "b"))))
    out, executable = run_auto_sharded(_mlp_step, params, placed, (1, 4))
    assert_allclose(out, jax.jit(_mlp_step)(params, batch), rtol=1e-4, atol=1e-4)
    plan = executable.plan
    x = len(plan.in_specs) - 2  # the batch's leaves come last: x, y
    assert plan.in_specs[x] == P(None, "y")
    counts = count_communication_primitives(executable.get_hlo_text())
    assert (counts.all_to_all, counts.all_reduce, counts.total) == (1, 1, 2), counts

    mesh = plan.logical_mesh
    fixed = [None] * len(plan.in_specs)
    fixed[x] = P(None, "y")
    shared = solve_auto_sharding(executable.traced, mesh, fixed_in_specs=fixed)
    priced = ilp_solver.collectives(shared.graph, shared.solution.choice)
    # Two gradients all-reduced (XLA combines them into the program's one all-reduce).
    assert sorted(c.kind for _, _, c in priced) == ["all-reduce", "all-reduce", "all-to-all"]
    (a2a,) = [c for _, _, c in priced if c.kind == "all-to-all"]
    assert a2a.cost(mesh) == pytest.approx(1 + 1.5 * 3 / 16 * (B * H * 4))
    assert shared.objective - shared.compute == pytest.approx(executable.auto_sharding_objective)

    apart = solve_auto_sharding(
        executable.traced, mesh, fixed_in_specs=fixed, shared_reshardings=False
    )
    kinds = sorted(c.kind for _, _, c in ilp_solver.collectives(apart.graph, apart.solution.choice))
    assert kinds == ["all-reduce", "all-reduce", "all-to-all", "all-to-all"]
    assert apart.objective == pytest.approx(shared.objective + a2a.cost(mesh))


@pytest.mark.parametrize("shape", [(1, 4), (2, 2)])
def test_shared_reshardings_never_price_more(shape):
    """On a GPT and an MoE-GPT training step, the optimum with resharding nodes is never
    dearer than without (holding the producer's spec, a node prices each reader as
    before), and the graph has such nodes."""
    from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step
    from alpa.model.moe import MoEConfig, get_moe_train_state_and_step

    gpt = GPTConfig(hidden_size=32, num_layers=2, num_heads=4, seq_len=16, vocab_size=64)
    moe = MoEConfig(
        hidden_size=32, num_layers=2, num_heads=4, num_experts=4, seq_len=16, vocab_size=64,
        expert_group_size=16,
    )  # fmt: skip
    mesh = unit_cost_mesh(shape)
    for state, batch, step in (
        get_gpt_train_state_and_step(gpt, 8),
        get_moe_train_state_and_step(moe, 8),
    ):
        traced = (
            alpa.parallelize(step, method=alpa.ShardParallel(devices=mesh))
            .get_executable(state, batch)
            .traced
        )
        shared = solve_auto_sharding(traced, mesh)
        apart = solve_auto_sharding(traced, mesh, shared_reshardings=False)
        assert any(n.label.startswith("resharding of") for n in shared.graph.nodes)
        assert not any(n.label.startswith("resharding of") for n in apart.graph.nodes)
        assert shared.objective <= apart.objective * (1 + 1e-9)


def test_readers_on_both_sides_of_the_grad_marker_do_not_share():
    """Gradient accumulation splits the step at the ``alpa.grad`` marker into programs of
    their own (accumulate, apply), each resharding its own copy: a resharding node groups
    readers on one side of the marker only. The parameters are read on both sides (the
    forward's matmuls, the update)."""

    def step(params, batch):
        def loss_fn(p):
            return jnp.mean((jnp.maximum(batch["x"] @ p["w0"], 0.0) @ p["w1"]) ** 2)

        grads = alpa.grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g * w, params, grads)

    params, batch = _inputs()
    closed = jax.make_jaxpr(step)(params, batch)
    eqns = closed.jaxpr.eqns
    (marker,) = [t for t, e in enumerate(eqns) if is_grad_marker(e)]
    w0 = closed.jaxpr.invars[0]
    readers = [t for t, e in enumerate(eqns) if w0 in e.invars]
    assert min(readers) < marker < max(readers)  # read on both sides

    graph = build_strategy_graph(closed, unit_cost_mesh((1, 4)), GraphOptions())
    (marker,) = [t for t, e in enumerate(graph.jaxpr.eqns) if is_grad_marker(e)]
    side = {}
    for t, sources in enumerate(graph.eqn_sources):
        for node, _ in sources:
            side[node] = t > marker
    nodes = [n.id for n in graph.nodes if n.label.startswith("resharding of")]
    assert nodes
    for node in nodes:
        sides = {side[e.dst] for e in graph.edges if e.src == node}
        assert len(sides) == 1, graph.nodes[node].label
