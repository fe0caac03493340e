"""PipeshardRayExecutable: a pipelined step on Ray mesh workers.

The same :class:`~alpa.pipeline_parallel.pipeshard_plan.PipeshardPlan` the local runtime
runs, cut into one :class:`~alpa.runtime.worker_program.WorkerProgram` per stage mesh:

* every stage computation the plan's instructions ``RUN`` (and every ``ALLOC`` of
  accumulators) is jitted by :class:`StagePrograms` on an abstract mesh of the stage's
  logical shape and exported (``jax.export``); the mesh's workers compile it;
* the global instruction order is projected onto each mesh: a mesh keeps its ``LOAD`` s,
  ``RUN`` s and ``ALLOC`` s; a ``RESHARD`` becomes a ``SEND`` on the source mesh and a
  ``RECV`` on the destination mesh, with the tile plan the ``PipeshardPlan`` recorded
  for it (``PipeshardPlan.reshards``). Projecting one
  valid sequential order onto the meshes cannot deadlock: a ``RECV`` waits only for a
  ``SEND`` that comes earlier in that order, and sends never wait;
* each buffer's last use drops it on its own mesh, so after a step the workers hold only
  the step's inputs they were given and its outputs.

The driver ships the programs once (``RayStepLauncher``); a step sends each worker one
message with the step's inputs (or the names of the ``DistributedArray`` s it already
holds) and gets ``DistributedArray`` s back.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax

from alpa.executables.base import Executable, check_dispatch_args
from alpa.executables.distributed import abstract_mesh, serialize_jitted
from alpa.executables.stage_programs import StagePrograms, hlo_order, input_placement_specs
from alpa.executables.stage_trace import StageTrace
from alpa.global_env import global_config
from alpa.pipeline_parallel.pipeshard_plan import PipeshardPlan
from alpa.pipeline_parallel.program_rewrites import step_arguments
from alpa.pipeline_parallel.stage_sharding import DATA_AXES
from alpa.runtime.instructions import ConstOutput, MicroBatchOutput, Op, activation_keys
from alpa.runtime.mesh_group import PhysicalMeshGroup
from alpa.runtime.placement import PlacementSpec, caller_placements, place
from alpa.runtime.ray_launch import MeshOutput, RayStepLauncher
from alpa.runtime.ray_mesh import DistributedPhysicalDeviceMesh, wait_workers
from alpa.runtime.resharding import worker_transfer_plan
from alpa.runtime.worker_program import (
    ExportedFn,
    Layout,
    WorkerInstruction,
    WorkerOp,
    WorkerProgram,
)
from alpa.shard_parallel.compile import full_batch_avals
from alpa.tracing import leaf_signature


class _MeshProgramBuilder:
    """One mesh's program, built instruction by instruction."""

    def __init__(self):
        self.fns: list[ExportedFn] = []
        self.fn_index: dict[Any, int] = {}
        self.slots: dict[Any, int] = {}
        self.ops: list[dict] = []
        self.args: list[tuple[int, Layout]] = []
        self.arg_index: dict[int, int] = {}
        self.outputs: list[int] = []
        self.computation_of: dict[int, int] = {}  # a RUN's op index -> its computation

    def slot(self, key) -> int:
        return self.slots.setdefault(key, len(self.slots))

    def arg(self, leaf: int, layout: Layout) -> int:
        if leaf not in self.arg_index:
            self.arg_index[leaf] = len(self.args)
            self.args.append((leaf, layout))
        return self.arg_index[leaf]

    def emit(self, op: WorkerOp, **fields) -> None:
        self.ops.append(dict(op=op, free=[], **fields))

    def build(self, activations: set) -> WorkerProgram:
        instructions = tuple(
            WorkerInstruction(**{**op, "free": tuple(op["free"])}) for op in self.ops
        )
        # The plan's activations (instructions.activation_keys; not what a relayout
        # between two stages of this mesh writes): the buffers the in-flight count is
        # about, named (stage's mesh, micro-batch).
        micro_batch_of: list[tuple | None] = [None] * len(self.slots)
        for key, slot in self.slots.items():
            if key in activations:
                micro_batch_of[slot] = (key[2], key[1])
        return WorkerProgram(
            tuple(self.fns),
            instructions,
            len(self.slots),
            tuple(self.outputs),
            tuple(micro_batch_of),
        )


class PipeshardRayExecutable(Executable):
    """Runs a pipelined step on Ray mesh workers: one mesh per stage, or, where the schedule
    places several stages on one mesh (interleaved 1F1B, DualPipeV), per group of devices, whose
    workers run the instructions of all its stages.

    ``meshes`` are those of the plan's meshes of devices
    (``PipelineInstructions.physical_mesh``), in order."""

    def __init__(self, plan: PipeshardPlan, meshes: Sequence[DistributedPhysicalDeviceMesh]):
        self.plan = plan
        self.traced = plan.user_traced  # what callers pass and get back
        self._row_split = plan.row_split
        self.program = plan.program
        self.stage_plan = plan.stage_plan
        self.schedule = plan.schedule
        self.instructions = plan.instructions
        self.num_micro_batches = plan.num_micro_batches
        self.meshes = list(meshes)
        self._mesh_of = plan.instructions.physical_mesh  # a stage's mesh -> its devices' mesh
        self._platform = self.meshes[0].cluster.platform
        self._logical_shapes = [tuple(m.shape) for m in plan.logical_meshes]
        stages = StagePrograms(
            plan, [abstract_mesh(shape, DATA_AXES) for shape in self._logical_shapes]
        )
        self._stages = stages
        var_of = stages.var_of
        # The program's inputs: the step's leaves, then the row ids of its random draws.
        inputs = plan.program.closed_jaxpr.jaxpr.invars
        leaf_index = {plan.names[v]: i for i, v in enumerate(inputs)}
        self._check_meshes()
        builders = self._project_instructions(stages, leaf_index)
        outputs, const_names = self._project_outputs(builders, var_of)
        self._const_outputs = stages.const_outputs(const_names)
        activations = activation_keys(plan.instructions)
        self._programs = [b.build(activations) for b in builders]
        self.mesh_group = PhysicalMeshGroup(self.meshes, [m.mesh_id for m in self.meshes])
        self._computation_of = [b.computation_of for b in builders]
        self.stage_trace = StageTrace(len(plan.program.computations))
        self._tracing = False
        self.launcher = RayStepLauncher(
            self.meshes,
            self._programs,
            [b.args for b in builders],
            outputs,
            frozenset(),
            worker_transfer_plan,
        )
        full = full_batch_avals(self.traced, plan.num_micro_batches)
        self._signatures = [leaf_signature(a) for a in full]
        self._last_outputs: list = []

    def _check_meshes(self) -> None:
        """Each mesh has as many devices per host as its stage's submesh."""
        for m, mesh in enumerate(self.meshes):
            planned = int(self.plan.stage_plan.submesh_shapes[m][1])
            if mesh.num_devices_per_host != planned:
                raise ValueError(
                    f"mesh {m} has {mesh.num_devices_per_host} devices per host but the plan's "
                    f"stage {m} submesh has {planned}: its tile plans would name other hosts"
                )

    def _exported(self, builder, mesh, key, name, jitted, structs, out_shardings, donate=()) -> int:
        """The index in ``builder``'s functions of ``jitted`` exported for ``mesh``'s
        platform (exported once per ``key``)."""
        if key not in builder.fn_index:
            in_layouts = [
                Layout(self._logical_shapes[mesh], DATA_AXES, s.sharding.spec) for s in structs
            ]
            out_layouts = [
                Layout(self._logical_shapes[mesh], DATA_AXES, s.spec) for s in out_shardings
            ]
            builder.fn_index[key] = len(builder.fns)
            builder.fns.append(
                ExportedFn(
                    name,
                    serialize_jitted(jitted, structs, self._platform),
                    tuple(in_layouts),
                    tuple(out_layouts),
                    tuple(donate),
                )
            )
        return builder.fn_index[key]

    def _project_instructions(self, stages, leaf_index) -> list[_MeshProgramBuilder]:
        """Per mesh, the worker program of the plan's instructions: ``INPUT`` of each
        persistent buffer, then each instruction's ops (a ``RESHARD`` is a ``SEND`` on its
        source mesh and a ``RECV`` on its destination), with the buffers it frees."""
        plan = self.plan
        inputs = plan.program.closed_jaxpr.jaxpr.invars
        layout = plan.buffer_layout
        exported = self._exported
        builders = [_MeshProgramBuilder() for _ in self.meshes]
        mesh_of = self._mesh_of
        for key in sorted(plan.instructions.persistent, key=str):
            b = builders[mesh_of(key[2])]
            b.emit(
                WorkerOp.INPUT,
                out_slots=(b.slot(key),),
                arg=b.arg(leaf_index[key[0]], layout(key)),
                layout=layout(key),
            )
        for tag, ins in enumerate(plan.instructions.instructions):
            m = ins.mesh
            b = builders[mesh_of(m)]
            if ins.op is Op.LOAD:
                b.emit(
                    WorkerOp.LOAD,
                    out_slots=tuple(b.slot(k) for k in ins.outputs),
                    arg=b.arg(ins.leaf, layout(ins.outputs[0])),
                    layout=layout(ins.outputs[0]),
                    micro_batch_size=inputs[ins.leaf].aval.shape[0],
                )
            elif ins.op is Op.RUN:
                kernel = plan.instructions.kernels[ins.computation]
                jitted, structs, outs = stages.kernel(kernel)
                num_in = len(plan.program.computations[kernel.computation].invars)
                name = plan.program.computations[kernel.computation].name
                fn = exported(
                    b,
                    m,
                    ("kernel", ins.computation),
                    name,
                    jitted,
                    structs,
                    outs,
                    range(len(structs) - num_in),  # the running sums come first
                )
                b.computation_of[len(b.ops)] = kernel.computation
                b.emit(
                    WorkerOp.RUN,
                    in_slots=tuple(b.slot(k) for k in ins.inputs),
                    out_slots=tuple(b.slot(k) for k in ins.outputs),
                    fn=fn,
                )
            elif ins.op is Op.ALLOC:
                zeros = stages.zeros(ins.outputs)
                shardings = [stages.key_sharding(k) for k in ins.outputs]
                fn = exported(b, m, ("zeros", ins.outputs), "zeros", zeros, [], shardings)
                b.emit(WorkerOp.ALLOC, out_slots=tuple(b.slot(k) for k in ins.outputs), fn=fn)
            elif ins.op is Op.RESHARD and mesh_of(ins.inputs[0][2]) == mesh_of(m):
                # Between two stages on one mesh: a compiled relayout on its workers.
                (src,), (dst,) = ins.inputs, ins.outputs
                jitted, structs, outs = stages.relayout(src, dst)
                key = ("relayout", src[0], src[2], m)
                fn = exported(b, m, key, "relayout", jitted, structs, outs)
                b.emit(WorkerOp.RUN, in_slots=(b.slot(src),), out_slots=(b.slot(dst),), fn=fn)
            elif ins.op is Op.RESHARD:
                (src,), (dst,) = ins.inputs, ins.outputs
                transfer = plan.reshards[tag]
                s = builders[mesh_of(src[2])]
                s.emit(
                    WorkerOp.SEND,
                    in_slots=(s.slot(src),),
                    transfer=transfer,
                    tag=tag,
                    peer_mesh=self.meshes[mesh_of(m)].mesh_id,
                )
                b.emit(
                    WorkerOp.RECV,
                    out_slots=(b.slot(dst),),
                    layout=layout(dst),
                    transfer=transfer,
                    tag=tag,
                    peer_mesh=self.meshes[mesh_of(src[2])].mesh_id,
                )
            else:  # pragma: no cover - a new opcode needs a projection here
                raise NotImplementedError(f"no Ray projection of opcode {ins.op}")
            for key in ins.free:
                owner = builders[mesh_of(key[2])]
                owner.ops[-1]["free"].append(owner.slot(key))
        return builders

    def _project_outputs(self, builders, var_of):
        """Per mesh, what its workers return (a micro-batched output combined there
        first); ``self._output_sources`` says, per step output, where it comes from."""
        plan = self.plan
        layout = plan.buffer_layout
        # Outputs: per step output, where it comes from.
        self._output_sources: list[tuple[str, Any]] = []
        outputs: list[list[MeshOutput]] = [[] for _ in self.meshes]
        const_names = set()
        for output in plan.instructions.outputs:
            if output.keys:
                keys = output.keys
                m = self._mesh_of(keys[0][2])
                b = builders[m]
                aval = var_of[keys[0][0]].aval
                shape = tuple(aval.shape)
                if isinstance(output, MicroBatchOutput):
                    concat = output.combine == "concat"
                    slot = b.slot((output.combine, keys))
                    b.emit(
                        WorkerOp.CONCAT if concat else WorkerOp.MEAN,
                        in_slots=tuple(b.slot(k) for k in keys),
                        out_slots=(slot,),
                        layout=layout(keys[0]),
                    )
                    if concat:
                        shape = (shape[0] * len(keys),) + shape[1:]
                else:
                    slot = b.slot(keys[0])
                self._output_sources.append(("mesh", (m, len(b.outputs), keys[0][2])))
                b.outputs.append(slot)
                outputs[m].append(
                    MeshOutput(shape, aval.dtype, bool(aval.weak_type), layout(keys[0]))
                )
            elif isinstance(output, ConstOutput):
                self._output_sources.append(("const", output.name))
                const_names.add(output.name)
            else:
                self._output_sources.append(("literal", output.value))
        return outputs, const_names

    # -- running

    def dispatch(self, *dynamic_args: Any) -> Any:
        leaves = check_dispatch_args(self.traced, dynamic_args, self._signatures)
        return jax.tree.unflatten(self.traced.out_tree, self._run(leaves))

    def placing_dispatch(self) -> Any:
        return self.dispatch

    def launch(self, flat_args: Sequence[Any]) -> list:
        return self._run(flat_args)

    def _run(self, flat_args: Sequence[Any]) -> list:
        split = self._row_split
        if split is not None:
            flat_args = split.split_args(flat_args)
        args = step_arguments(self.program, flat_args, self.num_micro_batches)
        trace = global_config.collect_trace
        if trace != self._tracing:  # tell the workers to wait for and time every RUN
            for mesh in self.meshes:
                mesh.call("trace_runs", self.launcher.program_id, trace)
            self._tracing = trace
        per_mesh = self.launcher.launch(args)
        if trace:
            self._record_trace()
        outputs = []
        for kind, value in self._output_sources:
            if kind == "mesh":
                outputs.append(per_mesh[value[0]][value[1]])
            elif kind == "const":
                outputs.append(self._const_outputs[value])
            else:
                outputs.append(jax.numpy.asarray(value))
        self._last_outputs = outputs
        return outputs if split is None else split.join_outputs(outputs)

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

    def get_stage_execution_info(self) -> list[list[tuple]]:
        """Alpa's: per stage computation, when each of its traced runs started and
        stopped (steps run with ``global_config.collect_trace`` set), and its mesh's hosts
        and devices (of each host, the device indices)."""
        computations = self.program.computations

        def where(c: int):
            mesh = self.meshes[self._mesh_of(computations[c].stage)]
            first = mesh.first_device
            return mesh.host_ids, tuple(range(first, first + mesh.num_devices_per_host))

        return self.stage_trace.info(where)

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

    @property
    def stage_input_shard_specs(self) -> list[list]:
        """Alpa's name: per stage, the ``PartitionSpec`` of each input
        (``PipeshardPlan.stage_input_specs``)."""
        return self.plan.stage_input_specs()

    def flat_input_placement_specs(self) -> list[PlacementSpec]:
        specs = input_placement_specs(
            self.plan.traced, self.program.input_stages, self.num_micro_batches, self._placement
        )
        return caller_placements(self._row_split, specs)

    def flat_output_placement_specs(self) -> list[PlacementSpec]:
        specs = []
        for v, (kind, value) in zip(
            self.plan.traced.jaxpr.outvars, self._output_sources, strict=True
        ):
            if kind == "mesh":
                specs.append(self._placement(v, (value[2],)))
            else:
                specs.append(PlacementSpec(getattr(v, "aval", None), (), ()))
        return caller_placements(self._row_split, specs, outputs=True)

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

    def dump_debug_info(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "schedule.txt"), "w") as f:
            f.write(self.schedule.grid() + "\n")
        for mesh, program in enumerate(self._programs):
            with open(os.path.join(folder, f"mesh{mesh}_program.txt"), "w") as f:
                for ins in program.instructions:
                    f.write(f"{ins.op} in={ins.in_slots} out={ins.out_slots} free={ins.free}\n")
