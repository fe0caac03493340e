"""The strategy graph as a record: what :func:`~alpa.shard_parallel.strategies.strategy_graph.
build_strategy_graph` makes and the solver, the memory model and the shrinking read.

:class:`StrategyGraph` holds the :class:`Node` of each value producer (its candidate
strategies), the :class:`Edge` of each value read (its resharding cost matrix), the
:class:`PartialSumSite` of each add whose partial results are reduced once, and the
:class:`GraphOptions` it was built with. :func:`live_points` reads liveness off it: the
values alive at each program point where one dies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from jax.extend.core import JaxprEqn, Literal, Var

from alpa.device_mesh import LogicalDeviceMesh
from alpa.shard_parallel.strategies.sharding_spec import Spec
from alpa.shard_parallel.strategies.strategy_rules import Strategy

#: Source of a value: (node id, output index).
Source = tuple[int, int]


@dataclass(frozen=True)
class Node:
    """A producer of values: a jaxpr input, a constant, or an equation."""

    id: int
    label: str
    outvars: tuple[Var, ...]
    strategies: tuple[Strategy, ...]
    follow: int | None
    # out_bytes[k][i]: bytes per device of output k under strategy i.
    out_bytes: tuple[tuple[float, ...], ...]
    # The node's reductions are independent of every other combined node's: XLA merges
    # them into one collective per mesh axis, so their latency is priced once per step
    # (``combined_latency``), not in the strategies' ``comm_cost``.
    combined: bool = False

    @property
    def num_strategies(self) -> int:
        return len(self.strategies)


@dataclass(frozen=True)
class Edge:
    """A value read: ``cost[i, j]`` reshards ``src``'s output under its strategy ``i``
    (spec ``src_specs[i]``) into ``dst_specs[j]`` (``None``: taken as it is), the spec
    ``dst``'s strategy ``j`` reads; the value is ``nbytes`` in full."""

    src: int
    dst: int
    cost: np.ndarray  # [src strategy, dst strategy]
    src_specs: tuple[Spec, ...] = ()
    dst_specs: tuple[Spec | None, ...] = ()
    nbytes: float = 0.0


@dataclass(frozen=True)
class StrategyGraph:
    """Nodes in program order, edges, where each value comes from, and liveness."""

    mesh: LogicalDeviceMesh
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    sources: dict  # Var -> Source
    input_nodes: tuple[int, ...]
    output_sources: tuple[Source | None, ...]
    jaxpr: object
    eqn_sources: tuple[tuple[Source, ...], ...]
    num_eqns: int
    unknown_primitives: tuple[str, ...]
    partial_sums: tuple[PartialSumSite, ...] = ()
    options: GraphOptions | None = None
    # The scans and conds whose bodies are planned (their equations in ``jaxpr``), and the
    # body inputs that are nodes of their own: each carry and each row of a stacked input.
    control_flow: tuple[JaxprEqn, ...] = ()
    body_inputs: tuple[Var, ...] = ()
    # The nodes whose work should split over every device (``ilp_solver.solve``):
    # contractions, and opaque equations that may hold some (not scatters: their FLOPs are
    # priced at the FLOP rate too, but they are no contraction;
    # ``strategy_costs.holds_contractions``).
    contractions: tuple[int, ...] = ()


@dataclass(frozen=True)
class PartialSumSite:
    """An ``add`` of two values that are reduced where they are computed (a contraction,
    scatter-add or sum over a split dimension, perhaps transposed after) and read by
    nothing else: the tied input and output embedding's gradient. Where both producers
    reduce over the same mesh axes into the same spec, the sum of their partial results is
    reduced once, and the edge from the other operand to the add takes the second
    reduction's price back (:func:`partial_sum_discount`); the lowering then reduces once
    (``alpa.shard_parallel.gradients.partial_sums``).

    ``followed`` / ``other``: the reducing nodes behind the operand the add's strategies
    mirror and behind the other one (``other_index``); ``followed_end`` / ``other_end``:
    the nodes of the operands themselves (the same, or the last of a chain of
    :data:`PARTIAL_CHAIN` followers). A follower's strategy ``i`` is its operand's ``i``."""

    eqn: JaxprEqn
    add_node: int
    followed: int
    followed_end: int
    other: int
    other_end: int
    other_index: int
    followed_eqn: JaxprEqn
    other_eqn: JaxprEqn


@dataclass(frozen=True)
class GraphOptions:
    allow_mixed_mesh_shape: bool = False
    allow_recompute_heavy_op: bool = False
    prefer_reduce_scatter: bool = False
    allow_all_gather: bool = True
    allow_all_to_all: bool = True
    # Price an add of two partial results reduced alike as one reduction (PartialSumSite).
    carry_partial_sums: bool = True
    # Price a resharding once for the readers of one spec (shared_resharding): the step is
    # one program up to the alpa.grad marker and one after it. False: once per reader (a
    # pipeline stage's forward and backward are programs of their own).
    share_reshardings: bool = True


def live_points(graph: StrategyGraph) -> list[tuple[Source, ...]]:
    """Live values just before each equation frees an operand for the last time.

    A value is live from its definition (inputs: from the start) to its last read (outputs:
    to the end). Only points where some value dies can be peaks, so only those are kept.
    """
    jaxpr, sources, eqn_sources = graph.jaxpr, graph.sources, graph.eqn_sources
    last_use: dict = {}
    for t, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal):
                last_use[sources[v]] = t
    end = len(jaxpr.eqns)
    for v in jaxpr.outvars:
        if not isinstance(v, Literal):
            last_use[sources[v]] = end
    born: dict = {}
    for v in (*jaxpr.constvars, *jaxpr.invars):
        born[sources[v]] = -1
    for t, outs in enumerate(eqn_sources):
        for src in outs:
            born.setdefault(src, t)
    dying = set(last_use.values())
    points = []
    for t in sorted(dying):
        live = tuple(sorted(s for s, b in born.items() if b <= t and last_use.get(s, b) >= t))
        points.append(live)
    return points
