"""What the auto-sharding ILP decided, as data (:class:`AutoShardingSolution`): the
strategy graph, the strategy chosen for each node and the costs, turned into the
``ShardingPlan`` the lowering follows (:meth:`AutoShardingSolution.to_sharding_plan`)
or into the table ``ALPA_DEBUG_PRINT_AS_STRATEGY=1`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass

from jax.extend.core import Literal
from jax.sharding import PartitionSpec

from alpa.device_mesh import LogicalDeviceMesh
from alpa.shard_parallel.ilp import ilp_solver
from alpa.shard_parallel.sharding_plan import PartialSum, ShardingPlan
from alpa.shard_parallel.strategies.sharding_spec import Spec, format_spec, to_partition_spec
from alpa.shard_parallel.strategies.strategy_costs import sums_partials
from alpa.shard_parallel.strategies.strategy_graph_record import StrategyGraph


@dataclass(frozen=True)
class AutoShardingSolution:
    """Everything the pass decided, as data: the graph, the choice per node, the costs.

    ``to_sharding_plan()`` is what the lowering needs; ``format_table()`` is the readable
    table that ``ALPA_DEBUG_PRINT_AS_STRATEGY=1`` prints; ``rows()`` is the same as tuples.
    """

    graph: StrategyGraph
    solution: ilp_solver.Solution
    batch_invars: tuple[bool, ...]
    grad_operands: tuple | None
    state_pairs: tuple[tuple[int, int], ...] = ()

    @property
    def objective(self) -> float:
        """The ILP's objective: communication plus :attr:`compute`."""
        return self.solution.objective

    @property
    def compute(self) -> float:
        """The compute term of :attr:`objective`."""
        return self.solution.compute

    @property
    def mesh(self) -> LogicalDeviceMesh:
        return self.graph.mesh

    def spec_of(self, var) -> Spec | None:
        if isinstance(var, Literal):
            return None
        node_id, k = self.graph.sources[var]
        return self.graph.nodes[node_id].strategies[self.solution.choice[node_id]].out_specs[k]

    def data_axes(self) -> tuple[str, ...]:
        """The axes that split the batch: those of the first batch leaf the plan splits
        (a leaf read whole, such as a mask whose sum normalizes the loss, says nothing)."""
        for v, is_batch in zip(self.graph.jaxpr.invars, self.batch_invars, strict=True):
            if is_batch and v.aval.shape and self.spec_of(v)[0]:
                return tuple(self.mesh.axis_names[a] for a in self.spec_of(v)[0])
        return ()

    def partition_spec(self, var) -> PartitionSpec | None:
        """``var``'s ``PartitionSpec`` in the plan (``None``: a value it does not name),
        without building the whole :class:`ShardingPlan`."""
        if isinstance(var, Literal) or var not in self.graph.sources:
            return None
        return to_partition_spec(self.spec_of(var), self.mesh)

    def to_sharding_plan(self) -> ShardingPlan:
        graph, mesh = self.graph, self.mesh
        jaxpr = graph.jaxpr
        in_specs = tuple(to_partition_spec(self.spec_of(v), mesh) for v in jaxpr.invars)
        out_specs = [
            PartitionSpec() if isinstance(v, Literal) else to_partition_spec(self.spec_of(v), mesh)
            for v in jaxpr.outvars
        ]
        # Updated state leaves the step in its input's spec, as the state edge priced it: the
        # resharding (if any) happens inside the program, and the donated buffer can be
        # reused for the output.
        for i, o in self.state_pairs:
            out_specs[o] = in_specs[i]
        out_specs = tuple(out_specs)
        var_specs = {}
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                if v in graph.sources:
                    var_specs[v] = to_partition_spec(self.spec_of(v), mesh)
        for v in graph.body_inputs:  # a loop's carries and a scan's rows, inside the body
            var_specs[v] = to_partition_spec(self.spec_of(v), mesh)
        operand_specs = {}
        for eqn, needs in zip(jaxpr.eqns, self._operand_needs(), strict=True):
            if any(n is not None for n in needs):
                operand_specs[eqn] = tuple(
                    None if n is None else to_partition_spec(n, mesh) for n in needs
                )
        grad_specs = None
        if self.grad_operands is not None:
            grad_specs = tuple(
                None if isinstance(v, Literal) else to_partition_spec(self.spec_of(v), mesh)
                for v in self.grad_operands
            )
        return ShardingPlan(
            logical_mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            var_specs=var_specs,
            operand_specs=operand_specs,
            partial_sums=self._partial_sums(),
            data_axes=self.data_axes(),
            grad_specs=grad_specs,
            objective=self.objective,
            method="auto-sharding ILP",
            compute_cost=self.solution.compute,
        )

    def _partial_sums(self) -> dict:
        """The adds of two partial results whose chosen strategies reduce alike (the ILP
        priced one reduction for them: ``strategy_costs.partial_sum_discount``)."""
        nodes, choice, mesh = self.graph.nodes, self.solution.choice, self.mesh

        def chosen(n):
            return nodes[n].strategies[choice[n]]

        result = {}
        for site in self.graph.partial_sums:
            if not sums_partials(nodes, site, choice[site.other], choice[site.add_node]):
                continue
            other, followed = chosen(site.other), chosen(site.followed)
            specs = [None, None]
            for index, strategy in ((site.other_index, other), (1 - site.other_index, followed)):
                specs[index] = tuple(
                    None if s is None else to_partition_spec(s, mesh) for s in strategy.in_specs
                )
            axes = tuple(mesh.axis_names[a] for a in other.reduce_axes)
            result[site.eqn] = PartialSum(tuple(specs), axes)
        return result

    def _operand_needs(self) -> list[tuple[Spec | None, ...]]:
        """Per equation, per operand: the spec the chosen strategy reads it in, where that
        differs from the spec its producer holds it in (a resharding edge), else ``None``."""
        graph, choice = self.graph, self.solution.choice
        loops = {id(e) for e in graph.control_flow}
        result = []
        for eqn, sources in zip(graph.jaxpr.eqns, graph.eqn_sources, strict=True):
            # An alias (marker, barrier): no node, nothing to reshard. A planned scan,
            # while or cond: its operands are read as its bodies' inputs are pinned (the
            # lowering reshards them there).
            if not sources or id(eqn) in loops:
                result.append((None,) * len(eqn.invars))
                continue
            node_id = sources[0][0]
            in_specs = graph.nodes[node_id].strategies[choice[node_id]].in_specs
            needs = []
            for j, v in enumerate(eqn.invars):
                need = in_specs[j] if j < len(in_specs) else None
                if isinstance(v, Literal) or need is None or need == self.spec_of(v):
                    needs.append(None)
                else:
                    needs.append(need)
            result.append(tuple(needs))
        return result

    def rows(self) -> list[tuple[str, tuple[int, ...], str, str, float]]:
        """Per node: (label, shape of its first output, strategy, spec, cost).

        The cost is the node's own communication plus the resharding of its operands.
        """
        incoming = [0.0] * len(self.graph.nodes)
        choice = self.solution.choice
        for edge in self.graph.edges:
            incoming[edge.dst] += float(edge.cost[choice[edge.src], choice[edge.dst]])
        rows = []
        for node in self.graph.nodes:
            strategy = node.strategies[choice[node.id]]
            shape = tuple(node.outvars[0].aval.shape) if node.outvars else ()
            # A resharding node (shared_resharding) holds no value: the spec it reads.
            specs = strategy.out_specs or strategy.in_specs
            spec = format_spec(specs[0], self.mesh) if specs and specs[0] is not None else "-"
            cost = strategy.comm_cost + strategy.compute_cost + incoming[node.id]
            rows.append((node.label, shape, strategy.name, spec, cost))
        return rows

    def format_table(self) -> str:
        rows = self.rows()
        header = ("value", "shape", "strategy", "sharding", "cost")
        cells = [header] + [(r[0], str(r[1]), r[2], r[3], f"{r[4]:.4g}") for r in rows]
        widths = [max(len(c[i]) for c in cells) for i in range(5)]
        lines = [
            f"auto-sharding plan on logical mesh {self.mesh.shape}: objective "
            f"{self.objective:.6g} (communication {self.objective - self.compute:.6g}, compute "
            f"{self.compute:.6g}; "
            f"{'communication first' if self.solution.comm_first else 'their sum'} "
            f"minimized), {self.solution.status}"
        ]
        for c in cells:
            lines.append("  ".join(x.ljust(w) for x, w in zip(c, widths, strict=True)))
        return "\n".join(lines)
