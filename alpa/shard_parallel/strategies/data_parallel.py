"""Fixed plans: data parallelism and ZeRO stages 2 and 3 (``docs/shard_parallel.md``).

All three split the batch (dim 0 of every batch leaf) over all devices, on mesh axis
``x`` of an ``(n, 1)`` logical mesh, and differ in what else is split:

=========  ===========  ===============  =====================================
method     parameters   optimizer state  gradients
=========  ===========  ===============  =====================================
DP         replicated   replicated       all-reduced, replicated
ZeRO-2     replicated   sharded (1/n)    reduced then sharded like the state
ZeRO-3     sharded      sharded (1/n)    reduced then sharded; parameters are
                                         gathered before use
=========  ===========  ===============  =====================================

A batch leaf that has no row per example (:func:`batch_rows`: a PRNG key among the
batch's arrays) is replicated. A leaf is optimizer state when its path holds
``opt_state`` (flax ``TrainState``, or any pytree that follows that name). A leaf is
sharded along its first dimension that ``n`` divides; leaves with none (scalars such as
Adam's step count) stay replicated.

ZeRO-2 leaves a gradient whose optimizer state is *factored* whole
(:func:`factored_gradients`): where the update computes, from that gradient, state of
another shape than the gradient's (Adafactor's row and column statistics of a matrix).
Such state is already small (``n + m`` for an ``n x m`` parameter), and an update from a
slice of the gradient's rows would need the column statistics of every device: one
all-reduce and one all-gather per parameter, chained behind each other. The gradient is
all-reduced instead (packed with the others), and its state and update stay whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from jax.extend.core import Var
from jax.sharding import PartitionSpec

from alpa.device_mesh import MESH_AXIS_NAMES, LogicalDeviceMesh
from alpa.shard_parallel.sharding_plan import REPLICATED, ShardingPlan
from alpa.tracing import StepJaxpr
from alpa.tracing.jaxpr_util import grad_marker_index

DATA_AXIS = "x"


def zero_spec(
    shape: tuple[int, ...], num_devices: int, axes=DATA_AXIS, first_only: bool = False
) -> PartitionSpec:
    """Shard the first dimension that ``num_devices`` divides over mesh axis (or axes)
    ``axes``; else replicate. ``first_only``: dimension 0 or none (ZeRO-2's gradients and
    optimizer state, as Alpa's reduce-scatter rewrite split them)."""
    for dim, size in enumerate(shape[:1] if first_only else shape):
        if size % num_devices == 0 and size >= num_devices:
            return PartitionSpec(*([None] * dim + [axes]))
    return REPLICATED


def is_opt_state(name: str) -> bool:
    return "opt_state" in name


def data_parallel_plan(
    traced: StepJaxpr,
    logical_mesh: LogicalDeviceMesh,
    zero_stage: int = 0,
    method: str = "data parallel",
    gather_bound: int = 1 << 25,
) -> ShardingPlan:
    """Data parallelism's plan (the batch over every device), ZeRO-2's or ZeRO-3's.
    ``gather_bound``: ZeRO-3's bound on each packed all-gather of parameters
    (``ShardingPlan.gather_bound``)."""
    if zero_stage not in (0, 2, 3):
        raise ValueError(f"zero_stage must be 0, 2 or 3, got {zero_stage!r}")
    mesh = replace(logical_mesh, shape=(logical_mesh.num_devices, 1), axis_names=MESH_AXIS_NAMES)
    n = mesh.num_devices

    factored = factored_gradients(traced) if zero_stage == 2 else Factored()

    def state_spec(name: str, shape, v=None) -> PartitionSpec:
        if isinstance(v, Var) and v in factored.state:
            return REPLICATED
        sharded = (zero_stage == 3) or (zero_stage == 2 and is_opt_state(name))
        return zero_spec(shape, n, first_only=zero_stage == 2) if sharded else REPLICATED

    rows = batch_rows(traced)
    in_specs = []
    for v, aval, is_batch, name in zip(
        traced.jaxpr.invars, traced.in_avals, traced.batch_invars, traced.leaf_names, strict=True
    ):
        if not is_batch:
            in_specs.append(state_spec(name, aval.shape, v))
            continue
        if aval.ndim == 0 or aval.shape[0] != rows:  # no row per example: a PRNG key
            in_specs.append(REPLICATED)
            continue
        if rows % n:
            raise ValueError(
                f"{method}: {name} has batch size {rows}, which does not split over the {n} "
                f"devices (dim 0 of every batch argument must be divisible by {n}; with "
                "num_micro_batches, the micro-batch size must be)"
            )
        in_specs.append(PartitionSpec(DATA_AXIS))

    out_names = traced.output_names()
    out_specs = tuple(
        state_spec(name, v.aval.shape, v)
        for name, v in zip(out_names, traced.jaxpr.outvars, strict=True)
    )
    var_specs = {}
    if zero_stage == 3:  # gather parameters before use; the optimizer updates shards
        var_specs = {
            v: REPLICATED
            for v, spec, b, name in zip(
                traced.jaxpr.invars, in_specs, traced.batch_invars, traced.leaf_names, strict=True
            )
            if not b and spec != REPLICATED and not is_opt_state(name)
        }
    grad_specs = None
    marker = traced.grad_marker()
    if zero_stage and marker is not None:
        grad_specs = tuple(
            REPLICATED
            if i in factored.gradients
            else zero_spec(v.aval.shape, n, first_only=zero_stage == 2)
            for i, v in enumerate(marker.outvars)
        )
    if zero_stage == 2:
        var_specs = updated_on_shards(traced, n, out_names, out_specs, factored.updated)
    return ShardingPlan(
        logical_mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=out_specs,
        var_specs=var_specs,
        data_axes=(DATA_AXIS,),
        grad_specs=grad_specs,
        gather_bound=gather_bound if zero_stage == 3 else None,
        method=method,
    )


def updated_on_shards(
    traced: StepJaxpr, n: int, out_names: list[str], out_specs, whole=frozenset()
) -> dict[Var, PartitionSpec]:
    """ZeRO-2's outputs computed on each device's shard and returned whole: those the
    step returns replicated (parameters, not optimizer state) that it computes from the
    gradients (after the ``alpa.grad`` marker), each pinned split like its gradient, but
    those in ``whole`` (computed from a factored gradient, :func:`factored_gradients`).
    The lowering all-gathers them together (``gradient_sync.packed_gathers``)."""
    marker = traced.grad_marker()
    if marker is None:
        return {}
    jaxpr = traced.jaxpr
    downstream = set(marker.outvars)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, Var) and v in downstream for v in eqn.invars):
            downstream.update(eqn.outvars)
    pins = {}
    for v, name, spec in zip(jaxpr.outvars, out_names, out_specs, strict=True):
        if not isinstance(v, Var) or v not in downstream or spec != REPLICATED or v in whole:
            continue
        if is_opt_state(name):
            continue
        split = zero_spec(v.aval.shape, n, first_only=True)
        if split != REPLICATED:
            pins[v] = split
    return pins


@dataclass(frozen=True)
class Factored:
    """What ZeRO-2 keeps whole for its factored gradients (:func:`factored_gradients`):
    the gradients (indices into the marker's values), the optimizer state they update
    (the step's input and output variables) and the other outputs computed from them
    (the updated parameters)."""

    gradients: frozenset[int] = frozenset()
    state: frozenset[Var] = frozenset()
    updated: frozenset[Var] = frozenset()


def factored_gradients(traced: StepJaxpr) -> Factored:
    """The gradients at the ``alpa.grad`` marker whose optimizer state is factored: from
    which, through values of more than one element, the step computes an optimizer-state
    output of another shape than the gradient's (module docstring). Scalars carry no
    row of a gradient (a global norm, a step count), so flow through them is not followed.
    An equation is read as a whole: each output may come from each input."""
    marker = traced.grad_marker()
    if marker is None:
        return Factored()
    jaxpr = traced.jaxpr
    names = traced.output_names()
    # Per value: the gradients and the optimizer-state inputs it is computed from.
    from_grads: dict[Var, frozenset[int]] = {
        v: frozenset({i}) for i, v in enumerate(marker.outvars) if _carries(v)
    }
    from_state: dict[Var, frozenset[Var]] = {
        v: frozenset({v})
        for v, name in zip(jaxpr.invars, traced.leaf_names, strict=True)
        if is_opt_state(name) and _carries(v)
    }
    for eqn in jaxpr.eqns[grad_marker_index(jaxpr.eqns) + 1 :]:
        ins = [v for v in eqn.invars if isinstance(v, Var) and _carries(v)]
        g = frozenset().union(*(from_grads.get(v, ()) for v in ins))
        s_ = frozenset().union(*(from_state.get(v, ()) for v in ins))
        for out in eqn.outvars:
            if _carries(out):
                if g:
                    from_grads[out] = g
                if s_:
                    from_state[out] = s_
    factored = set()
    state_outs = [
        v for v, name in zip(jaxpr.outvars, names, strict=True)
        if isinstance(v, Var) and is_opt_state(name) and _carries(v)
    ]  # fmt: skip
    for v in state_outs:
        for i in from_grads.get(v, ()):
            if v.aval.shape != marker.outvars[i].aval.shape:
                factored.add(i)
    if not factored:
        return Factored()
    whole_state, updated = set(), set()
    for v, name in zip(jaxpr.outvars, names, strict=True):
        if isinstance(v, Var) and from_grads.get(v, frozenset()) & factored:
            if is_opt_state(name):
                whole_state.add(v)
                whole_state.update(from_state.get(v, ()))
            else:
                updated.add(v)
    return Factored(frozenset(factored), frozenset(whole_state), frozenset(updated))


def _carries(v) -> bool:
    """Whether ``v`` is a value of more than one element (:func:`factored_gradients`)."""
    return isinstance(v, Var) and getattr(v.aval, "size", 1) > 1


def batch_rows(traced: StepJaxpr) -> int | None:
    """The batch size: the most common dim 0 of the batch leaves (the largest on a tie). A
    batch leaf with another dim 0, or a scalar, holds no row per example (a PRNG
    key, a step number in the batch dict): the fixed plans replicate it, as Alpa's did."""
    pairs = zip(traced.in_avals, traced.batch_invars, strict=True)
    return most_common_rows([aval.shape[0] for aval, is_batch in pairs if is_batch and aval.ndim])


def most_common_rows(sizes: Sequence[int]) -> int | None:
    """The most common of the batch leaves' dim 0 ``sizes`` (the largest on a tie): the
    batch size."""
    return max(sizes, key=lambda size: (sizes.count(size), size)) if sizes else None


def rows_per_example(dims: Sequence[int | None]) -> list[bool]:
    """Per leaf (its dim 0 if it is a batch leaf with one, else ``None``), whether it
    holds a row per example: its dim 0 is the batch's size (:func:`most_common_rows`).
    A batch leaf with another dim 0 (a PRNG key's data) or a scalar does not."""
    rows = most_common_rows([d for d in dims if d is not None])
    return [d is not None and d == rows for d in dims]
