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
import weakref
from collections.abc import Sequence
from typing import Any

import jax

from alpa.record.parallel_plan import ParallelPlan
from alpa.runtime.placement import PlacementSpec, leaf_placer
from alpa.runtime.stacked_array import StackedRows
from alpa.tracing import TracedStep, leaf_signature


class Executable(abc.ABC):
    """A compiled step. Subclasses: ``MeshExecutable`` (one mesh), ``DistributedMeshExecutable``
    (one Ray mesh) and the pipelined ones (``pipeshard_base.PipeshardExecutable``)."""

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

    @property
    def _last_outputs(self) -> list[Any]:
        """The last step's output arrays that the caller still holds: the executable keeps
        only weak references, so that an output the caller drops (a state, a loss) is
        freed, here and on Ray workers, as soon as the caller lets go of it."""
        refs = self.__dict__.get("_last_output_refs", ())
        return [x for x in (ref() for ref in refs) if x is not None]

    @_last_outputs.setter
    def _last_outputs(self, outputs: Any) -> None:
        refs = []
        leaves = jax.tree.leaves(outputs)
        # A pipeline's split leaf: the arrays of its parts are what was computed.
        leaves += [r for x in leaves if isinstance(x, StackedRows) for r in x.rows]
        for x in leaves:
            try:
                refs.append(weakref.ref(x))
            except TypeError:  # a Python scalar output: nothing to wait for or free
                continue
        self.__dict__["_last_output_refs"] = refs

    def sync(self) -> None:
        """Wait until the computations of the last step whose outputs are still held have
        finished."""
        for array in self._last_outputs:
            if isinstance(array, jax.Array) and not array.is_deleted():
                array.block_until_ready()

    def hit_dispatch(self, placing: bool) -> Any:
        """What a cache hit of the parallelized function calls (``call_cache``):
        :meth:`dispatch`, or with ``placing`` :meth:`placing_dispatch`."""
        return self.placing_dispatch() if placing else self.dispatch

    def step_seconds(self) -> list[list[float]]:
        """Per step this executable ran and timed, per mesh, its seconds (see
        :meth:`get_execution_time_costs`)."""
        return getattr(self, "_step_seconds", [])

    def get_execution_time_costs(
        self, timer_name: str | None = None, return_all_costs: bool = False
    ) -> list:
        """Alpa's step timer: the seconds each step this executable ran took, in order
        (Alpa's benchmarks drop the first, warm-up ones); with ``return_all_costs``, per
        mesh the list of its seconds. A step's time is its slowest mesh's. On Ray each
        mesh's workers time their part of every step (from its arguments to its outputs
        computed); on the local runtime a step is timed from its call until its outputs
        are computed, while ``global_config.shard_parallel_sync_for_timer`` (one mesh) or
        ``pipeline_sync_for_timer`` (a pipeline) is set, and not otherwise (a step is
        then XLA's asynchronous dispatch, whose time says nothing of the computation)."""
        if timer_name not in (None, "overall"):
            raise ValueError(
                f"timer_name={timer_name!r}: an executable times whole steps, its only timer "
                "is 'overall' (or None)"
            )
        steps = self.step_seconds()
        if return_all_costs:
            return [list(mesh) for mesh in zip(*steps, strict=True)]
        return [max(step) for step in steps]

    def sync_move_workers(self) -> None:
        """Alpa's: wait for the checkpoint shards that a save with ``local_cache_dir``
        left moving in the background. A save here writes straight to the checkpoint
        folder and is done when it returns, so there is nothing to wait for."""
        return None

    def get_parallel_plan(self):
        """Every decision of this compile (mesh, shardings; for a pipeline its layers and
        stages) as a serializable ``alpa.ParallelPlan``; ``alpa.plan_to_method(plan)``
        compiles it again without the ILP or the stage DP."""
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
