"""Layer construction: alpa.grad turns operand-less boundaries into layer markers that JAX's
transpose mirrors into the backward pass, and the stage split follows them."""

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import devices_or_skip

import alpa
from alpa.parallel_method import PipeshardParallel
from alpa.pipeline_parallel.layers.layer_construction import manual_layers
from alpa.tracing.primitive_def import pipeline_p


def _params(hidden=8):
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    return {
        "w0": jax.random.normal(keys[0], (hidden, hidden)),
        "b0": jnp.zeros((hidden,)),
        "w1": jax.random.normal(keys[1], (hidden, hidden)),
        "b1": jnp.zeros((hidden,)),
    }


def _loss(params, x, y):
    h = jnp.tanh(x @ params["w0"] + params["b0"])
    alpa.mark_pipeline_boundary()
    h = jnp.tanh(h @ params["w1"] + params["b1"])
    return jnp.mean((h - y) ** 2)


def _step(grad_fn):
    def step(params, batch):
        loss, grads = grad_fn(_loss)(params, *batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    return step


def _batch(hidden=8):
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    return jax.random.normal(keys[0], (8, hidden)), jax.random.normal(keys[1], (8, hidden))


def _markers(jaxpr):
    return [
        (e.params["name"], e.params["mark_type"], len(e.invars))
        for e in jaxpr.eqns
        if e.primitive is pipeline_p
    ]


def test_plain_jax_grad_leaves_no_boundary_in_the_backward_pass():
    # Why alpa.grad rewrites: AD evaluates an equation without operands in the forward
    # sweep only, so jax.value_and_grad keeps the one boundary and mirrors nothing.
    jaxpr = jax.make_jaxpr(_step(jax.value_and_grad))(_params(), _batch()).jaxpr
    assert _markers(jaxpr) == [("boundary", "boundary", 0)]


def test_alpa_grad_mirrors_the_layer_markers_into_the_backward_pass():
    jaxpr = jax.make_jaxpr(_step(alpa.value_and_grad))(_params(), _batch()).jaxpr
    names = [(name, kind) for name, kind, _ in _markers(jaxpr)]
    # One boundary = 2 layers, each wrapped by a start and an end marker: 4 markers in the
    # forward pass. Each carries tangents, so its transpose appears in the backward pass,
    # mirrored (the tangents' end becomes the cotangents' start) and in reverse layer
    # order: 4 more. Then the alpa.grad marker: 9 in all, and the boundary is gone.
    assert names == [
        ("layer_0", "start"),
        ("layer_0", "end"),
        ("layer_1", "start"),
        ("layer_1", "end"),
        ("layer_1", "start"),
        ("layer_1", "end"),
        ("layer_0", "start"),
        ("layer_0", "end"),
        ("grad", "grad"),
    ]
    counts = [n for _, _, n in _markers(jaxpr)]
    # Forward: layer 0 reads x, w0, b0 and passes h on; layer 1 reads h, w1, b1, y and
    # passes on the loss. Backward: only values with a tangent are marked: the loss's
    # cotangent enters layer 1, whose backward passes on those of h, w1, b1; layer 0's
    # backward passes on those of w0, b0 (not x's: the batch has no tangent).
    assert counts == [3, 1, 4, 1, 1, 3, 1, 2, 5]


def test_stage_split_follows_the_mirrored_markers():
    devices_or_skip(8)
    params, batch = _params(), _batch()
    method = PipeshardParallel(num_micro_batches=2, stage_option="uniform")
    step = alpa.parallelize(_step(alpa.value_and_grad), method=method, batch_argnums=(1,))
    executable = step.get_executable(params, batch)
    layers = manual_layers(executable.traced.closed_jaxpr)
    assert layers.num_layers == 2
    program = executable.program
    # The program's jaxpr: the traced one with parameters read past their markers
    # (``read_step_inputs_through_markers``), equation for equation.
    jaxpr = program.closed_jaxpr.jaxpr
    assert len(jaxpr.eqns) == len(executable.traced.closed_jaxpr.jaxpr.eqns)
    eqn_home = {id(e): (c.stage, c.kind) for c in program.computations for e in c.eqns}
    # Every equation between the mirrored markers of layer l runs in stage l's backward.
    seen = {0: 0, 1: 0}
    for eqn, layer, kind in zip(jaxpr.eqns, layers.layers, layers.kinds, strict=True):
        if kind != "backward" or eqn.outvars[0] in program.const_eqns:
            continue
        assert eqn_home[id(eqn)] == (layer, "backward"), eqn
        seen[layer] += 1
    assert seen[0] > 0 and seen[1] > 0
    # The weight gradients (dot_generals of the backward) are each on their layer's stage.
    grads = {}
    for comp in program.computations:
        if comp.kind == "backward":
            grads[comp.stage] = [
                e.outvars[0].aval.shape for e in comp.eqns if e.primitive.name == "dot_general"
            ]
    assert (8, 8) in grads[0] and (8, 8) in grads[1]
    ref = jax.jit(_step(jax.value_and_grad))(params, batch)
    out = step(params, batch)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        assert jnp.allclose(a, b, rtol=1e-4, atol=1e-4)


def test_has_aux_and_non_array_arguments_pass_through_the_rewrite():
    params, (x, y) = _params(), _batch()

    def loss(params, x, y, scale):
        h = jnp.tanh(x @ params["w0"])
        alpa.mark_pipeline_boundary()
        out = h @ params["w1"] * scale
        return jnp.mean((out - y) ** 2), {"mean": jnp.mean(out), "n": jnp.sum(x > 0)}

    (value, aux), grads = alpa.value_and_grad(loss, has_aux=True)(params, x, y, 2.0)
    (ref_value, ref_aux), ref_grads = jax.value_and_grad(loss, has_aux=True)(params, x, y, 2.0)
    for a, b in zip(
        jax.tree.leaves((value, aux, grads)),
        jax.tree.leaves((ref_value, ref_aux, ref_grads)),
        strict=True,
    ):
        assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_boundary_outside_the_differentiated_function():
    devices_or_skip(8)
    params, batch = _params(), _batch()

    def step(params, batch):
        loss, grads = alpa.value_and_grad(_loss)(params, *batch)
        alpa.mark_pipeline_boundary()
        return optax.apply_updates(params, grads), loss

    traced = jax.make_jaxpr(step)(params, batch)
    with pytest.raises(ValueError, match=r"mark_pipeline_boundary\(\) was called after alpa.grad"):
        manual_layers(traced)

    def step2(params, batch):
        x, y = batch
        x = x * 2
        alpa.mark_pipeline_boundary()
        loss, grads = alpa.value_and_grad(_loss)(params, x, y)
        return optax.apply_updates(params, grads), loss

    with pytest.raises(ValueError, match=r"both in the function that alpa.grad"):
        manual_layers(jax.make_jaxpr(step2)(params, batch))


def test_alpas_layer_decorators_mark_layers_for_plain_jax_grad():
    # Alpa's programs decorate the loss and differentiate it with jax.grad: the decorator
    # does what alpa.grad does, with its own option.
    from alpa.pipeline_parallel.layers.layer_construction import (
        automatic_layer_construction,
        manual_layer_construction,
    )

    manual = _step(lambda f: jax.value_and_grad(manual_layer_construction(f)))
    jaxpr = jax.make_jaxpr(manual)(_params(), _batch()).jaxpr
    names = [(name, kind) for name, kind, _ in _markers(jaxpr)]
    assert names[:4] == [
        ("layer_0", "start"),
        ("layer_0", "end"),
        ("layer_1", "start"),
        ("layer_1", "end"),
    ]
    assert len(names) == 8 and ("boundary", "boundary") not in names
    # The automatic one clusters into layer_num layers, ignoring the boundary.
    auto = _step(
        lambda f: jax.value_and_grad(automatic_layer_construction(layer_num=2, eps=1.0)(f))
    )
    jaxpr = jax.make_jaxpr(auto)(_params(), _batch()).jaxpr
    starts = [n for n, kind, _ in _markers(jaxpr) if kind == "start"]
    assert starts[:2] == ["layer_0", "layer_1"] and len(starts) == 4
    ref = jax.jit(_step(jax.value_and_grad))(_params(), _batch())
    for step in (manual, auto):
        for a, b in zip(
            jax.tree.leaves(step(_params(), _batch())), jax.tree.leaves(ref), strict=True
        ):
            assert jnp.allclose(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="automatic_layer_construction needs layer_num"):
        automatic_layer_construction(_loss)
    with pytest.raises(TypeError, match="static_argnums must be an int or a tuple of ints"):
        manual_layer_construction(_loss, static_argnums="x")
