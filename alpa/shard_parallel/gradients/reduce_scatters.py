"""Lowering of the reduce-scatters the plan chose: written out, not left to XLA.

A contraction whose contracted dimension is split over a mesh axis leaves each device a
partial result. Where the plan wants that result split over the same axis (a strategy
``... RS0->...``, with ``prefer_reduce_scatter``), the ILP priced a reduce-scatter. XLA's
partitioner writes it as an all-reduce followed by a slice, and XLA on CPU never turns
that pair into a reduce-scatter (``docs/design.md``, Facts of JAX 0.10; measured: the conv
kernel gradients of a 2-D plan compiled to 9 all-reduces, 0 reduce-scatters), so the
program moved twice the bytes the plan priced. Here such an equation runs in
``shard_map``: on each device's blocks of its operands, in the specs the plan reads them
in, its partial result then ``psum_scatter``-ed over each reducing axis that splits the
result and ``psum``-ed over the others. The program is the one priced, on every backend.

Only ``dot_general`` and ungrouped ``conv_general_dilated`` (spatial dimensions whole)
are written out, and only where each reducing axis that splits the result is the minor
one of its dimension (the device's block, split further) and the blocks add up to the
plan's result spec; any other equation is left to XLA as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import jax
from jax.extend.core import Jaxpr, JaxprEqn, Literal
from jax.sharding import PartitionSpec

from alpa.device_mesh import entry_names
from alpa.shard_parallel.gradients.row_sums import bind_eqn

#: The primitives whose reduce-scatters are written out.
WRITTEN = frozenset({"dot_general", "conv_general_dilated"})


def _entry(spec: PartitionSpec, dim: int) -> tuple[str, ...]:
    return entry_names(spec[dim]) if dim < len(spec) else ()


def contracted_axes(eqn: JaxprEqn, specs: Sequence[PartitionSpec]) -> tuple[str, ...] | None:
    """The mesh axes over which ``eqn``, its operands in ``specs``, leaves partial
    results: those splitting its contracted dimensions. ``None`` for an equation this
    module does not write out."""
    name = eqn.primitive.name
    if name == "dot_general":
        (lhs_c, _), _ = eqn.params["dimension_numbers"]
        dims = [(0, d) for d in lhs_c]
    elif name == "conv_general_dilated":
        if eqn.params["feature_group_count"] != 1 or eqn.params["batch_group_count"] != 1:
            return None
        numbers = eqn.params["dimension_numbers"]
        spatial = [(0, d) for d in numbers.lhs_spec[2:]] + [(1, d) for d in numbers.rhs_spec[2:]]
        if any(_entry(specs[i], d) for i, d in spatial):
            return None  # a split window would need its halo
        dims = [(0, numbers.lhs_spec[1])]
    else:
        return None
    axes: list[str] = []
    for i, d in dims:
        axes += [a for a in _entry(specs[i], d) if a not in axes]
    return tuple(axes)


def reduce_scatter_overrides(
    jaxpr: Jaxpr,
    var_specs: Mapping,
    operand_specs: Mapping,
    in_specs: Mapping,
    mesh,
    skip=frozenset(),
) -> dict[JaxprEqn, Callable[[list], list]]:
    """``eval_jaxpr_with_constraints``'s ``overrides`` for the plan's reduce-scatters
    (module docstring). ``var_specs`` and ``operand_specs`` are the plan's;
    ``in_specs[v]`` the spec of each input ``v`` of ``jaxpr``. Equations in ``skip``
    (already overridden) are left alone."""
    held = dict(in_specs)
    held.update(var_specs)
    overrides = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in WRITTEN or eqn in skip:
            continue
        if any(isinstance(v, Literal) for v in eqn.invars):
            continue
        out_spec = var_specs.get(eqn.outvars[0])
        needs = operand_specs.get(eqn) or (None,) * len(eqn.invars)
        specs = [
            need if need is not None else held.get(v)
            for v, need in zip(eqn.invars, needs, strict=True)
        ]
        if out_spec is None or any(s is None for s in specs):
            continue
        reducing = contracted_axes(eqn, specs)
        if not reducing:
            continue
        scattered = {
            a: d for d in range(len(out_spec)) for a in _entry(out_spec, d) if a in reducing
        }
        if scattered and _blocks_fit(eqn, specs, out_spec, scattered, mesh):
            overrides[eqn] = _rule(eqn, specs, out_spec, reducing, scattered, mesh)
    return overrides


def _blocks_fit(eqn, specs, out_spec, scattered: Mapping[str, int], mesh) -> bool:
    """Whether ``eqn`` on each device's blocks gives a partial result that, scattered over
    ``scattered``'s axes, is the device's block of ``out_spec``: each scattered axis minor
    in its dimension, one per dimension, and the block shapes agreeing."""
    if len(set(scattered.values())) != len(scattered):
        return False
    if any(_entry(out_spec, d)[-1] != a for a, d in scattered.items()):
        return False

    def local(aval, spec):
        shape = list(aval.shape)
        for d in range(len(shape)):
            n = math.prod(mesh.shape[a] for a in _entry(spec, d))
            if shape[d] % n:
                return None
            shape[d] //= n
        return jax.ShapeDtypeStruct(tuple(shape), aval.dtype)

    blocks = [local(v.aval, s) for v, s in zip(eqn.invars, specs, strict=True)]
    out = eqn.outvars[0].aval
    if any(b is None for b in blocks):
        return False
    try:
        partial = jax.eval_shape(lambda *xs: bind_eqn(eqn, *xs), *blocks)
    except Exception:  # noqa: BLE001 -- blocks this equation cannot be bound on
        return False
    expected = []
    for d, size in enumerate(out.shape):
        kept = [a for a in _entry(out_spec, d) if a not in scattered]
        expected.append(size // math.prod(mesh.shape[a] for a in kept))
    return tuple(partial.shape) == tuple(expected)


def _rule(eqn, specs, out_spec, reducing, scattered: Mapping[str, int], mesh):
    def local(*blocks):
        y = bind_eqn(eqn, *blocks)
        for a in reducing:
            if a in scattered:
                y = jax.lax.psum_scatter(y, a, scatter_dimension=scattered[a], tiled=True)
            else:
                y = jax.lax.psum(y, a)
        return y

    def rule(operands):
        return [
            jax.shard_map(
                local, mesh=mesh, in_specs=tuple(specs), out_specs=out_spec, check_vma=False
            )(*operands)
        ]

    return rule
