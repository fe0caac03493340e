"""PipeshardRayExecutable: a pipelined step on Ray mesh workers.

The same :class:`~alpa.pipeline_parallel.pipeshard_plan.PipeshardPlan` the local runtime
runs, cut into one :class:`~alpa.runtime.worker_program.WorkerProgram` per mesh of devices
by ``worker_projection.project_plan`` (one projection per plan opcode; each step output
typed by where it comes from).

The driver ships the programs once (``RayStepLauncher``); a step sends each worker one
message with the step's inputs (or the names of the ``DistributedArray`` s it already
holds) and gets ``DistributedArray`` s back.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from alpa.executables.distributed import abstract_mesh
from alpa.executables.pipeshard_base import PipeshardExecutable
from alpa.executables.stage_programs import StagePrograms, hlo_order
from alpa.executables.worker_projection import project_plan
from alpa.pipeline_parallel.pipeshard_plan import PipeshardPlan
from alpa.pipeline_parallel.program.stage_sharding import DATA_AXES
from alpa.runtime.mesh_group import PhysicalMeshGroup
from alpa.runtime.placement import PlacementSpec, place
from alpa.runtime.ray_launch import RayStepLauncher
from alpa.runtime.ray_mesh import DistributedPhysicalDeviceMesh, wait_workers
from alpa.runtime.worker_program import Layout, WorkerOp


class PipeshardRayExecutable(PipeshardExecutable):
    """Runs a pipelined step on Ray mesh workers: one mesh per stage, or, where the schedule
    places several stages on one mesh (interleaved 1F1B, DualPipeV), per group of devices, whose
    workers run the instructions of all its stages.

    ``meshes`` are those of the plan's meshes of devices
    (``PipelineInstructions.physical_mesh``), in order."""

    def __init__(self, plan: PipeshardPlan, meshes: Sequence[DistributedPhysicalDeviceMesh]):
        super().__init__(plan)
        self.meshes = list(meshes)
        self._mesh_of = plan.instructions.physical_mesh  # a stage's mesh -> its devices' mesh
        self._logical_shapes = [tuple(m.shape) for m in plan.logical_meshes]
        stages = StagePrograms(
            plan, [abstract_mesh(shape, DATA_AXES) for shape in self._logical_shapes]
        )
        self._stages = stages
        self._check_meshes()
        projection = project_plan(
            plan, stages, [m.mesh_id for m in self.meshes], self.meshes[0].cluster.platform
        )
        self._output_sources = projection.sources
        self._const_outputs = stages.const_outputs(projection.const_names)
        self._programs = list(projection.programs)
        self.mesh_group = PhysicalMeshGroup(self.meshes, [m.mesh_id for m in self.meshes])
        self._computation_of = list(projection.computation_of)
        self._tracing = False  # whether the workers time every RUN
        self.launcher = RayStepLauncher(
            self.meshes,
            self._programs,
            projection.mesh_args,
            projection.mesh_outputs,
            frozenset(),
        )

    def _check_meshes(self) -> None:
        """Each mesh has as many devices per host as its stage's submesh."""
        for m, mesh in enumerate(self.meshes):
            planned = int(self.plan.stage_plan.submesh_shapes[m][1])
            if mesh.num_devices_per_host != planned:
                raise ValueError(
                    f"mesh {m} has {mesh.num_devices_per_host} devices per host but the plan's "
                    f"stage {m} submesh has {planned}: its tile plans would name other hosts"
                )

    # -- running

    def launch(self, flat_args: Sequence[Any]) -> list:
        return self._run(flat_args)

    def _execute(self, args: Sequence[Any], trace: bool) -> list:
        if trace != self._tracing:  # tell the workers to wait for and time every RUN
            for mesh in self.meshes:
                mesh.call("trace_runs", self.launcher.program_id, trace)
            self._tracing = trace
        per_mesh = self.launcher.launch(args)
        return [src.read(per_mesh, self._const_outputs) for src in self._output_sources]

    def step_seconds(self) -> list[list[float]]:
        return self.launcher.mesh_step_seconds

    def sync(self) -> None:
        """Steps on Ray return when every worker finished; nothing is left to wait for."""

    def _record_trace(self) -> None:
        """The last step's stage computations as each mesh's first worker timed them."""
        pid = self.launcher.program_id
        per_mesh = wait_workers(
            [(m.workers[0].run_times.remote(pid), m.label(0)) for m in self.meshes]
        )
        for computation_of, times in zip(self._computation_of, per_mesh, strict=True):
            for index, start, stop in times:
                if index in computation_of:  # not a relayout between two stages
                    self.stage_trace.add(computation_of[index], start, stop)

    def _stage_devices(self, computation: int) -> tuple[tuple, tuple]:
        mesh = self.meshes[self._mesh_of(self.program.computations[computation].stage)]
        first = mesh.first_device
        return mesh.host_ids, tuple(range(first, first + mesh.num_devices_per_host))

    def preshard_flat_args(self, flat_args: Sequence[Any]) -> list[Any]:
        """Each leaf as a ``DistributedArray`` on the mesh of the first stage that reads
        it, laid out as that stage reads it (a split stacked leaf as its rows on their
        stages'): a step then sends none of them."""
        specs = self.flat_input_placement_specs()
        return [
            place(x, spec) if spec.placements else x
            for x, spec in zip(flat_args, specs, strict=True)
        ]

    # -- what was compiled

    @property
    def bytes_sent_last_step(self) -> int:
        """Bytes the driver sent for the last step (host inputs and messages)."""
        return self.launcher.bytes_sent_last_step

    def worker_counters(self) -> list[list[dict]]:
        """Per mesh, per host: bytes the worker sent to and received from other meshes."""
        return [m.call("counters") for m in self.meshes]

    def get_resharded_bytes(self) -> int:
        """Bytes a step's ``SEND`` s move between meshes, by the tile plans."""
        return sum(
            ins.transfer.nbytes()
            for p in self._programs
            for ins in p.instructions
            if ins.op is WorkerOp.SEND
        )

    def _placement(self, var, meshes) -> PlacementSpec:
        specs = tuple(self._stages.sharding(var, m).spec for m in meshes)
        return PlacementSpec(
            var.aval,
            tuple(self.meshes[self._mesh_of(m)].mesh_id for m in meshes),
            specs,
            tuple(
                (self.meshes[self._mesh_of(m)], Layout(self._logical_shapes[m], DATA_AXES, spec))
                for m, spec in zip(meshes, specs, strict=True)
            ),
        )

    def _stage_functions(self) -> list[tuple[str, int, int]]:
        """``(name, mesh, function)`` of each stage computation, in Alpa's order of stage
        programs (``hlo_order``: the forwards, the backwards from the last stage to the
        first, apply-grad), as the local executable lists them; the meshes' other loaded
        functions (the gradient accumulators' ``zeros``) are left out."""
        where = {
            fn.name: (m, i)
            for m, program in enumerate(self._programs)
            for i, fn in enumerate(program.fns)
        }
        names = [self.program.computations[c].name for c in hlo_order(self.program)]
        return [(name, *where[name]) for name in names if name in where]

    def get_hlo_names(self) -> list[str]:
        """The name of each program ``get_hlo_text`` returns, in its order."""
        return [name for name, _, _ in self._stage_functions()]

    def get_hlo_text(self) -> list[str]:
        """Per stage program, in Alpa's order (``get_hlo_names``), the HLO the first worker
        of its mesh compiled."""
        return [
            self.meshes[m].call("hlo_text", self.launcher.program_id, i)[0]
            for _, m, i in self._stage_functions()
        ]

    def peak_live_micro_batches(self) -> list[int]:
        """Per mesh, the most micro-batches whose activations (or cotangents) the last
        step held on it at once, counted by its workers as they ran the step."""
        program_id = self.launcher.program_id
        return [max(mesh.call("peak_live_micro_batches", program_id)) for mesh in self.meshes]

    def get_peak_memory_per_mesh(self) -> list[int]:
        """Per stage mesh, the peak bytes a device of it allocated."""
        return [max(mesh.call("peak_memory")) for mesh in self.meshes]

    def live_buffers(self) -> list[list[dict]]:
        """Per mesh, per host: the buffer names its worker holds and its live arrays."""
        return [mesh.call("live_buffers") for mesh in self.meshes]

    def _dump_programs(self, folder: str) -> None:
        """Each mesh's worker program (``mesh{m}_program.txt``), one instruction a line."""
        for mesh, program in enumerate(self._programs):
            with open(os.path.join(folder, f"mesh{mesh}_program.txt"), "w") as f:
                for ins in program.instructions:
                    f.write(f"{ins.op} in={ins.in_slots} out={ins.out_slots} free={ins.free}\n")
