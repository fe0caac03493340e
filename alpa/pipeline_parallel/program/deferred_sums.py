"""Gradients of every stage reduced once per step, in apply-grad.

A stage runs its forward and backward computations once per micro-batch with the
micro-batch split over its *data axes*: every axis of its submesh for a data-parallel
stage (``force_data_parallel=True``, or a one-device submesh), the logical mesh axes the
ILP splits the batch over for a stage the ILP plans (``stage_data_axes``; none for a purely
model-parallel stage, which has no gradient reduction at all, and for a stage with
auto-sharding off, which XLA partitions: ``propagated_stages``). Left to XLA's partitioner,
every gradient (a sum over the micro-batch's rows) would be all-reduced over those axes
inside the backward, once per micro-batch. As on one mesh
(``shard_parallel/gradients/micro_batches.py``), such a row sum is *deferred* instead:

* **backward**: each device computes the sum over its own rows and keeps it as one slice
  of a value with a new leading axis of size ``n`` (the devices along the data axes), split
  over them: no communication. The value's own dimensions keep the split the stage's plan
  gives them over the other axes (a column-parallel kernel's gradient stays split over the
  model axis). Linear operations between the row sum and the ``alpa.grad`` marker apply
  slice by slice.
* **accumulation**: the running sum of a deferred gradient is such an ``[n, ...]`` buffer
  (a value of its own, :attr:`DeferredSums.partials`), donated and updated in the backward
  like every accumulator.
* **apply-grad**: the first apply computation that reads the gradient sums the slices
  (``packed_collectives.reduce_partials``): one all-reduce per gradient per step, or, with
  ``prefer_reduce_scatter=True``, a reduce-scatter into the gradient's ZeRO-2 sharding
  (:func:`zero2_specs`), the stage's packed into one, after which the optimizer
  updates ``1/n`` of each parameter and the updated parameters are all-gathered once,
  packed too.
  When a later apply computation reads the gradient too (a global-norm clip reads it at
  two levels), the first one also writes the reduced value for it.

Only gradients whose every reader is an apply computation on their own stage are
deferred (a gradient the step returns, or that another stage reads, is reduced where it
is computed). Which dimensions hold the batch's rows is read off a trace at the
micro-batch size divided by the data axes' devices (``micro_batches.batch_dims``); where it
differs in structure, or the micro-batch does not split over those devices, nothing is
deferred and the stage keeps its per-micro-batch all-reduces.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from jax.extend.core import Var
from jax.sharding import PartitionSpec

from alpa.device_mesh import entry_names
from alpa.jax_internals import ShapedArray
from alpa.pipeline_parallel.program.computation import PipelineProgram, StageComputation
from alpa.shard_parallel.gradients.micro_batches import batch_dims_for, leaves_with_rows
from alpa.shard_parallel.gradients.row_sums import deferrable, partial_spec
from alpa.shard_parallel.strategies.data_parallel import is_opt_state, zero_spec
from alpa.tracing import TracedStep, new_jaxpr
from alpa.tracing.jaxpr_util import is_var, nested_eqns

if TYPE_CHECKING:
    from alpa.pipeline_parallel.program.stage_sharding import StagePins


@dataclass(frozen=True, eq=False)
class DeferredSums:
    """Which values of a program are carried as per-device partial sums.

    Attributes:
      values: the values of forward and backward computations computed as ``[n, ...]``
        partial sums (``n``: devices of their stage's submesh).
      row_dims: the batch dimensions of values (``micro_batches.batch_dims``), read by the
        row sums that start them.
      partials: ``alpa.grad`` marker output -> its accumulator of partial sums, a value of
        shape ``[n, *shape]`` that the backward updates and apply-grad reduces.
      stage_axes: per stage with deferred sums, its data axes (the logical mesh axes the
        ``n`` slices are split over).
      partial_specs: accumulator -> its ``PartitionSpec``: ``n`` over the data axes, the
        gradient's own dimensions as the stage's plan splits them over the other axes.
    """

    values: frozenset[Var]
    row_dims: dict
    partials: dict[Var, Var]
    stage_axes: dict[int, tuple[str, ...]]
    partial_specs: dict[Var, PartitionSpec]

    @functools.cached_property
    def accumulators(self) -> frozenset[Var]:
        """The accumulators of partial sums (the values of ``partials``)."""
        return frozenset(self.partials.values())


def stage_data_axes(
    traced: TracedStep,
    program: PipelineProgram,
    stage_pins: Sequence[StagePins],
    mesh_shapes: Sequence[Sequence[int]],
    data_parallel: Sequence[bool],
    axis_names: tuple[str, ...],
) -> list[tuple[str, ...]]:
    """Per stage, the logical mesh axes its micro-batch is split over.

    A data-parallel stage: every axis (when it has more than one device). A stage the
    ILP plans: the axes that split dimension 0 of the first batch value its forward
    reads (a batch argument of the step first, else an activation from the stage
    before), as the stage's record says; none when the plan splits no batch value's
    rows (pure model parallelism)."""
    batch_args = {
        v for v, b in zip(traced.closed_jaxpr.jaxpr.invars, traced.batch_invars, strict=True) if b
    }
    with_rows = leaves_with_rows(traced)  # not a PRNG key in the batch
    micro = [a.shape[0] for a, r in zip(traced.in_avals, with_rows, strict=True) if r]
    out = []
    for s, (shape, dp) in enumerate(zip(mesh_shapes, data_parallel, strict=True)):
        sizes = dict(zip(axis_names, shape, strict=True))
        if dp:
            out.append(tuple(axis_names) if np.prod(shape) > 1 else ())
            continue
        forward = program.computation(s, "forward")
        reads = [] if forward is None else [v for v in forward.invars if is_var(v)]
        candidates = [v for v in reads if v in batch_args]
        candidates += [v for v in reads if v not in batch_args and v in program.batch_dependent]
        axes: tuple[str, ...] = ()
        for v in candidates:
            spec = stage_pins[s].var_specs.get(v)
            if not v.aval.shape or v.aval.shape[0] not in micro or not spec or not spec[0]:
                continue
            first = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
            axes = tuple(a for a in first if sizes[a] > 1)
            break
        out.append(axes)
    return out


def defer_gradient_sums(
    program: PipelineProgram,
    traced: TracedStep,
    mesh_sizes: Sequence[int],
    data_axes: Sequence[tuple[str, ...]],
    axis_sizes: Sequence[dict[str, int]] | None = None,
    stage_pins: Sequence[StagePins] | None = None,
    planned: Sequence[bool] | None = None,
) -> DeferredSums | None:
    """The deferred sums of ``program`` (module docstring): in stage ``s`` when its
    ``data_axes[s]`` (:func:`stage_data_axes`) hold more than one device
    (``axis_sizes[s]``: the logical mesh's size per axis; default, the data axes span the
    ``mesh_sizes[s]`` devices). ``stage_pins[s]`` (stage ``s``'s record) gives each
    accumulator the split of its gradient over the other axes. ``None`` when nothing is
    deferred.

    In a stage the ILP plans (``planned[s]``), a gradient its plan splits over a data
    axis (its parameter is split there, as ZeRO-3 splits it) is not deferred: its
    partial sums would be whole over that axis, ``n`` times the gradient's share on
    every device (the gradient sums of 2 layers of a 39B GPT on logical (1, 8), weights
    and batch split over the 8: 18 GiB per device instead of 2.25). The backward
    reduce-scatters it per micro-batch into its split instead, and it is accumulated
    there, as ZeRO-3 does; the stage cost model prices it so (``stage_cost._ilp_layer``)."""
    if not program.is_training:
        return None

    def spec_of(v, s: int) -> PartitionSpec | None:
        return None if stage_pins is None else stage_pins[s].var_specs.get(v)

    def num_data(s: int) -> int:
        if not data_axes[s]:
            return 1
        if axis_sizes is None:
            return mesh_sizes[s]
        return int(np.prod([axis_sizes[s][a] for a in data_axes[s]]))

    jaxpr = program.closed_jaxpr.jaxpr
    step_outputs = {v for v in jaxpr.outvars if is_var(v)}
    readers: dict[Var, list[StageComputation]] = {}
    for comp in program.computations:
        for v in comp.invars:
            readers.setdefault(v, []).append(comp)
    # The batch leaves with a row per example (a PRNG key in the batch has none).
    batch_sizes = [
        a.shape[0] for a, r in zip(traced.in_avals, leaves_with_rows(traced), strict=True) if r
    ]
    # Every count's batch dimensions, read off as few retraces as possible when first
    # needed (a step with nothing to defer is not retraced).
    counts = [
        num_data(c.stage)
        for c in program.computations
        if c.kind != "apply" and c.eqns and batch_sizes
        and not any(b % num_data(c.stage) for b in batch_sizes)
    ]  # fmt: skip
    dims_of: dict[int, dict | None] | None = None
    values: set[Var] = set()
    row_dims: dict = {}
    partials: dict[Var, Var] = {}
    stage_axes: dict[int, tuple[str, ...]] = {}
    partial_specs: dict[Var, PartitionSpec] = {}
    for comp in program.computations:
        s, n = comp.stage, num_data(comp.stage)
        if comp.kind == "apply" or not comp.eqns or n == 1:
            continue
        if not batch_sizes or any(b % n for b in batch_sizes):
            continue
        # Marker outputs whose gradient this computation makes and that only apply-grad
        # computations of this stage read.
        marked = {
            operand: out
            for out, operand in program.accumulated.items()
            if operand in comp.outvars
            and out not in step_outputs
            and readers.get(out)
            and all(r.kind == "apply" and r.stage == s for r in readers[out])
            and not readers.get(operand)
            and operand not in step_outputs
        }
        if planned is not None and planned[s]:
            marked = {
                operand: out
                for operand, out in marked.items()
                if not splits_over(spec_of(out, s), data_axes[s])
            }
        if not marked:
            continue
        if dims_of is None:
            dims_of = batch_dims_for(traced, counts)
        dims = dims_of[n]
        if dims is None:
            continue
        body = new_jaxpr(jaxpr, jaxpr.constvars, comp.invars, list(marked), comp.eqns)
        reduced = [v for v in comp.outvars if v not in marked]
        deferred = deferrable(body, dims, reduced=reduced)
        if not deferred & set(marked):
            continue
        values |= deferred
        # The operands of the row sums, those inside bodies too (a checkpoint's).
        row_dims.update(
            (v, dims[v])
            for e in nested_eqns(comp.eqns)
            if e.outvars and e.outvars[0] in deferred
            for v in e.invars
            if isinstance(v, Var) and v in dims
        )
        for operand, out in marked.items():
            if operand in deferred:
                aval = out.aval
                partials[out] = acc = Var(ShapedArray((n, *aval.shape), aval.dtype))
                spec = tuple(partial_spec(spec_of(out, s), data_axes[s]))
                while spec and spec[-1] is None:
                    spec = spec[:-1]
                partial_specs[acc] = PartitionSpec(*spec)
                stage_axes[s] = tuple(data_axes[s])
    if not partials:
        return None
    return DeferredSums(frozenset(values), row_dims, partials, stage_axes, partial_specs)


def splits_over(spec: PartitionSpec | None, axes: Sequence[str]) -> bool:
    """Whether ``spec`` splits a dimension over one of ``axes``."""
    return any(a in axes for entry in spec or () for a in entry_names(entry))


def zero2_specs(
    traced: TracedStep,
    program: PipelineProgram,
    stage_pins: Sequence[StagePins],
    mesh_sizes: Sequence[int],
    zero2: Sequence[bool],
    data_axes: tuple[str, ...],
) -> tuple[StagePins, ...]:
    """``stage_pins`` with ZeRO-2 in each data-parallel stage with ``prefer_reduce_scatter``
    (``zero2[s]``): its optimizer state and the gradients its apply-grad reads split along
    their first dimension that the submesh's device count divides (new records; specs
    already there, the user's pins, are kept). Parameters stay replicated: the apply-grad
    computation updates ``1/n`` of each and all-gathers the result.

    Optimizer state is every step input that only apply-grad computations read (whatever
    its name), and every input whose path holds ``opt_state`` (as for ``Zero2Parallel``)."""
    jaxpr = traced.closed_jaxpr.jaxpr
    split: list[dict] = [{} for _ in stage_pins]
    kinds: dict[Var, set[str]] = {}
    for comp in program.computations:
        for v in comp.invars:
            kinds.setdefault(v, set()).add(comp.kind)
    for v, name in zip(jaxpr.invars, traced.leaf_names, strict=True):
        if not (is_opt_state(name) or kinds.get(v) == {"apply"}):
            continue
        for s in program.input_stages[v]:
            if zero2[s] and mesh_sizes[s] > 1:
                split[s][v] = zero_spec(v.aval.shape, mesh_sizes[s], data_axes)
    # The gradients, and what apply-grad computes from them and the state for another
    # apply computation (a clip's scaled gradients, a moment read at the next level):
    # split too, so that no computation gathers them. The step's outputs are not: a
    # donated one takes its input's spec afterwards (``tie_donated_outputs``: the state
    # split, the parameters replicated), the others stay replicated, as in ``Zero2Parallel``.
    outputs = {v for v in jaxpr.outvars if is_var(v)}
    values = list(program.accumulated)
    values += [v for c in program.computations if c.kind == "apply" for v in c.outvars]
    for v in values:
        if v in outputs:
            continue
        s = program.home[v]
        if zero2[s] and mesh_sizes[s] > 1:
            split[s].setdefault(v, zero_spec(v.aval.shape, mesh_sizes[s], data_axes))
    return tuple(pins.with_defaults(specs) for pins, specs in zip(stage_pins, split, strict=True))
