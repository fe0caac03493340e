"""A step's ``ShardingPlan`` compiled by XLA on its mesh:
``shard_parallel/lowering/step_function.py``'s step function, jitted with the plan's
shardings and the step's donations. The one-mesh executables wrap what this returns; the
measured stage cost times it directly."""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from alpa.global_env import global_config
from alpa.shard_parallel.lowering.step_function import (
    build_micro_batched_parts,
    build_step_function,
)
from alpa.shard_parallel.sharding_plan import ShardingPlan
from alpa.tracing import StepJaxpr
from alpa.xla_compile import compile_lowered, hlo_text

logger = logging.getLogger(__name__)


def full_batch_avals(traced: StepJaxpr, num_micro_batches: int | None):
    """Input avals at the size the caller passes: batch leaves times ``k`` on dim 0."""
    k = num_micro_batches or 1
    avals = []
    for aval, is_batch in zip(traced.in_avals, traced.batch_invars, strict=True):
        shape = aval.shape
        if is_batch and k > 1:
            shape = (shape[0] * k,) + tuple(shape[1:])
        avals.append(jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type))
    return avals


def donated_argnums(traced: StepJaxpr) -> tuple[int, ...]:
    """Positions, among the dynamic arguments, of those whose buffers are donated (a
    dynamic argument is donated as a whole, so its first leaf says)."""
    donated, start = [], 0
    in_tree, _ = traced.trees()
    for position, subtree in enumerate(in_tree.children()):
        if subtree.num_leaves and traced.donated_invars[start]:
            donated.append(position)
        start += subtree.num_leaves
    return tuple(donated)


def compile_plan(traced: StepJaxpr, plan: ShardingPlan, num_micro_batches: int | None):
    """``(compiled, in_shardings)``: ``traced`` lowered with ``plan`` and compiled for the
    full batch; ``compiled`` takes the dynamic arguments as the user's pytrees, placed as
    ``in_shardings`` says. With ``num_micro_batches`` it is a :class:`MicroBatchedProgram`
    (a program per part of the step, as Alpa ran gradient accumulation); else XLA's
    compiled program."""
    mesh = plan.logical_mesh.get_jax_mesh()
    in_shardings = tuple(NamedSharding(mesh, s) for s in plan.in_specs)
    if num_micro_batches:
        tic = time.perf_counter()
        program = MicroBatchedProgram(traced, plan, mesh, num_micro_batches, in_shardings)
        _log_compile(traced, plan, tic)
        return program, in_shardings
    out_shardings = tuple(None if s is None else NamedSharding(mesh, s) for s in plan.out_specs)
    inner = build_step_function(traced, plan, mesh, num_micro_batches)
    in_tree, out_tree = traced.trees()

    def step(*dynamic_args):
        return jax.tree.unflatten(out_tree, inner(*jax.tree.leaves(dynamic_args)))

    jitted = jax.jit(
        step,
        in_shardings=jax.tree.unflatten(in_tree, in_shardings),
        out_shardings=jax.tree.unflatten(out_tree, out_shardings),
        donate_argnums=donated_argnums(traced),
    )
    tic = time.perf_counter()
    lowered = jitted.lower(
        *jax.tree.unflatten(in_tree, full_batch_avals(traced, num_micro_batches))
    )
    compiled = compile_lowered(lowered, _platform(mesh))
    _log_compile(traced, plan, tic)
    return compiled, in_shardings


def _platform(mesh) -> str:
    return mesh.devices.flat[0].platform


def _log_compile(traced: StepJaxpr, plan: ShardingPlan, tic: float) -> None:
    if global_config.print_compilation_time:
        logger.warning(
            "compiled %s (%s) in %.2f s", traced.name, plan.method, time.perf_counter() - tic
        )


def _device_bytes(structs) -> int:
    """Bytes of one device's shard of each of ``structs``, summed."""
    total = 0
    for x in structs:
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def _struct(aval, sharding) -> jax.ShapeDtypeStruct:
    weak = getattr(aval, "weak_type", False)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding, weak_type=weak)


class _PartFunctions:
    """The functions ``MicroBatchedProgram`` compiles, on flat lists of the step's
    non-batch leaves (``params``), micro-batch leaves (one micro-batch's, or micro-batches
    ``0 .. k-2`` stacked) and the carried accumulators of the gradients the apply part
    reads (the others, a loss the step does not return, are left out, and XLA drops their
    computation)."""

    def __init__(self, parts, param_at: list[int], batch_at: list[int]):
        self.parts, self.param_at, self.batch_at = parts, param_at, batch_at
        self.used = parts.grad_used

    def _leaves(self, params, batch) -> list:
        leaves = [None] * len(self.parts.is_batch)
        for i, x in zip(self.param_at, params, strict=True):
            leaves[i] = x
        for i, x in zip(self.batch_at, batch, strict=False):  # (then the row ids, if any)
            leaves[i] = x
        return leaves

    def _kept(self, values) -> list:
        return [x for x, u in zip(values, self.used, strict=True) if u]

    def _all_of(self, carry) -> list:
        zeros, it = self.parts.carried(self.parts.init()), iter(carry)
        return [next(it) if u else z for z, u in zip(zeros, self.used, strict=True)]

    def prepare(self, batch):
        """``(first, last, carry)``: micro-batches ``0 .. k-2`` stacked (``[k-1, ...]`` per
        leaf), micro-batch ``k-1``, and the zero accumulators."""
        stacked = self.parts.split(self._leaves([None] * len(self.param_at), batch))
        first = [s[: self.parts.k - 1] for s in stacked]
        last = [s[self.parts.k - 1] for s in stacked]
        return first, last, self._kept(self.parts.carried(self.parts.init()))

    def _accumulate(self, params, micro_batches, carry, stacked: bool) -> list:
        leaves = self._leaves(params, [m[0] if stacked else m for m in micro_batches])
        params = self.parts.params(self.parts.read(leaves))
        acc = self.parts.uncarried(self._all_of(carry))
        if not stacked:
            return self.parts.accumulate(params, micro_batches, acc)
        return self.parts.accumulate_each(params, micro_batches, acc)

    def accumulate(self, params, first, carry):
        """Micro-batches ``0 .. k-2``, in a loop: the accumulators, still unreduced."""
        return self._kept(self.parts.carried(self._accumulate(params, first, carry, True)))

    def accumulate_last(self, params, micro_batch, carry):
        """Micro-batch ``k-1``, then the step's gradient synchronisation."""
        acc = self._accumulate(params, micro_batch, carry, False)
        return self.parts.finish(acc, self.used)

    def apply(self, *params_and_grads):
        n = len(self.param_at)
        params, grads = params_and_grads[:n], iter(params_and_grads[n:])
        grads = [next(grads) if u else None for u in self.used]
        return self.parts.apply(self._leaves(params, []), grads)


class MicroBatchedProgram:
    """A step over ``k`` micro-batches as Alpa ran it: a program per part
    (``lowering.MicroBatchedParts``), called in turn by :meth:`__call__`, four calls a
    step whatever ``k``.

    * ``prepare``: the batch leaves as ``k`` micro-batches (rows ``j·B/k .. (j+1)·B/k``,
      each laid out as the plan wants the leaf: the step's one change of layout), the
      first ``k-1`` stacked, and the zero gradient accumulators;
    * ``accumulate`` (micro-batches ``0 .. k-2``, in a ``lax.scan``; not compiled when
      ``k = 1``): the parameters, the stacked micro-batches and the accumulators in, the
      accumulators plus their gradients out. Row sums stay per-device partial sums: no
      gradient synchronisation;
    * ``accumulate_last`` (micro-batch ``k-1``): the parameters, one micro-batch and the
      accumulators in; the gradients summed and reduced across devices (once per step)
      out;
    * ``apply``: the parameters (the step's non-batch inputs) and the summed gradients in,
      the step's outputs out.

    Alpa compiled one accumulate program, ran it on each micro-batch and skipped its
    gradient all-reduce at run time on all but the last; stock XLA cannot skip a
    collective, so the micro-batches before the last run in a program of their own,
    without it, as one loop (one dispatch, not ``k - 1``: measured in
    ``benchmark/dispatch/bench_micro_batch_programs.py``). :meth:`as_text` is Alpa's
    ``get_hlo_text()`` of such a step: ``accumulate_last``'s module, then ``apply``'s.
    Arguments must already be placed as ``in_shardings`` says (``MeshExecutable``
    places them)."""

    def __init__(self, traced: StepJaxpr, plan: ShardingPlan, mesh, k: int, in_shardings):
        first = build_micro_batched_parts(traced, plan, mesh, k)
        self.k = k
        self._platform = _platform(mesh)
        self.in_tree, self.out_tree = traced.trees()
        avals = full_batch_avals(traced, k)
        self._batch_at = [i for i, b in enumerate(first.is_batch) if b]
        self._param_at = [i for i, b in enumerate(first.is_batch) if not b]
        self._batch = [_struct(avals[i], in_shardings[i]) for i in self._batch_at]
        self._params = [_struct(avals[i], in_shardings[i]) for i in self._param_at]
        # The apply program first, each gradient in the plan's sharding or, where the plan
        # names none, in the one XLA's propagation picks for the update that reads it;
        # the accumulate programs then compute, carry and reduce each in that sharding.
        self.apply = self._compile_apply(traced, plan, mesh, first)
        # (XLA may give a sharding no mesh spec names: then as the plan says, or XLA's.)
        picked = iter(
            s if isinstance(s, NamedSharding) else None
            for s in self.apply.input_shardings[0][len(self._params) :]
        )
        grad_shardings = [
            (next(picked) or s) if u else s
            for s, u in zip(first.grad_shardings, first.grad_used, strict=True)
        ]
        parts = build_micro_batched_parts(traced, plan, mesh, k, grad_shardings)
        self._compile_accumulate(_PartFunctions(parts, self._param_at, self._batch_at))
        self.output_shardings = self.apply.output_shardings

    def _compile_apply(self, traced: StepJaxpr, plan: ShardingPlan, mesh, parts):
        functions = _PartFunctions(parts, self._param_at, self._batch_at)
        _, last_avals, carry_avals = jax.eval_shape(functions.prepare, self._batch)
        grad_avals = jax.eval_shape(
            functions.accumulate_last, self._params, last_avals, carry_avals
        )
        shardings = [s for s, u in zip(parts.grad_shardings, parts.grad_used, strict=True) if u]
        grads = [_struct(a, s) for a, s in zip(grad_avals, shardings, strict=True)]
        out_shardings = [None if s is None else NamedSharding(mesh, s) for s in plan.out_specs]
        donated = tuple(n for n, i in enumerate(self._param_at) if traced.donated_invars[i])
        jitted = jax.jit(functions.apply, out_shardings=out_shardings, donate_argnums=donated)
        return compile_lowered(jitted.lower(*self._params, *grads), self._platform)

    def _compile_accumulate(self, functions: _PartFunctions) -> None:
        self.prepare = compile_lowered(
            jax.jit(functions.prepare).lower(self._batch), self._platform
        )
        first_shardings, last_shardings, carry_shardings = self.prepare.output_shardings
        first_avals, last_avals, carry_avals = jax.eval_shape(functions.prepare, self._batch)
        first = [_struct(a, s) for a, s in zip(first_avals, first_shardings, strict=True)]
        micro_batch = [_struct(a, s) for a, s in zip(last_avals, last_shardings, strict=True)]
        carry = [_struct(a, s) for a, s in zip(carry_avals, carry_shardings, strict=True)]
        self._micro_batch = micro_batch
        self.accumulate = None
        if self.k > 1:
            self.accumulate = compile_lowered(
                jax.jit(
                    functions.accumulate, out_shardings=carry_shardings, donate_argnums=(2,)
                ).lower(self._params, first, carry),
                self._platform,
            )
        grad_out = list(self.apply.input_shardings[0][len(self._params) :])
        self.accumulate_last = compile_lowered(
            jax.jit(functions.accumulate_last, out_shardings=grad_out, donate_argnums=(2,)).lower(
                self._params, micro_batch, carry
            ),
            self._platform,
        )

    @property
    def parts(self) -> list[tuple[str, Any]]:
        """``(name, compiled)`` of each program, in the order a step runs them."""
        named = [("prepare", self.prepare), ("accumulate", self.accumulate)]
        named += [("accumulate_last", self.accumulate_last), ("apply", self.apply)]
        return [(name, c) for name, c in named if c is not None]

    def __call__(self, *dynamic_args):
        leaves = jax.tree.leaves(dynamic_args)
        params = [leaves[i] for i in self._param_at]
        first, last, carry = self.prepare([leaves[i] for i in self._batch_at])
        del leaves
        if self.accumulate is not None:
            carry = self.accumulate(params, first, carry)
        del first  # freed before the last micro-batch runs
        grads = self.accumulate_last(params, last, carry)
        return jax.tree.unflatten(self.out_tree, self.apply(*params, *grads))

    def bytes_beside(self) -> dict[str, int]:
        """Per program, the bytes one device holds beside what it allocates itself while it
        runs (its arguments, outputs and temporaries, XLA's memory analysis): the
        caller's inputs it does not read, the micro-batches not yet consumed. The step's
        peak is the largest sum (``MeshExecutable.get_total_allocation_size``)."""
        batch, params = _device_bytes(self._batch), _device_bytes(self._params)
        micro_batch = _device_bytes(self._micro_batch)
        beside = {
            "prepare": params,
            "accumulate": batch + micro_batch,
            "accumulate_last": batch,
            "apply": batch,
        }
        return {name: beside[name] for name, _ in self.parts}

    def as_text(self) -> str:
        """Alpa's two modules of a micro-batched step: ``accumulate_last``'s HLO (the
        gradient synchronisation inside), then ``apply``'s."""
        return hlo_text(self.accumulate_last) + hlo_text(self.apply)
