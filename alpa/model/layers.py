"""Transformer building blocks shared by GPT, BERT and MoE: attention and the feed-forward MLP.

Everything is written with plain ``jnp`` ops (``einsum``, ``softmax``, ``where``) so that the
traced program holds only primitives the sharding pass has rules for: ``dot_general``,
elementwise ops, reductions, ``select_n``. There is no dropout, hence no RNG in the forward
pass, and ``deterministic`` arguments elsewhere exist only for API compatibility.

Query, key and value are three separate ``Dense`` layers rather than one fused ``[H, 3H]``
matrix: each is a plain ``[H, H]`` matmul that the sharding pass splits by heads
(Megatron's column split) without having to reason about how a fused dimension is reshaped.

Parameters are kept in float32; ``dtype`` is the compute dtype. The attention softmax runs in
float32 whatever ``dtype`` is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from alpa.model.model_util import DType

#: Standard deviation of the normal initializer of every kernel and embedding (GPT-2, BERT).
INIT_STD = 0.02


def dense(features: int, dtype: DType, name: str | None = None, use_bias: bool = True) -> nn.Dense:
    """A ``Dense`` layer with the N(0, 0.02²) initializer of GPT-2 and BERT."""
    return nn.Dense(
        features,
        use_bias=use_bias,
        dtype=dtype,
        kernel_init=nn.initializers.normal(INIT_STD),
        name=name,
    )


def embed_tokens(
    input_ids: jax.Array,
    position_ids: jax.Array | None,
    vocab_size: int,
    max_seq_len: int,
    hidden_size: int,
    dtype: DType,
) -> tuple[jax.Array, nn.Embed]:
    """GPT-2 input: token embedding ``wte`` plus learned position embedding ``wpe``.

    Call it inside a ``@nn.compact`` method: ``wte`` and ``wpe`` become submodules of the
    calling module. ``position_ids`` defaults to ``0..seq-1`` in every row. Returns the
    embedded input ``[batch, seq, hidden]`` and ``wte``, for a tied LM head (:func:`lm_head`).
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
    seq_len = input_ids.shape[1]
    if seq_len > max_seq_len:
        raise ValueError(f"input of length {seq_len} exceeds config.seq_len={max_seq_len}")
    if position_ids is None:
        position_ids = jnp.broadcast_to(jnp.arange(seq_len), input_ids.shape)
    embed_init = nn.initializers.normal(INIT_STD)
    wte = nn.Embed(vocab_size, hidden_size, dtype=dtype, embedding_init=embed_init, name="wte")
    wpe = nn.Embed(max_seq_len, hidden_size, dtype=dtype, embedding_init=embed_init, name="wpe")
    return wte(input_ids) + wpe(position_ids), wte


def lm_head(
    x: jax.Array, wte: nn.Embed, tie_word_embeddings: bool, vocab_size: int, dtype: DType
) -> jax.Array:
    """Logits over the vocabulary: ``wte`` transposed when tied, else a ``lm_head`` kernel."""
    if tie_word_embeddings:
        return wte.attend(x)
    return dense(vocab_size, dtype, "lm_head", use_bias=False)(x)


def causal_mask(seq_len: int) -> jax.Array:
    """``mask[q, k] = k <= q``: query position ``q`` may attend to key positions up to itself."""
    positions = jnp.arange(seq_len)
    return positions[None, :] <= positions[:, None]


def dot_product_attention(
    query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None = None
) -> jax.Array:
    r"""Multi-head scaled dot-product attention.

    With ``query[b, q, h, d]``, ``key[b, k, h, d]`` and ``value[b, k, h, d]``,

    .. math::
        s_{bhqk} = \frac{\sum_d Q_{bqhd} K_{bkhd}}{\sqrt{D}}, \qquad
        p_{bhqk} = \operatorname{softmax}_k\bigl(s_{bhqk} \text{ where } M_{bhqk}
        \text{ else } -\infty\bigr), \qquad
        O_{bqhd} = \sum_k p_{bhqk} V_{bkhd}.

    ``mask`` is boolean and broadcasts to ``[b, h, q, k]`` (``True`` = may attend). Masked
    scores are set to the most negative finite float32 rather than ``-inf`` so that a fully
    masked row gives a uniform distribution instead of NaN.
    """
    depth = query.shape[-1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", query, key) / math.sqrt(depth)
    scores = scores.astype(jnp.float32)
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, value)


class MultiHeadAttention(nn.Module):
    """Self-attention with ``num_heads`` heads over ``x[batch, seq, hidden]``.

    ``causal=True`` masks future positions (decoders); ``mask`` (boolean, broadcastable to
    ``[batch, heads, seq, seq]``) masks further, e.g. padding in an encoder.
    """

    num_heads: int
    causal: bool
    dtype: DType = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        batch, seq_len, hidden = x.shape
        if hidden % self.num_heads:
            raise ValueError(f"hidden size {hidden} is not divisible by num_heads={self.num_heads}")
        head_shape = (batch, seq_len, self.num_heads, hidden // self.num_heads)
        query = dense(hidden, self.dtype, "query")(x).reshape(head_shape)
        key = dense(hidden, self.dtype, "key")(x).reshape(head_shape)
        value = dense(hidden, self.dtype, "value")(x).reshape(head_shape)
        if self.causal:
            causal = causal_mask(seq_len)[None, None]
            mask = causal if mask is None else jnp.logical_and(mask, causal)
        out = dot_product_attention(query, key, value, mask)
        return dense(hidden, self.dtype, "out")(out.reshape(batch, seq_len, hidden))


#: The MLP's activations by their Hugging Face / Alpa names: ``"gelu"`` is the exact GELU,
#: ``"gelu_new"`` its tanh approximation (GPT-2's, and ``nn.gelu``'s default).
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": partial(nn.gelu, approximate=False),
    "gelu_new": partial(nn.gelu, approximate=True),
    "relu": nn.relu,
    "silu": nn.swish,
    "swish": nn.swish,
}


class FeedForward(nn.Module):
    """The transformer MLP: ``Dense(intermediate_size) -> activation -> Dense(hidden)``,
    the activation one of :data:`ACTIVATIONS` (default the tanh GELU)."""

    intermediate_size: int
    dtype: DType = jnp.float32
    activation: str = "gelu_new"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}"
            )
        hidden = x.shape[-1]
        h = ACTIVATIONS[self.activation](dense(self.intermediate_size, self.dtype, "wi")(x))
        return dense(hidden, self.dtype, "wo")(h)
