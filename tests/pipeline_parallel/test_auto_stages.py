"""Automatic stages (``stage_option="auto"``): numerics, plans with known answers, plans
for clusters that are not here, and errors."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa
from alpa.device_mesh import ClusterSpec
from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step
from alpa.model.mlp import MLPModel, get_mlp_train_state_and_step
from alpa.pipeline_parallel.stages.layer_facts import compute_layer_facts
from alpa.pipeline_parallel.stages.measured_stage_cost import CACHE_FORMAT, MeasuredStageCost
from alpa.pipeline_parallel.stages.stage_construction import (
    AutoStageOption,
    get_last_dp_result,
    place_submeshes,
)
from alpa.pipeline_parallel.stages.stage_cost import AnalyticStageCost
from alpa.pipeline_parallel.stages.stage_imbalance import imbalance_mask
from alpa.pipeline_parallel.stages.stage_problem import StageCosts
from alpa.saved_format import NewerFormatError
from alpa.testing import assert_allclose
from alpa.tracing.flops import jaxpr_flops


def _mlp(widths, batch_size, abstract, value_and_grad):
    """``(state, batch, train_step)`` of the MLP of examples/pipeshard_manual.py without its
    boundary, one Dense per entry of ``widths`` (all equal), relu between them, trained with
    Adam; ``train_step(state, batch) -> (state, loss)`` differentiates with
    ``value_and_grad``."""
    width = widths[0]
    assert set(widths) == {width}, widths
    model = MLPModel(hidden_size=width, num_layers=len(widths) - 1, output_dim=width)
    return get_mlp_train_state_and_step(
        model, batch_size, width, learning_rate=1e-2, grad_func=value_and_grad, abstract=abstract
    )


def make_train_step(value_and_grad):
    """The MLP's train step; it reads the model from the state, so one serves every width."""
    return _mlp((64, 64), 1, True, value_and_grad)[2]


def mlp_state(widths=(64, 64, 64, 64), batch_size=32, abstract=False):
    state, batch, _ = _mlp(tuple(widths), batch_size, abstract, jax.value_and_grad)
    return state, batch


def check_against_serial(step_fn, state, batch, method, steps=2):
    parallel = alpa.parallelize(step_fn(alpa.value_and_grad), method=method)
    serial = jax.jit(step_fn(jax.value_and_grad))
    # The parallel step donates the state it replaces: each steps a copy of the caller's.
    p_state, s_state = jax.tree.map(jnp.copy, state), jax.tree.map(jnp.copy, state)
    for _ in range(steps):
        # Each step waited for: XLA's CPU collectives can abort with steps queued
        # (docs/dispatch.md, known issues).
        p_state, p_loss = jax.block_until_ready(parallel(p_state, batch))
        s_state, s_loss = serial(s_state, batch)
    assert_allclose(p_state.params, s_state.params, rtol=1e-4, atol=1e-4)
    assert_allclose(p_loss, s_loss, rtol=1e-4, atol=1e-4)
    return parallel.get_last_executable()


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_micro_batches", [1, 4, 16])
def test_mlp_auto_layers_and_stages_match_serial(
    schedule, num_micro_batches, tmp_path, monkeypatch
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # get_last_dp_result's file
    state, batch = mlp_state()
    method = alpa.PipeshardParallel(
        num_micro_batches=num_micro_batches,
        layer_option=alpa.AutoLayerOption(layer_num=2),
        stage_option="auto",
        pipeline_schedule=schedule,
    )
    executable = check_against_serial(make_train_step, state, batch, method)
    plan = executable.plan
    assert plan.layers.num_layers == 2
    # The executable runs what the DP chose.
    path, layer_ids, shapes, logical, _ = get_last_dp_result()
    assert layer_ids == plan.stage_plan.stage_layers()
    assert [tuple(s) for s in shapes] == list(plan.stage_plan.submesh_shapes)
    assert sum(a * b for a, b in plan.stage_plan.submesh_shapes) == 8
    with np.load(path) as tables:
        assert tables["compute_cost"].shape[:2] == (2, 2)


def test_mlp_measured_cost_model_matches_serial_and_caches(tmp_path):
    cache = tmp_path / "costs.json"
    state, batch = mlp_state()
    option = AutoStageOption(cost_model="measured", profiling_database_filename=str(cache))
    method = alpa.PipeshardParallel(
        num_micro_batches=4, layer_option=alpa.AutoLayerOption(layer_num=2), stage_option=option
    )
    check_against_serial(make_train_step, state, batch, method, steps=1)
    data = json.loads(cache.read_text())
    assert data["format"] == CACHE_FORMAT
    entries = data["latencies"]
    assert entries and all(v > 0 for v in entries.values())
    # Planning again measures nothing: every candidate is in the cache.
    step = alpa.parallelize(make_train_step(alpa.value_and_grad), method=method)
    traced_plan = step.plan(state, batch)
    model = MeasuredStageCost(cache_file=str(cache))
    from alpa.pipeline_parallel.stages.stage_construction import StageContext
    from alpa.pipeline_parallel.stages.stage_search import stage_problem

    context = StageContext(
        2,
        ClusterSpec.local(),
        jax.devices(),
        traced_plan.traced,
        traced_plan.layers,
        traced_plan.names,
        4,
    )
    problem = stage_problem(option, context)
    model(problem)
    assert model.measured == 0
    # A cache of format 1 (the latencies alone, before the field) is read the same.
    cache.write_text(json.dumps(entries))
    model(problem)
    assert model.measured == 0 and json.loads(cache.read_text())["latencies"] == entries
    # One of a newer format is refused by name, and left as it is.
    newer = json.dumps({"format": CACHE_FORMAT + 1, "latencies": entries})
    cache.write_text(newer)
    with pytest.raises(
        NewerFormatError,
        match=rf"^{re.escape(repr(str(cache)))} is a stage-cost cache of format "
        rf"{CACHE_FORMAT + 1}, newer than this alpa reads .*cache_file=",
    ):
        model(problem)
    assert cache.read_text() == newer


def test_gpt_tied_embeddings_auto_matches_serial():
    config = GPTConfig(hidden_size=32, num_layers=4, num_heads=4, seq_len=8, vocab_size=64)
    assert config.tie_word_embeddings
    state, batch, _ = get_gpt_train_state_and_step(config, batch_size=16, optimizer="adam")

    def step_fn(value_and_grad):
        return get_gpt_train_state_and_step(
            config, batch_size=16, optimizer="adam", grad_func=value_and_grad, abstract=True
        )[2]

    for schedule, k in (("1f1b", 4), ("gpipe", 1)):
        method = alpa.PipeshardParallel(
            num_micro_batches=k,
            layer_option=alpa.AutoLayerOption(layer_num=2),
            stage_option="auto",
            pipeline_schedule=schedule,
        )
        check_against_serial(step_fn, state, batch, method, steps=1)


# ----------------------------------------------------------------------------- known answers


def _plan(widths, cluster, option, batch_size=64, k=16, layer_num=None):
    state, batch = mlp_state(widths, batch_size, abstract=True)
    method = alpa.PipeshardParallel(
        devices=cluster,
        num_micro_batches=k,
        layer_option=alpa.AutoLayerOption(layer_num=layer_num or len(widths)),
        stage_option=option,
    )
    return alpa.parallelize(make_train_step(alpa.value_and_grad), method=method).plan(state, batch)


SLOW_NETWORK = ClusterSpec(1, 8, 1e13, 1 << 34, 1e8, 1e8, name="slow-network")


class ClosedFormCost:
    """A ``StageCostModel`` with closed-form costs: layer ``l`` does ``work[l]`` on one
    device, split over ``n``, plus ``comm * (n - 1)`` of intra-op communication per layer;
    transfers between stages are free and memory is unbounded."""

    def __init__(self, work, comm):
        self.work, self.comm = work, comm

    def __call__(self, problem):
        L, M, C = problem.num_layers, len(problem.submesh_choices), problem.num_configs
        assert L == len(self.work)
        cost = np.full((L, L, M, C), np.inf)
        for m, (hosts, per_host) in enumerate(problem.submesh_choices):
            n = hosts * per_host
            for i in range(L):
                for j in range(i, L):
                    layers = range(i, j + 1)
                    cost[i, j, m, 0] = sum(self.work[x] / n + self.comm * (n - 1) for x in layers)
        return StageCosts(cost, np.full((L, L, M, C), L), np.zeros((L, L, M, C)))


def test_analytic_latency_is_flops_over_the_submesh_plus_communication():
    """On a free network (no latency, 1e30 B/s links) the analytic model's latency of a
    one-layer stage is F / (n R) in closed form (F: the layer's FLOPs, n: the submesh's
    devices, R = 1e13 FLOP/s): the ILP's communication is ~0 and its own compute estimate
    is not added on top."""
    free = ClusterSpec(
        1, 8, 1e13, 1 << 34, 1e30, 1e30, intra_node_latency=0.0, inter_node_latency=0.0
    )
    seen = {}

    def recording(problem):
        seen["problem"], seen["costs"] = problem, AnalyticStageCost()(problem)
        return seen["costs"]

    _plan((64,) * 4, free, AutoStageOption(cost_model=recording))
    problem, costs = seen["problem"], seen["costs"]
    checked = 0
    for layer in range(problem.num_layers):
        flops = jaxpr_flops(e for c in problem.layer_comps([layer]) for e in c.eqns)
        assert flops > 0
        for m, (hosts, per_host) in enumerate(problem.submesh_choices):
            for c in range(len(problem.configs[m])):
                expected = flops / (hosts * per_host * 1e13)
                assert costs.compute_cost[layer, layer, m, c] == pytest.approx(expected, rel=1e-6)
                checked += 1
    assert checked >= 4 * 4, checked


def test_identical_layers_are_planned_by_one_ilp(monkeypatch):
    """Six Dense(64) layers cut into 6 layers: layers 1..4 (dense, relu, read the previous
    layer's activation and send one back) are the same computation and differ only in
    their markers' names, so the analytic model solves one ILP per configuration for them
    together, on layer 1's step; layers 0 (reads the batch, sends no cotangent back) and 5
    (the loss) get their own."""
    from alpa.pipeline_parallel.stages import stage_cost

    solved = []
    original = stage_cost.solve_auto_sharding

    def counting(step, mesh, option, **kwargs):
        solved.append((step.name, mesh.shape))
        return original(step, mesh, option, **kwargs)

    monkeypatch.setattr(stage_cost, "solve_auto_sharding", counting)
    _plan((64,) * 6, ClusterSpec.preset("cpu"), AutoStageOption(), layer_num=6)
    by_layer = {name: sum(1 for n, _ in solved if n == name) for name, _ in solved}
    assert set(by_layer) == {"layers0_0", "layers1_1", "layers5_5"}, by_layer
    assert len(set(by_layer.values())) == 1  # one ILP per configuration, for each
    assert len(solved) == len(set(solved)) and by_layer["layers1_1"] >= 3


def _gpt_4_blocks():
    """A 4-block GPT train step, abstract: ``(state, batch, step)``."""
    config = GPTConfig(hidden_size=64, num_layers=4, num_heads=4, seq_len=16, vocab_size=64)
    return get_gpt_train_state_and_step(config, 8, grad_func=alpa.value_and_grad, abstract=True)


def _plan_4_uniform_stages(step, state, batch):
    """``step`` in 4 layers, one per stage on a (1, 2) submesh of the 8 CPU devices."""
    method = alpa.PipeshardParallel(
        devices=ClusterSpec.preset("cpu"),
        num_micro_batches=2,
        layer_option=alpa.AutoLayerOption(layer_num=4),
        stage_option="uniform",
    )
    return alpa.parallelize(step, method=method).plan(state, batch)


def test_analytic_tables_do_not_depend_on_the_ilp_threads():
    """The layer ILPs run on threads; one thread and four give the same tables, bit for
    bit (a 4-block GPT in 4 layers, on every submesh of a 2x4 cluster)."""
    state, batch, step = _gpt_4_blocks()
    tables = []
    for workers in (1, 4):
        seen = []

        def recording(problem, workers=workers, seen=seen):
            seen.append(AnalyticStageCost(workers=workers)(problem))
            return seen[-1]

        method = alpa.PipeshardParallel(
            devices=ClusterSpec.preset("a100-40gb", num_nodes=2, num_devices_per_node=4),
            num_micro_batches=2,
            layer_option=alpa.AutoLayerOption(layer_num=4),
            stage_option=AutoStageOption(cost_model=recording),
        )
        alpa.parallelize(step, method=method).plan(state, batch)
        tables.append(seen[0])
    one, four = tables
    assert np.isfinite(one.compute_cost).sum() > 50
    for name in ("compute_cost", "max_n_succ_stages", "memory"):
        np.testing.assert_array_equal(getattr(one, name), getattr(four, name))
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        AnalyticStageCost(workers=0)


def test_stage_shardings_do_not_depend_on_the_threads(monkeypatch):
    """The chosen stages' ILPs run on threads, a stage per thread; one thread and four give
    the same plan, JSON for JSON (4 stages of a 4-block GPT on (1, 2) submeshes, each
    planned by the ILP, with Adam's apply levels)."""
    from alpa.pipeline_parallel import pipeshard_passes

    state, batch, step = _gpt_4_blocks()
    original = pipeshard_passes.plan_stage_shardings
    texts, objectives = [], []
    for workers in (1, 4):
        monkeypatch.setattr(
            pipeshard_passes,
            "plan_stage_shardings",
            lambda *args, workers=workers, **kwargs: original(*args, workers=workers, **kwargs),
        )
        plan = _plan_4_uniform_stages(step, state, batch)
        assert plan.stage_plan.num_stages == 4 and len(plan.objectives) == 4, plan
        texts.append(plan.to_json())
        objectives.append(plan.objectives)
    assert texts[0] == texts[1] and objectives[0] == objectives[1]


def test_identical_stages_share_their_ilps(monkeypatch):
    """4 stages of a 4-block GPT on (1, 2) submeshes: stages 1 and 2 are the same
    equations (a block, its backward and Adam's apply levels), so each ILP of the two is
    solved once and the other stage takes its plan position by position; the plan is the one each
    stage solving its own ILPs gives, JSON for JSON."""
    from alpa.pipeline_parallel.program import stage_sharding

    state, batch, step = _gpt_4_blocks()
    solved = []
    original = stage_sharding.plan_auto_sharding

    def counting(sub, *args, **kwargs):
        solved.append(sub.name)
        return original(sub, *args, **kwargs)

    monkeypatch.setattr(stage_sharding, "plan_auto_sharding", counting)
    texts, counts = [], []
    for share in (True, False):
        if not share:
            monkeypatch.setattr(stage_sharding._SharedPlans, "get", lambda self, key, f: f())
        solved.clear()
        plan = _plan_4_uniform_stages(step, state, batch)
        assert len(plan.objectives) == 4 and plan.objectives[1] == plan.objectives[2]
        texts.append(plan.to_json())
        counts.append({name: solved.count(name) for name in set(solved)})
    shared, alone = counts
    # Stages 1 and 2 together solve each of their ILPs once; which of the two threads
    # solves one (and the other waits for it) is whichever gets there first.
    together = shared.get("stage1", 0) + shared.get("stage2", 0)
    assert together == alone["stage1"] == alone["stage2"] >= 2, counts
    assert texts[0] == texts[1]


def test_activations_are_the_batch_values_a_forward_keeps():
    """4 Dense(64) layers, micro-batches of 4 rows: the forward of layers 0..2 keeps its
    input (f32[4, 64]) and relu's mask (bool[4, 64]) for the backward, 4 * 64 * 5 = 1,280
    bytes; the loss layer keeps two f32[4, 64], 2,048 bytes. Layers 1..3 also hand their
    kernel (f32[64, 64]) on to their backward, which is the parameter's buffer, not a
    per-micro-batch one."""

    seen = []

    def recording(problem):
        seen.append(problem)
        return AnalyticStageCost()(problem)

    _plan((64,) * 4, ClusterSpec.preset("cpu"), AutoStageOption(cost_model=recording))
    (problem,) = seen
    facts = [compute_layer_facts(problem.program, layer) for layer in range(4)]
    assert [f.activation_bytes for f in facts] == [1280, 1280, 1280, 2048]


def test_parameters_split_where_replicated_state_cannot_fit():
    """4 Dense(64) layers with Adam: the largest layer's state (kernel and bias, two
    moments, the gradient sum, and Adam's step count) is S = 66,568 bytes whole, the
    largest activation A = 2,048 bytes per micro-batch (the loss layer's). On 8 devices a
    stage on n of them holds 4 n / 8 layers and 8 / n micro-batches in flight (the first
    of 8 / n stages under 1F1B), so its replicated footprint is
    4 n / 8 * (S + 8 / n * A / n): 70,664 bytes on (1, 2), 135,184 on (1, 4), 267,296 on
    (1, 8). A budget of 1.5 S splits parameters from (1, 4) on; 68,000 bytes (the state
    of one layer fits, not with its micro-batches in flight) from (1, 2) on; 100 S
    nowhere."""
    layer_state = 4 * (64 * 64 + 64) * 4 + 8
    seen = []

    def recording(problem):
        seen.append(problem)
        return AnalyticStageCost()(problem)

    option = AutoStageOption(cost_model=recording)
    budgets = {1.5 * layer_state: 4, 68_000: 2, 100 * layer_state: None}
    for budget in budgets:
        cluster = ClusterSpec(1, 8, 1e13, int(budget), 1e11, 1e10, name="small-memory")
        _plan((64,) * 4, cluster, option)
    assert len(seen) == len(budgets)
    for problem, split_from in zip(seen, budgets.values(), strict=True):
        for (hosts, per_host), configs in zip(
            problem.submesh_choices, problem.configs, strict=True
        ):
            split = split_from is not None and hosts * per_host >= split_from
            for config in configs:
                assert config.option_dict.get("allow_replicated_parameters", True) is not split


def test_identical_layers_free_transfers_give_equal_stages_on_equal_submeshes():
    # 4 stages on (1, 2): each 0.5 + 0.05 -> 19 * 0.55 = 10.45 per step; 2 on (1, 4):
    # 18 * 0.8; 1 on (1, 8): 16 * 1.9; any unequal split has a slower stage.
    option = AutoStageOption(cost_model=ClosedFormCost([1.0] * 4, 0.05))
    plan = _plan((64,) * 4, ClusterSpec.preset("cpu"), option)
    stages = plan.stage_plan
    assert stages.stage_layers() == [[0], [1], [2], [3]], plan
    assert stages.submesh_shapes == ((1, 2),) * 4, plan
    assert stages.predicted_cost == pytest.approx(19 * 0.55)


def test_heavier_layer_gets_more_devices():
    option = AutoStageOption(cost_model=ClosedFormCost([1.0, 1.0, 4.0, 1.0], 0.01))
    plan = _plan((64,) * 4, ClusterSpec.preset("cpu"), option)
    stages = plan.stage_plan
    heavy = next(s for s, layers in enumerate(stages.stage_layers()) if 2 in layers)
    sizes = [a * b for a, b in stages.submesh_shapes]
    assert stages.num_stages > 1, plan
    assert sizes[heavy] == max(sizes) and sizes.count(sizes[heavy]) == 1, plan


def test_memory_budget_pushes_to_more_stages_and_errors_when_nothing_fits():
    free = _plan((256,) * 4, SLOW_NETWORK, AutoStageOption(), k=4)
    assert free.stage_plan.num_stages == 1, free
    one_stage_memory = free.stage_plan.memory[0]
    tight = AutoStageOption(memory_budget_per_device=0.9 * one_stage_memory)
    plan = _plan((256,) * 4, SLOW_NETWORK, tight, k=4)
    assert plan.stage_plan.num_stages > 1, plan
    assert max(plan.stage_plan.memory) <= 0.9 * one_stage_memory
    with pytest.raises(ValueError, match="memory_budget_per_device=1000"):
        _plan((256,) * 4, SLOW_NETWORK, AutoStageOption(memory_budget_per_device=1000), k=4)


# ----------------------------------------------------------------------------- imbalance


def _kept_by_definition(flops, sizes, num_devices, tolerance, i, j, m) -> bool:
    """Alpa's bound for one candidate, restated: skip a stage of layers i..j on n of N
    devices when n / N > f (1 + t) or n / N < f / (1 + t), f its share of the FLOPs (all
    layers equal when no layer has FLOPs); t = inf skips nothing."""
    if j < i:
        return False
    if tolerance == math.inf:
        return True
    weights = list(flops) if sum(flops) > 0 else [1.0] * len(flops)
    f = sum(weights[i : j + 1]) / sum(weights)
    d = sizes[m] / num_devices
    return not (d > f * (1 + tolerance) or d < f / (1 + tolerance))


def test_imbalance_mask_matches_its_definition_on_random_instances():
    rng = np.random.default_rng(0)
    checked = kept = dropped = 0
    for trial in range(60):
        num_layers = int(rng.integers(1, 7))
        # Integer FLOP counts (as jaxpr_flops gives), some zero; every 10th all zero.
        flops = rng.integers(0, 6, num_layers) * rng.integers(1, 1000, num_layers)
        if trial % 10 == 0:
            flops[:] = 0
        num_devices = int(rng.choice([4, 8, 16]))
        sizes = sorted(rng.choice([1, 2, 4, 8, 16], size=int(rng.integers(1, 5)), replace=False))
        for tolerance in (0.0, 0.25, 0.5, 1.0, math.inf):
            mask = imbalance_mask(flops.astype(float), sizes, num_devices, tolerance)
            assert mask.shape == (num_layers, num_layers, len(sizes)) and mask.dtype == bool
            for i, j, m in np.ndindex(mask.shape):
                expected = _kept_by_definition(flops, sizes, num_devices, tolerance, i, j, m)
                assert mask[i, j, m] == expected, (flops, sizes, num_devices, tolerance, i, j, m)
                checked += 1
                kept += expected
                dropped += (j >= i) and not expected
    assert checked > 5000 and kept > 500 and dropped > 500, (checked, kept, dropped)


def test_imbalance_mask_closed_form():
    sizes = [1, 2, 4, 8]
    # 4 identical layers on 8 devices, exact balance: a stage of k layers needs 2k devices.
    exact = imbalance_mask([5.0] * 4, sizes, 8, 0.0)
    kept = {(i, j, sizes[m]) for i, j, m in zip(*np.nonzero(exact), strict=True)}
    assert kept == ({(i, i, 2) for i in range(4)} | {(i, i + 1, 4) for i in range(3)} | {(0, 3, 8)})
    # No FLOPs anywhere: the layers count as equal shares, no division by zero.
    np.testing.assert_array_equal(imbalance_mask([0.0] * 4, sizes, 8, 0.0), exact)
    # Tolerance 1: a share of f allows device shares in [f / 2, 2 f]; one layer (f = 1/4)
    # takes 1, 2 or 4 of the 8 devices, all four layers (f = 1) 4 or 8.
    loose = imbalance_mask([5.0] * 4, sizes, 8, 1.0)
    assert [sizes[m] for m in np.nonzero(loose[2, 2])[0]] == [1, 2, 4]
    assert [sizes[m] for m in np.nonzero(loose[0, 3])[0]] == [4, 8]
    # inf: every stage i <= j on every submesh, also with zero FLOPs (no 0 * inf).
    unbounded = imbalance_mask([0.0, 3.0, 0.0], sizes, 8, math.inf)
    assert (unbounded == np.triu(np.ones((3, 3), dtype=bool))[:, :, None]).all()
    # A layer without FLOPs is no stage of its own under a finite tolerance; joined to
    # another layer it takes that layer's share.
    zero_first = imbalance_mask([0.0, 1.0, 1.0], [1, 2, 4], 4, 0.0)
    assert not zero_first[0, 0].any()
    np.testing.assert_array_equal(zero_first[0, 1], zero_first[1, 1])
    assert [[1, 2, 4][m] for m in np.nonzero(zero_first[0, 1])[0]] == [2]


def _planned_with_flops(option_fields, work, comm, **plan_kwargs):
    """``(plan, per-layer FLOPs)`` of the 4-layer Dense(64) MLP planned on 8 CPU devices
    with the closed-form costs ``ClosedFormCost(work, comm)``; the FLOPs are each layer's
    forward and backward equations counted by ``jaxpr_flops``."""
    seen = []

    def recording(problem):
        seen.append(problem)
        return ClosedFormCost(work, comm)(problem)

    option = AutoStageOption(cost_model=recording, **option_fields)
    plan = _plan((64,) * 4, ClusterSpec.preset("cpu"), option, **plan_kwargs)
    problem = seen[-1]
    flops = [
        jaxpr_flops(e for c in problem.layer_comps([layer]) for e in c.eqns)
        for layer in range(problem.num_layers)
    ]
    return plan, flops


def _unbalanced_stages(stage_plan, flops, tolerance, num_devices=8):
    """The stages of ``stage_plan`` outside the band of ``tolerance``, with their shares."""
    out = []
    for layers, (hosts, per_host) in zip(
        stage_plan.stage_layers(), stage_plan.submesh_shapes, strict=True
    ):
        f = sum(flops[x] for x in layers) / sum(flops)
        d = hosts * per_host / num_devices
        if d > f * (1 + tolerance) or d < f / (1 + tolerance):
            out.append((layers, hosts * per_host, round(f, 3)))
    return out


def test_stage_imbalance_tolerance_keeps_every_stage_in_its_band():
    """Layer 2 costs 4x the others in the cost table, but the layers' FLOPs are about equal
    (layer 0 ~19% of them: no input cotangent; layers 1..3 ~27%). Unbounded, the DP gives
    layer 2 alone 4 of the 8 devices (half the devices for ~27% of the FLOPs). With
    tolerance 0.5 a single layer may take only 2 devices, two layers 4, so among the
    balanced plans [[0, 1], [2, 3]] on 4 + 4 devices is cheapest (per micro-batch 0.5 + 0.3
    and 1.25 + 0.3: 2.35 + 15 * 1.55 = 25.6, against 25.9 for [0], [1], [2, 3] on
    2 + 2 + 4 and 36.4 for one stage on 8)."""
    work, comm = [1.0, 1.0, 4.0, 1.0], 0.05
    unbounded, flops = _planned_with_flops({}, work, comm)
    assert 0.15 < flops[0] / sum(flops) < 0.25 and len(set(flops[1:])) <= 2, flops
    assert _unbalanced_stages(unbounded.stage_plan, flops, 0.5), unbounded  # it matters
    plans = {}
    for tolerance in (0.5, 1.0, 2.0):
        plan, _ = _planned_with_flops({"stage_imbalance_tolerance": tolerance}, work, comm)
        assert not _unbalanced_stages(plan.stage_plan, flops, tolerance), (tolerance, plan)
        # The bound only removes plans: never cheaper than the unbounded optimum.
        assert plan.stage_plan.predicted_cost >= unbounded.stage_plan.predicted_cost
        plans[tolerance] = plan
    bounded = plans[0.5]
    assert bounded.stage_plan.stage_layers() == [[0, 1], [2, 3]], bounded
    assert bounded.stage_plan.submesh_shapes == ((1, 4), (1, 4)), bounded
    assert bounded.stage_plan.predicted_cost == pytest.approx(25.6)
    assert unbounded.stage_plan.predicted_cost < 25.6


def test_stage_imbalance_tolerance_applies_to_cached_tables_which_stay_unbounded(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # get_last_dp_result's file
    work, comm = [1.0, 1.0, 4.0, 1.0], 0.05
    bounded, _ = _planned_with_flops({"stage_imbalance_tolerance": 0.5}, work, comm)
    path = get_last_dp_result()[0]
    with np.load(path) as saved:
        table = saved["compute_cost"]
    # The saved table is the cost model's, unmasked: layer 2 alone on (1, 4) (index 2 of
    # the submesh choices (1, 1), (1, 2), (1, 4), (1, 8)) is out of the band yet finite.
    assert table[2, 2, 2, 0] == pytest.approx(4.0 / 4 + 0.05 * 3)
    # Reused unbounded, the tables give the unbounded plan; reused with the tolerance,
    # the bounded one.
    unbounded, _ = _planned_with_flops({}, work, comm)
    assert unbounded.stage_plan.stage_layers() != bounded.stage_plan.stage_layers()
    for tolerance, expected in ((math.inf, unbounded), (0.5, bounded)):
        option = AutoStageOption(cached_profile_result=path, stage_imbalance_tolerance=tolerance)
        plan = _plan((64,) * 4, ClusterSpec.preset("cpu"), option)
        assert plan.stage_plan.stage_layers() == expected.stage_plan.stage_layers()
        assert plan.stage_plan.submesh_shapes == expected.stage_plan.submesh_shapes


def test_the_dp_result_lives_on_the_plan_and_its_file_is_written_only_when_asked(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    plan, _ = _planned_with_flops({}, [1.0, 1.0, 4.0, 1.0], 0.05)
    result = plan.stage_plan.dp_result
    assert result is not None and result.costs.compute_cost.shape[:2] == (4, 4)
    assert list(tmp_path.iterdir()) == []  # the DP wrote nothing
    path, layer_ids, shapes, logical, dicts = get_last_dp_result()
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(path)]
    assert layer_ids == plan.stage_plan.stage_layers()
    assert [tuple(s) for s in shapes] == list(plan.stage_plan.submesh_shapes)
    assert [tuple(s) for s in logical] == list(plan.stage_plan.logical_shapes)
    with np.load(path) as saved:
        np.testing.assert_array_equal(saved["compute_cost"], result.costs.compute_cost)
    assert get_last_dp_result()[0] == path  # written once
    assert len(list(tmp_path.iterdir())) == 1
    # Not part of the plan's identity.
    assert dataclasses.replace(plan.stage_plan, dp_result=None) == plan.stage_plan


# ----------------------------------------------------------------------------- plans


def test_plan_for_64_gpus_touches_no_device():
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        import alpa
        from alpa.device_mesh import ClusterSpec
        from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step
        config = GPTConfig(hidden_size=1024, num_layers=8, num_heads=16, seq_len=512,
                           vocab_size=1024)
        state, batch, step = get_gpt_train_state_and_step(
            config, 256, grad_func=alpa.value_and_grad, abstract=True)
        cluster = ClusterSpec.preset("a100-40gb", num_nodes=8, num_devices_per_node=8)
        method = alpa.PipeshardParallel(devices=cluster, num_micro_batches=16,
            layer_option=alpa.AutoLayerOption(layer_num=8), stage_option="auto")
        plan = alpa.parallelize(step, method=method).plan(state, batch)
        import jax._src.xla_bridge as xb
        assert not xb._backends, xb._backends
        assert sum(a * b for a, b in plan.stage_plan.submesh_shapes) == 64
        # Every RESHARD's tile plan is made with the plan, for hosts that are not here.
        moves = [i for i, ins in enumerate(plan.instructions.instructions)
                 if ins.op == "RESHARD"]
        assert plan.stage_plan.num_stages > 1 and moves and sorted(plan.reshards) == moves
        assert plan.resharded_bytes() > 0
        print(plan)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pipeshard plan of train_step" in out.stdout and "8x8 a100-40gb" in out.stdout


def test_plan_prints_round_trips_and_replays():
    state, batch = mlp_state()
    method = alpa.PipeshardParallel(
        num_micro_batches=4, layer_option=alpa.AutoLayerOption(layer_num=2), stage_option="auto"
    )
    step = alpa.parallelize(make_train_step(alpa.value_and_grad), method=method)
    plan = step.plan(state, batch)
    text = str(plan)
    assert "stage" in text and "latency" in text and "1f1b" in text
    # The JSON holds the decisions themselves, read back field by field.
    data = type(plan).from_json(plan.to_json())
    stage_plan = plan.stage_plan
    assert [s["layers"] for s in data["stages"]] == stage_plan.stage_layers()
    assert [tuple(s["submesh"]) for s in data["stages"]] == list(stage_plan.submesh_shapes)
    assert [tuple(s["devices"]) for s in data["stages"]] == list(stage_plan.device_ranges)
    assert [s["latency"] for s in data["stages"]] == list(stage_plan.latencies)
    assert data["predicted_cost"] == stage_plan.predicted_cost
    assert data["num_micro_batches"] == 4 and data["schedule"] == "1f1b"
    assert data["instructions"] == [str(i) for i in plan.instructions.instructions]
    assert len(data["ticks"]) == plan.schedule.num_ticks
    again = step.plan(state, batch)
    assert again.summary()["instructions"] == plan.summary()["instructions"]
    # The plan's stages replayed by hand give the same instructions, and run.
    manual = alpa.PipeshardParallel(
        num_micro_batches=4,
        layer_option=alpa.AutoLayerOption(layer_num=2),
        stage_option=plan.stage_option(),
    )
    replay = alpa.parallelize(make_train_step(alpa.value_and_grad), method=manual)
    assert replay.plan(state, batch).summary()["instructions"] == plan.summary()["instructions"]
    executable = replay.get_executable(state, batch)
    assert executable.plan.summary()["shardings"] == plan.summary()["shardings"]


def test_place_submeshes_is_host_aligned():
    ranges = place_submeshes([(1, 2), (2, 4), (1, 1), (1, 1)], 3, 4)
    assert ranges[1] == (0, 8)  # two whole hosts first
    assert ranges[0] == (8, 10) and sorted([ranges[2], ranges[3]]) == [(10, 11), (11, 12)]
    with pytest.raises(ValueError, match="cannot be placed"):
        place_submeshes([(1, 3), (1, 3)], 1, 4)


# ----------------------------------------------------------------------------- bad input


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="submesh_physical_shape_space.*'pow2'"):
        AutoStageOption(submesh_physical_shape_space="pow2")
    with pytest.raises(ValueError, match="submesh_logical_shape_space.*'diagonal'"):
        AutoStageOption(submesh_logical_shape_space="diagonal")
    with pytest.raises(ValueError, match="cost_model"):
        AutoStageOption(cost_model="guess")
    option = AutoStageOption(
        submesh_physical_shape_space="manual", manually_specified_submeshes=[(1, 3)]
    )
    with pytest.raises(ValueError, match=r"\(1, 3\) does not tile"):
        _plan((64,) * 2, ClusterSpec.preset("cpu"), option)


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), True, "big", None])
def test_bad_stage_imbalance_tolerance_is_a_clear_error(bad):
    with pytest.raises(
        ValueError,
        match=rf"stage_imbalance_tolerance must be a number >= 0.*got {re.escape(repr(bad))}",
    ):
        AutoStageOption(stage_imbalance_tolerance=bad)


def test_good_stage_imbalance_tolerances_are_kept_as_floats():
    for good in (0, 0.5, 3, np.float32(0.25), math.inf):
        option = AutoStageOption(stage_imbalance_tolerance=good)
        assert type(option.stage_imbalance_tolerance) is float
        assert option.stage_imbalance_tolerance == float(good)


def test_stage_imbalance_tolerance_that_excludes_every_plan_is_a_clear_error():
    """Only (1, 2) submeshes: the plan is one layer per stage on 2 of 8 devices (25%), but
    layer 0 has ~19% of the FLOPs, so a tolerance below ~0.31 leaves no plan. The error
    names the tolerance the unbounded plan needs, and that tolerance plans."""
    fields = {"submesh_physical_shape_space": "manual", "manually_specified_submeshes": [(1, 2)]}
    work, comm = [1.0] * 4, 0.05
    plan, flops = _planned_with_flops(fields, work, comm)
    assert plan.stage_plan.stage_layers() == [[0], [1], [2], [3]]
    needed = max(max(0.25 / (f / sum(flops)), (f / sum(flops)) / 0.25) - 1 for f in flops)
    assert 0.2 < needed < 0.4, needed
    for tolerance in (0, 0.1, 0.99 * needed):
        with pytest.raises(ValueError, match="stage_imbalance_tolerance=.* excludes every") as e:
            _planned_with_flops({**fields, "stage_imbalance_tolerance": tolerance}, work, comm)
    suggested = float(
        re.search(r"needs stage_imbalance_tolerance >= ([0-9.e+-]+)", str(e.value))[1]
    )
    assert needed <= suggested <= needed * 1.01, (needed, suggested, str(e.value))
    plan, _ = _planned_with_flops({**fields, "stage_imbalance_tolerance": suggested}, work, comm)
    assert plan.stage_plan.stage_layers() == [[0], [1], [2], [3]]


def test_stage_imbalance_tolerance_keeps_the_memory_error_when_nothing_fits():
    def nothing_fits(problem):
        L, M, C = problem.num_layers, len(problem.submesh_choices), problem.num_configs
        shape = (L, L, M, C)
        return StageCosts(np.full(shape, np.inf), np.full(shape, -1), np.full(shape, 1e12))

    option = AutoStageOption(cost_model=nothing_fits, stage_imbalance_tolerance=0.5)
    with pytest.raises(
        ValueError, match="no pipeline plan of the step fits memory_budget_per_device"
    ):
        _plan((64,) * 4, ClusterSpec.preset("cpu"), option)


def test_auto_stages_without_layers_is_a_clear_error():
    state, batch = mlp_state()
    method = alpa.PipeshardParallel(num_micro_batches=2, layer_option="manual", stage_option="auto")
    step = alpa.parallelize(make_train_step(alpa.value_and_grad), method=method)
    with pytest.raises(ValueError, match="AutoLayerOption"):
        step.plan(state, batch)


def test_running_on_a_cluster_that_is_not_here_is_a_clear_error():
    state, batch = mlp_state()
    method = alpa.PipeshardParallel(
        devices=ClusterSpec.preset("a100-40gb", num_nodes=2),
        layer_option=alpa.AutoLayerOption(layer_num=2),
        stage_option="auto",
    )
    with pytest.raises(ValueError, match=r"plan\(\*args\)"):
        alpa.parallelize(make_train_step(alpa.value_and_grad), method=method)(state, batch)


def test_stage_construction_is_timed_under_alpas_names(monkeypatch):
    """Alpa's benchmarks read ``timers("stage-construction" [+ "-compilation",
    "-profiling", "-dp"]).elapsed(mode="sum")``: each part covers the work it names (timed
    here from inside), and the whole covers the parts."""
    import time

    from alpa.pipeline_parallel.stages import stage_search

    inside = {"compilation": 0.0, "profiling": 0.0, "dp": 0.0}

    def measured(part, fn):
        def run(*args, **kwargs):
            tic = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                inside[part] += time.perf_counter() - tic

        return run

    monkeypatch.setattr(
        stage_search, "stage_problem", measured("compilation", stage_search.stage_problem)
    )
    monkeypatch.setattr(stage_search, "training_dp", measured("dp", stage_search.training_dp))
    names = ["stage-construction"] + [f"stage-construction-{part}" for part in inside]
    for name in names:
        alpa.timers(name).reset()
    _plan(
        (64,) * 4,
        SLOW_NETWORK,
        AutoStageOption(cost_model=measured("profiling", ClosedFormCost([1.0] * 4, 0.01))),
    )
    elapsed = {name: alpa.timers(name).elapsed(mode="sum") for name in names}
    assert [len(alpa.timers(name).costs) for name in names[:3]] == [1, 1, 1]
    for part, seconds in inside.items():
        assert 0 < seconds <= elapsed[f"stage-construction-{part}"], (part, inside, elapsed)
    assert sum(elapsed[n] for n in names[1:]) <= elapsed["stage-construction"]


def test_a_configuration_is_the_same_whatever_the_order_of_its_options():
    """The search's configuration and ``plan.price_stages``' (built from the option's
    fields) are one: one column of the tables, one ILP per layer."""
    from alpa.pipeline_parallel.stages.stage_problem import LogicalConfig

    forced = (("force_batch_dim_to_mesh_dim", 0), ("allow_replicated_parameters", False))
    one, other = LogicalConfig((2, 2), forced), LogicalConfig((2, 2), forced[::-1])
    assert one == other and hash(one) == hash(other)
    assert one.option_items == tuple(sorted(forced))
    assert len({one, other, LogicalConfig((2, 2), forced[:1])}) == 2
