"""Manual sharding: the user names a PartitionSpec for inputs and outputs.

``ManualShardingOption(mesh_axis_names, in_axis_resources, out_axis_resources)`` turns
into a :class:`ShardingPlan` whose mesh axes carry the user's names. A spec tree may be a
prefix of the argument tree (one spec for a whole ``TrainState``). ``None`` replicates an
input and leaves an output to XLA's sharding propagation.

Every spec is checked against its value when the step compiles, so that a mistake is
named in the user's terms rather than by XLA: the axis names, the number of entries
against the value's rank, no mesh axis used twice (a device holds one slice per axis),
and each split dimension divisible by the product of its mesh axes' sizes.

Of an ``AutoShardingOption`` given alongside, only the fields that view the devices as a
mesh act (:data:`MESH_VIEW_FIELDS`); :func:`ignored_auto_sharding_fields` names the rest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import jax
from jax.sharding import PartitionSpec

from alpa.device_mesh import LogicalDeviceMesh, entry_names
from alpa.shard_parallel.sharding_plan import ShardingPlan
from alpa.tracing import TracedStep


@dataclass(frozen=True)
class ManualShardingOption:
    """User-given shardings.

    Attributes:
      mesh_axis_names: one name per logical mesh axis (1 or 2 names); ``None`` when
        ``submesh_axis_names`` names every pipeline stage's axes.
      submesh_axis_names: per pipeline stage, the axis names of its submesh (pipeshard).
      in_axis_resources: a tuple with one entry per positional argument: a PartitionSpec,
        ``None`` (replicated), or a pytree prefix of that argument with such leaves.
      out_axis_resources: the same for the output pytree, or ``None``.
      pipeline_intermediate_axes: pipeshard only: ``((axis_name, dim), ...)``, how the
        values passed between pipeline stages (activations forward, their gradients
        backward) are split: dimension ``dim`` over the stage's axis ``axis_name``, on
        each stage whose submesh has an axis of that name, where it divides the
        dimension (elsewhere the value is planned as without the option).
    """

    mesh_axis_names: tuple[str, ...] | None
    submesh_axis_names: tuple[tuple[str, ...], ...] | None = None
    in_axis_resources: Any = None
    out_axis_resources: Any = None
    pipeline_intermediate_axes: tuple[tuple[str, int], ...] | None = None

    def __post_init__(self):
        axes = self.pipeline_intermediate_axes
        if axes is not None:
            pairs = tuple(tuple(p) if isinstance(p, tuple | list) else p for p in axes)
            if not all(
                isinstance(p, tuple)
                and len(p) == 2
                and isinstance(p[0], str)
                and isinstance(p[1], int)
                and not isinstance(p[1], bool)
                and p[1] >= 0
                for p in pairs
            ):
                raise ValueError(
                    "pipeline_intermediate_axes must be pairs (axis_name, dimension), "
                    f"e.g. (('data', 0),), got {axes!r}"
                )
            names = [name for name, _ in pairs]
            if len(set(names)) != len(names):
                raise ValueError(
                    "pipeline_intermediate_axes names an axis twice (a mesh axis splits one "
                    f"dimension of a value), got {axes!r}"
                )
            object.__setattr__(self, "pipeline_intermediate_axes", pairs)
        for stage, stage_names in enumerate(self.submesh_axis_names or ()):
            if isinstance(stage_names, tuple | list):
                _check_distinct(stage_names, f"submesh_axis_names[{stage}]")
        names = self.mesh_axis_names
        if names is None and self.submesh_axis_names is not None:
            return  # a pipeline's: every stage names its own axes (as in Alpa)
        if (
            not isinstance(names, tuple | list)
            or not 1 <= len(names) <= 2
            or not all(isinstance(n, str) for n in names)
        ):
            raise ValueError(f"mesh_axis_names must be a tuple of 1 or 2 axis names, got {names!r}")
        _check_distinct(names, "mesh_axis_names")
        object.__setattr__(self, "mesh_axis_names", tuple(names))


def _check_distinct(names: Sequence[str], what: str) -> None:
    """A mesh's axes need names of their own: a spec names the axis it splits over."""
    repeated = sorted({n for n in names if list(names).count(n) > 1})
    if repeated:
        raise ValueError(
            f"{what}={tuple(names)!r} names the mesh axis {repeated[0]!r} twice: expected "
            "a distinct name for each mesh axis (a PartitionSpec names the axis it splits "
            "a dimension over), e.g. ('data', 'model')"
        )


def _is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def broadcast_prefix_specs(prefix, tree, what: str) -> list[PartitionSpec | None]:
    """One spec per leaf of ``tree`` from a spec tree that is a prefix of it."""
    try:
        nested = jax.tree.map(
            lambda spec, sub: [spec] * len(jax.tree.leaves(sub)),
            prefix,
            tree,
            is_leaf=_is_spec_leaf,
        )
    except ValueError as e:
        raise ValueError(f"{what} does not match the structure of its value: {e}") from None
    return [
        s for group in jax.tree.leaves(nested, is_leaf=lambda x: isinstance(x, list)) for s in group
    ]


#: The ``AutoShardingOption`` fields a manual plan reads: how the devices form a mesh.
MESH_VIEW_FIELDS = ("logical_mesh_shape", "mesh_alpha", "mesh_beta")


def ignored_auto_sharding_fields(option) -> list[str]:
    """The fields of an ``AutoShardingOption`` set away from their defaults that a manual
    plan does not read (it reads only :data:`MESH_VIEW_FIELDS`)."""
    default = type(option)()
    return [
        f.name
        for f in fields(option)
        if f.name not in MESH_VIEW_FIELDS and getattr(option, f.name) != getattr(default, f.name)
    ]


def unknown_axis_names(spec: PartitionSpec, names: Sequence[str]) -> list[str]:
    """The mesh axis names ``spec`` uses that are not in ``names``, in order."""
    return [n for entry in spec for n in entry_names(entry) if n not in names]


def repeated_axis_names(spec: PartitionSpec) -> list[str]:
    """The mesh axis names ``spec`` uses more than once, in order."""
    used = [n for entry in spec for n in entry_names(entry)]
    return list(dict.fromkeys(n for n in used if used.count(n) > 1))


def check_spec_axis_names(
    spec: PartitionSpec, names: Sequence[str], where: str, spec_text: str, names_text: str
) -> None:
    """Raise ``ValueError`` unless every mesh axis ``spec`` names is one of ``names``, each
    at most once; the message starts with ``where``, names the spec as ``spec_text`` and
    the known names as ``names_text``."""
    unknown = unknown_axis_names(spec, names)
    if unknown:
        raise ValueError(
            f"{where}: {spec_text} names mesh axes {unknown} that are not in {names_text} "
            f"{tuple(names)}"
        )
    repeated = repeated_axis_names(spec)
    if repeated:
        raise ValueError(
            f"{where}: {spec_text} uses mesh axis {repeated[0]!r} more than once; "
            "each mesh axis may split at most one dimension"
        )


def _check_spec(spec, names: Sequence[str], shape, where: str, sizes: dict[str, int]):
    if spec is None:
        return
    check_spec_axis_names(spec, names, where, f"PartitionSpec {spec}", "mesh_axis_names")
    if len(spec) > len(shape):
        raise ValueError(
            f"{where}: PartitionSpec {spec} has {len(spec)} entries but the "
            f"value has {len(shape)} dimensions"
        )
    for dim, entry in enumerate(spec):
        axes = entry_names(entry)
        parts = math.prod(sizes[a] for a in axes)
        if shape[dim] % parts:
            over = " and ".join(f"{a!r} of size {sizes[a]}" for a in axes)
            over = f"mesh axis {over}" if len(axes) == 1 else f"mesh axes {over} ({parts} parts)"
            raise ValueError(
                f"{where}: PartitionSpec {spec} splits dimension {dim} of size {shape[dim]} "
                f"(shape {tuple(shape)}) over {over}, which does not divide it"
            )


def manual_sharding_plan(
    traced: TracedStep,
    logical_mesh: LogicalDeviceMesh,
    option: ManualShardingOption,
    args: Sequence[Any],
) -> ShardingPlan:
    names = option.mesh_axis_names
    if names is None:
        raise ValueError(
            "ManualShardingOption.mesh_axis_names is None, which only a pipeline's option "
            "may be (with submesh_axis_names); a one-mesh method needs the mesh's axis names"
        )
    if len(names) == 1:
        mesh = replace(
            logical_mesh,
            shape=(1, logical_mesh.num_devices),
            axis_names=(f"_{names[0]}_outer", names[0]),
        )
    else:
        mesh = replace(logical_mesh, axis_names=names)

    in_res = option.in_axis_resources
    if in_res is None:
        in_res = (None,) * len(args)
    if not isinstance(in_res, tuple | list) or len(in_res) != len(args):
        raise ValueError(
            f"in_axis_resources must have one entry per positional argument ({len(args)}), "
            f"got {in_res!r}"
        )
    in_specs: list = []
    for pos in traced.dynamic_argnums:
        in_specs += broadcast_prefix_specs(in_res[pos], args[pos], f"in_axis_resources[{pos}]")
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    for spec, aval, leaf in zip(in_specs, traced.in_avals, traced.leaf_names, strict=True):
        _check_spec(spec, mesh.axis_names, aval.shape, f"in_axis_resources for {leaf}", sizes)

    out_avals = [v.aval for v in traced.jaxpr.outvars]
    if option.out_axis_resources is None:
        out_specs = [None] * len(out_avals)
    else:
        dummy = jax.tree.unflatten(traced.out_tree, [0] * len(out_avals))
        out_specs = broadcast_prefix_specs(option.out_axis_resources, dummy, "out_axis_resources")
    for i, (spec, aval) in enumerate(zip(out_specs, out_avals, strict=True)):
        _check_spec(spec, mesh.axis_names, aval.shape, f"out_axis_resources for output {i}", sizes)

    # The batch is split over the axes that shard dim 0 of every batch leaf.
    data_axes = None
    for spec, is_batch in zip(in_specs, traced.batch_invars, strict=True):
        if not is_batch:
            continue
        first = spec[0] if spec is not None and len(spec) else None
        axes = set() if first is None else set(first if isinstance(first, tuple) else (first,))
        data_axes = axes if data_axes is None else data_axes & axes
    ordered = tuple(a for a in mesh.axis_names if a in (data_axes or set()))
    return ShardingPlan(
        logical_mesh=mesh,
        in_specs=tuple(PartitionSpec() if s is None else s for s in in_specs),
        out_specs=tuple(out_specs),
        data_axes=ordered,
        method="manual",
    )
