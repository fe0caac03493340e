"""The strategy graph of a jaxpr: one node per value producer, one edge per value read.

Every jaxpr input and every equation becomes a :class:`Node` holding its candidate
strategies (from :mod:`strategy_rules`); every operand an equation reads from another node
becomes an :class:`Edge` holding the resharding cost matrix ``cost[i, j]``: what it costs to
turn the producer's output under its strategy ``i`` into what the consumer needs under its
strategy ``j`` (paper §4.2; ``docs/auto_sharding.md``, Strategy graph and Cost model).
Identity-like equations (the pipeline marker, optimization barriers, sharding constraints)
are not nodes: their outputs *are* their operands.

Equations with bodies are planned in the graph too (:mod:`strategy_graph_bodies`): a
checkpoint's, scan's, while loop's or cond's equations are nodes like the step's, a loop's
costs counted per iteration, its carries and rows nodes of their own.
``StrategyGraph.jaxpr`` lists the equations planned, in program order (each body's before
the equation that holds it), so that liveness sees the body's values come and go; it is a
view, not a jaxpr to evaluate.

A node that *follows* an operand (``Node.follow``) has strategies in one-to-one
correspondence with the producer's; the solver gives both one decision variable.
The graph also records liveness: for each program point, the values alive there, so that a
memory budget can be imposed per point. The graph itself, as data, is
:mod:`strategy_graph_record`.

A stack of identical layers repeats the same equations on the same shapes, so the builder
does each piece of work once (:mod:`strategy_graph_caches`).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, DropVar, JaxprEqn, Literal, Var

import alpa.shard_parallel.strategies.strategy_rules_contraction  # noqa: F401  (registers rules)
import alpa.shard_parallel.strategies.strategy_rules_random  # noqa: F401  (registers rules)
from alpa.device_mesh import LogicalDeviceMesh
from alpa.jax_internals import is_remat, is_scan, is_while
from alpa.shard_parallel.strategies.sharding_spec import (
    Spec,
    enumerate_specs,
    from_partition_spec,
    nbytes,
    num_shards,
    resharding_cost,
    user_partition_spec,
)
from alpa.shard_parallel.strategies.shared_resharding import share_reshardings
from alpa.shard_parallel.strategies.strategy_costs import (
    PARTIAL_SUM_ADDS,
    combinable_reductions,
    contraction_flops,
    force_batch_axis,
    holds_contractions,
    itemsize,
    partial_chain,
    partial_sum_discount,
    priced_strategies,
)
from alpa.shard_parallel.strategies.strategy_graph_bodies import BodyPlanning
from alpa.shard_parallel.strategies.strategy_graph_caches import (
    by_identity,
    rule_key,
    shared_caches,
)
from alpa.shard_parallel.strategies.strategy_graph_record import (
    Edge,
    GraphOptions,
    Node,
    PartialSumSite,
    Source,
    StrategyGraph,
)
from alpa.shard_parallel.strategies.strategy_rules import (
    NodeStrategies,
    RuleContext,
    Strategy,
    lookup_rule,
    replicated_strategy,
    whole_value_strategy,
)
from alpa.tracing.jaxpr_util import is_grad_marker, live_eqns, planned_bodies
from alpa.tracing.primitive_def import pipeline_p

# Equations whose outputs are their operands, unchanged (``random_clone``: a key's copy,
# as ``jax.random.clone`` and flax's scanned dropout write).
ALIAS_PRIMITIVES = {
    p.name for p in (pipeline_p, lax.optimization_barrier_p, lax.sharding_constraint_p)
} | {"reshard", "random_clone"}

#: The user's shardings in a step, and the parameter that holds each one's
#: ``NamedSharding``: ``with_sharding_constraint`` (and its transpose) and ``reshard``
#: (``jax.sharding.reshard``; JAX's own, of the scalar seed of a gradient).
USER_SHARDINGS = {"sharding_constraint": "sharding", "reshard": "dst_sharding"}


def build_strategy_graph(
    closed_jaxpr: ClosedJaxpr,
    mesh: LogicalDeviceMesh,
    options: GraphOptions,
    input_filter: Callable[[int, tuple[int, ...], list[Spec]], list[Spec]] | None = None,
    state_pairs: Sequence[tuple[int, int]] = (),
    batch_axis: tuple[Mapping, int] | None = None,
) -> StrategyGraph:
    """The strategy graph of ``closed_jaxpr`` on ``mesh``.

    ``batch_axis = (batch_dims, axis)`` forces the batch dimension of every value that has
    one onto mesh ``axis`` (``force_batch_dim_to_mesh_dim``): ``batch_dims[var]`` holds the
    dimensions of ``var`` that are rows of the batch, and a strategy whose result leaves
    ``axis`` off its one batch dimension costs ``FORBIDDEN_COST`` (priced out rather than
    removed, so that following nodes keep their one-to-one strategies).

    ``input_filter(index, shape, specs)`` may narrow the specs allowed for jaxpr input
    ``index`` (forced batch dimension, no replicated parameters, ...). ``state_pairs`` holds
    ``(input, output)`` index pairs of training state (parameters, optimizer state) that the
    step reads and returns updated: the output must come back in the input's spec for the
    next step, so an edge prices the resharding from the one to the other.
    """
    jaxpr = closed_jaxpr.jaxpr
    builder = _Builder(mesh, options, combinable_reductions(jaxpr))
    builder.batch_axis = batch_axis
    # Dead equations (the forward pass of an init function, whose outputs it drops) are
    # left out: XLA removes them, and priced they would steer the plan.
    live = live_eqns(jaxpr)
    builder.reads = Counter(
        v
        for e, keep in zip(jaxpr.eqns, live, strict=True)
        if keep
        for v in e.invars
        if isinstance(v, Var)
    )
    builder.reads.update(v for v in jaxpr.outvars if isinstance(v, Var))
    for var in jaxpr.constvars:
        builder.add_node(f"constant {var}", (var,), (whole_value_strategy(var),), None)
    input_nodes = []
    builder.inputs = set(jaxpr.invars)
    all_specs: dict[tuple[int, ...], list[Spec]] = {}
    input_strategies: dict[tuple[Spec, ...], tuple[Strategy, ...]] = {}
    for i, var in enumerate(jaxpr.invars):
        shape = tuple(var.aval.shape)
        if shape not in all_specs:
            all_specs[shape] = enumerate_specs(shape, mesh, options.allow_mixed_mesh_shape)
        specs = list(all_specs[shape])
        if input_filter is not None:
            specs = input_filter(i, shape, specs) or specs
        specs = tuple(specs)
        if specs not in input_strategies:
            input_strategies[specs] = tuple(Strategy("input", (s,), ()) for s in specs)
        input_nodes.append(builder.add_node(f"input {i}", (var,), input_strategies[specs], None))
    for t, eqn in enumerate(jaxpr.eqns):
        if live[t]:
            builder.add_eqn(t, eqn)
    for i, o in state_pairs:
        out = jaxpr.outvars[o]
        if not isinstance(out, Literal):
            builder.add_state_edge(builder.sources[out], input_nodes[i], out)
    output_sources = tuple(
        None if isinstance(v, Literal) else builder.sources[v] for v in jaxpr.outvars
    )
    if options.share_reshardings:
        builder.share_reshardings()
    if builder.foreign_constraints:
        meshes = sorted(
            {
                str(e.params[USER_SHARDINGS[e.primitive.name]].mesh)
                for e in builder.foreign_constraints
            }
        )
        warnings.warn(
            f"{len(builder.foreign_constraints)} with_sharding_constraint(s) name another mesh "
            f"than the plan's logical mesh {mesh.shape} ({'; '.join(meshes)}): the planner "
            "cannot pin them and leaves them in the program as given. Constrain with a "
            "PartitionSpec under jax.set_mesh(mesh), or a NamedSharding, on a mesh of the "
            "plan's devices and shape (its axes are the logical mesh's by position)",
            stacklevel=3,
        )
    if builder.unknown:
        names = ", ".join(sorted(builder.unknown))
        warnings.warn(
            f"auto-sharding has no strategy rule for {names}; these equations run replicated",
            stacklevel=3,
        )
    return StrategyGraph(
        mesh=mesh,
        nodes=tuple(builder.nodes),
        edges=tuple(builder.edges),
        sources=builder.sources,
        input_nodes=tuple(input_nodes),
        output_sources=output_sources,
        jaxpr=jaxpr.replace(eqns=builder.eqns) if builder.expanded or not all(live) else jaxpr,
        eqn_sources=tuple(tuple(x) for x in builder.eqn_sources),
        num_eqns=len(builder.eqns),
        unknown_primitives=tuple(sorted(builder.unknown)),
        partial_sums=tuple(builder.partial_sums),
        options=options,
        control_flow=tuple(builder.control_flow),
        body_inputs=tuple(builder.body_inputs),
        contractions=tuple(
            n
            for n, eqn in sorted(builder.node_eqn.items())
            if contraction_flops(eqn) > 0 and holds_contractions(eqn)
        ),
    )


class _Builder(BodyPlanning):
    def __init__(self, mesh: LogicalDeviceMesh, options: GraphOptions, combinable: set[int]):
        self.mesh = mesh
        self.options = options
        self.combinable = combinable
        self.batch_axis: tuple[Mapping, int] | None = None
        caches = shared_caches(mesh, options)
        self._priced_cache: dict = caches["priced"]
        self.nodes: list[Node] = []
        self.edges: list[Edge] = []
        self.sources: dict = {}
        # The equations planned, in program order (remat2 bodies expanded), and the values
        # each one produces.
        self.eqns: list[JaxprEqn] = []
        self.eqn_sources: list[list[Source]] = []
        # ids of the bodies planned (checkpoint, scan, while, cond): a body shared by two
        # equations is planned once.
        self.expanded: set[int] = set()
        self.unknown: set[str] = set()
        # Per node, per output: the output spec under each strategy (the operand specs of
        # the node's consumers).
        self._out_specs: list[tuple[tuple[Spec, ...], ...]] = []
        self._cost_cache: dict = caches["cost"]
        self._matrix_cache: dict = caches["matrix"]
        self._rule_cache: dict = caches["rule"]
        self._shards_cache: dict = caches["shards"]
        self._bytes_cache: dict = caches["bytes"]
        self._outputs_cache: dict = caches["outputs"]
        self._operands_cache: dict = caches["operands"]
        # This graph's resharding matrices by the identity of their spec tuples (pinned).
        self._edge_matrices: dict = {}
        # How often the jaxpr (not a remat2 body) reads each value; the add sites found.
        self.reads: Counter = Counter()
        self.partial_sums: list[PartialSumSite] = []
        self.node_eqn: dict[int, JaxprEqn] = {}
        # How many times the equations being added run per step: the product of the trip
        # counts of the scans around them. Their strategies' and edges' costs are scaled.
        self.scale = 1
        self.control_flow: list[JaxprEqn] = []
        # The user's sharding constraints on another mesh than this one (not planned).
        self.foreign_constraints: list[JaxprEqn] = []
        self.body_inputs: list[Var] = []
        # The step's inputs (a scan's rows of them keep a node of their own: _loop_input).
        self.inputs: set[Var] = set()
        # The reads that may share one resharding (``shared_resharding``), by value and jaxpr
        # (with the number of alpa.grad markers before it: ``segment``).
        self.shared_reads: dict[tuple[Source, tuple[int, str]], list[int]] = {}
        self.segment = 0

    def add_node(self, label, outvars, strategies, follow, combined=False, shared=False) -> int:
        """``shared``: ``strategies`` is an entry of the shared pricing cache, which keeps
        it alive, so its outputs' specs and bytes are looked up by its identity instead
        of by hashing every spec again (most of a stack's equations)."""
        node_id = len(self.nodes)
        out_bytes = []
        out_specs = []
        for k, var in enumerate(outvars):
            aval = var.aval
            size = nbytes(getattr(aval, "shape", ()), itemsize(aval))
            if shared:
                specs, sizes = by_identity(
                    self._outputs_cache,
                    (strategies,),
                    (k, size),
                    lambda k=k, size=size: self._output_specs(strategies, k, size),
                )
            else:
                specs, sizes = self._output_specs(strategies, k, size)
            out_specs.append(specs)
            out_bytes.append(sizes)
        self.nodes.append(
            Node(
                node_id,
                label,
                tuple(outvars),
                tuple(strategies),
                follow,
                tuple(out_bytes),
                combined,
            )
        )
        self._out_specs.append(tuple(out_specs))
        for k, var in enumerate(outvars):
            if not isinstance(var, DropVar):
                self.sources[var] = (node_id, k)
        return node_id

    def _output_specs(self, strategies, k: int, size: float):
        """Output ``k``'s spec and bytes per device under each of ``strategies``."""
        specs = tuple(s.out_specs[k] for s in strategies)
        sizes = self._bytes_cache.get((specs, size))
        if sizes is None:
            sizes = tuple(size / self._num_shards(spec) for spec in specs)
            self._bytes_cache[(specs, size)] = sizes
        return specs, sizes

    def _num_shards(self, spec: Spec) -> int:
        shards = self._shards_cache.get(spec)
        if shards is None:
            shards = self._shards_cache[spec] = num_shards(spec, self.mesh)
        return shards

    def add_eqn(self, t: int | str, eqn: JaxprEqn) -> None:
        """Add ``eqn``: equation ``t`` of the jaxpr, or at path ``t = "3/1"`` (equation 1 of
        the body of the remat2 equation 3; never a combinable reduction)."""
        if eqn.primitive.name in USER_SHARDINGS and self._add_user_constraint(t, eqn):
            return
        if eqn.primitive.name in ALIAS_PRIMITIVES:
            if isinstance(t, int) and is_grad_marker(eqn):
                # Gradient accumulation splits the step here (accumulate, then apply): a
                # resharding is not shared across the marker.
                self.segment += 1
            self._alias(t, eqn.invars, eqn.outvars)
            self.eqns.append(eqn)
            self.eqn_sources.append([])
            return
        bodies = [body for _, body in planned_bodies(eqn)]
        if bodies and self._expandable(bodies):
            self.expanded.update(id(body) for body in bodies)
            if is_remat(eqn):
                self._add_remat(t, eqn)
            elif is_scan(eqn):
                self._add_scan(t, eqn)
            elif is_while(eqn):
                self._add_while(t, eqn)
            else:
                self._add_cond(t, eqn)
            return
        operand_specs = tuple(
            None if isinstance(v, Literal) else self._specs_of(self.sources[v]) for v in eqn.invars
        )
        ctx = RuleContext(
            self.mesh,
            self.options.allow_mixed_mesh_shape,
            self.options.allow_recompute_heavy_op,
            self.options.prefer_reduce_scatter,
            operand_specs,
        )
        rule = lookup_rule(eqn.primitive)
        key = rule_key(eqn, operand_specs)
        if rule is None:
            self.unknown.add(eqn.primitive.name)
            result = replicated_strategy(eqn)
        else:
            result = None if key is None else self._rule_cache.get(key)
            if result is None:
                result = rule(eqn, ctx)
                if not result.strategies:
                    result = replicated_strategy(eqn)
                if key is not None:
                    self._rule_cache[key] = result
        combined = t in self.combinable
        strategies = self._priced(eqn, result.strategies, combined, key)
        shared = key is not None
        if self.batch_axis is not None:
            strategies = force_batch_axis(eqn, strategies, *self.batch_axis)
            shared = False
        follow = None
        if result.follow is not None:
            follow = self.sources[eqn.invars[result.follow]][0]
        node_id = self.add_node(
            f"eqn {t} {eqn.primitive.name}",
            tuple(eqn.outvars),
            strategies,
            follow,
            combined,
            shared,
        )
        self.eqns.append(eqn)
        self.eqn_sources.append([(node_id, k) for k in range(len(eqn.outvars))])
        self.node_eqn[node_id] = eqn
        site = self._partial_sum_site(t, eqn, node_id, result)
        # ``result`` is the rule cache's own entry only when a rule made it under a key.
        self._add_edges(t, eqn, node_id, result, site, key is not None and rule is not None)

    def _add_user_constraint(self, t: int | str, eqn: JaxprEqn) -> bool:
        """Pin the value of the user's ``with_sharding_constraint`` ``eqn`` to its spec:
        a node of one strategy that reads the operand in that spec (the edge prices the
        resharding into it). ``False`` (the constraint stays an alias, planned around by
        nothing) when its mesh is not this mesh under other names
        (``sharding_spec.user_partition_spec``); the graph then warns."""
        pspec = user_partition_spec(eqn.params[USER_SHARDINGS[eqn.primitive.name]], self.mesh)
        if pspec is None:
            self.foreign_constraints.append(eqn)
            return False
        rank = len(eqn.outvars[0].aval.shape)
        spec = from_partition_spec(pspec, rank, self.mesh)
        result = NodeStrategies((Strategy("user", (spec,), (spec,)),))
        node_id = self.add_node(
            f"eqn {t} sharding_constraint", tuple(eqn.outvars), result.strategies, None
        )
        self.eqns.append(eqn)
        self.eqn_sources.append([(node_id, 0)])
        self.node_eqn[node_id] = eqn
        self._add_edges(t, eqn, node_id, result, None, False)
        return True

    def _body_edge(self, source: Source, node: int, var, operand: bool = False) -> None:
        """An edge from ``source`` to ``node``, a scan's carry or row or a cond's result:
        resharding ``var`` into the spec that ``node``'s strategy reads (``operand``: its
        operand spec, the stacked one for a row) or holds (a carry's new value, a branch's
        result), ``self.scale`` times."""
        total = nbytes(var.aval.shape, itemsize(var.aval))
        strategies = self.nodes[node].strategies
        dst_specs = tuple(s.in_specs[0] if operand else s.out_specs[0] for s in strategies)
        src_specs = self._specs_of(source)
        cost = self._matrix(src_specs, dst_specs, total)
        if self.scale != 1:
            cost = cost * self.scale
        self.edges.append(Edge(source[0], node, cost, src_specs, dst_specs, total))

    def _partial_sum_site(self, t, eqn: JaxprEqn, node_id: int, result) -> PartialSumSite | None:
        if not self.options.carry_partial_sums or not isinstance(t, int):
            return None
        if eqn.primitive.name not in PARTIAL_SUM_ADDS:
            return None
        if result.follow is None or len(eqn.invars) != 2 or eqn.invars[0] is eqn.invars[1]:
            return None
        shape = eqn.outvars[0].aval.shape
        if any(not isinstance(v, Var) or v.aval.shape != shape for v in eqn.invars):
            return None

        def producer(v):
            node, k = self.sources[v]
            return self.node_eqn.get(node) if k == 0 else None

        chains = [partial_chain(v, producer, self.reads) for v in eqn.invars]
        if None in chains:
            return None
        ends = [self.sources[v][0] for v in eqn.invars]
        roots = [self.sources[c[0].outvars[0]][0] for c in chains]
        f, o = result.follow, 1 - result.follow
        site = PartialSumSite(
            eqn, node_id, roots[f], ends[f], roots[o], ends[o], o, chains[f][0], chains[o][0]
        )
        self.partial_sums.append(site)
        return site

    def _alias(self, t: int | str, values, aliases) -> None:
        """``aliases[i]`` is ``values[i]``: the same source (a literal gets a node)."""
        for value, alias in zip(values, aliases, strict=True):
            if isinstance(alias, DropVar | Literal):
                continue
            if isinstance(value, Literal):
                self.add_node(f"literal of eqn {t}", (alias,), (whole_value_strategy(alias),), None)
            else:
                self.sources[alias] = self.sources[value]

    def _priced(self, eqn, strategies, combined: bool, key) -> tuple[Strategy, ...]:
        scale = self.scale
        cache_key = None if key is None else (key, combined, scale)
        priced = None if cache_key is None else self._priced_cache.get(cache_key)
        if priced is None:
            priced = priced_strategies(self.mesh, eqn, strategies, combined)
            if scale != 1:
                priced = tuple(
                    replace(s, comm_cost=s.comm_cost * scale, compute_cost=s.compute_cost * scale)
                    for s in priced
                )
            if cache_key is not None:
                self._priced_cache[cache_key] = priced
        return priced

    def _specs_of(self, source: Source) -> tuple[Spec, ...]:
        node_id, k = source
        return self._out_specs[node_id][k]

    def _add_edges(
        self, t, eqn: JaxprEqn, node_id: int, result: NodeStrategies, site, shared: bool
    ) -> None:
        """``shared``: ``result`` is an entry of the shared rule cache (kept alive there),
        so its operand specs are looked up by identity, as in :meth:`add_node`. The reads
        that may share a resharding are noted in ``shared_reads`` (by value and by the
        jaxpr ``t`` is in: a checkpoint's body reshards its own copy)."""
        where = (self.segment, str(t).rpartition("/")[0])
        follow = self.nodes[node_id].follow
        for j, var in enumerate(eqn.invars):
            if isinstance(var, Literal):
                continue
            src_id, k = self.sources[var]

            def operand_specs(j=j):
                return tuple(s.in_specs[j] for s in result.strategies)

            if shared:
                dst_specs = by_identity(self._operands_cache, (result,), (j,), operand_specs)
            else:
                dst_specs = operand_specs()
            total = nbytes(var.aval.shape, itemsize(var.aval))
            src_specs = self._specs_of((src_id, k))
            # The same two spec tuples meet again in every repeated block of the graph.
            cost = by_identity(
                self._edge_matrices,
                (src_specs, dst_specs),
                (total,),
                lambda src=src_specs, dst=dst_specs, total=total: self._matrix(src, dst, total),
            )
            discounted = site is not None and j == site.other_index
            if discounted:
                cost = cost + partial_sum_discount(self.nodes, site)
            if self.scale != 1:
                cost = cost * self.scale
            elif not discounted and follow != src_id and any(d is not None for d in dst_specs):
                self.shared_reads.setdefault(((src_id, k), where), []).append(len(self.edges))
            self.edges.append(Edge(src_id, node_id, cost, src_specs, dst_specs, total))

    def share_reshardings(self) -> None:
        """A resharding node for each value that readers may need in one spec
        (:mod:`shared_resharding`)."""

        def add_node(source: Source, strategies) -> int:
            var = self.nodes[source[0]].outvars[source[1]]
            return self.add_node(f"resharding of {var.aval.str_short()}", (), strategies, None)

        share_reshardings(self.edges, self.shared_reads, add_node, self._matrix)

    def add_state_edge(self, source: Source, input_node: int, var) -> None:
        total = nbytes(var.aval.shape, itemsize(var.aval))
        src_specs, dst_specs = self._specs_of(source), self._specs_of((input_node, 0))
        cost = self._matrix(src_specs, dst_specs, total)
        self.edges.append(Edge(source[0], input_node, cost, src_specs, dst_specs, total))

    def _matrix(
        self, src_specs: tuple[Spec, ...], dst_specs: tuple[Spec | None, ...], total: float
    ) -> np.ndarray:
        """``cost[a, b]``: resharding ``src_specs[a]`` to ``dst_specs[b]`` (0 where the
        consumer takes the value as it is, ``None``).

        Repeated layers read values of the same shapes under the same specs, so most edges
        share one matrix; the cached matrices are read-only.
        """
        key = (src_specs, dst_specs, total)
        cost = self._matrix_cache.get(key)
        if cost is None:
            cost = np.zeros((len(src_specs), len(dst_specs)))
            for a, src in enumerate(src_specs):
                for b, dst in enumerate(dst_specs):
                    if dst is not None and src != dst:
                        cost[a, b] = self._reshard(src, dst, total)
            cost.flags.writeable = False
            self._matrix_cache[key] = cost
        return cost

    def _reshard(self, src: Spec, dst: Spec, total: float) -> float:
        key = (src, dst, total)
        cost = self._cost_cache.get(key)
        if cost is None:
            cost = resharding_cost(
                src, dst, total, self.mesh,
                self.options.allow_all_gather, self.options.allow_all_to_all,
            )  # fmt: skip
            self._cost_cache[key] = cost
        return cost
