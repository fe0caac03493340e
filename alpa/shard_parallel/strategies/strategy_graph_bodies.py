"""How the strategy graph plans equations with bodies: checkpoints, scans, while loops
and conds (:class:`BodyPlanning`, the part of :mod:`strategy_graph`'s builder that adds
them).

A checkpoint (``remat2``, from ``jax.checkpoint`` / ``flax.linen.remat``) is planned like any
other code: its body's equations are nodes, its body's inputs are its operands and its results
are its body's results (no node of its own). In a differentiated step the forward pass is
plain equations and the backward pass holds a ``remat2`` that recomputes the forward before
using it; both copies of the forward get strategies, so a checkpointed layer is split as it
would be without the checkpoint, and the lowering keeps the ``remat2`` (and so the
recomputation) around the planned body. ``StrategyGraph.jaxpr`` lists the equations planned,
in program order: the step's, each ``remat2`` preceded by its body's (recursively), so that
liveness sees the body's values come and go. Its ``eqns`` are those the plan names (the
``remat2`` itself and aliases have no node); it is a view, not a jaxpr to evaluate.

A ``scan`` is planned the same way, as one iteration of its loop (:meth:`BodyPlanning._add_scan`):
its body's equations are nodes whose costs count ``length`` times; each carry and each row
of a stacked input is a node of its own (``StrategyGraph.body_inputs``), the carry tied to
one spec across iterations by an edge from the body's new value, a row of a step input read
from it through an edge, a row of a value the step computes following that value's spec;
each stacked output follows the body value it stacks. A ``while`` loop is a scan without
rows, priced at :data:`WHILE_TRIP_COUNT` iterations. The branches of a ``cond`` are planned
together (:meth:`BodyPlanning._add_cond`): each branch's equations are nodes, and each result
is a node that every branch's value is resharded into, so that the branches return one
sharding. ``StrategyGraph.control_flow`` lists the scans, loops and conds planned; the
lowering keeps each one a loop or a branch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jax.extend.core import DropVar, JaxprEqn, Literal, Var

from alpa.jax_internals import cond_branches, open_jaxpr, remat_body, scan_parts, while_parts
from alpa.shard_parallel.strategies.sharding_spec import enumerate_specs, nbytes
from alpa.shard_parallel.strategies.strategy_costs import itemsize
from alpa.shard_parallel.strategies.strategy_rules import Strategy, whole_value_strategy

if TYPE_CHECKING:
    from alpa.shard_parallel.strategies.strategy_graph_record import Source

#: How many iterations a ``while`` loop's condition and body are priced at: its trip count
#: is known only when it runs (a ``fori_loop`` with static bounds is a ``scan``, priced at
#: its own count).
WHILE_TRIP_COUNT = 1


class BodyPlanning:
    """The strategy graph builder's methods for equations with bodies. A mixin of
    ``strategy_graph._Builder``, whose state and node and edge methods they use
    (``add_eqn``, ``add_node``, ``_alias``, ``_body_edge``, ``_specs_of``, ``_reshard``,
    ``sources``, ``scale``, ``expanded``, ``body_inputs``, ``inputs``, ``control_flow``)."""

    def _expandable(self, bodies) -> bool:
        """An equation's bodies can be planned in the graph: none closes over constants
        and each is new to it (``trace_step`` gives every body variables of its own; a body
        object shared by two equations is planned once, the other equation stays opaque)."""
        ids = {id(body) for body in bodies}
        return (
            not any(body.constvars for body in bodies)
            and len(ids) == len(bodies)
            and not ids & self.expanded
        )

    def _add_remat(self, t: int | str, eqn: JaxprEqn) -> None:
        """A checkpoint's body is planned in place: its inputs are the equation's operands,
        its results the equation's (which has no node of its own)."""
        body = remat_body(eqn)
        self._alias(t, eqn.invars, body.invars)
        for u, inner in enumerate(body.eqns):
            self.add_eqn(f"{t}/{u}", inner)
        self._alias(t, body.outvars, eqn.outvars)
        self.eqns.append(eqn)
        self.eqn_sources.append([])

    def _add_scan(self, t: int | str, eqn: JaxprEqn) -> None:
        """Plan the body of the scan ``eqn`` once, as one iteration of the loop.

        The body's equations are nodes (path ``t/u``) whose costs count ``length`` times.
        Its constants are the scan's operands (read whole every iteration). Each carry is
        a node of its own that fixes the carry's spec for every iteration: an edge from
        the initial value prices resharding it once before the loop, and one from the
        body's new value back to it prices resharding that value every iteration. Each
        stacked input's slice is a node whose spec is the stacked operand's on the
        non-scanned axes (the scanned axis whole: each iteration reads its own row): of a
        step input, fed by an edge from it priced once; of a value the step computes, its
        spec (:meth:`_row_of`). Each stacked output follows the body's value it stacks.
        The scan's final carries are the carry nodes' values.
        """
        parts = scan_parts(eqn)
        body = parts.jaxpr
        n_consts, n_carry, length = parts.num_consts, parts.num_carry, parts.length
        self._alias(t, eqn.invars[:n_consts], body.invars[:n_consts])
        carry_nodes = [
            self._loop_input(f"carry of eqn {t}", init, var, stacked=False)
            for init, var in zip(
                eqn.invars[n_consts : n_consts + n_carry],
                body.invars[n_consts : n_consts + n_carry],
                strict=True,
            )
        ]
        for x, var in zip(
            eqn.invars[n_consts + n_carry :], body.invars[n_consts + n_carry :], strict=True
        ):
            self._loop_input(f"row of eqn {t}", x, var, stacked=True)
        outer = self.scale
        self.scale = outer * length
        try:
            for u, inner in enumerate(body.eqns):
                self.add_eqn(f"{t}/{u}", inner)
            self._close_carries(carry_nodes, body.outvars[:n_carry])
        finally:
            self.scale = outer
        out_sources = self._final_carries(carry_nodes, eqn.outvars[:n_carry])
        for y, var in zip(body.outvars[n_carry:], eqn.outvars[n_carry:], strict=True):
            if isinstance(var, DropVar):
                continue
            if isinstance(y, Literal):
                node = self.add_node(
                    f"stacked literal of eqn {t}", (var,), (whole_value_strategy(var),), None
                )
            else:
                source = self.sources[y]
                stacked = tuple(
                    Strategy("stack", (((),) + spec,), (spec,)) for spec in self._specs_of(source)
                )
                node = self.add_node(f"stacked output of eqn {t}", (var,), stacked, source[0])
            out_sources.append((node, 0))
        self.eqns.append(eqn)
        self.eqn_sources.append(out_sources)
        self.control_flow.append(eqn)

    def _add_while(self, t: int | str, eqn: JaxprEqn) -> None:
        """Plan a ``while`` loop as a scan without rows: each carry a node tied to one
        spec across iterations, the condition's and the body's equations nodes (paths
        ``t/cond/u``, ``t/body/u``) whose costs count :data:`WHILE_TRIP_COUNT` times (the
        real count is known only when the loop runs)."""
        parts = while_parts(eqn)
        cond, body = open_jaxpr(parts.cond)[0], open_jaxpr(parts.body)[0]
        n_cond, n_body = parts.cond_nconsts, parts.body_nconsts
        inits = eqn.invars[n_cond + n_body :]
        carry_nodes = [
            self._loop_input(f"carry of eqn {t}", init, var, stacked=False)
            for init, var in zip(inits, body.invars[n_body:], strict=True)
        ]
        self._alias(t, eqn.invars[:n_cond], cond.invars[:n_cond])
        self._alias(t, eqn.invars[n_cond : n_cond + n_body], body.invars[:n_body])
        for var, node in zip(cond.invars[n_cond:], carry_nodes, strict=True):
            self.sources[var] = (node, 0)  # the condition reads the carries as they are
            self.body_inputs.append(var)
        outer = self.scale
        self.scale = outer * WHILE_TRIP_COUNT
        try:
            for part, jaxpr in (("cond", cond), ("body", body)):
                for u, inner in enumerate(jaxpr.eqns):
                    self.add_eqn(f"{t}/{part}/{u}", inner)
            self._close_carries(carry_nodes, body.outvars)
        finally:
            self.scale = outer
        self.eqns.append(eqn)
        self.eqn_sources.append(self._final_carries(carry_nodes, eqn.outvars))
        self.control_flow.append(eqn)

    def _close_carries(self, carry_nodes: list[int], new_values) -> None:
        """Edges that reshard each iteration's new carry into its carry's spec."""
        for node, new in zip(carry_nodes, new_values, strict=True):
            if isinstance(new, Literal) or self.sources[new][0] == node:
                continue
            self._body_edge(self.sources[new], node, new)

    def _final_carries(self, carry_nodes: list[int], outvars) -> list[Source]:
        """A loop's final carries are its carry nodes' values."""
        sources = []
        for node, var in zip(carry_nodes, outvars, strict=True):
            if not isinstance(var, DropVar):
                self.sources[var] = (node, 0)
                sources.append((node, 0))
        return sources

    def _add_cond(self, t: int | str, eqn: JaxprEqn) -> None:
        """Plan the branches of the ``cond`` ``eqn`` together.

        Each branch reads the operands as they are (its inputs alias them) and its
        equations are nodes (path ``t/b{i}/u``), priced as if every branch ran: an upper
        bound of the step, as only one runs. Each result of the ``cond`` is a node of its
        own, with any spec; an edge from each branch's value prices resharding it into
        that spec, so that every branch returns the result in one sharding (as the
        lowering pins it).
        """
        branches = [open_jaxpr(branch)[0] for branch in cond_branches(eqn)]
        for i, body in enumerate(branches):
            self._alias(t, eqn.invars[1:], body.invars)
            for u, inner in enumerate(body.eqns):
                self.add_eqn(f"{t}/b{i}/{u}", inner)
        out_sources: list[Source] = []
        for k, var in enumerate(eqn.outvars):
            strategies = self._any_spec("result", var)
            node = self.add_node(f"result of eqn {t}", (var,), strategies, None)
            for body in branches:
                value = body.outvars[k]
                if not isinstance(value, Literal):
                    self._body_edge(self.sources[value], node, value)
            out_sources.append((node, 0))
        self.eqns.append(eqn)
        self.eqn_sources.append(out_sources)
        self.control_flow.append(eqn)

    def _any_spec(self, name: str, var, stacked: bool = False) -> tuple[Strategy, ...]:
        """One strategy per spec of ``var``, reading its operand in that spec (with a
        leading scanned axis whole, ``stacked``)."""
        return tuple(
            Strategy(name, (spec,), ((((),) + spec) if stacked else spec,))
            for spec in enumerate_specs(
                tuple(var.aval.shape), self.mesh, self.options.allow_mixed_mesh_shape
            )
        )

    def _loop_input(self, label: str, outer, var: Var, stacked: bool) -> int:
        """The node of a scan body's carry or row ``var``, fed by ``outer`` (the initial
        carry, or the stacked operand: read with its scanned axis whole)."""
        if stacked and not isinstance(outer, Literal) and outer not in self.inputs:
            return self._row_of(label, outer, var)
        strategies = self._any_spec("row" if stacked else "carry", var, stacked)
        node = self.add_node(label, (var,), strategies, None)
        self.body_inputs.append(var)
        if not isinstance(outer, Literal):
            self._body_edge(self.sources[outer], node, outer, operand=True)
        return node

    def _row_of(self, label: str, outer, var: Var) -> int:
        """A scan's row ``var`` of a stacked operand ``outer`` that the step computes (a
        forward scan's stacked residuals, read by the backward's transposed scan): it
        follows the operand, each iteration reading its row in the operand's spec on the
        other axes, as the iterations written out read their rows of it, and every reader
        in the body reshards it as it needs (an edge each). An operand split on the
        scanned axis is gathered there once, before the loop.

        A row of a step input (a stacked parameter) keeps a node of its own, read from the
        input through one edge (``_loop_input``): the parameter is stored in one spec and
        each scan reads its rows in another if that is cheaper."""
        source = self.sources[outer]
        total = nbytes(outer.aval.shape, itemsize(outer.aval))
        strategies = []
        for spec in self._specs_of(source):
            whole = ((),) + tuple(spec[1:])
            cost = 0.0 if tuple(spec) == whole else self._reshard(tuple(spec), whole, total)
            cost *= self.scale
            strategies.append(Strategy("row", (tuple(spec[1:]),), (tuple(spec),), comm_cost=cost))
        node = self.add_node(label, (var,), tuple(strategies), source[0])
        self.body_inputs.append(var)
        return node
