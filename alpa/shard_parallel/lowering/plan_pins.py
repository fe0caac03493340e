"""What a plan pins, lowered onto a mesh: one way for every program built from a plan.

A ``ShardingPlan`` names three kinds of pins besides its inputs and outputs: the
intermediate values it shards (``var_specs``, inside checkpoint, loop and branch bodies
too), the operands it reads in another spec than their producer's (``operand_specs``, its
resharding edges) and the adds of two partial results it reduces once
(``partial_sums``). :func:`plan_pins` turns them into what
``constrained_eval.eval_jaxpr_with_constraints`` takes on a concrete or abstract mesh:
``constraints`` (value -> ``NamedSharding``), ``operand_constraints`` (equation -> one
sharding or ``None`` per operand) and, per jaxpr evaluated, the overrides that compute each
such add on each device's blocks and reduce the sum once (:meth:`Pins.overrides`,
``gradients.partial_sums``).

The one-mesh step function (``step_function``) lowers its plan with it; so does each stage
computation of a pipeline (``executables/stage_programs``), from its stage's plan: a
stage computation is then the same program ``ShardParallel`` would make of those pins,
and performs the collectives its ILP priced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from jax.extend.core import Jaxpr
from jax.sharding import NamedSharding, PartitionSpec

from alpa.shard_parallel.gradients.partial_sums import partial_sum_overrides
from alpa.shard_parallel.sharding_plan import PartialSum


class PinnedSpecs(Protocol):
    """The pins of a plan (``ShardingPlan``, or a pipeline stage's plan): values,
    operands and partial sums, keyed by the ``Var`` and ``JaxprEqn`` objects of the
    jaxpr it was made for (bodies included)."""

    @property
    def var_specs(self) -> Mapping[Any, PartitionSpec]: ...

    @property
    def operand_specs(self) -> Mapping[Any, tuple[PartitionSpec | None, ...]]: ...

    @property
    def partial_sums(self) -> Mapping[Any, PartialSum]: ...


@dataclass(frozen=True, eq=False)
class Pins:
    """A plan's pins on ``mesh`` (module docstring).

    Attributes:
      constraints: value -> the sharding ``eval_jaxpr_with_constraints`` pins it to
        where it is written.
      operand_constraints: equation -> per operand, the sharding it is resharded to
        before the equation reads it, ``None`` where it is read as produced.
      partial_sums: the plan's adds of two partial results, reduced once.
      mesh: the mesh (concrete or abstract) the shardings are on.
    """

    constraints: dict
    operand_constraints: dict
    partial_sums: Mapping[Any, PartialSum]
    mesh: Any

    def overrides(self, jaxpr: Jaxpr, skip: Collection = frozenset()) -> dict:
        """``eval_jaxpr_with_constraints``'s ``overrides`` of the partial sums whose add is
        an equation of ``jaxpr`` (its producers too, which hand their operands on), each
        reduced into the spec the plan pins its sum in; an add with an equation in
        ``skip`` (already overridden: gradient accumulation's deferred row sums) is left
        as it is. Empty on a mesh of one device, where nothing is reduced."""
        if self.mesh.size == 1 or not self.partial_sums:
            return {}
        mine = {id(e) for e in jaxpr.eqns}
        sums = {e: p for e, p in self.partial_sums.items() if id(e) in mine}
        if not sums:
            return {}
        specs = {v: s.spec for v, s in self.constraints.items()}
        return partial_sum_overrides(jaxpr, sums, specs, self.mesh, skip=set(skip))

    def with_constraints(self, constraints: dict) -> Pins:
        """These pins with ``constraints`` in place of :attr:`constraints`."""
        return dataclasses.replace(self, constraints=dict(constraints))


def plan_pins(plan: PinnedSpecs, mesh: Any, *, unpinned: Collection = ()) -> Pins:
    """``plan``'s pins as shardings on ``mesh`` (module docstring). ``unpinned``: values
    not to constrain (a stage computation's inputs, which arrive in the shardings its
    program takes them in)."""
    left_out = set(unpinned)
    constraints = {
        v: NamedSharding(mesh, spec) for v, spec in plan.var_specs.items() if v not in left_out
    }
    operand_constraints = {
        eqn: tuple(None if spec is None else NamedSharding(mesh, spec) for spec in specs)
        for eqn, specs in plan.operand_specs.items()
    }
    return Pins(constraints, operand_constraints, plan.partial_sums, mesh)
