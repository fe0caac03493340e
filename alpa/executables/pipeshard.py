"""PipeshardDriverExecutable: a step compiled into pipeline stages on submeshes.

``PipeshardParallel`` makes a ``PipeshardPlan`` (``pipeshard_passes.plan_pipeshard``: layers,
stages, split, per-stage shardings, schedule, instructions; no device touched) and hands
it to :class:`PipeshardDriverExecutable`, which compiles the plan's computations on the
devices of each submesh and runs them with the local runtime.

Each stage computation is compiled with ``jax.jit`` on its own submesh
(``stage_programs.StagePrograms``), with the shardings the intra-op pass chose for that
stage (``stage_sharding``): the auto-sharding ILP on the stage's logical submesh, data
parallel with ``force_data_parallel=True``, or XLA's propagation from the user's pins with
auto-sharding off (``propagated_stages``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from alpa.device_mesh import LocalPhysicalDeviceMesh, make_jax_mesh
from alpa.executables.base import check_dispatch_args
from alpa.executables.pipeshard_base import PipeshardExecutable
from alpa.executables.stage_programs import StagePrograms, hlo_order
from alpa.global_env import global_config
from alpa.pipeline_parallel.pipeshard_plan import PipeshardPlan
from alpa.pipeline_parallel.program.computation import StageComputation
from alpa.pipeline_parallel.program.stage_sharding import DATA_AXES
from alpa.pipeline_parallel.program.user_shardings import input_names
from alpa.pipeline_parallel.scheduling import plan_view
from alpa.runtime.instructions import (
    ConstOutput,
    Kernel,
    Op,
    donated_inputs,
    simulate_memory,
)
from alpa.runtime.local_runtime import LocalPipelineRuntime, RuntimeContext
from alpa.runtime.memory import allocation_bytes, device_peak_bytes, step_peak_bytes
from alpa.runtime.mesh_group import PhysicalMeshGroup
from alpa.runtime.placement import PlacementSpec, is_abstract, place_leaf
from alpa.xla_compile import compile_lowered, hlo_text


class PipeshardDriverExecutable(PipeshardExecutable):
    """Runs a pipelined step on local submeshes (the driver runs every mesh's program)."""

    def __init__(self, plan: PipeshardPlan, devices: Sequence[Any]):
        super().__init__(plan)
        traced, program, stage_plan = plan.traced, plan.program, plan.stage_plan
        instructions, names = plan.instructions, plan.names
        self._names = names
        self._var_of = {name: v for v, name in names.items()}
        self.options = list(plan.options)
        self.devices = list(devices)  # the devices the stage plan's device ranges index
        self.meshes = [
            make_jax_mesh(devices[a:b], logical.shape, DATA_AXES)
            for (a, b), logical in zip(stage_plan.device_ranges, plan.logical_meshes, strict=True)
        ]
        self.stage_objectives = plan.objectives
        self.stage_programs = StagePrograms(plan, self.meshes)
        # The state a step replaces is donated where its last reader runs (the apply).
        donated = {
            names[v] for v, d in zip(traced.jaxpr.invars, traced.donated_invars, strict=True) if d
        }
        self._donated = donated_inputs(instructions, donated)
        self._kernels = [
            self._compile_kernel(kernel, self._donated.get(k, ()))
            for k, kernel in enumerate(instructions.kernels)
        ]
        self._compiled: dict[int, Any] = {
            kernel.computation: compiled
            for kernel, compiled in zip(instructions.kernels, self._kernels, strict=True)
        }
        self._zeros: dict[tuple, Any] = {}
        # The program's inputs: the step's leaves, then the row ids of its random draws.
        inputs = program.closed_jaxpr.jaxpr.invars
        leaf_index = {names[v]: i for i, v in enumerate(inputs)}
        micro = [
            a.shape[0] if b and a.shape else None
            for a, b in zip(traced.in_avals, traced.batch_invars, strict=True)
        ]
        if program.row_ids is not None:
            micro.append(program.row_ids.aval.shape[0])
        kernel_names = [program.computations[k.computation].name for k in instructions.kernels]
        context = RuntimeContext(
            kernels=self._kernels,
            allocs=self._alloc,
            sharding_of=self._key_sharding,
            micro_batch_size=micro,
            kernel_names=kernel_names,
            shape_of=lambda key: tuple(self._var_of[key[0]].aval.shape),
            in_flight_limit=2 if devices[0].platform == "cpu" else None,
        )
        reshard_bytes = {i: p.nbytes() for i, p in plan.reshards.items()}
        self.runtime = LocalPipelineRuntime(instructions, context, leaf_index, reshard_bytes)
        self._const_outputs = self.stage_programs.const_outputs(
            {o.name for o in instructions.outputs if isinstance(o, ConstOutput)}
        )
        self._step_seconds: list[list[float]] = []
        # Alpa's mesh_group: each submesh's devices, by the mesh ids of the placement specs.
        self.mesh_group = PhysicalMeshGroup(
            [LocalPhysicalDeviceMesh(list(m.devices.flat)) for m in self.meshes],
            range(len(self.meshes)),
        )
        # Per leaf split by rows, where its parts live: one array where a sharding says it.
        if self._row_split is not None:
            self._in_layouts = _layouts(self.flat_input_placement_specs())
            self._out_layouts = _layouts(self.flat_output_placement_specs())

    # -- compilation

    def _sharding(self, var, mesh: int) -> NamedSharding:
        return self.stage_programs.sharding(var, mesh)

    def _key_sharding(self, key) -> NamedSharding:
        return self.stage_programs.key_sharding(key)

    def _alloc(self, keys) -> Any:
        """A compiled function returning zeros for the buffers ``keys`` (accumulators)."""
        shardings = tuple(self._key_sharding(key) for key in keys)
        avals = [self._var_of[key[0]].aval for key in keys]
        signature = (tuple((a.shape, a.dtype) for a in avals), shardings)
        if signature not in self._zeros:
            self._zeros[signature] = compile_lowered(
                self.stage_programs.zeros(keys).lower(), self.devices[0].platform
            )
        return self._zeros[signature]

    def _compile_kernel(self, kernel: Kernel, donate: Sequence[int] = ()):
        jitted, structs, _ = self.stage_programs.kernel(kernel, donate)
        return compile_lowered(jitted.lower(*structs), self.devices[0].platform)

    def _compile(self, comp: StageComputation):
        jitted, structs, _ = self.stage_programs.computation(comp)
        return compile_lowered(jitted.lower(*structs), self.devices[0].platform)

    # -- Executable interface

    def dispatch(self, *dynamic_args: Any) -> Any:
        leaves = check_dispatch_args(self.traced, dynamic_args, self._signatures)
        try:
            outputs = self._run(leaves)
        except (TypeError, ValueError) as e:
            # The caller reads these as "not my arguments" (nothing ran); from here on a
            # step was under way, so it must not be retried as if it had not run.
            raise RuntimeError(f"{self.traced.name}: pipeline step failed: {e}") from e
        return jax.tree.unflatten(self.traced.out_tree, outputs)

    def launch(self, flat_args: Sequence[Any]) -> list[jax.Array]:
        self._check_batch(flat_args)
        return self._run(flat_args)

    def _run(self, flat_args: Sequence[Any]) -> list:
        if any(is_abstract(x) for x in flat_args):  # dummy values, made where they are read
            flat_args = self.preshard_flat_args(flat_args)
        return super()._run(flat_args)

    def _execute(self, args: Sequence[Any], trace: bool) -> list:
        timed = global_config.pipeline_sync_for_timer
        if timed:
            self.sync()
        tic = time.perf_counter()
        outputs = self.runtime.run(args, self._const_outputs, blocking=trace)
        if timed:
            jax.block_until_ready(outputs)
            self._step_seconds.append([time.perf_counter() - tic])
        return outputs

    def _record_trace(self) -> None:
        """The last step's stage computations, each waited for, into ``stage_trace``."""
        to_wall = time.time() - time.perf_counter()  # the runtime's clock is perf_counter
        instructions = self.instructions
        for ins, event in zip(instructions.instructions, self.runtime.events, strict=True):
            if ins.op is Op.RUN:
                computation = instructions.kernels[ins.computation].computation
                self.stage_trace.add(computation, event.start + to_wall, event.end + to_wall)

    def _stage_devices(self, computation: int) -> tuple[tuple, tuple]:
        stage = self.program.computations[computation].stage
        return (0,), tuple(self.meshes[stage].devices.flat)

    def _check_batch(self, flat_args) -> None:
        k = self.num_micro_batches
        for i, (arg, aval, is_batch) in enumerate(
            zip(flat_args, self.traced.in_avals, self.traced.batch_invars, strict=True)
        ):
            if is_batch and np.shape(arg)[0] != aval.shape[0] * k:
                raise ValueError(
                    f"{self.traced.leaf_names[i]} has batch size {np.shape(arg)[0]} but the "
                    f"step was compiled for {aval.shape[0] * k} ({k} micro-batches of "
                    f"{aval.shape[0]})"
                )

    def preshard_flat_args(self, flat_args: Sequence[Any]) -> list[Any]:
        out = []
        step = self.plan.traced
        split = self._row_split
        args = flat_args if split is None else split.split_args(flat_args, self._in_layouts)
        for v, arg, is_batch in zip(step.jaxpr.invars, args, step.batch_invars, strict=True):
            sharding = None if is_batch else self._sharding(v, self.program.input_stages[v][0])
            out.append(place_leaf(arg, sharding))
        return out if split is None else split.join_inputs(out, self._in_layouts)

    def _placement(self, var, meshes) -> PlacementSpec:
        shardings = tuple(self._sharding(var, m) for m in meshes)
        return PlacementSpec(var.aval, tuple(meshes), tuple(s.spec for s in shardings), shardings)

    def get_stage_input_names(self) -> list[list[str]]:
        """Per stage, its inputs (what its forward and backward read from outside), in the
        order ``PipeshardParallel(stage_input_shardings=...)`` takes their specs."""
        return input_names(self.program, self.plan.traced, self._names)

    def _compiled_computation(self, index: int):
        """The compiled program of computation ``index`` (its kernel's, if a RUN calls it)."""
        if index not in self._compiled:
            self._compiled[index] = self._compile(self.program.computations[index])
        return self._compiled[index]

    def get_hlo_text(self) -> list[str]:
        """One HLO module per stage computation, as a ``RUN`` calls it (a backward takes its
        gradients' running sums first), in Alpa's order: the forwards by stage, the
        backwards as the first micro-batch runs them (the last stage's first), then
        apply-grad by stage."""
        return [hlo_text(self._compiled_computation(i)) for i in hlo_order(self.program)]

    def get_hlo_names(self) -> list[str]:
        """The name of each program ``get_hlo_text`` returns, in its order
        (``stage1_backward``)."""
        return [self.program.computations[i].name for i in hlo_order(self.program)]

    def get_stage_allocation_size(self) -> list[int]:
        """Per stage computation, the bytes XLA allocates per device (args + temps + outputs)."""
        return [
            allocation_bytes(self._compiled_computation(i))
            for i in range(len(self.program.computations))
        ]

    def get_peak_memory_per_mesh(self) -> list[int]:
        """Per stage mesh, the peak bytes a device of it allocated: the allocator's
        figure where the platform keeps one (GPU), else XLA's estimate for the largest
        program the mesh runs (arguments + outputs + temporaries)."""
        sizes = self.get_stage_allocation_size()
        peaks = []
        for mesh, jax_mesh in enumerate(self.meshes):
            measured = device_peak_bytes(list(jax_mesh.devices.flat))
            estimate = max(
                (
                    n
                    for n, c in zip(sizes, self.program.computations, strict=True)
                    if c.stage == mesh
                ),
                default=0,
            )
            peaks.append(measured or estimate)
        return peaks

    def get_step_memory_per_mesh(self) -> list[int]:
        """Per stage mesh, the most bytes a device of it holds at once during a step,
        from XLA's memory analysis of each program it runs plus the buffers the step
        holds around it (``runtime.memory.step_peak_bytes``); compare with
        ``plan.cost.memory``, the cost model's prediction of the same."""

        def buffer_bytes(key) -> int:
            aval = self._var_of[key[0]].aval
            shard = self._key_sharding(key).shard_shape(aval.shape)
            return int(np.prod(shard)) * aval.dtype.itemsize

        return step_peak_bytes(
            self.instructions,
            buffer_bytes,
            lambda k: allocation_bytes(self._kernels[k]),
            self._donated,
        )

    def _kernel_rows(self, figures) -> list[dict]:
        """Per compiled program a ``RUN`` calls: its computation's ``name``, ``stage`` and
        ``kind`` (forward, backward, apply), and ``figures(kernel index, compiled)``."""
        rows = []
        for k, (kernel, compiled) in enumerate(
            zip(self.instructions.kernels, self._kernels, strict=True)
        ):
            computation = self.program.computations[kernel.computation]
            rows.append(
                {
                    "name": computation.name,
                    "stage": computation.stage,
                    "kind": computation.kind,
                    **figures(k, compiled),
                }
            )
        return rows

    def get_kernel_memory(self) -> list[dict]:
        """Per compiled program a ``RUN`` calls, XLA's memory analysis on one device
        (:meth:`_kernel_rows`): the bytes of its ``arguments``, ``outputs``,
        ``temporaries`` and ``aliased`` outputs, the terms
        :meth:`get_step_memory_per_mesh` adds up."""

        def figures(_, compiled) -> dict:
            stats = compiled.memory_analysis()
            return {
                "arguments": int(stats.argument_size_in_bytes),
                "outputs": int(stats.output_size_in_bytes),
                "temporaries": int(stats.temp_size_in_bytes),
                "aliased": int(stats.alias_size_in_bytes),
            }

        return self._kernel_rows(figures)

    def get_kernel_costs(self) -> list[dict]:
        """Per compiled program a ``RUN`` calls, XLA's cost analysis on one device
        (:meth:`_kernel_rows`): ``runs`` (how many ``RUN`` s of one step call it),
        ``flops`` and ``bytes_accessed`` per run. ``sum(runs * flops)`` over the programs
        is the step's work per device, to set beside the same step under ``jax.jit``."""
        runs = [0] * len(self._kernels)
        for ins in self.instructions.instructions:
            if ins.op is Op.RUN:
                runs[ins.computation] += 1

        def figures(k, compiled) -> dict:
            stats = compiled.cost_analysis()
            return {
                "runs": runs[k],
                "flops": float(stats.get("flops", 0.0)),
                "bytes_accessed": float(stats.get("bytes accessed", 0.0)),
            }

        return self._kernel_rows(figures)

    def get_peak_live_bytes(self) -> list[int]:
        """Per mesh, the peak bytes of buffers a step creates (the emitter's accounting)."""
        return simulate_memory(self.instructions)

    def get_resharded_bytes(self) -> int:
        """Bytes the last step moved between meshes (``RESHARD``), counted by the tile
        planner: each piece of a value once per destination host."""
        return self.runtime.resharded_bytes

    def last_step_blocks(self) -> list:
        """The last step as it ran: per instruction a ``plan_view.Block`` on its mesh
        (``stage`` is the stage's mesh, ``mesh`` its devices' where stages share them),
        from the runtime's events (dispatch times, or with
        ``collect_trace`` set before the step each instruction waited for), seconds from
        the step's start; a ``RUN`` by its computation's kind (forward, backward, apply),
        ``LOAD`` / ``RESHARD`` / ``ALLOC`` as ``"transfer"``."""
        events = self.runtime.events
        if not events:
            raise RuntimeError(f"{self.traced.name}: no step has run yet; nothing to show")
        base = events[0].start
        blocks = []
        instructions = self.instructions
        for ins, event in zip(instructions.instructions, events, strict=True):
            kind = "transfer"
            if ins.op is Op.RUN:
                kernel = instructions.kernels[ins.computation]
                kind = self.program.computations[kernel.computation].kind
            mesh = instructions.physical_mesh(ins.mesh) if instructions.stage_meshes else None
            blocks.append(
                plan_view.Block(
                    ins.mesh, kind, ins.micro_batch, event.start - base, event.end - base, mesh
                )
            )
        return blocks

    def draw_last_step(self, path: str, dpi: int = 100):
        """The last step as it ran (:meth:`last_step_blocks`), in the picture
        ``self.plan.draw`` makes of the plan (``plan_view``), so the two lie side by side."""
        blocks = self.last_step_blocks()
        events = self.runtime.events
        instructions = self.instructions
        waited = all(e.returned is not None for e in events)
        plan = self.plan
        return plan_view.draw_blocks(
            path,
            blocks,
            instructions.num_physical_meshes,
            plan.stage_plan.device_ranges,
            plan.num_hosts,
            plan.num_devices_per_host,
            title=f"{self.traced.name}: the last step as run",
            heading=(
                f"{plan.schedule.name}, {len(instructions.instructions)} instructions "
                f"({'each waited for' if waited else 'dispatch times'})"
            ),
            logical_shapes=[tuple(m.shape) for m in plan.logical_meshes],
            dpi=dpi,
        )

    def dump_stage_execution_trace(self, path: str) -> None:
        """Write the last step as a Chrome trace (opens in Perfetto or chrome://tracing).

        Times are dispatch times unless ``collect_trace`` was set before the step, in which
        case every computation was waited for.
        """
        events = []
        base = min((e.start for e in self.runtime.events), default=0.0)
        for e in self.runtime.events:
            events.append(
                {
                    "name": e.name,
                    "ph": "X",
                    "pid": 0,
                    "tid": e.mesh,
                    "ts": (e.start - base) * 1e6,
                    "dur": (e.end - e.start) * 1e6,
                    "args": e.args,
                }
            )
        for mesh in range(len(self.meshes)):
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": 0,
                    "tid": mesh,
                    "args": {"name": f"mesh {mesh}"},
                }
            )
        with open(path, "w") as f:
            json.dump({"traceEvents": events}, f)

    def _dump_programs(self, folder: str) -> None:
        """The instructions (``instructions.txt``) and each stage program's HLO."""
        with open(os.path.join(folder, "instructions.txt"), "w") as f:
            f.write("\n".join(str(i) for i in self.instructions.instructions) + "\n")
        for name, text in zip(self.get_hlo_names(), self.get_hlo_text(), strict=True):
            with open(os.path.join(folder, f"{name}.hlo"), "w") as f:
                f.write(text)

    def peak_live_micro_batches(self) -> list[int]:
        """Per mesh, the most micro-batches whose activations (or cotangents) the last
        step held on it at once, counted by the runtime as it ran: a schedule's in-flight
        bound (``PipelineSchedule.max_in_flight``) as executed."""
        return list(self.runtime.peak_live_micro_batches)

    def live_buffers_after_step(self) -> list:
        """Buffers of the last step still referenced besides inputs and outputs (none)."""
        return list(self.runtime.leftover)


def _layouts(specs: Sequence[PlacementSpec]) -> dict:
    """Per leaf split by rows (by position), its ``stage_rows.RowsLayout``."""
    return {i: spec.rows_layout for i, spec in enumerate(specs) if spec.rows}
