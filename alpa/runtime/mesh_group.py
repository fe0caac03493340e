"""The meshes of a pipelined step as one object: Alpa's ``executable.mesh_group``.

A pipelined executable runs on several physical meshes (one per stage, or per group of
stages). Alpa's scripts reach them through ``executable.mesh_group``: they sync the
workers, read and reset the memory statistics (``alpa.device_memory``), place arguments
where the step reads them (``shard_args_to_arrays``) and index the group by the mesh ids
a ``PlacementSpec`` names (``mesh_group[spec.mesh_ids[0]]``). The meshes are
``DistributedPhysicalDeviceMesh`` es (Ray) or ``LocalPhysicalDeviceMesh`` es (the local
runtime); both answer the same calls.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from alpa.runtime.placement import PlacementSpec, place


class PhysicalMeshGroup:
    """The meshes of one pipelined executable, by the ids its placement specs use."""

    def __init__(self, meshes: Sequence[Any], mesh_ids: Sequence[int]):
        self.meshes = list(meshes)
        self.mesh_ids = list(mesh_ids)
        self._by_id = dict(zip(self.mesh_ids, self.meshes, strict=True))

    def __getitem__(self, mesh_id: int) -> Any:
        """The mesh a placement spec calls ``mesh_id``."""
        try:
            return self._by_id[mesh_id]
        except KeyError:
            raise KeyError(
                f"no mesh {mesh_id!r} in this mesh group; its mesh ids are {self.mesh_ids}"
            ) from None

    def __iter__(self) -> Iterator[Any]:
        return iter(self.meshes)

    def __len__(self) -> int:
        return len(self.meshes)

    def sync_workers(self) -> None:
        """Wait until every computation launched on every mesh has finished."""
        for mesh in self.meshes:
            mesh.sync_workers()

    def get_memory_allocated(self) -> int:
        """Bytes a device holds now, the most over every mesh's devices."""
        return max(mesh.get_memory_allocated() for mesh in self.meshes)

    def get_max_memory_allocated(self) -> int:
        """The most bytes a device of any mesh held since the last reset."""
        return max(self.get_max_memory_allocated_per_mesh())

    def get_max_memory_allocated_per_mesh(self) -> list[int]:
        """Per mesh, the most bytes one of its devices held since the last reset."""
        return [mesh.get_max_memory_allocated() for mesh in self.meshes]

    def reset_memory_stats(self) -> None:
        for mesh in self.meshes:
            mesh.reset_memory_stats()

    def shard_args_to_arrays(
        self, placement_specs: Sequence[PlacementSpec], args: Sequence[Any]
    ) -> list[Any]:
        """Each of ``args`` placed as its placement spec says (on the mesh and in the
        sharding the step reads it in); an abstract one (``jax.ShapeDtypeStruct``) as a
        dummy array made there, under ``global_config.use_dummy_value_for_benchmarking``."""
        if len(placement_specs) != len(args):
            raise ValueError(
                f"shard_args_to_arrays got {len(placement_specs)} placement specs for "
                f"{len(args)} arguments"
            )
        return [place(arg, spec) for spec, arg in zip(placement_specs, args, strict=True)]

    def __repr__(self) -> str:
        return f"PhysicalMeshGroup({self.meshes})"
