"""The analytic stage cost model, term by term, against closed forms (no device used).

The model (``stage_cost`` module docstring): per micro-batch a stage costs its FLOPs at the
cluster's rate (plus its forward again under stage remat), its own collectives, and its
gradient reductions once per step, amortised over the ``B`` micro-batches; its memory is
its state, plus per micro-batch in flight the activations it keeps (under remat, only
what enters it), plus once its temporaries (under remat, the backward's while it
recomputes one micro-batch's activations, each held until its last read).

The step: 4 Dense(64) layers with Adam, micro-batches of 4 rows (batch 64, ``B = 16``),
8 devices of one node on a network with no latency and 1e9 B/s links.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_auto_stages import make_train_step, mlp_state

import alpa
from alpa.device_mesh import ClusterSpec
from alpa.pipeline_parallel.stages import stage_cost
from alpa.pipeline_parallel.stages.layer_facts import recomputed_bytes, temporary_bytes
from alpa.pipeline_parallel.stages.stage_construction import AutoStageOption
from alpa.pipeline_parallel.stages.stage_cost import AnalyticStageCost

BANDWIDTH = 1e9
RATE = 1e13
CLUSTER = ClusterSpec(
    1, 8, RATE, 1 << 34, BANDWIDTH, BANDWIDTH, intra_node_latency=0.0, inter_node_latency=0.0
)
ROWS, WIDTH = 4, 64
PARAM_BYTES = (WIDTH * WIDTH + WIDTH) * 4  # a layer's kernel and bias, f32


def _recorded(
    k=16, remat="none", data_parallel=False, cluster=CLUSTER, stage_option=None, rows=ROWS
):
    """(problem, tables, plan) of planning the 4-layer MLP with ``k`` micro-batches."""
    seen = {}

    def recording(problem):
        seen["problem"], seen["costs"] = problem, AnalyticStageCost()(problem)
        return seen["costs"]

    state, batch = mlp_state((WIDTH,) * 4, rows * k, abstract=True)
    option = alpa.AutoShardingOption(force_data_parallel=data_parallel)
    method = alpa.PipeshardParallel(
        devices=cluster,
        num_micro_batches=k,
        layer_option=alpa.AutoLayerOption(layer_num=4, remat_mode=remat),
        stage_option=stage_option or AutoStageOption(cost_model=recording),
        default_auto_sharding_option=option,
    )
    plan = alpa.parallelize(make_train_step(alpa.value_and_grad), method=method).plan(state, batch)
    return seen.get("problem"), seen.get("costs"), plan


def _all_reduce(num_bytes: float, n: int) -> float:
    return 2 * (n - 1) / n * num_bytes / BANDWIDTH


def test_data_parallel_gradient_all_reduce_is_paid_once_per_step():
    """A data-parallel stage of one layer on ``n`` devices:
    ``t = F / (n R) + AR_n(P) / B (+ 2 X / W for a layer after the first)``, with
    ``AR_n(P) = 2 (n - 1) / n * P / W`` the one all-reduce of the layer's gradients (its
    kernel and bias, ``P`` bytes) per step; so ``t(B=1) - t(B=16) = AR_n(P) * 15 / 16``."""
    problem, costs, _ = _recorded(k=16, data_parallel=True)
    _, costs_one, _ = _recorded(k=1, data_parallel=True)
    facts = problem.layer_facts
    checked = 0
    for layer in range(3):  # the loss layer has no parameters of its own besides its Dense
        assert facts[layer].param_bytes == PARAM_BYTES
        for m, (hosts, per_host) in enumerate(problem.submesh_choices):
            n = hosts * per_host
            transfer = 2 * facts[layer].entering_bytes / BANDWIDTH if layer else 0.0
            expected = facts[layer].flops / (n * RATE) + _all_reduce(PARAM_BYTES, n) / 16
            assert costs.compute_cost[layer, layer, m, 0] == pytest.approx(expected + transfer)
            saved = (
                costs_one.compute_cost[layer, layer, m, 0] - costs.compute_cost[layer, layer, m, 0]
            )
            assert saved == pytest.approx(_all_reduce(PARAM_BYTES, n) * 15 / 16)
            checked += n > 1
    assert checked >= 3 * 3


def test_ilp_gradient_reductions_are_split_from_the_per_micro_batch_collectives():
    """The ILP on a logical ``(n, 1)`` mesh with the batch forced on axis 0
    (``submesh_logical_shape_space="data_parallel_only"``), micro-batches of 256 rows
    (gathering a layer's f32[256, 64] input would cost more than reducing its f32[64, 64]
    gradient), plans a Dense layer data parallel: its only collectives are the gradient
    all-reduces over axis 0, which the model moves to ``gradient_sync`` (``AR_n(P)``, once
    per step), leaving nothing per
    micro-batch."""
    seen = {}

    def recording(problem):
        seen["problem"] = problem
        return AnalyticStageCost()(problem)

    space = AutoStageOption(cost_model=recording, submesh_logical_shape_space="data_parallel_only")
    _recorded(k=16, stage_option=space, rows=256)
    problem = seen["problem"]
    plans = stage_cost.LayerPlans(problem, problem.layer_facts, workers=1)
    checked = 0
    for m, configs in enumerate(problem.configs):
        n = int(np.prod(problem.submesh_choices[m]))
        for config in configs:
            if n == 1:
                continue
            assert config.shape == (n, 1) and config.option_dict == {
                "force_batch_dim_to_mesh_dim": 0
            }
            cost = plans.get(1, m, config)
            assert cost.gradient_sync == pytest.approx(_all_reduce(PARAM_BYTES, n), rel=1e-6)
            assert cost.communication == pytest.approx(0.0, abs=1e-12)
            checked += 1
    assert checked >= 2, problem.configs


def test_remat_keeps_only_what_enters_a_stage_and_recomputes_its_forward():
    """Stage of all 4 layers, data parallel on ``n`` devices. Per micro-batch the forward
    keeps ``A = [1280, 1280, 1280, 2048]`` bytes per layer (an f32[4, 64] input and a
    bool[4, 64] relu mask; the loss layer two f32[4, 64]), and what enters the stage is the
    batch: ``x`` and ``y``, f32[4, 64] each. Without remat: ``per micro-batch = sum A / n``
    and the largest layer's temporaries once. With remat: ``per micro-batch = 2 * 1024 /
    n``, and once the backward's fullest point while it recomputes the micro-batch,
    ``max_l (sum_{k<l} A_k / n + recomputed_l)``: at the loss layer (``l = 3``), whose
    own kept values are read for the last time before its fullest point (its weight
    gradient and that gradient's transpose), so ``recomputed_3`` is its temporaries and
    the stage holds ``(A_0 + A_1 + A_2) / n`` besides, not ``sum A / n``. The latency
    grows by the forward FLOPs ``/ (n R)``."""
    plain_problem, plain, _ = _recorded(data_parallel=True)
    remat_problem, remat, _ = _recorded(data_parallel=True, remat="coarse_grained_remat")
    facts = plain_problem.layer_facts
    assert [f.activation_bytes for f in facts] == [1280, 1280, 1280, 2048]
    kept, entering = 1280 * 3 + 2048, 2 * ROWS * WIDTH * 4
    state = sum(f.state_bytes for f in facts)
    forward = sum(f.forward_flops for f in facts)
    budget = plain_problem.memory_budget
    plans = stage_cost.LayerPlans(plain_problem, facts, workers=1)
    remat_plans = stage_cost.LayerPlans(remat_problem, remat_problem.layer_facts, workers=1)
    for m, (hosts, per_host) in enumerate(plain_problem.submesh_choices):
        n = hosts * per_host
        # Held once: the largest layer's temporaries (test_temporaries_are_...).
        config = plain_problem.configs[m][0]
        temporaries = max(plans.get(layer, m, config).temporary_bytes for layer in range(4))
        assert temporaries > 0
        once = temporaries
        assert plain.memory[0, 3, m, 0] == pytest.approx(state + once + kept / n)
        loss_layer = remat_plans.get(3, m, remat_problem.configs[m][0])
        assert loss_layer.recomputed_bytes == loss_layer.temporary_bytes == temporaries
        recomputing = (kept - 2048) / n + loss_layer.recomputed_bytes
        assert remat.memory[0, 3, m, 0] == pytest.approx(state + recomputing + entering / n)
        # Capped at what no plan exceeds: L - 1 followers, M micro-batches (GPipe).
        cap = max(4, remat_problem.num_micro_batches)
        fits = min(int((budget - state - recomputing) // (entering / n)) - 1, cap)
        assert remat.max_n_succ_stages[0, 3, m, 0] == fits
        extra = remat.compute_cost[0, 3, m, 0] - plain.compute_cost[0, 3, m, 0]
        assert extra == pytest.approx(forward / (n * RATE))
    assert remat_problem.remat and not plain_problem.remat


def test_a_hand_plan_is_priced_by_the_same_model_as_the_dp():
    """The DP's plan replayed as a ``ManualStageOption``: ``plan.cost`` of the manual plan
    (which runs only its stages' ILPs) equals the DP's own prediction, stage by stage."""
    _, _, auto = _recorded()
    manual_option = auto.stage_option()
    _, _, manual = _recorded(stage_option=manual_option)
    assert manual.stage_plan.predicted_cost is None
    cost = manual.cost
    assert manual.predicted_cost == cost.step_seconds
    assert cost.step_seconds == pytest.approx(auto.stage_plan.predicted_cost, rel=1e-9)
    assert cost.latencies == pytest.approx(auto.stage_plan.latencies, rel=1e-9)
    assert all(cost.fits)
    k = manual.num_micro_batches
    assert cost.step_seconds == pytest.approx(sum(cost.latencies) + (k - 1) * max(cost.latencies))


def test_a_hand_plan_over_the_budget_says_so():
    """A budget below one stage's state: the manual plan is priced, and marked as not
    fitting, instead of failing."""
    tiny = dataclasses.replace(CLUSTER, device_memory=1000)
    option = alpa.ManualStageOption([[0, 1], [2, 3]], [(1, 4), (1, 4)])
    _, _, plan = _recorded(cluster=tiny, stage_option=option)
    cost = plan.cost
    assert len(cost.latencies) == 2 and not any(cost.fits)
    assert all(m > 1000 for m in cost.memory)
    # Where its price is printed, it says so.
    title = str(plan).splitlines()[0]
    needs = ", ".join(f"{m / 2**20:.1f}" for m in cost.memory)
    assert f"DOES NOT FIT memory_budget_per_device=0.0 MiB: stages 0, 1 need {needs} MiB" in title


def test_a_plans_state_counts_its_gradient_sums():
    """Two stages of two layers on one device each: a stage holds its parameters, Adam's
    two moments and the gradient sums its backward accumulates over the micro-batches,
    four times its parameters' bytes (plus Adam's step counters, a few bytes). The sums
    depend on the batch, yet live from the first backward to apply-grad: the state read
    off the plan once left them out (three times the parameters)."""
    cluster = dataclasses.replace(CLUSTER, num_devices_per_node=2)
    option = alpa.ManualStageOption([[0, 1], [2, 3]], [(1, 1), (1, 1)])
    _, _, plan = _recorded(cluster=cluster, stage_option=option)
    for state in plan.cost.state_memory:
        assert state == pytest.approx(4 * 2 * PARAM_BYTES, abs=16)


def test_temporaries_are_the_fullest_point_of_the_liveness_of_what_is_not_held():
    """``a = x @ w; b = tanh(a); c = 2 b; d = c + a`` on f32[4, 8] (128 bytes each),
    ``x, w, d`` held (inputs, output): ``a`` lives from its equation to ``d``'s, ``b``
    to ``c``'s, ``c`` to ``d``'s, so all three are live at ``c``'s equation: 384 bytes;
    with ``a`` held too (kept for a backward), ``b`` and ``c``: 256; split over 4
    devices, a quarter. With fusion, ``b`` and ``c`` (elementwise, read only by
    elementwise equations) are never written: ``a`` alone, 128, and with ``a`` held
    nothing."""
    import jax
    import jax.numpy as jnp

    def f(x, w):
        a = x @ w
        return 2.0 * jnp.tanh(a) + a

    jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 16)), jnp.ones((16, 8))).jaxpr
    a = jaxpr.eqns[0].outvars[0]
    held = {*jaxpr.invars, *jaxpr.outvars}
    size = lambda v: float(np.prod(v.aval.shape) * v.aval.dtype.itemsize)  # noqa: E731
    unfused = functools.partial(temporary_bytes, fused=False)
    assert unfused(jaxpr, held, size) == 384
    assert unfused(jaxpr, held | {a}, size) == 256
    assert unfused(jaxpr, held, lambda v: size(v) / 4) == 96
    assert temporary_bytes(jaxpr, held, size) == 128
    assert temporary_bytes(jaxpr, held | {a}, size) == 0


def test_a_broadcast_read_by_elementwise_equations_is_never_written():
    """``relu(x @ w)`` written ``max(a, zeros)``: ``a = x @ w`` (f32[4, 8], 128 bytes) and
    the zeros broadcast to its shape (128), both live at the ``max``: 256 bytes if both
    were written. XLA computes a broadcast inside the kernel that reads it on every
    backend (the CPU's HLO has ``broadcast_select_fusion``s), so unfused too only ``a``
    is counted: 128."""

    def f(x, w):
        return jnp.maximum(x @ w, jnp.zeros((4, 8)))

    jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 16)), jnp.ones((16, 8))).jaxpr
    assert [e.primitive.name for e in jaxpr.eqns] == ["dot_general", "broadcast_in_dim", "max"]
    held = {*jaxpr.invars, *jaxpr.outvars}
    size = lambda v: float(np.prod(v.aval.shape) * v.aval.dtype.itemsize)  # noqa: E731
    assert temporary_bytes(jaxpr, held, size, fused=False) == 128
    assert temporary_bytes(jaxpr, held, size) == 128


def test_fused_temporaries_keep_what_a_matmul_or_a_non_fusible_reader_needs():
    """``a = x @ w; b = tanh(a); c = 2 b; e = c @ v; d = e + a`` (f32[4, 8], 128 bytes
    each): with fusion ``b`` is never written, but ``c`` is, since a matmul reads it
    (XLA does not compute a matmul's operand inside the matmul): ``a``, ``c`` and ``e``
    are live at ``e``'s equation, 384 bytes (256 if ``c`` were left out). A reduction
    reads its operand inside its fusion: ``sum(2 tanh(x @ w))`` writes ``x @ w`` and the
    result only."""
    import jax
    import jax.numpy as jnp

    def f(x, w, v):
        a = x @ w
        return (2.0 * jnp.tanh(a)) @ v + a

    def g(x, w):
        return jnp.sum(2.0 * jnp.tanh(x @ w), axis=1)

    size = lambda v: float(np.prod(v.aval.shape) * v.aval.dtype.itemsize)  # noqa: E731
    x, w = jnp.ones((4, 16)), jnp.ones((16, 8))
    jaxpr = jax.make_jaxpr(f)(x, w, jnp.ones((8, 8))).jaxpr
    held = {*jaxpr.invars, *jaxpr.outvars}
    assert temporary_bytes(jaxpr, held, size) == 384
    jaxpr = jax.make_jaxpr(g)(x, w).jaxpr
    held = {*jaxpr.invars, *jaxpr.outvars}
    assert [e.primitive.name for e in jaxpr.eqns] == ["dot_general", "tanh", "mul", "reduce_sum"]
    assert temporary_bytes(jaxpr, held, size) == 128  # x @ w alone
    # Unfused, each of the three lives until the next reads it: two at a time.
    assert temporary_bytes(jaxpr, held, size, fused=False) == 256


def test_recomputed_activations_are_held_until_their_last_read():
    """A layer's forward then backward, ``a = x @ w; b = a @ w; c = b + a; d = c @ w;
    e = d @ w; f = e @ w; g = f + e; h = g + d`` on f32[4, 8] (128 bytes each), ``a`` what
    the forward keeps for the backward, ``x, w, h`` held. Without remat ``a`` is held
    apart and the temporaries peak at ``g``'s equation (``d, e, f, g``): 512, so the old
    remat sum, kept plus temporaries, was 640. Under remat the backward recomputes ``a``
    and frees it after ``c``'s equation (``a, b, c``: 384), before the peak: 512. With
    fusion ``g`` (an add read by an add) is never written: 384 either way, ``a`` counted
    at ``c``'s equation although it is elementwise-read."""
    import types

    def layer(x, w):
        a = x @ w
        c = (a @ w) + a
        d = c @ w
        e = d @ w
        return ((e @ w) + e) + d

    jaxpr = jax.make_jaxpr(layer)(jnp.ones((4, 8)), jnp.ones((8, 8))).jaxpr
    a = jaxpr.eqns[0].outvars[0]
    step = types.SimpleNamespace(closed_jaxpr=types.SimpleNamespace(jaxpr=jaxpr))
    facts = types.SimpleNamespace(kept=(a,))
    size = lambda v: float(np.prod(v.aval.shape) * v.aval.dtype.itemsize)  # noqa: E731
    held = {*jaxpr.invars, *jaxpr.outvars}
    assert temporary_bytes(jaxpr, held | {a}, size, fused=False) == 512
    assert recomputed_bytes(step, facts, size, fused=False) == 512
    assert recomputed_bytes(step, facts, lambda v: size(v) / 4, fused=False) == 128
    assert temporary_bytes(jaxpr, held | {a}, size) == 384
    assert recomputed_bytes(step, facts, size) == 384
    # A kept value is counted written although fusion could leave it out: ``b = tanh(a)``
    # read by a multiply is never written, unless the forward keeps it.
    jaxpr = jax.make_jaxpr(lambda x, w: 2.0 * jnp.tanh(x @ w))(jnp.ones((4, 8)), jnp.ones((8, 8)))
    jaxpr = jaxpr.jaxpr
    b = jaxpr.eqns[1].outvars[0]
    held = {*jaxpr.invars, *jaxpr.outvars}
    assert temporary_bytes(jaxpr, held, size) == 128  # x @ w alone
    assert temporary_bytes(jaxpr, held, size, written={b}) == 256


def _dense_stack_step(checkpointed: bool):
    """Four Dense(64) layers, each under ``jax.checkpoint`` when ``checkpointed``, with
    plain SGD; and its abstract parameters and batch (16 micro-batches of 256 rows)."""

    def dense(h, w, b):
        return jnp.tanh(h @ w + b)

    layer = jax.checkpoint(dense) if checkpointed else dense

    def step(params, batch):
        def loss_fn(p):
            h = batch["x"]
            for w, b in p:
                h = layer(h, w, b)
            return jnp.mean((h - batch["y"]) ** 2)

        grads = alpa.grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)

    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    params = [(f32(WIDTH, WIDTH), f32(WIDTH)) for _ in range(4)]
    return step, params, {"x": f32(16 * 256, WIDTH), "y": f32(16 * 256, WIDTH)}


def test_a_checkpointed_layer_defers_its_gradient_reduction_as_a_written_out_one():
    """Under ``jax.checkpoint`` a layer's backward recomputes it inside a ``remat2``
    equation whose body makes its weight gradients; the lowering defers their reduction
    through the body (``row_sums``), and the model prices it so: the same
    ``gradient_sync`` (``AR_n(P)``, once per step) and per-micro-batch communication as
    the same layer without the checkpoint."""
    priced = {}
    for checkpointed in (False, True):
        seen = {}

        def recording(problem, seen=seen):
            seen["problem"] = problem
            return AnalyticStageCost()(problem)

        step, params, batch = _dense_stack_step(checkpointed)
        space = AutoStageOption(
            cost_model=recording, submesh_logical_shape_space="data_parallel_only"
        )
        method = alpa.PipeshardParallel(
            devices=CLUSTER,
            num_micro_batches=16,
            layer_option=alpa.AutoLayerOption(layer_num=4),
            stage_option=space,
        )
        alpa.parallelize(step, method=method).plan(params, batch)
        problem = seen["problem"]
        plans = stage_cost.LayerPlans(problem, problem.layer_facts, workers=1)
        priced[checkpointed] = {
            (m, config.shape): plans.get(1, m, config)
            for m, configs in enumerate(problem.configs)
            for config in configs
            if np.prod(problem.submesh_choices[m]) > 1
        }
    assert priced[True].keys() == priced[False].keys() and len(priced[True]) >= 3
    for key, cost in priced[True].items():
        n = int(np.prod(key[1]))
        # The kernel's and the bias's all-reduce, once per step. (The bias's gradient is
        # its row sum, a reshape, and a sum over the size-1 dimension of its broadcast,
        # which is not the row sum: ``stage_cost._sums_nothing``.)
        assert cost.gradient_sync == pytest.approx(_all_reduce(PARAM_BYTES, n), rel=1e-9)
        assert cost.gradient_sync == pytest.approx(priced[False][key].gradient_sync, rel=1e-9)
        assert cost.communication == pytest.approx(priced[False][key].communication, rel=1e-9)


def test_each_gradient_row_sum_makes_its_own_gradient():
    """``_LayerFacts.gradients``: walking back from each gradient the marker receives,
    a pipeline marker's output leads to its operand of the same position only. Each
    Dense layer's kernel and bias row sums make their own gradient; the input cotangent
    (``f32[256, 64]``, a ``dot_general`` that sums nothing over the batch), which the
    backward's end marker also passes, is not taken for one."""
    seen = {}

    def recording(problem):
        seen["problem"] = problem
        return AnalyticStageCost()(problem)

    step, params, batch = _dense_stack_step(False)
    method = alpa.PipeshardParallel(
        devices=CLUSTER,
        num_micro_batches=16,
        layer_option=alpa.AutoLayerOption(layer_num=4),
        stage_option=AutoStageOption(cost_model=recording),
    )
    alpa.parallelize(step, method=method).plan(params, batch)
    for layer in range(3):  # the Dense layers without the loss
        gradients = seen["problem"].layer_facts[layer].gradients
        made = sorted(
            (tuple(v.aval.shape), tuple(tuple(g.aval.shape) for g in gs))
            for v, gs in gradients.items()
        )
        assert made == [((WIDTH,), ((WIDTH,),)), ((WIDTH, WIDTH), ((WIDTH, WIDTH),))], made
