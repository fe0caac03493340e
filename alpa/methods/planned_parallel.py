"""PlannedParallel: compile a step exactly as a recorded :class:`ParallelPlan` says.

``alpa.plan_to_method(plan)`` returns this method. It searches nothing (no ILP, no stage
DP): the recorded decisions, whose values and equations are named by position
(:func:`~alpa.record.plan_refs.value_refs`), are bound to the values and equations of a fresh
trace of the step, after checking that the trace is the recorded step (its fingerprint,
inputs and outputs); a plan applied to another step raises ``ValueError``. Compiling the
bound plan gives the recorded executable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from jax.extend.core import Jaxpr

from alpa.device_mesh import LogicalDeviceMesh
from alpa.executables.base import Executable
from alpa.methods.pipeshard_method import PipeshardParallel, compile_pipeshard_plan
from alpa.methods.shard_method import ParallelMethod, _compile_one_mesh
from alpa.pipeline_parallel.pipeshard_passes import (
    PipeshardOptions,
    pipeline_step,
    plan_pipeshard,
)
from alpa.record.parallel_plan import ParallelPlan
from alpa.record.plan_refs import eqn_refs, value_refs
from alpa.resolved_cluster import resolve_cluster
from alpa.shard_parallel.sharding_plan import ShardingPlan
from alpa.tracing import TracedStep


class PlannedParallel(ParallelMethod):
    """The method of a recorded :class:`ParallelPlan` (:func:`plan_to_method`).

    ``plan()`` rebuilds the recorded ``ShardingPlan`` / ``PipeshardPlan`` for a fresh
    trace of the step, after checking that the trace is the recorded step; compiling it
    gives the recorded executable. A pipeline is traced under the recorded layer option,
    as ``PipeshardParallel`` traces it (an ``AutoLayerOption`` cuts the loss function
    while tracing); its stages and shardings are replayed.
    """

    def __init__(self, plan: ParallelPlan, devices=None):
        self.parallel_plan = plan
        self.devices = devices
        self.num_micro_batches = plan.num_micro_batches
        pipeline = plan.pipeline_plan
        self._pipeshard = None
        if pipeline is not None:
            # The recorded schedule and layer option; its stage and sharding options are
            # never read, the recorded decisions take their place.
            self._pipeshard = PipeshardParallel(
                devices=devices,
                num_micro_batches=plan.num_micro_batches or 1,
                pipeline_schedule=pipeline.pipeline_schedule,
                layer_option=pipeline.layer_option,
            )

    def trace_context(self) -> contextlib.AbstractContextManager:
        if self._pipeshard is None:
            return contextlib.nullcontext()
        return self._pipeshard.trace_context()

    def plan(self, traced: TracedStep, args: Sequence[Any], require_devices: bool = False):
        """The recorded plan of ``traced``: a ``ShardingPlan`` or a ``PipeshardPlan``."""
        self.parallel_plan.check_step(traced)
        if self._pipeshard is None:
            return self._sharding_plan(traced, require_devices)
        return self._pipeshard_plan(traced, args, require_devices)[0]

    def compile_executable(self, traced: TracedStep, args: Sequence[Any]) -> Executable:
        self.parallel_plan.check_step(traced)
        if self._pipeshard is None:
            plan = self._sharding_plan(traced, require_devices=True)
            cluster = resolve_cluster(self.devices)
            return _compile_one_mesh(cluster, traced, plan, self.num_micro_batches)
        plan, cluster = self._pipeshard_plan(traced, args, require_devices=True)
        return compile_pipeshard_plan(plan, cluster)

    def _sharding_plan(self, traced: TracedStep, require_devices: bool) -> ShardingPlan:
        recorded = self.parallel_plan.sharding_plan
        mesh = resolve_cluster(self.devices).logical_mesh(None, require_devices)
        if mesh.num_devices != recorded.logical_mesh.num_devices:
            raise ValueError(
                f"the ParallelPlan of {self.parallel_plan.step_name} was made for "
                f"{recorded.logical_mesh.num_devices} devices but devices has "
                f"{mesh.num_devices}"
            )
        logical = replace(recorded.logical_mesh, devices=mesh.devices)
        return _bound_sharding_plan(recorded, traced.jaxpr, logical)

    def _pipeshard_plan(self, traced: TracedStep, args, require_devices: bool):
        cluster = self._pipeshard.resolved_cluster()
        info = self.parallel_plan.cluster_info
        shape = (cluster.spec.num_nodes, cluster.spec.num_devices_per_node)
        if shape != (info.num_hosts, info.num_devices_per_host):
            raise ValueError(
                f"the ParallelPlan of {self.parallel_plan.step_name} was made for a cluster "
                f"of {info.num_hosts} x {info.num_devices_per_host} devices but devices is "
                f"{shape[0]} x {shape[1]}"
            )
        if require_devices:
            cluster.check_here()
        pipeline = self.parallel_plan.pipeline_plan
        recorded = pipeline.decisions
        row_split = None
        if pipeline.split_rows:  # the recorded refs name values of the split step
            traced, row_split = pipeline_step(traced, pipeline.layer_option)
            if row_split is None:
                raise ValueError(
                    f"the ParallelPlan of {self.parallel_plan.step_name} splits stacked "
                    f"parameters by rows, but {traced.name} has none to split: it was made "
                    "for another step"
                )
        vars_by_ref = {ref: v for v, ref in value_refs(traced.jaxpr).items()}
        eqns_by_ref = eqn_refs(traced.jaxpr)
        decisions = replace(
            recorded,
            stage_pins=tuple(
                pins.rekeyed(
                    lambda ref: _lookup(vars_by_ref, ref, traced),
                    lambda ref: _lookup(eqns_by_ref, ref, traced, "an equation"),
                )
                for pins in recorded.stage_pins
            ),
        )
        options = PipeshardOptions(
            cluster.spec,
            self._pipeshard.num_micro_batches,
            pipeline_schedule=pipeline.pipeline_schedule,
            layer_option=pipeline.layer_option,
        )
        plan = plan_pipeshard(
            traced,
            options,
            args=args,
            devices=cluster.devices,
            decisions=decisions,
            row_split=row_split,
        )
        return plan, cluster

    def __repr__(self) -> str:
        plan = self.parallel_plan
        return (
            f"PlannedParallel({plan.method} plan of {plan.step_name}, "
            f"num_micro_batches={plan.num_micro_batches})"
        )


def _lookup(by_ref: dict, ref: str, traced: TracedStep, kind: str = "a value"):
    """The value (or equation: ``kind``) ``ref`` names in ``traced``."""
    found = by_ref.get(ref)
    if found is None:
        raise ValueError(
            f"the ParallelPlan names {kind} {ref!r} that {traced.name} does not have: it "
            "was made for another step"
        )
    return found


def _bound_sharding_plan(
    plan: ShardingPlan, jaxpr: Jaxpr, logical_mesh: LogicalDeviceMesh
) -> ShardingPlan:
    """The portable ``plan`` on the values and equations of ``jaxpr``, on
    ``logical_mesh``."""
    vars_by_ref = {ref: v for v, ref in value_refs(jaxpr).items()}
    eqns_by_ref = eqn_refs(jaxpr)

    def find(table: dict, ref: str):
        if ref not in table:
            raise ValueError(
                f"the ParallelPlan names {ref!r}, which this step does not have: it was "
                "made for another step"
            )
        return table[ref]

    if len(plan.in_specs) != len(jaxpr.invars) or len(plan.out_specs) != len(jaxpr.outvars):
        raise ValueError(
            f"the ParallelPlan has {len(plan.in_specs)} inputs and {len(plan.out_specs)} "
            f"outputs, this step {len(jaxpr.invars)} and {len(jaxpr.outvars)}: it was made "
            "for another step"
        )
    return replace(
        plan,
        logical_mesh=logical_mesh,
        var_specs={find(vars_by_ref, r): spec for r, spec in plan.var_specs.items()},
        operand_specs={find(eqns_by_ref, r): s for r, s in plan.operand_specs.items()},
        partial_sums={find(eqns_by_ref, r): p for r, p in plan.partial_sums.items()},
    )


def plan_to_method(plan: ParallelPlan, devices=None) -> PlannedParallel:
    """A parallel method that compiles the step ``plan`` was recorded for exactly as
    recorded, without searching (no ILP, no stage DP). ``devices``: as a method's
    (default: the global mesh); it must have the plan's number of devices."""
    if not isinstance(plan, ParallelPlan):
        raise TypeError(
            "plan_to_method expects a ParallelPlan (executable.get_parallel_plan() or "
            f"ParallelPlan.load(path)), got {type(plan).__name__}"
        )
    return PlannedParallel(plan, devices)
