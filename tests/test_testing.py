"""alpa.testing (each factory's step, parallelized, equals jax.jit of it; assert_allclose
fails on mismatches) and alpa.set_seed (what it seeds, and what it rejects)."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import devices_or_skip

import alpa
from alpa.global_env import GlobalConfig
from alpa.model.mlp import MLPModel
from alpa.testing import (
    PipelineBasicTest,
    assert_allclose,
    bert_layer_collection_inference_step,
    create_train_state,
    get_bert_layer_train_state_and_step,
    get_mlp_train_state_and_step,
    mlp_inference_step,
)

BERT = dict(batch_size=8, seq_len=4, num_layers=2, hidden_size=16, num_heads=2)


@pytest.fixture(autouse=True)
def _restore_seeds():
    """set_seed changes process-wide state; later tests must not see it."""
    seed, numpy_state, python_state = (
        alpa.global_config.seed,
        np.random.get_state(),
        random.getstate(),
    )
    yield
    alpa.global_config.seed = seed
    np.random.set_state(numpy_state)
    random.setstate(python_state)


def _shard():
    return alpa.ShardParallel()


def _pipeshard(schedule="1f1b"):
    return alpa.PipeshardParallel(
        num_micro_batches=2,
        layer_option="manual",
        stage_option="uniform",
        pipeline_schedule=schedule,
    )


def _two_steps(step, state, batch, method):
    """Two steps parallelized with ``method`` and two under jax.jit, from the same state."""
    serial = jax.jit(step)
    expected = serial(serial(state, batch), batch)
    parallel = alpa.parallelize(step, method=method, donate_argnums=())
    return parallel(parallel(state, batch), batch), expected, parallel.get_last_executable()


# ----------------------------------------------------------------------------- factories


@pytest.mark.parametrize("method, markers", [(_shard, False), (_pipeshard, True)])
def test_mlp_step_matches_serial(method, markers):
    devices_or_skip(8)
    state, batch, step = get_mlp_train_state_and_step(
        32, 16, num_layers=2, add_manual_pipeline_marker=markers
    )
    assert batch["x"].shape == batch["y"].shape == (32, 16)
    actual, expected, executable = _two_steps(step, state, batch, method())
    assert_allclose(actual, expected)
    assert int(actual.step) == 2
    # The step trained: the parameters moved.
    with pytest.raises(AssertionError):
        assert_allclose(actual.params, state.params)
    if markers:  # one boundary between the two layers: two stages
        assert executable.stage_plan.num_stages == 2


@pytest.mark.parametrize(
    "method, markers, clip",
    [(_shard, False, False), (_pipeshard, True, True)],
)
def test_bert_layer_step_matches_serial(method, markers, clip):
    devices_or_skip(8)
    state, batch, step = get_bert_layer_train_state_and_step(
        **BERT, clip_by_global_norm=clip, add_manual_pipeline_marker=markers
    )
    assert batch["x"].shape == batch["y"].shape == (8, 4, 16)
    assert batch["attention_mask"].shape == (8, 4)
    assert sorted(state.params) == ["0", "1"]  # one entry per BERT layer
    actual, expected, executable = _two_steps(step, state, batch, method())
    assert_allclose(actual, expected, rtol=1e-3, atol=1e-3)
    with pytest.raises(AssertionError):
        assert_allclose(actual.params, state.params)
    if markers:
        assert executable.stage_plan.num_stages == 2


def test_clipping_bounds_the_first_update():
    """With clip_by_global_norm, Adam's first update is the same (Adam normalizes), but the
    clipped gradient's norm is 0.05: seen in the first moment, 0.1 * clipped gradient."""
    state, batch, step = get_bert_layer_train_state_and_step(**BERT, clip_by_global_norm=True)
    new_state = jax.jit(step)(state, batch)
    mu = new_state.opt_state[1][0].mu
    norm = jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(mu)))
    np.testing.assert_allclose(norm, 0.1 * 0.05, rtol=1e-4)


def test_dynamic_scale_is_refused():
    with pytest.raises(
        NotImplementedError,
        match=r"use_dynamic_scale=True \(fp16 dynamic loss scaling\) is not supported",
    ):
        get_bert_layer_train_state_and_step(**BERT, use_dynamic_scale=True)


def test_inference_steps_match_serial():
    devices_or_skip(8)
    state, batch, _ = get_mlp_train_state_and_step(32, 16, num_layers=2)
    parallel = alpa.parallelize(mlp_inference_step, method=_shard(), donate_argnums=())
    out, loss = parallel(state, batch)
    assert out.shape == (32, 16) and loss.shape == ()
    assert_allclose((out, loss), jax.jit(mlp_inference_step)(state, batch))

    state, batch, _ = get_bert_layer_train_state_and_step(**BERT, add_manual_pipeline_marker=True)
    step = bert_layer_collection_inference_step
    parallel = alpa.parallelize(step, method=_pipeshard("inference"), donate_argnums=())
    out, loss = parallel(state, batch)
    assert out.shape == (8, 4, 16)
    assert_allclose((out, loss), jax.jit(step)(state, batch), rtol=1e-3, atol=1e-3)
    assert parallel.get_last_executable().stage_plan.num_stages == 2


def test_create_train_state():
    model = MLPModel(hidden_size=8, num_layers=2)
    x = jnp.ones((4, 8))
    state = create_train_state(jax.random.key(3), model, [x])
    params = model.init(jax.random.key(3), x)["params"]
    assert_allclose(state.params, params, rtol=0, atol=0)
    # An int seed is a key too; Adam with learning rate 1e-2 by default.
    assert_allclose(
        create_train_state(5, model, [x]).params, create_train_state(5, model, [x]).params
    )
    grads = jax.tree.map(jnp.ones_like, state.params)
    moved = jax.tree.map(
        lambda a, b: a - b, state.params, state.apply_gradients(grads=grads).params
    )
    assert_allclose(moved, jax.tree.map(lambda g: 1e-2 * g, grads), rtol=1e-4, atol=0)
    out, _ = mlp_inference_step(state, {"x": x, "y": x})
    assert out.shape == (4, 8)
    with pytest.raises(
        ValueError, match=r"create_train_state: seed must be an int in \[0, 2\*\*32\), got -1"
    ):
        create_train_state(-1, model, [x])


class TestPipelineBasic(PipelineBasicTest):
    """Alpa's way of writing pipeline tests runs unchanged."""

    def test_run_mlp_with_manual_and_automatic_layers(self):
        devices_or_skip(8)
        # At least a forward, a backward and an apply-grad module per stage (4 stages: one
        # per marked layer; 2 stages: AutoLayerOption(layer_num=2)).
        for kwargs, num_stages in (({}, 4), ({"manual_pipeline_layer": False}, 2)):
            hlo = self.run_mlp(**kwargs)
            self.assertGreaterEqual(len(hlo), 3 * num_stages)
            self.assertTrue(all(text.startswith("HloModule") for text in hlo))

    def test_run_n_layer_bert(self):
        devices_or_skip(8)
        hlo = self.run_n_layer_bert(2, batch_size=8, seq_len=4, hidden_size=16, num_heads=2)
        self.assertGreaterEqual(len(hlo), 3 * 2)


# ----------------------------------------------------------------------------- assert_allclose


def test_assert_allclose_names_the_mismatching_leaf():
    x = {"a": jnp.zeros(3), "b": {"c": jnp.ones((2, 2))}}
    assert_allclose(x, jax.tree.map(lambda v: v + 5e-5, x))  # within atol=1e-4
    y = {"a": jnp.zeros(3), "b": {"c": jnp.ones((2, 2)).at[1, 0].set(1.1)}}
    with pytest.raises(AssertionError, match=r"leaf \['b'\]\['c'\]"):
        assert_allclose(x, y)
    assert_allclose(x, y, rtol=0.2)
    with pytest.raises(AssertionError, match=r"^leaf \['a'\]: shape \(3,\) != \(1, 3\)$"):
        assert_allclose(x, {"a": jnp.zeros((1, 3)), "b": x["b"]})
    with pytest.raises(AssertionError, match=r"leaf <root>"):
        assert_allclose(1.0, 2.0)


def test_assert_allclose_rejects_different_structures():
    with pytest.raises(
        AssertionError,
        match=r"^pytrees differ in structure:\n\[\"\['a'\]\"\]\nvs\n\[\"\['b'\]\"\]$",
    ):
        assert_allclose({"a": 1.0}, {"b": 1.0})
    with pytest.raises(AssertionError, match="pytrees differ in structure"):
        assert_allclose((1.0, 2.0), (1.0, 2.0, 3.0))


# ----------------------------------------------------------------------------- set_seed


def test_set_seed_makes_the_helpers_and_numpy_reproducible():
    alpa.set_seed(3)
    assert alpa.global_config.seed == 3
    draws = np.random.rand(4), random.random()
    first = get_mlp_train_state_and_step(8, 8, num_layers=2)
    bert_first = get_bert_layer_train_state_and_step(**BERT)
    alpa.set_seed(3)
    assert np.array_equal(np.random.rand(4), draws[0]) and random.random() == draws[1]
    again = get_mlp_train_state_and_step(8, 8, num_layers=2)
    assert_allclose(again[:2], first[:2], rtol=0, atol=0)
    assert_allclose(get_bert_layer_train_state_and_step(**BERT)[:2], bert_first[:2], rtol=0, atol=0)
    # An explicit seed wins over the global one.
    assert_allclose(get_mlp_train_state_and_step(8, 8, num_layers=2, seed=3)[:2], first[:2])

    alpa.set_seed(4)
    other = get_mlp_train_state_and_step(8, 8, num_layers=2)
    for name in ("params", "batch"):
        a, b = (other[0].params, first[0].params) if name == "params" else (other[1], first[1])
        for leaf_a, leaf_b in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            if leaf_a.size > 1 and np.any(leaf_a != 0):  # biases start at zero whatever the seed
                assert not np.allclose(leaf_a, leaf_b), name
    assert not np.array_equal(np.random.rand(4), draws[0])


def test_set_seed_rejects_bad_seeds():
    for bad, error, message in (
        (-1, ValueError, r"got -1$"),
        (2**32, ValueError, r"got 4294967296$"),
        (1.5, TypeError, r"got 1.5 \(float\)$"),
        (True, TypeError, r"got True \(bool\)$"),
        ("7", TypeError, r"got '7' \(str\)$"),
    ):
        with pytest.raises(
            error, match=r"^set_seed: seed must be an int in \[0, 2\*\*32\), " + message
        ):
            alpa.set_seed(bad)
    alpa.set_seed(np.int64(2**32 - 1))
    assert alpa.global_config.seed == 2**32 - 1 and type(alpa.global_config.seed) is int
    with pytest.raises(ValueError, match=r"get_mlp_train_state_and_step: seed must be an int"):
        get_mlp_train_state_and_step(8, 8, seed=-2)


def test_seed_field_reads_alpa_seed(monkeypatch):
    monkeypatch.setenv("ALPA_SEED", "7")
    assert GlobalConfig().seed == 7
    monkeypatch.delenv("ALPA_SEED")
    assert GlobalConfig().seed == 0
