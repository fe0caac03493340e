"""Alpa's model zoo under Alpa's names (``bert_model``, ``gpt_model``, ``unet_2d``,
``wide_resnet.get_wide_resnet``), its ``TrainState`` (master copy, ``create_aval``),
``DynamicScale``, ``init_dummy`` and ``ModelOutput``."""

from __future__ import annotations

import pickle

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.dynamic_scale import DynamicScale as FlaxDynamicScale

from alpa.model import bert
from alpa.model.bert_model import BertConfig, FlaxBertForMaskedLMModule, FlaxBertLayerCollection
from alpa.model.gpt_model import FlaxGPTForLMModule
from alpa.model.model_util import (
    DynamicScale,
    FlaxMaskedLMOutput,
    ModelOutput,
    TrainState,
    init_dummy,
)
from alpa.model.unet_2d import get_unet_2d, timestep_embedding
from alpa.model.wide_resnet import WIDE_RESNET_DEPTHS, get_wide_resnet
from alpa.testing import assert_allclose

KEY = jax.random.PRNGKey(0)
H, L, V, S = 32, 4, 64, 8
ALPA_CONFIG = BertConfig(
    vocab_size=V,
    hidden_size=H,
    num_attention_heads=4,
    intermediate_size=4 * H,
    num_hidden_layers=L,
    max_position_embeddings=S,
    type_vocab_size=0,
    # as Alpa's benchmark passes them on its shard-only path
    gradient_checkpointing=None,
    add_manual_pipeline_markers=None,
    pipeline_mp_size=None,
)
IDS = jnp.arange(2 * S, dtype=jnp.int32).reshape(2, S) % V
ONES = jnp.ones((2, S), jnp.int32)


def _markers(fn, *args) -> int:
    jaxpr = jax.make_jaxpr(fn)(*args)
    return sum(e.primitive.name == "pipeline_marker" for e in jaxpr.jaxpr.eqns)


def test_alpa_bert_config_maps_onto_alpas_bert_and_checks_its_values():
    cfg = ALPA_CONFIG.to_config(jnp.float16)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.ffn_size) == (H, L, 4, 4 * H)
    assert (cfg.type_vocab_size, cfg.hidden_act, cfg.dtype) == (0, "gelu", jnp.float16)
    assert not cfg.gradient_checkpointing and not cfg.add_manual_pipeline_markers
    with pytest.raises(ValueError, match=r"initializer_range=0.05: .* expected 0.02"):
        BertConfig(initializer_range=0.05)
    with pytest.raises(ValueError, match="pipeline_mp_size=3 does not divide num_layers=4"):
        BertConfig(num_hidden_layers=4, add_manual_pipeline_markers=True, pipeline_mp_size=3)
    with pytest.raises(ValueError, match="hidden_size=30 is not divisible by num_heads=4"):
        BertConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="hidden_act must be one of"):
        BertConfig(hidden_act="tanh")


def test_alpas_gpt_is_the_bert_body_with_a_tied_head_and_no_causal_mask():
    model = FlaxGPTForLMModule(ALPA_CONFIG)
    params = model.init(KEY, IDS, ONES, ONES, ONES)
    # Alpa's parameter count: L (12 H^2 + 13 H) + the word and position embeddings, their
    # LayerNorm and the head's bias (tied: no decoder kernel).
    count = sum(x.size for x in jax.tree.leaves(params))
    assert count == L * (12 * H * H + 13 * H) + V * H + S * H + 2 * H + V
    out = model.apply(params, IDS, ONES, ONES, ONES, deterministic=True)
    assert isinstance(out, FlaxMaskedLMOutput) and out[0] is out.logits
    # The logits are the encoder's output times the word embedding, plus the bias.
    p = flax.core.unfreeze(params)
    p["params"]["bias"] = jnp.full((V,), 0.5)
    hidden = bert.FlaxBertLayerCollection(ALPA_CONFIG.to_config(jnp.float32)).apply(
        {"params": p["params"]["encoder"]},
        flax.linen.LayerNorm(epsilon=1e-12).apply(
            {"params": p["params"]["embeddings_ln"]},
            p["params"]["word_embeddings"]["embedding"][IDS]
            + p["params"]["position_embeddings"]["embedding"][ONES],
        ),
        ONES,
    )
    expected = hidden @ p["params"]["word_embeddings"]["embedding"].T + 0.5
    assert_allclose(model.apply(p, IDS, ONES, ONES, ONES)[0], expected)
    # As Alpa's: bidirectional, so the last token changes the first position's logits.
    changed = IDS.at[:, -1].set(7)
    assert not np.allclose(out[0][:, 0], model.apply(params, changed, ONES, ONES, ONES)[0][:, 0])


def test_alpas_masked_lm_is_alpas_bert_with_the_modules_dtype():
    model = FlaxBertForMaskedLMModule(ALPA_CONFIG, dtype=jnp.float16)
    params = model.init(KEY, IDS, ONES, ONES, ONES)
    logits = model.apply(params, IDS, ONES, ONES, ONES)[0]
    ours = bert.FlaxBertForMaskedLM(ALPA_CONFIG.to_config(jnp.float16))
    assert logits.dtype == jnp.float16
    assert_allclose(logits, ours.apply({"params": params["params"]["bert"]}, IDS, ONES, ONES, ONES))
    assert model.apply(params, IDS, ONES, ONES, ONES, return_dict=False)[0].shape == (2, S, V)
    with pytest.raises(NotImplementedError, match="deterministic=False with dropout"):
        model.apply(params, IDS, ONES, ONES, ONES, deterministic=False)
    with pytest.raises(NotImplementedError, match="output_attentions / output_hidden_states"):
        model.apply(params, IDS, ONES, ONES, ONES, output_hidden_states=True)


@pytest.mark.parametrize("mp_size, boundaries", [(None, 3), (2, 1), (4, 3), (1, 0)])
def test_pipeline_markers_every_num_layers_over_pipeline_mp_size(mp_size, boundaries):
    cfg = ALPA_CONFIG.__class__(
        **{**ALPA_CONFIG.__dict__, "add_manual_pipeline_markers": True, "pipeline_mp_size": mp_size}
    )
    model = FlaxGPTForLMModule(cfg)
    params = jax.eval_shape(model.init, KEY, IDS, ONES, ONES, ONES)
    assert _markers(model.apply, params, IDS, ONES, ONES, ONES) == boundaries


def test_gradient_checkpointing_rematerializes_every_layer():
    cfg = ALPA_CONFIG.__class__(**{**ALPA_CONFIG.__dict__, "gradient_checkpointing": True})
    model = FlaxBertLayerCollection(cfg)
    x = jnp.ones((2, S, H))
    params = jax.eval_shape(model.init, KEY, x, ONES)
    jaxpr = jax.make_jaxpr(lambda p: model.apply(p, x, ONES).last_hidden_state)(params)
    assert sum(e.primitive.name == "remat2" for e in jaxpr.jaxpr.eqns) == L


def test_init_dummy_fills_every_parameter_with_1e_8():
    model = FlaxGPTForLMModule(ALPA_CONFIG)
    dummy = model.init_dummy(KEY, IDS, ONES, ONES, ONES)
    real = model.init(KEY, IDS, ONES, ONES, ONES)
    assert jax.tree.structure(dummy) == jax.tree.structure(real)
    for leaf in jax.tree.leaves(dummy):
        assert isinstance(leaf, jax.Array) and np.all(np.asarray(leaf) == np.float32(1e-8))
    # The function is the method, for any flax module.
    dense = flax.linen.Dense(3)
    assert_allclose(
        init_dummy(dense, KEY, jnp.ones((1, 2)))["params"]["kernel"], np.full((2, 3), 1e-8)
    )


def test_master_copy_updates_in_float32_and_rounds_the_params():
    params = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array(0.5)}
    tx = optax.adamw(1e-2)
    state = TrainState.create(apply_fn=None, params=params, tx=tx, use_master_copy=True)
    assert state.step.dtype == np.int32 and int(state.step) == 0
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float16)}
    assert {x.dtype for x in jax.tree.leaves(state.master_copy)} == {jnp.dtype(jnp.float32)}
    grads = {"w": jnp.array([0.1, 0.2, -0.3], jnp.float16), "b": jnp.array(1.0, jnp.float16)}
    new = state.apply_gradients(grads=grads)
    # The oracle: optax on float32 master weights.
    g32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, _ = tx.update(g32, tx.init(params), params)
    master = optax.apply_updates(params, updates)
    assert_allclose(new.master_copy, master, rtol=1e-6, atol=1e-7)
    assert_allclose(new.params, jax.tree.map(lambda m: m.astype(jnp.float16), master))
    assert int(new.step) == 1
    plain = TrainState.create(apply_fn=None, params=params, tx=tx)
    assert plain.master_copy is None and plain.dynamic_scale is None


def test_create_aval_is_create_without_allocating():
    model = FlaxGPTForLMModule(ALPA_CONFIG, dtype=jnp.float16)
    avals = jax.eval_shape(model.init, KEY, IDS, ONES, ONES, ONES)
    tx = optax.adamw(1e-2)
    state = TrainState.create_aval(
        apply_fn=model.apply, params=avals, tx=tx, use_master_copy=True, dynamic_scale=None
    )
    leaves = jax.tree.leaves(state)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    real = TrainState.create(
        apply_fn=model.apply,
        params=model.init_dummy(KEY, IDS, ONES, ONES, ONES),
        tx=tx,
        use_master_copy=True,
    )
    assert jax.tree.structure(state) == jax.tree.structure(real)
    assert [(x.shape, x.dtype) for x in leaves] == [
        (x.shape, x.dtype) for x in jax.tree.leaves(real)
    ]
    assert state.apply_fn == model.apply and state.tx is tx


def test_dynamic_scale_matches_flaxs_and_backs_off_on_overflow():
    def loss(p, x):
        return jnp.sum(jnp.asarray(p, jnp.float16) * x) ** 2

    p = jnp.array([1.0, 2.0])
    x = jnp.array([0.5, -1.0], jnp.float16)
    ours = DynamicScale(growth_interval=1, scale=4.0)
    flax_ds = FlaxDynamicScale(growth_interval=1, scale=4.0)
    for _ in range(2):  # the second step grows the scale
        ours, fin, value, grad = ours.value_and_grad(loss)(p, x)
        flax_ds, fin_ref, value_ref, grad_ref = flax_ds.value_and_grad(loss)(p, x)
        assert bool(fin) and bool(fin_ref)
        assert_allclose((value, grad, ours.scale), (value_ref, grad_ref, flax_ds.scale))
    assert float(ours.scale) == 8.0
    huge = jnp.array([1e4, 1e4], jnp.float16)  # the scaled float16 loss overflows
    ours, fin, _, _ = ours.value_and_grad(loss)(p, huge)
    assert not bool(fin) and float(ours.scale) == 4.0 and int(ours.fin_steps) == 0


def test_model_output_reads_by_position_name_and_attribute():
    logits = jnp.ones((2, 3))
    out = FlaxMaskedLMOutput(logits=logits)
    assert out[0] is logits and out["logits"] is logits and out.to_tuple() == (logits,)
    assert list(out) == ["logits"]  # None fields are left out
    through_jit = jax.jit(lambda: FlaxMaskedLMOutput(logits=jnp.zeros(2)))()
    assert type(through_jit) is FlaxMaskedLMOutput and through_jit[0].shape == (2,)
    assert pickle.loads(pickle.dumps(out))[0].shape == (2, 3)
    with pytest.raises(TypeError, match="cannot be changed in place; make a new one"):
        out["logits"] = logits

    class NotADataclass(ModelOutput):
        pass

    with pytest.raises(TypeError, match="must be a dataclass"):
        NotADataclass().__post_init__()


def test_get_wide_resnet_builds_alpas_depths():
    model = get_wide_resnet(50, 2, 8, 10, jnp.float32)
    assert model.stage_sizes == (3, 4, 6, 3) and model.block == "bottleneck"
    assert WIDE_RESNET_DEPTHS[18] == ((2, 2, 2, 2), "basic")
    images = jnp.ones((2, 32, 32, 3))
    params = model.init_dummy(KEY, images)
    logits = jax.eval_shape(lambda v: model.apply(v, images, train=False), params)
    assert logits.shape == (2, 10) and "batch_stats" in params
    with pytest.raises(ValueError, match=r"num_layers must be one of \[0, 18, 34"):
        get_wide_resnet(20, 2, 8, 10, jnp.float32)


def test_get_unet_2d_denoises_a_channels_first_sample():
    down = ("CrossAttnDownBlock2D", "DownBlock2D")
    up = ("UpBlock2D", "CrossAttnUpBlock2D")
    model = get_unet_2d(8, down, up, [8, 8], in_channels=3, layers_per_block=1)
    sample = jnp.ones((2, 3, 8, 8))
    context = jnp.ones((2, 16, 4))
    params = jax.eval_shape(model.init, KEY, sample, 1, context)
    out = jax.eval_shape(lambda p: model.apply(p, sample, 1, context), params)
    assert out.sample.shape == (2, 4, 8, 8)
    # conv_in, a unit and the downsampling, a unit, the middle's 2 units, 2 + 2 up units
    assert _markers(lambda p: model.apply(p, sample, 1, context).sample, params) == 10
    t = jnp.array([0, 3])
    emb = timestep_embedding(t, 8, 0.0)
    freqs = 10000.0 ** (-np.arange(4) / 4)
    assert_allclose(emb[1], np.concatenate([np.sin(3 * freqs), np.cos(3 * freqs)]))
    with pytest.raises(ValueError, match="need one entry per block, got 2, 2 and 3"):
        get_unet_2d(8, down, up, [8, 8, 8])
    with pytest.raises(ValueError, match=r"down_block_types must hold"):
        get_unet_2d(8, ("Nope", "DownBlock2D"), up, [8, 8])


def test_alpas_mixed_precision_train_step_under_zero2_equals_jit():
    """The train step of Alpa's GPT-2 and OPT fine-tuning examples, on Alpa's GPT in
    float16: a float32 master copy, ``DynamicScale`` (whose gradient is
    ``alpa.value_and_grad``), the update kept only where the gradients are finite, under
    ``Zero2Parallel`` with 2 micro-batches and a donated state; the metrics gathered with
    ``alpa.util.get_metrics``. The oracle: the same step under ``jax.jit``."""
    import functools

    import alpa
    from alpa.util import get_metrics

    config = ALPA_CONFIG.__class__(**{**ALPA_CONFIG.__dict__, "num_hidden_layers": 2})
    model = FlaxGPTForLMModule(config, dtype=jnp.float16)
    batch = {"input_ids": jnp.tile(IDS, (8, 1)), "labels": jnp.tile(IDS[:, ::-1], (8, 1))}
    ones = jnp.ones_like(batch["input_ids"])
    params = model.init(KEY, batch["input_ids"], ones, ones, ones)
    state = TrainState.create(
        apply_fn=model.apply,
        params=params,
        # SGD: Adam would scale the float16 rounding noise of gradients that are 0 in
        # exact arithmetic (the key biases') up to its step size.
        tx=optax.sgd(0.1),
        use_master_copy=True,
        dynamic_scale=DynamicScale(scale=256.0),
    )

    def train_step(state, batch):
        def compute_loss(params):
            ids = batch["input_ids"]
            mask = jnp.ones_like(ids)  # of the micro-batch
            logits = state.apply_fn(params, ids, mask, mask, mask)[0].astype(jnp.float32)
            labels = jax.nn.one_hot(batch["labels"], V)
            return optax.softmax_cross_entropy(logits, labels).mean()

        dynamic_scale, is_fin, loss, grads = state.dynamic_scale.value_and_grad(compute_loss)(
            state.params
        )
        new_state = state.apply_gradients(grads=grads)
        keep = functools.partial(jax.tree.map, functools.partial(jnp.where, is_fin))
        new_state = new_state.replace(
            opt_state=keep(new_state.opt_state, state.opt_state),
            params=keep(new_state.params, state.params),
            master_copy=keep(new_state.master_copy, state.master_copy),
            dynamic_scale=dynamic_scale,
        )
        return new_state, {"loss": loss, "scale": dynamic_scale.scale}

    jitted = jax.jit(train_step)
    p_step = alpa.parallelize(
        train_step, method=alpa.Zero2Parallel(num_micro_batches=2), donate_argnums=(0,)
    )
    expected, got, metrics = state, state, []
    for _ in range(2):
        expected, expected_metrics = jitted(expected, batch)
        got, step_metrics = p_step(got, batch)
        metrics.append(step_metrics)
    assert {x.dtype for x in jax.tree.leaves(got.params)} == {jnp.dtype(jnp.float16)}
    assert_allclose(got.master_copy, expected.master_copy, rtol=2e-3, atol=2e-3)
    assert_allclose(got.params, expected.params, rtol=2e-2, atol=2e-2)
    stacked = get_metrics(metrics)
    assert stacked["loss"].shape == (2,) and float(stacked["scale"][-1]) == 256.0
    assert_allclose(stacked["loss"][-1], expected_metrics["loss"], rtol=1e-2, atol=1e-2)
