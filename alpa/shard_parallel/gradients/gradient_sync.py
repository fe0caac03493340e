"""Gradient synchronisation of a data-parallel plan, written out as packed collectives.

A plan that splits the batch over every device (``DataParallel``, ZeRO-2 and ZeRO-3,
the ILP's plan on a 1-D data-parallel mesh) synchronises its replicas three ways:

* **Gradients** are sums over the batch's rows. Each device sums its own rows and the
  per-device sums are reduced once, at the ``alpa.grad`` marker
  (:func:`reduce_at_marker`; the sums are carried there as ``micro_batches`` defers
  them). A gradient the plan wants whole is all-reduced (XLA combines those into one
  tuple all-reduce); the gradients it wants split over the data axes (ZeRO) are
  reduce-scattered, **all in one** ``psum_scatter``
  (``packed_collectives.packed_reduce_scatter``). A scalar reduced at the marker (the
  loss) rides in that reduce-scatter, a copy in each
  device's row, so it needs no all-reduce of its own (as in Alpa's ZeRO-2 programs: one
  collective per step in accumulate-grad).
* **Updated parameters** that ZeRO-2 computes on each device's shard and returns whole
  are all-gathered, all in one ``all_gather`` at the end of the step.
* **Parameters** that ZeRO-3 receives split and reads whole are all-gathered, all in one
  ``all_gather`` at the start of the step (:func:`packed_gathers`).

The same reduction at the marker serves a plan that splits the model over other axes
and asks for it (``ShardingPlan.sync_at_marker``: Alpa's ``prefer_reduce_scatter``
rewrite of a 2-D plan, ``gradient_scatter``): the gradients are then reduced over the
plan's data axes only, and each packed collective works on every device's block, each
value keeping the split of the other axes (:func:`sync_groups`).

The packed collectives themselves are :mod:`packed_collectives`.

**Cost.** Under the alpha-beta model a reduce-scatter and an all-gather of ``B`` bytes
over ``n`` devices cost ``2α + 2β(n-1)/n·B``, an all-reduce of them ``α + 2β(n-1)/n·B``:
ZeRO-2 costs what data parallelism costs, one latency more (:func:`written_sync`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.extend.core import Var
from jax.sharding import PartitionSpec

from alpa.device_mesh import entry_names
from alpa.shard_parallel.gradients.micro_batches import batch_dims
from alpa.shard_parallel.gradients.packed_collectives import (
    minor_scatter_dimension,
    reduce_partials,
    rides,
    without_axes,
)
from alpa.shard_parallel.gradients.param_gathers import gather_schedule
from alpa.shard_parallel.gradients.row_sums import (
    deferrable,
    deferred_rules,
    scatter_dimension,
)
from alpa.shard_parallel.sharding_plan import REPLICATED, ShardingPlan
from alpa.tracing import StepJaxpr, new_jaxpr
from alpa.tracing.jaxpr_util import read_vars

# ----------------------------------------------------------------------------- what is packed


def packs_by_dimension(plan: ShardingPlan) -> bool:
    """Whether the lowering packs the gradients' reduce-scatters and the parameters'
    all-gathers of ``plan`` per tensor dimension they split, as well as per dtype: in
    Alpa's ``prefer_reduce_scatter`` rewrite of a plan that also splits the model
    (``sync_groups``, ``gradient_scatter``), whose collectives XLA's combiners grouped
    by that dimension (a 2-D MLP's column-split kernels scattered on their rows, its
    row-split ones on their columns: two reduce-scatters, two all-gathers). The same
    bytes, one latency more per dimension. A data-parallel plan packs by dtype alone."""
    return bool(plan.sync_groups) and not pure_data_parallel(plan)


def pure_data_parallel(plan: ShardingPlan) -> tuple[str, ...]:
    """The plan's data axes when they hold every device of its mesh (more than one), else
    ``()``: only then do the gradient sums and gathers here stand for the whole plan."""
    mesh = plan.logical_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    data_axes = tuple(plan.data_axes)
    if not data_axes or mesh.num_devices == 1:
        return ()
    if any(size > 1 for a, size in sizes.items() if a not in data_axes):
        return ()
    return data_axes


def sync_groups(plan: ShardingPlan) -> tuple[tuple[str, ...], ...]:
    """The groups of axes over which the lowering reduces the gradients at the
    ``alpa.grad`` marker and packs the gathers: the plan's data axes where they hold every
    device (:func:`pure_data_parallel`), else those the plan asks for (``sync_groups``:
    Alpa's ``prefer_reduce_scatter`` rewrite of a plan that also splits the model)."""
    pure = pure_data_parallel(plan)
    return (pure,) if pure else tuple(tuple(g) for g in plan.sync_groups)


def spec_entries(spec) -> tuple[tuple[str, ...], ...]:
    """The mesh axes of each entry of ``spec`` (``None``: none), trailing empty ones
    dropped, so that specs that split alike compare equal."""
    entries = [entry_names(e) for e in spec or ()]
    while entries and not entries[-1]:
        entries.pop()
    return tuple(entries)


def _gathered_into(split, whole, data_axes) -> bool:
    """Whether a value in spec ``split`` becomes one in ``whole`` by an all-gather over
    ``data_axes`` that ``packed_collectives.packed_all_gather`` writes: ``split`` splits
    one dimension over them (the minor axes of its entry), and is ``whole`` otherwise."""
    if split is None or whole is None or minor_scatter_dimension(split, data_axes) is None:
        return False
    return spec_entries(without_axes(split, data_axes)) == spec_entries(whole)


@dataclass(frozen=True)
class PackedGathers:
    """The all-gathers a data-parallel plan's lowering packs, by position, each as
    ``(spec, axes)``: the spec the value is split in and the axes it is gathered over.
    Step inputs the plan receives split and pins whole (``inputs[i]``: ZeRO-3's
    parameters), step outputs it computes split and returns whole (``outputs[o]``:
    ZeRO-2's updated parameters)."""

    inputs: Mapping[int, tuple[PartitionSpec, tuple[str, ...]]]
    outputs: Mapping[int, tuple[PartitionSpec, tuple[str, ...]]]


def packed_gathers(traced: StepJaxpr, plan: ShardingPlan) -> PackedGathers:
    """The all-gathers ``packed_collectives.gather_packed`` writes out for ``plan`` (empty
    unless the lowering reduces its gradients at the marker, :func:`sync_groups`)."""
    groups = sync_groups(plan)

    def gathered(split, whole):
        return next((g for g in groups if _gathered_into(split, whole, g)), None)

    jaxpr = traced.jaxpr
    inputs = {}
    for i, (v, spec) in enumerate(zip(jaxpr.invars, plan.in_specs, strict=True)):
        group = gathered(spec, plan.var_specs.get(v))
        if group is not None:
            inputs[i] = (spec, group)
    made = {v for e in jaxpr.eqns for v in e.outvars}
    outputs, seen = {}, set()
    for o, (v, spec) in enumerate(zip(jaxpr.outvars, plan.out_specs, strict=True)):
        if not isinstance(v, Var) or v not in made or v in seen:
            continue
        seen.add(v)
        split = plan.var_specs.get(v)
        group = gathered(split, spec)
        if group is not None:
            outputs[o] = (split, group)
    return PackedGathers(inputs, outputs)


# ----------------------------------------------------------------------------- at the marker


@dataclass(frozen=True)
class MarkerDeferral:
    """The row sums of a step carried as per-device partial sums to its ``alpa.grad``
    marker (``deferred``, found by ``row_sums.deferrable`` in ``before``, the step
    without its marker), and the batch dimensions of its values (``dims``)."""

    deferred: frozenset
    dims: Mapping
    before: object


def marker_deferral(
    traced: StepJaxpr, plan: ShardingPlan, data_axes: Sequence[str] | None = None
) -> MarkerDeferral | None:
    """Which gradients :func:`reduce_at_marker` reduces at the marker over ``data_axes``
    (default: the first of :func:`sync_groups`), ``None`` where it reduces none.

    Only row sums that the plan itself reduces over those axes are deferred (it reads
    their batch dimensions split over exactly those axes), and only where the batch is
    split over every device or the plan asks for it (:func:`sync_groups`): elsewhere the
    per-device sums would override the plan's own strategy for them. Where other axes
    split the model, a row sum that the plan also reduces over one of them (it sums a
    dimension split over it: a sequence split over the model axis) is not deferred: its
    partial sums would be all-reduced over that axis whole, at each addend."""
    marker = traced.grad_marker()
    if data_axes is None:
        data_axes = next(iter(sync_groups(plan)), ())
    data_axes = tuple(data_axes)
    if marker is None or not data_axes:
        return None
    sizes = dict(zip(plan.logical_mesh.axis_names, plan.logical_mesh.shape, strict=True))
    dims = batch_dims(traced, int(np.prod([sizes[a] for a in data_axes])))
    if dims is None:
        return None
    jaxpr = traced.jaxpr
    # Every equation but the marker reads values, so a gradient also read past the marker
    # (not through it) is not deferred.
    before = new_jaxpr(
        jaxpr, jaxpr.constvars, jaxpr.invars, marker.invars,
        [e for e in jaxpr.eqns if e is not marker],
    )  # fmt: skip
    read_specs = _read_specs(traced, plan)
    others = {a for a, size in sizes.items() if size > 1 and a not in data_axes}

    def planned_over_data(eqn) -> bool:
        specs = read_specs(eqn)
        for v, spec in zip(eqn.invars, specs, strict=True):
            d = dims.get(v) if isinstance(v, Var) else None
            if not d or spec is None:  # not a batch operand, or left to XLA
                continue
            if entry_names(spec[d[0]] if d[0] < len(spec) else None) != data_axes:
                return False
        return not others or not _sums_over(eqn, specs, others)

    deferred = deferrable(before, dims, keep=planned_over_data)
    return MarkerDeferral(frozenset(deferred), dims, before) if deferred else None


def _read_specs(traced: StepJaxpr, plan: ShardingPlan):
    """``read_specs(eqn)``: per operand of ``eqn``, the spec the plan reads it in (its
    resharding edge's, else the value's pinned spec or the step input's), ``None`` where
    the plan names none."""
    inputs = dict(zip(traced.jaxpr.invars, plan.in_specs, strict=True))

    def read_specs(eqn) -> list:
        needs = plan.operand_specs.get(eqn) or (None,) * len(eqn.invars)
        return [
            need or (plan.var_specs.get(v) or inputs.get(v) if isinstance(v, Var) else None)
            for v, need in zip(eqn.invars, needs, strict=True)
        ]

    return read_specs


def _sums_over(eqn, specs, axes) -> bool:
    """Whether ``eqn``, its operands in ``specs``, sums a dimension split over one of
    ``axes`` (any split dimension, for a row sum other than a contraction or a
    ``reduce_sum``)."""
    name = eqn.primitive.name
    if name == "dot_general":
        (lhs_c, rhs_c), _ = eqn.params["dimension_numbers"]
        summed = [set(lhs_c), set(rhs_c)]
    elif name == "reduce_sum":
        summed = [set(eqn.params["axes"])]
    else:
        summed = None
    for i, spec in enumerate(specs):
        for d, entry in enumerate(spec or ()):
            if set(entry_names(entry)) & axes and (summed is None or d in summed[i]):
                return True
    return False


def reduce_at_marker(traced: StepJaxpr, plan: ShardingPlan, mesh, var_shardings) -> dict:
    """Without micro-batches: the ``overrides`` of ``constrained_eval.eval_jaxpr_with_constraints``
    that reduce the step's gradients once, at the ``alpa.grad`` marker, as the
    micro-batched step does after its loop.

    Each gradient that is a sum over the batch's rows reaching the marker through linear
    operations is kept per device until the marker (:func:`marker_deferral`, for each of
    :func:`sync_groups`), where it is all-reduced, or reduce-scattered into the plan's
    gradient spec when that splits it over its group's axes (ZeRO,
    ``prefer_reduce_scatter``), packed with the others of its group
    (``packed_collectives.reduce_partials``). Two such sums added (the tied input and
    output embedding's gradient) are therefore reduced once, not twice. Empty (the plan's
    constraints alone) where nothing is deferred."""
    groups = deferred_groups(traced, plan)
    if not groups:
        return {}
    marker = traced.grad_marker()
    operand_specs = _read_specs(traced, plan)
    overrides = {}
    for axes, found in groups:
        overrides |= deferred_rules(
            found.before.eqns, found.dims, found.deferred, mesh, axes, plan.var_specs,
            operand_specs if plan.sync_at_marker else None,
        )  # fmt: skip
    shardings = [var_shardings.get(out) for out in marker.outvars]
    specs = [None if s is None else s.spec for s in shardings]
    read = read_marker_outputs(traced)
    members = [
        [i for i, v in enumerate(marker.invars) if isinstance(v, Var) and v in found.deferred]
        for _, found in groups
    ]

    def reduce(operands):
        outs = list(operands)
        for (axes, _), idx in zip(groups, members, strict=True):
            sums = reduce_partials(
                [operands[i] for i in idx], [True] * len(idx), [specs[i] for i in idx],
                mesh, axes, [read[i] for i in idx], packs_by_dimension(plan),
            )  # fmt: skip
            for i, x in zip(idx, sums, strict=True):
                outs[i] = x
        return [
            x if s is None else jax.lax.with_sharding_constraint(x, s)
            for x, s in zip(outs, shardings, strict=True)
        ]

    overrides[marker] = reduce
    return overrides


def deferred_groups(traced: StepJaxpr, plan: ShardingPlan) -> list[tuple[tuple, MarkerDeferral]]:
    """Per group of :func:`sync_groups` that defers something, ``(axes, deferral)``. The
    groups' deferred values must be disjoint: a value carried as partial sums over two
    groups at once has no one layout (``gradient_scatter`` plans only disjoint ones)."""
    groups = []
    for axes in sync_groups(plan):
        found = marker_deferral(traced, plan, axes)
        if found is None:
            continue
        for other, seen in groups:
            if found.deferred & seen.deferred:
                raise ValueError(
                    f"{plan.method}: gradients reduced at the marker over {axes} and over "
                    f"{other} share {len(found.deferred & seen.deferred)} values"
                )
        groups.append((tuple(axes), found))
    return groups


def read_marker_outputs(traced: StepJaxpr) -> list[bool]:
    """Per output of the ``alpa.grad`` marker, whether the step reads or returns it (an
    unreturned loss is not)."""
    jaxpr, marker = traced.jaxpr, traced.grad_marker()
    read = read_vars([e for e in jaxpr.eqns if e is not marker], jaxpr.outvars)
    return [v in read for v in marker.outvars]


# ----------------------------------------------------------------------------- cost


@dataclass(frozen=True)
class WrittenSync:
    """The packed collectives a fixed data-parallel plan's lowering writes out, in bytes
    of the whole tensors, on the mesh axis ``axis`` of the plan's logical mesh: the
    gradients reduce-scattered and the tensors all-gathered, per dtype (one collective
    each). ``riding``: bytes of the scalars (the loss) that ride whole in the packed
    reduce-scatter instead of an all-reduce of their own; ``scattered`` counts their
    ``n`` copies."""

    axis: int
    scattered: tuple[float, ...]
    gathered: tuple[float, ...]
    riding: float = 0.0
    # ZeRO-3's packs of the backward pass (gathered again), priced where the mesh has
    # measured rates (a step's seconds) and left out of Alpa's objective otherwise.
    backward_gathered: tuple[float, ...] = ()

    def cost_change(self, mesh, all_reduced: float) -> float:
        """Seconds that these collectives add to data parallelism's communication, whose
        plan all-reduces ``all_reduced`` bytes in all (its gradients, combined into one
        collective): the scattered gradients' all-reduce is replaced by their
        reduce-scatter, and the gathers are added. When nothing else is all-reduced,
        the combined all-reduce's latency goes too."""
        n = mesh.shape[self.axis]
        replaced = sum(self.scattered) - (n - 1) * self.riding  # what the all-reduce carried
        all_reduce = mesh.all_reduce_cost(replaced, self.axis)
        if all_reduced > replaced * (1 + 1e-9):  # another all-reduce keeps the latency
            all_reduce -= mesh.all_reduce_cost(0.0, self.axis)
        change = (
            sum(mesh.reduce_scatter_cost(b, self.axis) for b in self.scattered)
            + sum(mesh.all_gather_cost(b, self.axis) for b in self.gathered)
            - (all_reduce if replaced else 0.0)
        )
        if mesh.rates is not None:
            # In seconds of a step: the backward's gathers too, and the copies of packing
            # every tensor into its collective's one buffer and out of it again.
            gathered = (*self.gathered, *self.backward_gathered)
            change += sum(mesh.all_gather_cost(b, self.axis) for b in self.backward_gathered)
            packed = sum(self.scattered) + sum(gathered)
            change += mesh.rates.write_seconds(2 * packed, movement=True)
        return change


def written_sync(traced: StepJaxpr, plan: ShardingPlan) -> WrittenSync | None:
    """What the lowering of ``plan`` packs (module docstring), ``None`` where it packs
    nothing: the gradients it reduce-scatters at the marker and the tensors it
    all-gathers (ZeRO-3's parameters, in the packs of the forward pass:
    ``param_gathers``; ZeRO-2's updated parameters), grouped as packed."""
    data_axes = pure_data_parallel(plan)
    if not data_axes:
        return None
    mesh = plan.logical_mesh
    sized = [
        mesh.axis_names.index(a) for a in data_axes if mesh.shape[mesh.axis_names.index(a)] > 1
    ]
    if len(sized) != 1:
        return None  # the batch over two mesh axes: priced by the ILP alone
    found = marker_deferral(traced, plan)
    scattered, whole = [], []
    if found is not None and plan.grad_specs is not None:
        read = read_marker_outputs(traced)
        for v, spec, r in zip(traced.grad_marker().invars, plan.grad_specs, read, strict=True):
            if isinstance(v, Var) and v in found.deferred:
                split = scatter_dimension(spec, data_axes) is not None
                if split or r:
                    (scattered if split else whole).append(v.aval)
    riding = [a for a in whole if rides(a.ndim, a.dtype, scattered)]
    gathers = packed_gathers(traced, plan)
    if plan.gather_bound is not None and gathers.inputs:
        # ZeRO-3's packs of the forward pass. The backward's gathers again (which trade
        # communication for memory) are not priced: Alpa's objective, the all-reduce
        # plan's, did not count them either.
        schedule = gather_schedule(traced, sorted(gathers.inputs), plan.gather_bound)
        gathered = tuple(schedule.pack_bytes(traced.jaxpr, backward=False))
        forward = len(gathered)
        backward_gathered = tuple(schedule.pack_bytes(traced.jaxpr)[forward:])
    else:
        backward_gathered = ()
        gathered = _bytes_by_dtype([traced.jaxpr.invars[i].aval for i in gathers.inputs])
    gathered += _bytes_by_dtype([traced.jaxpr.outvars[o].aval for o in gathers.outputs])
    if not scattered and not gathered:
        return None
    n = mesh.shape[sized[0]]
    packed = _bytes_by_dtype(scattered + riding * n)
    riding_bytes = sum(_bytes_by_dtype(riding))
    return WrittenSync(sized[0], packed, gathered, riding_bytes, backward_gathered)


def _bytes_by_dtype(avals) -> tuple[float, ...]:
    """Bytes of ``avals``, summed per dtype: one packed collective each."""
    total: dict = {}
    for aval in avals:
        key = np.dtype(aval.dtype)
        total[key] = total.get(key, 0.0) + float(np.prod(aval.shape)) * key.itemsize
    return tuple(total.values())


def data_parallel_in_specs(traced: StepJaxpr, plan: ShardingPlan) -> tuple:
    """``plan``'s input specs with every input but the batch's replicated: data
    parallelism's plan of the same step, which :class:`WrittenSync` prices against."""
    return tuple(
        spec if is_batch else REPLICATED
        for spec, is_batch in zip(plan.in_specs, traced.batch_invars, strict=True)
    )
