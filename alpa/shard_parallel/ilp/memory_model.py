"""The memory model of the auto-sharding budget: what XLA holds per device.

``AutoShardingOption.memory_budget_per_device`` bounds the allocation XLA reports for the
compiled step (``get_total_allocation_size``): arguments + outputs + temporaries - donated
aliases. The ILP (``ilp_solver``) bounds the bytes live at every point of the liveness of
a strategy graph; :func:`xla_memory_graph` rewrites the graph so that its liveness is
XLA's, and :func:`solve_within_budget` solves on that graph. The model is an estimate: XLA's
collective buffers and alignment are not in it, and a resharded operand's copy is counted
whether or not the chosen plan reshards it (an upper bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from jax.extend.core import Literal, Var

from alpa.shard_parallel.ilp import ilp_solver
from alpa.shard_parallel.strategies.sharding_spec import nbytes, num_shards, replicated
from alpa.shard_parallel.strategies.strategy_graph_record import Node, StrategyGraph
from alpa.shard_parallel.strategies.strategy_rules import Strategy


def xla_memory_graph(graph: StrategyGraph, state_pairs: Sequence[tuple[int, int]]) -> StrategyGraph:
    """``graph`` with the liveness of XLA's buffer assignment, for the memory budget.

    XLA reports a step's allocation per device as arguments + outputs + temporaries -
    donated aliases: the caller's arguments and the step's results are allocations of the
    whole step, and intermediates share the temporary heap, resharded copies of operands
    included. The solver's liveness (``strategy_graph_record.live_points``) instead frees an input
    after its last read, allocates an output where it is computed, and knows no copies,
    which undercounts what XLA holds. This graph has the same nodes, strategies and costs,
    plus zero-cost *copy nodes*, and the jaxpr the liveness is read from is rewritten so
    that:

    * every input that is not donated into an output is live from the start to the end;
    * every output is live from the first equation to the end;
    * a donated input paired with an output (``state_pairs``) is not counted at all: its
      buffer is the output's;
    * every operand an equation reads in its own spec (not the one it follows) has a copy
      of that spec's size, live while the equation runs: the buffer a resharding writes.
      It is counted whether or not the producer's spec differs, an upper bound: which of
      the two happens is an edge decision, and the solver's memory terms are per node.

    A copy node follows its consumer, so the solver gives it the consumer's variable; the
    first ``len(graph.nodes)`` entries of a choice for this graph are a choice for ``graph``.
    """
    jaxpr = graph.jaxpr
    nodes = list(graph.nodes)
    sources = dict(graph.sources)
    eqns = list(jaxpr.eqns)
    eqn_sources = [list(x) for x in graph.eqn_sources]
    for t, eqn in enumerate(jaxpr.eqns):
        if not graph.eqn_sources[t]:  # an alias equation: no node
            continue
        consumer = graph.nodes[graph.eqn_sources[t][0][0]]
        copies = []
        for j, v in enumerate(eqn.invars):
            if isinstance(v, Literal) or sources[v][0] == consumer.follow:
                continue
            needs = [s.in_specs[j] if j < len(s.in_specs) else None for s in consumer.strategies]
            if all(n is None for n in needs):
                continue
            size = nbytes(v.aval.shape, v.aval.dtype.itemsize)
            rank = len(v.aval.shape)
            specs = [replicated(rank) if n is None else n for n in needs]
            copy = Var(v.aval)
            node = Node(
                id=len(nodes),
                label=f"copy of operand {j} of eqn {t}",
                outvars=(copy,),
                strategies=tuple(Strategy("operand copy", (s,), ()) for s in specs),
                follow=consumer.id,
                out_bytes=(
                    tuple(0.0 if n is None else size / num_shards(n, graph.mesh) for n in needs),
                ),
            )
            nodes.append(node)
            sources[copy] = (node.id, 0)
            eqn_sources[t].append((node.id, 0))
            copies.append(copy)
        if copies:
            eqns[t] = eqn.replace(invars=[*eqn.invars, *copies])
    donated = {i for i, _ in state_pairs}
    held = [v for i, v in enumerate(jaxpr.invars) if i not in donated]
    inputs = {graph.sources[v] for v in jaxpr.invars}
    results = []
    for src in graph.output_sources:
        if src is not None and src not in inputs and src not in results:
            results.append(src)
    if eqn_sources:
        eqn_sources[0] = [*results, *eqn_sources[0]]
    memory_jaxpr = jaxpr.replace(invars=held, outvars=[*jaxpr.outvars, *held], eqns=eqns)
    return replace(
        graph,
        nodes=tuple(nodes),
        sources=sources,
        jaxpr=memory_jaxpr,
        eqn_sources=tuple(tuple(x) for x in eqn_sources),
    )


def xla_peak_memory(
    graph: StrategyGraph, choice: Sequence[int], state_pairs: Sequence[tuple[int, int]] = ()
) -> float:
    """Peak bytes per device of ``choice`` (one strategy per node of ``graph``) under the
    memory model of the budget (:func:`xla_memory_graph`)."""
    memory_graph = xla_memory_graph(graph, state_pairs)
    full = list(choice)
    for node in memory_graph.nodes[len(full) :]:
        full.append(full[node.follow])
    return ilp_solver.peak_memory(memory_graph, full)


def solve_within_budget(
    graph: StrategyGraph, budget: float, time_limit: float, state_pairs, comm_first: bool = True
) -> ilp_solver.Solution:
    """The cheapest plan whose peak bytes per device, as XLA allocates them
    (:func:`xla_memory_graph`), fit ``budget`` (``comm_first``: as ``ilp_solver.solve``)."""
    memory_graph = xla_memory_graph(graph, state_pairs)
    solution = ilp_solver.solve(memory_graph, budget, time_limit, comm_first)
    solution = replace(solution, choice=solution.choice[: len(graph.nodes)])
    # Without a pairwise term the solver may pick per group without an ILP; the budget must
    # hold all the same.
    if solution.peak_memory is not None and solution.peak_memory > budget * (1 + 1e-9):
        raise ilp_solver.InfeasibleMemoryBudgetError(
            ilp_solver._infeasible_message(memory_graph, budget, time_limit)
        )
    return solution
