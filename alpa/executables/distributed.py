"""DistributedMeshExecutable: a one-mesh step (ShardParallel, DataParallel, ZeRO) on Ray.

The driver lowers the same step function the local ``MeshExecutable`` compiles
(``lowering.build_step_function``), but for an **abstract** mesh of the plan's logical
shape, and serializes it with ``jax.export`` (:func:`export_program`): the driver needs
no device of the workers' kind. Each worker of the mesh deserializes the program and
compiles it on its own devices (``runtime/ray_worker.py``); a step is one message per
worker (``runtime/ray_launch.py``). Outputs come back as ``DistributedArray`` s and feed
the next step without leaving the workers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, NamedSharding

from alpa.executables.base import Executable, check_dispatch_args
from alpa.executables.mesh import PricedPlan
from alpa.runtime.placement import PlacementSpec, place
from alpa.runtime.ray_launch import MeshOutput, RayStepLauncher
from alpa.runtime.ray_mesh import DistributedPhysicalDeviceMesh
from alpa.runtime.worker_program import (
    ExportedFn,
    Layout,
    WorkerInstruction,
    WorkerOp,
    WorkerProgram,
)
from alpa.shard_parallel.lowering.compile import full_batch_avals
from alpa.shard_parallel.lowering.step_function import build_step_function
from alpa.shard_parallel.sharding_plan import ShardingPlan
from alpa.tracing import TracedStep, leaf_signature

#: ``jax.export`` platform names of a cluster's platform.
_EXPORT_PLATFORMS = {"gpu": ("cuda",), "cpu": ("cpu",)}


def abstract_mesh(shape: Sequence[int], axis_names: Sequence[str]) -> AbstractMesh:
    return AbstractMesh(tuple(shape), tuple(axis_names), axis_types=(AxisType.Auto,) * len(shape))


def export_program(
    name: str,
    fn: Callable,
    in_layouts: Sequence[Layout],
    out_layouts: Sequence[Layout | None],
    avals: Sequence[Any],
    donate_argnums: Sequence[int],
    platform: str,
) -> ExportedFn:
    """``fn`` (flat arrays in, a list out) jitted with these layouts on an abstract mesh
    and serialized by ``jax.export`` for the workers' platform. An output layout ``None``
    leaves that output's sharding to XLA, as the local executable does."""

    def sharding(layout: Layout | None):
        if layout is None:
            return None
        return NamedSharding(abstract_mesh(layout.mesh_shape, layout.axis_names), layout.spec)

    jitted = jax.jit(
        fn,
        in_shardings=[sharding(layout) for layout in in_layouts],
        out_shardings=[sharding(layout) for layout in out_layouts],
        donate_argnums=tuple(donate_argnums),
    )
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    return ExportedFn(
        name=name,
        serialized=serialize_jitted(jitted, structs, platform),
        in_layouts=tuple(in_layouts),
        out_layouts=tuple(out_layouts),
        donate_argnums=tuple(donate_argnums),
    )


def serialize_jitted(jitted, structs: Sequence[Any], platform: str) -> bytes:
    """``jax.export`` of an already jitted function for the workers' platform."""
    structs = [
        jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding, weak_type=s.weak_type)
        for s in structs
    ]
    return bytes(
        jax.export.export(jitted, platforms=_EXPORT_PLATFORMS[platform])(*structs).serialize()
    )


class DistributedMeshExecutable(PricedPlan, Executable):
    """A step compiled for one mesh of Ray workers (see the module docstring)."""

    def __init__(
        self,
        traced: TracedStep,
        plan: ShardingPlan,
        mesh: DistributedPhysicalDeviceMesh,
        num_micro_batches: int | None,
    ):
        """The runtime plans the tiles of an argument that lives on another mesh itself
        (``runtime.resharding.worker_transfer_plan``, the one tile planner)."""
        self.traced = traced
        self.plan = plan
        self.mesh = mesh
        self.num_micro_batches = num_micro_batches
        logical = plan.logical_mesh
        axis_names = tuple(logical.axis_names)
        inner = build_step_function(
            traced, plan, abstract_mesh(logical.shape, axis_names), num_micro_batches
        )

        def step(*leaves):
            return list(inner(*leaves))

        self.in_layouts = [Layout(logical.shape, axis_names, s) for s in plan.in_specs]
        out_layouts = [
            None if s is None else Layout(logical.shape, axis_names, s) for s in plan.out_specs
        ]
        avals = full_batch_avals(traced, num_micro_batches)
        self._signatures = [leaf_signature(a) for a in avals]
        donated = [i for i, d in enumerate(traced.donated_invars) if d]
        fn = export_program(
            traced.name,
            step,
            self.in_layouts,
            out_layouts,
            avals,
            donated,
            mesh.cluster.platform,
        )
        num_in = len(avals)
        instructions = [
            WorkerInstruction(WorkerOp.INPUT, out_slots=(i,), arg=i, layout=layout)
            for i, layout in enumerate(self.in_layouts)
        ]
        outvars = traced.jaxpr.outvars
        out_slots = tuple(range(num_in, num_in + len(outvars)))
        instructions.append(
            WorkerInstruction(
                WorkerOp.RUN,
                in_slots=tuple(range(num_in)),
                out_slots=out_slots,
                fn=0,
                free=tuple(range(num_in)),
            )
        )
        program = WorkerProgram((fn,), tuple(instructions), num_in + len(outvars), out_slots)
        outputs = [
            MeshOutput(tuple(v.aval.shape), v.aval.dtype, bool(v.aval.weak_type), layout)
            for v, layout in zip(outvars, out_layouts, strict=True)
        ]
        self.launcher = RayStepLauncher(
            [mesh],
            [program],
            [list(enumerate(self.in_layouts))],
            [outputs],
            frozenset(donated),
        )
        self._last_outputs: Any = ()

    # -- running

    def dispatch(self, *dynamic_args: Any) -> Any:
        leaves = check_dispatch_args(self.traced, dynamic_args, self._signatures)
        return jax.tree.unflatten(self.traced.out_tree, self._run(leaves))

    def placing_dispatch(self) -> Any:
        return self.dispatch  # the workers place every argument as the program says

    def launch(self, flat_args: Sequence[Any]) -> list:
        return self._run(flat_args)

    def _run(self, flat_args: Sequence[Any]) -> list:
        outputs = self.launcher.launch(flat_args)[0]
        self._last_outputs = outputs
        return outputs

    def sync(self) -> None:
        """Steps on Ray return when every worker finished; nothing is left to wait for."""

    def step_seconds(self) -> list[list[float]]:
        return self.launcher.mesh_step_seconds

    def get_total_allocation_size(self) -> int:
        """Bytes one device allocates for this step (arguments, outputs, temporaries), from
        XLA's memory analysis as the mesh's first worker compiled it."""
        return self.mesh.call("allocation_size", self.launcher.program_id)[0]

    @property
    def physical_mesh(self):
        """Alpa's name of the mesh the step runs on (its workers: ``.workers``)."""
        return self.mesh

    @property
    def bytes_sent_last_step(self) -> int:
        """Bytes the driver sent for the last step (host inputs and messages)."""
        return self.launcher.bytes_sent_last_step

    def preshard_flat_args(self, flat_args: Sequence[Any]) -> list[Any]:
        """Each leaf as a ``DistributedArray`` on the mesh, laid out as the step reads it
        (Alpa's ``preshard_dynamic_args``): a step then sends none of them."""
        return [
            place(x, spec)
            for x, spec in zip(flat_args, self.flat_input_placement_specs(), strict=True)
        ]

    # -- what was compiled

    def _placement(self, avals, layouts) -> list[PlacementSpec]:
        return [
            PlacementSpec(aval, (self.mesh.mesh_id,), (layout.spec,), ((self.mesh, layout),))
            for aval, layout in zip(avals, layouts, strict=True)
        ]

    def flat_input_placement_specs(self) -> list[PlacementSpec]:
        avals = full_batch_avals(self.traced, self.num_micro_batches)
        return self._placement(avals, self.in_layouts)

    def flat_output_placement_specs(self) -> list[PlacementSpec]:
        avals = [v.aval for v in self.traced.jaxpr.outvars]
        layouts = [out.layout for out in self.launcher.mesh_outputs[0]]
        return self._placement(avals, layouts)

    def get_hlo_text(self) -> str:
        """The optimized HLO as the first worker compiled it."""
        return self.mesh.call("hlo_text", self.launcher.program_id, 0)[0]

    def get_peak_memory_per_mesh(self) -> list[int]:
        """Per mesh (one here), the peak bytes a device of it allocated."""
        return [max(self.mesh.call("peak_memory"))]

    def dump_debug_info(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{self.traced.name}.hlo.txt"), "w") as f:
            f.write(self.get_hlo_text())
