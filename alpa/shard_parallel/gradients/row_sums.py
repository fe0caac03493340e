"""Row sums carried as per-device partial sums: which, and how they are evaluated.

A gradient is a sum over the rows of the batch (``dot_general`` contracting the batch
dimension, ``reduce_sum`` over it, ``conv_general_dilated`` contracting it, ``scatter-add``
of rows), and a sum over a dimension split over the data axes compiles to an all-reduce.
A row sum whose result reaches the ``alpa.grad`` marker only through linear operations
can instead be *deferred*: each device computes the sum over its own rows inside
``shard_map`` and keeps it as one slice of a value with a new leading axis of size ``n``
(split over the data axes, so no communication), the linear operations apply slice by
slice, and one collective sums the slices where the gradient is needed whole
(:func:`sum_partials`). Since ``Σ_d L(p_d) = L(Σ_d p_d)`` for a linear ``L``, the result
is the serial one.

:func:`deferrable` finds the values that can be carried so, :func:`deferred_rules`
computes them (``constrained_eval.eval_jaxpr_with_constraints``'s overrides). Gradient
accumulation (``micro_batches``), the one-batch step's reduction at the marker
(``gradient_sync``) and the pipeline's stages (``pipeline_parallel/deferred_sums``) use
them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Var
from jax.sharding import NamedSharding, PartitionSpec

from alpa.device_mesh import entry_names, spec_entry
from alpa.jax_internals import is_remat, is_scan, remat_body, scan_parts
from alpa.tracing import jaxpr_util, new_jaxpr
from alpa.tracing.primitive_def import passes_through

# ----------------------------------------------------------------------------- deferral

# Row sums: out = Σ_rows f(row), for the batch dimensions as the rule checks them.


def _one_batch_dim(dims, v) -> int | None:
    d = dims.get(v, None) if isinstance(v, Var) else ()
    return d[0] if d is not None and len(d) == 1 else None


def _reduce_sum_is_row_sum(eqn: JaxprEqn, dims) -> bool:
    d = _one_batch_dim(dims, eqn.invars[0])
    return d is not None and d in eqn.params["axes"]


def _dot_is_row_sum(eqn: JaxprEqn, dims) -> bool:
    (lhs_c, rhs_c), _ = eqn.params["dimension_numbers"]
    a, b = (_one_batch_dim(dims, v) for v in eqn.invars)
    return a is not None and b is not None and (a, b) in zip(lhs_c, rhs_c, strict=True)


def _conv_is_row_sum(eqn: JaxprEqn, dims) -> bool:
    """The kernel gradient of a convolution: the batch is the contracted feature dim."""
    numbers = eqn.params["dimension_numbers"]
    if eqn.params["feature_group_count"] != 1 or eqn.params["batch_group_count"] != 1:
        return False
    a, b = (_one_batch_dim(dims, v) for v in eqn.invars)
    return a == numbers.lhs_spec[1] and b == numbers.rhs_spec[1]


def _scatter_add_is_row_sum(eqn: JaxprEqn, dims) -> bool:
    """Rows of updates added at their rows' indices (an embedding's gradient)."""
    operand, indices, updates = eqn.invars
    row = _one_batch_dim(dims, updates)
    return (
        dims.get(operand, ()) == ()
        and _one_batch_dim(dims, indices) is not None
        and row is not None
        and row not in eqn.params["dimension_numbers"].update_window_dims
    )


_ROW_SUMS: dict[str, Callable[[JaxprEqn, dict], bool]] = {
    "reduce_sum": _reduce_sum_is_row_sum,
    "dot_general": _dot_is_row_sum,
    "conv_general_dilated": _conv_is_row_sum,
    "scatter-add": _scatter_add_is_row_sum,
}

# Linear operations. Additive ones are linear in all their listed operands together (a
# replicated operand is carried by device 0's slice, zeros elsewhere); the others are
# linear in one listed operand while the rest stay replicated.
_ADDITIVE: dict[str, Callable[[int], bool]] = {
    "add": lambda i: True,
    "add_any": lambda i: True,
    "sub": lambda i: True,
    "concatenate": lambda i: True,
    "pad": lambda i: True,
    "select_n": lambda i: i > 0,
    "dynamic_update_slice": lambda i: i < 2,
}
_LINEAR_IN_ONE: dict[str, Callable[[int], bool]] = {
    **{
        name: (lambda i: i == 0)
        for name in (
            "neg",
            "convert_element_type",
            "reshape",
            "transpose",
            "squeeze",
            "broadcast_in_dim",
            "reduce_sum",
            "copy",
            "copy_p",
            "slice",
            "dynamic_slice",
            "rev",
            "cumsum",
            "div",
        )
    },
    "mul": lambda i: True,
    "dot_general": lambda i: True,
}


def _linear_positions(eqn: JaxprEqn) -> Callable[[int], bool] | None:
    name = eqn.primitive.name
    return _ADDITIVE.get(name) or _LINEAR_IN_ONE.get(name)


def _is_float(v) -> bool:
    return jnp.issubdtype(v.aval.dtype, jnp.inexact)


def deferrable(
    compute: Jaxpr,
    dims: dict,
    keep: Callable[[JaxprEqn], bool] | None = None,
    reduced: Collection[Var] = (),
) -> set[Var]:
    """The values of ``compute`` that can be carried as per-device partial sums: each is
    made by a row sum (one that ``keep`` accepts, when given) or by a linear operation of
    such values, is not in ``reduced`` (values something outside ``compute`` reads
    whole), and is read only by the marker (``compute.outvars``) or by linear operations,
    in an operand where they are linear, whose results are deferred too; a multiplication
    or contraction reads at most one of them.

    A row sum may also be made inside a body: a stacked output of a ``scan`` (the weight
    gradients of scanned layers, made by the transposed scan) or an output of a
    checkpoint is made so when the body's value it returns is deferrable in the body
    (the body's other results read whole), and the body's values that make it are then
    deferred too (they are in the set returned). ``dims`` holds the batch dimensions of
    the bodies' values as well (``micro_batches.batch_dims``).

    Found by removing values from all candidates: first those that break the conditions
    that only get harder as values leave the set, until none does; then, where a
    multiplication still reads two deferred values, both; and again."""
    uses: dict[Var, list[tuple[JaxprEqn, int]]] = {}
    for eqn in compute.eqns:
        for i, v in enumerate(eqn.invars):
            if isinstance(v, Var):
                uses.setdefault(v, []).append((eqn, i))
    producer = {v: eqn for eqn in compute.eqns for v in eqn.outvars}
    marked = {v for v in compute.outvars if isinstance(v, Var)}

    def row_sum(eqn: JaxprEqn) -> bool:
        return _is_row_sum(eqn, dims) and (keep is None or keep(eqn))

    bodies = bodies_passing_row_sums(compute.eqns)

    def candidate(eqn: JaxprEqn, v: Var) -> bool:
        if eqn in bodies:
            return eqn.outvars.index(v) >= bodies[eqn][1]
        return passes_through(eqn) or (
            len(eqn.outvars) == 1 and (row_sum(eqn) or _linear_positions(eqn) is not None)
        )

    deferred = {
        v
        for eqn in compute.eqns
        for v in eqn.outvars
        if candidate(eqn, v) and _is_float(v) and dims.get(v) == () and v not in reduced
    }

    def deferred_operands(eqn: JaxprEqn) -> list[Var]:
        return [u for u in eqn.invars if isinstance(u, Var) and u in deferred]

    inside: dict[JaxprEqn, set[Var]] = {}  # per body equation, its body's deferred values
    solved: dict[tuple[JaxprEqn, frozenset[int]], set[Var]] = {}  # by the outputs wanted

    def in_body(eqn: JaxprEqn, body: Jaxpr) -> set[Var]:
        wanted = frozenset(i for i, v in enumerate(eqn.outvars) if v in deferred)
        if (eqn, wanted) not in solved:  # a body is solved again only when wanted shrinks
            solved[eqn, wanted] = _deferrable_in_body(body, wanted, dims, keep)
        return solved[eqn, wanted]

    def holds(v: Var) -> bool:
        eqn = producer[v]
        if eqn in bodies:
            body, _ = bodies[eqn]
            if body.outvars[eqn.outvars.index(v)] not in inside[eqn]:
                return False
        elif passes_through(eqn):
            source = eqn.invars[eqn.outvars.index(v)]
            if not (isinstance(source, Var) and source in deferred):
                return False
        elif not deferred_operands(eqn) and not row_sum(eqn):
            return False
        for user, i in uses.get(v, ()):
            if passes_through(user):
                if user.outvars[i] not in deferred:
                    return False
                continue
            linear = _linear_positions(user)
            if linear is None or not linear(i) or not all(o in deferred for o in user.outvars):
                return False
        return v in marked or bool(uses.get(v))

    while True:
        inside = {
            eqn: in_body(eqn, body)
            for eqn, (body, _) in bodies.items()
            if any(v in deferred for v in eqn.outvars)
        }
        broken = {v for v in deferred if not holds(v)}
        if not broken:
            broken = {
                u
                for eqn in compute.eqns
                if eqn.primitive.name not in _ADDITIVE
                and not passes_through(eqn)
                and len(deferred_operands(eqn)) > 1
                for u in deferred_operands(eqn)
            }
        if not broken:
            return deferred.union(*inside.values())
        deferred -= broken


def bodies_passing_row_sums(eqns) -> dict[JaxprEqn, tuple[Jaxpr, int]]:
    """The equations among ``eqns`` whose outputs from index ``first`` on are their body's
    results of the same index: a ``scan``'s stacked outputs (``first``: its carries'
    count) and a checkpoint's outputs (``first`` 0), as ``eqn -> (body, first)``. A body
    that two equations share (a cached trace) is left out: its values would have to be
    deferred for both or neither."""
    found: dict[JaxprEqn, tuple[Jaxpr, int]] = {}
    for eqn in eqns:
        if is_scan(eqn):
            parts = scan_parts(eqn)
            found[eqn] = (parts.jaxpr, parts.num_carry)
        elif is_remat(eqn):
            found[eqn] = (remat_body(eqn), 0)
    count: dict[int, int] = {}
    for body, _ in found.values():
        count[id(body)] = count.get(id(body), 0) + 1
    return {eqn: bf for eqn, bf in found.items() if count[id(bf[0])] == 1}


def _deferrable_in_body(body: Jaxpr, wanted: frozenset[int], dims, keep) -> set[Var]:
    """The values of ``body`` deferred so that it returns partial sums for its results at
    positions ``wanted``; its other results are read whole."""
    results = [v for i, v in enumerate(body.outvars) if i in wanted and isinstance(v, Var)]
    whole = [v for i, v in enumerate(body.outvars) if i not in wanted and isinstance(v, Var)]
    sub = new_jaxpr(body, body.constvars, body.invars, results, body.eqns)
    return deferrable(sub, dims, keep, reduced=whole)


def _is_row_sum(eqn: JaxprEqn, dims) -> bool:
    rule = _ROW_SUMS.get(eqn.primitive.name)
    return rule is not None and rule(eqn, dims)


# ----------------------------------------------------------------------------- evaluation


def deferred_rules(
    eqns: Iterable[JaxprEqn],
    dims: dict,
    deferred: set[Var],
    mesh,
    data_axes: tuple[str, ...],
    var_specs: Mapping[Var, PartitionSpec] | None = None,
    operand_specs: Callable[[JaxprEqn], list] | None = None,
) -> dict[JaxprEqn, Callable[[list], list]]:
    """For each of ``eqns`` that makes a deferred value, the function that computes its
    partial sums (``[n, ...]``, split over ``data_axes``) from its operands, as
    ``eval_jaxpr_with_constraints``'s ``overrides``. A value the plan pins in
    ``var_specs`` keeps its split over the other mesh axes (a vocabulary-parallel
    embedding's gradient stays split over the model axis). ``operand_specs(eqn)``, where
    given, is the spec the plan reads each operand of ``eqn`` in (``None`` where it names
    none): a contraction whose operands it names all is then computed on each device's
    blocks as the plan lays them out over every axis (:func:`_manual_dot_specs`), not
    left to XLA's propagation over the other axes."""
    n = int(np.prod([mesh.shape[a] for a in data_axes]))
    data = spec_entry(tuple(data_axes))
    var_specs = var_specs or {}
    eqns = list(eqns)
    bodies = bodies_passing_row_sums(eqns)
    rules = {}
    for eqn in eqns:
        if eqn in bodies:
            positions = tuple(i for i, v in enumerate(eqn.outvars) if v in deferred)
            if positions:
                body = bodies[eqn][0]
                rules |= deferred_rules(
                    body.eqns, dims, deferred, mesh, data_axes, var_specs, operand_specs
                )
                shardings = tuple(
                    NamedSharding(mesh, _rule_spec(var_specs, eqn.outvars[i], data_axes))
                    for i in positions
                )
                rules[eqn] = DeferredBody(positions, is_scan(eqn), shardings)
            continue
        if passes_through(eqn):
            if any(v in deferred for v in eqn.outvars):
                rules[eqn] = list  # the identity, on partial sums and whole values alike
            continue
        if not eqn.outvars or eqn.outvars[0] not in deferred:
            continue
        partial_sharding = NamedSharding(mesh, _rule_spec(var_specs, eqn.outvars[0], data_axes))
        partial_in = tuple(isinstance(v, Var) and v in deferred for v in eqn.invars)
        if any(partial_in):
            rules[eqn] = _linear_rule(eqn, partial_in, n, partial_sharding)
        else:
            specs = None if operand_specs is None else operand_specs(eqn)
            manual = _manual_dot_specs(eqn, specs, dims, data_axes)
            if manual is not None:
                rules[eqn] = _manual_row_sum_rule(eqn, mesh, data, manual, partial_sharding)
            else:
                rules[eqn] = _row_sum_rule(eqn, dims, mesh, data_axes, data, partial_sharding)
    return rules


@dataclass(frozen=True, eq=False)
class DeferredBody:
    """The override of an equation with a body (a scan, a checkpoint) whose outputs at
    ``positions`` are partial sums: the lowering evaluates the body with the overrides of
    its own equations, which make it return those results as ``[n, ...]`` partial sums,
    and binds the equation again around it (``constrained_eval.eval_jaxpr_with_constraints``);
    :meth:`finish` then lays each such output out as the partial sums of the value
    (a scan's ``[length, n, ...]`` stack moved to ``[n, length, ...]``: on each device
    its own slice, no communication), in ``shardings``."""

    positions: tuple[int, ...]
    stacked: bool
    shardings: tuple[NamedSharding, ...]

    def finish(self, outs: list) -> list:
        outs = list(outs)
        for i, sharding in zip(self.positions, self.shardings, strict=True):
            x = jnp.moveaxis(outs[i], 1, 0) if self.stacked else outs[i]
            outs[i] = jax.lax.with_sharding_constraint(x, sharding)
        return outs


def _rule_spec(var_specs, v: Var, data_axes: tuple[str, ...]) -> PartitionSpec:
    """The spec a deferral rule pins ``v``'s partial sums to: :func:`partial_spec` of the
    plan's spec; where the plan names none (a manual plan's intermediate), ``n`` over the
    data axes and the value's own dimensions left to XLA's propagation, so that a
    gradient computed split over another axis (Megatron's) is not gathered whole."""
    spec = var_specs.get(v)
    if spec is not None:
        return partial_spec(spec, data_axes)
    data = spec_entry(tuple(data_axes))
    return PartitionSpec(data, *[PartitionSpec.UNCONSTRAINED] * len(v.aval.shape))


def partial_spec(spec: PartitionSpec | None, data_axes: tuple[str, ...]) -> PartitionSpec:
    """The spec of a value's per-device partial sums ``[n, ...]``: ``n`` over the data
    axes, the value's own dimensions as ``spec`` splits them over the other axes."""
    data = spec_entry(tuple(data_axes))
    rest = []
    for axes in spec or ():
        axes = axes if isinstance(axes, tuple) else (axes,) if axes else ()
        kept = tuple(a for a in axes if a not in data_axes)
        rest.append(spec_entry(kept))
    return PartitionSpec(data, *rest)


def bind_eqn(eqn: JaxprEqn, *operands):
    """``eqn`` bound on ``operands``: its result, the first where it has several."""
    out = jaxpr_util.bind_eqn(eqn, *operands)
    return out[0] if eqn.primitive.multiple_results else out


def _row_sum_rule(eqn: JaxprEqn, dims, mesh, data_axes, data, partial_sharding):
    in_specs = []
    for v in eqn.invars:
        d = _one_batch_dim(dims, v)
        spec = [None] * len(getattr(v.aval, "shape", ()))
        if d is not None:
            spec[d] = data
        in_specs.append(PartitionSpec(*spec))
    carried_by_first = [
        eqn.primitive.name == "scatter-add" and i == 0 for i in range(len(eqn.invars))
    ]

    def local(*operands):
        if any(carried_by_first):
            first = jax.lax.axis_index(data_axes) == 0
            operands = [
                jnp.where(first, x, jnp.zeros_like(x)) if c else x
                for x, c in zip(operands, carried_by_first, strict=True)
            ]
        return bind_eqn(eqn, *operands)[None]

    partial = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=PartitionSpec(data),
        axis_names=set(data_axes),
        check_vma=False,
    )

    def rule(operands):
        sums = partial(*[jnp.asarray(x) for x in operands])
        return [jax.lax.with_sharding_constraint(sums, partial_sharding)]

    return rule


def _manual_dot_specs(eqn: JaxprEqn, specs, dims, data_axes):
    """``(operand specs, result entries)`` of a row-sum contraction computed on each
    device's blocks over every axis: its operands in ``specs``, the batch dimension they
    contract split over exactly ``data_axes``, no other contracted dimension split, the
    other axes only on dimensions the result keeps (so each device's block of the result
    is a partial sum over the data axes alone). ``None`` where that does not hold."""
    if eqn.primitive.name != "dot_general" or specs is None or any(s is None for s in specs):
        return None
    lhs, rhs = (
        [entry_names(e) for e in spec] + [()] * (v.aval.ndim - len(spec))
        for spec, v in zip(specs, eqn.invars, strict=True)
    )
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    batch = (_one_batch_dim(dims, eqn.invars[0]), _one_batch_dim(dims, eqn.invars[1]))
    data = tuple(data_axes)
    for i, j in zip(lc, rc, strict=True):
        wanted = data if (i, j) == batch else ()
        if lhs[i] != wanted or rhs[j] != wanted:
            return None
    for i, j in zip(lb, rb, strict=True):
        if lhs[i] != rhs[j]:
            return None
    kept = [lhs[i] for i in lb]
    kept += [lhs[d] for d in range(len(lhs)) if d not in lc and d not in lb]
    kept += [rhs[d] for d in range(len(rhs)) if d not in rc and d not in rb]
    axes = [a for e in kept for a in e]
    if set(axes) & set(data) or len(axes) != len(set(axes)):
        return None  # an axis on two of the result's dimensions: blocks the devices lack
    operands = tuple(PartitionSpec(*[spec_entry(e) for e in x]) for x in (lhs, rhs))
    return operands, tuple(spec_entry(e) for e in kept)


def _manual_row_sum_rule(eqn: JaxprEqn, mesh, data, manual, partial_sharding):
    operands, kept = manual
    partial = jax.shard_map(
        lambda *blocks: bind_eqn(eqn, *blocks)[None],
        mesh=mesh,
        in_specs=operands,
        out_specs=PartitionSpec(data, *kept),
        check_vma=False,
    )

    def rule(values):
        sums = partial(*[jnp.asarray(x) for x in values])
        return [jax.lax.with_sharding_constraint(sums, partial_sharding)]

    return rule


def _linear_rule(eqn: JaxprEqn, partial_in, n: int, partial_sharding):
    additive = eqn.primitive.name in _ADDITIVE
    linear = _linear_positions(eqn)

    def rule(operands):
        operands, axes = list(operands), []
        for i, (x, p) in enumerate(zip(operands, partial_in, strict=True)):
            if not p and additive and linear(i):
                x = jnp.asarray(x)
                operands[i] = jnp.zeros((n,) + x.shape, x.dtype).at[0].set(x)
                p = True
            axes.append(0 if p else None)
        out = jax.vmap(lambda *xs: bind_eqn(eqn, *xs), in_axes=axes)(*operands)
        return [jax.lax.with_sharding_constraint(out, partial_sharding)]

    return rule


def sum_partials(x, mesh, data_axes: tuple[str, ...], spec: PartitionSpec | None = None):
    """``Σ_d x[d]`` of a deferred value: the one reduction of the step.

    An all-reduce; a reduce-scatter (``psum_scatter``) instead when ``spec``, the sharding
    the sum is wanted in, splits one dimension over exactly ``data_axes``: each device then
    receives only its block (ZeRO-2's sharded gradients). XLA on CPU never turns an
    all-reduce followed by a slice into a reduce-scatter (``docs/design.md``, Facts of JAX
    0.10), so the scatter is written out here; other axes of ``spec`` are left to the
    caller's constraint."""
    data = spec_entry(tuple(data_axes))
    dim = scatter_dimension(spec, data_axes)
    if dim is None:
        body, out_spec = (lambda p: jax.lax.psum(p[0], data_axes)), PartitionSpec()
    else:

        def body(p):
            return jax.lax.psum_scatter(p[0], data_axes, scatter_dimension=dim, tiled=True)

        out_spec = PartitionSpec(*([None] * dim), data)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=PartitionSpec(data),
        out_specs=out_spec,
        axis_names=set(data_axes),
        check_vma=False,
    )(x)


def scatter_dimension(spec: PartitionSpec | None, data_axes: tuple[str, ...]) -> int | None:
    """The dimension that ``spec`` splits over exactly ``data_axes``, if one does."""
    for d, axes in enumerate(spec or ()):
        axes = axes if isinstance(axes, tuple) else (axes,)
        if axes == tuple(data_axes):
            return d
    return None
