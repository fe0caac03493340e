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

from alpa.pipeline_parallel.computation import PipelineProgram, _is_var, _nbytes
from alpa.pipeline_parallel.schedules import PipelineSchedule
from alpa.runtime.instructions import (
    Accumulation,
    BufferKey,
    Instruction,
    Kernel,
    Op,
    PipelineInstructions,
)


def emit_instructions(
    program: PipelineProgram,
    schedule: PipelineSchedule,
    names: dict,
) -> PipelineInstructions:
    """Emit the instructions of one step (see the module docstring).

    ``names`` maps every jaxpr variable to a stable string name.
    """
    jaxpr = program.closed_jaxpr.jaxpr
    invars = list(jaxpr.invars)
    leaf_of = {v: i for i, v in enumerate(invars)}
    batch_dependent = program.batch_dependent
    batch_inputs = {v for v in invars if v in batch_dependent}  # split into micro-batches
    k = schedule.num_micro_batches
    comps = {c: i for i, c in enumerate(program.computations)}
    instructions: list[Instruction] = []
    present: set[BufferKey] = set()
    nbytes: dict[BufferKey, int] = {}

    persistent = set()
    for v in invars:
        if v in leaf_of and v not in batch_inputs:
            for s in program.input_stages[v]:
                key = (names[v], None, s)
                persistent.add(key)
                present.add(key)
                nbytes[key] = _nbytes(v)

    def mb_of(v, mb):
        return mb if v in program.per_micro_batch or v in batch_inputs else None

    def ensure(v, mb, mesh) -> BufferKey:
        key = (names[v], mb_of(v, mb), mesh)
        if key in present:
            return key
        if v in batch_inputs:
            keys = tuple((names[v], m, mesh) for m in range(k))
            instructions.append(Instruction(Op.LOAD, mesh, (), keys, leaf=leaf_of[v]))
            for each in keys:
                nbytes[each] = _nbytes(v)
            present.update(keys)
            return key
        nbytes[key] = _nbytes(v)
        sources = [program.home[v]] if v in program.home else list(program.input_stages[v])
        src = next(
            ((names[v], key[1], s) for s in sources if (names[v], key[1], s) in present), None
        )
        if src is None:
            raise AssertionError(
                f"value {names[v]} (micro-batch {mb}) is not computed before mesh {mesh} needs it"
            )
        instructions.append(Instruction(Op.RESHARD, mesh, (src,), (key,)))
        present.add(key)
        return key

    # Which outputs of each computation are read by anything but the accumulation.
    accumulated_by_operand = {op: out for out, op in program.accumulated.items()}
    read_elsewhere = {v for c in program.computations for v in c.invars}
    read_elsewhere |= {v for v in jaxpr.outvars if _is_var(v)}
    # Deferred gradients: accumulated as partial sums, reduced by their first reader
    # (apply computations of one stage, lowest level first), which writes the sum for
    # the others.
    partials = program.deferred.partials if program.deferred is not None else {}
    readers: dict = {}
    for comp in sorted(program.computations, key=lambda c: c.level):
        for v in comp.invars:
            if v in partials:
                readers.setdefault(v, []).append(comp)
    kernels: list[Kernel] = []
    kernel_of: dict[int, int] = {}

    def kernel_for(comp) -> int:
        index = comps[comp]
        if index not in kernel_of:
            kept, accumulate = [], []
            for i, v in enumerate(comp.outvars):
                out = accumulated_by_operand.get(v)
                if out is not None and out not in read_elsewhere:
                    out = None  # a marked value nothing reads (alpa.grad's loss): not summed
                if out is None or v in read_elsewhere:
                    kept.append(i)
                if out is not None:
                    scale = 1.0 / k if k > 1 and _is_float(out) else None
                    sum_var = partials.get(out, out)
                    accumulate.append(Accumulation(i, sum_var, scale, reads_sum=k > 1))
            reduces = tuple(
                i for i, v in enumerate(comp.invars) if v in partials and readers[v][0] is comp
            )
            publishes = tuple(i for i in reduces if len(readers[comp.invars[i]]) > 1)
            kernel_of[index] = len(kernels)
            kernels.append(Kernel(index, tuple(kept), tuple(accumulate), reduces, publishes))
        return kernel_of[index]

    def run(comp, mb):
        if not comp.eqns:
            present.update((names[v], mb_of(v, mb), comp.stage) for v in comp.outvars)
            return
        kernel = kernels[kernel_for(comp)]
        ins = [
            (names[partials[v]], None, comp.stage)
            if i in kernel.reduces
            else ensure(v, mb, comp.stage)
            for i, v in enumerate(comp.invars)
        ]
        outs = [
            (names[comp.outvars[i]], mb_of(comp.outvars[i], mb), comp.stage) for i in kernel.kept
        ]
        outs += [(names[comp.invars[i]], None, comp.stage) for i in kernel.publishes]
        sums = [(names[a.marker_out], None, comp.stage) for a in kernel.accumulate]
        for key, a in zip(sums, kernel.accumulate, strict=True):
            nbytes[key] = _nbytes(a.marker_out)
        missing = tuple(
            key
            for key, a in zip(sums, kernel.accumulate, strict=True)
            if a.reads_sum and key not in present
        )
        if missing:
            instructions.append(
                Instruction(Op.ALLOC, comp.stage, (), missing, computation=kernel_of[comps[comp]])
            )
            present.update(missing)
        ins += [key for key, a in zip(sums, kernel.accumulate, strict=True) if a.reads_sum]
        written = [comp.outvars[i] for i in kernel.kept] + [
            comp.invars[i] for i in kernel.publishes
        ]
        for key, v in zip(outs, written, strict=True):
            nbytes[key] = _nbytes(v)
        instructions.append(
            Instruction(
                Op.RUN,
                comp.stage,
                tuple(ins),
                tuple(outs + sums),
                computation=kernel_of[comps[comp]],
                micro_batch=mb,
            )
        )
        present.update(outs + sums)

    for tick in schedule.ticks:
        apply_stages = [t.stage for t in tick if t.kind == "apply"]
        for task in tick:
            if task.kind == "apply":
                continue
            comp = program.computation(task.stage, task.kind)
            if comp is not None:
                run(comp, task.micro_batch)
        for level in range(program.apply_levels()):
            for stage in apply_stages:
                comp = program.computation(stage, "apply", level)
                if comp is not None:
                    run(comp, None)

    # Outputs.
    outputs = []
    for v in jaxpr.outvars:
        if not _is_var(v):
            outputs.append(("literal", v.val))
        elif v in program.aliases and not _is_var(program.aliases[v]):
            outputs.append(("literal", program.aliases[v].val))
        elif v in program.aliases:
            src = program.aliases[v]
            outputs.append(("key", ensure(src, None, program.input_stages[src][0])))
        elif v in program.const_eqns:
            outputs.append(("const", names[v]))
        elif v in program.per_micro_batch:
            keys = tuple((names[v], m, program.home[v]) for m in range(k))
            if v in batch_dependent and v.aval.ndim == 0 and k > 1 and _is_float(v):
                # A scalar computed from the batch (a loss): the mean over micro-batches,
                # which is the full batch's value for a mean over equal micro-batches.
                outputs.append(("mean", keys))
            elif v in batch_dependent and v.aval.ndim > 0:
                outputs.append(("concat", keys))
            else:  # the same every micro-batch, or a non-float scalar: the last one
                outputs.append(("key", keys[-1]))
        elif v in leaf_of:
            outputs.append(("key", ensure(v, None, program.input_stages[v][0])))
        else:
            outputs.append(("key", (names[v], None, program.home[v])))
    final_keys = set()
    for kind, value in outputs:
        if kind == "key":
            final_keys.add(value)
        elif kind in ("concat", "mean"):
            final_keys.update(value)

    return PipelineInstructions(
        instructions=tuple(_attach_frees(instructions, persistent | final_keys)),
        kernels=tuple(kernels),
        num_meshes=program.num_stages,
        persistent=frozenset(persistent),
        outputs=tuple(outputs),
        nbytes=nbytes,
    )


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
