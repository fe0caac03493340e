r"""A multi-layer perceptron: the smallest model on which every parallel plan can be judged.

``MLPModel`` applies ``num_layers`` hidden layers :math:`x \mapsto \mathrm{relu}(xW_i + b_i)`
of width ``hidden_size`` and then, if ``output_dim`` is given, a linear output layer
:math:`x \mapsto xW_o + b_o`. In Megatron-style model parallelism the kernels alternate
column and row splits, so an L-layer MLP needs L−1 forward all-reduces: the closed-form oracle
the sharding tests use.

With ``add_manual_pipeline_markers=True`` a pipeline boundary is marked between every two
consecutive layers (none after the last), for ``ManualLayerOption``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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
)


class MLPModel(nn.Module):
    """``num_layers`` Dense+relu layers of width ``hidden_size``, then an optional linear head."""

    hidden_size: int
    num_layers: int
    output_dim: int | None = None
    use_bias: bool = True
    add_manual_pipeline_markers: bool = False
    dtype: DType = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        check_positive(hidden_size=self.hidden_size, num_layers=self.num_layers)
        for i in range(self.num_layers):
            if i > 0 and self.add_manual_pipeline_markers:
                mark_pipeline_boundary()
            x = nn.Dense(self.hidden_size, use_bias=self.use_bias, dtype=self.dtype)(x)
            x = nn.relu(x)
        if self.output_dim is not None:
            if self.add_manual_pipeline_markers:
                mark_pipeline_boundary()
            x = nn.Dense(self.output_dim, use_bias=self.use_bias, dtype=self.dtype)(x)
        return x


def get_mlp_train_state_and_step(
    model: MLPModel,
    batch_size: int,
    input_dim: int,
    optimizer: OptimizerName = "adam",
    learning_rate: float = 1e-3,
    seed: int = 0,
    grad_func: GradFunc = jax.value_and_grad,
    abstract: bool = False,
) -> tuple[TrainState, dict[str, Any], Callable[..., Any]]:
    r"""``(state, batch, train_step)`` for regression of ``model`` onto random targets.

    The loss is the mean squared error :math:`\frac{1}{N}\sum (f(x) - y)^2`. The batch holds
    ``"x": [batch_size, input_dim]`` and ``"y"`` of the model's output shape. See
    :mod:`alpa.model.model_util` for the meaning of the other arguments.
    """
    check_positive(batch_size=batch_size, input_dim=input_dim)
    out_dim = model.output_dim if model.output_dim is not None else model.hidden_size
    rng = np.random.default_rng(seed)
    batch = make_batch(
        {
            "x": rng.standard_normal((batch_size, input_dim), dtype=np.float32),
            "y": rng.standard_normal((batch_size, out_dim), dtype=np.float32),
        },
        abstract,
    )
    tx = make_optimizer(optimizer, learning_rate)
    state = create_train_state(model, (batch["x"],), tx, seed, abstract)

    def loss_fn(params: PyTree, state: TrainState, batch: Mapping[str, jax.Array]) -> jax.Array:
        out = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)

    return state, batch, make_train_step(loss_fn, grad_func)
