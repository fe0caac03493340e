"""MeshExecutable: a step compiled by XLA for one device mesh.

``compile_shard_executable`` lowers a :class:`ShardingPlan`
(``shard_parallel/lowering/step_function.py``) with ``jax.jit`` and compiles it for the
full-batch input shapes (``shard_parallel/lowering/compile.py``). The program takes the
dynamic arguments as the user's pytrees, with the plan's shardings as ``in_shardings`` and
the donated arguments as ``donate_argnums``, so that a cache hit is one call of XLA's
compiled program: its C++ fast path checks the arguments, places host arrays and runs, at
``jax.jit``'s own dispatch cost. With micro-batches the step is a program per part, as Alpa
ran it (``compile.MicroBatchedProgram``: prepare, accumulate, accumulate_last, apply); a
cache hit checks and places the arguments, then calls them in turn. The executable also
exposes what XLA compiled: its HLO, its per-device memory, and where every input and output
lives.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from alpa.executables.base import Executable, check_dispatch_args
from alpa.global_env import global_config
from alpa.runtime.memory import allocation_bytes, device_peak_bytes
from alpa.runtime.placement import PlacementSpec, place_leaf
from alpa.shard_parallel.auto_sharding import plan_objective
from alpa.shard_parallel.gradients.micro_batches import layout_change_cost
from alpa.shard_parallel.lowering.compile import MicroBatchedProgram, compile_plan, full_batch_avals
from alpa.shard_parallel.sharding_plan import ShardingPlan
from alpa.tracing import TracedStep, leaf_signature
from alpa.util import grad_sync_channel_ids
from alpa.xla_compile import hlo_text

logger = logging.getLogger(__name__)


def compile_shard_executable(
    traced: TracedStep, plan: ShardingPlan, num_micro_batches: int | None
) -> MeshExecutable:
    compiled, in_shardings = compile_plan(traced, plan, num_micro_batches)
    return MeshExecutable(traced, plan, compiled, in_shardings, num_micro_batches)


class PricedPlan:
    """``auto_sharding_objective`` of an executable compiled from one ``ShardingPlan``
    (``plan``) of a traced step (``traced``): the local and the Ray one-mesh executables."""

    traced: TracedStep
    plan: ShardingPlan
    num_micro_batches: int | None

    @functools.cached_property
    def _objective_terms(self) -> tuple[float, float]:
        return plan_objective(self.traced, self.plan)

    @functools.cached_property
    def auto_sharding_objective(self) -> float:
        """The plan's communication cost under the auto-sharding cost model (Alpa's
        convention: the collectives and reshardings, in seconds of the alpha-beta model):
        the ILP's own plan's, or for a plan the ILP did not make (``DataParallel``, ZeRO,
        manual) that of the cheapest plan with its input shardings
        (``auto_sharding.plan_objective``, solved on first access), so that methods
        compare. With micro-batches, plus the step's one change of the batch's layout into
        micro-batches (``micro_batches.layout_change_cost``). The ILP minimises this plus
        :attr:`auto_sharding_compute_cost`."""
        layout = layout_change_cost(self.traced, self.plan, self.num_micro_batches)
        return self._objective_terms[0] + layout

    @property
    def grad_sync_channel_ids(self) -> str:
        """Alpa's name: the channel ids of the collectives in :meth:`get_hlo_text` that
        reduce the gradients once per step (``alpa.util.grad_sync_channel_ids``), as
        ``".1."``. With micro-batches they are in the last micro-batch's accumulate
        program, which runs once per step (Alpa skipped them at run time in all but the
        last micro-batch; here the others run a copy compiled without them)."""
        return grad_sync_channel_ids(self.get_hlo_text())

    @property
    def auto_sharding_compute_cost(self) -> float:
        """The compute term the ILP adds to :attr:`auto_sharding_objective`: seconds of
        work on one device (contraction FLOPs and bytes written at the mesh's rates)."""
        return self._objective_terms[1]

    @property
    def predicted_step_seconds(self) -> float:
        """Seconds per step the cost model predicts for this plan: its collectives and
        its work on one device (:attr:`auto_sharding_objective` +
        :attr:`auto_sharding_compute_cost`) and, where the cluster has a profile
        (``ClusterSpec.profile``: the plan's mesh then prices in measured seconds), the
        driver's measured cost of launching its programs (one, or with micro-batches one
        per micro-batch plus the split and the apply)."""
        seconds = self.auto_sharding_objective + self.auto_sharding_compute_cost
        rates = self.plan.logical_mesh.rates
        if rates is not None:
            launches = 1 if not self.num_micro_batches else self.num_micro_batches + 2
            seconds += launches * rates.profile.launch_seconds
        return seconds


class MeshExecutable(PricedPlan, Executable):
    """A step compiled for one mesh."""

    def __init__(
        self,
        traced: TracedStep,
        plan: ShardingPlan,
        compiled,
        in_shardings,
        num_micro_batches: int | None,
    ):
        self.traced = traced
        self.plan = plan
        self.compiled = compiled
        self.in_shardings = in_shardings
        self.out_shardings = tuple(jax.tree.leaves(compiled.output_shardings))
        self.num_micro_batches = num_micro_batches
        self._last_outputs: Any = ()
        self._step_seconds: list[list[float]] = []
        # A cache hit calls XLA's compiled program directly (see the module docstring);
        # a micro-batched step's programs are called in turn, on placed arguments.
        if not isinstance(compiled, MicroBatchedProgram):
            self.dispatch = compiled
        avals = full_batch_avals(traced, num_micro_batches)
        self._signatures = [leaf_signature(a) for a in avals]

    def preshard_flat_args(self, flat_args: Sequence[Any]) -> list[jax.Array]:
        return [
            place_leaf(x, sharding)
            for x, sharding in zip(flat_args, self.in_shardings, strict=True)
        ]

    def flat_input_shardings(self) -> list[Any]:
        return list(self.in_shardings)

    def dispatch(self, *dynamic_args: Any) -> Any:  # replaced by XLA's program when one
        leaves = check_dispatch_args(self.traced, dynamic_args, self._signatures)
        placed = self.preshard_flat_args(leaves)
        return self.compiled(*jax.tree.unflatten(self.traced.in_tree, placed))

    def launch(self, flat_args: Sequence[Any]) -> list[jax.Array]:
        placed = jax.tree.unflatten(self.traced.in_tree, self.preshard_flat_args(flat_args))
        outs = self._timed(self.compiled)(*placed)
        self._last_outputs = outs
        return self.traced.out_tree.flatten_up_to(outs)

    def hit_dispatch(self, placing: bool) -> Any:
        run = super().hit_dispatch(placing)
        timed = self._timed(run)
        return lambda *args: (
            timed(*args) if global_config.shard_parallel_sync_for_timer else run(*args)
        )

    def _timed(self, run: Callable) -> Callable:
        """``run`` timed, while ``global_config.shard_parallel_sync_for_timer`` is set,
        from the previous step's end to the end of its own computation (Alpa's timer)."""

        def timed(*args: Any) -> Any:
            if not global_config.shard_parallel_sync_for_timer:
                return run(*args)
            self.sync()
            tic = time.perf_counter()
            outs = jax.block_until_ready(run(*args))
            self._step_seconds.append([time.perf_counter() - tic])
            return outs

        return timed

    def _placement(self, avals, shardings) -> list[PlacementSpec]:
        return [
            PlacementSpec(aval, (0,), (s.spec if isinstance(s, NamedSharding) else s,), (s,))
            for aval, s in zip(avals, shardings, strict=True)
        ]

    def flat_input_placement_specs(self) -> list[PlacementSpec]:
        avals = full_batch_avals(self.traced, self.num_micro_batches)
        return self._placement(avals, self.in_shardings)

    def flat_output_placement_specs(self) -> list[PlacementSpec]:
        avals = [v.aval for v in self.traced.jaxpr.outvars]
        return self._placement(avals, self.out_shardings)

    def get_hlo_text(self) -> str:
        """The optimized, SPMD-partitioned HLO that runs on each device. With micro-batches
        Alpa's two modules, accumulate (the last micro-batch's, with the gradient
        synchronisation) then apply (``compile.MicroBatchedProgram.as_text``)."""
        if isinstance(self.compiled, MicroBatchedProgram):
            return self.compiled.as_text()
        return hlo_text(self.compiled)

    def get_program_texts(self) -> dict[str, str]:
        """The HLO of each program a step runs, by name: ``{"step": ...}``, or with
        micro-batches ``prepare``, ``accumulate`` (when more than one),
        ``accumulate_last`` and ``apply`` (``compile.MicroBatchedProgram``)."""
        if isinstance(self.compiled, MicroBatchedProgram):
            return {name: hlo_text(c) for name, c in self.compiled.parts}
        return {"step": hlo_text(self.compiled)}

    def get_total_allocation_size(self) -> int:
        """Bytes one device allocates for this step (arguments, outputs, temporaries),
        from XLA's memory analysis."""
        if isinstance(self.compiled, MicroBatchedProgram):
            beside = self.compiled.bytes_beside()
            return max(allocation_bytes(c) + beside[name] for name, c in self.compiled.parts)
        return allocation_bytes(self.compiled)

    def get_peak_memory_per_mesh(self) -> list[int]:
        """Per mesh (one here), the peak bytes a device of it allocated: the allocator's
        figure where the platform keeps one (GPU), else XLA's estimate for this step
        (:meth:`get_total_allocation_size`)."""
        devices = self.plan.logical_mesh.devices
        return [device_peak_bytes(devices) or self.get_total_allocation_size()]

    def dump_debug_info(self, folder: str) -> None:
        """Write the traced jaxpr, the plan and the compiled HLO into ``folder``."""
        os.makedirs(folder, exist_ok=True)
        name = self.traced.name
        with open(os.path.join(folder, f"{name}.jaxpr.txt"), "w") as f:
            f.write(str(self.traced.closed_jaxpr))
        with open(os.path.join(folder, f"{name}.hlo.txt"), "w") as f:
            f.write(self.get_hlo_text())
        with open(os.path.join(folder, f"{name}.plan.txt"), "w") as f:
            f.write(f"method: {self.plan.method}\nmesh: {self.plan.logical_mesh}\n")
            f.write(f"data_axes: {self.plan.data_axes}\n")
            for leaf, spec in zip(self.traced.leaf_names, self.plan.in_specs, strict=True):
                f.write(f"input  {leaf}: {spec}\n")
            for i, s in enumerate(self.out_shardings):
                f.write(f"output {i}: {getattr(s, 'spec', s)}\n")
            if isinstance(self.compiled, MicroBatchedProgram):
                for part, compiled in self.compiled.parts:
                    f.write(f"memory_analysis ({part}): {compiled.memory_analysis()}\n")
            else:
                f.write(f"memory_analysis: {self.compiled.memory_analysis()}\n")
