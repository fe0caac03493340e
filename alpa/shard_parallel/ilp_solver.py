"""The integer linear program that picks one strategy per node (paper §4.2, DESIGN §4.4).

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

The graph is shrunk before the solve, exactly (the optimum does not change):

1. *followers*: a node whose strategies mirror an operand's shares its variable; edges
   inside such a group become unary costs on the diagonal;
2. a group with one strategy is a constant; an edge to it is a unary cost of the other end;
   an edge matrix of the form ``a_i + b_j`` is two unary costs;
3. without a memory budget, *variable elimination*: a group with one neighbour is folded
   into it (``c_u[i] += min_j R[i, j] + c_v[j]``), and a group with two neighbours ``a``,
   ``b`` becomes an edge ``R_ab[i, k] = min_j R_a[i, j] + c_v[j] + R_b[j, k]``.

Before these, a graph of more than ``TIE_LAYERS_ABOVE_GROUPS`` groups has its repeated
structure tied (step 4, :meth:`_Groups.tie_repeated_structure`): a restriction, not an exact
step, that keeps the ILP of an ``L``-layer model the size of one layer's.

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
from alpa.shard_parallel.milp import Milp
from alpa.shard_parallel.sharding_spec import (
    COLLECTIVE_KINDS,
    FORBIDDEN_COST,
    Collective,
    resharding_collectives,
)
from alpa.shard_parallel.strategy_costs import combined_latency, sums_partials, work_shards
from alpa.shard_parallel.strategy_graph import StrategyGraph, live_points


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


#: Graphs with more decision groups than this get repeated structure tied (step 4).
TIE_LAYERS_ABOVE_GROUPS = 150
#: Rounds of colour refinement that decide which groups are "the same" across layers.
TIE_ROUNDS = 3


def solve(
    graph: StrategyGraph,
    memory_budget: float | None = None,
    time_limit: float = 60.0,
    comm_first: bool = True,
) -> Solution:
    """The cheapest choice of strategies (module docstring), communication first.

    The first solve weighs compute only as a tie-breaker (:data:`COMPUTE_TIE_WEIGHT`): the
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
    return replace(full, comm_first=False, solve_time=time.perf_counter() - start)


#: In the communication-first solve, the compute of any one node weighs at most this
#: fraction of the cheapest priced communication event: it breaks ties.
COMPUTE_TIE_WEIGHT = 1e-3


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
    groups = _Groups(graph, comm_first)
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


# ----------------------------------------------------------------------------- shrinking


class _Groups:
    """Decision groups (followers merged), their unary costs and pairwise matrices."""

    def __init__(self, graph: StrategyGraph, comm_first: bool = False):
        self.graph = graph
        n = len(graph.nodes)
        self.parent = list(range(n))
        for node in graph.nodes:
            if node.follow is not None:
                root = self.find(node.follow)
                if len(graph.nodes[root].strategies) == node.num_strategies:
                    self.parent[node.id] = root
        self.roots = sorted({self.find(i) for i in range(n)})
        self.k = {g: graph.nodes[g].num_strategies for g in self.roots}
        self.unary = {g: np.zeros(self.k[g]) for g in self.roots}
        self.tie = {g: np.zeros(self.k[g]) for g in self.roots}
        total_bytes = (
            sum(max(max(b) for b in node.out_bytes) if node.out_bytes else 0.0
                for node in graph.nodes)
            or 1.0
        )  # fmt: skip
        # Repeated layers share strategy tuples and edge matrices: each is read once.
        matrices = {id(e.cost): e.cost for e in graph.edges}
        positive = [m[m > 0].min() for m in matrices.values() if (m > 0).any()]
        positive += [
            s.comm_cost for node in graph.nodes for s in node.strategies if s.comm_cost > 0
        ]
        # Ties between equal-cost plans go to the one with less memory; the weight keeps the
        # whole tie-breaking term below 1e-4 of the cheapest priced event.
        weight = 1e-4 * (min(positive) if positive else 1.0) / total_bytes
        compute_weight = 1.0
        if comm_first and positive:
            # The widest compute range of one node: a node's choice weighs at most the
            # tie fraction of the cheapest collective (a tie-break HiGHS still resolves).
            ranges = [[s.compute_cost for s in n.strategies] for n in graph.nodes if n.strategies]
            most = max((max(r) - min(r) for r in ranges), default=0.0)
            if most > 0:
                compute_weight = COMPUTE_TIE_WEIGHT * min(positive) / most
        costs: dict[int, np.ndarray] = {}
        sizes: dict[tuple, np.ndarray] = {}
        for node in graph.nodes:
            g = self.find(node.id)
            key = id(node.strategies)
            if key not in costs:
                costs[key] = np.array(
                    [s.comm_cost + compute_weight * s.compute_cost for s in node.strategies]
                )
            self.unary[g] += costs[key]
            if node.out_bytes:
                if node.out_bytes not in sizes:
                    sizes[node.out_bytes] = np.sum(node.out_bytes, axis=0)
                self.tie[g] += weight * sizes[node.out_bytes]
        self.adj: dict[int, dict[int, np.ndarray]] = {g: {} for g in self.roots}
        self.alive = set(self.roots)
        self.constant = 0.0
        self.eliminated: list[tuple] = []

    def tie_repeated_structure(self) -> None:
        """Give groups that look the same from ``TIE_ROUNDS`` edges away one variable.

        Colour refinement (Weisfeiler-Lehman) over the node graph: a node's colour starts as
        its primitive, shapes and strategies, and is refined by the colours of its operands
        and consumers. Groups whose roots end with equal colours and equal strategy lists
        are merged: in a stack of identical layers, layer ``i``'s matmul and layer ``j``'s
        take the same strategy. This only restricts the plan (the objective stays the exact
        cost of the chosen plan); it is applied to large graphs, where it keeps the ILP the
        size of one layer.
        """
        graph = self.graph
        initial = []  # per node (node ids are positions in graph.nodes)
        spec_hashes: dict[int, int] = {}  # repeated layers share strategy tuples
        for node in graph.nodes:
            op = node.label.split(" ", 2)[-1] if node.label.startswith("eqn") else node.label
            if node.label.startswith("input"):
                op = "input"
            shapes = tuple(tuple(v.aval.shape) for v in node.outvars)
            specs = spec_hashes.get(id(node.strategies))
            if specs is None:
                specs = hash(tuple(s.out_specs for s in node.strategies))
                spec_hashes[id(node.strategies)] = specs
            initial.append(hash((op, shapes, specs)))
        # The rounds run on arrays: a node's new colour mixes its own, its operands' in
        # order and its consumers' in any order (a sum), with 64-bit wrapping arithmetic.
        colours = np.array(initial, dtype=np.int64).view(np.uint64)
        src = np.array([e.src for e in graph.edges], dtype=np.int64)
        dst = [e.dst for e in graph.edges]
        # Position of each edge among its destination's operands (edges come in order).
        seen: dict[int, int] = {}
        order = []
        for d in dst:
            order.append(seen.get(d, 0))
            seen[d] = order[-1] + 1
        position = np.array(order, dtype=np.uint64)
        dst = np.array(dst, dtype=np.int64)
        for _ in range(TIE_ROUNDS):
            from_preds = np.zeros(len(colours), dtype=np.uint64)
            np.add.at(from_preds, dst, _mix(colours[src] + position * _PRIME))
            from_succs = np.zeros(len(colours), dtype=np.uint64)
            np.add.at(from_succs, src, _mix(colours[dst]))
            colours = _mix(_mix(colours) + _mix(from_preds ^ _SALT) * _PRIME + from_succs)
        colour = colours.tolist()
        by_colour: dict[int, list[int]] = {}
        for g in self.roots:
            by_colour.setdefault(colour[g], []).append(g)
        merged = set()
        for members in by_colour.values():
            head = members[0]
            for g in members[1:]:
                if self.k[g] == self.k[head]:
                    self.parent[g] = head
                    self.unary[head] += self.unary.pop(g)
                    self.tie[head] += self.tie.pop(g)
                    merged.add(g)
        self.roots = [g for g in self.roots if g not in merged]
        self.adj = {g: {} for g in self.roots}
        self.alive = set(self.roots)

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def add_pair(self, g: int, h: int, matrix: np.ndarray) -> None:
        if h in self.adj[g]:
            self.adj[g][h] = self.adj[g][h] + matrix
        else:
            self.adj[g][h] = matrix
        self.adj[h][g] = self.adj[g][h].T

    def remove_pair(self, g: int, h: int) -> None:
        del self.adj[g][h]
        del self.adj[h][g]

    def eliminate_edges(self) -> None:
        for edge in self.graph.edges:
            g, h = self.find(edge.src), self.find(edge.dst)
            if g == h:
                self.unary[g] += np.diagonal(edge.cost)
            elif self.k[g] == 1:
                self.unary[h] += edge.cost[0]
            elif self.k[h] == 1:
                self.unary[g] += edge.cost[:, 0]
            else:
                self.add_pair(g, h, edge.cost)
        for g in self.roots:
            for h in sorted(self.adj[g]):
                if g < h:
                    self._split_if_separable(g, h)

    def _split_if_separable(self, g: int, h: int) -> None:
        m = self.adj[g][h]
        a, b = m[:, 0], m[0, :] - m[0, 0]
        if np.allclose(m, a[:, None] + b[None, :], rtol=1e-12, atol=1e-9):
            self.unary[g] += a
            self.unary[h] += b
            self.remove_pair(g, h)

    def eliminate_variables(self) -> None:
        """Fold groups of degree <= 2 into their neighbours (module docstring, step 3)."""
        queue = sorted(g for g in self.alive if self.k[g] > 1 and len(self.adj[g]) <= 2)
        while queue:
            next_queue = set()
            for v in queue:
                if v not in self.alive or not 0 < len(self.adj[v]) <= 2 or self.k[v] == 1:
                    continue
                neighbours = sorted(self.adj[v])
                cost_v = self.unary[v] + self.tie[v]
                if len(neighbours) == 1:
                    (a,) = neighbours
                    m = self.adj[v][a].T  # [a, v]
                    total = m + cost_v[None, :]
                    self.unary[a] += total.min(axis=1)
                    self.eliminated.append(("leaf", v, a, total))
                    self.remove_pair(v, a)
                    next_queue.add(a)
                elif len(neighbours) == 2:
                    a, b = neighbours
                    ma, mb = self.adj[a][v], self.adj[v][b]  # [a, v], [v, b]
                    total = ma[:, :, None] + cost_v[None, :, None] + mb[None, :, :]
                    self.eliminated.append(("series", v, (a, b), total))
                    self.remove_pair(v, a)
                    self.remove_pair(v, b)
                    self.add_pair(a, b, total.min(axis=1))
                    self._split_if_separable(a, b)
                    next_queue.update((a, b))
                self.alive.discard(v)
            queue = sorted(
                g for g in next_queue if g in self.alive and self.k[g] > 1 and len(self.adj[g]) <= 2
            )

    def back_substitute(self, picks: dict[int, int]) -> dict[int, int]:
        choice = dict(picks)
        for g in self.roots:
            if g in self.alive and g not in choice:
                choice[g] = int(np.argmin(self.unary[g] + self.tie[g]))
        for kind, v, nb, total in reversed(self.eliminated):
            if kind == "leaf":
                choice[v] = int(np.argmin(total[choice[nb]]))
            else:
                a, b = nb
                choice[v] = int(np.argmin(total[choice[a], :, choice[b]]))
        return choice


# ----------------------------------------------------------------------------- ILP


def _solve_ilp(graph, groups: _Groups, core, memory_budget, time_limit):
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


_PRIME = np.uint64(0x9E3779B97F4A7C15)
_SALT = np.uint64(0x5851F42D4C957F2D)


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit integer hash (splitmix64's finaliser), element by element."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _class_of(lines: list[list[int]]) -> dict[int, int]:
    return {i: c for c, members in enumerate(lines) for i in members}


def _incumbent(groups: _Groups, core, s, pairs, relaxed: np.ndarray) -> np.ndarray:
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
    groups = _Groups(graph)
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
