"""ShardingPlan: where the values of one traced step live on one logical mesh.

Every way of sharding a step (data parallel, ZeRO, manual PartitionSpecs, the ILP) ends in a
``ShardingPlan``; one lowering (``alpa.shard_parallel.lowering.step_function``) turns any plan
into a compiled XLA program. A plan names a ``PartitionSpec`` over the mesh axes
(``logical_mesh.axis_names``) for every input and output of the jaxpr, and for the
intermediate values it pins; everything else is left to XLA's sharding propagation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jax.sharding import PartitionSpec

from alpa.device_mesh import LogicalDeviceMesh

REPLICATED = PartitionSpec()


@dataclass(frozen=True)
class PartialSum:
    """How an ``add`` of two partial results runs: ``operand_specs[i]`` are the specs
    in which the producer of the add's operand ``i`` reads its own operands (``None`` for
    a literal), and ``reduce_axes`` the mesh axes (by name) both reduce over. The sum is
    reduced once: all-reduced, or reduce-scattered over the axes that split the add's
    result."""

    operand_specs: tuple[tuple[PartitionSpec | None, ...], tuple[PartitionSpec | None, ...]]
    reduce_axes: tuple[str, ...]


@dataclass(frozen=True)
class ShardingPlan:
    """A sharding decision for one jaxpr on one logical mesh.

    Attributes:
      logical_mesh: the mesh; its ``axis_names`` are the names used in the specs.
      in_specs: one spec per jaxpr input (flat).
      out_specs: one per jaxpr output; ``None`` lets XLA choose.
      var_specs: intermediate values (``jax.extend.core.Var`` of the jaxpr, or of the body
        of one of its ``remat2`` or ``scan`` equations, a scan body's carries and rows
        included) to pin with a sharding constraint.
      operand_specs: per equation (the ``JaxprEqn`` object of the jaxpr or of a ``remat2``
        or ``scan`` body), the spec each
        operand must be resharded to before the equation reads it, ``None`` where it is read
        as produced. Only equations that read some operand in another spec than its
        producer's are listed: these are the plan's resharding edges, made explicit so that
        XLA performs the planned collective (all-to-all, slice) rather than one of its own
        choosing around the consumer.
      partial_sums: per ``add`` equation (as ``operand_specs``) whose two operands are
        partial results reduced alike (:class:`PartialSum`): the lowering computes both on
        each device's blocks, adds them, and reduces the sum once.
      data_axes: mesh axes over which the batch (dim 0 of the batch arguments) is split;
        gradient accumulation reduces gradients over these axes once per step.
      grad_specs: specs for the gradients that ``alpa.grad`` marks, in the marker's operand
        order, or ``None`` to leave them to XLA (ZeRO shards them like the optimizer state).
      sync_groups: groups of mesh axes over which the gradients' row sums are carried per
        device to the ``alpa.grad`` marker and reduced there, packed, each gradient over
        the group that splits its rows (``gradient_sync``), although other axes split the
        model: Alpa's ``prefer_reduce_scatter`` rewrite of such a plan
        (``gradient_scatter``; :attr:`sync_at_marker`). A plan that splits the batch over
        every device does so without it.
      gather_bound: ZeRO-3's (``force_zero_stage_3_all_gather_threshold``): the bytes of
        whole tensors one packed all-gather of parameters may hold; the parameters are
        then gathered before their first use in the forward and again in the backward
        pass (``param_gathers``). ``None``: the gathered inputs in one pack, before the
        step, kept whole.
      objective: the ILP objective when the plan came from the ILP, else ``None``:
        communication (collectives and reshardings) plus ``compute_cost``.
      compute_cost: the compute term of ``objective`` (seconds of work on one device).
      method: a short name of what produced the plan, for messages.
    """

    logical_mesh: LogicalDeviceMesh
    in_specs: tuple[PartitionSpec, ...]
    out_specs: tuple[PartitionSpec | None, ...]
    var_specs: Mapping[Any, PartitionSpec] = field(default_factory=dict)
    operand_specs: Mapping[Any, tuple[PartitionSpec | None, ...]] = field(default_factory=dict)
    partial_sums: Mapping[Any, PartialSum] = field(default_factory=dict)
    data_axes: tuple[str, ...] = ()
    grad_specs: tuple[PartitionSpec | None, ...] | None = None
    sync_groups: tuple[tuple[str, ...], ...] = ()
    gather_bound: int | None = None
    objective: float | None = None
    method: str = ""
    compute_cost: float | None = None

    @property
    def sync_at_marker(self) -> bool:
        """Whether the plan asks for its gradients to be reduced at the marker
        (``sync_groups``)."""
        return bool(self.sync_groups)
