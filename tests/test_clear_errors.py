"""Clear errors and warnings where a mistake used to be silent or surface as an internal
error: each case with the exact message, and, where a correct call
sits next to the mistake, that call still runs and matches serial."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.errors import ScopeParamShapeError
from jax.sharding import PartitionSpec as P

import alpa
from alpa.testing import assert_allclose, get_mlp_train_state_and_step

B, H = 32, 16


def _mlp(**kw):
    return get_mlp_train_state_and_step(B, H, num_layers=2, **kw)


def _pipeshard(**kw):
    return alpa.PipeshardParallel(
        num_micro_batches=2, layer_option="manual", stage_option="uniform", **kw
    )


def _copy(tree):
    """A copy whose buffers no donation can delete (the serial reference's inputs)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


# ----------------------------------------------------------------------------- 1. batch


def test_train_state_in_the_batch_position_is_named():
    state, batch, train_step = _mlp()

    def swapped(batch, state):
        return train_step(state, batch)

    with pytest.raises(
        ValueError,
        match=r"argument 1 of swapped is a batch argument \(batch_argnums=\(1,\), the default "
        r"for a call with two or more arguments\) but it is a flax TrainState, which holds "
        r"the parameters: they would be split on dim 0 as a batch. Name the position of the "
        r"batch with batch_argnums=\(0,\)",
    ):
        alpa.parallelize(swapped, method=alpa.DataParallel())(batch, state)
    off_by_one = alpa.parallelize(train_step, method=alpa.DataParallel(), batch_argnums=(0,))
    with pytest.raises(
        ValueError,
        match=r"argument 0 of train_step is a batch argument \(batch_argnums=\(0,\)\) but it "
        r"is a flax TrainState.*batch_argnums=\(1,\)",
    ):
        off_by_one(state, batch)
    # The fix the message names runs and matches serial.
    fixed = alpa.parallelize(swapped, method=alpa.DataParallel(), batch_argnums=(0,))
    assert_allclose(fixed(batch, _copy(state)).params, jax.jit(train_step)(state, batch).params)


def _params_and_batch():
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.standard_normal((H, H)) / 4, jnp.float32),
        "b": jnp.zeros((H,), jnp.float32),
    }
    batch = {
        "x": jnp.asarray(rng.standard_normal((B, H)), jnp.float32),
        "y": jnp.asarray(rng.standard_normal((B, H)), jnp.float32),
    }
    return params, batch


def _sgd_step(params, batch):
    def loss(params):
        return jnp.mean((jnp.tanh(batch["x"] @ params["w"] + params["b"]) - batch["y"]) ** 2)

    grads = alpa.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def test_parameters_in_the_batch_position_are_named():
    params, batch = _params_and_batch()
    # W is (16, 16): it splits over 8 devices like a batch would, so nothing else fails.
    f = alpa.parallelize(_sgd_step, method=alpa.DataParallel(), batch_argnums=(0,))
    with pytest.raises(
        ValueError,
        match=r"argument 0 of _sgd_step is a batch argument \(batch_argnums=\(0,\)\) but "
        r"alpa.grad differentiates every one of its leaves, so it looks like the parameters",
    ):
        f(params, batch)


def test_input_gradients_of_a_real_batch_are_not_mistaken_for_parameters():
    # Adversarial training differentiates the loss with respect to the batch's x.
    params, batch = _params_and_batch()

    def step(params, batch):
        def loss(x):
            return jnp.mean((jnp.tanh(x @ params["w"]) - batch["y"]) ** 2)

        return batch["x"] + 0.1 * jnp.sign(alpa.grad(loss)(batch["x"]))

    f = alpa.parallelize(step, method=alpa.DataParallel())
    ref = jax.jit(step)(params, batch)  # alpa.grad runs under jax.jit too
    assert_allclose(f(params, batch), ref)


# ----------------------------------------------------------------------------- 2. static


def test_array_in_static_argnums_is_a_type_error():
    f = alpa.parallelize(lambda w, x: w * x, static_argnums=(1,))
    with pytest.raises(
        TypeError,
        match=r"argument 1 of <lambda> is in static_argnums=\(1,\) but is an array "
        r"\(float32\[8\]\): arrays cannot be static, as they are not hashable and a static "
        r"value compiles the step again for every new value; remove 1 from static_argnums",
    ):
        f(jnp.ones(()), jnp.ones((8,), jnp.float32))
    g = alpa.parallelize(lambda p, x: p["w"] * x, static_argnums=(0,), batch_argnums=(1,))
    with pytest.raises(TypeError, match=r"argument 0 .* is an array \(a dict holding float32"):
        g({"w": np.ones((2,), np.float32), "b": np.ones((2,), np.float32)}, jnp.ones((8, 2)))


def test_static_argument_1_is_not_the_default_batch():
    # Alpa's default batch_argnums=(1,) does not claim an argument the user made static.
    f = alpa.parallelize(
        lambda x, mode: jnp.tanh(x) if mode == "tanh" else x,
        static_argnums=(1,),
        method=alpa.DataParallel(),
    )
    x = jnp.linspace(-1.0, 1.0, 16)
    assert_allclose(f(x, "tanh"), jnp.tanh(x))


# ----------------------------------------------------------------------------- 3. outputs


@pytest.mark.parametrize(
    "output, path, kind",
    [
        (lambda y: (y, "done"), r"output\[1\]", "str"),
        (lambda y: (y, {"name": object()}), r"output\[1\]\['name'\]", "object"),
    ],
)
def test_output_that_is_not_an_array_is_named_by_its_path(output, path, kind):
    def step(w, x):
        return output(w * x)

    f = alpa.parallelize(step, method=alpa.DataParallel())
    with pytest.raises(
        TypeError,
        match=rf"step returned a value of type {kind} at {path}: outputs must be pytrees "
        "of arrays",
    ):
        f(jnp.ones(()), jnp.ones((8,)))


def test_python_scalars_and_none_in_the_output_are_fine():
    f = alpa.parallelize(lambda w, x: (w * x, 1.5, None), method=alpa.DataParallel())
    out = f(jnp.float32(2.0), jnp.ones((8,)))
    assert_allclose(out[:2], (2.0 * jnp.ones((8,)), 1.5))
    assert out[2] is None


# ----------------------------------------------------------------------------- 4. donation


DONATED = (
    r"argument 0 \(a TrainState\) of train_step was donated to an earlier call of "
    r"train_step, whose outputs reused its buffers, so its arrays are deleted: "
    r"donate_argnums='auto' donates TrainState arguments, so that the step updates the "
    r"state in place. Pass what that call returned instead \(state = train_step\(state, "
    r"...\)\), or parallelize with donate_argnums=\(\) to keep the arguments alive"
)


def test_reusing_a_donated_train_state_shard_parallel():
    state, batch, train_step = _mlp()
    f = alpa.parallelize(train_step, method=alpa.ShardParallel())
    s1 = f(state, batch)
    s2 = f(s1, batch)
    # The state the first call returned went to the second (a cache hit): jax would crash.
    with pytest.raises(ValueError, match=DONATED):
        f(s1, batch)
    s3 = f(s2, batch)  # the returned state is the right one to pass
    # Another step that is handed a deleted array names its leaf.
    g = alpa.parallelize(lambda state: state.step + 1)
    with pytest.raises(ValueError, match=r"argument 0\.step of <lambda> is a deleted array"):
        g(s2)
    # With donate_argnums=() nothing is donated: the same state twice gives the same result.
    keep = alpa.parallelize(train_step, method=alpa.ShardParallel(), donate_argnums=())
    assert_allclose(keep(s3, batch), keep(s3, batch))


def test_reusing_a_donated_train_state_pipeshard_parallel():
    # A pipelined step donates the state it replaces, as the one-mesh methods do: the
    # state a call returned, passed again after the next call consumed it, is named.
    state, batch, train_step = _mlp(add_manual_pipeline_marker=True)
    ref = jax.jit(train_step)(jax.jit(train_step)(_copy(state), batch), batch)
    f = alpa.parallelize(train_step, method=_pipeshard())
    s1 = f(state, batch)
    s2 = f(s1, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves(s1))
    with pytest.raises(ValueError, match=DONATED):
        f(s1, batch)
    assert_allclose(s2, ref)
    # With donate_argnums=() nothing is donated: the same state twice gives the same result.
    keep = alpa.parallelize(train_step, method=_pipeshard(), donate_argnums=())
    assert_allclose(keep(s2, batch), keep(s2, batch))


# ----------------------------------------------------------------------------- 5. manual specs


def _manual(in_res, names=("data", "model"), mesh_shape=(2, 4)):
    mesh = alpa.LocalPhysicalDeviceMesh().get_logical_mesh(mesh_shape)
    option = alpa.ManualShardingOption(names, in_axis_resources=in_res)
    return alpa.ShardParallel(devices=mesh, manual_sharding_option=option)


def test_manual_spec_that_does_not_divide_a_dimension():
    w, x = jnp.ones((6, 4)), jnp.ones((8, 6))
    method = _manual(({"w": P("model")}, P("data")))
    f = alpa.parallelize(lambda p, x: x @ p["w"], method=method)
    with pytest.raises(
        ValueError,
        match=r"in_axis_resources for argument 0\['w'\]: PartitionSpec "
        r"P\('model',\) splits dimension 0 of size 6 \(shape \(6, 4\)\) over mesh "
        r"axis 'model' of size 4, which does not divide it",
    ):
        f({"w": w}, x)
    g = alpa.parallelize(lambda w, x: x @ w, method=_manual((P(), P(("data", "model")))))
    with pytest.raises(
        ValueError,
        match=r"argument 1: .* splits dimension 0 of size 4 \(shape \(4, 6\)\) over mesh axes "
        r"'data' of size 2 and 'model' of size 4 \(8 parts\), which does not divide it",
    ):
        g(jnp.ones((6, 4)), jnp.ones((4, 6)))


def test_manual_spec_that_repeats_a_mesh_axis():
    f = alpa.parallelize(lambda w, x: x @ w, method=_manual((P("model", "model"), P("data"))))
    with pytest.raises(
        ValueError,
        match=r"in_axis_resources for argument 0: PartitionSpec P\('model', "
        r"'model'\) uses mesh axis 'model' more than once; each mesh axis may split at most "
        "one dimension",
    ):
        f(jnp.ones((8, 8)), jnp.ones((8, 8)))
    # PipeshardParallel checks its specs' axis names when it is built.
    option = alpa.ManualShardingOption(("data",), in_axis_resources=(P(("data", "data")), P()))
    with pytest.raises(
        ValueError,
        match=r"manual_sharding_option.in_axis_resources: P\(\('data', 'data'\),\) "
        "uses mesh axis 'data' more than once",
    ):
        _pipeshard(manual_sharding_option=option)


def test_manual_sharding_option_naming_one_axis_twice():
    """Two mesh axes of one name: refused where the option is made, not by JAX's
    ``DuplicateSpecError`` about a spec the user did not write."""
    with pytest.raises(
        ValueError,
        match=r"mesh_axis_names=\('data', 'data'\) names the mesh axis 'data' twice: "
        r"expected a distinct name for each mesh axis",
    ):
        alpa.ManualShardingOption(mesh_axis_names=("data", "data"))
    with pytest.raises(
        ValueError, match=r"submesh_axis_names\[1\]=\('x', 'x'\) names the mesh axis 'x' twice"
    ):
        alpa.ManualShardingOption(None, submesh_axis_names=(("x", "y"), ("x", "x")))


# ----------------------------------------------------------------------------- 6. jax.grad


def test_jax_grad_in_a_pipelined_step_says_use_alpa_grad():
    from alpa.model.mlp import MLPModel
    from alpa.model.mlp import get_mlp_train_state_and_step as make

    model = MLPModel(hidden_size=H, num_layers=2, add_manual_pipeline_markers=True)
    state, batch, step = make(model, B, H, grad_func=jax.value_and_grad)
    f = alpa.parallelize(step, method=_pipeshard())
    with pytest.raises(
        ValueError,
        match=r"train_step differentiates with jax.grad \(or jax.value_and_grad / jax.vjp\), "
        r"so with num_micro_batches=2 PipeshardParallel cannot tell its gradients \(to "
        r"average over micro-batches\) from its other outputs: use alpa.grad / "
        r"alpa.value_and_grad in place of jax.grad / jax.value_and_grad",
    ):
        f(state, batch)


def test_inference_step_is_still_an_inference_step():
    params, batch = _params_and_batch()

    def infer(params, batch):
        h = jnp.tanh(batch["x"] @ params["w"])
        alpa.mark_pipeline_boundary()
        return jnp.tanh(h @ params["w"] + params["b"])

    f = alpa.parallelize(infer, method=_pipeshard(pipeline_schedule="inference"))
    assert_allclose(f(params, batch), infer(params, batch))
    g = alpa.parallelize(infer, method=_pipeshard())
    with pytest.raises(
        ValueError,
        match="the step has no alpa.grad, so it is an inference step; pass "
        "pipeline_schedule='inference' instead of '1f1b'",
    ):
        g(params, batch)


# ----------------------------------------------------------------------------- 7-9. warnings


@pytest.mark.parametrize("method", [alpa.DataParallel, alpa.Zero2Parallel, alpa.Zero3Parallel])
def test_no_batch_argument_with_data_parallel_warns_once(method):
    f = alpa.parallelize(lambda w, x: jnp.sum(w * x), method=method(), batch_argnums=())
    with pytest.warns(
        UserWarning,
        match=rf"<lambda> is parallelized with {method.__name__} and batch_argnums=\(\): no "
        r"argument is split, so every device computes the whole batch. Name the batch's "
        r"position, e.g. batch_argnums=\(1,\)",
    ):
        out = f(jnp.ones((8,)), jnp.ones((8,)))
    assert float(out) == 8.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(f(jnp.ones((16,)), jnp.ones((16,)))) == 16.0  # compiles again, silently


def test_static_python_float_that_keeps_changing_warns_once():
    f = alpa.parallelize(lambda w, x, lr: w - lr * jnp.sum(x), method=alpa.DataParallel())
    w, x = jnp.ones(()), jnp.ones((8,))
    assert_allclose(f(w, x, 0.1), 1.0 - 0.8)
    assert_allclose(f(w, x, 0.1), 1.0 - 0.8)  # the same value twice: one compile
    assert_allclose(f(w, x, 0.2), 1.0 - 1.6)
    with pytest.warns(
        UserWarning,
        match=r"argument 2 of <lambda> is a Python float, hence static "
        r"\(static_argnums='auto'\), and has taken 3 values: each new value compiles the "
        r"step again. Pass it as an array \(jnp.asarray\(0.3\)\), or list the static "
        r"positions with static_argnums=\(...\) leaving 2 out",
    ):
        f(w, x, 0.3)
    f(w, x, 0.4)  # warned once: a fourth value is silent (warnings are errors here)
    # Passed as an array, the value is an input: no recompile, no warning.
    g = alpa.parallelize(lambda w, x, lr: w - lr * jnp.sum(x), method=alpa.DataParallel())
    for lr in (0.1, 0.2, 0.3, 0.4):
        assert_allclose(g(w, x, jnp.asarray(lr)), 1.0 - 8 * lr)


def test_auto_sharding_option_with_manual_sharding_option_warns():
    manual = alpa.ManualShardingOption(("data",), in_axis_resources=(P(), P("data")))
    with pytest.warns(
        UserWarning,
        match=r"ShardParallel got both options: manual_sharding_option decides every "
        r"sharding, so auto_sharding_option's prefer_reduce_scatter, force_data_parallel are "
        r"ignored \(of it only logical_mesh_shape, mesh_alpha and mesh_beta act",
    ):
        alpa.ShardParallel(
            auto_sharding_option=alpa.AutoShardingOption(
                force_data_parallel=True, prefer_reduce_scatter=True
            ),
            manual_sharding_option=manual,
        )
    # The mesh's shape is read from the auto option: no warning.
    alpa.ShardParallel(
        auto_sharding_option=alpa.AutoShardingOption(logical_mesh_shape=(2, 4)),
        manual_sharding_option=manual,
    )


def test_arguments_in_another_order_say_what_was_split_as_the_batch():
    """``eval_step(batch, params)`` called in place of ``eval_step(params, batch)``: the
    error the step raises while traced keeps its type, with a note naming what alpa split
    as the batch."""
    import flax.linen as nn

    model = nn.Dense(8)
    params = model.init(jax.random.key(0), jnp.ones((B, H)))
    batch = {"x": jnp.ones((B, H)), "y": jnp.ones((B, 8))}

    def eval_step(params, batch):
        return jnp.mean((model.apply(params, batch["x"]) - batch["y"]) ** 2)

    f = alpa.parallelize(eval_step, method=alpa.ShardParallel(), donate_argnums=())
    with pytest.raises(KeyError) as info:  # the step's own error: params["x"]
        f(batch, params)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert (
        "alpa traced eval_step with argument 1['params']['bias'] (dim 0 of 8) and 1 more "
        "leaves as the batch (batch_argnums=(1,), the default for a call with two or more "
        "arguments); if the arguments are in another order, pass the batch's position as "
        "batch_argnums"
    ) in notes
    # The right order runs and matches serial.
    np.testing.assert_allclose(f(params, batch), eval_step(params, batch), rtol=1e-6)

    # A step written (batch, params) called in that order: alpa's default batch_argnums
    # splits the parameters into micro-batches, and flax's own error says the kernel has
    # half its rows; the note says which argument alpa split.
    def swapped(batch, params):
        return eval_step(params, batch)

    g = alpa.parallelize(swapped, method=alpa.ShardParallel(num_micro_batches=2))
    with pytest.raises(ScopeParamShapeError) as info:
        g(batch, params)
    assert (
        "alpa traced swapped with argument 1['params']['bias'] (dim 0 of 8) and 1 more leaves "
        "(4 rows per micro-batch) as the batch (batch_argnums=(1,), the default"
    ) in "\n".join(info.value.__notes__)

    # A retrace (a pass asking for the step at another batch size) says the same.
    def fixed_size(params, batch):  # written for one batch size
        return eval_step(params, batch) + batch["x"].reshape(B, H).sum()

    h = alpa.parallelize(fixed_size, donate_argnums=())
    traced = h.get_executable(params, batch).traced
    with pytest.raises(TypeError) as info:
        traced.retrace(2)
    assert (
        "alpa traced fixed_size with argument 1['x'] (dim 0 of 32) and 1 more leaves "
        "(traced again with 16 rows) as the batch"
    ) in "\n".join(info.value.__notes__)


def test_create_state_returning_the_parameters_alone():
    """``CreateStateParallel``'s function returns the parameters where ``train_step``
    takes the whole ``TrainState``: named by structure when ``train_step`` has been
    compiled, else the ``AttributeError`` of ``train_step`` gets a note saying what alpa
    passed it (it was ``'dict' object has no attribute 'params'`` alone)."""
    state, batch, train_step = _mlp()
    p_step = alpa.parallelize(train_step, method=alpa.DataParallel(), donate_argnums=())

    def create_params():
        return jax.tree.map(jnp.zeros_like, state.params)

    create = alpa.parallelize(create_params, method=alpa.CreateStateParallel(p_step, (batch,)))
    with pytest.raises(AttributeError, match="'dict' object has no attribute 'params'") as info:
        create()
    assert (
        "CreateStateParallel compiled train_step with what create_params returns, a dict of 4 "
        "leaves (keys ['Dense_0', 'Dense_1']), as its first argument (the state); "
        "create_params must return the whole state train_step takes (e.g. a TrainState)"
    ) in "\n".join(info.value.__notes__)
    p_step(state, batch)
    with pytest.raises(
        ValueError,
        match=r"create_params returns a dict of 4 leaves \(keys \['Dense_0', 'Dense_1'\]\), but "
        r"train_step takes a TrainState of \d+ leaves as its first argument, the state: "
        r"CreateStateParallel creates the state train_step takes",
    ):
        create()


def test_a_function_compiled_before_a_new_init_runs_on_the_new_cluster():
    """``alpa.shutdown(); alpa.init("local", num_devices_per_node=4)``: a function
    compiled for the 8 devices of the cluster before compiles again for the 4 of the new
    one, on the fast path too (it ran on 8 devices, silently)."""
    state, batch, train_step = _mlp()
    f = alpa.parallelize(train_step, method=alpa.DataParallel(), donate_argnums=())
    assert len(f(state, batch).params["Dense_0"]["kernel"].sharding.device_set) == 8
    f(state, batch)  # a cache hit from now on
    alpa.shutdown()
    alpa.init("local", num_devices_per_node=4)
    for _ in range(2):  # compiled again, then the fast path
        out = f(state, batch)
        assert out.params["Dense_0"]["kernel"].sharding.device_set == set(jax.devices()[:4])
    assert_allclose(out.params, jax.jit(train_step)(state, batch).params)
