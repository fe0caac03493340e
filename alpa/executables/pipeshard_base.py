"""PipeshardExecutable: what the two pipelined executables share.

A ``PipeshardPlan`` runs either in this process (``pipeshard.PipeshardDriverExecutable``,
the local runtime) or on Ray mesh workers (``pipeshard_ray.PipeshardRayExecutable``).
Both read the same plan, take and return the same leaves, place them by the same specs and
keep the same trace; they differ only in how a step's instructions run and where the
compiled programs live. This abstract base holds the common part once:

* the plan's parts under Alpa's attribute names (``program``, ``stage_plan``, ``schedule``,
  ``instructions``, ``num_micro_batches``), the compiled signatures a dispatch checks;
* one step (:meth:`_run`): split leaves cut into their stages' rows, the micro-batched
  step arguments, the runtime's part (:meth:`_execute`), the trace, the rows joined back;
* the placement specs of inputs and outputs, ``stage_input_shard_specs``,
  ``get_stage_execution_info`` and ``dump_debug_info``'s schedule.

A subclass gives :meth:`_execute`, :meth:`_placement`, :meth:`_stage_devices`,
:meth:`_record_trace`, :meth:`_dump_programs` and the per-mesh reports declared here.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence
from typing import Any

import jax

from alpa.executables.base import Executable, check_dispatch_args
from alpa.executables.stage_programs import input_placement_specs
from alpa.executables.stage_trace import StageTrace
from alpa.global_env import global_config
from alpa.pipeline_parallel.pipeshard_plan import PipeshardPlan
from alpa.pipeline_parallel.program.program_rewrites import step_arguments
from alpa.runtime.placement import PlacementSpec, caller_placements
from alpa.shard_parallel.lowering.compile import full_batch_avals
from alpa.tracing import leaf_signature


class PipeshardExecutable(Executable):
    """A pipelined step compiled from a ``PipeshardPlan`` (see the module docstring)."""

    def __init__(self, plan: PipeshardPlan):
        self.plan = plan
        self.traced = plan.user_traced  # what callers pass and get back
        self._row_split = plan.row_split
        self.program = plan.program
        self.stage_plan = plan.stage_plan
        self.schedule = plan.schedule
        self.instructions = plan.instructions
        self.num_micro_batches = plan.num_micro_batches
        self.collect_trace = False  # this executable's own switch (or global_config's)
        self.stage_trace = StageTrace(len(plan.program.computations))
        full = full_batch_avals(self.traced, plan.num_micro_batches)
        self._signatures = [leaf_signature(a) for a in full]
        # Per leaf split by rows, where its parts live (none: a StackedRows of slices).
        self._in_layouts: dict = {}
        self._out_layouts: dict = {}
        self._last_outputs: list = []

    # -- running

    def dispatch(self, *dynamic_args: Any) -> Any:
        leaves = check_dispatch_args(self.traced, dynamic_args, self._signatures)
        return jax.tree.unflatten(self.traced.out_tree, self._run(leaves))

    def placing_dispatch(self) -> Any:
        # The runtime places each input on its mesh (the local runtime at the start of
        # every step, Ray's workers as their programs say).
        return self.dispatch

    def _run(self, flat_args: Sequence[Any]) -> list:
        """One step on the caller's flat leaves; the caller's flat outputs."""
        split = self._row_split
        if split is not None:
            flat_args = split.split_args(flat_args, self._in_layouts)
        args = step_arguments(self.program, flat_args, self.num_micro_batches)
        trace = self.collect_trace or global_config.collect_trace
        outputs = self._execute(args, trace)
        if trace:
            self._record_trace()
        if split is not None:
            outputs = split.join_outputs(outputs, self._out_layouts)
        self._last_outputs = outputs
        return outputs

    @abc.abstractmethod
    def _execute(self, args: Sequence[Any], trace: bool) -> list:
        """Run the plan's instructions on the step arguments (``step_arguments``); the
        program's flat outputs. With ``trace`` every stage computation is waited for and
        timed."""

    @abc.abstractmethod
    def _record_trace(self) -> None:
        """The last (traced) step's stage computations into ``stage_trace``."""

    # -- placement

    @abc.abstractmethod
    def _placement(self, var, meshes: Sequence[int]) -> PlacementSpec:
        """The placement spec of ``var`` on the stage meshes ``meshes``."""

    def flat_input_placement_specs(self) -> list[PlacementSpec]:
        specs = input_placement_specs(
            self.plan.traced, self.program.input_stages, self.num_micro_batches, self._placement
        )
        return caller_placements(self._row_split, specs)

    def flat_output_placement_specs(self) -> list[PlacementSpec]:
        specs = []
        jaxpr = self.plan.traced.jaxpr
        for v, output in zip(jaxpr.outvars, self.instructions.outputs, strict=True):
            if output.keys:  # the mesh of the buffer(s) it is read from
                specs.append(self._placement(v, (output.keys[0][2],)))
            else:
                specs.append(PlacementSpec(getattr(v, "aval", None), (), ()))
        return caller_placements(self._row_split, specs, outputs=True)

    @property
    def stage_input_shard_specs(self) -> list[list]:
        """Alpa's name: per stage, the ``PartitionSpec`` of each input
        (``PipeshardPlan.stage_input_specs``)."""
        return self.plan.stage_input_specs()

    # -- what ran

    @abc.abstractmethod
    def _stage_devices(self, computation: int) -> tuple[tuple, tuple]:
        """The hosts and devices (of each host, the device indices) of the mesh that runs
        stage computation ``computation``."""

    def get_stage_execution_info(self) -> list[list[tuple]]:
        """Alpa's: per stage computation, when each of its traced runs started and
        stopped (steps run with ``global_config.collect_trace`` or ``collect_trace`` set),
        and its mesh's hosts and devices."""
        return self.stage_trace.info(self._stage_devices)

    @abc.abstractmethod
    def get_hlo_names(self) -> list[str]:
        """The name of each program ``get_hlo_text`` returns, in its order."""

    @abc.abstractmethod
    def peak_live_micro_batches(self) -> list[int]:
        """Per mesh, the most micro-batches whose activations (or cotangents) the last
        step held on it at once, counted as the step ran: a schedule's in-flight bound
        (``PipelineSchedule.max_in_flight``) as executed."""

    @abc.abstractmethod
    def get_peak_memory_per_mesh(self) -> list[int]:
        """Per stage mesh, the peak bytes a device of it allocated."""

    @abc.abstractmethod
    def get_resharded_bytes(self) -> int:
        """Bytes a step moves between meshes (``RESHARD``), by the tile plans: each
        piece of a value once per destination host."""

    def dump_debug_info(self, folder: str) -> None:
        """The schedule's grid (``schedule.txt``) and the programs as they run."""
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "schedule.txt"), "w") as f:
            f.write(self.schedule.grid() + "\n")
        self._dump_programs(folder)

    @abc.abstractmethod
    def _dump_programs(self, folder: str) -> None:
        """Write the compiled programs and instruction lists into ``folder``."""
