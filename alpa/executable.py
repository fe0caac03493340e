"""Executable: what a parallelized function runs once it is compiled.

Every parallel method compiles a :class:`~alpa.tracing.TracedStep` into an ``Executable``.
``ParallelizedFunc`` flattens the call's dynamic arguments into leaves, hands them to
:meth:`Executable.launch`, and rebuilds the output pytree from the flat outputs. The
executable owns where every leaf lives (its placement specs) and its compiled programs.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax

from alpa.tracing import TracedStep


@dataclass(frozen=True)
class PlacementSpec:
    """Where one leaf lives: its abstract value, the meshes and the sharding on each."""

    aval: Any
    mesh_ids: tuple[int, ...]
    sharding_specs: tuple[Any, ...]


class Executable(abc.ABC):
    """A compiled step. Subclasses: ``MeshExecutable`` (one mesh) and the pipeshard one."""

    traced: TracedStep

    @abc.abstractmethod
    def launch(self, flat_args: Sequence[Any]) -> list[jax.Array]:
        """Run one step on flat dynamic leaves (full batch); return flat outputs."""

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
        for array in getattr(self, "_last_outputs", ()):
            array.block_until_ready()

    def get_input_placement_specs(self):
        """A pytree like the dynamic arguments, one ``PlacementSpec`` per leaf."""
        specs = self.flat_input_placement_specs()
        return jax.tree.unflatten(self.traced.in_tree, specs)

    def get_output_placement_specs(self):
        """A pytree like the output, one ``PlacementSpec`` per leaf."""
        return jax.tree.unflatten(self.traced.out_tree, self.flat_output_placement_specs())
