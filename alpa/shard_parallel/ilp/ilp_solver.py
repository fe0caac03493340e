"""The integer linear program that picks one strategy per node (paper §4.2).

With ``s_v`` the one-hot choice of node ``v``, ``c_v`` its communication + compute cost
per strategy, ``R_uv`` the resharding cost matrix of edge ``u -> v`` and ``e_uv`` the one-hot
choice of the strategy pair::

    minimize    sum_v s_v . c_v  +  sum_(u,v) e_uv . R_uv
    subject to  sum_i s_v[i] = 1,   s_v[i] in {0, 1}
                sum_j e_uv[i, j] = s_u[i],   sum_i e_uv[i, j] = s_v[j],   e_uv >= 0
                sum_(v live at t) s_v . m_v <= budget       for each liveness point t

(``e_uv`` is integral whenever ``s`` is, so it is continuous here.) Strategies of ``u``
whose rows of ``R_uv`` are equal (say, several strategies of a matmul that need the same
operand spec) share one row of ``e_uv``, and likewise equal columns: with ``I`` a class of
equal rows and ``J`` one of equal columns, ``sum_J e_uv[I, J] = sum_(i in I) s_u[i]`` and
``sum_I e_uv[I, J] = sum_(j in J) s_v[j]``. For integral ``s`` this prices exactly the
chosen pair, and the LP relaxation is the same (split ``e_uv[I, J]`` in proportion to ``s``).

The graph is shrunk before the solve (``ilp_shrink``): followers share a variable,
constants and separable edges become unary costs, groups of one or two neighbours are
eliminated exactly, and a deep model's repeated layers are tied.

The latency of the reductions XLA combines (``Node.combined``) is not in ``c_v``: it is
paid once per mesh axis that any of them uses (``combined_latency``), which the reported
objective adds. The solve itself leaves that shared term out, so a plan is optimal up to
``sum_a alpha_a``.

What remains goes to the MILP solver that ``global_config.ilp_solver`` names (``milp``:
HiGHS in process by default, or CBC through PuLP); a solve stopped at its time limit with
a feasible plan is reported as such, not as optimal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from alpa.global_env import global_config
from alpa.shard_parallel.ilp.ilp_shrink import (
    TIE_LAYERS_ABOVE_GROUPS,
    Groups,
)
from alpa.shard_parallel.ilp.milp import Milp
from alpa.shard_parallel.strategies.sharding_spec import (
    COLLECTIVE_KINDS,
    FORBIDDEN_COST,
    Collective,
    resharding_collectives,
)
from alpa.shard_parallel.strategies.strategy_costs import (
    combined_latency,
    sums_partials,
    work_shards,
)
from alpa.shard_parallel.strategies.strategy_graph_record import StrategyGraph, live_points


class InfeasibleMemoryBudgetError(ValueError):
    """No plan fits the per-device memory budget."""


@dataclass(frozen=True)
class Solution:
    """The chosen strategy index per node, the plan's cost, and how the solve went."""

    choice: tuple[int, ...]
    objective: float
    status: str
    num_groups: int
    num_ilp_nodes: int
    num_ilp_edges: int
    num_ilp_variables: int
    mean_strategies: float
    solve_time: float
    peak_memory: float | None = None
    #: The compute term of ``objective`` (:func:`compute_cost`); the rest is
    #: communication (:func:`communication_cost`).
    compute: float = 0.0
    #: Whether the plan is the communication-first solve's (:func:`solve`), or the full
    #: objective's (a contraction would otherwise run on fewer devices than it can).
    comm_first: bool = True


def evaluate(graph: StrategyGraph, choice) -> float:
    """The cost of one choice of strategies under the graph's cost model."""
    return communication_cost(graph, choice) + compute_cost(graph, choice)


def communication_cost(graph: StrategyGraph, choice) -> float:
    """Seconds of collectives: each strategy's own, each edge's resharding, and one
    latency per mesh axis for the combined reductions (``combined_latency``)."""
    total = combined_latency(graph, choice)
    for node in graph.nodes:
        total += node.strategies[choice[node.id]].comm_cost
    for edge in graph.edges:
        total += float(edge.cost[choice[edge.src], choice[edge.dst]])
    return total


def collectives(graph: StrategyGraph, choice) -> list[tuple[int, bool, Collective]]:
    """The collectives behind :func:`communication_cost`, as ``(node, reduces,
    collective)``: each chosen strategy's reductions (``reduces``: an all-reduce of the
    node's result per axis it reduces over, or a reduce-scatter into the axis that splits
    the result) and each edge's resharding (``sharding_spec.resharding_collectives``),
    with ``node`` the consumer. Their costs on the mesh add up to
    :func:`communication_cost` but for the latency of combined reductions.
    A reduction the graph prices once for two partial results (``PartialSumSite``) is
    listed once."""
    mesh = graph.mesh
    merged = {
        site.other
        for site in graph.partial_sums
        if sums_partials(graph.nodes, site, choice[site.other], choice[site.add_node])
    }
    out = []
    for node in graph.nodes:
        if node.id in merged:
            continue
        strategy = node.strategies[choice[node.id]]
        split = {a for spec in strategy.out_specs for axes in spec for a in axes}
        for axis in strategy.reduce_axes:
            if mesh.shape[axis] == 1:
                continue
            per_device = node.out_bytes[0][choice[node.id]]
            if axis in split:  # reduce-scatter: priced on the unscattered buffer
                scattered = per_device * mesh.shape[axis]
                out.append((node.id, True, Collective("reduce-scatter", axis, scattered)))
            else:
                out.append((node.id, True, Collective("all-reduce", axis, per_device)))
    allow_all_to_all = graph.options is None or graph.options.allow_all_to_all
    for edge in graph.edges:
        if not edge.src_specs:
            continue
        src, dst = edge.src_specs[choice[edge.src]], edge.dst_specs[choice[edge.dst]]
        if dst is None:
            continue
        for c in resharding_collectives(src, dst, edge.nbytes, mesh, allow_all_to_all):
            out.append((edge.dst, False, c))
    return out


def bytes_by_kind(collectives) -> dict[str, float]:
    """Bytes per device of ``collectives`` by kind (``Collective``'s convention)."""
    total = dict.fromkeys(COLLECTIVE_KINDS, 0.0)
    for c in collectives:
        total[c.kind] += c.nbytes
    return total


def compute_cost(graph: StrategyGraph, choice) -> float:
    """Seconds of work on one device: contraction FLOPs and bytes written."""
    return sum(node.strategies[choice[node.id]].compute_cost for node in graph.nodes)


def peak_memory(graph: StrategyGraph, choice) -> float:
    """Bytes per device at the fullest liveness point under ``choice``."""
    best = 0.0
    for live in live_points(graph):
        best = max(best, sum(graph.nodes[n].out_bytes[k][choice[n]] for n, k in live))
    return best


def solve(
    graph: StrategyGraph,
    memory_budget: float | None = None,
    time_limit: float = 60.0,
    comm_first: bool = True,
) -> Solution:
    """The cheapest choice of strategies (module docstring), communication first.

    The first solve weighs compute only as a tie-breaker (``ilp_shrink.COMPUTE_TIE_WEIGHT``): the
    least communication, and among such plans the least compute. When that plan splits
    every contraction over as many devices as its strategies allow
    (:func:`splits_contractions_evenly`), it is the plan: trading communication for the
    rest of the compute term (memory-bound work: elementwise ops, the optimizer update)
    would rest on the cost model's weakest estimates, and Alpa's plans (data parallel as
    one all-reduce, Megatron's alternating layers) are the communication-optimal ones.
    Otherwise (a contraction would run replicated: ``allow_recompute_heavy_op``) the full
    objective, communication plus compute, is solved again and its plan taken.

    With ``prefer_reduce_scatter`` only the full objective is solved: the option asks for
    ZeRO-2's trade, a reduce-scatter and an all-gather (one latency more than the combined
    all-reduce) for the optimizer update on a shard of each gradient. So it is with
    ``comm_first=False`` (the pipeline's stages: see ``docs/auto_sharding.md``)."""
    start = time.perf_counter()
    if not comm_first or (graph.options is not None and graph.options.prefer_reduce_scatter):
        return _solve(graph, memory_budget, time_limit, comm_first=False)
    first = _solve(graph, memory_budget, time_limit, comm_first=True)
    if splits_contractions_evenly(graph, first.choice):
        return replace(first, solve_time=time.perf_counter() - start)
    left = max(time_limit - (time.perf_counter() - start), 0.0)
    full = _solve(graph, memory_budget, left, comm_first=False)
    return replace(full, solve_time=time.perf_counter() - start)


def splits_contractions_evenly(graph: StrategyGraph, choice) -> bool:
    """Whether every contraction node of ``graph`` takes, under ``choice``, a strategy that
    splits its work over as many devices as the most any of its affordable strategies do
    (``strategy_costs.work_shards``)."""
    mesh = graph.mesh
    for n in graph.contractions:
        node = graph.nodes[n]
        most = max(
            (work_shards(mesh, s) for s in node.strategies if s.comm_cost < FORBIDDEN_COST),
            default=1,
        )
        if work_shards(mesh, node.strategies[choice[n]]) < most:
            return False
    return True


def _solve(graph: StrategyGraph, memory_budget, time_limit, comm_first: bool) -> Solution:
    start = time.perf_counter()
    groups = Groups(graph, comm_first)
    if len(groups.roots) > TIE_LAYERS_ABOVE_GROUPS:
        groups.tie_repeated_structure()
    groups.eliminate_edges()
    if memory_budget is None:
        groups.eliminate_variables()
    core = sorted(g for g in groups.alive if groups.k[g] > 1)
    num_pairs = sum(1 for g in core for h in groups.adj[g] if g < h)
    status = "optimal"
    num_vars = 0
    if core and (num_pairs or memory_budget is not None):
        picks, status, num_vars = _solve_ilp(graph, groups, core, memory_budget, time_limit)
    else:
        picks = {g: int(np.argmin(groups.unary[g] + groups.tie[g])) for g in core}
    group_choice = groups.back_substitute(picks)
    choice = tuple(group_choice[groups.find(n.id)] for n in graph.nodes)
    ks = [groups.k[g] for g in groups.roots]
    return Solution(
        choice=choice,
        objective=evaluate(graph, choice),
        compute=compute_cost(graph, choice),
        status=status,
        num_groups=len(groups.roots),
        num_ilp_nodes=len(core),
        num_ilp_edges=num_pairs,
        num_ilp_variables=num_vars,
        mean_strategies=float(np.mean(ks)) if ks else 0.0,
        solve_time=time.perf_counter() - start,
        peak_memory=None if memory_budget is None else peak_memory(graph, choice),
        comm_first=comm_first,
    )


# ----------------------------------------------------------------------------- ILP


def _solve_ilp(graph, groups: Groups, core, memory_budget, time_limit):
    model = Milp()
    s = {g: model.add_binaries(groups.unary[g] + groups.tie[g]) for g in core}
    pairs = []  # (g, h, the class of each row and column, the e variables)
    for g in core:
        model.add_row(s[g], [1.0] * len(s[g]), 1.0, 1.0, distinct=True)
    for g in core:
        for h in sorted(groups.adj[g]):
            if h < g:
                continue
            m = groups.adj[g][h]
            rows, cols = _equal_lines(m), _equal_lines(m.T)
            costs = m[np.ix_([ri[0] for ri in rows], [cj[0] for cj in cols])]
            flat = model.add_vars(costs.ravel().tolist())
            pairs.append((g, h, _class_of(rows), _class_of(cols), len(cols), flat))
            e = [flat[a * len(cols) : (a + 1) * len(cols)] for a in range(len(rows))]
            # The variables of one row are distinct (e's, then s's): nothing to merge.
            for a, members in enumerate(rows):
                model.add_row(
                    e[a] + [s[g][i] for i in members],
                    [1.0] * len(e[a]) + [-1.0] * len(members),
                    0.0,
                    0.0,
                    distinct=True,
                )
            for b, members in enumerate(cols):
                column = flat[b :: len(cols)]
                model.add_row(
                    column + [s[h][j] for j in members],
                    [1.0] * len(column) + [-1.0] * len(members),
                    0.0,
                    0.0,
                    distinct=True,
                )
    if memory_budget is not None:
        _add_memory_constraints(model, graph, groups, s, memory_budget)
    else:
        model.presolve = False  # Milp.presolve
        model.incumbent = lambda relaxed: _incumbent(groups, core, s, pairs, relaxed)
    solver = global_config.ilp_solver
    values, status = model.solve(solver, time_limit)
    if values is None:
        if memory_budget is not None:
            raise InfeasibleMemoryBudgetError(_infeasible_message(graph, memory_budget, time_limit))
        raise RuntimeError(
            f"the auto-sharding ILP found no plan with {solver}: {status} "
            f"(time limit {time_limit} s)"
        )
    picks = {g: int(np.argmax(values[s[g]])) for g in core}
    return picks, status, model.num_vars


def _class_of(lines: list[list[int]]) -> dict[int, int]:
    return {i: c for c, members in enumerate(lines) for i in members}


def _incumbent(groups: Groups, core, s, pairs, relaxed: np.ndarray) -> np.ndarray:
    """A plan to start the MILP from, when its LP relaxation is fractional: each group's
    largest value in ``relaxed``, then improved one group at a time (each takes its
    cheapest strategy given its neighbours', until none changes: a local optimum). Handed
    to HiGHS as its first incumbent, it changes no objective (HiGHS still proves the
    optimum) but most of the solve time: on GPT-39B's stage-cost ILPs whose relaxations
    are fractional, this start is within 5e-5 of the optimum and HiGHS takes 0.15-0.35 s
    instead of about 1 s to finish."""
    pick = {g: int(np.argmax(relaxed[s[g]])) for g in core}
    unary = {g: groups.unary[g] + groups.tie[g] for g in core}
    for _ in range(100):
        changed = False
        for g in core:
            cost = unary[g].copy()
            for h, m in groups.adj[g].items():
                if h in pick:
                    cost += m[:, pick[h]]
            best = int(np.argmin(cost))
            if cost[best] < cost[pick[g]] - 1e-12 * max(1.0, abs(cost[pick[g]])):
                pick[g], changed = best, True
        if not changed:
            break
    values = np.zeros(len(relaxed))
    for g in core:
        values[s[g][pick[g]]] = 1.0
    for g, h, row_class, col_class, num_cols, flat in pairs:
        values[flat[row_class[pick[g]] * num_cols + col_class[pick[h]]]] = 1.0
    return values


def _equal_lines(m: np.ndarray) -> list[list[int]]:
    """Indices of equal rows of ``m``, grouped, in order of first appearance."""
    classes: dict[bytes, list[int]] = {}
    for i, row in enumerate(m):
        classes.setdefault(row.tobytes(), []).append(i)
    return list(classes.values())


def _memory_terms(graph, groups, s, live):
    """Bytes alive at one point: per group, the summed sizes of its live values."""
    per_group: dict[int, np.ndarray] = {}
    constant = 0.0
    for n, k in live:
        g = groups.find(n)
        sizes = np.asarray(graph.nodes[n].out_bytes[k])
        if g in s:
            per_group[g] = per_group.get(g, 0.0) + sizes
        else:
            constant += float(sizes[0])
    # One coefficient per variable: an affine expression keeps only the last of duplicates.
    terms = [
        (var, float(b))
        for g in sorted(per_group)
        for b, var in zip(per_group[g], s[g], strict=True)
    ]
    return terms, constant


def _add_memory_constraints(model: Milp, graph, groups, s, budget) -> None:
    seen = set()
    for live in live_points(graph):
        if live in seen:
            continue
        seen.add(live)
        terms, constant = _memory_terms(graph, groups, s, live)
        model.add_row([v for v, _ in terms], [c for _, c in terms], -np.inf, budget - constant)


def _infeasible_message(graph, budget, time_limit) -> str:
    smallest = smallest_peak_memory(graph, time_limit)
    return (
        f"memory_budget_per_device={budget:.0f} bytes cannot be met: the smallest plan found "
        f"needs {smallest:.0f} bytes per device at its peak on logical mesh "
        f"{graph.mesh.shape}; raise the budget or use more devices"
    )


def smallest_peak_memory(graph, time_limit) -> float:
    """The least peak memory of any plan (min over plans of max over liveness points)."""
    groups = Groups(graph)
    core = [g for g in groups.roots if groups.k[g] > 1]
    model = Milp()
    s = {g: model.add_binaries([0.0] * groups.k[g]) for g in core}
    for g in core:
        model.add_row(s[g], [1.0] * len(s[g]), 1.0, 1.0, distinct=True)
    peak = model.add_var(1.0, 0.0, np.inf)
    for live in set(live_points(graph)):
        terms, constant = _memory_terms(graph, groups, s, live)
        index = [v for v, _ in terms] + [peak]
        model.add_row(index, [c for _, c in terms] + [-1.0], -np.inf, -constant)
    values, _ = model.solve(global_config.ilp_solver, time_limit)
    return float(values[peak]) if values is not None else float("nan")
