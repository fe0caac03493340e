"""How a Ray mesh worker runs each instruction of a
:class:`~alpa.runtime.worker_program.WorkerProgram`: one handler per
:class:`~alpa.runtime.worker_program.WorkerOp` (``HANDLERS``), which
:meth:`~alpa.runtime.ray_worker.MeshHostWorker.run_step` calls in program order; and the
compiled ``CONCAT`` / ``MEAN`` of per-micro-batch outputs, which the local runtime uses
too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from alpa.runtime.worker_program import (
    DummyValue,
    Layout,
    WorkerInstruction,
    WorkerOp,
    WorkerProgram,
)

if TYPE_CHECKING:
    from alpa.runtime.ray_worker import MeshHostWorker


class LoadedProgram:
    """A :class:`WorkerProgram` with its functions compiled on the worker's devices."""

    def __init__(self, program: WorkerProgram, fns: list[Callable]):
        self.program = program
        self.fns = fns
        self.unstack: dict[tuple, Callable] = {}  # per LOAD: the compiled split
        # Per instruction, the micro-batches of the buffers it writes (a RUN) and frees
        # that the in-flight count is about (WorkerProgram.micro_batch_of).
        tag = program.micro_batch_of or (None,) * program.num_slots
        self.born = [
            tuple(tag[s] for s in ins.out_slots if tag[s] is not None)
            if ins.op is WorkerOp.RUN
            else ()
            for ins in program.instructions
        ]
        self.dead = [
            tuple(tag[s] for s in ins.free if tag[s] is not None) for ins in program.instructions
        ]


# ----------------------------------------------------------------------------- handlers


def _input(w: MeshHostWorker, lp: LoadedProgram, ins: WorkerInstruction, env, args, step):
    env[ins.out_slots[0]] = w._place(args[ins.arg], ins.layout)


def _load(w: MeshHostWorker, lp: LoadedProgram, ins: WorkerInstruction, env, args, step):
    """The ``k`` micro-batches of a batch argument: one placement of the whole batch as
    ``[k, size, ...]`` (each micro-batch laid out as the mesh wants it), then one compiled
    split on the devices."""
    import jax
    from jax.sharding import PartitionSpec

    k = len(ins.out_slots)
    value = args[ins.arg]
    if isinstance(value, DummyValue) and k > 1:
        value = value.host()
    if k == 1:
        env[ins.out_slots[0]] = w._place(value, ins.layout)
        return
    sharding = w._sharding(ins.layout)
    data = np.asarray(value)
    data = data.reshape((k, ins.micro_batch_size) + data.shape[1:])
    stacked_layout = Layout(
        ins.layout.mesh_shape, ins.layout.axis_names, PartitionSpec(None, *ins.layout.spec)
    )
    stacked = w._place(data, stacked_layout)
    key = (ins.arg, k, ins.layout)
    if key not in lp.unstack:
        lp.unstack[key] = jax.jit(lambda s: [s[m] for m in range(k)], out_shardings=[sharding] * k)
    for slot, part in zip(ins.out_slots, lp.unstack[key](stacked), strict=True):
        env[slot] = part


def _run(w: MeshHostWorker, lp: LoadedProgram, ins: WorkerInstruction, env, args, step):
    outs = lp.fns[ins.fn](*[env[i] for i in ins.in_slots])
    for slot, value in zip(ins.out_slots, outs, strict=True):
        env[slot] = value


def _alloc(w: MeshHostWorker, lp: LoadedProgram, ins: WorkerInstruction, env, args, step):
    for slot, value in zip(ins.out_slots, lp.fns[ins.fn](), strict=True):
        env[slot] = value


def _send(w: MeshHostWorker, lp: LoadedProgram, ins: WorkerInstruction, env, args, step):
    w._send(env[ins.in_slots[0]], ins.transfer, (step, ins.tag), ins.peer_mesh)


def _recv(w: MeshHostWorker, lp: LoadedProgram, ins: WorkerInstruction, env, args, step):
    env[ins.out_slots[0]] = w._receive(ins.transfer, (step, ins.tag), step, ins.peer_mesh)


def _concat(w: MeshHostWorker, lp: LoadedProgram, ins: WorkerInstruction, env, args, step):
    env[ins.out_slots[0]] = jitted_concat()(*[env[i] for i in ins.in_slots])


def _mean(w: MeshHostWorker, lp: LoadedProgram, ins: WorkerInstruction, env, args, step):
    env[ins.out_slots[0]] = jitted_mean()(*[env[i] for i in ins.in_slots])


@functools.cache
def jitted_concat() -> Callable:
    """``CONCAT``, compiled: per-micro-batch values joined along axis 0 (made on first use,
    after this process has set up jax; the local runtime uses it too)."""
    import jax

    return jax.jit(lambda *xs: jax.numpy.concatenate(xs, axis=0))


@functools.cache
def jitted_mean() -> Callable:
    """``MEAN``, compiled: the mean of per-micro-batch values (a scalar loss)."""
    import jax

    return jax.jit(lambda *xs: sum(xs[1:], xs[0]) / len(xs))


HANDLERS: dict[WorkerOp, Callable] = {
    WorkerOp.INPUT: _input,
    WorkerOp.LOAD: _load,
    WorkerOp.RUN: _run,
    WorkerOp.ALLOC: _alloc,
    WorkerOp.SEND: _send,
    WorkerOp.RECV: _recv,
    WorkerOp.CONCAT: _concat,
    WorkerOp.MEAN: _mean,
}
