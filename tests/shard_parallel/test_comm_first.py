"""The ILP minimizes communication first (``ilp_solver.solve``): the compute term breaks
ties and never buys a collective while the communication-only optimum already splits every
contraction over all its devices.

Oracles: the closed forms of Alpa's own plans on its unit-cost meshes (``alpha = beta = 1``):
data parallel is one all-reduce of the gradients, Megatron's alternating layers one
all-reduce of the activations per layer boundary; and, for each case, the
communication-only solve (compute priced at zero) of the same step, whose communication the
chosen plan must equal.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import pytest
from jax.sharding import PartitionSpec as P

import alpa
from alpa.shard_parallel.auto_sharding import AutoShardingOption, solve_auto_sharding
from alpa.shard_parallel.ilp import ilp_solver
from alpa.testing import assert_allclose, get_mlp_train_state_and_step, get_tied_embedding_step
from alpa.util import count_communication_primitives

F32 = 4


def _alpa_mesh(shape, beta=(1, 1)):
    """Alpa's test meshes: 4 devices, unit latency, the given bandwidth costs."""
    return alpa.LocalPhysicalDeviceMesh(jax.local_devices()[:4]).get_logical_mesh(
        shape, [1, 1], list(beta)
    )


def _run(step, state, batch, mesh):
    p_step = alpa.parallelize(step, method=alpa.ShardParallel(devices=mesh), donate_argnums=())
    out = p_step(state, batch)
    assert_allclose(out, jax.jit(step)(state, batch), rtol=1e-4, atol=1e-4)
    return out, p_step.get_last_executable()


def _kernel_specs(state, num_layers):
    return [state.params[f"Dense_{k}"]["kernel"].sharding.spec for k in range(num_layers)]


def test_megatron_on_one_by_four():
    """4 layers, batch 32, hidden 512 on (1, 4): Megatron's plan (column, row, column, row;
    3 all-reduces of a 32 x 512 activation, nothing else). The compute term once turned it
    into column, column, row, column with an extra all-gather."""
    state, batch, step = get_mlp_train_state_and_step(32, 512, num_layers=4)
    mesh = _alpa_mesh((1, 4))
    out, executable = _run(step, state, batch, mesh)
    assert _kernel_specs(out, 4) == [P(None, "y"), P("y")] * 2
    counts = count_communication_primitives(executable.get_hlo_text())
    assert tuple(counts) == (3, 3, 0, 0, 0)
    expected = 3 * mesh.all_reduce_cost(32 * 512 * F32, 1)
    assert executable.auto_sharding_objective == pytest.approx(expected)


def test_data_parallel_on_four_by_one():
    """6 layers, batch 256, hidden 32 on (4, 1): data parallel, every parameter and Adam
    moment replicated, the gradients reduced by one (combined) all-reduce."""
    num_layers, hidden = 6, 32
    state, batch, step = get_mlp_train_state_and_step(256, hidden, num_layers=num_layers)
    mesh = _alpa_mesh((4, 1))
    out, executable = _run(step, state, batch, mesh)
    leaves = jax.tree.leaves((out.params, out.opt_state))
    assert all(x.sharding.spec == P() or x.ndim == 0 for x in leaves)
    counts = count_communication_primitives(executable.get_hlo_text())
    assert tuple(counts) == (1, 1, 0, 0, 0)
    # The gradients and the loss (an operand of ``alpa.value_and_grad``'s marker).
    gradients = num_layers * (hidden * hidden + hidden) * F32 + F32
    assert executable.auto_sharding_objective == pytest.approx(mesh.all_reduce_cost(gradients, 0))


CASES = {
    "megatron (1, 4)": (lambda: get_mlp_train_state_and_step(32, 512, num_layers=4), (1, 4)),
    "data parallel (4, 1)": (lambda: get_mlp_train_state_and_step(256, 32, num_layers=6), (4, 1)),
    "2-D (2, 2)": (lambda: get_mlp_train_state_and_step(256, 32, num_layers=6), (2, 2)),
    "tied embedding (2, 2)": (get_tied_embedding_step, (2, 2)),
}


@pytest.mark.parametrize("case", CASES)
def test_compute_never_buys_communication(case):
    """The plan communicates exactly as little as the communication-only optimum (the same
    step solved with compute priced at zero), which splits every contraction over all the
    devices its strategies can: the compute term only chose among those plans."""
    make, shape = CASES[case]
    state, batch, step = make()
    mesh = _alpa_mesh(shape, (1, 0.1) if shape == (2, 2) else (1, 1))
    _, executable = _run(step, state, batch, mesh)
    comm_only = dataclasses.replace(mesh, device_flops=math.inf, memory_bandwidth=math.inf)
    best = solve_auto_sharding(executable.traced, comm_only, AutoShardingOption())
    assert best.solution.compute == 0.0
    assert ilp_solver.splits_contractions_evenly(best.graph, best.solution.choice)
    assert executable.auto_sharding_objective == pytest.approx(best.objective, rel=1e-9)
    # The compute term did act: the plan computes no more than the communication-only one.
    chosen = solve_auto_sharding(executable.traced, mesh, AutoShardingOption())
    recomputed = ilp_solver.compute_cost(chosen.graph, best.solution.choice)
    assert chosen.solution.compute <= recomputed * (1 + 1e-9)
    assert chosen.solution.comm_first


def test_replicated_contractions_fall_back_to_the_full_objective():
    """With ``allow_recompute_heavy_op`` the communication-only optimum of a tiny MLP on
    (1, 4) runs its matmuls whole on every device (no collective at all); that plan does
    not split the contractions evenly, so the full objective (communication + compute)
    is solved and its plan taken: cheaper in total, and its matmuls split."""
    state, batch, step = get_mlp_train_state_and_step(16, 64, num_layers=2)
    mesh = _alpa_mesh((1, 4))
    option = AutoShardingOption(allow_recompute_heavy_op=True)
    p_step = alpa.parallelize(
        step, method=alpa.ShardParallel(devices=mesh, auto_sharding_option=option)
    )
    p_step(state, batch)
    traced = p_step.get_last_executable().traced
    solution = solve_auto_sharding(traced, mesh, option)
    first = ilp_solver._solve(solution.graph, None, 60.0, comm_first=True)
    assert not ilp_solver.splits_contractions_evenly(solution.graph, first.choice)
    assert not solution.solution.comm_first
    assert solution.objective < first.objective
    assert ilp_solver.splits_contractions_evenly(solution.graph, solution.solution.choice)
