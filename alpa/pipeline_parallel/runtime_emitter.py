"""Runtime emitter: schedule + stage computations -> instruction lists per mesh.

The emitter walks the schedule tick by tick. For each task it makes sure every input of the
task's computation is on the task's mesh (``LOAD`` a micro-batch slice of a batch argument,
or ``RESHARD`` a value from the mesh that holds it), emits ``RUN``, and ``ACCUMULATE``s the
values the ``alpa.grad`` marker receives. A liveness pass then inserts ``FREE`` right after
the last use of every buffer, so a value dies as soon as nothing needs it; only the step's
inputs (parameters, optimizer state: the caller's arrays) and outputs survive a step.

A buffer is named by a :data:`BufferKey` ``(value name, micro-batch or None, mesh)``.
:func:`simulate_memory` replays the instructions and reports the peak of live bytes each
mesh holds, which is how the 1F1B and GPipe schedules are compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from alpa.pipeline_parallel.computation import PipelineProgram, _is_var, _nbytes
from alpa.pipeline_parallel.schedules import PipelineSchedule

BufferKey = tuple[str, int | None, int]
OpName = Literal["LOAD", "RUN", "RESHARD", "ACCUMULATE", "FREE"]


@dataclass(frozen=True)
class Instruction:
    """One step of a mesh's program.

    * ``LOAD``: ``outputs[0]`` = micro-batch ``micro_batch`` of step input ``leaf``.
    * ``RUN``: ``outputs`` = computation ``computation``(``inputs``).
    * ``RESHARD``: ``outputs[0]`` (on ``mesh``) = ``inputs[0]`` (on another mesh).
    * ``ACCUMULATE``: ``outputs[0]`` = ``inputs[0]`` (first micro-batch) or
      ``outputs[0] + inputs[0]``; times ``scale`` when ``scale`` is set.
    * ``FREE``: drop ``inputs``.
    """

    op: OpName
    mesh: int
    inputs: tuple[BufferKey, ...] = ()
    outputs: tuple[BufferKey, ...] = ()
    computation: int | None = None
    micro_batch: int | None = None
    leaf: int | None = None
    first: bool = False
    scale: float | None = None

    def __str__(self) -> str:
        def keys(ks):
            return ", ".join(f"{n}@{m if m is not None else '*'}" for n, m, _ in ks)

        extra = f" c{self.computation}" if self.computation is not None else ""
        return (
            f"[mesh {self.mesh}] {self.op}{extra} ({keys(self.inputs)}) -> ({keys(self.outputs)})"
        )


@dataclass(frozen=True)
class PipelineInstructions:
    """The emitted program: one global order, and per-mesh views of it."""

    instructions: tuple[Instruction, ...]
    num_meshes: int
    persistent: frozenset  # input buffers the caller owns
    outputs: tuple  # per step output: a key, a tuple of per-micro-batch keys, or a literal
    nbytes: dict  # BufferKey -> bytes

    def for_mesh(self, mesh: int) -> list[Instruction]:
        return [ins for ins in self.instructions if ins.mesh == mesh]


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
    k = schedule.num_micro_batches
    comps = {c: i for i, c in enumerate(program.computations)}
    instructions: list[Instruction] = []
    present: set[BufferKey] = set()
    nbytes: dict[BufferKey, int] = {}
    var_of: dict[str, object] = {names[v]: v for v in names}

    persistent = set()
    for v in invars:
        if v in leaf_of and not _is_batch_input(v, program):
            for s in program.input_stages[v]:
                key = (names[v], None, s)
                persistent.add(key)
                present.add(key)
                nbytes[key] = _nbytes(v)

    def mb_of(v, mb):
        return mb if v in program.per_micro_batch or _is_batch_input(v, program) else None

    def ensure(v, mb, mesh) -> BufferKey:
        key = (names[v], mb_of(v, mb), mesh)
        if key in present:
            return key
        nbytes[key] = _nbytes(v)
        if _is_batch_input(v, program):
            instructions.append(
                Instruction("LOAD", mesh, (), (key,), micro_batch=mb, leaf=leaf_of[v])
            )
        else:
            sources = [program.home[v]] if v in program.home else list(program.input_stages[v])
            src = next(
                ((names[v], key[1], s) for s in sources if (names[v], key[1], s) in present), None
            )
            if src is None:
                raise AssertionError(
                    f"value {names[v]} (micro-batch {mb}) is not computed "
                    f"before mesh {mesh} needs it"
                )
            instructions.append(Instruction("RESHARD", mesh, (src,), (key,)))
        present.add(key)
        return key

    accumulated_by_operand = {op: out for out, op in program.accumulated.items()}
    accumulate_count: dict = {}

    def run(comp, mb):
        ins = tuple(ensure(v, mb, comp.stage) for v in comp.invars)
        outs = tuple((names[v], mb_of(v, mb), comp.stage) for v in comp.outvars)
        for key, v in zip(outs, comp.outvars, strict=True):
            nbytes[key] = _nbytes(v)
        if comp.eqns:
            instructions.append(
                Instruction("RUN", comp.stage, ins, outs, computation=comps[comp], micro_batch=mb)
            )
        present.update(outs)
        for v, key in zip(comp.outvars, outs, strict=True):
            out = accumulated_by_operand.get(v)
            if out is None:
                continue
            n = accumulate_count.get(out, 0)
            accumulate_count[out] = n + 1
            scale = 1.0 / k if n == k - 1 and k > 1 and _is_float(out) else None
            dst = (names[out], None, comp.stage)
            nbytes[dst] = _nbytes(out)
            instructions.append(
                Instruction("ACCUMULATE", comp.stage, (key,), (dst,), first=n == 0, scale=scale)
            )
            present.add(dst)

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
            if v in batch_dependent:
                outputs.append(("concat", keys))
            else:
                outputs.append(("key", keys[-1]))
        elif v in leaf_of:
            outputs.append(("key", ensure(v, None, program.input_stages[v][0])))
        else:
            outputs.append(("key", (names[v], None, program.home[v])))
    del var_of
    final_keys = set()
    for kind, value in outputs:
        if kind == "key":
            final_keys.add(value)
        elif kind == "concat":
            final_keys.update(value)

    return PipelineInstructions(
        instructions=tuple(_insert_frees(instructions, persistent, final_keys)),
        num_meshes=program.num_stages,
        persistent=frozenset(persistent),
        outputs=tuple(outputs),
        nbytes=nbytes,
    )


def _is_batch_input(v, program: PipelineProgram) -> bool:
    invars = program.closed_jaxpr.jaxpr.invars
    return v in program.batch_dependent and v in set(invars)


def _is_float(v) -> bool:
    return np.issubdtype(np.dtype(v.aval.dtype), np.inexact)


def _insert_frees(instructions, persistent, final_keys) -> list[Instruction]:
    last_use: dict[BufferKey, int] = {}
    for i, ins in enumerate(instructions):
        for key in ins.inputs + ins.outputs:
            last_use[key] = i
    keep = persistent | final_keys
    frees_after: dict[int, list[BufferKey]] = {}
    for key, i in last_use.items():
        if key not in keep:
            frees_after.setdefault(i, []).append(key)
    out = []
    for i, ins in enumerate(instructions):
        out.append(ins)
        by_mesh: dict[int, list] = {}
        for key in frees_after.get(i, ()):
            by_mesh.setdefault(key[2], []).append(key)
        for mesh, keys in sorted(by_mesh.items()):
            out.append(Instruction("FREE", mesh, tuple(sorted(keys, key=str))))
    return out


def simulate_memory(program: PipelineInstructions) -> list[int]:
    """Peak bytes per mesh of the buffers a step creates (inputs it is given excluded)."""
    live = [0] * program.num_meshes
    peak = [0] * program.num_meshes
    alive: set = set()
    for ins in program.instructions:
        if ins.op == "FREE":
            for key in ins.inputs:
                if key in alive:
                    alive.remove(key)
                    live[key[2]] -= program.nbytes[key]
            continue
        for key in ins.outputs:
            if key not in alive and key not in program.persistent:
                alive.add(key)
                live[key[2]] += program.nbytes[key]
        peak[ins.mesh] = max(peak[ins.mesh], live[ins.mesh])
    return peak
