"""Helpers for tests and examples (public API, as in the reference alpa)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def assert_allclose(x: Any, y: Any, rtol: float = 1e-4, atol: float = 1e-4) -> None:
    """Assert two pytrees (dicts, tuples, flax ``TrainState``...) hold the same structure
    of leaves, equal to the tolerances. Static fields (``apply_fn``, ``tx``) are ignored."""
    x_leaves = jax.tree_util.tree_flatten_with_path(x)[0]
    y_leaves = jax.tree_util.tree_flatten_with_path(y)[0]
    x_paths = [jax.tree_util.keystr(p) for p, _ in x_leaves]
    y_paths = [jax.tree_util.keystr(p) for p, _ in y_leaves]
    if x_paths != y_paths:
        raise AssertionError(f"pytrees differ in structure:\n{x_paths}\nvs\n{y_paths}")
    for path, (_, a), (_, b) in zip(x_paths, x_leaves, y_leaves, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            raise AssertionError(f"leaf {path or '<root>'}: shape {a.shape} != {b.shape}")
        np.testing.assert_allclose(
            a.astype(np.float64) if a.dtype.kind == "V" else a,
            b,
            rtol=rtol,
            atol=atol,
            err_msg=f"leaf {path or '<root>'}",
        )


def regression_train_step(grad: Callable = jax.grad) -> Callable:
    """``train_step(state, batch) -> state``: one step of mean-squared-error regression of
    ``state.apply_fn(state.params, batch["x"])`` onto ``batch["y"]``, differentiated with
    ``grad`` (``alpa.grad`` for a parallelized step, ``jax.grad`` for its serial
    reference; ``jax.jit`` runs either)."""

    def train_step(state, batch):
        def loss_fn(params):
            out = state.apply_fn(params, batch["x"])
            return jax.numpy.mean((out - batch["y"]) ** 2)

        return state.apply_gradients(grads=grad(loss_fn)(state.params))

    return train_step


def get_mlp_train_state_and_step(
    batch_size: int,
    hidden_size: int,
    num_layers: int = 4,
    use_bias: bool = True,
    add_manual_pipeline_marker: bool = False,
) -> tuple[Any, dict[str, jax.Array], Callable]:
    """``(state, batch, train_step)`` of an MLP regression trained with Adam.

    ``train_step(state, batch) -> state`` differentiates with ``alpa.grad``, so it works
    with every parallel method, micro-batches included.
    """
    import alpa
    from alpa.model.mlp import MLPModel
    from alpa.model.mlp import get_mlp_train_state_and_step as make

    model = MLPModel(
        hidden_size=hidden_size,
        num_layers=num_layers,
        use_bias=use_bias,
        add_manual_pipeline_markers=add_manual_pipeline_marker,
    )
    state, batch, step = make(
        model, batch_size, hidden_size, optimizer="adam", grad_func=alpa.value_and_grad
    )

    def train_step(state, batch):
        new_state, _ = step(state, batch)
        return new_state

    return state, batch, train_step


def unit_cost_mesh(shape: tuple[int, int]):
    """The logical mesh ``shape`` over the first ``shape[0] * shape[1]`` local devices, with
    alpha = beta = 1 on both axes: the cost parameters the closed-form oracles assume."""
    import alpa

    devices = jax.devices()[: shape[0] * shape[1]]
    return alpa.LocalPhysicalDeviceMesh(devices).get_logical_mesh(shape, (1.0, 1.0), (1.0, 1.0))


def run_auto_sharded(step: Callable, state: Any, batch: Any, shape: tuple[int, int], **option):
    """Run ``step(state, batch)`` once with ``ShardParallel`` planned by the auto-sharding ILP
    on :func:`unit_cost_mesh` ``(shape)``; ``option`` holds ``AutoShardingOption`` fields.
    Returns ``(outputs, executable)``. Nothing is donated, so the inputs stay usable for the
    serial reference."""
    import alpa

    method = alpa.ShardParallel(
        devices=unit_cost_mesh(shape), auto_sharding_option=alpa.AutoShardingOption(**option)
    )
    p_step = alpa.parallelize(step, method=method, donate_argnums=())
    out = p_step(state, batch)
    return out, p_step.get_last_executable()
