r"""Mixture of experts: GShard's top-2 gating with expert capacity, and a small MoE language model.

**Routing** (Lepikhin et al., "GShard", 2020, Algorithm 1). Tokens are split into ``G`` groups
of ``S`` tokens; each group is routed on its own, so routing is local to a data-parallel
shard. For router logits :math:`z_{gse}` over ``E`` experts,

.. math::
    p_{gse} = \operatorname{softmax}_e(z_{gse}), \qquad
    e_1 = \arg\max_e p_{gse}, \qquad e_2 = \arg\max_{e \ne e_1} p_{gse}.

Each expert takes at most :math:`C = \lceil c \cdot 2S / E \rceil` tokens per group
(``capacity_factor`` :math:`c`). First choices are served first, in token order: the slot of
token :math:`s` in expert :math:`e_1` is the number of earlier tokens whose first choice is
:math:`e_1` (an exclusive cumulative sum of the one-hot mask over :math:`s`); second choices
fill the slots after all kept first choices. A token whose slot is :math:`\ge C` is dropped
for that expert. This gives

.. math::
    \mathrm{dispatch}_{gsec} \in \{0, 1\}, \qquad
    \mathrm{combine}_{gsec} = \textstyle\sum_{k=1,2} p_{g s e_k} \,
        [e = e_k] \, [c = \mathrm{slot}_k(s)] \, [\mathrm{slot}_k(s) < C],

so a token that no expert dropped has combine weights summing to :math:`p_{se_1} + p_{se_2}`
(or to 1 with ``normalize_gates=True``, which divides by that sum as GShard does).

**Experts** are one batched weight pair ``wi[E, H, F]``, ``wo[E, F, H]``:

.. math::
    X_{egch} = \textstyle\sum_s \mathrm{dispatch}_{gsec} x_{gsh}, \quad
    Y_{egch} = \sum_f \mathrm{gelu}\bigl(\sum_h X_{egch} W^i_{ehf}\bigr) W^o_{efh}, \quad
    y_{gsh} = \sum_{e,c} \mathrm{combine}_{gsec} Y_{egch}.

**Load balancing.** With :math:`m_{ge}` the mean router probability of expert :math:`e` and
:math:`f_{ge}` the fraction of tokens whose first choice is :math:`e` (before dropping),

.. math::
    \ell_{\mathrm{aux}} = E \cdot \frac{1}{G}\sum_g \sum_e m_{ge} f_{ge},

which is 1 for perfectly uniform routing and grows as routing concentrates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from alpa.model.layers import (
    INIT_STD,
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

# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """``ceil(capacity_factor * num_tokens * 2 / num_experts)``: slots per expert and group."""
    check_positive(num_tokens=num_tokens, num_experts=num_experts, capacity_factor=capacity_factor)
    return math.ceil(capacity_factor * num_tokens * 2 / num_experts)


class Top2Routing(NamedTuple):
    """The routing of ``G`` groups of ``S`` tokens to ``E`` experts of ``C`` slots each."""

    #: ``float32[G, S, E, C]``: the weight of expert ``e``'s slot ``c`` in token ``s``'s output.
    combine: jax.Array
    #: ``bool[G, S, E, C]``: token ``s`` occupies slot ``c`` of expert ``e``.
    dispatch: jax.Array
    #: scalar float32: the load-balancing loss (1 for uniform routing).
    aux_loss: jax.Array


def top2_gating(
    router_logits: jax.Array, capacity: int, normalize_gates: bool = False
) -> Top2Routing:
    """GShard top-2 routing of ``router_logits[G, S, E]`` into experts of ``capacity`` slots.

    See the module docstring for the maths.
    """
    if router_logits.ndim != 3:
        raise ValueError(
            f"router_logits must be [groups, tokens, experts], got shape {router_logits.shape}"
        )
    num_experts = router_logits.shape[-1]
    if num_experts < 2:
        raise ValueError(f"top-2 gating needs at least 2 experts, got {num_experts}")
    check_positive(capacity=capacity)

    gates = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [G, S, E]
    mask_1 = jax.nn.one_hot(jnp.argmax(gates, axis=-1), num_experts, dtype=jnp.float32)
    gates_without_1 = jnp.where(mask_1 > 0, -jnp.inf, gates)
    mask_2 = jax.nn.one_hot(jnp.argmax(gates_without_1, axis=-1), num_experts, dtype=jnp.float32)

    density = jnp.mean(mask_1, axis=1)  # [G, E], before any token is dropped
    density_proxy = jnp.mean(gates, axis=1)
    aux_loss = jnp.mean(jnp.sum(density * density_proxy, axis=-1)) * num_experts

    # Slot of each token in its expert: an exclusive running count over the tokens of a group.
    slot_1 = jnp.cumsum(mask_1, axis=1) - mask_1
    mask_1 = mask_1 * (slot_1 < capacity)
    kept_1 = jnp.sum(mask_1, axis=1, keepdims=True)  # [G, 1, E]
    slot_2 = jnp.cumsum(mask_2, axis=1) - mask_2 + kept_1
    mask_2 = mask_2 * (slot_2 < capacity)

    gate_1 = jnp.sum(gates * mask_1, axis=-1)  # [G, S]; 0 when dropped
    gate_2 = jnp.sum(gates * mask_2, axis=-1)
    if normalize_gates:
        denom = jnp.maximum(gate_1 + gate_2, jnp.finfo(jnp.float32).eps)
        gate_1, gate_2 = gate_1 / denom, gate_2 / denom

    def slots(mask: jax.Array, slot: jax.Array) -> jax.Array:
        """``[G, S, E, C]`` one-hot of each kept token's (expert, slot)."""
        slot_of_token = jnp.sum(slot * mask, axis=-1).astype(jnp.int32)  # [G, S]
        return mask[..., None] * jax.nn.one_hot(slot_of_token, capacity)[:, :, None, :]

    dispatch_1, dispatch_2 = slots(mask_1, slot_1), slots(mask_2, slot_2)
    combine = gate_1[..., None, None] * dispatch_1 + gate_2[..., None, None] * dispatch_2
    return Top2Routing(combine, (dispatch_1 + dispatch_2) > 0, aux_loss)


# ---------------------------------------------------------------------------------------------
# The MoE layer
# ---------------------------------------------------------------------------------------------


class MoELayer(nn.Module):
    """A top-2 mixture of ``num_experts`` GELU MLPs over ``x[batch, seq, hidden]``.

    Returns ``(y, aux_loss)``, ``y`` of the shape of ``x``. ``expert_group_size`` is the number
    of tokens routed together (``S``); ``None`` routes each sequence as one group.
    """

    num_experts: int
    intermediate_size: int
    capacity_factor: float = 1.0
    expert_group_size: int | None = None
    normalize_gates: bool = False
    dtype: DType = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        batch, seq_len, hidden = x.shape
        group_size = seq_len if self.expert_group_size is None else self.expert_group_size
        if (batch * seq_len) % group_size:
            raise ValueError(
                f"expert_group_size={group_size} does not divide the {batch * seq_len} tokens "
                f"of a [{batch}, {seq_len}] batch"
            )
        tokens = x.reshape(-1, group_size, hidden)  # [G, S, H]

        router = nn.Dense(
            self.num_experts,
            use_bias=False,
            dtype=jnp.float32,
            kernel_init=nn.initializers.normal(INIT_STD),
            name="router",
        )
        capacity = expert_capacity(group_size, self.num_experts, self.capacity_factor)
        routing = top2_gating(router(tokens.astype(jnp.float32)), capacity, self.normalize_gates)

        init = nn.initializers.normal(INIT_STD)
        wi = self.param("wi", init, (self.num_experts, hidden, self.intermediate_size))
        wo = self.param("wo", init, (self.num_experts, self.intermediate_size, hidden))
        wi, wo = wi.astype(self.dtype), wo.astype(self.dtype)

        expert_in = jnp.einsum("gsec,gsh->egch", routing.dispatch.astype(self.dtype), tokens)
        h = nn.gelu(jnp.einsum("egch,ehf->egcf", expert_in, wi))
        expert_out = jnp.einsum("egcf,efh->egch", h, wo)
        y = jnp.einsum("gsec,egch->gsh", routing.combine.astype(self.dtype), expert_out)
        return y.reshape(batch, seq_len, hidden), routing.aux_loss


# ---------------------------------------------------------------------------------------------
# A small MoE language model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEConfig:
    """Sizes of an MoE language model: a GPT whose odd-numbered blocks use an MoE MLP.

    ``intermediate_size`` (of the dense MLPs and of every expert) defaults to ``4 *
    hidden_size``; ``aux_loss_weight`` scales the sum of the MoE layers' balancing losses in
    the training loss.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_experts: int
    intermediate_size: int | None = None
    capacity_factor: float = 1.0
    expert_group_size: int | None = None
    normalize_gates: bool = False
    aux_loss_weight: float = 0.01
    seq_len: int = 1024
    vocab_size: int = 32000
    tie_word_embeddings: bool = True
    dtype: DType = jnp.float32
    add_manual_pipeline_markers: bool = False
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        check_positive(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            capacity_factor=self.capacity_factor,
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
        )
        if self.num_experts < 2:
            raise ValueError(f"num_experts must be at least 2, got {self.num_experts!r}")
        for name in ("intermediate_size", "expert_group_size"):
            if getattr(self, name) is not None:
                check_positive(**{name: getattr(self, name)})
        if self.aux_loss_weight < 0:
            raise ValueError(f"aux_loss_weight must be >= 0, got {self.aux_loss_weight!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )

    @property
    def ffn_size(self) -> int:
        """The width of the hidden layer of the dense MLPs and of each expert."""
        return self.intermediate_size or 4 * self.hidden_size

    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has an MoE MLP: every other block, from block 1."""
        return index % 2 == 1


class FlaxMoEBlock(nn.Module):
    """A pre-LN causal decoder block whose MLP is dense or a mixture of experts."""

    config: MoEConfig
    use_moe: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Returns ``(x', aux_loss)``; ``aux_loss`` is 0 for a dense block."""
        cfg = self.config
        h = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype, name="ln_1")(x)
        x = x + MultiHeadAttention(cfg.num_heads, causal=True, dtype=cfg.dtype, name="attn")(h)
        h = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype, name="ln_2")(x)
        if not self.use_moe:
            return x + FeedForward(cfg.ffn_size, dtype=cfg.dtype, name="mlp")(h), jnp.zeros(())
        moe = MoELayer(
            num_experts=cfg.num_experts,
            intermediate_size=cfg.ffn_size,
            capacity_factor=cfg.capacity_factor,
            expert_group_size=cfg.expert_group_size,
            normalize_gates=cfg.normalize_gates,
            dtype=cfg.dtype,
            name="moe",
        )
        y, aux_loss = moe(h)
        return x + y, aux_loss


class FlaxMoEForLMModule(nn.Module):
    """MoE language model: ``input_ids[batch, seq] -> (logits[batch, seq, vocab], aux_loss)``.

    ``aux_loss`` is the sum of the balancing losses of the MoE blocks.
    """

    config: MoEConfig

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        position_ids: jax.Array | None = None,
        deterministic: bool = True,
    ) -> tuple[jax.Array, jax.Array]:
        del deterministic  # no dropout
        cfg = self.config
        x, wte = embed_tokens(
            input_ids, position_ids, cfg.vocab_size, cfg.seq_len, cfg.hidden_size, cfg.dtype
        )

        aux_loss = jnp.zeros((), jnp.float32)
        for i in range(cfg.num_layers):
            x, block_aux = FlaxMoEBlock(cfg, cfg.is_moe_block(i), name=f"block_{i}")(x)
            aux_loss = aux_loss + block_aux
            if cfg.add_manual_pipeline_markers and i < cfg.num_layers - 1:
                mark_pipeline_boundary()

        x = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype, name="ln_f")(x)
        logits = lm_head(x, wte, cfg.tie_word_embeddings, cfg.vocab_size, cfg.dtype)
        return logits, aux_loss


def get_moe_train_state_and_step(
    config: MoEConfig,
    batch_size: int,
    optimizer: OptimizerName = "adamw",
    learning_rate: float = 1e-3,
    seed: int = 0,
    grad_func: GradFunc = jax.value_and_grad,
    abstract: bool = False,
) -> tuple[TrainState, dict[str, Any], Callable[..., Any]]:
    """``(state, batch, train_step)`` for next-token prediction on random tokens.

    The batch is that of :func:`alpa.model.gpt.get_gpt_train_state_and_step`. The loss is the
    token cross-entropy plus ``config.aux_loss_weight`` times the balancing loss.
    """
    check_positive(batch_size=batch_size)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, (batch_size, config.seq_len + 1), dtype=np.int32)
    positions = np.broadcast_to(np.arange(config.seq_len, dtype=np.int32), tokens[:, 1:].shape)
    batch = make_batch(
        {"input_ids": tokens[:, :-1], "position_ids": positions, "labels": tokens[:, 1:]},
        abstract,
    )
    model = FlaxMoEForLMModule(config)
    tx = make_optimizer(optimizer, learning_rate)
    state = create_train_state(
        model, (batch["input_ids"], batch["position_ids"]), tx, seed, abstract
    )

    def loss_fn(params: PyTree, state: TrainState, batch: Mapping[str, jax.Array]) -> jax.Array:
        logits, aux_loss = state.apply_fn(
            {"params": params}, batch["input_ids"], batch["position_ids"]
        )
        lm_loss = softmax_cross_entropy(logits, batch["labels"])
        return lm_loss + config.aux_loss_weight * aux_loss

    return state, batch, make_train_step(loss_fn, grad_func)
