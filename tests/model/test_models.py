"""The shared flax models: shapes, masks, routing invariants, and that one train step learns."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa.model import (
    GPT_PRESETS,
    WRESNET_PRESETS,
    BertConfig,
    FlaxBertForMaskedLM,
    FlaxGPTForLMModule,
    GPTConfig,
    MLPModel,
    MoEConfig,
    MoELayer,
    TrainState,
    count_params,
    expert_capacity,
    get_bert_train_state_and_step,
    get_gpt_train_state_and_step,
    get_mlp_train_state_and_step,
    get_moe_train_state_and_step,
    get_wresnet_train_state_and_step,
    gpt_lm_loss,
    make_optimizer,
    top2_gating,
)

GPT_TINY = GPTConfig(hidden_size=32, num_layers=1, num_heads=4, seq_len=8, vocab_size=64)
BERT_TINY = BertConfig(
    hidden_size=32, num_layers=1, num_heads=4, vocab_size=64, max_position_embeddings=8
)
MOE_TINY = MoEConfig(
    hidden_size=32, num_layers=2, num_heads=4, num_experts=4, seq_len=8, vocab_size=64
)
WRESNET_TINY = WRESNET_PRESETS["tiny"]
KEY = jax.random.key(0)  # for jax.eval_shape only

# Each program here runs a few times on tiny arrays, so XLA's compile time is what the tests
# spend: skip the backend's (LLVM's) optimizations.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _jit(fn, **kwargs):
    return jax.jit(fn, compiler_options=FAST_COMPILE, **kwargs)


def _count_markers(fn, *args) -> int:
    jaxpr = jax.make_jaxpr(fn)(*args)
    return sum(eqn.primitive.name == "pipeline_marker" for eqn in jaxpr.jaxpr.eqns)


@dataclasses.dataclass(frozen=True)
class Run:
    """A model's factory output and two train steps on its fixed batch."""

    state: TrainState
    batch: dict
    new_state: TrainState
    losses: tuple[float, float]  # before and after the first step


def _run(factory, config, batch_size: int, **kwargs) -> Run:
    state, batch, train_step = factory(config, batch_size, **kwargs)
    step = _jit(train_step)
    new_state, loss_0 = step(state, batch)
    _, loss_1 = step(new_state, batch)
    return Run(state, batch, new_state, (float(loss_0), float(loss_1)))


def _check_one_step(run: Run, reference_loss) -> None:
    """The step is one optimizer step on ``reference_loss(params)`` (written here from the
    model's public pieces): its loss at the old parameters, and the parameters
    ``TrainState.apply_gradients`` makes of that loss's gradient."""
    params = run.state.params
    loss, grads = jax.value_and_grad(reference_loss)(params)
    assert run.losses[0] == pytest.approx(float(loss), rel=1e-5)
    expected = run.state.apply_gradients(grads=grads).params
    leaves = jax.tree.leaves(
        jax.tree.map(
            lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), run.new_state.params, expected
        )
    )
    assert max(leaves) < 1e-5
    # Control: the parameters did move (a step that returned its input would fail above
    # only if the gradient were zero).
    moved = jax.tree.leaves(
        jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), params, expected)
    )
    assert max(moved) > 1e-4


@pytest.fixture(scope="module")
def gpt_run() -> Run:
    return _run(get_gpt_train_state_and_step, GPT_TINY, 4)


@pytest.fixture(scope="module")
def bert_run() -> Run:
    return _run(get_bert_train_state_and_step, BERT_TINY, 4)


@pytest.fixture(scope="module")
def moe_run() -> Run:
    return _run(get_moe_train_state_and_step, MOE_TINY, 4)


@pytest.fixture(scope="module")
def wresnet_run() -> Run:
    return _run(get_wresnet_train_state_and_step, WRESNET_TINY, 8)


# ---------------------------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------------------------


def test_mlp_shapes_and_markers():
    model = MLPModel(hidden_size=16, num_layers=3, output_dim=4, add_manual_pipeline_markers=True)
    x = jnp.ones((2, 8))
    params = jax.eval_shape(model.init, KEY, x)
    assert jax.eval_shape(model.apply, params, x).shape == (2, 4)
    # 3 hidden layers + the output layer: 3 boundaries between them.
    assert _count_markers(model.apply, params, x) == 3
    unmarked = dataclasses.replace(model, add_manual_pipeline_markers=False)
    assert _count_markers(unmarked.apply, params, x) == 0


def test_mlp_train_step_is_one_adam_step_on_the_mse():
    model = MLPModel(hidden_size=16, num_layers=2, output_dim=4)
    run = _run(get_mlp_train_state_and_step, model, 8, input_dim=8)

    def mse(params):
        return jnp.mean((model.apply({"params": params}, run.batch["x"]) - run.batch["y"]) ** 2)

    _check_one_step(run, mse)
    loss_0, loss_1 = run.losses
    assert loss_1 < loss_0


# ---------------------------------------------------------------------------------------------
# GPT
# ---------------------------------------------------------------------------------------------


def test_gpt_logits_shape_and_dtype():
    ids = jnp.zeros((2, 8), jnp.int32)
    model = FlaxGPTForLMModule(GPT_TINY)
    params = jax.eval_shape(model.init, KEY, ids)
    assert jax.eval_shape(model.apply, params, ids).shape == (2, 8, 64)
    bf16 = FlaxGPTForLMModule(dataclasses.replace(GPT_TINY, dtype=jnp.bfloat16))
    assert jax.eval_shape(bf16.apply, params, ids).dtype == jnp.bfloat16
    # Parameters stay float32 whatever the compute dtype.
    bf16_params = jax.eval_shape(bf16.init, KEY, ids)
    assert {x.dtype for x in jax.tree_util.tree_leaves(bf16_params)} == {jnp.dtype(jnp.float32)}


def test_gpt_attention_is_causal(gpt_run):
    ids = gpt_run.batch["input_ids"]
    apply = _jit(FlaxGPTForLMModule(GPT_TINY).apply)
    params = {"params": gpt_run.new_state.params}
    changed = ids.at[:, 5].set((ids[:, 5] + 1) % 64)
    before, after = apply(params, ids), apply(params, changed)
    np.testing.assert_allclose(before[:, :5], after[:, :5], rtol=1e-6, atol=1e-6)
    assert not np.allclose(before[:, 5:], after[:, 5:])


def test_gpt_tied_embedding_has_no_separate_head(gpt_run):
    params = gpt_run.state.params
    assert set(params) == {"wte", "wpe", "block_0", "ln_f"}
    assert params["wte"]["embedding"].shape == (64, 32)
    assert count_params(params) == (12 * 32**2 + 13 * 32) + (64 + 8) * 32 + 2 * 32

    untied = FlaxGPTForLMModule(dataclasses.replace(GPT_TINY, tie_word_embeddings=False))
    ids = jnp.zeros((1, 8), jnp.int32)
    params = jax.eval_shape(untied.init, KEY, ids)["params"]
    assert params["lm_head"]["kernel"].shape == (32, 64)


def test_gpt_markers_between_blocks():
    cfg = dataclasses.replace(GPT_TINY, num_layers=3, add_manual_pipeline_markers=True)
    model = FlaxGPTForLMModule(cfg)
    ids = jnp.zeros((1, 8), jnp.int32)
    params = jax.eval_shape(model.init, KEY, ids)
    assert _count_markers(model.apply, params, ids) == 2


def test_gpt_lm_loss_is_token_cross_entropy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 5, 11), dtype=np.float32)
    labels = rng.integers(0, 11, (2, 5))
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, labels[..., None], -1).mean()
    np.testing.assert_allclose(_jit(gpt_lm_loss)(logits, labels), expected, rtol=1e-6)
    with pytest.raises(ValueError, match=r"labels of shape \(2, 4\) do not match"):
        gpt_lm_loss(logits, labels[:, :4])


def test_gpt_train_step_is_one_adam_step_on_the_lm_loss(gpt_run):
    batch = gpt_run.batch
    model = FlaxGPTForLMModule(GPT_TINY)

    def lm_loss(params):
        logits = model.apply({"params": params}, batch["input_ids"], batch["position_ids"])
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(log_probs, batch["labels"][..., None], axis=-1)
        return -jnp.mean(picked)

    _check_one_step(gpt_run, lm_loss)
    loss_0, loss_1 = gpt_run.losses
    assert loss_0 == pytest.approx(np.log(64), rel=0.05)  # near-uniform at initialization
    assert loss_1 < loss_0


def test_gpt_config_validation():
    with pytest.raises(ValueError, match="hidden_size=30 is not divisible by num_heads=4"):
        GPTConfig(hidden_size=30, num_layers=1, num_heads=4)
    with pytest.raises(ValueError, match="num_layers must be a positive number, got 0"):
        GPTConfig(hidden_size=32, num_layers=0, num_heads=4)
    with pytest.raises(ValueError, match="exceeds config.seq_len=8"):
        jax.eval_shape(FlaxGPTForLMModule(GPT_TINY).init, KEY, jnp.zeros((1, 9), jnp.int32))
    with pytest.raises(ValueError, match="optimizer must be one of"):
        make_optimizer("lamb", 1e-3)


def test_other_config_validation():
    with pytest.raises(ValueError, match="num_experts must be at least 2, got 1"):
        dataclasses.replace(MOE_TINY, num_experts=1)
    with pytest.raises(ValueError, match="top-2 gating needs at least 2 experts, got 1"):
        top2_gating(jnp.zeros((1, 4, 1)), capacity=4)
    with pytest.raises(ValueError, match="block must be one of"):
        dataclasses.replace(WRESNET_TINY, block="dense")
    with pytest.raises(ValueError, match="stage_sizes must be a non-empty tuple"):
        dataclasses.replace(WRESNET_TINY, stage_sizes=())
    with pytest.raises(ValueError, match="seq_len=16 exceeds config.max_position_embeddings=8"):
        get_bert_train_state_and_step(BERT_TINY, 2, seq_len=16)


# ---------------------------------------------------------------------------------------------
# BERT
# ---------------------------------------------------------------------------------------------


def test_bert_is_bidirectional_and_respects_padding(bert_run):
    ids = bert_run.batch["input_ids"]
    mask = jnp.ones((4, 8), jnp.int32).at[:, 6:].set(0)
    apply = _jit(FlaxBertForMaskedLM(BERT_TINY).apply)
    params = {"params": bert_run.new_state.params}
    base = apply(params, ids, mask)
    assert base.shape == (4, 8, 64)
    # A later, unpadded token changes earlier outputs: attention is bidirectional.
    later = apply(params, ids.at[:, 5].set((ids[:, 5] + 1) % 64), mask)
    assert not np.allclose(base[:, :5], later[:, :5])
    # A padded token changes no other position's output.
    padded = apply(params, ids.at[:, 7].set((ids[:, 7] + 1) % 64), mask)
    np.testing.assert_allclose(base[:, :7], padded[:, :7], rtol=1e-5, atol=1e-5)


def test_bert_train_step_decreases_loss(bert_run):
    loss_0, loss_1 = bert_run.losses
    assert loss_1 < loss_0


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------

_top2_gating = _jit(top2_gating, static_argnames=("capacity", "normalize_gates"))


def test_expert_capacity():
    assert expert_capacity(num_tokens=16, num_experts=4, capacity_factor=1.0) == 8
    assert expert_capacity(num_tokens=10, num_experts=4, capacity_factor=1.5) == 8  # ceil(7.5)
    with pytest.raises(ValueError, match="num_experts must be a positive number, got 0"):
        expert_capacity(16, 0, 1.0)


def test_top2_dispatch_respects_capacity():
    groups, tokens, experts, capacity = 2, 32, 4, 5
    logits = np.random.default_rng(0).standard_normal((groups, tokens, experts))
    logits[:, :, 0] += 3.0  # overload expert 0 so that tokens get dropped
    routing = _top2_gating(jnp.asarray(logits, jnp.float32), capacity=capacity)
    dispatch = np.asarray(routing.dispatch)
    assert dispatch.shape == (groups, tokens, experts, capacity)
    assert dispatch.sum(axis=1).max() <= 1  # a slot holds at most one token
    assert (dispatch.sum(axis=(1, 3)) <= capacity).all()  # an expert at most `capacity`
    assert (dispatch.sum(axis=(2, 3)) <= 2).all()  # a token goes to at most two experts
    assert dispatch[:, :, 0].sum(axis=(1, 2)).tolist() == [capacity] * groups  # overloaded
    assert dispatch.sum() < groups * tokens * 2  # so some tokens were dropped
    # Weights only where a token was dispatched.
    assert (np.asarray(routing.combine)[~dispatch] == 0).all()


def test_top2_first_choices_fill_slots_in_token_order():
    logits = np.zeros((1, 6, 3), np.float32)
    logits[0, :, 0], logits[0, :, 1] = 5.0, 1.0
    dispatch = np.asarray(_top2_gating(jnp.asarray(logits), capacity=4).dispatch)[0]
    # Every token picks expert 0 first: tokens 0..3 take its slots 0..3, tokens 4, 5 are
    # dropped there; second choices (expert 1) are served in token order too.
    np.testing.assert_array_equal(dispatch[:4, 0].argmax(-1), [0, 1, 2, 3])
    assert dispatch[4:, 0].sum() == 0
    np.testing.assert_array_equal(dispatch[:4, 1].argmax(-1), [0, 1, 2, 3])


def test_top2_combine_sums_to_top2_gates_with_ample_capacity():
    logits = np.random.default_rng(1).standard_normal((2, 16, 4)).astype(np.float32)
    routing = _top2_gating(jnp.asarray(logits), capacity=16)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    top2 = np.sort(probs, axis=-1)[..., -2:].sum(-1)
    np.testing.assert_allclose(routing.combine.sum(axis=(2, 3)), top2, rtol=1e-5)
    assert int(routing.dispatch.sum()) == 2 * 16 * 2  # nothing dropped
    normalized = _top2_gating(jnp.asarray(logits), capacity=16, normalize_gates=True)
    np.testing.assert_allclose(normalized.combine.sum(axis=(2, 3)), 1.0, rtol=1e-5)


def test_top2_aux_loss_measures_imbalance():
    experts = 4
    balanced = np.eye(experts, dtype=np.float32)[np.arange(16) % experts][None] * 20.0
    collapsed = np.zeros((1, 16, experts), np.float32)
    collapsed[:, :, 0] = 20.0
    aux = [float(_top2_gating(jnp.asarray(x), capacity=16).aux_loss) for x in (balanced, collapsed)]
    assert aux == pytest.approx([1.0, experts], rel=1e-3)


def test_moe_layer_shapes_and_group_size_error():
    layer = MoELayer(num_experts=4, intermediate_size=16, expert_group_size=4)
    x = jnp.ones((2, 6, 8))
    variables = jax.eval_shape(layer.init, KEY, x)
    assert variables["params"]["wi"].shape == (4, 8, 16)
    assert variables["params"]["wo"].shape == (4, 16, 8)
    y, aux = jax.eval_shape(layer.apply, variables, x)
    assert y.shape == x.shape and aux.shape == ()
    bad = MoELayer(num_experts=4, intermediate_size=16, expert_group_size=5)
    with pytest.raises(ValueError, match="expert_group_size=5 does not divide the 12 tokens"):
        jax.eval_shape(bad.init, KEY, x)


def test_moe_alternates_dense_and_moe_blocks_and_learns(moe_run):
    params = moe_run.state.params
    assert "mlp" in params["block_0"] and "moe" in params["block_1"]
    loss_0, loss_1 = moe_run.losses
    assert loss_1 < loss_0


# ---------------------------------------------------------------------------------------------
# Wide-ResNet
# ---------------------------------------------------------------------------------------------


def test_wresnet_train_step_updates_batch_stats_and_decreases_loss(wresnet_run):
    loss_0, loss_1 = wresnet_run.losses
    assert loss_1 < loss_0
    old_mean = wresnet_run.state.batch_stats["stem_bn"]["mean"]
    assert not np.allclose(old_mean, wresnet_run.new_state.batch_stats["stem_bn"]["mean"])
    # Inference uses the running averages and needs no mutable collection.
    new_state = wresnet_run.new_state
    variables = {"params": new_state.params, "batch_stats": new_state.batch_stats}
    infer = partial(WRESNET_TINY.make_model().apply, train=False)
    logits = jax.eval_shape(infer, variables, wresnet_run.batch["images"])
    assert logits.shape == (8, WRESNET_TINY.num_classes)


# ---------------------------------------------------------------------------------------------
# Abstract factories
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory, config, run",
    [
        (get_gpt_train_state_and_step, GPT_TINY, "gpt_run"),
        (get_bert_train_state_and_step, BERT_TINY, "bert_run"),
        (get_moe_train_state_and_step, MOE_TINY, "moe_run"),
        (get_wresnet_train_state_and_step, WRESNET_TINY, "wresnet_run"),
    ],
)
def test_abstract_factories_return_shape_dtype_structs(factory, config, run, request):
    real: Run = request.getfixturevalue(run)
    batch_size = jax.tree_util.tree_leaves(real.batch)[0].shape[0]
    state, batch, _ = factory(config, batch_size, abstract=True)
    leaves = jax.tree_util.tree_leaves((state, batch))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    real_leaves = jax.tree_util.tree_leaves((real.state, real.batch))
    assert [(x.shape, x.dtype) for x in real_leaves] == [(x.shape, x.dtype) for x in leaves]


def test_gpt_1_3b_parameter_count_abstractly():
    config = GPT_PRESETS["1.3B"]
    assert (config.seq_len, config.vocab_size) == (1024, 51200)
    state, batch, _ = get_gpt_train_state_and_step(config, batch_size=8, abstract=True)
    assert batch["input_ids"].shape == (8, 1024)
    assert count_params(state.params) == pytest.approx(1.3e9, rel=0.05)
