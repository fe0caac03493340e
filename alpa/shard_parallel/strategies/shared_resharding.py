"""One resharding per value and spec, however many equations read it there.

The lowering reshards a value once for every spec some reader needs it in, and every
reader of that spec takes the one copy (``constrained_eval``: one resharding per value and
spec, inside one jaxpr). The strategy graph prices a resharding per *edge*, per reader:
where two readers need the same spec, it prices two collectives for the program's one. The
MoE layer's backward reads each dispatched tensor a second time (its weight gradient), so
that the four all-to-alls of expert parallelism were priced as seven.

:func:`share_reshardings` closes that gap with a *resharding node* per value read by two
or more equations of the same jaxpr (readers that follow the producer, and so read it in
its own spec, are left out) in a spec more than one of them could need: the node's
strategies are the specs it may hold the value in, the producer's own and those shared
readers' (a strategy ``"reshard"`` each, reading the value in that spec: the node has no
value of its own, ``outvars`` and ``out_specs`` are empty; its edges name the spec,
``src_specs``); an edge from the producer prices resharding into it, and the readers'
edges now start from it. Under the producer's spec the node is the old pricing (each
reader reshards from the value as it is);
under a reader's spec, the readers that take that spec pay once between them. So the
optimum never prices more than before, and a plan whose readers share a spec is priced as
the program runs it. A reader that needs yet another spec is priced from the node's spec,
not from the producer's (as the lowering reshards it): the node then holds the producer's
spec if that is cheaper.

The node has no equation: the plan's specs and the lowering do not change, only what the
ILP pays for them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from alpa.shard_parallel.strategies.sharding_spec import Spec
from alpa.shard_parallel.strategies.strategy_rules import Strategy


def share_reshardings(
    edges: list,
    reads: Mapping[tuple[tuple[int, int], tuple[int, str]], Sequence[int]],
    add_node: Callable[[tuple[int, int], tuple[Strategy, ...]], int],
    matrix: Callable[[tuple[Spec, ...], tuple[Spec | None, ...], float], object],
) -> None:
    """Route the reads of each value that several readers may need in one spec through a
    resharding node (module docstring), in place.

    ``edges``: the graph's edges (``strategy_graph_record.Edge``); ``reads[(source, jaxpr)]``: the
    indices in ``edges`` of the reads of ``source``'s value in one jaxpr (after a number of
    ``alpa.grad`` markers, and at a checkpoint body's path) that may share a
    resharding (not scaled by a loop, not a partial sum's, the reader not following the
    producer); ``add_node(source, strategies)``: adds the resharding node of ``source``'s
    value, returning its id; ``matrix(src_specs, dst_specs, bytes)``: a resharding cost
    matrix."""
    for (source, _), indices in reads.items():
        if len(indices) < 2:
            continue
        shared = _shared_specs([edges[i].dst_specs for i in indices])
        if not shared:
            continue
        first = edges[indices[0]]
        specs = tuple(dict.fromkeys((*first.src_specs, *shared)))
        node = add_node(source, tuple(Strategy("reshard", (), (s,)) for s in specs))
        total = first.nbytes
        into = matrix(first.src_specs, specs, total)
        edges.append(replace(first, dst=node, cost=into, dst_specs=specs))
        for i in indices:
            read = edges[i]
            cost = matrix(specs, read.dst_specs, total)
            edges[i] = replace(read, src=node, cost=cost, src_specs=specs)


def _shared_specs(readers: list[tuple[Spec | None, ...]]) -> list[Spec]:
    """The specs that two or more of ``readers`` (each the specs its strategies read the
    value in) may read, in the order they first appear."""
    seen: dict[Spec, int] = {}
    for specs in readers:
        for spec in dict.fromkeys(s for s in specs if s is not None):
            seen[spec] = seen.get(spec, 0) + 1
    return [spec for spec, count in seen.items() if count > 1]
