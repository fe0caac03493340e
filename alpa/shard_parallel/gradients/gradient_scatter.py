"""``prefer_reduce_scatter`` in Alpa's order: the all-reduce plan, its gradients scattered.

Alpa solved the ILP without reduce-scatter strategies, then rewrote the plan it found:
each gradient all-reduced over the data axes became a reduce-scatter, the optimizer
update ran on each device's shard, and the updated parameters were all-gathered. The
objective it reported was the all-reduce plan's. Here (``auto_sharding.plan_auto_sharding``
solves the all-reduce plan first and hands it to :func:`scattered_in_alpas_order`):

* A plan that reduces no gradient over a data axis (no batch split: Megatron's model
  parallelism) has nothing to rewrite: it is the plan.
* A data-parallel plan (the batch over every device, every other input replicated)
  becomes ZeRO-2's (``data_parallel_plan(zero_stage=2)``).
* Any other plan that splits the batch (over one axis of a 2-D mesh, the model over the
  other) keeps every decision it made before the ``alpa.grad`` marker; each gradient
  that is a row sum over the data axes alone (``gradient_sync.marker_deferral``) is
  carried per device to the marker and reduce-scattered there into its all-reduce spec
  with the data axes added to one dimension (:func:`scattered_spec`), the optimizer
  state is split alike, the update after the marker is left to XLA on those shards, and
  each updated parameter is all-gathered back into its spec. The lowering packs the
  reduce-scatters into one and the all-gathers into one
  (``ShardingPlan.sync_at_marker``, ``gradient_sync``).
* ``None`` where no gradient can be so rewritten (a plan whose inputs the caller fixed,
  gradients that are not row sums deferred to the marker: a convolution's kernel, an
  embedding's scatter-add in a data-parallel step), or where a carried gradient adds a
  value that the plan reduces by itself (:func:`_adds_a_reduced_value`): the ILP then
  solves with its reduce-scatter strategies instead (``solve_auto_sharding``),
  communication against the sharded update's compute.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from jax.extend.core import Var
from jax.sharding import PartitionSpec

from alpa.device_mesh import entry_names, spec_entry
from alpa.shard_parallel.gradients.gradient_sync import (
    marker_deferral,
    pure_data_parallel,
    spec_entries,
)
from alpa.shard_parallel.sharding_plan import ShardingPlan
from alpa.shard_parallel.strategies.data_parallel import data_parallel_plan, is_opt_state
from alpa.tracing import StepJaxpr


def scattered_in_alpas_order(
    traced: StepJaxpr, plan: ShardingPlan, fixed_in_specs=None, one_group: bool = False
) -> ShardingPlan | None:
    """``plan`` (the all-reduce plan, solved communication first) rewritten as Alpa's
    ``prefer_reduce_scatter`` rewrote it (module docstring), ``None`` where it cannot be.
    ``one_group``: reduce-scatter over the plan's data axes only (a step with
    micro-batches: their lowering carries partial sums over one group of axes)."""
    if not plan.data_axes:
        return plan
    if fixed_in_specs is not None or traced.grad_marker() is None:
        return None
    if pure_data_parallel(plan):
        others = [s for s, b in zip(plan.in_specs, traced.batch_invars, strict=True) if not b]
        if all(all(axes is None for axes in spec) for spec in others):
            return _zero2(traced, plan)
    return _scattered(traced, plan, one_group)


def _zero2(traced: StepJaxpr, plan: ShardingPlan) -> ShardingPlan | None:
    """A data-parallel plan as ZeRO-2's, where every gradient ZeRO-2 splits is a row sum
    deferred to the marker (else XLA would all-reduce it, slice the update and gather each
    such parameter on its own)."""
    zero2 = data_parallel_plan(traced, plan.logical_mesh, zero_stage=2)
    marker, found = traced.grad_marker(), marker_deferral(traced, zero2)
    if found is None or zero2.grad_specs is None:
        return None
    scattered = [
        v
        for v, spec in zip(marker.invars, zero2.grad_specs, strict=True)
        if any(axes is not None for axes in spec)
    ]
    if not all(isinstance(v, Var) and v in found.deferred for v in scattered):
        return None
    return replace(
        zero2,
        objective=plan.objective,
        compute_cost=plan.compute_cost,
        method="auto-sharding: data parallel, gradients reduce-scattered (ZeRO-2)",
    )


def scattered_spec(
    spec: PartitionSpec, shape: Sequence[int], sizes: Mapping[str, int], data_axes
) -> PartitionSpec | None:
    """``spec`` (of a value of ``shape``) split further over ``data_axes``: on its first
    dimension that no axis splits and that they divide (a column-split kernel's rows, a
    row-split kernel's columns, as Alpa's rewrite chose); else as the minor axes of the
    first dimension whose block they divide (a split bias). ``None`` where none does, or
    ``spec`` already uses them."""
    data_axes = tuple(data_axes)
    n = math.prod(sizes[a] for a in data_axes)
    entries = [entry_names(e) for e in spec] + [()] * (len(shape) - len(spec))
    if n == 1 or any(a in data_axes for e in entries for a in e):
        return None

    def split(d: int) -> PartitionSpec:
        axes = entries[d] + data_axes
        new = [spec_entry(e) for e in entries]
        new[d] = spec_entry(axes)
        return PartitionSpec(*new)

    for d, size in enumerate(shape):
        if not entries[d] and size % n == 0 and size >= n:
            return split(d)
    for d, size in enumerate(shape):
        block = size // math.prod(sizes[a] for a in entries[d])
        if entries[d] and block % n == 0 and block >= n:
            return split(d)
    return None


def _scattered(traced: StepJaxpr, plan: ShardingPlan, one_group: bool) -> ShardingPlan | None:
    """A plan that splits the batch over some axes and the model over others, its
    gradients reduce-scattered at the marker (module docstring). A gradient is reduced
    over the axes that split its rows: the plan's data axes, or every axis where part of
    the step splits the batch over all of them (the attention of an MoE layer whose
    experts split the other axis)."""
    marker = traced.grad_marker()
    if plan.grad_specs is None:
        return None
    mesh = plan.logical_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    groups = _groups(traced, plan, sizes)[: 1 if one_group else None]
    if not groups:
        return None
    group_of = {}  # marker operand -> the axes its partial sums are reduced over
    for axes, found in groups:
        for v in marker.invars:
            if isinstance(v, Var) and v in found.deferred:
                if _adds_a_reduced_value(v, found, traced):
                    return None
                group_of[v] = axes
    grad_specs, by_layout = list(plan.grad_specs), {}
    for i, (v, spec) in enumerate(zip(marker.invars, plan.grad_specs, strict=True)):
        if v in group_of and spec is not None:
            split = scattered_spec(spec, v.aval.shape, sizes, group_of[v])
            if split is not None:
                grad_specs[i] = split
                by_layout.setdefault(_layout(v.aval, spec), set()).add(group_of[v])
    if grad_specs == list(plan.grad_specs):
        return None

    def scattered(spec, aval):
        """A state value or an updated parameter laid out as a scattered gradient is: split
        alike, over the axes of that gradient's group (none where gradients of that
        layout are reduced over different groups)."""
        found = by_layout.get(_layout(aval, spec)) if spec is not None else None
        if not found or len(found) > 1:
            return None
        return scattered_spec(spec, aval.shape, sizes, next(iter(found)))

    jaxpr = traced.jaxpr
    in_specs = list(plan.in_specs)
    for i, (name, v, b) in enumerate(
        zip(traced.leaf_names, jaxpr.invars, traced.batch_invars, strict=True)
    ):
        if not b and is_opt_state(name):
            in_specs[i] = scattered(in_specs[i], v.aval) or in_specs[i]
    # The update: what is computed from the gradients or the split optimizer state.
    after = set(marker.outvars)
    after.update(v for v, a, b in zip(jaxpr.invars, plan.in_specs, in_specs, strict=True) if a != b)
    update = []
    for eqn in jaxpr.eqns:
        if any(isinstance(v, Var) and v in after for v in eqn.invars):
            after.update(eqn.outvars)
            update.append(eqn)
    out_specs = list(plan.out_specs)
    var_specs = {v: s for v, s in plan.var_specs.items() if v not in after}
    for o, (name, v) in enumerate(zip(traced.output_names(), jaxpr.outvars, strict=True)):
        split = scattered(out_specs[o], v.aval) if isinstance(v, Var) else None
        if split is None:
            continue
        if is_opt_state(name):
            out_specs[o] = split  # returned split, as it arrives
        elif v in after:
            var_specs[v] = split  # an updated parameter: computed split, gathered
    update = set(update)
    used = tuple(axes for axes, _ in groups if axes in group_of.values())
    return replace(
        plan,
        in_specs=tuple(in_specs),
        out_specs=tuple(out_specs),
        var_specs=var_specs,
        operand_specs={e: s for e, s in plan.operand_specs.items() if e not in update},
        partial_sums={e: s for e, s in plan.partial_sums.items() if e not in update},
        grad_specs=tuple(grad_specs),
        sync_groups=used,
        method=f"{plan.method}, gradients reduce-scattered over "
        + "; ".join(", ".join(axes) for axes in used),
    )


def _groups(traced: StepJaxpr, plan: ShardingPlan, sizes) -> list[tuple[tuple, object]]:
    """``(axes, deferral)`` for the plan's data axes and, where they are not all its
    axes, for all of them: the row sums each carries to the marker. A group whose
    deferred values meet an earlier group's is left out (a value has one layout of
    partial sums)."""
    data_axes = tuple(plan.data_axes)
    every = tuple(a for a in plan.logical_mesh.axis_names if sizes[a] > 1)
    candidates = [data_axes] + ([every] if set(data_axes) < set(every) else [])
    groups = []
    for axes in candidates:
        found = marker_deferral(traced, plan, axes)
        if found is not None and not any(found.deferred & f.deferred for _, f in groups):
            groups.append((axes, found))
    return groups


def _layout(aval, spec) -> tuple:
    return tuple(aval.shape), spec_entries(spec)


def _adds_a_reduced_value(v: Var, found, traced: StepJaxpr) -> bool:
    """Whether the deferred gradient ``v`` is made, through the linear operations that
    carry its partial sums, from a value computed from the batch that is not deferred (a
    tied embedding's scatter-add into its table's gradient split over the model axis,
    added to the output projection's gradient). The plan reduces such a value by itself,
    and then the sum again: more than the all-reduce plan's one reduction of the sum."""
    producer = {u: e for e in found.before.eqns for u in e.outvars}
    from_batch = {u for u, b in zip(traced.jaxpr.invars, traced.batch_invars, strict=True) if b}
    for eqn in found.before.eqns:
        if any(isinstance(u, Var) and u in from_batch for u in eqn.invars):
            from_batch.update(eqn.outvars)
    stack, seen = [v], set()
    while stack:
        u = stack.pop()
        eqn = producer.get(u)
        if u in seen or eqn is None:
            continue
        seen.add(u)
        operands = [w for w in eqn.invars if isinstance(w, Var)]
        if not any(w in found.deferred for w in operands):
            continue  # a row sum: its operands are the batch's rows
        for w in operands:
            if w in found.deferred:
                stack.append(w)
            elif w in from_batch:
                return True
    return False
