r"""A conditional 2-D UNet (latent diffusion's denoiser), at Alpa's path ``alpa.model.unet_2d``.

``get_unet_2d(sample_size, down_block_types, up_block_types, block_out_channels, ...)``
builds the model of Alpa's UNet benchmark; it is called as
``apply(params, sample, timesteps, encoder_hidden_states)`` with ``sample[batch, C, H, W]``
(channels first, as Alpa's), the diffusion step ``timesteps`` (an int, or one per row) and
the conditioning sequence ``encoder_hidden_states[batch, seq, dim]``, and returns a
``FlaxUNet2DConditionOutput`` whose ``sample`` has the input's shape with
``out_channels`` channels.

The network (Ronneberger et al. 2015; Rombach et al. 2022), with :math:`c_i` the
``block_out_channels``:

* **time**: the sinusoidal embedding of the step, :math:`e_k = \sin(t\,\omega_k)` and
  :math:`\cos(t\,\omega_k)` with :math:`\omega_k = 10000^{-k/(c_0/2 - \text{freq\_shift})}`,
  then ``Dense(4 c_0) -> SiLU -> Dense(4 c_0)``;
* ``conv_in`` (3x3, :math:`c_0` channels);
* **down blocks**: block :math:`i` holds ``layers_per_block`` residual units at
  :math:`c_i` channels, then a stride-2 3x3 convolution (all but the last block). A unit is
  a residual block (GroupNorm -> SiLU -> conv3x3, plus the projected time embedding,
  GroupNorm -> SiLU -> conv3x3, with a 1x1 projection of the shortcut when the channels
  change), followed in a ``"CrossAttnDownBlock2D"`` by a spatial transformer. Every unit's
  output is kept for the skip connections;
* **middle**: residual block, spatial transformer, residual block at :math:`c_{-1}`;
* **up blocks** (channels reversed): ``layers_per_block + 1`` units, each reading the
  concatenation of its input and the last kept skip output, then a nearest-neighbour 2x
  upsampling and a 3x3 convolution (all but the last block);
* GroupNorm -> SiLU -> ``conv_out`` (3x3, ``out_channels``).

A spatial transformer is GroupNorm, a 1x1 convolution, then over the :math:`HW` positions
pre-LN self-attention, cross-attention to ``encoder_hidden_states`` and a GEGLU feed-forward
(:math:`W_2 (a \odot \mathrm{GELU}(b))`, :math:`[a, b] = W_1 x` of width :math:`2 \cdot 4c`),
each with a residual, then a 1x1 convolution and the block's residual. Attention has
``num_attention_heads`` heads of :math:`c / \text{heads}` dimensions
(:func:`alpa.model.layers.dot_product_attention`).

With ``add_manual_pipeline_markers`` (the default, as Alpa's) a pipeline boundary follows
``conv_in``, every unit, every down- and upsampling and the middle's two halves. There is no
dropout: ``dropout`` must be 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from alpa.model.layers import dot_product_attention
from alpa.model.model_output import ModelOutput
from alpa.model.model_util import DType, TrainState, check_positive  # noqa: F401
from alpa.model.train_state import DummyInit
from alpa.tracing.primitive_def import mark_pipeline_boundary

DOWN_BLOCK_TYPES = ("DownBlock2D", "CrossAttnDownBlock2D")
UP_BLOCK_TYPES = ("UpBlock2D", "CrossAttnUpBlock2D")


@dataclass(frozen=True)
class UNet2DConfig:
    """The sizes of :class:`FlaxUNet2DConditionModel` besides its blocks' channels."""

    sample_size: int
    in_channels: int = 4
    out_channels: int = 4
    layers_per_block: int = 2
    num_attention_heads: int = 8
    freq_shift: float = 0
    num_groups: int = 4
    add_manual_pipeline_markers: bool = True

    def __post_init__(self) -> None:
        check_positive(
            sample_size=self.sample_size,
            in_channels=self.in_channels,
            out_channels=self.out_channels,
            layers_per_block=self.layers_per_block,
            num_attention_heads=self.num_attention_heads,
            num_groups=self.num_groups,
        )


@flax.struct.dataclass
class FlaxUNet2DConditionOutput(ModelOutput):
    """The denoised ``sample[batch, out_channels, height, width]``."""

    sample: Any = None


def timestep_embedding(timesteps: jax.Array, dim: int, freq_shift: float) -> jax.Array:
    """``[batch] -> [batch, dim]``: the sines then the cosines of the module docstring."""
    half = dim // 2
    frequencies = jnp.exp(-math.log(10000.0) * jnp.arange(half) / (half - freq_shift))
    angles = timesteps.astype(jnp.float32)[:, None] * frequencies[None, :]
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class ResnetBlock2D(nn.Module):
    """A residual block at ``out_channels`` with the time embedding added in the middle."""

    out_channels: int
    num_groups: int
    dtype: DType = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, temb: jax.Array) -> jax.Array:
        conv = lambda name: nn.Conv(self.out_channels, (3, 3), dtype=self.dtype, name=name)  # noqa: E731
        h = conv("conv1")(nn.silu(nn.GroupNorm(self.num_groups, name="norm1")(x)))
        h = (
            h
            + nn.Dense(self.out_channels, dtype=self.dtype, name="time_emb_proj")(nn.silu(temb))[
                :, None, None, :
            ]
        )
        h = conv("conv2")(nn.silu(nn.GroupNorm(self.num_groups, name="norm2")(h)))
        if x.shape[-1] != self.out_channels:
            x = nn.Conv(self.out_channels, (1, 1), dtype=self.dtype, name="conv_shortcut")(x)
        return x + h


class Attention(nn.Module):
    """Multi-head attention of ``x[batch, q, c]`` to ``context[batch, k, d]`` (itself when
    ``None``), no biases on the projections."""

    num_heads: int
    dtype: DType = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array | None = None) -> jax.Array:
        context = x if context is None else context
        channels = x.shape[-1]
        proj = lambda name, y: nn.Dense(channels, False, self.dtype, name=name)(y)  # noqa: E731

        def heads(y: jax.Array) -> jax.Array:
            return y.reshape(*y.shape[:2], self.num_heads, channels // self.num_heads)

        out = dot_product_attention(
            heads(proj("to_q", x)), heads(proj("to_k", context)), heads(proj("to_v", context))
        )
        return nn.Dense(channels, dtype=self.dtype, name="to_out")(out.reshape(x.shape))


class SpatialTransformer(nn.Module):
    """Self-attention, cross-attention and a GEGLU feed-forward over the positions of
    ``x[batch, h, w, c]`` (see the module docstring)."""

    num_heads: int
    num_groups: int
    dtype: DType = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array) -> jax.Array:
        batch, height, width, channels = x.shape
        norm = lambda name: nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name=name)  # noqa: E731
        h = nn.GroupNorm(self.num_groups, name="norm")(x)
        h = nn.Conv(channels, (1, 1), dtype=self.dtype, name="proj_in")(h)
        h = h.reshape(batch, height * width, channels)
        h = h + Attention(self.num_heads, self.dtype, name="attn1")(norm("norm1")(h))
        h = h + Attention(self.num_heads, self.dtype, name="attn2")(norm("norm2")(h), context)
        a, b = jnp.split(
            nn.Dense(8 * channels, dtype=self.dtype, name="ff_in")(norm("norm3")(h)), 2, -1
        )
        h = h + nn.Dense(channels, dtype=self.dtype, name="ff_out")(a * nn.gelu(b))
        h = nn.Conv(channels, (1, 1), dtype=self.dtype, name="proj_out")(
            h.reshape(batch, height, width, channels)
        )
        return x + h


class FlaxUNet2DConditionModel(DummyInit, nn.Module):
    """The conditional UNet of the module docstring."""

    config: UNet2DConfig
    down_block_types: tuple[str, ...]
    up_block_types: tuple[str, ...]
    block_out_channels: tuple[int, ...]
    dtype: DType = jnp.float32

    def _marker(self) -> None:
        if self.config.add_manual_pipeline_markers:
            mark_pipeline_boundary()

    def _unit(self, name: str, channels: int, attention: bool, x, temb, context) -> jax.Array:
        cfg = self.config
        x = ResnetBlock2D(channels, cfg.num_groups, self.dtype, name=f"{name}_resnet")(x, temb)
        if attention:
            heads = cfg.num_attention_heads
            transformer = SpatialTransformer(heads, cfg.num_groups, self.dtype, name=f"{name}_attn")
            x = transformer(x, context)
        self._marker()
        return x

    @nn.compact
    def __call__(
        self,
        sample: jax.Array,
        timesteps: Any,
        encoder_hidden_states: jax.Array,
        return_dict: bool = True,
        train: bool = False,
    ) -> Any:
        cfg, channels = self.config, self.block_out_channels
        batch = sample.shape[0]
        timesteps = jnp.broadcast_to(jnp.asarray(timesteps).reshape(-1), (batch,))
        temb = timestep_embedding(timesteps, channels[0], cfg.freq_shift)
        temb = nn.Dense(4 * channels[0], dtype=self.dtype, name="time_linear_1")(temb)
        temb = nn.Dense(4 * channels[0], dtype=self.dtype, name="time_linear_2")(nn.silu(temb))
        ctx = encoder_hidden_states

        x = jnp.transpose(sample, (0, 2, 3, 1)).astype(self.dtype)  # NCHW -> NHWC
        x = nn.Conv(channels[0], (3, 3), dtype=self.dtype, name="conv_in")(x)
        self._marker()
        skips = [x]
        for i, (kind, c) in enumerate(zip(self.down_block_types, channels, strict=True)):
            for j in range(cfg.layers_per_block):
                x = self._unit(f"down{i}_{j}", c, kind == "CrossAttnDownBlock2D", x, temb, ctx)
                skips.append(x)
            if i < len(channels) - 1:
                x = nn.Conv(c, (3, 3), (2, 2), dtype=self.dtype, name=f"down{i}_sample")(x)
                self._marker()
                skips.append(x)
        x = self._unit("mid_0", channels[-1], True, x, temb, ctx)
        x = self._unit("mid_1", channels[-1], False, x, temb, ctx)
        for i, (kind, c) in enumerate(zip(self.up_block_types, channels[::-1], strict=True)):
            for j in range(cfg.layers_per_block + 1):
                x = jnp.concatenate([x, skips.pop()], axis=-1)
                x = self._unit(f"up{i}_{j}", c, kind == "CrossAttnUpBlock2D", x, temb, ctx)
            if i < len(channels) - 1:
                b, h, w, _ = x.shape
                x = jax.image.resize(x, (b, 2 * h, 2 * w, c), method="nearest")
                x = nn.Conv(c, (3, 3), dtype=self.dtype, name=f"up{i}_sample")(x)
        x = nn.silu(nn.GroupNorm(cfg.num_groups, name="conv_norm_out")(x))
        x = nn.Conv(cfg.out_channels, (3, 3), dtype=self.dtype, name="conv_out")(x)
        out = jnp.transpose(x, (0, 3, 1, 2))
        return FlaxUNet2DConditionOutput(sample=out) if return_dict else (out,)


def get_unet_2d(
    sample_size: int,
    down_block_types: Sequence[str],
    up_block_types: Sequence[str],
    block_out_channels: Sequence[int],
    in_channels: int = 4,
    out_channels: int = 4,
    dropout: float = 0.0,
    layers_per_block: int = 2,
    num_attention_heads: int = 8,
    freq_shift: float = 0,
    num_groups: int = 4,
    dtype: DType = jnp.float32,
    add_manual_pipeline_markers: bool = True,
) -> FlaxUNet2DConditionModel:
    """Alpa's UNet factory (see the module docstring); the arguments are Alpa's."""
    if dropout:
        raise NotImplementedError(f"dropout={dropout!r}: alpa.model's UNet has no dropout")
    channels = tuple(block_out_channels)
    counts = (len(down_block_types), len(up_block_types), len(channels))
    if len(set(counts)) != 1 or not channels:
        raise ValueError(
            f"down_block_types, up_block_types and block_out_channels need one entry per "
            f"block, got {counts[0]}, {counts[1]} and {counts[2]}"
        )
    for name, kinds, known in (
        ("down_block_types", down_block_types, DOWN_BLOCK_TYPES),
        ("up_block_types", up_block_types, UP_BLOCK_TYPES),
    ):
        if any(k not in known for k in kinds):
            raise ValueError(f"{name} must hold {known}, got {tuple(kinds)}")
    for c in channels:
        if c % num_groups or c % num_attention_heads:
            raise ValueError(
                f"block_out_channels {channels}: each must be divisible by num_groups="
                f"{num_groups} and num_attention_heads={num_attention_heads}"
            )
    config = UNet2DConfig(
        sample_size=sample_size,
        in_channels=in_channels,
        out_channels=out_channels,
        layers_per_block=layers_per_block,
        num_attention_heads=num_attention_heads,
        freq_shift=freq_shift,
        num_groups=num_groups,
        add_manual_pipeline_markers=add_manual_pipeline_markers,
    )
    return FlaxUNet2DConditionModel(
        config, tuple(down_block_types), tuple(up_block_types), channels, dtype
    )
