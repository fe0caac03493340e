"""Executable: what a parallelized function runs once it is compiled.

Every parallel method compiles a :class:`~alpa.tracing.TracedStep` into an ``Executable``.
A call reaches it one of two ways:

* **a cache hit** (the call looks like the last one): ``ParallelizedFunc`` hands the dynamic
  arguments, as the user's pytrees, to :meth:`Executable.dispatch`. For a one-mesh
  executable that is XLA's compiled program itself, whose C++ fast path checks the
  arguments, places host and uncommitted arrays and runs, as a ``jax.jit`` call does.
  A dispatch raises ``TypeError`` / ``ValueError`` *before running anything* when the
  arguments are not what it was compiled for (other shapes, a committed array in a
  sharding that is not equivalent to the planned one); the caller then takes the slow path.
* **the slow path**: ``ParallelizedFunc`` builds the full cache key, compiles if needed, and
  calls :meth:`Executable.launch` on the flat leaves, which first places every leaf that is
  not already in a sharding equivalent to the planned one.

The executable owns where every leaf lives (its placement specs) and its compiled programs.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from alpa.tracing import TracedStep, leaf_signature


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
    """

    aval: Any
    mesh_ids: tuple[int, ...]
    sharding_specs: tuple[Any, ...]
    placements: tuple[Any, ...] = field(default=(), compare=False)


def place(value: Any, spec: PlacementSpec) -> Any:
    """``value`` (a host or device array) placed where ``spec`` says the step reads it: on
    its first mesh, which is where the executable takes it from (a leaf read by several
    stages is copied to the others by the step). Local: a ``jax.Array`` in the planned
    sharding (not copied when it already is, :func:`is_placed`); Ray: a
    ``DistributedArray`` on the mesh's workers."""
    if not spec.placements:
        raise ValueError(f"no mesh holds a leaf of {spec.aval}: there is nowhere to place it")
    target = spec.placements[0]
    if isinstance(target, tuple):  # Ray: (mesh, Layout)
        mesh, layout = target
        if getattr(value, "is_distributed_array", False) and value.mesh is mesh:
            if value.layout == layout:
                return value
        return mesh.put(np.asarray(value), layout)
    if is_placed(value, target):
        return value
    return jax.device_put(value, target)


class Executable(abc.ABC):
    """A compiled step. Subclasses: ``MeshExecutable`` (one mesh) and the pipeshard one."""

    traced: TracedStep

    @abc.abstractmethod
    def launch(self, flat_args: Sequence[Any]) -> list[jax.Array]:
        """Run one step on flat dynamic leaves (full batch); return flat outputs."""

    @abc.abstractmethod
    def dispatch(self, *dynamic_args: Any) -> Any:
        """Run one step on the dynamic arguments as pytrees; return the output pytree.

        Raises ``TypeError`` or ``ValueError`` before running anything when the arguments
        are not those it was compiled for (see the module docstring)."""

    def __call__(self, *dynamic_args: Any) -> Any:
        """Run one step on the dynamic arguments (those ``get_executable`` was given,
        static ones left out), placing them first: Alpa's ``executable(*args)``."""
        return self.placing_dispatch()(*dynamic_args)

    def placing_dispatch(self) -> Any:
        """A :meth:`dispatch` that first places leaves whose sharding is not equivalent to
        the planned one (for callers whose inputs keep arriving elsewhere)."""
        in_tree = self.traced.in_tree
        place = leaf_placer(self.flat_input_shardings())

        def placing(*dynamic_args):
            leaves, tree = jax.tree.flatten(dynamic_args)
            if tree != in_tree:
                raise TypeError(f"pytree structure {tree} differs from the compiled {in_tree}")
            return self.dispatch(*jax.tree.unflatten(in_tree, place(leaves)))

        return placing

    def flat_input_shardings(self) -> list[Any]:
        """Per dynamic leaf, the ``jax.sharding.Sharding`` a step wants it in."""
        raise NotImplementedError(f"{type(self).__name__} has no single input placement")

    @abc.abstractmethod
    def preshard_flat_args(self, flat_args: Sequence[Any]) -> list[Any]:
        """Place flat leaves where :meth:`launch` wants them, without running."""

    @abc.abstractmethod
    def flat_input_placement_specs(self) -> list[PlacementSpec]: ...

    @abc.abstractmethod
    def flat_output_placement_specs(self) -> list[PlacementSpec]: ...

    @abc.abstractmethod
    def get_hlo_text(self) -> str | list[str]: ...

    @abc.abstractmethod
    def dump_debug_info(self, folder: str) -> None: ...

    def sync(self) -> None:
        """Wait until every computation launched so far has finished."""
        for array in jax.tree.leaves(getattr(self, "_last_outputs", ())):
            if isinstance(array, jax.Array) and not array.is_deleted():
                array.block_until_ready()

    def get_parallel_plan(self):
        """Every decision of this compile (mesh, shardings; for a pipeline its layers and
        stages) as a serializable ``alpa.ParallelPlan``; ``alpa.plan_to_method(plan)``
        compiles it again without the ILP or the stage DP."""
        from alpa.parallel_plan import ParallelPlan  # the record sits above the passes

        return ParallelPlan.of(self)

    def get_input_placement_specs(self):
        """A pytree like the dynamic arguments, one ``PlacementSpec`` per leaf."""
        specs = self.flat_input_placement_specs()
        return jax.tree.unflatten(self.traced.in_tree, specs)

    def get_output_placement_specs(self):
        """A pytree like the output, one ``PlacementSpec`` per leaf."""
        return jax.tree.unflatten(self.traced.out_tree, self.flat_output_placement_specs())


def check_dispatch_args(
    traced: TracedStep, dynamic_args: Sequence[Any], signatures: Sequence[tuple]
) -> list[Any]:
    """The flat leaves of ``dynamic_args``, after checking they are what the step was
    compiled for (``TypeError`` otherwise, before anything runs: see the module
    docstring)."""
    leaves, tree = jax.tree.flatten(dynamic_args)
    if tree != traced.in_tree:
        raise TypeError(f"pytree {tree} differs from the compiled {traced.in_tree}")
    for x, signature in zip(leaves, signatures, strict=True):
        if leaf_signature(x) != signature:
            raise TypeError(f"argument {leaf_signature(x)} differs from the compiled {signature}")
    return leaves


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
            if is_placed(x, sharding):
                accepted[i] = x.sharding
            else:
                leaves[i] = jax.device_put(x, sharding)
        return leaves

    return place
