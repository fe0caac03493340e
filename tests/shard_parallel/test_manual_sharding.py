"""Manual sharding: user PartitionSpecs compile to the collectives they need, no more."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import alpa
from alpa.testing import assert_allclose, entry_shapes
from alpa.util import count_communication_primitives

B, D, H = 16, 32, 64


def _params():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.standard_normal((D, H)) / np.sqrt(D), jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((H, D)) / np.sqrt(H), jnp.float32),
    }


def _batch():
    rng = np.random.default_rng(1)
    return {
        "x": jnp.asarray(rng.standard_normal((B, D)), jnp.float32),
        "y": jnp.asarray(rng.standard_normal((B, D)), jnp.float32),
    }


def _forward(params, x):
    return jax.nn.relu(x @ params["w1"]) @ params["w2"]


MEGATRON = {"w1": P(None, "model"), "w2": P("model", None)}


def _method(in_res, out_res, mesh_shape=(1, 8), names=("data", "model"), **kw):
    mesh = alpa.LocalPhysicalDeviceMesh().get_logical_mesh(mesh_shape)
    return alpa.ShardParallel(
        devices=mesh,
        manual_sharding_option=alpa.ManualShardingOption(
            names, in_axis_resources=in_res, out_axis_resources=out_res
        ),
        **kw,
    )


def test_megatron_forward_needs_one_all_reduce():
    """Column-split W1 then row-split W2: the hidden activation stays sharded, and only the
    partial sums of the output are all-reduced: exactly one collective."""
    method = _method((MEGATRON, P()), P())
    f = alpa.parallelize(_forward, method=method, batch_argnums=(1,))
    params, x = _params(), _batch()["x"]
    out = f(params, x)
    assert_allclose(out, _forward(params, x), 1e-5, 1e-5)
    counts = count_communication_primitives(f.get_last_executable().get_hlo_text())
    assert counts == (1, 1, 0, 0, 0)


def test_megatron_train_step():
    """Training with SGD adds no collective: dW2 = h^T dy is row-sharded like W2 and
    dW1 = x^T dh column-sharded like W1, both computed locally. The loss needs the
    all-reduced output (1) and its scalar mean is local, so the step has 1 all-reduce."""
    tx = optax.sgd(0.1)

    def step(params, opt_state, batch):
        def loss(p):
            return jnp.mean((_forward(p, batch["x"]) - batch["y"]) ** 2)

        g = alpa.grad(loss)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = _params()
    opt_state = tx.init(params)
    batch = _batch()
    method = _method((MEGATRON, None, P()), (MEGATRON, None))
    f = alpa.parallelize(step, method=method, batch_argnums=(2,), donate_argnums=())
    new_params, _ = f(params, opt_state, batch)
    assert_allclose(new_params, jax.jit(step)(params, opt_state, batch)[0], 1e-5, 1e-5)
    assert new_params["w1"].sharding.spec == P(None, "model")
    assert new_params["w2"].sharding.spec == P("model", None)
    counts = count_communication_primitives(f.get_last_executable().get_hlo_text())
    assert counts == (1, 1, 0, 0, 0)


def _megatron_over_2x4_with_2_micro_batches():
    """An SGD step with the batch over 'data' (2) and Megatron over 'model' (4), in 2
    micro-batches: checked against jax.jit, its executable."""
    tx = optax.sgd(0.1)

    def step(params, batch):
        g = alpa.grad(lambda p: jnp.mean((_forward(p, batch["x"]) - batch["y"]) ** 2))(params)
        return optax.apply_updates(params, tx.update(g, tx.init(params))[0])

    params, batch = _params(), _batch()
    method = _method((MEGATRON, P("data")), MEGATRON, mesh_shape=(2, 4), num_micro_batches=2)
    f = alpa.parallelize(step, method=method, donate_argnums=())
    assert_allclose(f(params, batch), jax.jit(step)(params, batch), 1e-4, 1e-4)
    return f.get_last_executable()


def test_2d_mesh_data_and_model_parallel_with_micro_batches():
    """Batch over 'data' (2), Megatron over 'model' (4); with micro-batches the gradient
    reduction over 'data' happens once per step, and in each micro-batch only Megatron's
    forward all-reduce: the weight gradients' per-device partial sums stay split over
    'model' as they are computed (before, each micro-batch all-gathered them whole)."""
    from alpa.util import count_micro_batch_communication

    executable = _megatron_over_2x4_with_2_micro_batches()
    texts = executable.get_program_texts()
    per_micro_batch, per_step, _ = count_micro_batch_communication(texts)
    # Per micro-batch: only the Megatron forward all-reduce over 'model'. Once per step:
    # one all-reduce of the gradients over 'data' (groups {0,4},{1,5}...).
    assert per_micro_batch.total == per_micro_batch.all_reduce == 1  # (no gradient gathered)
    assert per_step.total == per_step.all_reduce == 1
    assert "replica_groups={{0,4},{1,5},{2,6},{3,7}}" in texts["accumulate_last"]
    assert executable.plan.data_axes == ("data",)


def test_one_axis_name():
    method = _method((MEGATRON, P()), P(), names=("model",))
    f = alpa.parallelize(_forward, method=method)
    params, x = _params(), _batch()["x"]
    assert_allclose(f(params, x), _forward(params, x), 1e-5, 1e-5)


def test_unknown_axis_name_is_an_error():
    method = _method(({"w1": P(None, "tensor"), "w2": P()}, P()), None)
    f = alpa.parallelize(_forward, method=method)
    with pytest.raises(
        ValueError,
        match=r"in_axis_resources for argument 0\['w1'\]: "
        r"PartitionSpec .* names mesh axes \['tensor'\]",
    ):
        f(_params(), _batch()["x"])


def test_in_axis_resources_length_is_checked():
    f = alpa.parallelize(_forward, method=_method((MEGATRON,), None))
    with pytest.raises(
        ValueError,
        match=r"in_axis_resources must have one entry per "
        r"positional argument \(2\)",
    ):
        f(_params(), _batch()["x"])


def _entry_shapes(hlo: str) -> tuple[list[str], list[str]]:
    """The f32 shapes of a module's parameters and of its results."""
    params, results = entry_shapes(hlo)
    return [p for p in params if p.startswith("f32")], [r for r in results if r.startswith("f32")]


def test_micro_batches_carry_each_gradient_in_its_parameters_shard():
    """Alpa's accumulate-grad module takes the parameters, one micro-batch and the
    accumulated gradients, and returns the gradients; apply-grad takes the parameters and
    the gradients. Each gradient is carried in its parameter's shard (Megatron's over
    'model'), also while it is a per-device partial sum over 'data' (before the last
    micro-batch reduces it), and the numbers are jax.jit's."""
    executable = _megatron_over_2x4_with_2_micro_batches()
    texts = executable.get_program_texts()
    shards = [f"f32[{D},{H // 4}]", f"f32[{H // 4},{D}]"]  # w1, w2 split over 'model' (4)
    micro_batch = [f"f32[{B // 2 // 2},{D}]"] * 2  # x, y: B / 2 micro-batches / 2 'data'
    stacked = [f"f32[1,{B // 2 // 2},{D}]"] * 2  # micro-batches 0 .. k-2 in one loop
    assert _entry_shapes(texts["accumulate"]) == (shards + stacked + shards, shards)
    assert _entry_shapes(texts["accumulate_last"]) == (shards + micro_batch + shards, shards)
    assert _entry_shapes(texts["apply"]) == (shards + shards, shards)
