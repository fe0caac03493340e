"""The cost model with a cluster profile (``stage_work``), against closed forms, and one
price for one stage wherever it is read: the stage DP's table, ``plan.cost``, the schedule
candidates and the plan's predicted step time. No device is used.

The profile is ``test_cost_profile.make_profile``'s: matmuls at 1e10 FLOP/s, memory-bound
work at 1e-10 s per byte, every collective ``1e-4 s + bytes / 1e9``, 8 devices of a host at
a quarter of their solo rate when all work at once (a shared host: virtual CPU devices).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_auto_stages import make_train_step, mlp_state
from test_cost_profile import DOT_RATE, make_profile

import alpa
from alpa.device_mesh import ClusterSpec, LogicalDeviceMesh, VirtualPhysicalMesh
from alpa.pipeline_parallel.scheduling.schedule_choice import makespan
from alpa.pipeline_parallel.scheduling.schedules import make_schedule
from alpa.pipeline_parallel.stages.stage_construction import AutoStageOption
from alpa.pipeline_parallel.stages.stage_cost import AnalyticStageCost
from alpa.pipeline_parallel.stages.stage_search import stages_for_schedule
from alpa.pipeline_parallel.stages.stage_work import (
    estimated_instructions,
    host_bound,
    instructions_per_micro_batch,
    shared_makespan,
)
from alpa.shard_parallel.strategies.strategy_costs import local_dot_dims
from alpa.shard_parallel.strategies.strategy_graph import build_strategy_graph
from alpa.shard_parallel.strategies.strategy_graph_record import GraphOptions

PROFILED = ClusterSpec.preset("cpu", 1, 8).with_profile(make_profile())


def _plan(stage_option, schedule="1f1b", k=8, cluster=PROFILED, recorded=None):
    state, batch = mlp_state((64,) * 4, 4 * k, abstract=True)
    method = alpa.PipeshardParallel(
        devices=cluster,
        num_micro_batches=k,
        layer_option=alpa.AutoLayerOption(layer_num=4),
        stage_option=stage_option,
        pipeline_schedule=schedule,
    )
    return alpa.parallelize(make_train_step(alpa.value_and_grad), method=method).plan(state, batch)


def test_one_price_for_one_stage():
    """The DP's table, ``plan.cost``, the schedule candidates and the plan's prediction
    give the same seconds and bytes for the same stages."""
    seen = {}

    def recording(problem):
        seen["costs"] = AnalyticStageCost()(problem)
        seen["problem"] = problem
        return seen["costs"]

    plan = _plan(AutoStageOption(cost_model=recording), schedule="auto")
    costs, problem = seen["costs"], seen["problem"]
    stage_plan = plan.stage_plan
    cost = plan.cost
    # Seconds: each stage's latency in the table is the plan's.
    entries = []
    for s, layers in enumerate(stage_plan.stage_layers()):
        m = problem.submesh_choices.index(tuple(stage_plan.submesh_shapes[s]))
        c = next(
            c
            for c, config in enumerate(problem.configs[m])
            if config.shape == tuple(plan.logical_meshes[s].shape)
        )
        entries.append((layers[0], layers[-1], m, c))
    table = [float(costs.compute_cost[i, j, m, c]) for i, j, m, c in entries]
    assert cost.latencies == pytest.approx(table, rel=1e-9)
    assert stage_plan.latencies == pytest.approx(table, rel=1e-9)
    # Bytes: the table's memory (one micro-batch in flight) is the stages' priced by the
    # same model with their micro-batches in flight (1F1B: stage s holds S - s).
    S = plan.num_stages
    raw = plan.price_stages(
        [
            (layers, stage_plan.submesh_shapes[s], plan.logical_meshes[s].shape, plan.options[s])
            for s, layers in enumerate(stage_plan.stage_layers())
        ]
    )
    for s, (i, j, m, c) in enumerate(entries):
        per = float(costs.per_micro_batch_memory[i, j, m, c])
        assert per == pytest.approx(cost.activation_memory[s], rel=1e-9)
        in_flight = min(S - s, plan.num_micro_batches)
        one = float(costs.memory[i, j, m, c])
        assert raw.memory[s] == pytest.approx(one + (in_flight - 1) * per, rel=1e-9)
    # The step: the schedule's candidate, the plan's prediction and its cost agree.
    chosen = next(c for c in plan.schedule_candidates if c.name == plan.schedule.name)
    assert plan.predicted_cost == pytest.approx(chosen.seconds, rel=1e-9)
    assert cost.step_seconds == pytest.approx(chosen.seconds, rel=1e-9)
    timeline = makespan(plan.schedule, cost.latencies)
    assert cost.step_seconds == pytest.approx(plan.step_bound(cost.latencies)(timeline), rel=1e-9)


def test_a_shared_host_runs_the_schedule_at_its_concurrency():
    """Two stages on 4 devices each of a host whose devices run at a quarter of their solo
    rate when all 8 work (at half of it when 4 do: log-linear): the schedule runs task by
    task with each stage at g(busy) / g(4) of its priced speed (``shared_makespan``). The
    oracles: with a profile whose devices own their compute it is the timeline's
    makespan; one stage alone is never slowed; shared, it is no shorter than the
    schedule's own time nor than the host's total work; the plan's step is it."""
    option = alpa.ManualStageOption([[0, 1], [2, 3]], [(1, 4), (1, 4)], [(4, 1), (4, 1)])
    plan = _plan(option)
    cost = plan.cost
    profile = PROFILED.profile
    B = plan.num_micro_batches
    g4, g8 = profile.concurrency_factor(4), profile.concurrency_factor(8)
    assert g4 == pytest.approx(0.5) and g8 == 0.25
    schedule = plan.schedule
    timeline = makespan(schedule, cost.latencies)
    own = make_profile(concurrency={1: 1.0})  # every device at its solo rate
    assert shared_makespan(own, schedule, cost.latencies, [4, 4]) == pytest.approx(timeline)
    alone = make_schedule("1f1b", 1, B)
    assert shared_makespan(profile, alone, [0.5], [4]) == pytest.approx(B * 0.5)
    shared = shared_makespan(profile, schedule, cost.latencies, [4, 4])
    total_work = host_bound(profile, cost.latencies, [(1, 4), (1, 4)], B, 8)
    assert total_work == pytest.approx(B * sum(4 * t * g4 / g8 for t in cost.latencies) / 8)
    assert shared >= max(timeline, total_work) * (1 - 1e-9) and shared > timeline
    instructions = estimated_instructions(2, B) * profile.instruction_seconds
    assert cost.step_seconds == pytest.approx(max(shared, instructions))
    assert plan.predicted_cost == cost.step_seconds
    # Without a profile: the schedule alone, as before.
    plain = _plan(option, cluster=ClusterSpec.preset("cpu", 1, 8))
    assert plain.cost.step_seconds == pytest.approx(
        sum(plain.cost.latencies) + (B - 1) * max(plain.cost.latencies)
    )


def test_a_stage_latency_adds_its_instructions_and_transfers_at_the_measured_rates():
    """The second of two one-layer stages pays, per micro-batch, 4 instructions at the
    profile's seconds and the measured cross-mesh curve twice for what enters it; the
    first pays 2 instructions and no transfer."""
    assert instructions_per_micro_batch(True) == 2 and instructions_per_micro_batch(False) == 4
    option = alpa.ManualStageOption([[0, 1], [2, 3]], [(1, 1), (1, 1)])
    profile = make_profile(cross_mesh=None)
    base = _plan(option, cluster=ClusterSpec.preset("cpu", 1, 8).with_profile(profile))
    costlier = dataclasses.replace(profile, instruction_seconds=profile.instruction_seconds + 1.0)
    more = _plan(option, cluster=ClusterSpec.preset("cpu", 1, 8).with_profile(costlier))
    added = np.subtract(more.cost.latencies, base.cost.latencies)
    assert added == pytest.approx([2.0, 4.0])


def test_a_matmul_is_priced_at_the_rate_of_its_per_device_shape():
    """``dot_general`` of (64, 256) @ (256, 16) on a (2, 4) mesh with rates: each strategy's
    compute is the table's seconds at its per-device shape, at 8 devices' concurrency, plus
    its share of the result at the memory-bound rate."""
    cluster = ClusterSpec.preset("cpu", 1, 8).with_profile(make_profile())
    mesh = VirtualPhysicalMesh(1, 8, cluster=cluster).get_logical_mesh((2, 4))
    closed = jax.make_jaxpr(lambda a, b: a @ b)(jnp.zeros((64, 256)), jnp.zeros((256, 16)))
    graph = build_strategy_graph(closed, mesh, GraphOptions())
    eqn = closed.jaxpr.eqns[0]
    (node,) = [n for n in graph.nodes if n.label.endswith("dot_general")]
    table = cluster.profile.dot_table("float32")
    assert len(node.strategies) > 3
    for strategy in node.strategies:
        b, m, k, n = local_dot_dims(eqn, strategy, mesh)
        assert b * m * k * n * 2 <= 2 * 64 * 256 * 16
        written = (
            64 * 16 * 4 / np.prod([mesh.shape[a] for axes in strategy.out_specs[0] for a in axes])
        )
        memory = cluster.profile.memory(written)  # at least its 1 KiB point's seconds
        expected = 2 * b * m * k * n / (table.rate(m, k, n) * 0.25) + memory / 0.25
        assert strategy.compute_cost == pytest.approx(expected, rel=1e-9)
    assert table.best_rate == pytest.approx(DOT_RATE)


def test_plans_without_a_profile_price_as_before():
    mesh = LogicalDeviceMesh((2, 4))
    closed = jax.make_jaxpr(lambda a, b: a @ b)(jnp.zeros((64, 256)), jnp.zeros((256, 16)))
    graph = build_strategy_graph(closed, mesh, GraphOptions())
    (node,) = [n for n in graph.nodes if n.label.endswith("dot_general")]
    flops = 2 * 64 * 256 * 16
    full = min(s.compute_cost for s in node.strategies)
    assert full == pytest.approx(flops / 8 / 1000.0 + 64 * 16 * 4 / 8 / 10.0)
    schedule = make_schedule("1f1b", 2, 4)
    assert makespan(schedule, [1.0, 2.0]) == pytest.approx(3.0 + 3 * 2.0)


def test_on_a_shared_host_the_search_is_no_slower_than_hand_plans_priced_alike():
    """Where the host's throughput bounds the step (8 devices sharing a host's cores: one
    device runs at 1/8 of its solo rate when all work, so pipelining gains nothing), the
    search also takes the plan of least total work (``stage_work.host_work_table``): the
    stage DP's own plan, which pipelines, is slower under the same model, and the
    searched plan is no slower than any of these hand plans priced alike."""
    profile = make_profile(concurrency={1: 1.0, 8: 0.125}, instruction_seconds=0.0, cross_mesh=None)
    cluster = ClusterSpec.preset("cpu", 1, 8).with_profile(profile)

    def plan(option):
        state, batch = mlp_state((512,) * 4, 64 * 8, abstract=True)
        method = alpa.PipeshardParallel(
            devices=cluster,
            num_micro_batches=8,
            layer_option=alpa.AutoLayerOption(layer_num=4),
            stage_option=option,
        )
        step = alpa.parallelize(make_train_step(alpa.value_and_grad), method=method)
        return step.plan(state, batch)

    searched = plan(AutoStageOption())
    pipelined = stages_for_schedule(searched.stage_plan, "1f1b")  # the DP alone
    assert pipelined is not searched.stage_plan
    assert searched.predicted_cost < pipelined.predicted_cost
    hands = [
        alpa.ManualStageOption([[0, 1, 2, 3]], [(1, 8)], [(8, 1)]),
        alpa.ManualStageOption([[0, 1], [2, 3]], [(1, 4), (1, 4)], [(4, 1), (4, 1)]),
        alpa.ManualStageOption([[0], [1], [2], [3]], [(1, 2)] * 4, [(2, 1)] * 4),
    ]
    for hand in hands:
        assert searched.predicted_cost <= plan(hand).cost.step_seconds * (1 + 1e-9), hand
