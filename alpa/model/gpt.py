r"""GPT: a decoder-only transformer language model (GPT-2/Megatron layout, pre-LayerNorm).

For token ids :math:`t_{b,s}` and positions :math:`p_{b,s}`,

.. math::
    x^{(0)} &= E_{\mathrm{tok}}[t] + E_{\mathrm{pos}}[p], \\
    y^{(l)} &= x^{(l-1)} + \mathrm{Attn}_{\mathrm{causal}}(\mathrm{LN}(x^{(l-1)})), \\
    x^{(l)} &= y^{(l)} + \mathrm{MLP}(\mathrm{LN}(y^{(l)})), \qquad l = 1..L, \\
    \mathrm{logits} &= \mathrm{LN}(x^{(L)}) \, E_{\mathrm{tok}}^\top
        \quad \text{(tied; an untied head uses its own } W_{\mathrm{head}}\text{)}.

The MLP is ``Dense(4H) -> GELU -> Dense(H)``. One block holds :math:`12H^2 + 13H` parameters,
the embeddings :math:`(V + S)H`, the final LayerNorm :math:`2H`; with the reference sizes
(``GPT_PRESETS``) the "1.3B" model has 1.316e9 parameters.

With ``add_manual_pipeline_markers=True`` a pipeline boundary is marked after every block
but the last. With ``scan_layers=True`` the blocks are one ``nn.scan`` over ``num_layers``
iterations (parameters stacked on a leading axis of that size, under ``params["blocks"]``),
as MaxText-style models are written; ``remat_layers=True`` checkpoints each block
(``nn.remat``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from alpa.model.layers import (
    FeedForward,
    MultiHeadAttention,
    embed_tokens,
    lm_head,
)
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
class GPTConfig:
    """Sizes of a GPT model. ``seq_len`` is the number of learned positions."""

    hidden_size: int
    num_layers: int
    num_heads: int
    seq_len: int = 1024
    vocab_size: int = 51200
    tie_word_embeddings: bool = True
    dtype: DType = jnp.float32
    add_manual_pipeline_markers: bool = False
    layer_norm_epsilon: float = 1e-5
    scan_layers: bool = False
    remat_layers: bool = False

    def __post_init__(self) -> None:
        check_positive(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
        )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        if self.scan_layers and self.add_manual_pipeline_markers:
            raise ValueError(
                "scan_layers=True and add_manual_pipeline_markers=True: a pipeline marker "
                "cannot sit between the iterations of one scan; use AutoLayerOption instead"
            )


def _preset(hidden_size: int, num_layers: int, num_heads: int) -> GPTConfig:
    return GPTConfig(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads)


#: The model sizes of Alpa's GPT benchmark (seq_len 1024, vocab 51200).
GPT_PRESETS: dict[str, GPTConfig] = {
    "125M": _preset(768, 12, 12),
    "350M": _preset(1024, 24, 16),
    "760M": _preset(1536, 24, 16),
    "1.3B": _preset(2048, 24, 32),
    "2.6B": _preset(2560, 32, 32),
    "6.7B": _preset(4096, 32, 32),
    "15B": _preset(5120, 48, 40),
    "39B": _preset(8192, 48, 64),
}


class GPTBlock(nn.Module):
    """One pre-LN decoder block: causal self-attention, then the MLP, each with a residual."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        h = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype, name="ln_1")(x)
        x = x + MultiHeadAttention(cfg.num_heads, causal=True, dtype=cfg.dtype, name="attn")(h)
        h = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype, name="ln_2")(x)
        return x + FeedForward(4 * cfg.hidden_size, dtype=cfg.dtype, name="mlp")(h)


class _ScannedBlock(nn.Module):
    """A ``GPTBlock`` in ``nn.scan``'s calling convention: ``(carry, x) -> (carry, y)``."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        block = nn.remat(GPTBlock) if self.config.remat_layers else GPTBlock
        return block(self.config, name="block")(x), None


class FlaxGPTForLMModule(nn.Module):
    """GPT language model: ``input_ids[batch, seq] -> logits[batch, seq, vocab]``."""

    config: GPTConfig

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        position_ids: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """Logits of the next token at every position.

        ``position_ids`` defaults to ``0..seq-1`` in every row. ``deterministic`` is accepted
        for compatibility; the model has no dropout, so it changes nothing.
        """
        del deterministic
        cfg = self.config
        x, wte = embed_tokens(
            input_ids, position_ids, cfg.vocab_size, cfg.seq_len, cfg.hidden_size, cfg.dtype
        )

        if cfg.scan_layers:
            blocks = nn.scan(
                _ScannedBlock,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=cfg.num_layers,
            )
            x, _ = blocks(cfg, name="blocks")(x, None)
        block = nn.remat(GPTBlock) if cfg.remat_layers else GPTBlock
        for i in range(0 if cfg.scan_layers else cfg.num_layers):
            x = block(cfg, name=f"block_{i}")(x)
            if cfg.add_manual_pipeline_markers and i < cfg.num_layers - 1:
                mark_pipeline_boundary()

        x = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype, name="ln_f")(x)
        return lm_head(x, wte, cfg.tie_word_embeddings, cfg.vocab_size, cfg.dtype)


def gpt_lm_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean token cross-entropy; ``labels[b, s]`` is the token that follows position ``s``."""
    return softmax_cross_entropy(logits, labels)


def get_gpt_train_state_and_step(
    config: GPTConfig,
    batch_size: int,
    optimizer: OptimizerName = "adamw",
    learning_rate: float = 1e-3,
    seed: int = 0,
    grad_func: GradFunc = jax.value_and_grad,
    abstract: bool = False,
) -> tuple[TrainState, dict[str, Any], Callable[..., Any]]:
    """``(state, batch, train_step)`` for next-token prediction on random tokens.

    The batch holds ``input_ids``, ``position_ids`` and ``labels`` (``input_ids`` shifted by
    one), each ``int32[batch_size, config.seq_len]``. See :mod:`alpa.model.model_util` for
    the other arguments.
    """
    check_positive(batch_size=batch_size)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, (batch_size, config.seq_len + 1), dtype=np.int32)
    positions = np.broadcast_to(np.arange(config.seq_len, dtype=np.int32), tokens[:, 1:].shape)
    batch = make_batch(
        {"input_ids": tokens[:, :-1], "position_ids": positions, "labels": tokens[:, 1:]},
        abstract,
    )
    model = FlaxGPTForLMModule(config)
    tx = make_optimizer(optimizer, learning_rate)
    state = create_train_state(
        model, (batch["input_ids"], batch["position_ids"]), tx, seed, abstract
    )

    def loss_fn(params: PyTree, state: TrainState, batch: Mapping[str, jax.Array]) -> jax.Array:
        logits = state.apply_fn({"params": params}, batch["input_ids"], batch["position_ids"])
        return gpt_lm_loss(logits, batch["labels"])

    return state, batch, make_train_step(loss_fn, grad_func)
