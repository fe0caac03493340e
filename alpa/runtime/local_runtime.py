"""The in-process runtime: run pipeline instructions on local submeshes.

Every mesh is a set of this process's devices; the driver itself walks the instruction
list (``docs/design.md``, Runtimes). Values move between submeshes with
``jax.device_put``: a jit never reads an array of another mesh (``docs/design.md``, Facts
of JAX 0.10). Each ``RESHARD``'s tile plan is in the
``PipeshardPlan`` (``reshards``); its bytes, what a cross-host backend sends, are what a
step sends (``resharded_bytes``, the same every step).

**Prebuilt closures.** Nothing is interpreted per step. When the runtime is built, every
buffer key gets an integer slot and every instruction becomes one closure
``fn(env, flat_args)`` made by the handler of its opcode (:data:`HANDLERS`), with its
compiled program, input and output slots and shardings bound in. A step is then a loop
over the closures on a list of slots, dropping after each instruction the slots of its
``Instruction.free``; JAX frees device memory when a slot's last reference goes.

The runtime records, per instruction, when it was dispatched (or, with ``blocking=True``,
when it finished), which the executable writes as a Chrome trace.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from alpa.runtime.instructions import (
    BufferKey,
    BufferOutput,
    ConstOutput,
    InFlight,
    Instruction,
    LiteralOutput,
    Op,
    PipelineInstructions,
    activation_keys,
)
from alpa.runtime.placement import leaf_placer
from alpa.runtime.worker_ops import jitted_concat, jitted_mean


@dataclass
class TraceEvent:
    """One instruction of a step: when it started and ended (dispatched, or with
    ``blocking`` finished) and, with ``blocking``, when its call returned (``returned``:
    the time JAX took to accept the work, with its inputs ready and the devices idle)."""

    name: str
    mesh: int
    start: float
    end: float
    args: dict = field(default_factory=dict)
    returned: float | None = None


def _owner(program: PipelineInstructions, key: BufferKey) -> tuple[int, tuple]:
    """The in-flight count's name of buffer ``key``: its mesh of devices, and the stage
    (the stage's mesh) and micro-batch it belongs to."""
    return program.physical_mesh(key[2]), (key[2], key[1])


@dataclass(frozen=True)
class RuntimeContext:
    """What the handlers need from the executable.

    Attributes:
      kernels: per ``Kernel`` of the instructions, its compiled program.
      allocs: ``alloc(keys) -> callable`` returning zeros for those buffers.
      sharding_of: ``BufferKey -> jax.sharding.Sharding`` of that buffer on its mesh.
      micro_batch_size: per step-input leaf, its micro-batch size (for ``LOAD``).
      kernel_names: per kernel, a name for the trace.
      shape_of: ``BufferKey -> shape`` of that buffer.
      in_flight_limit: on XLA's CPU backend, how many ``RUN``s a mesh may have queued
        before the next waits for the oldest (``None``: no limit). XLA's CPU collectives
        can abort when many programs with collectives are queued on the same devices
        (``docs/dispatch.md``, known issues); GPUs need no limit.
      in_flight: per mesh, the outputs of its queued ``RUN``s (emptied after each step).
    """

    kernels: Sequence[Callable]
    allocs: Callable[[tuple[BufferKey, ...]], Callable]
    sharding_of: Callable[[BufferKey], Any]
    micro_batch_size: Sequence[int | None]
    kernel_names: Sequence[str]
    shape_of: Callable[[BufferKey], tuple[int, ...]]
    in_flight_limit: int | None = None
    in_flight: dict = field(default_factory=dict)


# A built instruction: the closure, its trace name and arguments, and its output slots.
# (The runtime loop frees an instruction's ``free`` slots after it, whatever its opcode.)
_Built = tuple[Callable, str, dict, tuple[int, ...]]


def _build_run(ins: Instruction, slot: dict, ctx: RuntimeContext) -> _Built:
    program = ctx.kernels[ins.computation]
    in_slots = tuple(slot[k] for k in ins.inputs)
    out_slots = tuple(slot[k] for k in ins.outputs)

    limit = ctx.in_flight_limit
    queued = ctx.in_flight.setdefault(ins.mesh, collections.deque())

    def run(env, args):
        outs = program(*[env[i] for i in in_slots])
        for i, value in zip(out_slots, outs, strict=True):
            env[i] = value
        if limit is not None and outs:
            queued.append(outs[0])
            if len(queued) > limit:
                oldest = queued.popleft()
                if not oldest.is_deleted():  # a donated output: a later RUN consumed it
                    oldest.block_until_ready()

    name = f"{ctx.kernel_names[ins.computation]} mb{ins.micro_batch}"
    return run, name, {}, out_slots


def _build_alloc(ins: Instruction, slot: dict, ctx: RuntimeContext) -> _Built:
    zeros = ctx.allocs(ins.outputs)
    out_slots = tuple(slot[k] for k in ins.outputs)

    def alloc(env, args):
        for i, value in zip(out_slots, zeros(), strict=True):
            env[i] = value

    return alloc, f"alloc {len(out_slots)} accumulators", {}, out_slots


def _build_load(ins: Instruction, slot: dict, ctx: RuntimeContext) -> _Built:
    """All micro-batches of a batch argument onto one mesh in one compiled call, whatever
    ``k``: the call places the whole batch (its ``in_shardings`` place a host or
    uncommitted array, as ``jax.jit`` does) and cuts it into the ``k`` micro-batches, every
    device slicing its own rows (no communication). For that, each device must receive the
    rows of every micro-batch it holds: the batch is placed viewed as ``[k, size, ...]``
    with ``P(None, *spec)``. When the micro-batch spec does not split dim 0, that is the
    flat batch placed with ``spec``, and the view is taken inside the call; when it does,
    the view is taken before (free for a host array). A committed array elsewhere is moved
    first (``jit`` refuses it)."""
    leaf, keys = ins.leaf, ins.outputs
    size = ctx.micro_batch_size[leaf]
    k = len(keys)
    sharding = ctx.sharding_of(keys[0])
    if any(ctx.sharding_of(key) != sharding for key in keys):
        raise AssertionError(f"micro-batches of {keys[0][0]} differ in sharding")
    spec, mesh = tuple(sharding.spec), sharding.mesh
    view_inside = not spec or spec[0] is None
    if view_inside:
        placed = NamedSharding(mesh, PartitionSpec(*spec))

        def cut(x):
            stacked = x.reshape((k, size) + x.shape[1:])
            return [stacked[m] for m in range(k)]
    else:
        placed = NamedSharding(mesh, PartitionSpec(None, *spec))

        def cut(x):
            return [x[m] for m in range(k)]

    unstack = jax.jit(cut, in_shardings=placed, out_shardings=[sharding] * k)
    out_slots = tuple(slot[key] for key in keys)

    def load(env, args):
        x = args[leaf]
        if not isinstance(x, jax.Array):
            x = np.asarray(x)
        if k == 1:
            env[out_slots[0]] = jax.device_put(x, sharding)
            return
        if not view_inside:
            x = x.reshape((k, size) + x.shape[1:])
        if (
            isinstance(x, jax.Array)
            and x.committed
            and not x.sharding.is_equivalent_to(placed, x.ndim)
        ):
            x = jax.device_put(x, placed)
        for i, value in zip(out_slots, unstack(x), strict=True):
            env[i] = value

    load.cut = unstack  # the compiled cut, for tests to read its HLO
    return load, f"load {keys[0][0]}", {}, out_slots


def _build_reshard(ins: Instruction, slot: dict, ctx: RuntimeContext) -> _Built:
    """``jax.device_put`` to the destination mesh, after laying the value out on its own
    mesh as the destination wants it when that is needed. ``device_put`` between device
    sets copies buffers device to device, asynchronously, only when every destination
    shard is the index of some source shard; otherwise JAX fetches the whole value to the
    host, which waits for the computation that produces it and so stalls the pipeline. A
    compiled identity with the destination's spec on the source mesh (same shape) makes
    the indices match. Between meshes of different shapes that is not always possible, and
    the host path remains."""
    (src,), (dst,) = ins.inputs, ins.outputs
    src_slot, dst_slot = slot[src], slot[dst]
    sharding, source = ctx.sharding_of(dst), ctx.sharding_of(src)
    shape = ctx.shape_of(src)
    relayout = None
    if not _indices_covered(source, sharding, shape) and source.mesh.shape == sharding.mesh.shape:
        relayout = jax.jit(lambda v: v, out_shardings=NamedSharding(source.mesh, sharding.spec))

    def reshard(env, args):
        value = env[src_slot]
        if relayout is not None:
            value = relayout(value)
        env[dst_slot] = jax.device_put(value, sharding)

    return reshard, f"reshard {src[0]} {src[2]}->{dst[2]}", {}, (dst_slot,)


def _indices_covered(src, dst, shape) -> bool:
    """Whether every shard ``dst`` needs is exactly a shard ``src`` has."""
    have = {_index_key(i) for i in src.devices_indices_map(shape).values()}
    return all(_index_key(i) in have for i in dst.devices_indices_map(shape).values())


def _index_key(index) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


#: Opcode -> builder of the instruction's closure.
HANDLERS: dict[Op, Callable[[Instruction, dict, RuntimeContext], _Built]] = {
    Op.RUN: _build_run,
    Op.ALLOC: _build_alloc,
    Op.LOAD: _build_load,
    Op.RESHARD: _build_reshard,
}


class LocalPipelineRuntime:
    """Executes :class:`PipelineInstructions` through prebuilt closures.

    Attributes:
      program: the instructions.
      sharding_of: ``BufferKey -> jax.sharding.Sharding`` of that buffer on its mesh.
      resharded_bytes: bytes a step's ``RESHARD`` instructions send between meshes, by the
        tile plan (each piece once per destination host).
      events: the last step's trace events.
      peak_live_micro_batches: per mesh, the most micro-batches that had a buffer a
        ``RUN`` wrote alive on it at once during the last step (activations, cotangents:
        what a schedule's in-flight bound is about; the loaded batch is not counted).
    """

    def __init__(
        self,
        program: PipelineInstructions,
        context: RuntimeContext,
        leaf_index: dict[str, int],
        reshard_bytes: dict[int, int],
    ):
        self._context = context
        self.program = program
        self.sharding_of = context.sharding_of
        keys: list[BufferKey] = sorted(program.buffer_keys(), key=str)
        self._slot = {key: i for i, key in enumerate(keys)}
        self._num_slots = len(keys)
        persistent = sorted(program.persistent, key=str)
        self._persistent_slots = [self._slot[key] for key in persistent]
        self._persistent_leaves = [leaf_index[key[0]] for key in persistent]
        self._place = leaf_placer([context.sharding_of(key) for key in persistent])
        self._steps: list[_Built] = []
        self._frees: list[tuple[int, ...]] = []
        self.resharded_bytes = 0
        # Per instruction, the (mesh of devices, (stage mesh, micro-batch)) of each
        # activation a RUN writes on its own mesh, and of each it frees: the in-flight count.
        written = activation_keys(program)
        self._born: list[tuple] = []
        self._dead: list[tuple] = []
        for i, ins in enumerate(program.instructions):
            fn, name, args, out_slots = HANDLERS[ins.op](ins, self._slot, context)
            if ins.op is Op.RESHARD:
                # Between two stages on one mesh (interleaved 1F1B, DualPipeV) nothing leaves it.
                args = {"bytes": reshard_bytes.get(i, 0)}
                self.resharded_bytes += args["bytes"]
            self._steps.append((fn, name, args, out_slots))
            self._frees.append(tuple(self._slot[key] for key in ins.free))
            born = ins.outputs if ins.op is Op.RUN else ()
            self._born.append(
                tuple(_owner(program, k) for k in born if k in written and k[2] == ins.mesh)
            )
            self._dead.append(tuple(_owner(program, k) for k in ins.free if k in written))
        self.peak_live_micro_batches: list[int] = [0] * program.num_physical_meshes
        self._meshes = [ins.mesh for ins in program.instructions]
        self._outputs = list(program.outputs)
        self._times: list[float] = []
        self._returned: list[float | None] = []
        self._last_alive: frozenset[int] = frozenset()  # slots holding a value at the end

    def run(self, flat_args: Sequence[Any], consts: dict, blocking: bool = False) -> list:
        env: list[Any] = [None] * self._num_slots
        placed = self._place([flat_args[leaf] for leaf in self._persistent_leaves])
        for i, value in zip(self._persistent_slots, placed, strict=True):
            env[i] = value
        clock = time.perf_counter
        times = [clock()]
        returned = []
        in_flight = InFlight(len(self.peak_live_micro_batches))
        steps = zip(self._steps, self._frees, self._born, self._dead, strict=True)
        for (fn, _, _, out_slots), free, born, dead in steps:
            fn(env, flat_args)
            if blocking:
                returned.append(clock())
                jax.block_until_ready([env[i] for i in out_slots])
            for mesh, owner in born:
                in_flight.written(mesh, owner)
            for i in free:
                env[i] = None
            for mesh, owner in dead:
                in_flight.freed(mesh, owner)
            times.append(clock())
        self.peak_live_micro_batches = in_flight.peak
        for queued in self._context.in_flight.values():
            queued.clear()
        self._times = times
        self._returned = returned or [None] * len(self._steps)
        # Which slots still held a value (the step's values themselves are not kept:
        # the caller may let go of its inputs and outputs).
        self._last_alive = frozenset(i for i, value in enumerate(env) if value is not None)
        outputs = []
        for output in self._outputs:
            if isinstance(output, LiteralOutput):
                outputs.append(jax.numpy.asarray(output.value))
            elif isinstance(output, ConstOutput):
                outputs.append(consts[output.name])
            elif isinstance(output, BufferOutput):
                outputs.append(env[self._slot[output.key]])
            elif output.combine == "mean":
                outputs.append(_mean([env[self._slot[k]] for k in output.keys]))
            else:
                outputs.append(_concat([env[self._slot[k]] for k in output.keys]))
        return outputs

    @property
    def events(self) -> list[TraceEvent]:
        """The last step, one event per instruction (none before the first step)."""
        times = self._times
        if not times:
            return []
        return [
            TraceEvent(name, mesh, times[i], times[i + 1], dict(args), self._returned[i])
            for i, ((_, name, args, _), mesh) in enumerate(
                zip(self._steps, self._meshes, strict=True)
            )
        ]

    @property
    def leftover(self) -> list[BufferKey]:
        """Buffers of the last step still alive besides inputs and outputs (none)."""
        keep = set(self.program.persistent) | self.program.output_keys()
        return sorted(
            (key for key, i in self._slot.items() if i in self._last_alive and key not in keep),
            key=str,
        )


def _mean(values):
    return jitted_mean()(*values)


def _concat(values):
    return values[0] if len(values) == 1 else jitted_concat()(*values)
