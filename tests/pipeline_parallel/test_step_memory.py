"""A pipelined step holds nothing the caller let go: the state it replaces is donated (as
a one-mesh step's ``donate_argnums`` do), no retrace closure keeps the first call's
arguments, and the executable keeps no step's inputs or outputs.

Oracles, a 4-layer MLP ``TrainState`` on two (1, 4) stages: after each step the live
arrays hold the state once (the base code held it three times: the first call's input,
the previous step's, the current one), the previous step's arrays are deleted, nothing is
left once the caller drops the state, numbers equal ``jax.jit``'s, and XLA's figures of
the step's peak per device are lower than the same step's without donation (by the
buffers the apply computations alias).
"""

from __future__ import annotations

import gc

import jax

import alpa
from alpa.testing import assert_allclose, get_mlp_train_state_and_step


def _method():
    return alpa.PipeshardParallel(
        num_micro_batches=2, layer_option=alpa.AutoLayerOption(2), stage_option="uniform"
    )


def _live_bytes() -> int:
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays())


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_a_pipelined_step_holds_its_state_once_and_nothing_after():
    state, batch, step = get_mlp_train_state_and_step(32, 128, num_layers=4)
    expected = jax.jit(step)(jax.jit(step)(jax.jit(step)(state, batch), batch), batch)
    p_step = alpa.parallelize(step, method=_method())  # donates the TrainState ("auto")
    size = _nbytes(state)
    others = _live_bytes() - size  # the batch, the expected state, ...
    copies = []
    for i in range(3):
        previous = state
        state = p_step(state, batch)
        if i:  # the first call's state was placed by copies (as jax.jit does)
            assert all(x.is_deleted() for x in jax.tree.leaves(previous))
        del previous
        copies.append((_live_bytes() - others) / size)
    assert copies == [1.0, 1.0, 1.0]  # it was [3.0, 3.0, 3.0]
    assert_allclose(state.params, expected.params, rtol=1e-5, atol=1e-6)
    executable = p_step.get_last_executable()
    assert executable.live_buffers_after_step() == []
    del state
    assert _live_bytes() - others == 0  # it was three states

    # XLA's figures: each mesh's peak is lower by what its apply reuses.
    donated = executable.get_step_memory_per_mesh()
    kept = alpa.parallelize(step, method=_method(), donate_argnums=())
    kept.get_executable(*get_mlp_train_state_and_step(32, 128, num_layers=4)[:2])
    not_donated = kept.get_last_executable().get_step_memory_per_mesh()
    assert all(a < b for a, b in zip(donated, not_donated, strict=True)), (donated, not_donated)
    aliased = [k["aliased"] for k in executable.get_kernel_memory() if k["kind"] == "apply"]
    assert all(aliased)
