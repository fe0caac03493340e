r"""Wide ResNet (Zagoruyko & Komodakis, 2016): a ResNet whose convolutions are ``width_factor``
times wider, with batch normalization.

Stage :math:`i` (0-based) has ``stage_sizes[i]`` residual blocks at base width
:math:`F_i = \text{num\_filters} \cdot 2^i`; its first block halves the spatial size (except in
stage 0). A block computes :math:`\mathrm{relu}(\mathrm{shortcut}(x) + f(x))` with

* ``"basic"``: :math:`f` = conv3x3(:math:`wF_i`) → BN → relu → conv3x3(:math:`wF_i`) → BN;
* ``"bottleneck"``: :math:`f` = conv1x1(:math:`wF_i`) → BN → relu → conv3x3(:math:`wF_i`) →
  BN → relu → conv1x1(:math:`4F_i`) → BN,

where :math:`w` is ``width_factor`` and the shortcut is a 1x1 convolution + BN when the shape
changes, the identity otherwise. The stem is conv3x3 (small images) or conv7x7/2 + max-pool
(``imagenet_stem``); the head is a global average pool and a Dense layer.

Batch normalization normalizes with the batch's statistics in training
(``train=True``; the running averages in the ``batch_stats`` collection are then updated, so
``apply`` must be called with ``mutable=["batch_stats"]``) and with the running averages
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from alpa.model.model_util import (
    DType,
    DummyInit,
    GradFunc,
    OptimizerName,
    PyTree,
    TrainState,
    check_positive,
    create_train_state,
    make_batch,
    make_optimizer,
    softmax_cross_entropy,
)

BlockKind = Literal["basic", "bottleneck"]
BLOCK_KINDS: tuple[str, ...] = ("basic", "bottleneck")


class _ResidualBlock(nn.Module):
    """One residual block of base width ``filters`` (see the module docstring)."""

    filters: int
    width_factor: int
    strides: int
    block: BlockKind
    train: bool
    dtype: DType

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        conv = partial(nn.Conv, use_bias=False, padding="SAME", dtype=self.dtype)
        norm = partial(
            nn.BatchNorm,
            use_running_average=not self.train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
        )
        width = self.filters * self.width_factor
        strides = (self.strides, self.strides)
        if self.block == "basic":
            out_features = width
            y = nn.relu(norm()(conv(width, (3, 3), strides)(x)))
            y = norm()(conv(width, (3, 3))(y))
        else:
            out_features = 4 * self.filters
            y = nn.relu(norm()(conv(width, (1, 1))(x)))
            y = nn.relu(norm()(conv(width, (3, 3), strides)(y)))
            y = norm()(conv(out_features, (1, 1))(y))
        if x.shape[-1] != out_features or self.strides != 1:
            x = norm(name="shortcut_bn")(conv(out_features, (1, 1), strides, name="shortcut")(x))
        return nn.relu(x + y)


class WResNet(DummyInit, nn.Module):
    """Wide ResNet classifier: ``images[batch, height, width, 3] -> logits[batch, classes]``."""

    stage_sizes: tuple[int, ...]
    num_filters: int
    width_factor: int
    num_classes: int
    block: BlockKind = "basic"
    imagenet_stem: bool = False
    dtype: DType = jnp.float32

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = True) -> jax.Array:
        if self.block not in BLOCK_KINDS:
            raise ValueError(f"block must be one of {BLOCK_KINDS}, got {self.block!r}")
        if images.ndim != 4:
            raise ValueError(f"images must be [batch, height, width, channels], got {images.shape}")
        x = images.astype(self.dtype)
        stem_kernel, stem_strides = ((7, 7), (2, 2)) if self.imagenet_stem else ((3, 3), (1, 1))
        x = nn.Conv(
            self.num_filters,
            stem_kernel,
            stem_strides,
            padding="SAME",
            use_bias=False,
            dtype=self.dtype,
            name="stem",
        )(x)
        x = nn.BatchNorm(
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            name="stem_bn",
        )(x)
        x = nn.relu(x)
        if self.imagenet_stem:
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, num_blocks in enumerate(self.stage_sizes):
            for j in range(num_blocks):
                x = _ResidualBlock(
                    filters=self.num_filters * 2**i,
                    width_factor=self.width_factor,
                    strides=2 if i > 0 and j == 0 else 1,
                    block=self.block,
                    train=train,
                    dtype=self.dtype,
                    name=f"stage{i}_block{j}",
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=jnp.float32, name="head")(x)


@dataclass(frozen=True)
class WResNetConfig:
    """A :class:`WResNet` and the square ``image_size`` it is trained on."""

    stage_sizes: tuple[int, ...]
    num_filters: int
    width_factor: int
    num_classes: int
    image_size: int
    block: BlockKind = "basic"
    imagenet_stem: bool = False
    dtype: DType = jnp.float32

    def __post_init__(self) -> None:
        if not self.stage_sizes or any(not isinstance(n, int) or n <= 0 for n in self.stage_sizes):
            raise ValueError(
                f"stage_sizes must be a non-empty tuple of positive ints, got {self.stage_sizes!r}"
            )
        check_positive(
            num_filters=self.num_filters,
            width_factor=self.width_factor,
            num_classes=self.num_classes,
            image_size=self.image_size,
        )
        if self.block not in BLOCK_KINDS:
            raise ValueError(f"block must be one of {BLOCK_KINDS}, got {self.block!r}")

    def make_model(self) -> WResNet:
        return WResNet(
            stage_sizes=tuple(self.stage_sizes),
            num_filters=self.num_filters,
            width_factor=self.width_factor,
            num_classes=self.num_classes,
            block=self.block,
            imagenet_stem=self.imagenet_stem,
            dtype=self.dtype,
        )


#: A tiny model for tests, WRN-28-10 (CIFAR-10, 36.5M parameters) and WRN-50-2 (ImageNet,
#: 68.9M parameters).
WRESNET_PRESETS: dict[str, WResNetConfig] = {
    "tiny": WResNetConfig((1, 1), num_filters=8, width_factor=2, num_classes=10, image_size=16),
    "WRN-28-10": WResNetConfig(
        (4, 4, 4), num_filters=16, width_factor=10, num_classes=10, image_size=32
    ),
    "WRN-50-2": WResNetConfig(
        (3, 4, 6, 3),
        num_filters=64,
        width_factor=2,
        num_classes=1000,
        image_size=224,
        block="bottleneck",
        imagenet_stem=True,
    ),
}


#: Alpa's ``get_wide_resnet`` depths: residual blocks per stage and the kind of block.
WIDE_RESNET_DEPTHS: dict[int, tuple[tuple[int, ...], BlockKind]] = {
    0: ((), "basic"),
    18: ((2, 2, 2, 2), "basic"),
    34: ((3, 4, 6, 3), "basic"),
    50: ((3, 4, 6, 3), "bottleneck"),
    101: ((3, 4, 23, 3), "bottleneck"),
    152: ((3, 8, 36, 3), "bottleneck"),
    200: ((3, 24, 36, 3), "bottleneck"),
}


def get_wide_resnet(
    num_layers: int, width_factor: int, num_filters: int, num_classes: int, dtype: DType
) -> WResNet:
    """Alpa's Wide ResNet factory: the ImageNet-stem :class:`WResNet` of depth
    ``num_layers`` (a key of :data:`WIDE_RESNET_DEPTHS`; 0 is the stem and the head alone),
    computing in ``dtype``. Its ``init_dummy`` is Alpa's; its ``apply(variables, images,
    train=True)`` reads ``images[batch, height, width, 3]``."""
    if num_layers not in WIDE_RESNET_DEPTHS:
        raise ValueError(
            f"num_layers must be one of {sorted(WIDE_RESNET_DEPTHS)}, got {num_layers!r}"
        )
    check_positive(width_factor=width_factor, num_filters=num_filters, num_classes=num_classes)
    stage_sizes, block = WIDE_RESNET_DEPTHS[num_layers]
    return WResNet(
        stage_sizes=stage_sizes,
        num_filters=num_filters,
        width_factor=width_factor,
        num_classes=num_classes,
        block=block,
        imagenet_stem=True,
        dtype=dtype,
    )


def get_wresnet_train_state_and_step(
    config: WResNetConfig,
    batch_size: int,
    optimizer: OptimizerName = "adamw",
    learning_rate: float = 1e-3,
    seed: int = 0,
    grad_func: GradFunc = jax.value_and_grad,
    abstract: bool = False,
) -> tuple[TrainState, dict[str, Any], Callable[..., Any]]:
    """``(state, batch, train_step)`` for classification of random images.

    The batch holds ``images: float32[batch_size, image_size, image_size, 3]`` and
    ``labels: int32[batch_size]``. ``train_step`` runs the model in training mode and returns
    a state whose ``batch_stats`` are the updated running averages; ``grad_func`` is called
    with ``has_aux=True``. See :mod:`alpa.model.model_util` for the other arguments.
    """
    check_positive(batch_size=batch_size)
    rng = np.random.default_rng(seed)
    size = config.image_size
    batch = make_batch(
        {
            "images": rng.standard_normal((batch_size, size, size, 3), dtype=np.float32),
            "labels": rng.integers(0, config.num_classes, (batch_size,), dtype=np.int32),
        },
        abstract,
    )
    model = config.make_model()
    tx = make_optimizer(optimizer, learning_rate)
    state = create_train_state(
        model, (batch["images"],), tx, seed, abstract, init_kwargs={"train": False}
    )

    def loss_fn(
        params: PyTree, state: TrainState, batch: Mapping[str, jax.Array]
    ) -> tuple[jax.Array, PyTree]:
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["images"],
            train=True,
            mutable=["batch_stats"],
        )
        return softmax_cross_entropy(logits, batch["labels"]), updates["batch_stats"]

    def train_step(
        state: TrainState, batch: Mapping[str, jax.Array]
    ) -> tuple[TrainState, jax.Array]:
        grad_fn = grad_func(lambda params: loss_fn(params, state, batch), has_aux=True)
        (loss, batch_stats), grads = grad_fn(state.params)
        return state.apply_gradients(grads=grads, batch_stats=batch_stats), loss

    return state, batch, train_step
