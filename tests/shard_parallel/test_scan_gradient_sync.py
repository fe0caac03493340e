"""Weight gradients made inside a loop are reduced once per step.

The backward pass of a scanned stack is a transposed ``scan`` whose body computes each
layer's weight gradient, a sum over the batch's rows, and returns it as one row of a
stacked output. Left to XLA, that sum is all-reduced inside the loop: once per layer, and
with micro-batches once per layer and micro-batch. ``row_sums.deferrable`` follows row
sums through a scan's stacked outputs and a checkpoint's outputs, so they reach the
``alpa.grad`` marker as per-device partial sums and are reduced after every loop, as the
unrolled stack's are.

Oracles, on the 8 virtual CPU devices: the compiled program's collectives (none inside
any loop, as many as for the unrolled stack), the numbers of ``jax.jit``, and, for
``deferrable`` itself, which values a small jaxpr carries as partial sums.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from test_scan_planning import L, _mlp_inputs, _stack

import alpa
from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step
from alpa.shard_parallel.gradients.row_sums import deferrable
from alpa.testing import assert_allclose
from alpa.tracing.batch_dims import static_batch_dims
from alpa.util import (
    count_communication_primitives,
    count_loop_communication_primitives,
    count_micro_batch_communication,
)

B = 64  # rows: 4 micro-batches of 16, each split over the 8 devices


def _step(kind: str):
    stack = _stack(kind, L)

    def step(params, batch):
        def loss_fn(p):
            return jnp.mean((stack(batch["x"], p) - batch["y"]) ** 2)

        grads = alpa.grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)

    return step


def _compiled(kind: str, method):
    params, batch = _mlp_inputs(B)
    step = _step(kind)
    p_step = alpa.parallelize(step, method=method, donate_argnums=())
    assert_allclose(p_step(params, batch), jax.jit(step)(params, batch), rtol=1e-5, atol=1e-6)
    return p_step.get_last_executable().get_hlo_text()


@pytest.mark.parametrize("kind", ["scan", "nested", "checkpointed"])
@pytest.mark.parametrize(
    "method",
    [
        alpa.DataParallel(),
        alpa.DataParallel(num_micro_batches=4),
        alpa.Zero2Parallel(num_micro_batches=2),
    ],
    ids=["data_parallel", "micro_batches", "zero2"],
)
def test_scanned_weight_gradients_are_reduced_after_the_loops(kind, method):
    """One packed gradient reduction per step, outside every loop, as for the unrolled
    stack (the same collectives); before, the backward scan all-reduced a layer's
    gradient in each iteration."""
    hlo = _compiled(kind, method)
    assert count_loop_communication_primitives(hlo).total == 0
    counts = count_communication_primitives(hlo, ignore_scalar_all_reduce=True)
    assert counts == count_communication_primitives(
        _compiled("unrolled", method), ignore_scalar_all_reduce=True
    )
    assert counts.all_reduce + counts.reduce_scatter == 1  # the gradients, packed


def test_the_scanned_gpt_reduces_its_gradients_once_per_step():
    """The issue's GPT (``nn.scan`` + ``nn.remat`` blocks) under ``DataParallel`` with 2
    micro-batches: no collective in any loop (the micro-batch loop, the blocks' scans),
    the unrolled GPT's collectives, and ``jax.jit``'s numbers."""
    hlo = {}
    for scanned in (False, True):
        config = GPTConfig(
            hidden_size=64, num_layers=4, num_heads=4, seq_len=16, vocab_size=128,
            scan_layers=scanned, remat_layers=True,
        )  # fmt: skip
        state, batch, step = get_gpt_train_state_and_step(
            config, 16, optimizer="sgd", grad_func=alpa.value_and_grad
        )
        method = alpa.DataParallel(num_micro_batches=2)
        p_step = alpa.parallelize(step, method=method, donate_argnums=())
        assert_allclose(p_step(state, batch), jax.jit(step)(state, batch), rtol=1e-4, atol=1e-6)
        executable = p_step.get_last_executable()
        hlo[scanned] = executable.get_hlo_text()
        per_micro_batch, _, _ = count_micro_batch_communication(executable.get_program_texts())
        assert per_micro_batch.total == 0
    assert count_loop_communication_primitives(hlo[True]).total == 0
    assert count_communication_primitives(hlo[True]) == count_communication_primitives(hlo[False])


# ----------------------------------------------------------------------------- which values


def _scan_gradients(after):
    """A jaxpr whose scan makes ``x.T @ dy[i]`` per iteration (a row sum: ``x``'s rows are
    the batch) as a stacked output, which ``after`` then reads; and its batch dims."""

    def fun(x, dy):
        def body(carry, d):
            g = x.T @ d
            return carry, g * 2.0

        _, stacked = lax.scan(body, 0.0, jnp.moveaxis(dy, 1, 0))
        return after(stacked)

    x, dy = jnp.ones((8, 4)), jnp.ones((8, 3, 5))  # both hold the batch's 8 rows in dim 0
    jaxpr = jax.make_jaxpr(fun)(x, dy).jaxpr
    return jaxpr, static_batch_dims(jaxpr, (True, True), 2)


def _deferred_in(jaxpr, dims):
    found = deferrable(jaxpr, dims)
    scan = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
    body = scan.params["jaxpr"].jaxpr
    return [v in found for v in scan.outvars[scan.params["num_carry"] :]], [
        e.primitive.name for e in body.eqns if e.outvars[0] in found
    ]


def test_a_stacked_row_sum_is_deferred_through_the_scan_when_read_linearly():
    jaxpr, dims = _scan_gradients(lambda g: g.sum(0) * 0.5)
    outer, inner = _deferred_in(jaxpr, dims)
    assert outer == [True]
    assert inner == ["dot_general", "mul"]  # the row sum and the scaling after it


def test_a_stacked_row_sum_read_whole_is_not_deferred():
    """Squared after the loop (not linear), or returned as the scan's carry too (read
    whole by the next iteration): the body's row sum stays where it is reduced."""
    jaxpr, dims = _scan_gradients(lambda g: g * g)
    assert _deferred_in(jaxpr, dims) == ([False], [])

    def fun(x, dy):
        def body(carry, d):
            g = x.T @ d
            return carry + g, g

        return lax.scan(body, jnp.zeros((4, 5)), jnp.moveaxis(dy, 1, 0))

    jaxpr = jax.make_jaxpr(fun)(jnp.ones((8, 4)), jnp.ones((8, 3, 5))).jaxpr
    dims = static_batch_dims(jaxpr, (True, True), 2)
    found = deferrable(jaxpr, dims)
    scan = jaxpr.eqns[-1]
    assert scan.primitive.name == "scan"
    assert scan.outvars[1] not in found  # the stacked g: its row sum also feeds the carry
