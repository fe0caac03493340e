"""Where a step's leaves live: a :class:`PlacementSpec` per leaf, and putting an array
there (locally a ``jax.sharding.Sharding``, on Ray a mesh and a ``Layout``); a leaf whose
rows live on several meshes is one ``jax.Array`` over their devices or a ``StackedRows``
(``runtime.stage_rows``), and :func:`caller_placements` gives the caller's view of the
leaves a pipeline split so. Used by the executables and by the local runtime."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from alpa.jax_internals import ShapedArray
from alpa.runtime.stacked_array import StackedRows, stacked_parts
from alpa.runtime.stage_rows import RowsLayout, join_parts, rows_layout

__all__ = [
    "PlacementSpec",
    "StackedRows",
    "caller_placements",
    "is_placed",
    "leaf_placer",
    "place",
    "stacked_parts",
    "whole",
]


@dataclass(frozen=True)
class PlacementSpec:
    """Where one leaf lives: its abstract value, the meshes and the sharding on each.

    Attributes:
      aval: the leaf's abstract value (full batch).
      mesh_ids: the meshes that hold it (index of the stage mesh; a Ray mesh's id).
      sharding_specs: per mesh, its ``PartitionSpec`` over that mesh's logical axes.
      placements: per mesh, what puts a value there: a ``jax.sharding.Sharding`` on the
        local runtime, a ``(DistributedPhysicalDeviceMesh, Layout)`` pair on Ray. Empty
        for an output that no mesh holds (a value computed on the driver).
      rows: for a leaf a pipeline splits into its rows (``stacked_rows``), the
        ``PlacementSpec`` of each row: :func:`place` puts each row where its stage reads
        it (one ``jax.Array`` in :attr:`rows_layout`'s ``joined`` sharding where there
        is one, else a ``StackedRows``). The fields above place the whole array on the
        first row's mesh (what reads only one placement, a ``FollowParallel``, uses).
    """

    aval: Any
    mesh_ids: tuple[int, ...]
    sharding_specs: tuple[Any, ...]
    placements: tuple[Any, ...] = field(default=(), compare=False)
    rows: tuple = field(default=(), compare=False)

    def __post_init__(self):
        # Alpa's aval is a ShapedArray: the same leaf compares equal whether its spec was
        # made from a traced value, an argument's abstract value or a ShapeDtypeStruct.
        aval = self.aval
        if hasattr(aval, "shape") and hasattr(aval, "dtype"):
            weak = bool(getattr(aval, "weak_type", False))
            aval = ShapedArray(tuple(aval.shape), aval.dtype, weak_type=weak)
            object.__setattr__(self, "aval", aval)
        object.__setattr__(self, "mesh_ids", tuple(self.mesh_ids))
        object.__setattr__(self, "sharding_specs", tuple(self.sharding_specs))

    @property
    def rows_layout(self) -> RowsLayout | None:
        """For a leaf split by rows, where its parts live (``stage_rows.RowsLayout``);
        ``None`` for any other leaf."""
        if not self.rows:
            return None
        sizes = tuple(
            s.aval.shape[0] if len(s.aval.shape) == len(self.aval.shape) else 1 for s in self.rows
        )
        shardings = [s.placements[0] if s.placements else None for s in self.rows]
        return rows_layout(sizes, shardings, len(self.aval.shape))


def place(value: Any, spec: PlacementSpec) -> Any:
    """``value`` (a host or device array) placed where ``spec`` says the step reads it: on
    its first mesh, which is where the executable takes it from (a leaf read by several
    stages is copied to the others by the step). Local: a ``jax.Array`` in the planned
    sharding (not copied when it already is, :func:`is_placed`); Ray: a
    ``DistributedArray`` on the mesh's workers. An abstract ``value`` is placed as a dummy
    array (:func:`check_dummy_allowed`)."""
    if not spec.placements:
        raise ValueError(f"no mesh holds a leaf of {spec.aval}: there is nowhere to place it")
    if is_abstract(value) and not spec.rows:  # a dummy array, made where it is read
        check_dummy_allowed(value)
        target = spec.placements[0]
        if isinstance(target, tuple):  # Ray: the workers make it
            from alpa.runtime.worker_program import DummyValue

            return target[0].put(DummyValue(tuple(value.shape), np.dtype(value.dtype)), target[1])
        return dummy_array(value.shape, value.dtype, target)
    if spec.rows:  # each row (or block of rows) on its own stage's mesh
        layout = spec.rows_layout
        if layout.joined is not None:  # one array over the stages' devices
            if (
                isinstance(value, StackedRows)
                and value.sizes == layout.sizes
                and all(isinstance(r, jax.Array) for r in value.rows)
            ):
                return join_parts(value.rows, layout, spec.aval.shape)
            value = whole(value)
            return (
                value if is_placed(value, layout.joined) else jax.device_put(value, layout.joined)
            )
        if isinstance(value, StackedRows) and value.sizes == layout.sizes:
            rows = value.rows
        else:
            rows = stacked_parts(value, layout.sizes)
        placed = [place(x, s) for x, s in zip(rows, spec.rows, strict=True)]
        return StackedRows(placed, layout.sizes)
    target = spec.placements[0]
    value = whole(value)
    if isinstance(target, tuple):  # Ray: (mesh, Layout)
        mesh, layout = target
        if getattr(value, "is_distributed_array", False) and value.mesh is mesh:
            if value.layout == layout:
                return value
        return mesh.put(np.asarray(value), layout)
    if is_placed(value, target):
        return value
    return jax.device_put(value, target)


def is_abstract(x: Any) -> bool:
    """Whether ``x`` is a shape and a dtype without data (``jax.ShapeDtypeStruct`` or
    ``jax.core.ShapedArray``), as Alpa's benchmarks pass a state they never allocate."""
    return isinstance(x, jax.ShapeDtypeStruct | ShapedArray)


def check_dummy_allowed(x: Any) -> None:
    """Refuse an abstract step argument unless dummy values are on
    (``global_config.use_dummy_value_for_benchmarking``)."""
    from alpa.global_env import global_config

    if not global_config.use_dummy_value_for_benchmarking:
        raise ValueError(
            f"a step argument is abstract ({x}): a step runs on arrays. Set "
            "alpa.global_config.use_dummy_value_for_benchmarking = True to run it on dummy "
            "values made where the step reads them"
        )


def dummy_array(shape: Sequence[int], dtype: Any, sharding: Any) -> Any:
    """An array of ``shape`` in ``sharding`` (``None``: a host array) whose every element
    is ``DUMMY_VALUE``, each device's shard made on the host and copied to its device (no
    program compiled)."""
    from alpa.flax_patches import DUMMY_VALUE

    if sharding is None:
        return np.full(shape, DUMMY_VALUE, dtype)
    shape = tuple(shape)
    empty = np.broadcast_to(np.zeros((), np.int8), shape)
    return jax.make_array_from_callback(
        shape, sharding, lambda index: np.full(empty[index].shape, DUMMY_VALUE, dtype)
    )


def place_leaf(x: Any, sharding: Any) -> Any:
    """``x`` in ``sharding`` (``None``: as it is), moved only when it is not there
    already; an abstract ``x`` as a dummy array (:func:`check_dummy_allowed`)."""
    if is_abstract(x):
        check_dummy_allowed(x)
        return dummy_array(x.shape, x.dtype, sharding)
    if sharding is None or is_placed(x, sharding):
        return x
    return jax.device_put(whole(x), sharding)


def whole(x: Any) -> Any:
    """``x``, or, for a :class:`StackedRows` (rows on several meshes) or a Ray
    ``DistributedArray`` handed to a local step, its value on the host: what a program of
    one local mesh reads it as (a ``DistributedArray`` of a mesh shut down raises, naming
    its mesh, unless it was fetched before)."""
    if isinstance(x, StackedRows) or getattr(x, "is_distributed_array", False):
        return np.asarray(x)
    return x


def is_placed(x: Any, sharding: Any) -> bool:
    """Whether ``x`` is an array already laid out as ``sharding`` asks: the same sharding,
    or an equivalent one (``P()`` and ``P(None, None)``; a 1-device mesh and that device).
    Such an input is used as it is, never copied."""
    if not isinstance(x, jax.Array):
        return False
    current = x.sharding
    return current == sharding or current.is_equivalent_to(sharding, x.ndim)


def leaf_placer(shardings: Sequence[Any]) -> Callable[[list], list]:
    """``place(leaves)``: each leaf in its sharding (``leaves[i]`` in ``shardings[i]``),
    moved with ``jax.device_put`` only when it is not already placed (:func:`is_placed`).
    The sharding an array was last accepted in is remembered per position, so a leaf that
    keeps arriving the same way costs an identity check."""
    accepted: list[Any] = [None] * len(shardings)

    def place(leaves: list) -> list:
        for i, (x, sharding) in enumerate(zip(leaves, shardings, strict=True)):
            if isinstance(x, jax.Array) and x.sharding is accepted[i]:
                continue
            x = leaves[i] = whole(x)
            if is_placed(x, sharding):
                accepted[i] = x.sharding
            else:
                leaves[i] = jax.device_put(x, sharding)
        return leaves

    return place


def caller_placements(split: Any, specs: Sequence[Any], outputs: bool = False) -> list:
    """``specs`` (``PlacementSpec`` s), one per input (or ``outputs``) leaf of the step
    that a ``pipeline_parallel.stacked_rows.RowSplit`` ``split`` made, as one per leaf of
    the caller's. A split leaf's holds its parts' own (``PlacementSpec.rows``: ``place``
    puts each part on its stage's mesh), and, for what places the whole array, the first
    part's mesh and sharding with the row axis whole."""
    if split is None:
        return list(specs)
    counts = split.outputs if outputs else split.inputs
    step = split.original
    avals = [v.aval for v in step.jaxpr.outvars] if outputs else step.in_avals
    out, it = [], iter(specs)
    for i, aval in enumerate(avals):
        rows = [next(it) for _ in range(len(counts[i]) - 1 if i in counts else 1)]
        if i not in counts:
            out.append(rows[0])
            continue
        first = rows[0]
        block = len(first.aval.shape) == len(aval.shape)  # a block keeps its row axis
        out.append(
            dataclasses.replace(
                first,
                aval=aval,
                sharding_specs=tuple(_row_axis_whole(s, block) for s in first.sharding_specs),
                placements=tuple(_with_row_axis(p, block) for p in first.placements),
                rows=tuple(rows),
            )
        )
    return out


def _row_axis_whole(spec, block: bool) -> PartitionSpec:
    """A part's ``PartitionSpec`` for the whole stacked array: a row's with a leading axis
    added, a block's with its leading axis, both not split."""
    return PartitionSpec(None, *(tuple(spec)[1:] if block else tuple(spec)))


def _with_row_axis(placement, block: bool = False):
    """A part's placement (a ``NamedSharding``, or a Ray ``(mesh, Layout)``) for the
    whole stacked array: the same, with a leading axis that is not split."""
    if isinstance(placement, tuple):
        mesh, layout = placement
        return mesh, dataclasses.replace(layout, spec=_row_axis_whole(layout.spec, block))
    return NamedSharding(placement.mesh, _row_axis_whole(placement.spec, block))
