"""Shrinking the auto-sharding ILP before the solve (``ilp_solver``): decision groups, exact
eliminations, and tying the repeated layers of a deep model.

The graph is shrunk exactly (the optimum does not change) but for step 1, which restricts
it as Alpa's ILP does:

1. *followers*: a node whose strategies mirror an operand's shares its variable; edges
   inside such a group become unary costs on the diagonal. Not so a follower of the
   step's *state* (an input that a state edge ties to the updated value it returns):
   the state's spec is how it is stored, and its consumers may compute in another one.
   Tied to it, the optimizer's update of a parameter had to run in the parameter's own
   spec; untied, the ILP may update each shard of a reduce-scattered gradient and
   gather the new parameter (ZeRO-2, ``prefer_reduce_scatter``: on Alpa's 6-layer MLP
   with Adafactor on 4 devices, communication 55884 -> 39355 and the sum with compute
   714209 -> 697968);
2. a group with one strategy is a constant; an edge to it is a unary cost of the other end;
   an edge matrix of the form ``a_i + b_j`` is two unary costs;
3. without a memory budget, *variable elimination*: a group with one neighbour is folded
   into it (``c_u[i] += min_j R[i, j] + c_v[j]``), and a group with two neighbours ``a``,
   ``b`` becomes an edge ``R_ab[i, k] = min_j R_a[i, j] + c_v[j] + R_b[j, k]``.

Before these, a graph of more than ``TIE_LAYERS_ABOVE_GROUPS`` groups has its repeated
structure tied (step 4, :meth:`Groups.tie_repeated_structure`): a restriction, not an exact
step, that keeps the ILP of an ``L``-layer model the size of one layer's.
"""

from __future__ import annotations

import numpy as np

from alpa.shard_parallel.strategies.strategy_graph_record import StrategyGraph

#: Graphs with more decision groups than this get repeated structure tied (step 4).
TIE_LAYERS_ABOVE_GROUPS = 150
#: Rounds of colour refinement that decide which groups are "the same" across layers: two
#: groups are tied when everything within this many edges of them looks alike. With 3
#: rounds nodes that only look alike up close were tied too (two different matmuls of a
#: layer's backward; the scales and biases of every layer norm, the final one's included),
#: and the tie cost optimality: a 2-layer GPT of hidden size 64 on (2, 4) communicated 5 %
#: more than the untied optimum (141429 against 134661), GPT-125M on (2, 4) cost 0.16 %
#: more in all, and a BERT MLM on (2, 2) without all-to-all 18 % more (27 all-reduces
#: against 15). With 6 each reaches the untied optimum, and the ILP keeps a size that does
#: not grow with depth (GPT-125M to 1.3B on (2, 4): 319 groups where 3 rounds left 193,
#: and 125M has 2382 untied; the solve takes 1.4 s on 2 cores, 0.6-0.9 s with 3 rounds).
TIE_ROUNDS = 6


#: In the communication-first solve, the compute of any one node weighs at most this
#: fraction of the cheapest priced communication event: it breaks ties.
COMPUTE_TIE_WEIGHT = 1e-3


class Groups:
    """Decision groups (followers merged), their unary costs and pairwise matrices."""

    def __init__(self, graph: StrategyGraph, comm_first: bool = False):
        self.graph = graph
        n = len(graph.nodes)
        self.parent = list(range(n))
        inputs = set(graph.input_nodes)
        state = {e.dst for e in graph.edges if e.dst in inputs}
        for node in graph.nodes:
            if node.follow is not None and node.follow not in state:
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
                # (A resharding node holds no value: the specs it reads.)
                specs = hash(tuple(s.out_specs or s.in_specs for s in node.strategies))
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


_PRIME = np.uint64(0x9E3779B97F4A7C15)
_SALT = np.uint64(0x5851F42D4C957F2D)


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit integer hash (splitmix64's finaliser), element by element."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))
