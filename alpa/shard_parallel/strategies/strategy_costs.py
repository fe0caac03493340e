"""What a strategy graph's nodes cost: work, combined reductions and partial sums.

A node's strategies carry their cost per device (paper §4.2): ``compute_cost``, the seconds
one device spends on its share of the equation (:func:`work_cost`: contractions at the
device's FLOP rate, everything else by the bytes it writes), and ``comm_cost``, the
collectives the strategy runs. Two effects of XLA are priced here rather than in the rules:

* XLA combines the gradient all-reduces of a step into one collective per mesh axis
  (:func:`combinable_reductions`): such a node's strategies leave their reductions' latency
  out (:func:`priced_strategies`) and the solver adds it once per axis
  (:func:`combined_latency`).
* An add of two partial results reduced alike is reduced once, not twice
  (:func:`partial_sum_discount`, over
  :class:`~alpa.shard_parallel.strategies.strategy_graph_record.PartialSumSite`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
from jax.extend.core import DropVar, JaxprEqn, Literal, Var, jaxprs_in_params

from alpa.cost_profile import DATA_MOVEMENT
from alpa.device_mesh import LogicalDeviceMesh
from alpa.shard_parallel.strategies.sharding_spec import FORBIDDEN_COST, nbytes, num_shards
from alpa.shard_parallel.strategies.strategy_rules import Strategy
from alpa.shard_parallel.strategies.strategy_rules_contraction import dot_free_dims
from alpa.tracing.flops import eqn_flops

if TYPE_CHECKING:
    from alpa.shard_parallel.strategies.strategy_graph_record import (
        Node,
        PartialSumSite,
        StrategyGraph,
    )


#: Primitives whose FLOPs are priced at the device's FLOP rate (the others are
#: memory-bound: they are priced by the bytes they write).
CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})


def contraction_flops(eqn: JaxprEqn) -> float:
    """FLOPs priced at the device rate: a contraction's, or the body of an opaque equation
    (a loop, a branch, a rematerialized call) that runs as one node."""
    if eqn.primitive.name in CONTRACTIONS or any(True for _ in jaxprs_in_params(eqn.params)):
        return eqn_flops(eqn)
    return 0.0


def holds_contractions(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` is a contraction or an opaque equation whose body may hold some:
    the work that should be split over every device (``ilp_solver.solve``). A scatter's
    jaxpr, or a generic reduction's, only combines two elements: an embedding gradient's
    scatter-add is no contraction, whatever its FLOPs are priced at."""
    name = eqn.primitive.name
    if name in CONTRACTIONS:
        return True
    if name.startswith("scatter") or name in ("reduce", "reduce_window"):
        return False
    return any(True for _ in jaxprs_in_params(eqn.params))


def work_shards(mesh: LogicalDeviceMesh, strategy: Strategy) -> int:
    """Over how many devices ``strategy`` splits its equation's work: the product of the
    mesh axes that split some operand or result (an unused axis repeats the work)."""
    used = set()
    for spec in (*strategy.out_specs, *strategy.in_specs):
        if spec is not None:
            for axes in spec:
                used.update(axes)
    return math.prod(mesh.shape[a] for a in used)


def work_cost(
    mesh: LogicalDeviceMesh,
    strategy: Strategy,
    flops: float,
    out_sizes: Sequence[float],
    eqn: JaxprEqn | None = None,
) -> float:
    """Seconds one device spends running ``strategy`` of an equation of ``flops`` whose
    results are ``out_sizes`` bytes in full (``LogicalDeviceMesh.compute_cost``).

    The work splits over every mesh axis that splits some operand or result: a mesh axis
    the strategy leaves unused repeats the work on each of its devices, so replicated work
    is priced at full size on every device. Each device writes its shard of each result.
    Where the mesh has measured rates, a ``dot_general`` ``eqn`` is priced at the rate of
    its per-device shape under the strategy (:func:`local_dot_dims`), and the bytes of
    data movement (``cost_profile.DATA_MOVEMENT``) at the measured copy rate.
    """
    shards = work_shards(mesh, strategy)
    written = sum(
        size / num_shards(spec, mesh)
        for size, spec in zip(out_sizes, strategy.out_specs, strict=True)
    )
    if mesh.rates is None or eqn is None:
        return mesh.compute_cost(flops / shards, written)
    dot = None
    if flops > 0 and eqn.primitive.name == "dot_general":
        dot = local_dot_dims(eqn, strategy, mesh)
    movement = eqn.primitive.name in DATA_MOVEMENT
    return mesh.compute_cost(flops / shards, written, dot, operand_dtype(eqn), movement)


def local_dot_dims(
    eqn: JaxprEqn, strategy: Strategy, mesh: LogicalDeviceMesh
) -> tuple[float, float, float, float]:
    """``(batch, m, k, n)`` of one device's share of a ``dot_general`` under ``strategy``:
    the products of its operands' batch, free and contracting dimensions, each dimension
    divided by the mesh axes the strategy's operand spec splits it over (a ``None`` spec:
    whole)."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    local = []
    for operand, spec in zip(eqn.invars[:2], strategy.in_specs[:2], strict=True):
        shape = getattr(operand.aval, "shape", ())
        local.append(
            [
                size / (1 if spec is None else math.prod(mesh.shape[a] for a in spec[d]))
                for d, size in enumerate(shape)
            ]
        )
    lhs, rhs = local
    batch = math.prod(lhs[d] for d in lhs_batch)
    k = math.prod(lhs[d] for d in lhs_contract)
    m = math.prod(lhs[d] for d in range(len(lhs)) if d not in (*lhs_contract, *lhs_batch))
    n = math.prod(rhs[d] for d in range(len(rhs)) if d not in (*rhs_contract, *rhs_batch))
    return batch, m, k, n


def operand_dtype(eqn: JaxprEqn) -> str:
    """The dtype an equation computes in: its first operand's (a matmul of bf16 operands
    runs at bf16's rate whatever it accumulates in)."""
    for v in (*eqn.invars, *eqn.outvars):
        dtype = getattr(getattr(v, "aval", None), "dtype", None)
        if dtype is not None:
            return np.dtype(dtype).name
    return "float32"


def priced_strategies(
    mesh: LogicalDeviceMesh, eqn: JaxprEqn, strategies: Sequence[Strategy], combined: bool
) -> tuple[Strategy, ...]:
    """A rule's ``strategies`` of ``eqn`` as graph nodes hold them: with their compute cost
    (:func:`work_cost`) and, for a ``combined`` node, the latency of their reductions taken
    out of ``comm_cost`` (:func:`combined_latency` adds it once per mesh axis)."""
    flops = contraction_flops(eqn)
    sizes = [nbytes(getattr(v.aval, "shape", ()), itemsize(v.aval)) for v in eqn.outvars]
    priced = []
    for s in strategies:
        comm = s.comm_cost
        if combined:
            comm -= sum(mesh.collective_latency("all-reduce", a) for a in all_reduce_axes(s))
        compute = work_cost(mesh, s, flops, sizes, eqn)
        priced.append(replace(s, comm_cost=comm, compute_cost=compute))
    return tuple(priced)


def force_batch_axis(
    eqn: JaxprEqn,
    strategies: tuple[Strategy, ...],
    batch_dims: Mapping,
    axis: int,
    split: bool = True,
) -> tuple[Strategy, ...]:
    """``strategies`` with those that leave mesh ``axis`` off the batch dimension of a
    result or of an operand priced at ``FORBIDDEN_COST``.

    Operands count as in Alpa: an equation that contracts or reduces the batch away (a
    weight gradient ``x.T @ dy``, a bias gradient's sum over rows) must still read its
    batch operands split over ``axis``, and so reduces its partial results; it may not
    first move them to another split (an all-to-all) to skip that reduction.

    ``split=False`` (``axis`` has one device): the batch dimension stays whole, as Alpa
    maps it to that axis and to no other (a (1, 4) mesh forced to axis 0 is model
    parallel)."""
    outs = [batch_dims.get(v) if isinstance(v, Var) else None for v in eqn.outvars]
    ins = [batch_dims.get(v) if isinstance(v, Var) else None for v in eqn.invars]
    if not any(d is not None and len(d) == 1 for d in (*outs, *ins)):
        return strategies

    def on_axis(dim_axes) -> bool:
        return axis in dim_axes if split else not dim_axes

    def kept(dims, specs) -> bool:
        return all(
            d is None or len(d) != 1 or spec is None or on_axis(spec[d[0]])
            for d, spec in zip(dims, specs, strict=True)
        )

    merged_in, merged_out = _merged_free_dims(eqn, ins)

    def keeps(strategy: Strategy) -> bool:
        return (
            kept(outs, strategy.out_specs)
            and kept(ins, strategy.in_specs)
            and not any(_splits(strategy.in_specs[i], d) for i, d in merged_in)
            and not any(_splits(strategy.out_specs[0], d) for d in merged_out)
        )

    return tuple(
        s if keeps(s) else replace(s, comm_cost=s.comm_cost + FORBIDDEN_COST) for s in strategies
    )


#: The sums of partial results carried through an add (:class:`PartialSumSite`): the
#: producers the lowering can run on each device's blocks, the ops that may follow them
#: on the way to the add (they map a device's block to its block of the result), and the
#: adds.
PARTIAL_PRODUCERS = frozenset({"dot_general", "conv_general_dilated", "scatter-add", "reduce_sum"})
PARTIAL_CHAIN = frozenset({"transpose", "convert_element_type", "copy", "neg"})
PARTIAL_SUM_ADDS = frozenset({"add", "add_any"})


def partial_chain(var, producer: Callable, reads: Mapping) -> list[JaxprEqn] | None:
    """``[root, *chain]``: the reducing equation behind ``var`` and the chain of
    :data:`PARTIAL_CHAIN` equations from it to ``var``, each value on the way read once;
    ``None`` where ``var`` is not such a value. ``producer(v)`` is ``v``'s equation."""
    chain = []
    while True:
        eqn = producer(var)
        if eqn is None or reads.get(var, 0) != 1:
            return None
        chain.append(eqn)
        if eqn.primitive.name in PARTIAL_PRODUCERS:
            return chain[::-1]
        if eqn.primitive.name not in PARTIAL_CHAIN or not isinstance(eqn.invars[0], Var):
            return None
        var = eqn.invars[0]


def sums_partials(nodes: Sequence[Node], site: PartialSumSite, i: int, j: int) -> bool:
    """Whether, with strategy ``i`` of the other operand's chain and ``j`` of the add (and
    of the followed chain), the add sums two partial results reduced alike: both reducing
    strategies reduce over the same mesh axes, each can run on a device's blocks
    (:func:`runs_blockwise`), and the operands' specs are equal and read by the add as they
    are."""
    other, followed = nodes[site.other].strategies[i], nodes[site.followed].strategies[j]
    spec = nodes[site.other_end].strategies[i].out_specs[0]
    return (
        bool(other.reduce_axes)
        and other.reduce_axes == followed.reduce_axes
        and spec == nodes[site.followed_end].strategies[j].out_specs[0]
        and spec == nodes[site.add_node].strategies[j].in_specs[site.other_index]
        and runs_blockwise(site.other_eqn, other)
        and runs_blockwise(site.followed_eqn, followed)
    )


def runs_blockwise(eqn: JaxprEqn, strategy: Strategy) -> bool:
    """Whether ``eqn`` computes, on each device's blocks of its operands under
    ``strategy``, that device's block of its partial result: a contraction or sum always
    does; a scatter-add where each indexed dimension of its table that is split is one
    row wide in each update (``inserted_window_dims``): its global indices are then
    shifted to the block (``partial_sums.scatter_add_on_block``)."""
    if eqn.primitive.name != "scatter-add":
        return True
    table = strategy.in_specs[0]
    numbers = eqn.params["dimension_numbers"]
    return all(
        not table[d] or d in numbers.inserted_window_dims
        for d in numbers.scatter_dims_to_operand_dims
    )


def partial_sum_discount(nodes: Sequence[Node], site: PartialSumSite) -> np.ndarray:
    """``[other operand's strategy, add strategy]``: minus the other reduction's price (its
    ``comm_cost``) where the add sums two partial results (:func:`sums_partials`): one
    reduction of the sum is paid, by the followed producer, instead of two."""
    other, add = nodes[site.other], nodes[site.add_node]
    discount = np.zeros((other.num_strategies, add.num_strategies))
    for i, o in enumerate(other.strategies):
        for j in range(add.num_strategies):
            if sums_partials(nodes, site, i, j):
                discount[i, j] = -o.comm_cost
    return discount


def combinable_reductions(jaxpr) -> set[int]:
    """Equations (by index) whose reductions XLA combines into one collective per step.

    XLA's all-reduce combiner merges collectives that do not depend on each other: the
    gradient reductions of a step, which feed only the optimizer update. An equation
    qualifies when nothing computed from its results is a contraction (or an opaque
    equation that may hold one); the reductions of two such equations never feed each
    other through a contraction. Megatron's forward and backward all-reduces feed the next
    layer's matmul and do not qualify.
    """
    feeds_contraction: set = set()
    combinable = set()
    for t in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[t]
        downstream = any(v in feeds_contraction for v in eqn.outvars if not isinstance(v, DropVar))
        if not downstream:
            combinable.add(t)
        if downstream or contraction_flops(eqn) > 0:
            feeds_contraction.update(v for v in eqn.invars if not isinstance(v, Literal))
    return combinable


def combined_latency(graph: StrategyGraph, choice) -> float:
    """One latency per mesh axis that some combined node's chosen strategy all-reduces
    over."""
    axes = set()
    for node in graph.nodes:
        if node.combined:
            axes.update(all_reduce_axes(node.strategies[choice[node.id]]))
    return sum(graph.mesh.collective_latency("all-reduce", a) for a in axes)


def all_reduce_axes(strategy: Strategy) -> tuple[int, ...]:
    """The axes ``strategy`` all-reduces over: those it reduces over that do not split its
    result. Only all-reduces are combined; XLA on CPU leaves each reduce-scatter (and each
    all-gather) a collective of its own (measured: ZeRO-2 on a 3-layer MLP compiles to 6
    reduce-scatters and 6 all-gathers)."""
    split = {a for spec in strategy.out_specs for axes in spec for a in axes}
    return tuple(a for a in strategy.reduce_axes if a not in split)


def itemsize(aval) -> int:
    dtype = getattr(aval, "dtype", None)
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return 4


def _splits(spec, dim: int) -> bool:
    return spec is not None and bool(spec[dim])


def _merged_free_dims(eqn: JaxprEqn, ins) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """Where a ``dot_general`` operand's batch dimension is one of its free dimensions
    (neither contracted nor a batch dimension of the dot: ``x`` of ``x @ w``), its other
    free dimensions (``(operand, dim)``) and theirs in the result: Alpa's dot decomposer
    merged an operand's free dimensions into one before its batch-dimension analysis, so
    a forced batch dimension took them along (the sequence of a ``[B, S, H] @ [H, D]``
    dense layer is not split apart from the batch)."""
    if eqn.primitive.name != "dot_general":
        return (), ()
    in_dims, out_dims = [], []
    for i, (free, dims) in enumerate(zip(dot_free_dims(eqn), ins[:2], strict=True)):
        if dims is None or len(dims) != 1 or dims[0] not in (d for d, _ in free):
            continue
        for d, o in free:
            if d != dims[0]:
                in_dims.append((i, d))
                out_dims.append(o)
    return tuple(in_dims), tuple(out_dims)
