"""Sharding specs of one tensor on a 2-D logical mesh, and what it costs to change them.

A :data:`Spec` names, for every dimension of a tensor, the logical mesh axes that split it:
``((), (1,))`` is a matrix whose columns are split over mesh axis 1 and whose rows are whole
on every device. A mesh axis splits at most one dimension; a dimension split by both axes
``(0, 1)`` is the "mixed mesh shape" (a 1-D view of the 2-D mesh). Mesh axes of size 1 never
appear: splitting over one device is the same as not splitting.

Resharding a value from spec ``A`` to spec ``B`` (``docs/auto_sharding.md``, Cost model) is
priced as the cheapest
sequence of collectives: an axis that splits the same dimension in both, with the same axes
before it there, costs nothing; an axis that moves to another dimension is an all-to-all
when it split its dimension alone, or was the minor axis of a mixed-shape dimension and
becomes the minor axis of the one it moves to (or an all-gather when all-to-all is not
allowed, and otherwise); any
other axis that ``A`` uses is an all-gather; an axis that only ``B`` uses is a local slice,
which is free. (The collectives XLA writes for these reshardings, counted:
``test_auto_sharding_ilp``.)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from jax.sharding import Mesh, PartitionSpec

from alpa.device_mesh import LogicalDeviceMesh, entry_names

#: Per tensor dimension, the mesh axes that split it.
Spec = tuple[tuple[int, ...], ...]

#: The cost of a resharding that the options forbid; large enough that the solver picks it
#: only when nothing else is possible, small enough to keep the ILP well conditioned.
FORBIDDEN_COST = 1e13


def replicated(rank: int) -> Spec:
    return ((),) * rank


def mesh_axes(mesh: LogicalDeviceMesh) -> tuple[int, ...]:
    """The axes that have more than one device: the only ones worth splitting over."""
    return tuple(a for a, n in enumerate(mesh.shape) if n > 1)


def num_shards(spec: Spec, mesh: LogicalDeviceMesh) -> int:
    return math.prod(mesh.shape[a] for axes in spec for a in axes)


def used_axes(spec: Spec) -> tuple[int, ...]:
    return tuple(sorted(a for axes in spec for a in axes))


def axis_dim(spec: Spec, axis: int) -> int | None:
    """The tensor dimension that ``axis`` splits in ``spec``, or ``None``."""
    for dim, axes in enumerate(spec):
        if axis in axes:
            return dim
    return None


def divides(shape: Sequence[int], spec: Spec, mesh: LogicalDeviceMesh) -> bool:
    return all(
        size % math.prod(mesh.shape[a] for a in axes) == 0
        for size, axes in zip(shape, spec, strict=True)
    )


def enumerate_specs(
    shape: Sequence[int], mesh: LogicalDeviceMesh, allow_mixed: bool = False
) -> list[Spec]:
    """Every valid spec of a tensor of ``shape``, replicated first, in a fixed order."""
    rank = len(shape)
    axes = mesh_axes(mesh)
    choices = [None, *range(rank)]
    specs: list[Spec] = []
    for assignment in itertools.product(choices, repeat=len(axes)):
        dims: list[list[int]] = [[] for _ in range(rank)]
        for axis, dim in zip(axes, assignment, strict=True):
            if dim is not None:
                dims[dim].append(axis)
        if not allow_mixed and any(len(d) > 1 for d in dims):
            continue
        spec = tuple(tuple(d) for d in dims)
        if divides(shape, spec, mesh):
            specs.append(spec)
    return sorted(set(specs), key=lambda s: (num_axes_used(s), s))


def num_axes_used(spec: Spec) -> int:
    return sum(len(axes) for axes in spec)


def to_partition_spec(spec: Spec, mesh: LogicalDeviceMesh) -> PartitionSpec:
    """The ``PartitionSpec`` over ``mesh.axis_names`` that lowers ``spec``."""
    entries = []
    for axes in spec:
        if not axes:
            entries.append(None)
        elif len(axes) == 1:
            entries.append(mesh.axis_names[axes[0]])
        else:
            entries.append(tuple(mesh.axis_names[a] for a in axes))
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def from_partition_spec(pspec: PartitionSpec, rank: int, mesh: LogicalDeviceMesh) -> Spec:
    """The :data:`Spec` of a ``PartitionSpec`` over ``mesh.axis_names`` for a value of
    ``rank`` dimensions; mesh axes of one device split nothing and are dropped."""
    if len(pspec) > rank:
        raise ValueError(f"PartitionSpec {pspec} has more entries than the value's rank {rank}")
    spec = []
    for entry in (*pspec, *(None,) * (rank - len(pspec))):
        axes = []
        for name in entry_names(entry):
            if name not in mesh.axis_names:
                raise ValueError(
                    f"PartitionSpec {pspec} names mesh axis {name!r}; the mesh's axes are "
                    f"{tuple(mesh.axis_names)}"
                )
            axis = mesh.axis_names.index(name)
            if mesh.shape[axis] > 1:
                axes.append(axis)
        spec.append(tuple(axes))
    return tuple(spec)


def user_partition_spec(sharding, mesh: LogicalDeviceMesh) -> PartitionSpec | None:
    """The ``PartitionSpec`` over ``mesh.axis_names`` of a user's ``NamedSharding`` on a
    mesh that is ``mesh`` seen under other names, else ``None``.

    The user's mesh is ``mesh`` when its axes of more than one device have the sizes of
    ``mesh``'s, in order (a 1-D mesh of 8 devices is the logical mesh (1, 8)), and, when
    both hold devices, the same devices in the same places; an abstract mesh (a
    ``PartitionSpec`` under ``jax.set_mesh``) is matched by its sizes. Its axes are
    ``mesh``'s by position. A spec with an unconstrained dimension is ``None`` too.
    """
    user = getattr(sharding, "mesh", None)
    pspec = getattr(sharding, "spec", None)
    if user is None or pspec is None or PartitionSpec.UNCONSTRAINED in tuple(pspec):
        return None
    user_axes = [n for n, size in zip(user.axis_names, user.axis_sizes, strict=True) if size > 1]
    axes = [a for a in range(len(mesh.shape)) if mesh.shape[a] > 1]
    if [user.shape[n] for n in user_axes] != [mesh.shape[a] for a in axes]:
        return None
    if isinstance(user, Mesh) and mesh.devices is not None:
        if [d.id for d in user.devices.flat] != [d.id for d in mesh.devices]:
            return None
    names = dict(zip(user_axes, (mesh.axis_names[a] for a in axes), strict=True))
    entries = []
    for entry in pspec:
        kept = tuple(names[n] for n in entry_names(entry) if n in names)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


def format_spec(spec: Spec, mesh: LogicalDeviceMesh) -> str:
    """``S0R``-style notation of Alpa: per dimension, ``S`` + axes or ``R``."""
    if not spec:
        return "scalar"
    return "".join("S" + "".join(str(a) for a in axes) if axes else "R" for axes in spec)


def nbytes(shape: Sequence[int], itemsize: int) -> int:
    return math.prod(shape) * itemsize


#: The collectives of the cost model, by their names in HLO.
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


@dataclass(frozen=True)
class Collective:
    """One collective over one logical mesh ``axis``. ``nbytes`` is per device, in the
    convention of ``LogicalDeviceMesh``'s costs: the buffer an all-reduce reduces, the
    result an all-gather gathers, the operand a reduce-scatter scatters, the tensor an
    all-to-all exchanges among the axis's devices (each one's buffer times their number,
    Alpa's convention)."""

    kind: str
    axis: int
    nbytes: float

    def cost(self, mesh: LogicalDeviceMesh) -> float:
        return _COSTS[self.kind](mesh, self.nbytes, self.axis)


_COSTS = {
    "all-reduce": LogicalDeviceMesh.all_reduce_cost,
    "all-gather": LogicalDeviceMesh.all_gather_cost,
    "reduce-scatter": LogicalDeviceMesh.reduce_scatter_cost,
    "all-to-all": LogicalDeviceMesh.all_to_all_cost,
}


def resharding_collectives(
    src: Spec, dst: Spec, total_bytes: float, mesh: LogicalDeviceMesh, allow_all_to_all: bool = True
) -> tuple[Collective, ...]:
    """The collectives that turn a value of ``total_bytes`` held as ``src`` into ``dst``
    (module docstring), over axes of more than one device."""
    if src == dst:
        return ()
    out = []
    shards = num_shards(src, mesh)
    for axis in used_axes(src):
        src_dim = axis_dim(src, axis)
        dst_dim = axis_dim(dst, axis)
        if _stays(src, dst, axis, src_dim, dst_dim):
            continue
        # The axis's devices hold this much of the value between them: the all-to-all's
        # tensor, the all-gather's result.
        group = total_bytes / shards * mesh.shape[axis]
        if dst_dim is not None and allow_all_to_all and _moves(src, dst, axis, src_dim, dst_dim):
            out.append(Collective("all-to-all", axis, group))
            continue
        out.append(Collective("all-gather", axis, group))
        shards //= mesh.shape[axis]
    return tuple(c for c in out if mesh.shape[c.axis] > 1)


def _stays(src: Spec, dst: Spec, axis: int, src_dim: int, dst_dim: int | None) -> bool:
    """Whether ``axis`` splits the same blocks in ``dst`` as in ``src``: the same
    dimension, with the same axes before it (major) there. ``(0, 1) -> (0,)`` keeps axis
    0's blocks; axis 1 is then gathered."""
    if src_dim != dst_dim:
        return False
    k = src[src_dim].index(axis) + 1
    return src[src_dim][:k] == dst[dst_dim][:k]


def _moves(src: Spec, dst: Spec, axis: int, src_dim: int, dst_dim: int) -> bool:
    """Whether ``axis`` moves to another dimension by one all-to-all over it: where it
    splits its dimension alone, or is the minor axis of a mixed-shape dimension and becomes
    the minor axis of the dimension it moves to (``((), (0, 1)) -> ((1,), (0,))``: one
    all-to-all in XLA, measured)."""
    if len(src[src_dim]) == 1:
        return True
    return src[src_dim][-1] == axis and tuple(dst[dst_dim]) == (*src[dst_dim], axis)


def resharding_cost(
    src: Spec,
    dst: Spec,
    total_bytes: float,
    mesh: LogicalDeviceMesh,
    allow_all_gather: bool = True,
    allow_all_to_all: bool = True,
) -> float:
    """The cost of turning a value held as ``src`` into ``dst`` (module docstring): its
    :func:`resharding_collectives`, priced by the mesh."""
    cost = 0.0
    for collective in resharding_collectives(src, dst, total_bytes, mesh, allow_all_to_all):
        cost += collective.cost(mesh)
        if collective.kind == "all-gather" and not allow_all_gather:
            cost += FORBIDDEN_COST
    return cost
