"""Auto-sharded train steps judged by their compiled programs (DESIGN §4 oracles).

Each test plans a tiny model with ``ShardParallel`` (the ILP), compiles it on the 8 virtual
CPU devices, and checks: the collectives counted in the HLO are those the chosen strategy
needs, the parameters' output shardings show the strategy, and the numbers equal the serial
``jax.jit(step)`` at 1e-4. Cost parameters are alpha = beta = 1 on both mesh axes.
"""

from __future__ import annotations

import re

import jax
import pytest
from jax.sharding import PartitionSpec as P

import alpa
from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step
from alpa.model.moe import MoEConfig, get_moe_train_state_and_step
from alpa.shard_parallel.ilp_solver import InfeasibleMemoryBudgetError
from alpa.testing import assert_allclose, get_mlp_train_state_and_step
from alpa.util import count_communication_primitives

ALPHA_BETA = ((1.0, 1.0), (1.0, 1.0))


def _mesh(shape):
    devices = jax.devices()[: shape[0] * shape[1]]
    return alpa.LocalPhysicalDeviceMesh(devices).get_logical_mesh(shape, *ALPHA_BETA)


def _compile(step, state, batch, shape, **option):
    method = alpa.ShardParallel(
        devices=_mesh(shape), auto_sharding_option=alpa.AutoShardingOption(**option)
    )
    p_step = alpa.parallelize(step, method=method, donate_argnums=())
    out = p_step(state, batch)
    return out, p_step.get_last_executable()


def _param_specs(params) -> dict[str, P]:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(k): v.sharding.spec for k, v in flat}


def _counts(executable):
    return count_communication_primitives(executable.get_hlo_text())


def _params_of(out):
    return (out[0] if isinstance(out, tuple) else out).params


# ----------------------------------------------------------------------------- MLP


@pytest.fixture(scope="module")
def mlp_wide_batch():
    """Large batch, small hidden: the gradients (2 x 16x16 + biases) are far smaller than
    any activation (1024 x 16), so data parallelism is the cheapest plan."""
    state, batch, step = get_mlp_train_state_and_step(1024, 16, num_layers=2)
    return state, batch, step, jax.jit(step)(state, batch)


@pytest.fixture(scope="module")
def mlp_wide_hidden():
    """Small batch, large hidden: the activations (8 x 256) are far smaller than the
    gradients (256 x 256), so Megatron's column/row split is the cheapest plan."""
    state, batch, step = get_mlp_train_state_and_step(8, 256, num_layers=2)
    return state, batch, step, jax.jit(step)(state, batch)


@pytest.mark.parametrize("shape", [(8, 1), (1, 8)])
def test_mlp_large_batch_is_data_parallel(mlp_wide_batch, shape):
    state, batch, step, expected = mlp_wide_batch
    out, executable = _compile(step, state, batch, shape)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    # Data parallel: the parameter gradients are summed over the batch shards by one
    # all-reduce of the gradient tuple; nothing else moves (the loss is not an output).
    counts = _counts(executable)
    assert counts.all_reduce == 1, counts
    assert counts.total == 1, counts
    assert set(_param_specs(out.params).values()) == {P()}, _param_specs(out.params)
    # The batch is split over the mesh axis that has the devices.
    axis = executable.plan.logical_mesh.axis_names[0 if shape[0] > 1 else 1]
    assert executable.plan.data_axes == (axis,)


def test_mlp_small_batch_is_megatron(mlp_wide_hidden):
    state, batch, step, expected = mlp_wide_hidden
    out, executable = _compile(step, state, batch, (1, 8))
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    specs = _param_specs(out.params)
    # Column-parallel first kernel (and its bias), row-parallel second kernel; the second
    # bias is added after the reduction, so it stays replicated.
    assert specs["['Dense_0']['kernel']"] == P(None, "y")
    assert specs["['Dense_0']['bias']"] == P("y")
    assert specs["['Dense_1']['kernel']"] == P("y")
    assert specs["['Dense_1']['bias']"] == P()
    # Megatron needs one all-reduce: the forward partial sums of the row-parallel layer
    # (8 x 256). Every gradient is computed on the shard that owns its parameter, the input's
    # gradient is not needed, and the replicated second bias gets its gradient from the
    # replicated output: no gradient all-reduce.
    counts = _counts(executable)
    assert counts.all_reduce == 1, counts
    assert counts.total == 1, counts


# ----------------------------------------------------------------------------- options


def test_force_data_parallel_is_data_parallel_program(mlp_wide_hidden):
    """On the Megatron-favouring MLP, ``force_data_parallel`` still gives DataParallel's
    program: the same collectives and the same (replicated) parameters."""
    state, batch, step, expected = mlp_wide_hidden
    out, executable = _compile(step, state, batch, (2, 4), force_data_parallel=True)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    dp_step = alpa.parallelize(step, method=alpa.DataParallel(), donate_argnums=())
    dp_out = dp_step(state, batch)
    dp_exec = dp_step.get_last_executable()
    assert _counts(executable) == _counts(dp_exec)
    assert _param_specs(out.params) == _param_specs(dp_out.params)
    assert executable.plan.in_specs == dp_exec.plan.in_specs


@pytest.fixture(scope="module")
def mlp_mid():
    """Batch 64, hidden 16 on (8, 1): the free plan mixes strategies; its reshardings are
    all-to-alls."""
    state, batch, step = get_mlp_train_state_and_step(64, 16, num_layers=2)
    return state, batch, step, jax.jit(step)(state, batch)


def test_hlo_collectives_are_the_plans_reshardings(mlp_mid):
    """The plan (``ALPA_DEBUG_PRINT_AS_STRATEGY=1``) splits the first layer by columns and
    the second by rows of the batch: it prices two all-to-alls (the first ReLU output
    RS0 -> S0R before the second matmul, the second layer's input gradient S0R -> RS0 before
    the ReLU mask), the all-reduces of the first layer's weight and bias gradients (tupled
    into one by XLA), and no all-gather. The compiled program holds exactly these. (When the
    lowering pinned only the producers' specs, XLA fed the weight-gradient matmul by
    all-gathering both operands instead: 2 all-gathers that no edge of the plan priced.)"""
    state, batch, step, expected = mlp_mid
    out, executable = _compile(step, state, batch, (8, 1))
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    counts = _counts(executable)
    assert counts.all_gather == 0, counts
    assert counts.all_to_all == 2, counts
    assert counts.all_reduce == 1, counts
    assert counts.total == 3, counts


def test_all_gather_disallowed_plan_prices_no_all_gather(mlp_mid):
    """``allow_all_gather=False`` prices every all-gather resharding as forbidden; the
    chosen plan avoids them (its objective stays far below the forbidden cost), and the
    numbers stay right."""
    from alpa.shard_parallel.sharding_spec import FORBIDDEN_COST

    state, batch, step, expected = mlp_mid
    out, executable = _compile(step, state, batch, (8, 1), allow_all_gather=False)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    assert executable.auto_sharding_objective < FORBIDDEN_COST


def test_no_all_gather_in_hlo_when_disallowed(mlp_wide_hidden):
    """With ``prefer_reduce_scatter`` the free plan of the wide MLP on (8, 1) all-gathers
    one value (the batch-split output gradient, S0R -> RR, before the first weight-gradient
    matmul): one all-gather in the HLO. With ``allow_all_gather=False`` the plan is priced
    higher and the program has none."""
    state, batch, step, expected = mlp_wide_hidden
    _, free = _compile(step, state, batch, (8, 1), prefer_reduce_scatter=True)
    assert _counts(free).all_gather == 1, _counts(free)
    out, executable = _compile(
        step, state, batch, (8, 1), prefer_reduce_scatter=True, allow_all_gather=False
    )
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    assert _counts(executable).all_gather == 0, _counts(executable)
    assert executable.auto_sharding_objective > free.auto_sharding_objective


# ----------------------------------------------------------------------------- memory


@pytest.fixture(scope="module")
def mlp_replicated_input():
    """Batch 512, hidden 64 on (8, 1): the cheapest plan splits the first layer by columns
    and keeps the input batch (512 x 64, 128 KiB) whole on every device; splitting it by
    rows saves memory at a higher communication cost."""
    state, batch, step = get_mlp_train_state_and_step(512, 64, num_layers=2)
    return state, batch, step, jax.jit(step)(state, batch)


def test_memory_budget_changes_plan_and_fits(mlp_replicated_input):
    """A budget of 90 % of the free plan's per-device allocation (XLA's arguments + outputs +
    temporaries: 301184 bytes, budget 271066): the ILP, which counts what XLA holds (whole-step
    arguments and outputs, live intermediates and resharded copies), picks a dearer plan that
    splits the input batch, and the allocation XLA reports for it fits (210272 bytes)."""
    state, batch, step, expected = mlp_replicated_input
    _, free = _compile(step, state, batch, (8, 1))
    x = len(free.plan.in_specs) - 2  # the input batch: the leaf before the targets
    assert free.plan.in_specs[x] == P(), "the test needs a free plan that replicates x"
    free_bytes = free.get_total_allocation_size()
    budget = 0.9 * free_bytes
    out, executable = _compile(step, state, batch, (8, 1), memory_budget_per_device=budget)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    assert executable.plan.in_specs[x] == P("x")
    assert executable.auto_sharding_objective > free.auto_sharding_objective
    assert executable.get_total_allocation_size() <= budget


INFEASIBLE = (
    r"memory_budget_per_device=1000 bytes cannot be met: the smallest plan found needs "
    r"(\d+) bytes per device at its peak on logical mesh \(8, 1\); raise the budget or use "
    r"more devices"
)


def test_impossible_memory_budget_is_a_clear_error(mlp_wide_batch):
    """The error names the budget and the smallest plan's peak; that peak is a real plan: a
    budget of it (plus one byte) compiles and XLA's allocation fits it, and 1 % less fails."""
    state, batch, step, expected = mlp_wide_batch
    with pytest.raises(InfeasibleMemoryBudgetError, match=f"^{INFEASIBLE}$") as info:
        _compile(step, state, batch, (8, 1), memory_budget_per_device=1000.0)
    smallest = int(re.search(INFEASIBLE, str(info.value)).group(1))
    out, executable = _compile(step, state, batch, (8, 1), memory_budget_per_device=smallest + 1)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    assert executable.get_total_allocation_size() <= smallest + 1
    with pytest.raises(InfeasibleMemoryBudgetError, match=f"needs {smallest} bytes"):
        _compile(step, state, batch, (8, 1), memory_budget_per_device=0.99 * smallest)


def test_plan_is_deterministic(mlp_wide_hidden):
    state, batch, step, _ = mlp_wide_hidden
    _, first = _compile(step, state, batch, (2, 4))
    alpa.shutdown()
    _, second = _compile(step, state, batch, (2, 4))
    assert first.plan.in_specs == second.plan.in_specs
    assert first.plan.out_specs == second.plan.out_specs
    assert first.auto_sharding_objective == second.auto_sharding_objective


# ----------------------------------------------------------------------------- transformer


def test_gpt_layers_split_attention_heads():
    """Two GPT blocks (hidden 64, 8 heads) with batch 2 on (1, 8): Megatron's plan splits the
    query/key/value kernels by output columns (= by heads, 8 heads over 8 devices), the
    attention output and MLP output kernels by rows, the MLP input kernel by columns."""
    config = GPTConfig(hidden_size=64, num_layers=2, num_heads=8, seq_len=16, vocab_size=128)
    state, batch, step = get_gpt_train_state_and_step(config, 2, grad_func=alpa.value_and_grad)
    out, executable = _compile(step, state, batch, (1, 8))
    assert_allclose(out, jax.jit(step)(state, batch), rtol=1e-4, atol=1e-4)
    specs = _param_specs(_params_of(out))
    for block in ("block_0", "block_1"):
        for name in ("query", "key", "value"):
            assert specs[f"['{block}']['attn']['{name}']['kernel']"] == P(None, "y")
        assert specs[f"['{block}']['attn']['out']['kernel']"] == P("y")
        assert specs[f"['{block}']['mlp']['wi']['kernel']"] == P(None, "y")
        assert specs[f"['{block}']['mlp']['wo']['kernel']"] == P("y")
    # Each block's two row-parallel layers (attention out, MLP out) all-reduce their partial
    # sums in the forward pass and, as the mirrored column-parallel inputs, the activation
    # gradients in the backward pass: at least 4 all-reduces per block.
    counts = _counts(executable)
    assert counts.all_reduce >= 4 * config.num_layers, counts


# ----------------------------------------------------------------------------- MoE


def test_moe_splits_experts_with_all_to_all():
    """An MoE block with 8 experts on (1, 8): the experts' batched weights are split on the
    expert dimension, and tokens reach their experts' devices by all-to-all."""
    config = MoEConfig(
        hidden_size=32, num_layers=2, num_heads=4, num_experts=8, seq_len=16,
        vocab_size=128, expert_group_size=16,
    )  # fmt: skip
    state, batch, step = get_moe_train_state_and_step(config, 8, grad_func=alpa.value_and_grad)
    out, executable = _compile(step, state, batch, (1, 8))
    assert_allclose(out, jax.jit(step)(state, batch), rtol=1e-4, atol=1e-4)
    specs = _param_specs(_params_of(out))
    assert specs["['block_1']['moe']['wi']"] == P("y")
    assert specs["['block_1']['moe']['wo']"] == P("y")
    counts = _counts(executable)
    assert counts.all_to_all >= 1, counts
