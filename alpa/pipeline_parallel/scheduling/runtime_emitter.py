"""Runtime emitter: schedule + stage computations -> instruction lists per mesh.

The emitter walks the schedule tick by tick. For each task it makes sure every input of the
task's computation is on the task's mesh (``LOAD`` the micro-batches of a batch argument,
or ``RESHARD`` a value from the mesh that holds it) and emits ``RUN``. A liveness pass then
attaches to every instruction the buffers whose last use it is (``Instruction.free``), so a
value dies as soon as nothing needs it; only the step's inputs (parameters, optimizer
state: the caller's arrays) and outputs survive a step. The opcodes:

* ``LOAD``: the ``k`` micro-batches of one batch argument on one mesh, in one instruction
  (one split, one transfer call), when the mesh first needs one of them.
* ``RUN``: a :class:`Kernel`: a stage computation, the outputs other instructions read,
  and the values it **accumulates** for the ``alpa.grad`` marker. Gradient accumulation
  happens inside the computation that produces the gradient, as in Alpa: the running sum
  is an input and a donated output of the stage's backward, and each micro-batch adds its
  gradient times ``1/k`` (floats; integers are summed), so the apply part reads the mean.
  With one micro-batch the gradient is written as the marker's value directly.
* ``ALLOC``: the zero accumulators of one kernel, once per step, before its first
  micro-batch.
* ``RESHARD``: a value from the mesh that holds it to the mesh that needs it.

A buffer is named by a :data:`BufferKey` ``(value name, micro-batch or None, mesh)``.
``runtime.instructions.simulate_memory`` replays the instructions and reports the peak of
live bytes each mesh holds, which is how the 1F1B and GPipe schedules are compared.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from alpa.pipeline_parallel.program.computation import PipelineProgram
from alpa.pipeline_parallel.scheduling.schedule_record import PipelineSchedule
from alpa.runtime.instructions import (
    Accumulation,
    BufferKey,
    BufferOutput,
    ConstOutput,
    Instruction,
    Kernel,
    LiteralOutput,
    MicroBatchOutput,
    Op,
    PipelineInstructions,
    StepOutput,
)
from alpa.tracing.jaxpr_util import is_var, nbytes


def emit_instructions(
    program: PipelineProgram,
    schedule: PipelineSchedule,
    names: dict,
) -> PipelineInstructions:
    """Emit the instructions of one step (see the module docstring).

    ``names`` maps every jaxpr variable to a stable string name.
    """
    emitter = _Emitter(program, schedule.num_micro_batches, names)
    for tick in schedule.ticks:
        apply_stages = [t.stage for t in tick if t.kind == "apply"]
        for task in tick:
            if task.kind == "apply":
                continue
            comp = program.computation(task.stage, task.kind)
            if comp is not None:
                emitter.run(comp, task.micro_batch)
        for level in range(program.apply_levels()):
            for stage in apply_stages:
                comp = program.computation(stage, "apply", level)
                if comp is not None:
                    emitter.run(comp, None)
    outputs = tuple(emitter.output(v) for v in program.closed_jaxpr.jaxpr.outvars)
    final_keys = {key for output in outputs for key in output.keys}
    return PipelineInstructions(
        instructions=tuple(_attach_frees(emitter.instructions, emitter.persistent | final_keys)),
        kernels=tuple(emitter.kernels),
        num_meshes=program.num_stages,
        persistent=frozenset(emitter.persistent),
        outputs=outputs,
        nbytes=emitter.nbytes,
        stage_meshes=schedule.stage_meshes,
    )


class _Emitter:
    """The state of one emission: the instructions so far, the buffers present, the
    kernels made; :meth:`run` emits one computation of one micro-batch."""

    def __init__(self, program: PipelineProgram, k: int, names: dict):
        self.program, self.k, self.names = program, k, names
        jaxpr = program.closed_jaxpr.jaxpr
        invars = list(jaxpr.invars)
        self.leaf_of = {v: i for i, v in enumerate(invars)}
        # The batch arguments: split into micro-batches.
        self.batch_inputs = {v for v in invars if v in program.batch_dependent}
        self.comps = {c: i for i, c in enumerate(program.computations)}
        self.instructions: list[Instruction] = []
        self.present: set[BufferKey] = set()
        self.nbytes: dict[BufferKey, int] = {}
        self.persistent: set[BufferKey] = set()
        for v in invars:
            if v not in self.batch_inputs:
                for s in program.input_stages[v]:
                    key = (names[v], None, s)
                    self.persistent.add(key)
                    self.present.add(key)
                    self.nbytes[key] = nbytes(v)
        # Which outputs of each computation are read by anything but the accumulation.
        self.accumulated_by_operand = {op: out for out, op in program.accumulated.items()}
        self.read_elsewhere = {v for c in program.computations for v in c.invars}
        self.read_elsewhere |= {v for v in jaxpr.outvars if is_var(v)}
        # Deferred gradients: accumulated as partial sums, reduced by their first reader
        # (apply computations of one stage, lowest level first), which writes the sum for
        # the others.
        self.partials = program.deferred.partials if program.deferred is not None else {}
        self.readers: dict = {}
        for comp in sorted(program.computations, key=lambda c: c.level):
            for v in comp.invars:
                if v in self.partials:
                    self.readers.setdefault(v, []).append(comp)
        self.kernels: list[Kernel] = []
        self.kernel_of: dict[int, int] = {}

    def mb_of(self, v, mb):
        program = self.program
        return mb if v in program.per_micro_batch or v in self.batch_inputs else None

    def ensure(self, v, mb, mesh) -> BufferKey:
        """The buffer of ``v`` (micro-batch ``mb``) on ``mesh``, loaded or resharded there
        first if it is not."""
        program, names = self.program, self.names
        key = (names[v], self.mb_of(v, mb), mesh)
        if key in self.present:
            return key
        if v in self.batch_inputs:
            keys = tuple((names[v], m, mesh) for m in range(self.k))
            self.instructions.append(Instruction(Op.LOAD, mesh, (), keys, leaf=self.leaf_of[v]))
            for each in keys:
                self.nbytes[each] = nbytes(v)
            self.present.update(keys)
            return key
        self.nbytes[key] = nbytes(v)
        sources = [program.home[v]] if v in program.home else list(program.input_stages[v])
        src = next(
            ((names[v], key[1], s) for s in sources if (names[v], key[1], s) in self.present),
            None,
        )
        if src is None:
            raise AssertionError(
                f"value {names[v]} (micro-batch {mb}) is not computed before mesh {mesh} needs it"
            )
        self.instructions.append(Instruction(Op.RESHARD, mesh, (src,), (key,)))
        self.present.add(key)
        return key

    def kernel_for(self, comp) -> int:
        index = self.comps[comp]
        if index in self.kernel_of:
            return self.kernel_of[index]
        k, partials, readers = self.k, self.partials, self.readers
        kept, accumulate = [], []
        for i, v in enumerate(comp.outvars):
            out = self.accumulated_by_operand.get(v)
            if out is not None and out not in self.read_elsewhere:
                out = None  # a marked value nothing reads (alpa.grad's loss): not summed
            if out is None or v in self.read_elsewhere:
                kept.append(i)
            if out is not None:
                scale = 1.0 / k if k > 1 and _is_float(out) else None
                sum_var = partials.get(out, out)
                accumulate.append(Accumulation(i, sum_var, scale, reads_sum=k > 1))
        reduces = tuple(
            i for i, v in enumerate(comp.invars) if v in partials and readers[v][0] is comp
        )
        publishes = tuple(i for i in reduces if len(readers[comp.invars[i]]) > 1)
        self.kernel_of[index] = len(self.kernels)
        self.kernels.append(Kernel(index, tuple(kept), tuple(accumulate), reduces, publishes))
        return self.kernel_of[index]

    def run(self, comp, mb) -> None:
        names, stage = self.names, comp.stage
        if not comp.eqns:
            self.present.update((names[v], self.mb_of(v, mb), stage) for v in comp.outvars)
            return
        index = self.kernel_for(comp)
        kernel = self.kernels[index]
        ins = [
            (names[self.partials[v]], None, stage)
            if i in kernel.reduces
            else self.ensure(v, mb, stage)
            for i, v in enumerate(comp.invars)
        ]
        outs = [
            (names[comp.outvars[i]], self.mb_of(comp.outvars[i], mb), stage) for i in kernel.kept
        ]
        outs += [(names[comp.invars[i]], None, stage) for i in kernel.publishes]
        sums = [(names[a.marker_out], None, stage) for a in kernel.accumulate]
        for key, a in zip(sums, kernel.accumulate, strict=True):
            self.nbytes[key] = nbytes(a.marker_out)
        missing = tuple(
            key
            for key, a in zip(sums, kernel.accumulate, strict=True)
            if a.reads_sum and key not in self.present
        )
        if missing:
            self.instructions.append(Instruction(Op.ALLOC, stage, (), missing, computation=index))
            self.present.update(missing)
        # The running sums are the kernel's first inputs (StagePrograms.computation).
        ins = [key for key, a in zip(sums, kernel.accumulate, strict=True) if a.reads_sum] + ins
        written = [comp.outvars[i] for i in kernel.kept]
        written += [comp.invars[i] for i in kernel.publishes]
        for key, v in zip(outs, written, strict=True):
            self.nbytes[key] = nbytes(v)
        self.instructions.append(
            Instruction(
                Op.RUN, stage, tuple(ins), tuple(outs + sums), computation=index, micro_batch=mb
            )
        )
        self.present.update(outs + sums)

    def output(self, v) -> StepOutput:
        """Where step output ``v`` is read from, once every computation has run."""
        program, names, k = self.program, self.names, self.k
        if not is_var(v):
            return LiteralOutput(v.val)
        if v in program.aliases and not is_var(program.aliases[v]):
            return LiteralOutput(program.aliases[v].val)
        if v in program.aliases:
            src = program.aliases[v]
            return BufferOutput(self.ensure(src, None, program.input_stages[src][0]))
        if v in program.const_eqns:
            return ConstOutput(names[v])
        if v in program.per_micro_batch:
            keys = tuple((names[v], m, program.home[v]) for m in range(k))
            batch_dependent = v in program.batch_dependent
            if batch_dependent and v.aval.ndim == 0 and k > 1 and _is_float(v):
                # A scalar computed from the batch (a loss): the mean over micro-batches,
                # which is the full batch's value for a mean over equal micro-batches.
                return MicroBatchOutput(keys, "mean")
            if batch_dependent and v.aval.ndim > 0:
                return MicroBatchOutput(keys, "concat")
            return BufferOutput(keys[-1])  # the same every micro-batch, or a non-float scalar
        if v in self.leaf_of:
            return BufferOutput(self.ensure(v, None, program.input_stages[v][0]))
        return BufferOutput((names[v], None, program.home[v]))


def _is_float(v) -> bool:
    # jax's issubdtype: a PRNG key's dtype is not a numpy dtype.
    return jax.dtypes.issubdtype(v.aval.dtype, np.inexact)


def _attach_frees(instructions, keep) -> list[Instruction]:
    """Each instruction, with the buffers whose last use it is (not ``keep``) to drop."""
    last_use: dict[BufferKey, int] = {}
    for i, ins in enumerate(instructions):
        for key in ins.inputs + ins.outputs:
            last_use[key] = i
    frees: dict[int, list[BufferKey]] = {}
    for key, i in last_use.items():
        if key not in keep:
            frees.setdefault(i, []).append(key)
    return [
        dataclasses.replace(ins, free=tuple(sorted(frees[i], key=str))) if i in frees else ins
        for i, ins in enumerate(instructions)
    ]
