"""A ``PipeshardPlan`` projected onto its meshes: one ``WorkerProgram`` per mesh of devices.

The Ray executable (``pipeshard_ray``) runs the plan's instructions on mesh workers. The
plan has one global instruction order; each mesh's workers run their part of it:

* every stage computation the plan's instructions ``RUN`` (and every ``ALLOC`` of
  accumulators) is a ``jax.jit`` of :class:`StagePrograms` on an abstract mesh of the
  stage's logical shape, exported (``jax.export``) for the workers' platform; the mesh's
  workers compile it;
* each plan opcode has one projection in :data:`PROJECTIONS` (as the local runtime has one
  handler per opcode): ``LOAD``, ``RUN`` and ``ALLOC`` stay on their mesh under their own
  names; a ``RESHARD`` becomes a ``SEND`` on the source mesh and a ``RECV`` on the
  destination mesh with the tile plan the ``PipeshardPlan`` recorded for it
  (``PipeshardPlan.reshards``), or, between two stages on one mesh, a compiled relayout.
  Projecting one valid sequential order onto the meshes cannot deadlock: a ``RECV`` waits
  only for a ``SEND`` that comes earlier in that order, and sends never wait;
* each buffer's last use drops it on its own mesh, so after a step the workers hold only
  the step's inputs they were given and its outputs;
* each step output says where it comes from (:data:`OutputSource`): a mesh's program
  output, a constant computed on the driver, or a literal.

Nothing here needs a device or Ray: the projection of a plan made with ``.plan()`` is
testable in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from alpa.executables.distributed import serialize_jitted
from alpa.executables.stage_programs import StagePrograms
from alpa.pipeline_parallel.pipeshard_plan import PipeshardPlan
from alpa.pipeline_parallel.program.stage_sharding import DATA_AXES
from alpa.runtime.instructions import (
    ConstOutput,
    Instruction,
    MicroBatchOutput,
    Op,
    activation_keys,
)
from alpa.runtime.ray_launch import MeshOutput
from alpa.runtime.worker_program import (
    ExportedFn,
    Layout,
    WorkerInstruction,
    WorkerOp,
    WorkerProgram,
)

# ----------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class MeshOutputSource:
    """A step output that mesh (of devices) ``mesh`` returns as its program's output
    ``index``; its buffer belongs to stage mesh ``stage_mesh``."""

    mesh: int
    index: int
    stage_mesh: int

    def read(self, per_mesh: Sequence[Sequence[Any]], consts: Mapping[str, Any]) -> Any:
        return per_mesh[self.mesh][self.index]


@dataclass(frozen=True)
class ConstOutputSource:
    """A step output computed on the driver from constants (``StagePrograms.const_outputs``)."""

    name: str

    def read(self, per_mesh: Sequence[Sequence[Any]], consts: Mapping[str, Any]) -> Any:
        return consts[self.name]


@dataclass(frozen=True)
class LiteralOutputSource:
    """A step output that is a literal of the program."""

    value: Any

    def read(self, per_mesh: Sequence[Sequence[Any]], consts: Mapping[str, Any]) -> Any:
        return jax.numpy.asarray(self.value)


OutputSource = MeshOutputSource | ConstOutputSource | LiteralOutputSource


# ----------------------------------------------------------------------------- one mesh


class MeshProgramBuilder:
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


# ----------------------------------------------------------------------------- projections


@dataclass
class _Projector:
    """What the projection of each instruction reads and writes: the plan, its stage
    programs, and per mesh of devices its builder and Ray mesh id."""

    plan: PipeshardPlan
    stages: StagePrograms
    mesh_ids: Sequence[int]
    platform: str
    builders: list[MeshProgramBuilder] = field(init=False)

    def __post_init__(self):
        self.builders = [MeshProgramBuilder() for _ in self.mesh_ids]
        self.logical_shapes = [tuple(m.shape) for m in self.plan.logical_meshes]
        self.mesh_of = self.plan.instructions.physical_mesh

    def builder(self, stage_mesh: int) -> MeshProgramBuilder:
        return self.builders[self.mesh_of(stage_mesh)]

    def exported(self, builder, mesh, key, name, jitted, structs, out_shardings, donate=()):
        """The index in ``builder``'s functions of ``jitted`` exported for the workers'
        platform on stage mesh ``mesh``'s logical shape (exported once per ``key``)."""
        if key not in builder.fn_index:
            shape = self.logical_shapes[mesh]
            builder.fn_index[key] = len(builder.fns)
            builder.fns.append(
                ExportedFn(
                    name,
                    serialize_jitted(jitted, structs, self.platform),
                    tuple(Layout(shape, DATA_AXES, s.sharding.spec) for s in structs),
                    tuple(Layout(shape, DATA_AXES, s.spec) for s in out_shardings),
                    tuple(donate),
                )
            )
        return builder.fn_index[key]


def _project_load(p: _Projector, tag: int, ins: Instruction) -> None:
    b, layout = p.builder(ins.mesh), p.plan.buffer_layout(ins.outputs[0])
    b.emit(
        WorkerOp.LOAD,
        out_slots=tuple(b.slot(k) for k in ins.outputs),
        arg=b.arg(ins.leaf, layout),
        layout=layout,
        micro_batch_size=p.plan.program.closed_jaxpr.jaxpr.invars[ins.leaf].aval.shape[0],
    )


def _project_run(p: _Projector, tag: int, ins: Instruction) -> None:
    b = p.builder(ins.mesh)
    kernel = p.plan.instructions.kernels[ins.computation]
    computation = p.plan.program.computations[kernel.computation]
    jitted, structs, outs = p.stages.kernel(kernel)
    num_in = len(computation.invars)
    donate = range(len(structs) - num_in)  # the running sums come first
    key = ("kernel", ins.computation)
    fn = p.exported(b, ins.mesh, key, computation.name, jitted, structs, outs, donate)
    b.computation_of[len(b.ops)] = kernel.computation
    b.emit(
        WorkerOp.RUN,
        in_slots=tuple(b.slot(k) for k in ins.inputs),
        out_slots=tuple(b.slot(k) for k in ins.outputs),
        fn=fn,
    )


def _project_alloc(p: _Projector, tag: int, ins: Instruction) -> None:
    b = p.builder(ins.mesh)
    zeros = p.stages.zeros(ins.outputs)
    shardings = [p.stages.key_sharding(k) for k in ins.outputs]
    fn = p.exported(b, ins.mesh, ("zeros", ins.outputs), "zeros", zeros, [], shardings)
    b.emit(WorkerOp.ALLOC, out_slots=tuple(b.slot(k) for k in ins.outputs), fn=fn)


def _project_reshard(p: _Projector, tag: int, ins: Instruction) -> None:
    (src,), (dst,) = ins.inputs, ins.outputs  # dst on ins.mesh
    b, s = p.builder(ins.mesh), p.builder(src[2])
    if b is s:  # between two stages on one mesh: a compiled relayout on its workers
        jitted, structs, outs = p.stages.relayout(src, dst)
        key = ("relayout", src[0], src[2], ins.mesh)
        fn = p.exported(b, ins.mesh, key, "relayout", jitted, structs, outs)
        b.emit(WorkerOp.RUN, in_slots=(b.slot(src),), out_slots=(b.slot(dst),), fn=fn)
        return
    transfer = p.plan.reshards[tag]
    s.emit(
        WorkerOp.SEND,
        in_slots=(s.slot(src),),
        transfer=transfer,
        tag=tag,
        peer_mesh=p.mesh_ids[p.mesh_of(dst[2])],
    )
    b.emit(
        WorkerOp.RECV,
        out_slots=(b.slot(dst),),
        layout=p.plan.buffer_layout(dst),
        transfer=transfer,
        tag=tag,
        peer_mesh=p.mesh_ids[p.mesh_of(src[2])],
    )


#: Plan opcode -> its projection onto the worker programs of the meshes (``tag``: the
#: instruction's index, which pairs a ``SEND`` with its ``RECV``).
PROJECTIONS: dict[Op, Callable[[_Projector, int, Instruction], None]] = {
    Op.LOAD: _project_load,
    Op.RUN: _project_run,
    Op.ALLOC: _project_alloc,
    Op.RESHARD: _project_reshard,
}


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Projection:
    """A plan projected onto its meshes of devices (see the module docstring).

    Attributes:
      programs: per mesh, its workers' program.
      mesh_args: per mesh, ``(leaf, layout)`` of each step argument its program reads.
      mesh_outputs: per mesh, what each of its program's outputs is.
      sources: per step output, where it comes from.
      const_names: the constant outputs the driver computes.
      computation_of: per mesh, a ``RUN``'s index in its program -> the plan's
        computation it runs (a relayout between two stages is none).
    """

    programs: tuple[WorkerProgram, ...]
    mesh_args: tuple[tuple[tuple[int, Layout], ...], ...]
    mesh_outputs: tuple[tuple[MeshOutput, ...], ...]
    sources: tuple[OutputSource, ...]
    const_names: frozenset[str]
    computation_of: tuple[dict[int, int], ...]


def project_plan(
    plan: PipeshardPlan, stages: StagePrograms, mesh_ids: Sequence[int], platform: str
) -> Projection:
    """``plan`` as one worker program per mesh of devices (Ray mesh ids ``mesh_ids``, one
    per ``plan.instructions.physical_mesh``), its functions exported for ``platform``."""
    p = _Projector(plan, stages, list(mesh_ids), platform)
    _project_inputs(p)
    for tag, ins in enumerate(plan.instructions.instructions):
        PROJECTIONS[ins.op](p, tag, ins)
        for key in ins.free:
            owner = p.builder(key[2])
            owner.ops[-1]["free"].append(owner.slot(key))
    outputs, sources, const_names = _project_outputs(p)
    activations = activation_keys(plan.instructions)
    return Projection(
        programs=tuple(b.build(activations) for b in p.builders),
        mesh_args=tuple(tuple(b.args) for b in p.builders),
        mesh_outputs=tuple(tuple(o) for o in outputs),
        sources=tuple(sources),
        const_names=frozenset(const_names),
        computation_of=tuple(b.computation_of for b in p.builders),
    )


def _project_inputs(p: _Projector) -> None:
    """``INPUT`` of each persistent buffer, on its mesh (the step's leaves, then the row
    ids of its random draws)."""
    plan = p.plan
    inputs = plan.program.closed_jaxpr.jaxpr.invars
    leaf_index = {plan.names[v]: i for i, v in enumerate(inputs)}
    for key in sorted(plan.instructions.persistent, key=str):
        b, layout = p.builder(key[2]), plan.buffer_layout(key)
        b.emit(
            WorkerOp.INPUT,
            out_slots=(b.slot(key),),
            arg=b.arg(leaf_index[key[0]], layout),
            layout=layout,
        )


def _project_outputs(p: _Projector):
    """Per mesh, what its workers return (a micro-batched output combined there first);
    per step output, where it comes from; the constant outputs' names."""
    layout = p.plan.buffer_layout
    var_of = p.stages.var_of
    sources: list[OutputSource] = []
    outputs: list[list[MeshOutput]] = [[] for _ in p.builders]
    const_names = set()
    for output in p.plan.instructions.outputs:
        if isinstance(output, ConstOutput):
            sources.append(ConstOutputSource(output.name))
            const_names.add(output.name)
            continue
        if not output.keys:
            sources.append(LiteralOutputSource(output.value))
            continue
        keys = output.keys
        m = p.mesh_of(keys[0][2])
        b = p.builders[m]
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
        sources.append(MeshOutputSource(m, len(b.outputs), keys[0][2]))
        b.outputs.append(slot)
        outputs[m].append(MeshOutput(shape, aval.dtype, bool(aval.weak_type), layout(keys[0])))
    return outputs, sources, const_names
