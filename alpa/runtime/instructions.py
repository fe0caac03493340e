"""The instruction set of a pipelined step: what the emitter
(``pipeline_parallel/scheduling/runtime_emitter.py``) writes and both runtimes (``local_runtime``,
the Ray executable's workers) run. Data only; the opcodes are described in the
emitter's module docstring.

A buffer is named by a :data:`BufferKey` ``(value name, micro-batch or None, mesh)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

BufferKey = tuple[str, int | None, int]


class Op(str, enum.Enum):
    """Instruction opcodes (a ``str`` enum: ``Op.RUN == "RUN"``)."""

    LOAD = "LOAD"
    RUN = "RUN"
    ALLOC = "ALLOC"
    RESHARD = "RESHARD"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Accumulation:
    """A value a kernel accumulates: ``program.accumulated[marker_out] == operand``, where
    the operand is the computation's output ``outvar_index`` (for a deferred gradient,
    ``marker_out`` is its accumulator of partial sums, ``program.deferred.partials``).
    ``scale`` multiplies each micro-batch's value (``1/k`` for floats, ``None``: none);
    with ``reads_sum`` the running sum is an input (donated) and the output is
    ``sum + scale * value``, without it the output is ``scale * value`` (one micro-batch)."""

    outvar_index: int
    marker_out: object
    scale: float | None
    reads_sum: bool


@dataclass(frozen=True)
class Kernel:
    """What a ``RUN`` calls: computation ``computation`` of the program, returning its
    outputs ``kept`` (indices into its ``outvars``), then its inputs ``publishes``, then
    the ``accumulate``d values; its inputs are the running sums that are read (donated:
    first, as Alpa's backward took its accumulators) followed by its ``invars``.

    ``reduces`` (indices into ``invars``): gradients that arrive as per-device partial
    sums (``deferred_sums``), their ``[n, ...]`` accumulators in place of the gradient,
    and are summed on entry; those in ``publishes`` are also written, reduced, for the
    apply computations that read them later."""

    computation: int
    kept: tuple[int, ...]
    accumulate: tuple[Accumulation, ...]
    reduces: tuple[int, ...] = ()
    publishes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Instruction:
    """One step of a mesh's program.

    * ``LOAD``: ``outputs`` = the micro-batches of step input ``leaf``, in order.
    * ``RUN``: ``outputs`` = kernel ``computation``(``inputs``).
    * ``ALLOC``: ``outputs`` = zeros (the running sums of a kernel).
    * ``RESHARD``: ``outputs[0]`` (on ``mesh``) = ``inputs[0]`` (on another mesh).

    After it runs, the buffers ``free`` are dropped (their last use).
    """

    op: Op
    mesh: int
    inputs: tuple[BufferKey, ...] = ()
    outputs: tuple[BufferKey, ...] = ()
    computation: int | None = None
    micro_batch: int | None = None
    leaf: int | None = None
    free: tuple[BufferKey, ...] = ()

    def __str__(self) -> str:
        def keys(ks):
            return ", ".join(f"{n}@{m if m is not None else '*'}" for n, m, _ in ks)

        extra = f" k{self.computation}" if self.computation is not None else ""
        mb = f" mb{self.micro_batch}" if self.micro_batch is not None else ""
        freed = f" free({keys(self.free)})" if self.free else ""
        return (
            f"[mesh {self.mesh}] {self.op}{extra}{mb} ({keys(self.inputs)}) -> "
            f"({keys(self.outputs)}){freed}"
        )


@dataclass(frozen=True)
class BufferOutput:
    """A step output read from one buffer."""

    key: BufferKey

    @property
    def keys(self) -> tuple[BufferKey, ...]:
        return (self.key,)


@dataclass(frozen=True)
class MicroBatchOutput:
    """A step output made of every micro-batch's buffer of one value, in order, combined:
    ``"mean"`` (a scalar computed from the batch, such as the loss: the full batch's value
    for a mean over equal micro-batches) or ``"concat"`` (rows, along dimension 0)."""

    keys: tuple[BufferKey, ...]
    combine: str

    def __post_init__(self):
        if self.combine not in ("mean", "concat"):
            raise ValueError(f"combine must be 'mean' or 'concat', got {self.combine!r}")


@dataclass(frozen=True)
class ConstOutput:
    """A step output computed from constants alone, on the driver: ``name`` is its value's
    name among the stage programs' constant outputs."""

    name: str
    keys: tuple[BufferKey, ...] = ()


@dataclass(frozen=True)
class LiteralOutput:
    """A step output that is a literal of the program (``value``)."""

    value: Any
    keys: tuple[BufferKey, ...] = ()


StepOutput = BufferOutput | MicroBatchOutput | ConstOutput | LiteralOutput


@dataclass(frozen=True)
class PipelineInstructions:
    """The emitted program: one global order, and per-mesh views of it.

    An instruction's ``mesh`` (and a buffer key's) is its stage's mesh: where a schedule
    places several stages on one group of devices (interleaved 1F1B, DualPipeV), each stage keeps a
    mesh of its own in the instructions, ``stage_meshes[m]`` names the devices' mesh
    (``physical_mesh``) and a runtime runs the instructions of all of that mesh's stages.
    """

    instructions: tuple[Instruction, ...]
    kernels: tuple[Kernel, ...]
    num_meshes: int
    persistent: frozenset  # input buffers the caller owns
    outputs: tuple[StepOutput, ...]  # per step output, where it is read from
    nbytes: dict  # BufferKey -> bytes
    stage_meshes: tuple[int, ...] = ()  # per mesh, the mesh of devices it runs on

    def physical_mesh(self, mesh: int) -> int:
        """The mesh of devices that instruction mesh ``mesh`` runs on."""
        return self.stage_meshes[mesh] if self.stage_meshes else mesh

    @property
    def num_physical_meshes(self) -> int:
        return max(self.stage_meshes) + 1 if self.stage_meshes else self.num_meshes

    def output_keys(self) -> set[BufferKey]:
        """The buffers the step's outputs are read from."""
        return {key for output in self.outputs for key in output.keys}

    def buffer_keys(self) -> set[BufferKey]:
        """Every buffer of a step: what the instructions read and write, the inputs the
        caller gives and the buffers the outputs are read from."""
        keys = {key for ins in self.instructions for key in ins.inputs + ins.outputs}
        return keys | set(self.persistent) | self.output_keys()

    def for_mesh(self, mesh: int) -> list[Instruction]:
        return [ins for ins in self.instructions if ins.mesh == mesh]

    def count(self, op: Op | str) -> int:
        """How many instructions have opcode ``op``."""
        op = Op(op)
        return sum(ins.op is op for ins in self.instructions)


class InFlight:
    """Counts, per mesh, the micro-batches that have a live buffer a ``RUN`` wrote (a
    step's activations and cotangents) and the most at once, ``peak``: a schedule's
    in-flight bound (``PipelineSchedule.max_in_flight_per_mesh``) as a runtime executes
    it. Both runtimes count with it, the local one over all meshes, a Ray worker over its
    own. A micro-batch is named ``(stage, micro-batch)``: a mesh of several stages
    (interleaved 1F1B, DualPipeV) holds one stage's part of a micro-batch per stage."""

    def __init__(self, num_meshes: int):
        self._live: list[dict] = [{} for _ in range(num_meshes)]  # micro-batch -> buffers
        self.peak = [0] * num_meshes

    def written(self, mesh: int, micro_batch: int) -> None:
        live = self._live[mesh]
        live[micro_batch] = live.get(micro_batch, 0) + 1
        self.peak[mesh] = max(self.peak[mesh], len(live))

    def freed(self, mesh: int, micro_batch: int) -> None:
        live = self._live[mesh]
        live[micro_batch] -= 1
        if not live[micro_batch]:
            del live[micro_batch]


def activation_keys(program: PipelineInstructions) -> set[BufferKey]:
    """The buffers of one micro-batch that a ``RUN`` writes and a later ``RUN`` of the
    same stage reads (a forward's activations for its backward, a ``B``'s for its ``W``):
    what :class:`InFlight` counts. A value only sent to another stage (an output, a
    cotangent) is not one, however long it waits for its reader."""
    read = {key for ins in program.instructions if ins.op is Op.RUN for key in ins.inputs}
    return {
        key
        for ins in program.instructions
        if ins.op is Op.RUN
        for key in ins.outputs
        if key[1] is not None and key in read
    }


def simulate_memory(program: PipelineInstructions) -> list[int]:
    """Peak bytes per mesh of the buffers a step creates (inputs it is given excluded)."""
    live = [0] * program.num_meshes
    peak = [0] * program.num_meshes
    alive: set = set()
    for ins in program.instructions:
        for key in ins.outputs:
            if key not in alive and key not in program.persistent:
                alive.add(key)
                live[key[2]] += program.nbytes[key]
        for mesh in {key[2] for key in ins.outputs} | {ins.mesh}:
            peak[mesh] = max(peak[mesh], live[mesh])
        for key in ins.free:
            if key in alive:
                alive.remove(key)
                live[key[2]] -= program.nbytes[key]
    return peak


def donated_inputs(program: PipelineInstructions, donated: set[str]) -> dict[int, tuple]:
    """Per kernel, the positions of its arguments whose buffers a ``RUN`` of it may
    reuse: a step input the caller donated (its value name in ``donated``) whose last
    reader that ``RUN`` is, when it is the kernel's only ``RUN`` in a step (the apply
    computation that replaces the state) and no step output is read from the buffer.
    Donating it there frees the previous state as the new one is written, as a one-mesh
    step's ``donate_argnums`` do."""
    last: dict[BufferKey, int] = {}
    for i, ins in enumerate(program.instructions):
        for key in ins.inputs:
            last[key] = i
    runs: dict[int, int] = {}
    for ins in program.instructions:
        if ins.op is Op.RUN:
            runs[ins.computation] = runs.get(ins.computation, 0) + 1
    kept = program.output_keys()
    out: dict[int, list[int]] = {}
    for key in sorted(program.persistent, key=str):
        i = last.get(key)
        if key[0] not in donated or key in kept or i is None:
            continue
        ins = program.instructions[i]
        if ins.op is not Op.RUN or runs[ins.computation] != 1 or ins.inputs.count(key) != 1:
            continue
        out.setdefault(ins.computation, []).append(ins.inputs.index(key))
    return {k: tuple(sorted(v)) for k, v in out.items()}
