r"""BERT: a bidirectional transformer encoder with post-LayerNorm, and a masked-LM head.

Each encoder layer is post-LN (as in the original BERT):

.. math::
    y = \mathrm{LN}(x + \mathrm{Attn}(x)), \qquad
    x' = \mathrm{LN}(y + \mathrm{MLP}(y)),

where attention is bidirectional (every position sees every unpadded position) and the MLP is
``Dense(intermediate_size) -> GELU -> Dense(H)`` (``hidden_act``: the tanh GELU by default,
``"gelu"`` for the exact one). The embeddings are the LayerNorm of the sum of token, position
and token-type embeddings (no token types with ``type_vocab_size=0``). The masked-LM head is
``Dense(H) -> GELU -> LN`` followed by the token embedding transposed (tied) plus a bias.

With ``add_manual_pipeline_markers=True`` a pipeline boundary is marked after every layer but
the last, or with ``pipeline_mp_size=k`` after every ``num_layers / k`` layers. With
``gradient_checkpointing=True`` every layer is wrapped in ``nn.remat`` (``jax.checkpoint``):
the backward pass recomputes a layer's activations instead of keeping them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from alpa.model.layers import ACTIVATIONS, INIT_STD, FeedForward, MultiHeadAttention, dense
from alpa.model.model_util import (
    DType,
    GradFunc,
    OptimizerName,
    PyTree,
    TrainState,
    check_positive,
    create_train_state,
    make_batch,
    make_optimizer,
    make_train_step,
    mark_pipeline_boundary,
    softmax_cross_entropy,
)


@dataclass(frozen=True)
class BertConfig:
    """Sizes of a BERT model. ``intermediate_size`` defaults to ``4 * hidden_size``."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int | None = None
    vocab_size: int = 30522
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_epsilon: float = 1e-12
    tie_word_embeddings: bool = True
    dtype: DType = jnp.float32
    add_manual_pipeline_markers: bool = False
    gradient_checkpointing: bool = False
    hidden_act: str = "gelu_new"
    pipeline_mp_size: int | None = None

    def __post_init__(self) -> None:
        check_positive(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
        )
        if isinstance(self.type_vocab_size, bool) or not (
            isinstance(self.type_vocab_size, int) and self.type_vocab_size >= 0
        ):
            raise ValueError(
                f"type_vocab_size must be an int >= 0 (0: no token types), "
                f"got {self.type_vocab_size!r}"
            )
        if self.intermediate_size is not None:
            check_positive(intermediate_size=self.intermediate_size)
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act must be one of {sorted(ACTIVATIONS)}, got {self.hidden_act!r}"
            )
        if self.pipeline_mp_size:
            check_positive(pipeline_mp_size=self.pipeline_mp_size)
            if self.num_layers % self.pipeline_mp_size:
                raise ValueError(
                    f"pipeline_mp_size={self.pipeline_mp_size} does not divide "
                    f"num_layers={self.num_layers}: the pipeline boundaries cut the layers "
                    "into that many equal groups"
                )

    @property
    def ffn_size(self) -> int:
        """The width of the MLP's hidden layer."""
        return self.intermediate_size or 4 * self.hidden_size


def _padding_mask(attention_mask: jax.Array | None) -> jax.Array | None:
    """``[batch, seq]`` of 1 (token) / 0 (padding) -> boolean ``[batch, 1, 1, seq]`` over keys."""
    if attention_mask is None:
        return None
    return attention_mask[:, None, None, :].astype(bool)


class FlaxBertLayer(nn.Module):
    """One post-LN encoder layer over ``hidden_states[batch, seq, hidden]``."""

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        hidden_states: jax.Array,
        attention_mask: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """``attention_mask[batch, seq]`` is 1 for tokens and 0 for padding (keys to ignore)."""
        del deterministic  # no dropout
        cfg = self.config
        attn = MultiHeadAttention(cfg.num_heads, causal=False, dtype=cfg.dtype, name="attention")
        x = hidden_states + attn(hidden_states, _padding_mask(attention_mask))
        x = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype, name="attention_ln")(x)
        x = x + FeedForward(cfg.ffn_size, cfg.dtype, cfg.hidden_act, name="mlp")(x)
        return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype, name="output_ln")(x)


class FlaxBertLayerCollection(nn.Module):
    """``config.num_layers`` encoder layers, with pipeline boundaries between them if asked."""

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        hidden_states: jax.Array,
        attention_mask: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        cfg = self.config
        # static_argnums counts the module: 3 is ``deterministic``.
        layer = (
            nn.remat(FlaxBertLayer, static_argnums=(3,))
            if cfg.gradient_checkpointing
            else FlaxBertLayer
        )
        per_stage = cfg.num_layers // cfg.pipeline_mp_size if cfg.pipeline_mp_size else 1
        for i in range(cfg.num_layers):
            hidden_states = layer(cfg, name=str(i))(hidden_states, attention_mask, deterministic)
            last = i == cfg.num_layers - 1
            if cfg.add_manual_pipeline_markers and (i + 1) % per_stage == 0 and not last:
                mark_pipeline_boundary()
        return hidden_states


def bert_encode(
    cfg: BertConfig,
    input_ids: jax.Array,
    attention_mask: jax.Array | None,
    token_type_ids: jax.Array | None,
    position_ids: jax.Array | None,
    deterministic: bool,
) -> tuple[jax.Array, nn.Embed]:
    """The embeddings and the encoder: ``hidden_states[batch, seq, hidden]``, and the word
    embedding (for a tied head). Call it inside a ``@nn.compact`` method: its modules
    (``word_embeddings``, ``position_embeddings``, ``token_type_embeddings`` unless
    ``type_vocab_size`` is 0, ``embeddings_ln``, ``encoder``) become the caller's.

    ``token_type_ids`` default to 0, ``position_ids`` to ``0..seq-1``, ``attention_mask`` to
    no padding.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
    seq_len = input_ids.shape[1]
    if seq_len > cfg.max_position_embeddings:
        raise ValueError(
            f"input of length {seq_len} exceeds "
            f"config.max_position_embeddings={cfg.max_position_embeddings}"
        )
    if position_ids is None:
        position_ids = jnp.broadcast_to(jnp.arange(seq_len), input_ids.shape)

    def embed(num: int, name: str) -> nn.Embed:
        return nn.Embed(
            num,
            cfg.hidden_size,
            dtype=cfg.dtype,
            embedding_init=nn.initializers.normal(INIT_STD),
            name=name,
        )

    word_embeddings = embed(cfg.vocab_size, "word_embeddings")
    x = word_embeddings(input_ids) + embed(cfg.max_position_embeddings, "position_embeddings")(
        position_ids
    )
    if cfg.type_vocab_size:
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        x = x + embed(cfg.type_vocab_size, "token_type_embeddings")(token_type_ids)
    x = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype, name="embeddings_ln")(x)
    x = FlaxBertLayerCollection(cfg, name="encoder")(x, attention_mask, deterministic)
    return x, word_embeddings


class FlaxBertForMaskedLM(nn.Module):
    """BERT with a masked-LM head: ``input_ids[batch, seq] -> logits[batch, seq, vocab]``."""

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
        position_ids: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """Logits of the original token at every position (arguments: :func:`bert_encode`)."""
        cfg = self.config
        x, word_embeddings = bert_encode(
            cfg, input_ids, attention_mask, token_type_ids, position_ids, deterministic
        )

        x = ACTIVATIONS[cfg.hidden_act](dense(cfg.hidden_size, cfg.dtype, "transform")(x))
        x = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype, name="transform_ln")(x)
        if cfg.tie_word_embeddings:
            logits = word_embeddings.attend(x)
        else:
            logits = dense(cfg.vocab_size, cfg.dtype, "decoder", use_bias=False)(x)
        bias = self.param("decoder_bias", nn.initializers.zeros, (cfg.vocab_size,), jnp.float32)
        return logits + bias.astype(logits.dtype)


def get_bert_train_state_and_step(
    config: BertConfig,
    batch_size: int,
    seq_len: int | None = None,
    mask_prob: float = 0.15,
    optimizer: OptimizerName = "adamw",
    learning_rate: float = 1e-3,
    seed: int = 0,
    grad_func: GradFunc = jax.value_and_grad,
    abstract: bool = False,
) -> tuple[TrainState, dict[str, Any], Callable[..., Any]]:
    """``(state, batch, train_step)`` for masked-language modelling on random tokens.

    ``seq_len`` defaults to ``config.max_position_embeddings``. Tokens are drawn from
    ``1..vocab-1``; about ``mask_prob`` of the positions (at least one per row) are replaced by
    token 0, which plays ``[MASK]``. The batch holds ``input_ids``, ``attention_mask``,
    ``token_type_ids``, ``position_ids``, ``labels`` (the original tokens), all
    ``int32[batch_size, seq_len]``, and ``label_mask`` (float32, 1 where a token was masked):
    the loss is the cross-entropy averaged over masked positions only.
    """
    seq_len = config.max_position_embeddings if seq_len is None else seq_len
    check_positive(batch_size=batch_size, seq_len=seq_len, mask_prob=mask_prob)
    if seq_len > config.max_position_embeddings:
        raise ValueError(
            f"seq_len={seq_len} exceeds "
            f"config.max_position_embeddings={config.max_position_embeddings}"
        )
    if config.vocab_size < 2:
        raise ValueError(
            f"vocab_size={config.vocab_size} leaves no token besides 0, which plays [MASK]"
        )
    rng = np.random.default_rng(seed)
    shape = (batch_size, seq_len)
    labels = rng.integers(1, config.vocab_size, shape, dtype=np.int32)
    label_mask = rng.random(shape) < mask_prob
    label_mask[np.arange(batch_size), rng.integers(0, seq_len, batch_size)] = True
    batch = make_batch(
        {
            "input_ids": np.where(label_mask, 0, labels).astype(np.int32),
            "attention_mask": np.ones(shape, np.int32),
            "token_type_ids": np.zeros(shape, np.int32),
            "position_ids": np.broadcast_to(np.arange(seq_len, dtype=np.int32), shape),
            "labels": labels,
            "label_mask": label_mask.astype(np.float32),
        },
        abstract,
    )
    model = FlaxBertForMaskedLM(config)
    tx = make_optimizer(optimizer, learning_rate)
    init_args = tuple(
        batch[k] for k in ("input_ids", "attention_mask", "token_type_ids", "position_ids")
    )
    state = create_train_state(model, init_args, tx, seed, abstract)

    def loss_fn(params: PyTree, state: TrainState, batch: Mapping[str, jax.Array]) -> jax.Array:
        logits = state.apply_fn(
            {"params": params},
            batch["input_ids"],
            batch["attention_mask"],
            batch["token_type_ids"],
            batch["position_ids"],
        )
        return softmax_cross_entropy(logits, batch["labels"], batch["label_mask"])

    return state, batch, make_train_step(loss_fn, grad_func)
