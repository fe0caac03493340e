"""parallelize: compilation cache, argument handling, init/shutdown and bad input."""

import inspect
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training.train_state import TrainState

import alpa
from alpa.testing import assert_allclose, get_mlp_train_state_and_step


def _mlp():
    return get_mlp_train_state_and_step(batch_size=16, hidden_size=16, num_layers=2)


def _nbytes(tree) -> int:
    return sum(
        np.dtype(x.dtype).itemsize * int(np.prod(np.shape(x))) for x in jax.tree.leaves(tree)
    )


def test_decorator_with_and_without_arguments():
    @alpa.parallelize
    def f(params, batch):
        return params["w"] * batch["x"].sum()

    @alpa.parallelize(method=alpa.DataParallel())
    def g(params, batch):
        return params["w"] * batch["x"].sum()

    params, batch = {"w": jnp.float32(2.0)}, {"x": jnp.ones((8, 4))}
    assert float(f(params, batch)) == 64.0
    assert float(g(params, batch)) == 64.0


def test_second_call_does_not_retrace_new_shape_does():
    traces = []

    @alpa.parallelize(method=alpa.DataParallel())
    def step(w, batch):
        traces.append(batch["x"].shape)
        return w + jnp.mean(batch["x"])

    w = jnp.zeros(())
    step(w, {"x": jnp.ones((8, 4))})
    step(w, {"x": jnp.full((8, 4), 2.0)})
    assert traces == [(8, 4)]
    out = step(w, {"x": jnp.ones((16, 4))})
    assert traces == [(8, 4), (16, 4)]
    assert float(out) == 1.0


def test_static_argument_is_part_of_the_key():
    traces = []

    @alpa.parallelize(method=alpa.DataParallel())
    def step(w, batch, scale):
        traces.append(scale)
        return w + scale * jnp.sum(batch)

    w, batch = jnp.zeros(()), jnp.ones((8,))
    assert float(step(w, batch, 2)) == 16.0
    assert float(step(w, batch, 2)) == 16.0
    assert float(step(w, batch, 3)) == 24.0
    assert traces == [2, 3]


def test_auto_donation_donates_train_state_only():
    state, batch, train_step = _mlp()
    expected = jax.jit(train_step)(state, batch)
    p_step = alpa.parallelize(train_step, method=alpa.DataParallel())
    state = p_step.preshard_dynamic_args(state, batch)[0]
    kernel = state.params["Dense_0"]["kernel"]
    new_state = p_step(state, batch)
    assert kernel.is_deleted()
    assert not any(x.is_deleted() for x in jax.tree.leaves(batch) if isinstance(x, jax.Array))
    assert_allclose(new_state, expected, 1e-5, 1e-5)


def test_executable_api(tmp_path):
    state, batch, train_step = _mlp()
    p_step = alpa.parallelize(train_step, method=alpa.DataParallel(), donate_argnums=())
    executable = p_step.get_executable(state, batch)
    assert p_step.get_last_executable() is executable
    assert "all-reduce" in executable.get_hlo_text()
    # Data parallel: every device holds the whole state as input and, not donated, again
    # as output, and 1/8 of the batch.
    assert executable.get_total_allocation_size() >= 2 * _nbytes(state) + _nbytes(batch) / 8
    in_specs = executable.get_input_placement_specs()
    assert isinstance(in_specs[0], TrainState)
    assert in_specs[1]["x"].sharding_specs[0] == jax.sharding.PartitionSpec("x")
    out_specs = executable.get_output_placement_specs()
    kernel_spec = out_specs.params["Dense_0"]["kernel"]
    assert kernel_spec.aval.shape == (16, 16)
    executable.dump_debug_info(str(tmp_path))
    assert {p.name for p in tmp_path.iterdir()} == {
        "train_step.jaxpr.txt",
        "train_step.hlo.txt",
        "train_step.plan.txt",
    }
    out = p_step(state, batch)
    executable.sync()
    leaf = out.params["Dense_0"]["kernel"]
    assert isinstance(leaf, jax.Array) and leaf.sharding.num_devices == 8


def test_get_executable_accepts_abstract_arguments():
    state, batch, train_step = _mlp()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), (state, batch))
    p_step = alpa.parallelize(train_step, method=alpa.DataParallel())
    executable = p_step.get_executable(*abstract)
    assert executable.get_total_allocation_size() >= _nbytes(state) + _nbytes(batch) / 8


def test_init_shutdown_and_implicit_init(caplog):
    caplog.set_level(logging.WARNING, logger="alpa")
    mesh = alpa.get_global_physical_mesh()
    assert alpa.get_global_physical_mesh() is mesh
    assert mesh.num_devices == 8
    assert [r.getMessage() for r in caplog.records] == [
        "alpa.init() was not called: using the 8 local devices"
    ]
    # Implied by a first parallelize: local. Called explicitly: Alpa's default, Ray
    # (tests/runtime/test_ray_runtime.py).
    assert inspect.signature(alpa.init).parameters["cluster"].default == "ray"
    alpa.init("local")  # already initialized: no-op
    assert alpa.get_global_physical_mesh() is mesh
    alpa.shutdown()
    alpa.init("local", devices=jax.devices()[:4])
    assert alpa.get_global_physical_mesh().num_devices == 4

    @alpa.parallelize(method=alpa.DataParallel())
    def f(w, x):
        return w * x

    out = f(jnp.float32(2), jnp.ones((4,)))
    assert out.sharding.num_devices == 4


def test_init_bad_cluster_is_a_clear_error():
    # alpa.init("ray") itself is tested on a local Ray cluster (tests/runtime/).
    with pytest.raises(ValueError, match="cluster must be 'local' or 'ray', got 'slurm'"):
        alpa.init("slurm")
    with pytest.raises(ValueError, match="devices= is for cluster='local'"):
        alpa.init("ray", devices=jax.devices())
    assert alpa.get_global_cluster() is None


# ----------------------------------------------------------------------------- bad input


def test_non_callable_fun():
    with pytest.raises(TypeError, match="parallelize expects a callable fun, got int"):
        alpa.parallelize(3)


def test_unknown_method_type():
    with pytest.raises(TypeError, match="method must be a parallel method.*got str"):
        alpa.parallelize(lambda x: x, method="data_parallel")


def test_argnums_types():
    with pytest.raises(TypeError, match=r"batch_argnums must be a tuple of ints, got the int 1"):
        alpa.parallelize(lambda x: x, batch_argnums=1)


def test_alpa_default_batch_argnums_on_one_argument_means_no_batch():
    f = alpa.parallelize(lambda w: w * 2, batch_argnums=(1,), method=alpa.ShardParallel())
    np.testing.assert_allclose(f(jnp.ones((8, 4))), 2 * np.ones((8, 4)))
    assert not any(f.get_last_executable().traced.batch_invars)


def test_batch_argnums_out_of_range():
    f = alpa.parallelize(lambda w, b: w * b, batch_argnums=(2,))
    with pytest.raises(
        ValueError,
        match=r"batch_argnums=\(2,\) is out of range for a call "
        r"of <lambda> with 2 positional arguments",
    ):
        f(jnp.ones(()), jnp.ones((8,)))


def test_non_array_leaf_in_dynamic_argument():
    f = alpa.parallelize(lambda w, b: w["a"] * b, method=alpa.DataParallel())
    with pytest.raises(
        TypeError,
        match=r"argument 0\['name'\] of <lambda> is a str, not an "
        "array",
    ):
        f({"a": jnp.ones(()), "name": "layer"}, jnp.ones((8,)))


def test_mesh_shape_that_does_not_match_device_count():
    mesh = alpa.LocalPhysicalDeviceMesh()
    with pytest.raises(
        ValueError,
        match=r"mesh_shape \(3, 2\) has 6 devices but the physical "
        "mesh has 8",
    ):
        mesh.get_logical_mesh((3, 2))
    method = alpa.ShardParallel(
        auto_sharding_option=alpa.AutoShardingOption(logical_mesh_shape=(2, 2))
    )
    f = alpa.parallelize(lambda w, b: w * b, method=method)
    with pytest.raises(ValueError, match=r"mesh_shape \(2, 2\) has 4 devices"):
        f(jnp.ones(()), jnp.ones((8,)))


def test_batch_not_divisible_by_num_micro_batches():
    state, batch, train_step = _mlp()
    f = alpa.parallelize(train_step, method=alpa.DataParallel(num_micro_batches=3))
    with pytest.raises(
        ValueError,
        match=r"num_micro_batches=3 does not divide batch size 16 "
        r"of argument 1\['x'\]",
    ):
        f(state, batch)


def test_batch_not_divisible_by_devices():
    f = alpa.parallelize(lambda w, b: w * b, method=alpa.DataParallel())
    with pytest.raises(
        ValueError,
        match=r"argument 1 has batch size 6, which does not split "
        "over the 8 devices",
    ):
        f(jnp.ones(()), jnp.ones((6,)))


def test_bad_num_micro_batches():
    with pytest.raises(ValueError, match="num_micro_batches must be a positive int or None, got 0"):
        alpa.DataParallel(num_micro_batches=0)


def test_micro_batches_without_alpa_grad():
    def step(w, batch):
        g = jax.grad(lambda w: jnp.mean((batch["x"] * w) ** 2))(w)
        return w - g

    f = alpa.parallelize(step, method=alpa.DataParallel(num_micro_batches=2))
    with pytest.raises(ValueError, match="differentiates with jax.grad .* Replace jax.grad"):
        f(jnp.ones((4,)), {"x": jnp.ones((16, 4))})
    # A step with no gradient at all is an inference step: micro-batches make no sense.
    infer = alpa.parallelize(
        lambda w, batch: batch["x"] @ w, method=alpa.DataParallel(num_micro_batches=2)
    )
    with pytest.raises(ValueError, match="computes no gradient .* leave num_micro_batches unset"):
        infer(jnp.ones((4,)), {"x": jnp.ones((16, 4))})


def test_keyword_arguments_rejected():
    f = alpa.parallelize(lambda w, b: w * b)
    with pytest.raises(TypeError, match="pass its arguments positionally"):
        f(w=jnp.ones(()), b=jnp.ones((8,)))
