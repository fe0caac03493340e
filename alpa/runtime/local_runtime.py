"""The in-process runtime: run pipeline instructions on local submeshes.

Every mesh is a set of this process's devices; the driver itself walks the instruction
list (DESIGN §6). Values move between submeshes with ``jax.device_put`` (DESIGN §7: a jit
never reads an array of another mesh), and each ``RESHARD`` is also planned tile by tile
(``pipeline_parallel.resharding``, cached per shape and pair of shardings): the plan's bytes,
what a cross-host backend would send, are counted per step (``resharded_bytes``). Buffers
are plain references in a dict keyed by ``BufferKey``; ``FREE`` drops them, and JAX frees
device memory when the last reference goes.

The runtime records, per instruction, when it was dispatched (or, with
``blocking=True``, when it finished), which the executable writes as a Chrome trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from alpa.pipeline_parallel.resharding import MeshSharding, ReshardingPlan, plan_resharding
from alpa.pipeline_parallel.runtime_emitter import BufferKey, PipelineInstructions


@dataclass
class TraceEvent:
    name: str
    mesh: int
    start: float
    end: float
    args: dict = field(default_factory=dict)


@dataclass
class LocalPipelineRuntime:
    """Executes :class:`PipelineInstructions`.

    Attributes:
      program: the instructions.
      computations: callables, indexed like ``Instruction.computation``.
      sharding_of: ``BufferKey -> jax.sharding.Sharding`` of that buffer on its mesh.
      micro_batch_size: per step-input leaf, its micro-batch size (for ``LOAD``).
      computation_names: for the trace.
      leaf_index: name of a step input -> its position in the flat arguments.
      resharded_bytes: bytes the last step's ``RESHARD`` instructions sent between meshes,
        by the tile plan (each piece once per destination host).
    """

    program: PipelineInstructions
    computations: Sequence[Callable]
    sharding_of: Callable[[BufferKey], Any]
    micro_batch_size: Sequence[int | None]
    computation_names: Sequence[str]
    leaf_index: dict[str, int] = field(default_factory=dict)
    events: list[TraceEvent] = field(default_factory=list)
    leftover: list[BufferKey] = field(default_factory=list)
    resharded_bytes: int = 0
    _plans: dict = field(default_factory=dict)

    def __post_init__(self):
        self._add = jax.jit(lambda a, b: a + b)
        self._add_scale = jax.jit(lambda a, b, s: (a + b) * s.astype(a.dtype))
        self._scale = jax.jit(lambda a, s: a * s.astype(a.dtype))

    def run(self, flat_args: Sequence[Any], consts: dict, blocking: bool = False) -> list:
        env: dict[BufferKey, Any] = {}
        for key in self.program.persistent:
            leaf = self._leaf_of_key(key)
            env[key] = _place(flat_args[leaf], self.sharding_of(key))
        events = []
        resharded = 0
        for ins in self.program.instructions:
            start = time.perf_counter()
            if ins.op == "FREE":
                for key in ins.inputs:
                    env.pop(key, None)
                continue
            args = {}
            if ins.op == "LOAD":
                (key,) = ins.outputs
                size = self.micro_batch_size[ins.leaf]
                arg = flat_args[ins.leaf]
                piece = arg[ins.micro_batch * size : (ins.micro_batch + 1) * size]
                env[key] = jax.device_put(piece, self.sharding_of(key))
                name = f"load {key[0]} mb{ins.micro_batch}"
            elif ins.op == "RESHARD":
                (src,), (dst,) = ins.inputs, ins.outputs
                value, sharding = env[src], self.sharding_of(dst)
                sent = self._plan(value, sharding).num_elements_sent() * value.dtype.itemsize
                resharded += sent
                env[dst] = jax.device_put(value, sharding)
                name = f"reshard {src[0]} {src[2]}->{dst[2]}"
                args = {"bytes": sent}
            elif ins.op == "RUN":
                outs = self.computations[ins.computation](*[env[k] for k in ins.inputs])
                env.update(zip(ins.outputs, outs, strict=True))
                name = f"{self.computation_names[ins.computation]} mb{ins.micro_batch}"
                if blocking:
                    jax.block_until_ready(outs)
            elif ins.op == "ACCUMULATE":
                (src,), (dst,) = ins.inputs, ins.outputs
                value = env[src]
                scale = None if ins.scale is None else np.float32(ins.scale)
                if ins.first:
                    env[dst] = value if scale is None else self._scale(value, scale)
                elif scale is None:
                    env[dst] = self._add(env[dst], value)
                else:
                    env[dst] = self._add_scale(env[dst], value, scale)
                name = f"accumulate {dst[0]}"
            else:
                raise AssertionError(f"unknown instruction {ins.op}")
            events.append(TraceEvent(name, ins.mesh, start, time.perf_counter(), args))
        outputs = []
        for kind, value in self.program.outputs:
            if kind == "literal":
                outputs.append(jax.numpy.asarray(value))
            elif kind == "const":
                outputs.append(consts[value])
            elif kind == "key":
                outputs.append(env[value])
            else:
                outputs.append(_concat([env[k] for k in value]))
        # Nothing but inputs and outputs may stay alive after a step.
        output_keys = {v for kind, v in self.program.outputs if kind == "key"}
        output_keys |= {k for kind, v in self.program.outputs if kind == "concat" for k in v}
        self.leftover = sorted(set(env) - self.program.persistent - output_keys, key=str)
        self.events = events
        self.resharded_bytes = resharded
        return outputs

    def _leaf_of_key(self, key: BufferKey) -> int:
        return self.leaf_index[key[0]]

    def _plan(self, value, dst_sharding) -> ReshardingPlan:
        ndim = len(value.shape)
        key = (value.shape, value.sharding, dst_sharding)
        plan = self._plans.get(key)
        if plan is None:
            src = _mesh_sharding(value.sharding, ndim)
            plan = plan_resharding(value.shape, src, _mesh_sharding(dst_sharding, ndim))
            self._plans[key] = plan
        return plan


def _mesh_sharding(sharding, ndim: int) -> MeshSharding:
    """The tile-planner view of a ``NamedSharding`` on a 2-D submesh (or of one device)."""
    if isinstance(sharding, NamedSharding) and len(sharding.mesh.devices.shape) == 2:
        shape = tuple(int(n) for n in sharding.mesh.devices.shape)
        return MeshSharding.from_partition_spec(
            shape, sharding.spec, ndim, tuple(sharding.mesh.axis_names)
        )
    if len(sharding.device_set) == 1:
        return MeshSharding((1, 1), ((),) * ndim)
    raise NotImplementedError(f"resharding plan for sharding {sharding}")


def _place(value, sharding):
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    return jax.device_put(value, sharding)


_concat_fn = jax.jit(lambda *xs: jax.numpy.concatenate(xs, axis=0))


def _concat(values):
    return values[0] if len(values) == 1 else _concat_fn(*values)
