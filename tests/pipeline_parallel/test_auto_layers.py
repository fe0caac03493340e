"""AutoLayerOption (layers by clustering the loss function's equations) and segment
rematerialization (alpa.manual_remat, alpa.automatic_remat, remat_mode): the cut against
the clustering DP run on the loss function's own equations, numerics against the serial
step, checkpoint equations in the jaxpr, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import devices_or_skip
from jax.extend.core import Literal

import alpa
from alpa.model.mlp import MLPModel, get_mlp_train_state_and_step
from alpa.parallel_method import PipeshardParallel, ShardParallel
from alpa.pipeline_parallel.layers.layer_clustering import cluster_layers, layer_input_bytes
from alpa.pipeline_parallel.layers.layer_construction import (
    AutoLayerOption,
    construct_layers,
    layer_option_context,
    manual_layers,
    resolve_layer_option,
)
from alpa.testing import assert_allclose
from alpa.tracing import inline_calls
from alpa.tracing.flops import eqn_flops
from alpa.tracing.primitive_def import pipeline_p

BATCH = 16
REMAT = ("remat2", "checkpoint")


# ----------------------------------------------------------------------------- models


def _mlp(value_and_grad, abstract=False):
    """``(state, batch, train_step)`` of examples/pipeshard_manual.py's MLP without its
    boundary: three 16-wide Dense+relu layers and a linear one, trained with Adam;
    ``train_step(state, batch) -> (state, loss)`` differentiates with ``value_and_grad``."""
    model = MLPModel(hidden_size=16, num_layers=3, output_dim=16)
    return get_mlp_train_state_and_step(
        model, BATCH, 16, learning_rate=1e-2, grad_func=value_and_grad, abstract=abstract
    )


def _check_mlp_against_serial(method, steps=2):
    state, batch, step = _mlp(alpa.value_and_grad)
    parallel = alpa.parallelize(step, method=method)
    # The step reads the model from the state: a shape-only build gives the serial one.
    serial = jax.jit(_mlp(jax.value_and_grad, abstract=True)[2])
    # The parallel step donates the state it replaces: the serial one steps a copy.
    parallel_state, serial_state = state, jax.tree.map(jnp.copy, state)
    for _ in range(steps):
        parallel_state, parallel_loss = parallel(parallel_state, batch)
        serial_state, serial_loss = serial(serial_state, batch)
        assert_allclose(parallel_loss, serial_loss, rtol=1e-4, atol=1e-4)
        assert_allclose(parallel_state.params, serial_state.params, rtol=1e-4, atol=1e-4)
    return parallel.get_last_executable()


# Widths 16 -> 64 -> 8 -> 64 -> 16: the 8-wide activation is the cheapest value to cut at,
# and it splits the dot FLOPs 3:3, so the DP has a clear answer.
WIDTHS = (16, 64, 8, 64, 16)


def _bottleneck_params():
    keys = jax.random.split(jax.random.PRNGKey(1), len(WIDTHS) + 1)
    params = {}
    for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:], strict=False)):
        params[f"w{i}"] = jax.random.normal(keys[i], (a, b)) / np.sqrt(a)
        params[f"b{i}"] = jnp.full((b,), 0.01 * i)
    x = jax.random.normal(keys[-2], (BATCH, WIDTHS[0]))
    y = jax.random.normal(keys[-1], (BATCH, WIDTHS[-1]))
    return params, (x, y)


def _bottleneck_loss(params, x, y):
    h = x
    for i in range(len(WIDTHS) - 1):
        h = jnp.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
    return jnp.mean((h - y) ** 2)


def _sgd_step(loss, grad_fn):
    def step(params, batch):
        value, grads = grad_fn(loss)(params, *batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    return step


def _expected_cut(loss, args, layer_num, tolerance):
    """The oracle: cluster_layers on the loss function's equations (jits inlined), with
    per-equation FLOPs and bytes crossing layers computed here from the jaxpr."""
    closed = inline_calls(jax.make_jaxpr(loss)(*args), ("jit", "pjit"))
    eqns = closed.jaxpr.eqns
    ids, producer, nbytes = {}, [], []

    def vid(v, eqn):
        if v not in ids:
            ids[v] = len(producer)
            producer.append(eqn)
            nbytes.append(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize)
        return ids[v]

    inputs = []
    for i, eqn in enumerate(eqns):
        inputs.append([vid(v, -1) for v in eqn.invars if not isinstance(v, Literal)])
        for v in eqn.outvars:
            vid(v, i)
    flops = [eqn_flops(e) for e in eqns]
    starts, _ = cluster_layers(
        flops, layer_input_bytes(inputs, producer, nbytes), layer_num, tolerance
    )
    return eqns, starts


def _layer_of_position(starts, i):
    return sum(1 for s in starts if s <= i)


# ----------------------------------------------------------------------------- bad input


def test_bad_options():
    with pytest.raises(ValueError, match=r"layer_num must be an int >= 1, got 0"):
        AutoLayerOption(layer_num=0)
    with pytest.raises(TypeError, match=r"layer_num must be an int >= 1.*got 2.5 \(float\)"):
        AutoLayerOption(layer_num=2.5)
    with pytest.raises(ValueError, match=r"remat_mode must be one of \('none', .*got 'full'"):
        AutoLayerOption(2, remat_mode="full")
    with pytest.raises(ValueError, match=r"layer_eps must be a finite number >= 0.*got -0.1"):
        AutoLayerOption(2, layer_eps=-0.1)
    with pytest.raises(ValueError, match=r"fine_grained_remat_layer_num=1 is less than"):
        AutoLayerOption(2, remat_mode="fine_grained_remat", fine_grained_remat_layer_num=1)
    with pytest.raises(
        ValueError, match=r"fine_grained_remat_layer_num must be an int >= 1, got 0"
    ):
        AutoLayerOption(2, remat_mode="fine_grained_remat", fine_grained_remat_layer_num=0)
    with pytest.raises(ValueError, match=r"layer_eps=0.1 and eps=0.2; they are the same"):
        AutoLayerOption(2, layer_eps=0.1, eps=0.2)
    with pytest.raises(ValueError, match=r"'manual', a ManualLayerOption or an AutoLayerOption"):
        resolve_layer_option("auto")
    with pytest.raises(ValueError, match=r"automatic_remat: layer_num must be an int >= 1"):
        alpa.automatic_remat(_bottleneck_loss, layer_num=0)
    with pytest.raises(TypeError, match=r"manual_remat expects a callable"):
        alpa.manual_remat(3)
    # Alpa's name for the tolerance, and its coarse remat, are the option's too.
    option = AutoLayerOption(2, eps=0.25, remat_mode="coarse_grained_remat")
    assert option.layer_eps == 0.25 and option.remat_layer
    assert not AutoLayerOption(2, remat_mode="fine_grained_remat").remat_layer
    assert AutoLayerOption(2, static_argnums=1).static_argnums == (1,)


def test_layer_num_larger_than_the_loss_functions_equations():
    devices_or_skip(8)
    params, batch = _bottleneck_params()
    num_eqns = len(inline_calls(jax.make_jaxpr(_bottleneck_loss)(params, *batch)).jaxpr.eqns)
    method = PipeshardParallel(layer_option=AutoLayerOption(layer_num=num_eqns + 1))
    step = alpa.parallelize(_sgd_step(_bottleneck_loss, alpa.value_and_grad), method=method)
    with pytest.raises(
        ValueError,
        match=rf"layer_num={num_eqns + 1}.*cannot cut the {num_eqns} equations.*at most "
        rf"{num_eqns} layers",
    ):
        step.get_executable(params, batch)


def test_no_cut_within_the_tolerance_suggests_a_larger_layer_eps():
    def loss(w, x):  # one dot carries almost all the FLOPs: 2 layers cannot be balanced
        return jnp.sum(jnp.tanh(x @ w))

    w, x = jnp.ones((32, 32)), jnp.ones((8, 32))
    with layer_option_context(AutoLayerOption(2, layer_eps=0.0)):
        with pytest.raises(ValueError, match=r"layer_eps=0.0.*Use a larger eps \(layer_eps\)"):
            jax.make_jaxpr(alpa.grad(loss))(w, x)
    # More tolerance: the dot alone is one layer.
    with layer_option_context(AutoLayerOption(2, layer_eps=1.0)):
        jaxpr = jax.make_jaxpr(alpa.grad(loss))(w, x)
    assert manual_layers(jaxpr).num_layers == 2


# ----------------------------------------------------------------------------- the cut


@pytest.mark.parametrize("layer_num, tolerance", [(2, 0.6), (3, 0.5)])
def test_cut_is_the_clustering_of_the_loss_functions_equations(layer_num, tolerance):
    params, batch = _bottleneck_params()
    eqns, starts = _expected_cut(_bottleneck_loss, (params, *batch), layer_num, tolerance)
    expected = [
        _layer_of_position(starts, i)
        for i, e in enumerate(eqns)
        if e.primitive.name == "dot_general"
    ]
    assert len(expected) == len(WIDTHS) - 1 and len(set(expected)) > 1

    option = AutoLayerOption(layer_num=layer_num, layer_eps=tolerance)
    with layer_option_context(option):
        closed = jax.make_jaxpr(_sgd_step(_bottleneck_loss, alpa.value_and_grad))(params, batch)
    starts_seen = [
        e.params["name"]
        for e in closed.jaxpr.eqns
        if e.primitive is pipeline_p and e.params["mark_type"] == "start"
    ]
    # Each layer's start marker once in the forward pass and once (mirrored) in the backward.
    assert sorted(set(starts_seen)) == [f"layer_{i}" for i in range(layer_num)]
    assert len(starts_seen) == 2 * layer_num
    layers = construct_layers(closed, option)
    assert layers.num_layers == layer_num
    forward_dots = [
        layer
        for e, layer, kind in zip(closed.jaxpr.eqns, layers.layers, layers.kinds, strict=True)
        if e.primitive.name == "dot_general" and kind == "forward"
    ]
    assert forward_dots == expected


def test_two_layers_cut_at_the_bottleneck_and_become_two_stages():
    devices_or_skip(8)
    params, batch = _bottleneck_params()
    method = PipeshardParallel(
        num_micro_batches=2, layer_option=AutoLayerOption(layer_num=2), stage_option="uniform"
    )
    step = alpa.parallelize(_sgd_step(_bottleneck_loss, alpa.value_and_grad), method=method)
    executable = step.get_executable(params, batch)
    assert executable.stage_plan.num_stages == 2
    # The only value that crosses the two layers is the 8-wide activation: the forward of
    # stage 0 holds the first two dots, the forward of stage 1 the last two.
    for stage, shapes in ((0, [(16, 64), (64, 8)]), (1, [(8, 64), (64, 16)])):
        forward = executable.program.computation(stage, "forward")
        dots = [e.invars[1].aval.shape for e in forward.eqns if e.primitive.name == "dot_general"]
        assert dots == shapes
    ref = jax.jit(_sgd_step(_bottleneck_loss, jax.value_and_grad))(params, batch)
    assert_allclose(step(params, batch), ref, rtol=1e-4, atol=1e-4)


def test_user_boundaries_are_ignored():
    params, batch = _bottleneck_params()

    def loss(params, x, y):  # a boundary after the first layer: AutoLayerOption drops it
        h = jnp.tanh(x @ params["w0"] + params["b0"])
        alpa.mark_pipeline_boundary()
        for i in range(1, len(WIDTHS) - 1):
            h = jnp.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
        return jnp.mean((h - y) ** 2)

    with layer_option_context(AutoLayerOption(2)):
        closed = jax.make_jaxpr(_sgd_step(loss, alpa.value_and_grad))(params, batch)
    marks = [e.params["mark_type"] for e in closed.jaxpr.eqns if e.primitive is pipeline_p]
    assert "boundary" not in marks
    layers = manual_layers(closed)
    dots = [
        layer
        for e, layer, kind in zip(closed.jaxpr.eqns, layers.layers, layers.kinds, strict=True)
        if e.primitive.name == "dot_general" and kind == "forward"
    ]
    assert dots == [0, 0, 1, 1]  # cut at the bottleneck, not at the boundary
    # Outside the context, alpa.grad cuts at the boundary again.
    closed = jax.make_jaxpr(_sgd_step(loss, alpa.value_and_grad))(params, batch)
    layers = manual_layers(closed)
    dots = [
        layer
        for e, layer, kind in zip(closed.jaxpr.eqns, layers.layers, layers.kinds, strict=True)
        if e.primitive.name == "dot_general" and kind == "forward"
    ]
    assert dots == [0, 1, 1, 1]


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_micro_batches", [1, 4])
def test_mlp_matches_serial(schedule, num_micro_batches):
    devices_or_skip(8)
    method = PipeshardParallel(
        num_micro_batches=num_micro_batches,
        layer_option=AutoLayerOption(layer_num=2),
        stage_option="uniform",
        pipeline_schedule=schedule,
    )
    executable = _check_mlp_against_serial(method)
    assert executable.stage_plan.num_stages == 2
    assert executable.live_buffers_after_step() == []


def test_inference_step_is_clustered():
    devices_or_skip(8)
    params, (x, _) = _bottleneck_params()

    def infer(params, x):
        h = x
        for i in range(len(WIDTHS) - 1):
            h = jnp.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
        return h

    method = PipeshardParallel(
        num_micro_batches=2,
        layer_option=AutoLayerOption(layer_num=2),
        stage_option="uniform",
        pipeline_schedule="inference",
    )
    step = alpa.parallelize(infer, method=method)
    out = step(params, x)
    assert_allclose(out, infer(params, x), rtol=1e-4, atol=1e-4)
    executable = step.get_last_executable()
    assert executable.stage_plan.num_stages == 2
    # The step was traced at micro-batch size: so is the oracle's cut.
    eqns, starts = _expected_cut(infer, (params, x[: BATCH // 2]), 2, 0.6)
    assert eqns[starts[0] - 1].outvars[0].aval.shape == (BATCH // 2, 8)  # the bottleneck
    layers = construct_layers(executable.traced.closed_jaxpr, method.layer_option)
    assert layers.layers == tuple(_layer_of_position(starts, i) for i in range(len(eqns)))
    for stage, shapes in ((0, [(16, 64), (64, 8)]), (1, [(8, 64), (64, 16)])):
        forward = executable.program.computation(stage, "forward")
        dots = [e.invars[1].aval.shape for e in forward.eqns if e.primitive.name == "dot_general"]
        assert dots == shapes


# ----------------------------------------------------------------------------- remat


def test_coarse_grained_remat_matches_serial_and_recomputes_the_forward():
    devices_or_skip(8)
    method = PipeshardParallel(
        num_micro_batches=2,
        layer_option=AutoLayerOption(layer_num=2, remat_mode="coarse_grained_remat"),
        stage_option="uniform",
        pipeline_schedule="gpipe",
    )
    executable = _check_mlp_against_serial(method)
    for stage in range(2):
        forward = executable.program.computation(stage, "forward")
        backward = executable.program.computation(stage, "backward")
        # The backward recomputes: it reads no value of its own forward.
        assert not {v for e in forward.eqns for v in e.outvars} & set(backward.invars)


def test_fine_grained_remat_matches_serial_with_checkpointed_segments():
    devices_or_skip(8)
    option = AutoLayerOption(
        layer_num=2, remat_mode="fine_grained_remat", fine_grained_remat_layer_num=4
    )
    method = PipeshardParallel(
        num_micro_batches=2, layer_option=option, stage_option="uniform", pipeline_schedule="1f1b"
    )
    executable = _check_mlp_against_serial(method)
    checkpoints = {
        stage: [
            e
            for e in executable.program.computation(stage, "backward").eqns
            if e.primitive.name in REMAT
        ]
        for stage in range(2)
    }
    # Four checkpointed segments, each recomputed in the backward of the stage it is on.
    assert len(checkpoints[0]) + len(checkpoints[1]) == 4
    assert checkpoints[0] and checkpoints[1]


def _remat_eqns(jaxpr):
    return [e for e in jaxpr.eqns if e.primitive.name in REMAT]


def _two_layer_loss(params, x, y):
    h = jnp.tanh(x @ params["w0"] + params["b0"])
    h = jnp.tanh(h @ params["w1"] + params["b1"])
    alpa.mark_pipeline_boundary()
    h = jnp.tanh(h @ params["w2"] + params["b2"])
    h = jnp.tanh(h @ params["w3"] + params["b3"])
    return jnp.mean((h - y) ** 2)


def test_manual_remat_checkpoints_each_segment_and_keeps_gradients():
    params, (x, y) = _bottleneck_params()
    wrapped = alpa.manual_remat(_two_layer_loss)
    closed = jax.make_jaxpr(wrapped)(params, x, y)
    kinds = [
        "remat" if e.primitive.name in REMAT else e.params["mark_type"]
        for e in closed.jaxpr.eqns
        if e.primitive.name in REMAT or e.primitive is pipeline_p
    ]
    assert kinds == ["remat", "boundary", "remat"]  # the boundary survives, for alpa.grad
    grad_jaxpr = jax.make_jaxpr(jax.grad(wrapped))(params, x, y).jaxpr
    assert sum(e.params["differentiated"] for e in _remat_eqns(grad_jaxpr)) == 2
    assert_allclose(
        jax.jit(jax.grad(wrapped))(params, x, y), jax.grad(_two_layer_loss)(params, x, y), rtol=1e-5
    )
    assert_allclose(wrapped(params, x, y), _two_layer_loss(params, x, y), rtol=1e-6)


@pytest.mark.parametrize("layer_num", [1, 3])
def test_automatic_remat_checkpoints_clustered_segments_and_keeps_gradients(layer_num):
    params, (x, y) = _bottleneck_params()
    wrapped = alpa.automatic_remat(_bottleneck_loss, layer_num=layer_num)
    closed = jax.make_jaxpr(wrapped)(params, x, y)
    # Every equation is in one of layer_num checkpointed segments, cut as the DP says.
    assert len(_remat_eqns(closed.jaxpr)) == len(closed.jaxpr.eqns) == layer_num
    eqns, starts = _expected_cut(_bottleneck_loss, (params, x, y), layer_num, 0.6)
    bounds = [0, *starts, len(eqns)]
    sizes = [len(e.params["jaxpr"].eqns) for e in closed.jaxpr.eqns]
    assert sizes == [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    grad_jaxpr = jax.make_jaxpr(jax.grad(wrapped))(params, x, y).jaxpr
    assert any(e.params["differentiated"] for e in _remat_eqns(grad_jaxpr))
    assert_allclose(
        jax.jit(jax.grad(wrapped))(params, x, y),
        jax.grad(_bottleneck_loss)(params, x, y),
        rtol=1e-5,
    )
    # As a decorator, and with a non-array argument.
    scaled = alpa.automatic_remat(layer_num=2)(lambda p, x, y, s: s * _bottleneck_loss(p, x, y))
    assert_allclose(scaled(params, x, y, 2.0), 2.0 * _bottleneck_loss(params, x, y), rtol=1e-6)


def test_checkpointed_loss_compiles_through_shard_and_pipeshard_parallel():
    devices_or_skip(8)
    params = {
        f"{kind}{i}": value
        for i in range(4)
        for kind, value in (
            ("w", jax.random.normal(jax.random.PRNGKey(i), (16, 16)) / 4),
            ("b", jnp.full((16,), 0.1 * i)),
        )
    }
    keys = jax.random.split(jax.random.PRNGKey(7), 2)
    batch = (jax.random.normal(keys[0], (BATCH, 16)), jax.random.normal(keys[1], (BATCH, 16)))
    ref = jax.jit(_sgd_step(_two_layer_loss, jax.value_and_grad))(params, batch)

    # ShardParallel: the intra-op pass sees the checkpoint equations (run replicated).
    loss = alpa.automatic_remat(_two_layer_loss, layer_num=2)
    step = alpa.parallelize(_sgd_step(loss, alpa.value_and_grad), method=ShardParallel())
    assert _remat_eqns(step.get_executable(params, batch).traced.jaxpr)
    assert_allclose(step(params, batch), ref, rtol=1e-4, atol=1e-4)

    # PipeshardParallel with the user's layers: manual_remat keeps the boundary.
    loss = alpa.manual_remat(_two_layer_loss)
    method = PipeshardParallel(num_micro_batches=2, stage_option="uniform")
    step = alpa.parallelize(_sgd_step(loss, alpa.value_and_grad), method=method)
    executable = step.get_executable(params, batch)
    assert executable.stage_plan.num_stages == 2
    for stage in range(2):
        assert _remat_eqns(executable.program.computation(stage, "backward"))
    assert_allclose(step(params, batch), ref, rtol=1e-4, atol=1e-4)
