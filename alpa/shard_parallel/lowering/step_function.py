"""Lowering: a ``ShardingPlan`` becomes one compiled XLA program on one mesh.

The jaxpr is re-evaluated under ``jax.jit`` with the plan's constraints
(``constrained_eval.py``); XLA's SPMD partitioner does the rest (``docs/auto_sharding.md``,
Lowering). Inputs and outputs get the plan's ``in_shardings`` / ``out_shardings``.

Gradient accumulation (``docs/shard_parallel.md``, Gradient accumulation). With
``num_micro_batches = k`` the step is cut at the ``alpa.grad`` marker into a compute-grad
part and an apply-grad part. Micro-batch ``j`` is rows ``j·B/k .. (j+1)·B/k`` of every batch
leaf, for every method; the compute part runs on each in a ``lax.scan``, as the serial step
would (batch statistics are over the whole micro-batch, across devices), and its marked
outputs are averaged,

    g = (1/k) * sum_j compute(params, batch[j·B/k : (j+1)·B/k])

then the apply part runs once on ``g``. The batch is laid out as micro-batches once per
step, before the loop, and gradients that are sums over the batch's rows are reduced
across devices **once per step**, after it (``micro_batches.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Var
from jax.sharding import NamedSharding, PartitionSpec

from alpa.device_mesh import spec_entry
from alpa.shard_parallel.gradients.gradient_sync import (
    packed_gathers,
    packs_by_dimension,
    reduce_at_marker,
)
from alpa.shard_parallel.gradients.micro_batches import batch_dims, stack_micro_batches
from alpa.shard_parallel.gradients.packed_collectives import gather_packed, reduce_partials
from alpa.shard_parallel.gradients.param_gathers import GatherSchedule, Pack, gather_schedule
from alpa.shard_parallel.gradients.reduce_scatters import reduce_scatter_overrides
from alpa.shard_parallel.gradients.row_sums import deferrable, deferred_rules, partial_spec
from alpa.shard_parallel.lowering.constrained_eval import eval_jaxpr_with_constraints, pinned
from alpa.shard_parallel.lowering.plan_pins import Pins, plan_pins
from alpa.shard_parallel.sharding_plan import ShardingPlan
from alpa.tracing import StepJaxpr, new_jaxpr
from alpa.tracing.batch_draws import batch_size, micro_batch_draws, with_row_ids
from alpa.tracing.jaxpr_util import backward_slice, read_vars

# ----------------------------------------------------------------------------- grad split


@dataclass(frozen=True)
class GradSplit:
    """A step cut at the ``alpa.grad`` marker.

    ``compute`` maps all step inputs to the marker's operands; ``apply`` maps all step
    inputs followed by the marker's (accumulated) outputs to the step's outputs.
    """

    compute: Jaxpr
    apply: Jaxpr
    marker_outvars: tuple[Var, ...]


def split_at_grad_marker(traced: StepJaxpr) -> GradSplit:
    jaxpr = traced.jaxpr
    marker = traced.grad_marker()
    if marker is None:
        if traced.has_backward_pass:
            raise ValueError(
                f"num_micro_batches is set but {traced.name} differentiates with jax.grad "
                "(or jax.value_and_grad / jax.vjp): gradient accumulation needs to know "
                "which values are gradients. Replace jax.grad / jax.value_and_grad by "
                "alpa.grad / alpa.value_and_grad."
            )
        raise ValueError(
            f"num_micro_batches is set but {traced.name} computes no gradient (no alpa.grad "
            "or alpa.value_and_grad): micro-batches accumulate gradients, so an inference "
            "step runs its batch whole; leave num_micro_batches unset"
        )
    batch_vars = {v for v, b in zip(jaxpr.invars, traced.batch_invars, strict=True) if b}
    for eqn in jaxpr.eqns:
        if eqn is marker:  # accumulated over micro-batches: no longer per-batch
            continue
        if any(not isinstance(v, Literal) and v in batch_vars for v in eqn.invars):
            batch_vars.update(eqn.outvars)

    marked = set(marker.outvars)
    compute_eqns = backward_slice(jaxpr.eqns, marker.invars)
    apply_eqns = backward_slice(jaxpr.eqns, jaxpr.outvars, stop=marked)
    leaking = [e for e in apply_eqns if e is not marker and set(e.outvars) & batch_vars]
    leaking_outs = [
        v
        for v in jaxpr.outvars
        if not isinstance(v, Literal) and v in batch_vars and v not in marked
    ]
    if leaking or leaking_outs:
        what = f"the result of `{leaking[0].primitive.name}`" if leaking else "an output"
        raise ValueError(
            f"{traced.name}: {what} depends on the batch but does not pass through "
            "alpa.grad / alpa.value_and_grad. With num_micro_batches every batch-dependent "
            "value must be returned by the differentiated function (use has_aux=True for "
            "extra values) so that it can be accumulated over micro-batches."
        )
    compute = new_jaxpr(jaxpr, jaxpr.constvars, jaxpr.invars, marker.invars, compute_eqns)
    apply = new_jaxpr(
        jaxpr,
        jaxpr.constvars,
        list(jaxpr.invars) + list(marker.outvars),
        jaxpr.outvars,
        apply_eqns,
    )
    return GradSplit(compute, apply, tuple(marker.outvars))


def _average(total, count: int):
    if jnp.issubdtype(total.dtype, jnp.inexact):
        return total / count
    return total


# ----------------------------------------------------------------------------- lowering


def build_step_function(traced: StepJaxpr, plan: ShardingPlan, mesh, num_micro_batches: int | None):
    """The Python function that ``jax.jit`` compiles for ``plan``: flat leaves in, flat
    leaves out, batch leaves at full batch size."""
    pins = _step_pins(traced, plan, mesh)
    if not num_micro_batches:
        return _one_batch_step(traced, plan, mesh, pins)
    return _micro_batched_step(traced, plan, mesh, num_micro_batches, pins)


def build_micro_batched_parts(
    traced: StepJaxpr, plan: ShardingPlan, mesh, num_micro_batches: int, grad_shardings=None
) -> MicroBatchedParts:
    """``plan``'s step over ``num_micro_batches`` micro-batches, in the parts that a
    program each compiles (:class:`MicroBatchedParts`). ``grad_shardings`` (per output of
    the ``alpa.grad`` marker, a sharding or ``None``) pins the gradients, and what the
    compute part computes them from, where the plan does not."""
    pins = _step_pins(traced, plan, mesh)
    return micro_batched_parts(traced, plan, mesh, num_micro_batches, pins, grad_shardings)


def _step_pins(traced: StepJaxpr, plan: ShardingPlan, mesh) -> Pins:
    """What the plan pins, on ``mesh`` (``plan_pins``), its gradient specs on the
    ``alpa.grad`` marker's outputs too."""
    pins = plan_pins(plan, mesh)
    var_shardings = dict(pins.constraints)
    marker = traced.grad_marker()
    if marker is not None and plan.grad_specs is not None:
        for v, spec in zip(marker.outvars, plan.grad_specs, strict=True):
            if spec is not None:
                var_shardings[v] = NamedSharding(mesh, spec)
    if mesh.size == 1:
        # Nothing to shard; the constraints would only stand between XLA's simplifications
        # (measured: a 25 ms MLP step 12% slower than jax.jit with them, equal without).
        return dataclasses.replace(pins, constraints={}, operand_constraints={})
    return pins.with_constraints(var_shardings)


def _one_batch_step(traced: StepJaxpr, plan: ShardingPlan, mesh, pins: Pins):
    """The step on the whole batch at once, its gradients reduced at the marker."""
    closed = traced.closed_jaxpr
    var_shardings, operand_shardings = pins.constraints, pins.operand_constraints
    overrides = reduce_at_marker(traced, plan, mesh, var_shardings)
    if mesh.size > 1:
        overrides |= pins.overrides(closed.jaxpr, skip=overrides)
        overrides |= _reduce_scatters(traced, closed.jaxpr, plan, plan.var_specs, mesh, overrides)
    gathered = _gathering(traced, plan, mesh)
    schedule = None
    if plan.gather_bound is not None and gathered.input_specs:
        schedule = gather_schedule(traced, sorted(gathered.input_specs), plan.gather_bound)
        # The gathered inputs arrive split; the schedule binds them whole where read.
        split = {closed.jaxpr.invars[i] for i in gathered.input_specs}
        var_shardings = {v: s for v, s in var_shardings.items() if v not in split}

    def step(*leaves):
        rebinds = None
        if schedule is None:
            leaves = gathered.inputs(leaves)
        else:
            rebinds = _gather_rebinds(schedule, closed.jaxpr, leaves, gathered.input_specs, mesh)
        outs = eval_jaxpr_with_constraints(
            closed.jaxpr,
            closed.consts,
            leaves,
            var_shardings,
            operand_shardings,
            overrides,
            rebinds,
        )
        return gathered.outputs(outs)

    return step


def _gather_rebinds(
    schedule: GatherSchedule,
    jaxpr: Jaxpr,
    leaves: Sequence,
    specs: Mapping[int, tuple],
    mesh,
) -> dict[JaxprEqn, Callable]:
    """The ``rebinds`` of ``eval_jaxpr_with_constraints`` that carry out ``schedule``
    (ZeRO-3's gathers, ``param_gathers``) on the step's inputs ``leaves`` (the gathered
    ones split, as ``specs[i] = (spec, axes)`` says: ``gradient_sync.PackedGathers``; a
    data-parallel plan's, packed by dtype alone)."""
    rebinds: dict[JaxprEqn, list[Callable]] = {}

    def gather(pack: Pack) -> Callable:
        def rebind(read) -> dict:
            values = [leaves[i] for i in pack.inputs]
            packed = {k: specs[i] for k, i in enumerate(pack.inputs)}
            if pack.wait is not None:
                # A column of its own (an element per device, dropped after) keeps this
                # pack from being the same all-gather as a forward one, which XLA's CSE
                # merges where the barrier is expanded first (CPU).
                axes = specs[pack.inputs[0]][1]
                n = int(np.prod([mesh.shape[a] for a in axes]))
                packed[len(values)] = (PartitionSpec(spec_entry(axes)), axes)
                values = [*values, jnp.zeros((n,), values[0].dtype)]
                values, _ = jax.lax.optimization_barrier((values, read(pack.wait)))
            whole = gather_packed(values, packed, mesh)
            return {jaxpr.invars[i]: w for i, w in zip(pack.inputs, whole, strict=False)}

        return rebind

    for pack in schedule.packs:
        rebinds.setdefault(jaxpr.eqns[pack.at], []).append(gather(pack))
    if schedule.release is not None:
        split = {jaxpr.invars[i]: leaves[i] for i in specs}
        rebinds.setdefault(jaxpr.eqns[schedule.release], []).append(lambda read: split)

    def chained(hooks):
        def run(read) -> dict:
            out = {}
            for hook in hooks:
                out |= hook(read)
            return out

        return run

    return {eqn: chained(hooks) for eqn, hooks in rebinds.items()}


@dataclass(frozen=True)
class _Gathering:
    """The packed all-gathers of a data-parallel plan (``gradient_sync.packed_gathers``):
    of the step's inputs before it runs, of its outputs after."""

    input_specs: dict
    output_specs: dict
    mesh: Any
    by_dimension: bool

    def inputs(self, leaves) -> list:
        return gather_packed(list(leaves), self.input_specs, self.mesh, self.by_dimension)

    def outputs(self, outs) -> list:
        return gather_packed(list(outs), self.output_specs, self.mesh, self.by_dimension)


def _gathering(traced: StepJaxpr, plan: ShardingPlan, mesh) -> _Gathering:
    gathers = packed_gathers(traced, plan)
    return _Gathering(dict(gathers.inputs), dict(gathers.outputs), mesh, packs_by_dimension(plan))


def _micro_batched_step(traced: StepJaxpr, plan: ShardingPlan, mesh, k: int, pins: Pins):
    """The step over ``k`` micro-batches as one program: a loop of the compute part
    accumulating the gradients (row sums kept per device where they can be), then the
    apply part once."""
    parts = micro_batched_parts(traced, plan, mesh, k, pins)

    def step(*leaves):
        read = parts.read(leaves)
        acc = parts.accumulate_each(parts.params(read), parts.split(read), parts.init())
        return parts.apply(leaves, parts.finish(acc))

    return step


@dataclass(frozen=True, eq=False)
class MicroBatchedParts:
    """A step over ``k`` micro-batches, cut into the functions (traceable under
    ``jax.jit``) that one program (:func:`_micro_batched_step`) or a program per part
    (``compile.MicroBatchedProgram``) composes. ``leaves`` are the step's flat inputs,
    batch leaves at full batch size:

    * ``read(leaves)``: the inputs as the compute part reads them (ZeRO-3's gathers,
      packed; the plan's constraints on the parameters), batch leaves untouched;
    * ``params(read)``: the non-batch leaves among them, in input order;
    * ``split(read)``: per batch leaf (then the row ids of the step's random draws, if it
      draws), ``[k, B/k, ...]``, micro-batch ``j`` being rows ``j·B/k .. (j+1)·B/k``, each
      laid out as the plan wants the leaf;
    * ``init()``: the zero accumulators, per output of the compute part; a deferred row
      sum (``is_partial``) as per-device partial sums ``[n, ...]`` split over the data
      axes;
    * ``accumulate(params, micro_batch, acc)``: ``acc`` plus the compute part on one
      micro-batch (its leaves as ``split`` gives them, in order); :meth:`accumulate_each`
      the same over micro-batches stacked on a leading axis, in one ``lax.scan``;
    * ``finish(acc, keep)``: the partial sums reduced across devices (the step's one
      gradient synchronisation), each as the plan wants the gradient; only those
      ``keep`` marks (default: all), e.g. ``grad_used``, those the apply part reads;
    * ``apply(leaves, grads)``: the apply part on the step's inputs and the averaged sums;
    * ``carried(acc)`` / ``uncarried(carry)``: the accumulators as one program passes them
      to the next, each partial sum in its gradient's shape (``_carry``), and back.
    """

    k: int
    is_batch: tuple[bool, ...]
    is_partial: tuple[bool, ...]
    grad_shardings: tuple[Any, ...]  # per marker output, the plan's (or None)
    grad_used: tuple[bool, ...]  # per marker output, whether the apply part reads it
    read: Any
    split: Any
    init: Any
    accumulate: Any
    finish: Any
    apply: Any
    carried: Any
    uncarried: Any

    def params(self, read) -> list:
        return [x for x, b in zip(read, self.is_batch, strict=True) if not b]

    def accumulate_each(self, params, stacked, acc) -> list:
        def body(acc, micro_batch):
            return self.accumulate(params, micro_batch, acc), None

        return jax.lax.scan(body, acc, stacked)[0]


def micro_batched_parts(
    traced: StepJaxpr,
    plan: ShardingPlan,
    mesh,
    k: int,
    pins: Pins,
    grad_shardings=None,
) -> MicroBatchedParts:
    closed = traced.closed_jaxpr
    split = split_at_grad_marker(traced)
    jaxpr = closed.jaxpr
    is_batch = traced.batch_invars
    data_axes = tuple(plan.data_axes) if mesh.size > 1 else ()
    var_specs, by_dim = plan.var_specs, packs_by_dimension(plan)
    var_shardings, operand_shardings = pins.constraints, pins.operand_constraints
    if grad_shardings is not None and mesh.size > 1:
        var_shardings, var_specs = _pin_gradients(split, var_shardings, var_specs, grad_shardings)
        pins = pins.with_constraints(var_shardings)

    # The apply part starts from the step's inputs as they arrive: constraints on them
    # (ZeRO-3 gathers parameters before use) belong to the compute part only.
    step_inputs = set(jaxpr.invars)
    apply_shardings = {v: s for v, s in var_shardings.items() if v not in step_inputs}

    deferred, overrides, num_data = _deferred_sums(traced, plan, pins, split, data_axes, var_specs)
    is_partial = tuple(isinstance(v, Var) and v in deferred for v in split.compute.outvars)
    # A random draw of the batch's shape takes micro-batch j's rows of the full batch's
    # draw (tracing/batch_draws.py); the row ids are one more batch leaf, stacked like the
    # batch.
    compute, loop_is_batch, draws = split.compute, is_batch, micro_batch_draws(traced)
    if draws:
        compute = with_row_ids(compute, draws, k * batch_size(traced))
        loop_is_batch = (*is_batch, True)
        first = is_batch.index(True)
    gathered = _gathering(traced, plan, mesh)

    def spec_of(i, v):
        return plan.var_specs.get(v, plan.in_specs[i])

    def grad_spec(v):
        sharding = var_shardings.get(v)
        return None if sharding is None else sharding.spec

    def read(leaves):
        read = gathered.inputs(leaves)
        return [
            x if b else pinned(x, var_shardings.get(v))
            for x, v, b in zip(read, jaxpr.invars, is_batch, strict=True)
        ]

    def split_batch(read):
        stacked = [
            stack_micro_batches(x, k, mesh, spec_of(i, v))
            for i, (x, v, b) in enumerate(zip(read, jaxpr.invars, is_batch, strict=True))
            if b
        ]
        if draws:
            rows = jnp.arange(k * batch_size(traced), dtype=jnp.int32)
            rows_spec = PartitionSpec(*tuple(spec_of(first, jaxpr.invars[first]))[:1])
            stacked.append(stack_micro_batches(rows, k, mesh, rows_spec))
        return stacked

    def init():
        # Each accumulator split as its gradient is over the mesh's other axes, so that
        # adding a micro-batch's gradient to it moves nothing.
        def zeros(v, g, p):
            spec = grad_spec(g)
            if not p:
                zeros = jnp.zeros(v.aval.shape, v.aval.dtype)
                return zeros if spec is None else pinned(zeros, NamedSharding(mesh, spec))
            stacked = jnp.zeros((num_data,) + v.aval.shape, v.aval.dtype)
            return pinned(stacked, NamedSharding(mesh, partial_spec(spec, data_axes)))

        outs = zip(split.compute.outvars, split.marker_outvars, is_partial, strict=True)
        return [zeros(v, g, p) for v, g, p in outs]

    def carried(acc):
        return [
            _carry(x, grad_spec(g), mesh, data_axes) if p else x
            for x, g, p in zip(acc, split.marker_outvars, is_partial, strict=True)
        ]

    def uncarried(carry):
        return [
            _uncarry(x, grad_spec(g), mesh, data_axes) if p else x
            for x, g, p in zip(carry, split.marker_outvars, is_partial, strict=True)
        ]

    def accumulate(params, micro_batch, acc):
        mb_it, p_it = iter(micro_batch), iter(params)
        args = [next(mb_it) if b else next(p_it) for b in loop_is_batch]
        outs = eval_jaxpr_with_constraints(
            compute, closed.consts, args, var_shardings, operand_shardings, overrides
        )
        return [a + o for a, o in zip(acc, outs, strict=True)]

    def finish(acc, keep=None):
        kept = [i for i, k in enumerate(keep or (True,) * len(acc)) if k]
        specs = [grad_spec(split.marker_outvars[i]) for i in kept]
        values, partial = [acc[i] for i in kept], [is_partial[i] for i in kept]
        return reduce_partials(values, partial, specs, mesh, data_axes, None, by_dim)

    def apply(leaves, grads):
        outs = eval_jaxpr_with_constraints(
            split.apply,
            closed.consts,
            list(leaves) + [None if g is None else _average(g, k) for g in grads],
            apply_shardings,
            operand_shardings,
        )
        return gathered.outputs(outs)

    grad_shardings = tuple(var_shardings.get(v) for v in split.marker_outvars)
    reads = read_vars(split.apply.eqns, split.apply.outvars)
    grad_used = tuple(v in reads for v in split.marker_outvars)
    return MicroBatchedParts(
        k, tuple(is_batch), is_partial, grad_shardings, grad_used, read, split_batch, init,
        accumulate, finish, apply, carried, uncarried,
    )  # fmt: skip


def _pin_gradients(split: GradSplit, var_shardings, var_specs, grad_shardings):
    """``(var_shardings, var_specs)`` with each gradient the plan does not pin, and the
    value of the compute part it is accumulated from, pinned to ``grad_shardings``."""
    var_shardings, var_specs = dict(var_shardings), dict(var_specs)
    inputs = set(split.compute.invars)
    pairs = zip(split.marker_outvars, split.compute.outvars, grad_shardings, strict=True)
    for g, v, sharding in pairs:
        if sharding is None or g in var_shardings:
            continue
        var_shardings[g] = sharding
        if isinstance(v, Var) and v not in var_shardings and v not in inputs:
            var_shardings[v], var_specs[v] = sharding, sharding.spec
    return var_shardings, var_specs


def _deferred_sums(traced, plan, pins: Pins, split: GradSplit, data_axes, var_specs):
    """``(deferred, overrides, num_data)``: row sums that reach the marker through linear
    operations are kept per device and reduced once per step (micro_batches.py), by these
    overrides of the compute part (on ``pins.mesh``); the rest of it is the serial program
    under the plan's constraints."""
    mesh = pins.mesh
    deferred, overrides, num_data = set(), {}, 1
    if data_axes:
        num_data = int(np.prod([mesh.shape[a] for a in data_axes]))
        dims = batch_dims(traced, num_data)
        if dims is not None:
            _check_batch_free(traced, split, dims)
            deferred = deferrable(split.compute, dims)
            overrides = deferred_rules(
                split.compute.eqns, dims, deferred, mesh, data_axes, var_specs
            )
    if mesh.size > 1:
        overrides |= pins.overrides(split.compute, skip=overrides)
        overrides |= _reduce_scatters(traced, split.compute, plan, var_specs, mesh, overrides)
    return deferred, overrides, num_data


def _reduce_scatters(traced, jaxpr, plan: ShardingPlan, var_specs, mesh, overrides) -> dict:
    """The plan's reduce-scatters in ``jaxpr`` (the step's or a part of it) written out
    (``reduce_scatters.py``), where no other override computes the equation; the step's
    inputs are held as ``plan.in_specs``."""
    in_specs = dict(zip(traced.jaxpr.invars, plan.in_specs, strict=True))
    return reduce_scatter_overrides(
        jaxpr, var_specs, plan.operand_specs, in_specs, mesh, skip=set(overrides)
    )


def _carry(x, spec, mesh, data_axes):
    """Per-device partial sums ``[n, ...]`` (split over ``data_axes`` on dim 0) as one
    value of the gradient's shape whose buffer on each device is that device's partial sum:
    split over the other axes as ``spec`` splits them, and declared whole over the data
    axes, although its buffers there differ until :func:`_uncarry` and the reduction. No
    data moves. Alpa's accumulated gradients between its accumulate programs were such
    values; only the micro-batched programs pass them, from one to the next."""
    data = spec_entry(tuple(data_axes))
    local = jax.shard_map(
        lambda p: p[0],
        mesh=mesh,
        in_specs=PartitionSpec(data),
        out_specs=PartitionSpec(),
        axis_names=set(data_axes),
        check_vma=False,
    )(x)
    return pinned(local, NamedSharding(mesh, PartitionSpec(*partial_spec(spec, data_axes)[1:])))


def _uncarry(x, spec, mesh, data_axes):
    """The inverse of :func:`_carry`: each device's buffer as its slice of ``[n, ...]``."""
    data = spec_entry(tuple(data_axes))
    stacked = jax.shard_map(
        lambda a: a[None],
        mesh=mesh,
        in_specs=PartitionSpec(),
        out_specs=PartitionSpec(data),
        axis_names=set(data_axes),
        check_vma=False,
    )(x)
    return pinned(stacked, NamedSharding(mesh, partial_spec(spec, data_axes)))


def _check_batch_free(traced: StepJaxpr, split: GradSplit, dims: dict) -> None:
    for v_in, v_out in zip(split.compute.outvars, split.marker_outvars, strict=True):
        if isinstance(v_in, Var) and dims.get(v_in, ()) != ():
            raise ValueError(
                f"{traced.name}: alpa.grad returns a value of shape {v_out.aval.shape} "
                "that changes with the batch size; only gradients, losses and other "
                "batch-size-independent values can be accumulated over micro-batches"
            )
