"""What every model of ``alpa.model`` shares: a train state, optimizers, the loss, train steps.

The models of this package exist so that tests, examples and benchmarks train the same
networks. Each model module offers a factory ``get_<model>_train_state_and_step`` that returns
``(state, batch, train_step)``:

* ``state`` is a :class:`TrainState` (parameters, optimizer state and, for models with batch
  normalization, ``batch_stats``);
* ``batch`` is a dict of synthetic arrays with fixed shapes;
* ``train_step(state, batch) -> (new_state, loss)`` is a plain Python function, neither jitted
  nor parallelized, so a caller wraps it in ``jax.jit`` or ``alpa.parallelize``.

The gradient is taken by ``grad_func`` (``jax.value_and_grad`` by default); a caller that
parallelizes with pipelining passes ``alpa.value_and_grad`` so that the boundary between the
compute-grad and apply-grad parts is marked.

With ``abstract=True`` a factory returns ``jax.ShapeDtypeStruct`` pytrees instead of arrays,
computed with ``jax.eval_shape``: a 1.3B-parameter model can then be planned without
allocating its weights.

This module holds the pieces those factories have in common; it knows no model. It is
also Alpa's path of its train state (``TrainState``, ``DynamicScale``: ``train_state.py``)
and model outputs (``ModelOutput``: ``model_output.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

# Alpa's names at Alpa's path (alpa.model.model_util), re-exported:
from alpa.model.model_output import (  # noqa: F401
    FlaxBaseModelOutput,
    FlaxBaseModelOutputWithPooling,
    FlaxBertForPreTrainingOutput,
    FlaxMaskedLMOutput,
    FlaxSequenceClassifierOutput,
    ModelOutput,
)
from alpa.model.train_state import DummyInit, DynamicScale, TrainState, init_dummy  # noqa: F401
from alpa.tracing.primitive_def import mark_pipeline_boundary  # noqa: F401 (re-exported)

#: A numpy/jax dtype or scalar type such as ``jnp.float32`` or ``jnp.bfloat16``.
DType = Any
#: A pytree of arrays, or of ``jax.ShapeDtypeStruct`` when built abstractly.
PyTree = Any
#: ``grad_func(fun, **kwargs)(params) -> (value, grads)``: ``jax.value_and_grad`` or
#: ``alpa.value_and_grad``.
GradFunc = Callable[..., Callable[..., Any]]

#: XLA options for a program that runs once: skip the backend's (LLVM's) optimizations.
_RUN_ONCE_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}

OptimizerName = Literal["adamw", "adam", "sgd"]
OPTIMIZER_NAMES: tuple[str, ...] = ("adamw", "adam", "sgd")


def make_optimizer(name: OptimizerName, learning_rate: float) -> optax.GradientTransformation:
    """The optax optimizer called ``name``.

    * ``"adamw"``: Adam with decoupled weight decay 0.01 (the GPT/BERT benchmarks' choice);
    * ``"adam"``: Adam, no weight decay;
    * ``"sgd"``: SGD with momentum 0.9 (the Wide-ResNet benchmark's choice).
    """
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"optimizer must be one of {OPTIMIZER_NAMES}, got {name!r}")
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be positive, got {learning_rate!r}")
    if name == "adamw":
        return optax.adamw(learning_rate, weight_decay=0.01)
    if name == "adam":
        return optax.adam(learning_rate)
    return optax.sgd(learning_rate, momentum=0.9)


def softmax_cross_entropy(
    logits: jax.Array, labels: jax.Array, weights: jax.Array | None = None
) -> jax.Array:
    r"""Mean cross-entropy of integer ``labels`` under ``logits``.

    For logits :math:`z \in \mathbb{R}^{\ldots \times V}` and labels :math:`y`,

    .. math::
        \ell = -\frac{\sum_i w_i \, \log \operatorname{softmax}(z_i)_{y_i}}{\sum_i w_i},

    with :math:`w_i = 1` when ``weights`` is ``None``. The log-softmax is computed in float32
    whatever the dtype of ``logits``. The label's log-probability is picked with a one-hot
    product and a sum (elementwise ops and a reduction) rather than a gather, which the
    sharding pass splits along the vocabulary like any matrix.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels of shape {labels.shape} do not match logits of shape {logits.shape}: "
            "expected labels.shape == logits.shape[:-1]"
        )
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    one_hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32)
    token_loss = -jnp.sum(one_hot * log_probs, axis=-1)
    if weights is None:
        return jnp.mean(token_loss)
    weights = weights.astype(jnp.float32)
    return jnp.sum(token_loss * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def count_params(params: PyTree) -> int:
    """The number of scalars in a pytree of arrays or ``jax.ShapeDtypeStruct``."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params))


def init_key(seed: int) -> jax.Array:
    """The PRNG key that initializes parameters.

    It uses JAX's ``rbg`` generator rather than the default threefry: XLA's CPU compiler
    takes seconds per distinct parameter shape to compile threefry (measured here: ~2-4 s
    for one ``[3, 3, 16, 16]`` normal), which dominated the set-up time of small models.
    Initial values only need to be reproducible for a fixed seed, backend and JAX version.
    """
    return jax.random.key(seed, impl="rbg")


def create_train_state(
    model: nn.Module,
    init_args: tuple[Any, ...],
    tx: optax.GradientTransformation,
    seed: int,
    abstract: bool,
    init_kwargs: Mapping[str, Any] | None = None,
) -> TrainState:
    """Initialize ``model`` on ``init_args`` and wrap its variables in a :class:`TrainState`.

    ``init_args`` may be arrays or ``jax.ShapeDtypeStruct``. With ``abstract=True`` nothing is
    allocated: the state's leaves are ``jax.ShapeDtypeStruct``.
    """
    init_kwargs = dict(init_kwargs or {})

    def init(rng: jax.Array, *args: Any) -> TrainState:
        variables = model.init(rng, *args, **init_kwargs)
        return TrainState.create(
            apply_fn=model.apply,
            params=variables["params"],
            tx=tx,
            batch_stats=variables.get("batch_stats"),
        )

    if abstract:  # the key too is only traced: no device is touched
        return jax.eval_shape(lambda *args: init(init_key(seed), *args), *init_args)
    rng = init_key(seed)
    # Initialization runs once, and on CPU compiling its random-number code with full LLVM
    # optimization costs more than running it unoptimized.
    options = _RUN_ONCE_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None
    return jax.jit(init, compiler_options=options)(rng, *init_args)


def make_batch(arrays: Mapping[str, np.ndarray], abstract: bool) -> dict[str, Any]:
    """Device arrays, or their ``jax.ShapeDtypeStruct`` when ``abstract``."""
    if abstract:
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in arrays.items()}
    return {k: jnp.asarray(v) for k, v in arrays.items()}


def make_train_step(
    loss_fn: Callable[[PyTree, TrainState, Mapping[str, jax.Array]], jax.Array],
    grad_func: GradFunc,
) -> Callable[[TrainState, Mapping[str, jax.Array]], tuple[TrainState, jax.Array]]:
    """A train step that differentiates ``loss_fn(params, state, batch)`` w.r.t. ``params``."""

    def train_step(
        state: TrainState, batch: Mapping[str, jax.Array]
    ) -> tuple[TrainState, jax.Array]:
        loss, grads = grad_func(lambda params: loss_fn(params, state, batch))(state.params)
        return state.apply_gradients(grads=grads), loss

    return train_step


def check_positive(**values: int | float) -> None:
    """Raise ``ValueError`` naming the first argument that is not a positive number."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
