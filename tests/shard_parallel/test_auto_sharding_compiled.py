"""Auto-sharded train steps judged by their compiled programs (oracles: docs/design.md).

Each test plans a tiny model with ``ShardParallel`` (the ILP), compiles it on the 8 virtual
CPU devices, and checks: the collectives counted in the HLO are those the chosen strategy
needs, the parameters' output shardings show the strategy, and the numbers equal the serial
``jax.jit(step)`` at 1e-4. Cost parameters are alpha = beta = 1 on both mesh axes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import Literal
from jax.sharding import PartitionSpec as P

import alpa
from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step
from alpa.model.moe import MoEConfig, get_moe_train_state_and_step
from alpa.shard_parallel.auto_sharding import AutoShardingOption, solve_auto_sharding
from alpa.shard_parallel.ilp import ilp_solver
from alpa.shard_parallel.ilp.ilp_solver import InfeasibleMemoryBudgetError
from alpa.shard_parallel.strategies.sharding_spec import Spec, axis_dim, used_axes
from alpa.shard_parallel.strategies.strategy_costs import sums_partials
from alpa.testing import assert_allclose, get_mlp_train_state_and_step, unit_cost_mesh
from alpa.testing import run_auto_sharded as _compile
from alpa.util import collective_shapes, count_communication_primitives


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


def test_force_data_parallel_with_reduce_scatter_is_zero2_program(mlp_wide_batch):
    """``force_data_parallel`` with ``prefer_reduce_scatter`` is Alpa's ZeRO-2: the program
    and shardings of ``Zero2Parallel``, with one real reduce-scatter of all gradients packed
    (XLA on CPU merges none), no all-reduce, and one packed all-gather of the updated
    parameters (``gradient_sync.py``)."""
    state, batch, step, expected = mlp_wide_batch
    option = dict(force_data_parallel=True, prefer_reduce_scatter=True)
    out, executable = _compile(step, state, batch, (2, 4), **option)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    z2_step = alpa.parallelize(step, method=alpa.Zero2Parallel(), donate_argnums=())
    z2_out = z2_step(state, batch)
    assert _counts(executable) == _counts(z2_step.get_last_executable())
    assert tuple(_counts(executable)) == (2, 0, 1, 1, 0)
    assert _param_specs(out.opt_state) == _param_specs(z2_out.opt_state)
    assert all(s != P() for s in _param_specs(out.opt_state[0].mu).values())


def test_prefer_reduce_scatter_shards_the_update_of_data_parallel_gradients():
    """A data-parallel MLP (batch on mesh axis 0 everywhere, CPU cluster costs) with
    ``prefer_reduce_scatter``, in Alpa's order: the all-reduce plan (one all-reduce,
    nothing sharded) is rewritten to ZeRO-2's program, every gradient reduce-scattered in
    one packed reduce-scatter (``gradient_sync.py``), Adam's moments sharded so the update
    runs on 1/8 of each parameter, the updated parameters all-gathered in one packed
    all-gather; the objective reported is the all-reduce plan's, as Alpa reported it."""
    state, batch, step = get_mlp_train_state_and_step(1024, 128, num_layers=3)
    expected = jax.jit(step)(state, batch)
    mesh = alpa.get_global_physical_mesh().get_logical_mesh((8, 1))
    results = {}
    for prefer in (False, True):
        option = AutoShardingOption(prefer_reduce_scatter=prefer, force_batch_dim_to_mesh_dim=0)
        method = alpa.ShardParallel(devices=mesh, auto_sharding_option=option)
        p_step = alpa.parallelize(step, method=method)
        out = p_step(jax.tree.map(lambda x: x.copy(), state), batch)
        assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
        results[prefer] = out, p_step.get_last_executable()
    out, plain = results[False]
    assert tuple(_counts(plain)) == (1, 1, 0, 0, 0)
    assert all(s == P() for s in _param_specs(out.opt_state).values())
    out, scattered = results[True]
    assert tuple(_counts(scattered)) == (2, 0, 1, 1, 0)
    num_params = sum(x.size for x in jax.tree.leaves(state.params))
    hlo = scattered.get_hlo_text()
    assert collective_shapes(hlo, "reduce-scatter") == [f"f32[1,{num_params // 8}]"]
    moments = _param_specs((out.opt_state[0].mu, out.opt_state[0].nu))
    num_leaves = len(jax.tree.leaves(state.params))
    assert len(moments) == 2 * num_leaves and all(s != P() for s in moments.values())
    assert scattered.auto_sharding_objective == pytest.approx(plain.auto_sharding_objective)


def test_no_all_gather_in_the_plan_when_disallowed(mlp_wide_hidden):
    """With ``prefer_reduce_scatter`` the ILP's full-objective plan of the wide MLP on
    (8, 1) all-gathers one value (the batch-split output gradient, S0R -> RR, before the
    first weight-gradient matmul). With ``allow_all_gather=False`` the plan has none and
    is priced higher. (Compiled, the option takes the all-reduce plan here, which reduces
    no gradient: ``test_ilp_reduce_scatter``.)"""
    state, batch, step, expected = mlp_wide_hidden
    _, executable = _compile(step, state, batch, (8, 1))
    traced, mesh = executable.traced, executable.plan.logical_mesh

    def all_gathers(**option):
        solution = solve_auto_sharding(
            traced, mesh, AutoShardingOption(prefer_reduce_scatter=True, **option)
        )
        found = ilp_solver.collectives(solution.graph, solution.solution.choice)
        return sum(c.kind == "all-gather" for _, _, c in found), solution.objective

    gathers, free = all_gathers()
    assert gathers == 1
    gathers, disallowed = all_gathers(allow_all_gather=False)
    assert gathers == 0 and disallowed > free


# ----------------------------------------------------------------------------- memory


@pytest.fixture(scope="module")
def mlp_replicated_input():
    """Batch 128, hidden 128 on (8, 1): the cheapest plan is Megatron's (the first layer
    split by columns, the second by rows, one all-reduce) and keeps the input batch and the
    targets (128 x 128, 64 KiB each) whole on every device; splitting them saves memory at
    a higher communication cost."""
    state, batch, step = get_mlp_train_state_and_step(128, 128, num_layers=2)
    return state, batch, step, jax.jit(step)(state, batch)


def test_memory_budget_changes_plan_and_fits(mlp_replicated_input):
    """A budget of 90 % of the free plan's per-device allocation (XLA's arguments + outputs +
    temporaries: 364100 bytes, budget 327690): the ILP, which counts what XLA holds (whole-step
    arguments and outputs, live intermediates and resharded copies), picks a dearer plan that
    splits the targets (2 all-gathers and an all-to-all where the free plan all-reduces
    once), and the allocation XLA reports for it fits (312384 bytes)."""
    state, batch, step, expected = mlp_replicated_input
    _, free = _compile(step, state, batch, (8, 1))
    x, y = len(free.plan.in_specs) - 2, len(free.plan.in_specs) - 1  # the batch's leaves
    assert free.plan.in_specs[x] == free.plan.in_specs[y] == P(), (
        "the test needs a free plan that replicates the batch"
    )
    free_bytes = free.get_total_allocation_size()
    budget = 0.9 * free_bytes
    out, executable = _compile(step, state, batch, (8, 1), memory_budget_per_device=budget)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    assert executable.plan.in_specs[y] == P(None, "x")
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


BUDGET_REFUSED = (
    r"memory_budget_per_device=(\d+) bytes cannot be met: the closest plan found compiles to "
    r"(\d+) bytes per device \(XLA's allocation: arguments, outputs and temporaries\) on "
    r"logical mesh \(8, 1\); raise the budget or use more devices"
)


def test_memory_budget_is_kept_or_refused():
    """A budget is a promise. For a 4-layer MLP on (8, 1) the ILP's memory model undercounts
    what XLA allocates: with 75 % of the free plan's allocation as budget, the plan it
    chose compiled to 111 % of the budget, with no error. Now every budget of the sweep
    either compiles within itself (XLA's allocation, numerics equal serial) or is refused
    with the budget named and an allocation above it; both sides occur."""
    state, batch, step = get_mlp_train_state_and_step(32, 64, num_layers=4)
    expected = jax.jit(step)(state, batch)
    _, free = _compile(step, state, batch, (8, 1))
    kept = refused = 0
    for fraction in (0.95, 0.85, 0.75):
        budget = fraction * free.get_total_allocation_size()
        try:
            out, executable = _compile(step, state, batch, (8, 1), memory_budget_per_device=budget)
        except InfeasibleMemoryBudgetError as error:
            match = re.fullmatch(BUDGET_REFUSED, str(error))
            if match is None:  # the ILP itself found no plan: its own message
                assert re.fullmatch(
                    r"memory_budget_per_device=\d+ bytes cannot be met: .*", str(error)
                )
            else:  # a plan compiled over the budget and none closer fitted
                assert int(match.group(1)) == round(budget) and int(match.group(2)) > budget
                refused += 1
            continue
        assert executable.get_total_allocation_size() <= budget
        assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
        kept += 1
    assert kept and refused  # refused: by the promise, after XLA's allocation said no


def _objective(step, state, batch, method):
    p_step = alpa.parallelize(step, method=method, donate_argnums=())
    return p_step.get_executable(state, batch).auto_sharding_objective


def test_every_method_reports_its_objective(mlp_wide_batch, mlp_wide_hidden):
    """Fixed plans report their cost under the ILP's model (the cheapest plan with their
    input shardings), so methods compare on one (8, 1) unit-cost mesh: where data
    parallelism is the ILP's own choice (wide batch) DataParallel costs what ShardParallel
    costs, and where Megatron is (wide hidden) DataParallel costs more; ZeRO-3, which also
    gathers the parameters, never costs less than DataParallel; force_data_parallel is
    DataParallel."""
    from alpa.testing import unit_cost_mesh

    mesh = unit_cost_mesh((8, 1))
    for fixture, dp_is_best in ((mlp_wide_batch, True), (mlp_wide_hidden, False)):
        state, batch, step, _ = fixture
        auto = _objective(step, state, batch, alpa.ShardParallel(devices=mesh))
        dp = _objective(step, state, batch, alpa.DataParallel(devices=mesh))
        zero3 = _objective(step, state, batch, alpa.Zero3Parallel(devices=mesh))
        forced = alpa.ShardParallel(devices=mesh)
        forced.as_option.force_data_parallel = True
        assert all(isinstance(x, float) for x in (auto, dp, zero3))
        assert _objective(step, state, batch, forced) == pytest.approx(dp)
        assert zero3 >= dp - 1e-6
        if dp_is_best:
            assert dp == pytest.approx(auto)
        else:
            assert dp > auto


def test_plan_is_deterministic(mlp_wide_hidden):
    state, batch, step, _ = mlp_wide_hidden
    _, first = _compile(step, state, batch, (2, 4))
    alpa.shutdown()
    _, second = _compile(step, state, batch, (2, 4))
    assert first.plan.in_specs == second.plan.in_specs
    assert first.plan.out_specs == second.plan.out_specs
    assert first.auto_sharding_objective == second.auto_sharding_objective


# ----------------------------------------------------------------------------- plan vs HLO


def _resharding_collectives(src: Spec, dst: Spec) -> list[str]:
    """The collectives ``resharding_cost`` prices for ``src -> dst`` (``allow_all_to_all``),
    one per mesh axis: an axis that keeps its dimension and the axes before it there costs
    nothing; one that moves to another dimension is an all-to-all when it split its
    dimension alone; any other is an all-gather; an axis only ``dst`` uses is a free
    slice."""
    kinds = []
    for axis in used_axes(src):
        src_dim, dst_dim = axis_dim(src, axis), axis_dim(dst, axis)
        if src_dim == dst_dim:
            k = src[src_dim].index(axis) + 1
            if src[src_dim][:k] == dst[dst_dim][:k]:
                continue
        moves = dst_dim is not None and len(src[src_dim]) == 1
        kinds.append("all_to_all" if moves else "all_gather")
    return kinds


_REDUCE_SCATTER_RE = re.compile(r" RS\d+->")


def _plan_collectives(executable, **option) -> Counter:
    """The collectives the executable's ILP plan prices, by kind, read from the plan as data.

    * each node whose chosen strategy communicates by itself (a dot or reduction with a
      split contracting/reduced dimension; ``... = RRR AR1``, or ``... RS1->S1RR`` with
      ``prefer_reduce_scatter``): one all-reduce (reduce-scatter) of its result;
    * but where an add sums two partial results reduced alike
      (``strategy_costs.sums_partials``), one reduction of their sum, not two;
    * each resharding edge (an operand read in another spec than its producer's): the
      collectives of that resharding. The lowering reshards a value once per target spec,
      shared by all its readers (``constrained_eval.eval_jaxpr_with_constraints``), so a
      ``(value, spec)`` pair counts once, though the ILP prices every reading edge.

    The planning is re-run on the executable's trace with the same ``option`` fields
    (deterministic); its objective and input specs must be the executable's.
    """
    plan = executable.plan
    solution = solve_auto_sharding(
        executable.traced, plan.logical_mesh, AutoShardingOption(**option)
    )
    assert solution.objective - solution.compute == executable.auto_sharding_objective
    assert solution.compute == executable.auto_sharding_compute_cost
    assert solution.to_sharding_plan().in_specs == plan.in_specs
    graph, choice = solution.graph, solution.solution.choice
    counts = Counter()
    for node in graph.nodes:
        strategy = node.strategies[choice[node.id]]
        if strategy.comm_cost > 0:
            scatter = _REDUCE_SCATTER_RE.search(strategy.name)
            counts["reduce_scatter" if scatter else "all_reduce"] += 1
    reshardings = set()
    for eqn, sources in zip(graph.jaxpr.eqns, graph.eqn_sources, strict=True):
        if not sources:  # an alias equation: no node
            continue
        consumer = graph.nodes[sources[0][0]]
        needs = consumer.strategies[choice[consumer.id]].in_specs
        for v, need in zip(eqn.invars, needs, strict=False):
            if not isinstance(v, Literal) and need is not None:
                reshardings.add((v, need))
    for v, need in reshardings:
        counts.update(_resharding_collectives(solution.spec_of(v), need))
    for site in graph.partial_sums:  # two partial results added: one reduction of the sum
        if sums_partials(graph.nodes, site, choice[site.other], choice[site.add_node]):
            other = graph.nodes[site.other].strategies[choice[site.other]]
            counts["reduce_scatter" if _REDUCE_SCATTER_RE.search(other.name) else "all_reduce"] -= 1
    for i, o in solution.state_pairs:  # updated state leaves in its input's spec
        out, inp = graph.jaxpr.outvars[o], graph.jaxpr.invars[i]
        if not isinstance(out, Literal):
            counts.update(_resharding_collectives(solution.spec_of(out), solution.spec_of(inp)))
    return counts


_ALL_REDUCE_RE = re.compile(r"=\s*(?P<shape>.*?)\s+all-reduce(?:-start)?\(")
_ARRAY_SHAPE_RE = re.compile(r"\b[a-z]+\d*\[[\d,]*\]")


def _all_reduced_values(hlo_text: str) -> int:
    """How many arrays the HLO all-reduces: an all-reduce that XLA's combiner merged over a
    tuple counts once per tuple element (``count_communication_primitives`` counts it once)."""
    values = 0
    for line in hlo_text.splitlines():
        match = _ALL_REDUCE_RE.search(line)
        if match is not None:
            values += len(_ARRAY_SHAPE_RE.findall(match.group("shape")))
    return values


def _assert_hlo_is_plan(
    executable, expected: dict[str, int], all_reduce_ops: int, summed_first: int = 0
) -> None:
    """The plan prices ``expected`` collectives (all-reduces counted per value), and the HLO
    holds them: the same all-gathers, all-to-alls and reduce-scatters, and the same
    all-reduced values in ``all_reduce_ops`` all-reduce operations (XLA tuples independent
    all-reduces), less ``summed_first``: row sums the program defers to the ``alpa.grad``
    marker and adds before their one reduction, which the plan prices one by one."""
    planned = _plan_collectives(executable)
    kinds = ("all_reduce", "all_gather", "all_to_all", "reduce_scatter")
    assert {k: planned[k] for k in kinds} == expected, planned
    counts = _counts(executable)
    hlo = {
        "all_reduce": _all_reduced_values(executable.get_hlo_text()) + summed_first,
        "all_gather": counts.all_gather,
        "all_to_all": counts.all_to_all,
        "reduce_scatter": counts.reduce_scatter,
    }
    assert hlo == expected, counts
    assert counts.all_reduce == all_reduce_ops, counts
    total = all_reduce_ops + expected["all_gather"] + expected["all_to_all"]
    assert counts.total == total + expected["reduce_scatter"], counts


# ----------------------------------------------------------------------------- transformer


@pytest.mark.parametrize("num_layers", [1, 2])
def test_gpt_layers_split_attention_heads(num_layers):
    """``L`` GPT blocks (hidden 64, 8 heads, seq 16, vocab 128, batch 2) on (1, 8): Megatron's
    plan (query/key/value and the MLP input kernel split by output columns = by heads, the
    attention output and MLP output kernels by rows) and a vocabulary-split LM head.

    The plan (``ALPA_DEBUG_PRINT_AS_STRATEGY=1``) prices, per block:

    * 3 all-reduces of ``[2, 16, 64]`` (8 KiB): the forward partial sums of the two
      row-parallel layers (attention output, MLP output), and the input gradient of the
      column-parallel MLP input layer;
    * the input gradient of query, key and value, ``dq @ Wq.T + dk @ Wk.T + dv @ Wv.T``: three
      partial sums over the split heads. The first add sums two partial results reduced
      alike, so they are reduced once (``strategy_graph_record.PartialSumSite``; the lowering adds
      them on each device first, ``partial_sums.py``); the second add reads that sum, no
      longer a partial result: 2 all-reduces, where Megatron has 3. (Before the partial-sum
      rule the plan avoided the three all-reduces by all-gathering the head-split
      gradients: 5 all-gathers and 3 all-to-alls per block.)

    Once per step: the LM head's input gradient (contraction over the split vocabulary:
    1 all-reduce of ``[2, 16, 64]``) and the cross-entropy over vocabulary-split logits (max,
    sum of exponentials, label log-probability, and the backward's sum over the vocabulary:
    4 all-reduces of ``[2, 16]``). No all-gather, all-to-all or reduce-scatter; the
    parameter gradients are computed on the shards that own the parameters, so none is
    all-reduced.

    Total: 5L + 5 all-reduced values. XLA's all-reduce combiner tuples independent ones
    (e.g. the cross-entropy's label-only backward term goes with a forward partial sum):
    4L + 3 all-reduce operations.
    """
    config = GPTConfig(
        hidden_size=64, num_layers=num_layers, num_heads=8, seq_len=16, vocab_size=128
    )
    state, batch, step = get_gpt_train_state_and_step(config, 2, grad_func=alpa.value_and_grad)
    out, executable = _compile(step, state, batch, (1, 8))
    assert_allclose(out, jax.jit(step)(state, batch), rtol=1e-4, atol=1e-4)
    specs = _param_specs(_params_of(out))
    for i in range(num_layers):
        block = f"block_{i}"
        for name in ("query", "key", "value"):
            assert specs[f"['{block}']['attn']['{name}']['kernel']"] == P(None, "y")
        assert specs[f"['{block}']['attn']['out']['kernel']"] == P("y")
        assert specs[f"['{block}']['mlp']['wi']['kernel']"] == P(None, "y")
        assert specs[f"['{block}']['mlp']['wo']['kernel']"] == P("y")
    n = num_layers
    assert len(executable.plan.partial_sums) == n
    expected = {"all_reduce": 5 * n + 5, "all_gather": 0, "all_to_all": 0}
    _assert_hlo_is_plan(executable, {**expected, "reduce_scatter": 0}, 4 * n + 3)


# ----------------------------------------------------------------------------- MoE


@pytest.mark.parametrize("num_layers", [2, 4])
def test_moe_splits_experts_with_all_to_all(num_layers):
    """``L`` MoE-GPT blocks (hidden 32, 4 heads, 8 experts, seq 16, vocab 128, groups of 16
    tokens, batch 8) on (1, 8); blocks 1, 3, ... have an MoE MLP. The plan is data parallel
    (batch and token groups split) except where a split of another dimension is cheaper: the
    experts' batched weights are split on the expert dimension, and tokens reach their
    experts' devices by all-to-all.

    The plan (``ALPA_DEBUG_PRINT_AS_STRATEGY=1``) prices, per pair of blocks (dense, MoE):

    * MoE block: 4 all-to-alls of the ``[E, G, C, H]`` expert inputs/outputs between the
      group split and the expert split: dispatch and combine in the forward pass, and their
      transposes in the backward pass (GShard). The weight-gradient einsums re-read the
      forward values in the same specs, sharing those reshardings;
    * dense block: the MLP runs split on the intermediate dimension, as Megatron's, with its
      weight gradients computed there instead of all-reduced. The ``[8, 16, 32]`` input
      and output gradient are all-gathered once each (1 + 7/8 * 16384 = 14337), each read
      whole by a matmul and a weight gradient (one resharding shared by both readers,
      ``shared_resharding``); the ``[8, 16, 128]`` activation and its gradient move from
      the intermediate split to the batch split for ``wo``'s matmul and the input gradient
      (1 all-to-all each, priced on the whole 64 KiB tensor as Alpa's:
      1 + 7/64 * 65536 * 1.5 = 10753): 50180 in all against
      58243 for all-reducing both 16 KiB gradients and the ``wi`` bias's. 2 all-gathers,
      2 all-to-alls; the ``wi`` bias's gradient is split like the intermediate dimension;
    * all-reduced gradients: 13 in the dense block, 14 in the MoE block: every other
      parameter (attention kernels and biases, LayerNorms, the ``wo`` bias; the router
      kernel and the balancing loss in the MoE block) is replicated and summed over the
      batch split.

    Once per step: the LM head's weight gradient is computed vocabulary-split, its
    ``[8, 16, 128]`` logits gradient moved from the batch split to the vocabulary split (1
    all-to-all) and its ``[8, 16, 32]`` input all-gathered (1); the token and position
    embeddings' gradients are scatter-added hidden-split from an all-to-all of the input
    gradient (1, shared by both),
    and the LM head's vocabulary-split share of the tied embedding's gradient moves to the
    hidden split to be added (1 all-to-all); the loss and the final LayerNorm: 3 all-reduced
    values.

    Total, with P = L / 2 pairs: 3 + 27P all-reduced values, 1 + 2P all-gathers, 3 + 6P
    all-to-alls. XLA's combiner tuples every all-reduce into one operation.
    """
    config = MoEConfig(
        hidden_size=32, num_layers=num_layers, num_heads=4, num_experts=8, seq_len=16,
        vocab_size=128, expert_group_size=16,
    )  # fmt: skip
    state, batch, step = get_moe_train_state_and_step(config, 8, grad_func=alpa.value_and_grad)
    out, executable = _compile(step, state, batch, (1, 8))
    assert_allclose(out, jax.jit(step)(state, batch), rtol=1e-4, atol=1e-4)
    specs = _param_specs(_params_of(out))
    for i in range(1, num_layers, 2):
        assert specs[f"['block_{i}']['moe']['wi']"] == P("y")
        assert specs[f"['block_{i}']['moe']['wo']"] == P("y")
    pairs = num_layers // 2
    expected = {"all_reduce": 3 + 27 * pairs, "all_gather": 1 + 2 * pairs}
    expected.update(all_to_all=3 + 6 * pairs, reduce_scatter=0)
    # The scalar row sums of the loss (the LM loss and each MoE block's balancing loss)
    # reach the marker deferred and are added there: the program all-reduces their sum
    # once, ``pairs`` values fewer than the plan prices.
    _assert_hlo_is_plan(executable, expected, 1, summed_first=pairs)


# ----------------------------------------------------------------------------- work terms


def test_recomputing_heavy_ops_is_priced():
    """With ``allow_recompute_heavy_op`` the ILP may run a matmul whole on every device.
    Without the compute term that plan cost nothing and won: a BERT MLM step on (2, 4)
    came out fully replicated, objective 0, no collective. Priced, the plan splits. (The
    batch is left free, ``-1``: Alpa's default would force it onto axis 0 of the 2-D
    mesh.)"""
    from alpa.model.bert import BertConfig, get_bert_train_state_and_step

    config = BertConfig(
        hidden_size=8, num_layers=1, num_heads=2, vocab_size=16, max_position_embeddings=8
    )
    state, batch, step = get_bert_train_state_and_step(config, 128)
    expected = jax.jit(step)(state, batch)
    option = AutoShardingOption(allow_recompute_heavy_op=True, force_batch_dim_to_mesh_dim=-1)
    results = {}
    for name, mesh in (
        ("priced", unit_cost_mesh((2, 4))),
        ("free", dataclasses.replace(unit_cost_mesh((2, 4)), device_flops=math.inf)),
    ):
        method = alpa.ShardParallel(devices=mesh, auto_sharding_option=option)
        p_step = alpa.parallelize(step, method=method, donate_argnums=())
        out = p_step(state, batch)
        assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
        executable = p_step.get_last_executable()
        results[name] = (executable.plan, executable.auto_sharding_objective, _counts(executable))
    plan, objective, counts = results["free"]
    # No collective at all: every device computes the whole step.
    assert objective == 0.0 and counts.total == 0
    plan, objective, counts = results["priced"]
    assert objective > 0 and counts.total > 0
    assert plan.data_axes  # the batch is split
    assert set(plan.in_specs) != {P()}


def test_init_function_returns_sharded_kernels():
    """A weight-init function under ``ShardParallel`` (the local CPU cluster's costs): every
    kernel is written by elementwise ops after the random bits, and writing a shard costs
    a device 1/8 of writing all of it, so the kernels come out sharded. The forward pass
    ``init`` runs and drops is dead code, left out of the plan: priced, its batch-split
    matmuls (no communication with whole kernels) made the kernels come out replicated."""
    import flax.linen as nn

    class TwoDense(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(256)(nn.Dense(256)(x))

    model, x = TwoDense(), jax.numpy.ones((8, 256))

    def init(rng):
        return model.init(rng, x)

    rng = jax.random.PRNGKey(0)
    expected = jax.jit(init)(rng)
    mesh = alpa.LocalPhysicalDeviceMesh().get_logical_mesh((1, 8))
    params = alpa.parallelize(init, method=alpa.ShardParallel(devices=mesh), batch_argnums=())(rng)
    assert_allclose(params, expected)
    kernels = [params["params"][layer]["kernel"].sharding.spec for layer in ("Dense_0", "Dense_1")]
    assert all(spec != P() for spec in kernels), kernels


_PRICED_ALL_REDUCE_RE = re.compile(r"= (?P<shapes>\(.*?\)|\S+) all-reduce(?:-start)?\(")
_SHAPE_RE = re.compile(r"(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_MESH_GROUPS_RE = re.compile(r"replica_groups=mesh\[(?P<sizes>[^\]]*)\] \{(?P<axes>[^}]*)\}")
_EXPLICIT_GROUP_RE = re.compile(r"replica_groups=\{\{(?P<devices>[\d,]*)\}")
_ITEMSIZE = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "f64": 8, "pred": 1}


def _reduced_axes(line: str, mesh) -> list[int]:
    """The logical mesh axes an HLO collective's replica groups span: named in a mesh group
    (``axis_i`` is logical axis ``i``), or, for explicit groups (``shard_map``'s), the axes
    of more than one device whose sizes multiply to the group size."""
    groups = _MESH_GROUPS_RE.search(line)
    if groups is not None:
        return [int(a.strip(" '")[len("axis_") :]) for a in groups.group("axes").split(",")]
    first = _EXPLICIT_GROUP_RE.search(line).group("devices")
    size = len(first.split(","))
    axes = [a for a, n in enumerate(mesh.shape) if n > 1]
    assert math.prod(mesh.shape[a] for a in axes) == size, (line, mesh.shape)
    return axes


def _priced_all_reduces(hlo_text: str, mesh) -> tuple[float, int]:
    """``(cost, count)`` of the HLO's all-reduces at the cost model's price: one latency per
    operation (a merged tuple all-reduce is one) and the bytes of all its operands, over
    the logical mesh axes named in its replica groups (``axis_i`` is logical axis ``i``)."""
    total, count = 0.0, 0
    for line in hlo_text.splitlines():
        match = _PRICED_ALL_REDUCE_RE.search(line)
        if match is None:
            continue
        num_bytes = 0
        for shape in _SHAPE_RE.finditer(match.group("shapes")):
            dims = [int(d) for d in shape.group("dims").split(",") if d]
            num_bytes += _ITEMSIZE[shape.group("dtype")] * math.prod(dims)
        axes = _reduced_axes(line, mesh)
        total += sum(mesh.all_reduce_cost(num_bytes, a) for a in axes)
        count += 1
    return total, count


def test_data_parallel_objective_equals_priced_hlo_collectives():
    """The objective of a data-parallel plan prices what XLA compiles: the gradients and the
    loss leave in one merged all-reduce (one latency, the bytes of all), and its
    communication part equals that all-reduce priced by the same alpha-beta model, on the
    local CPU cluster's costs where the latency is most of the price."""
    from alpa.model.mlp import MLPModel
    from alpa.model.mlp import get_mlp_train_state_and_step as make

    model = MLPModel(hidden_size=16, num_layers=3, use_bias=True)
    state, batch, step = make(
        model, 1024, 16, optimizer="adam", seed=0, grad_func=alpa.value_and_grad
    )
    p_step = alpa.parallelize(step, method=alpa.DataParallel(), donate_argnums=())
    executable = p_step.get_executable(state, batch)
    plan = executable.plan
    solution = solve_auto_sharding(
        executable.traced, plan.logical_mesh, AutoShardingOption(), fixed_in_specs=plan.in_specs
    )
    graph, choice = solution.graph, solution.solution.choice
    communication = ilp_solver.communication_cost(graph, choice)
    priced, count = _priced_all_reduces(executable.get_hlo_text(), plan.logical_mesh)
    assert count == 1
    assert _counts(executable).total == 1
    assert communication == pytest.approx(priced, rel=1e-9)
    # Alpa's convention: the objective reported is the communication; the compute term
    # the ILP adds is reported beside it.
    assert executable.auto_sharding_objective == pytest.approx(communication, rel=1e-12)
    assert executable.auto_sharding_compute_cost == pytest.approx(
        ilp_solver.compute_cost(graph, choice), rel=1e-12
    )
    assert executable.auto_sharding_compute_cost > 0
    # Priced per tensor, the 3 kernels, 3 biases and the loss would pay 7 latencies.
    alpha = plan.logical_mesh.mesh_alpha[0]
    assert communication < 2 * alpha


# ----------------------------------------------------------------------------- forced batch


def _batch_dims_where(executable, test, num_data: int, **option) -> list[str]:
    """Labels of the plan's values whose one batch dimension (found at ``num_data``
    devices) has mesh axes ``axes`` for which ``test(axes)`` holds, as the ILP solved
    with ``option`` places them."""
    from alpa.shard_parallel.gradients.micro_batches import batch_dims

    mesh = executable.plan.logical_mesh
    solution = solve_auto_sharding(executable.traced, mesh, AutoShardingOption(**option))
    dims = batch_dims(executable.traced, num_data)
    labels = []
    for node in solution.graph.nodes:
        strategy = node.strategies[solution.solution.choice[node.id]]
        for var, spec in zip(node.outvars, strategy.out_specs, strict=True):
            d = dims.get(var)
            if d is not None and len(d) == 1 and test(spec[d[0]]):
                labels.append(node.label)
    return labels


def _batch_dims_off_axis(executable, axis: int, **option) -> list[str]:
    """Labels of the plan's values whose one batch dimension is not split by ``axis``."""
    size = executable.plan.logical_mesh.shape[axis]
    return _batch_dims_where(executable, lambda axes: axis not in axes, size, **option)


@pytest.mark.parametrize("axis", [0, 1])
def test_force_batch_dim_to_mesh_dim_forces_every_value(mlp_wide_hidden, axis):
    """``force_batch_dim_to_mesh_dim=k`` means what it means in Alpa: the batch dimension of
    every value that has one (activations, their gradients, the loss terms) is split over
    mesh axis ``k``, not only the batch arguments'. Free (``-1``), the same step (small
    batch, wide hidden) is Megatron on both axes and leaves the batch whole."""
    state, batch, step, expected = mlp_wide_hidden
    free_out, free = _compile(step, state, batch, (2, 4), force_batch_dim_to_mesh_dim=-1)
    assert _batch_dims_off_axis(free, axis, force_batch_dim_to_mesh_dim=-1)
    out, executable = _compile(step, state, batch, (2, 4), force_batch_dim_to_mesh_dim=axis)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    assert executable.plan.data_axes == (executable.plan.logical_mesh.axis_names[axis],)
    assert _batch_dims_off_axis(executable, axis, force_batch_dim_to_mesh_dim=axis) == []


def test_a_2d_mesh_forces_the_batch_onto_axis_0_by_default(mlp_wide_hidden):
    """Alpa's default (``force_batch_dim_to_mesh_dim=None``): on a logical mesh whose two
    axes both have more than one device, the batch dimension of every value is split over
    axis 0, as with ``force_batch_dim_to_mesh_dim=0``, and the ILP shards the model over
    axis 1; ``-1`` leaves the solver free (this step is then Megatron over both axes, the
    batch whole). On a mesh with an axis of one device nothing is forced. Oracles: the
    default's plan equals the forced plan, spec for spec; the batch dimensions of its
    values all lie on axis 0; the free plan's do not; numerics equal serial."""
    state, batch, step, expected = mlp_wide_hidden
    out, default = _compile(step, state, batch, (2, 4))
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    _, forced = _compile(step, state, batch, (2, 4), force_batch_dim_to_mesh_dim=0)
    _, free = _compile(step, state, batch, (2, 4), force_batch_dim_to_mesh_dim=-1)
    assert default.plan.in_specs == forced.plan.in_specs
    assert default.plan.data_axes == ("x",)
    assert default.auto_sharding_objective == pytest.approx(forced.auto_sharding_objective)
    assert _batch_dims_off_axis(default, 0) == []
    assert _batch_dims_off_axis(free, 0, force_batch_dim_to_mesh_dim=-1)
    assert free.plan.in_specs != default.plan.in_specs
    # The option the executable keeps is the user's: the default is resolved per mesh.
    assert default.auto_sharding_option.force_batch_dim_to_mesh_dim is None
    # A mesh with an axis of one device: the default forces nothing.
    for shape in ((1, 8), (8, 1)):
        _, one_axis = _compile(step, state, batch, shape)
        _, unforced = _compile(step, state, batch, shape, force_batch_dim_to_mesh_dim=-1)
        assert one_axis.plan.in_specs == unforced.plan.in_specs, shape


def test_forced_batch_axis_holds_for_the_operands_of_weight_gradients():
    """On (4, 1) with ``force_batch_dim_to_mesh_dim=0`` a small-batch, wide-hidden MLP is
    data parallel, as in Alpa: the weight gradients ``x.T @ dy`` contract the batch, so
    their operands carry it, and they must read them split over axis 0 and all-reduce
    their partial sums. Moving the activations to a column split first (all-to-alls, then
    all-gathers of the updated kernels) communicates less on this step, and is what the
    forcing forbids. Oracles: one all-reduce and no other collective in the HLO, every
    parameter replicated, the objective the closed form of one combined all-reduce of the
    gradients and the loss, numerics equal serial."""
    state, batch, step = get_mlp_train_state_and_step(32, 256, num_layers=3)
    expected = jax.jit(step)(state, batch)
    out, executable = _compile(step, state, batch, (4, 1), force_batch_dim_to_mesh_dim=0)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    counts = _counts(executable)
    assert (counts.all_reduce, counts.total) == (1, 1), counts
    assert set(_param_specs(out.params).values()) == {P()}
    # The gradients and the loss's partial sum (4 bytes), reduced together.
    reduced_bytes = 4 * sum(x.size for x in jax.tree.leaves(state.params)) + 4
    mesh = executable.plan.logical_mesh
    assert executable.auto_sharding_objective == pytest.approx(
        mesh.all_reduce_cost(reduced_bytes, 0), rel=1e-9
    )


def test_forced_batch_axis_of_one_device_keeps_the_batch_whole(mlp_wide_batch):
    """``force_batch_dim_to_mesh_dim=0`` on a (1, 4) mesh maps the batch to an axis of one
    device: no value's batch dimension is split (Alpa's convention), where the free plan
    of this large-batch step splits it over axis 1 (data parallel)."""
    state, batch, step, expected = mlp_wide_batch
    _, free = _compile(step, state, batch, (1, 4))
    assert free.plan.data_axes == ("y",)
    out, executable = _compile(step, state, batch, (1, 4), force_batch_dim_to_mesh_dim=0)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    assert executable.plan.data_axes == ()
    assert _split_batch_dims(free)
    assert _split_batch_dims(executable, force_batch_dim_to_mesh_dim=0) == []


@pytest.mark.parametrize("batch_size, seq_len", [(16, 32), (1, 64)])
def test_forced_batch_keeps_a_dense_layers_sequence_with_its_batch(batch_size, seq_len):
    """Alpa merged the free dimensions of a dot's operand (``[B, S, H] @ [H, D]`` as
    ``[B * S, H] @ [H, D]``) before it forced the batch dimension, so a dense layer's
    sequence goes where its batch goes. Forced onto the one-device axis of (1, 4), BERT
    layers are therefore Megatron, with a batch of 16 rows and of one (whose batch
    dimensions the jaxpr's rules find: no retrace at a fraction of one row exists); left
    to split the sequence, the ILP would reshuffle it with all-to-alls between the dense
    layers and the heads. Oracles: every collective of the program is an all-reduce of
    one ``[B, S, H]`` activation over axis 1 (Megatron's: the dense layers' outputs and
    input gradients; no all-to-all, no all-gather), the objective is that many of them
    by the closed form, and numerics equal serial."""
    from alpa.testing import get_bert_layer_train_state_and_step
    from alpa.util import collective_shapes

    hidden = 32
    state, batch, step = get_bert_layer_train_state_and_step(
        batch_size, seq_len, 2, hidden, num_heads=8, seed=0
    )
    expected = jax.jit(step)(state, batch)
    out, executable = _compile(step, state, batch, (1, 4), force_batch_dim_to_mesh_dim=0)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    hlo = executable.get_hlo_text()
    counts = _counts(executable)
    assert counts.total == counts.all_reduce, counts
    reduced = collective_shapes(hlo, "all-reduce")
    assert set(reduced) == {f"f32[{batch_size},{seq_len},{hidden}]"}, reduced
    mesh = executable.plan.logical_mesh
    activation = batch_size * seq_len * hidden * 4
    assert executable.auto_sharding_objective == pytest.approx(
        len(reduced) * mesh.all_reduce_cost(activation, 1), rel=1e-6
    )


def _split_batch_dims(executable, **option) -> list[str]:
    """Labels of the plan's values whose one batch dimension is split over some axis."""
    return _batch_dims_where(executable, bool, 2, **option)


def test_a_scatter_add_is_not_a_contraction():
    """An embedding's gradient, the scatter-add of the looked-up rows' gradients, is
    memory-bound work that a plan may split over fewer devices than the mesh has. Its
    combining jaxpr made it count as an opaque equation holding contractions, so a plan
    that left it on 2 of 4 devices sent the solve to the full objective, which traded
    communication for compute: this tied-embedding LM on (2, 2) communicated 19407 where
    the communication-first plan communicates 18058 (Alpa's own embedding test: 27466 in
    9 collectives against 19847 in 6). Oracles: the plan is the communication-first
    solve's and communicates less than the full objective's plan; numerics equal
    serial."""
    import flax.linen as nn
    import jax.numpy as jnp
    import optax
    from flax.training.train_state import TrainState

    vocab, width = 1024, 8

    class TiedLM(nn.Module):
        @nn.compact
        def __call__(self, ids):
            embed = nn.Embed(vocab, width)
            return embed(ids) @ embed.embedding.T

    model = TiedLM()
    ids = jnp.arange(64, dtype=jnp.int32).reshape(8, 8) % 7
    labels = (ids + 1) % 7
    state = TrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), ids), tx=optax.adam(1e-2)
    )

    def step(state, ids, labels):
        def loss_fn(params):
            logits = state.apply_fn(params, ids)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()

        return state.apply_gradients(grads=alpa.grad(loss_fn)(state.params))

    expected = jax.jit(step)(state, ids, labels)
    devices = alpa.LocalPhysicalDeviceMesh(jax.devices()[:4])
    mesh = devices.get_logical_mesh((2, 2), (1, 1), (1, 1))
    p_step = alpa.parallelize(step, method=alpa.ShardParallel(devices=mesh), donate_argnums=())
    out = p_step(state, ids, labels)
    assert_allclose(out.params, expected.params, rtol=1e-5, atol=1e-5)
    executable = p_step.get_last_executable()
    traced, mesh = executable.traced, executable.plan.logical_mesh
    plan = solve_auto_sharding(traced, mesh, AutoShardingOption())
    full = solve_auto_sharding(traced, mesh, AutoShardingOption(), comm_first=False)
    assert plan.solution.comm_first
    assert plan.objective - plan.compute < full.objective - full.compute


# ----------------------------------------------------------------------------- embedding


def _tied_lookup_step(mode: str | None):
    """A tied input and output embedding (vocabulary 1024, hidden 8), the lookup by
    ``jnp.take(..., mode=mode)`` (``None``: ``table[ids]``), summed cross-entropy, SGD."""

    def step(params, batch):
        def loss_fn(p):
            table = p["embedding"]
            if mode is None:
                x = table[batch["ids"]]
            else:
                x = jnp.take(table, batch["ids"], axis=0, mode=mode)
            logits = x @ table.T
            labels = jax.nn.one_hot(batch["labels"], logits.shape[-1])
            return -jnp.sum(labels * jax.nn.log_softmax(logits, axis=-1))

        grads = alpa.grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step


@pytest.mark.parametrize("mode", [None, "fill", "clip"])
def test_vocabulary_split_embedding_gradient_is_reduced_once(mode):
    """The tied embedding of Alpa's ``test_embedding_2d_mesh`` on (2, 2): the batch on
    ``x``, the vocabulary on ``y`` (Megatron's vocabulary-parallel embedding). The table's
    gradient is the lookup's scatter-add plus the output matmul's gradient, both partial
    sums over ``x`` (the table is donated, so it arrives vocabulary-split too): the plan
    adds them on each device and all-reduces the sum once
    (``partial_sums.scatter_add_on_block``: the scatter-add runs on the device's vocabulary
    block, its global ids shifted to the block, rows outside it dropped).

    Oracles: one all-reduce of the table's ``[512, 8]`` block, and the objective's closed
    form (Alpa's): that all-reduce over ``x``, two of the ``[4, 8, 8]`` activations over
    ``y`` (the lookup's partial sums, the output matmul's input gradient) and two of the
    ``[4, 8]`` softmax statistics over ``y`` (max, sum). Numbers equal ``jax.jit``, with
    ids out of range where the lookup's mode defines them (dropped or clipped)."""
    vocab, hidden = 1024, 8
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    params = {"embedding": jax.random.normal(keys[0], (vocab, hidden)) * 0.1}
    ids = jax.random.randint(keys[1], (8, 8), 0, vocab)
    if mode is not None:  # below 0 and past the end
        ids = ids.at[0, :3].set(jnp.array([-2, vocab, vocab + 5]))
    batch = {"ids": ids, "labels": jax.random.randint(keys[2], (8, 8), 0, vocab)}
    step = _tied_lookup_step(mode)
    expected_out = jax.jit(step)(params, batch)
    mesh = unit_cost_mesh((2, 2))
    p_step = alpa.parallelize(step, method=alpa.ShardParallel(devices=mesh), donate_argnums=(0,))
    out = p_step(params, batch)
    executable = p_step.get_last_executable()
    assert_allclose(out, expected_out, rtol=1e-4, atol=1e-5)
    assert out["embedding"].sharding.spec == P("y")
    assert collective_shapes(executable.get_hlo_text(), "all-reduce").count("f32[512,8]") == 1
    expected = (
        mesh.all_reduce_cost(vocab * hidden * 4 / 2, 0)
        + 2 * mesh.all_reduce_cost(8 * 8 * hidden * 4 / 2, 1)
        + 2 * mesh.all_reduce_cost(8 * 8 * 4 / 2, 1)
    )
    assert executable.auto_sharding_objective == pytest.approx(expected, rel=0.01)


# ----------------------------------------------------------------------------- reduce-scatter


def test_planned_reduce_scatters_are_written_out(monkeypatch):
    """A 2-D plan of the ILP with ``prefer_reduce_scatter`` (the batch on ``x``, Megatron
    on ``y``) reduce-scatters gradients where its strategies say so (``... RS0->...``).
    Alpa's order rewrites this plan (``gradient_scatter``); the ILP's reduce-scatter
    strategies are what plans it cannot rewrite take (a gradient reduced over both axes,
    inputs the caller placed), here forced by leaving the rewrite out. XLA's partitioner
    would write each as an all-reduce and a slice, which XLA on CPU keeps; the lowering
    writes them out (``reduce_scatters.py``). Oracles: the compiled program holds exactly
    the reduce-scatters the plan prices, and its numbers equal ``jax.jit``'s."""
    from alpa.shard_parallel import auto_sharding

    monkeypatch.setattr(auto_sharding, "scattered_in_alpas_order", lambda *args, **kwargs: None)
    state, batch, step = get_mlp_train_state_and_step(256, 32, num_layers=4)
    option = {"prefer_reduce_scatter": True}
    out, executable = _compile(step, state, batch, (2, 2), **option)
    assert_allclose(out, jax.jit(step)(state, batch), rtol=1e-4, atol=1e-5)
    planned = _plan_collectives(executable, **option)
    assert planned["reduce_scatter"] > 0, planned
    assert _counts(executable).reduce_scatter == planned["reduce_scatter"]
