"""The stage DP run on a step: ``AutoStageOption``'s plan.

:func:`plan_auto_stages` builds the ``StageProblem`` of a step's layers on a cluster
(:func:`stage_problem`), fills the DP's cost tables with the option's ``StageCostModel``
(``stage_cost``; or reads them from ``cached_profile_result``), masks the stages that
``stage_imbalance_tolerance`` drops, runs the DP (``stage_dp.training_dp``) under the
schedule the stages are planned for, and resolves its solution to a ``StagePlan``
(placed by ``stage_construction``), which keeps the tables (:class:`DPResult`).
:func:`stages_for_schedule` runs the same DP on those tables under another schedule
(``pipeline_schedule="auto"``'s candidates). ``stage_construction.get_last_dp_result``
is Alpa's view of the last DP, which :func:`plan_auto_stages` records there.
:func:`plan_stages` plans any stage option (the others by ``option.plan(context)``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from alpa.global_env import global_config
from alpa.pipeline_parallel.scheduling.schedules import SHARED_MESH_SCHEDULES, make_schedule
from alpa.pipeline_parallel.stages.stage_construction import (
    AutoStageOption,
    StageContext,
    StagePlan,
    _finish,
    record_last_dp_plan,
    resolve_stage_option,
)
from alpa.pipeline_parallel.stages.stage_dp import DP_SCHEDULES, get_submesh_choices, training_dp
from alpa.pipeline_parallel.stages.stage_imbalance import imbalance_mask, tolerance_error
from alpa.pipeline_parallel.stages.stage_memory_advice import infeasible_message
from alpa.pipeline_parallel.stages.stage_work import host_work_table, step_bound
from alpa.timer import timed


@dataclass(frozen=True, eq=False)
class DPResult:
    """The stage cost tables one stage DP chose from (``costs``: ``compute_cost``,
    ``max_n_succ_stages``, ``memory``, before any ``stage_imbalance_tolerance`` is
    applied, so they serve any tolerance); what it chose is the plan that holds this."""

    costs: Any
    _saved: list = field(default_factory=list, repr=False)
    # What the DP read besides the tables, to run it again under another schedule
    # (stages_for_schedule): the problem (submesh choices and their configurations), the
    # cost table as the imbalance tolerance masked it, and the context.
    problem: Any = field(default=None, repr=False)
    dp_compute_cost: Any = field(default=None, repr=False)
    context: Any = field(default=None, repr=False)

    def save(self, path: str | None = None) -> str:
        """The tables as an ``.npz`` file (``AutoStageOption(cached_profile_result=...)``
        reads it): written to ``path``, or once to a new file in the temporary directory
        when ``path`` is ``None`` (later calls return that file)."""
        if path is None and self._saved:
            return self._saved[0]
        if path is None:
            path = os.path.join(tempfile.gettempdir(), f"alpa-compute-cost-{time.time_ns()}.npz")
            self._saved.append(path)
        np.savez(
            path,
            compute_cost=self.costs.compute_cost,
            max_n_succ_stages=self.costs.max_n_succ_stages,
            memory=self.costs.memory,
        )
        return path


def layer_problem(context: StageContext, choices, configs, option, budget):
    """The :class:`~alpa.pipeline_parallel.stages.stage_problem.StageProblem` of ``context``'s
    layers (one stage per layer) on the submesh ``choices``, each with its logical
    ``configs``, under the ``AutoShardingOption`` ``option`` and a memory ``budget``."""
    from alpa.pipeline_parallel.program.computation import split_computations
    from alpa.pipeline_parallel.stages.stage_problem import StageProblem

    layers, traced = context.layers, context.traced
    program = split_computations(
        traced.closed_jaxpr,
        layers.layers,
        tuple(range(layers.num_layers)),
        traced.batch_invars,
        layers.kinds,
    )
    return StageProblem(
        traced,
        program,
        context.names or {},
        tuple(choices),
        tuple(configs),
        context.cluster,
        option,
        budget,
        num_micro_batches=context.num_micro_batches,
        remat=context.remat,
    )


def stage_problem(option: AutoStageOption, context: StageContext):
    """The :class:`~alpa.pipeline_parallel.stages.stage_problem.StageProblem` of ``context``."""
    from alpa.pipeline_parallel.stages.stage_problem import (
        get_logical_configs,
        split_parameters_under_memory_pressure,
    )
    from alpa.shard_parallel.auto_sharding import AutoShardingOption

    traced = context.traced
    # Alpa's global override of the submesh choices, checked as manual ones.
    forced = global_config.overwrite_submesh_choices
    choices = get_submesh_choices(
        context.num_hosts,
        context.num_devices_per_host,
        option.submesh_physical_shape_space if forced is None else "manual",
        option.manually_specified_submeshes if forced is None else forced,
    )
    batch = [
        a.shape[0]
        for a, b in zip(traced.in_avals, traced.batch_invars, strict=True)
        if b and a.shape
    ]
    batch_size = batch[0] if batch else None
    configs = tuple(
        get_logical_configs(m, option.submesh_logical_shape_space, batch_size) for m in choices
    )
    default = context.option or AutoShardingOption()
    budget = (
        option.memory_budget_per_device
        or default.memory_budget_per_device
        or context.cluster.device_memory
    )
    problem = layer_problem(context, choices, configs, default, budget)
    return split_parameters_under_memory_pressure(problem, context.num_devices)


def plan_auto_stages(option: AutoStageOption, context: StageContext) -> StagePlan:
    """Cost every candidate stage, run the DP, and resolve its solution. Timed as Alpa's
    stage construction (``alpa.timers``): ``stage-construction`` in all, of which
    ``-compilation`` (the step cut into every candidate stage's computations on every
    submesh), ``-profiling`` (the cost model pricing them) and ``-dp``."""
    if context.schedule in SHARED_MESH_SCHEDULES:
        raise ValueError(
            "stage_option='auto' places one stage per mesh; pipeline_schedule="
            f"{context.schedule!r} places two stages on each mesh and needs "
            "UniformStageOption or ManualStageOption"
        )
    with timed("stage-construction"):
        return _plan_auto_stages(option, context)


def _plan_auto_stages(option: AutoStageOption, context: StageContext) -> StagePlan:
    from alpa.pipeline_parallel.stages.stage_problem import StageCosts, layer_flops

    with timed("stage-construction-compilation"):
        problem = stage_problem(option, context)
    L, M, C = problem.num_layers, len(problem.submesh_choices), problem.num_configs
    costs = None
    if option.cached_profile_result is not None:
        with np.load(option.cached_profile_result) as saved:
            costs = StageCosts(saved["compute_cost"], saved["max_n_succ_stages"], saved["memory"])
        if costs.compute_cost.shape != (L, L, M, C):
            raise ValueError(
                f"cached_profile_result {option.cached_profile_result!r} holds tables of "
                f"shape {costs.compute_cost.shape}; this step and cluster need {(L, L, M, C)}"
            )
    if costs is None:
        with timed("stage-construction-profiling"):
            costs = option.cost_model_instance(context.devices)(problem)

    schedule = context.schedule if context.schedule in DP_SCHEDULES else "1f1b"

    @timed("stage-construction-dp")
    def dp(compute_cost):
        return training_dp(
            L,
            context.num_devices,
            context.num_micro_batches,
            problem.submesh_choices,
            C,
            compute_cost,
            costs.max_n_succ_stages,
            schedule,
        )

    tolerance = option.stage_imbalance_tolerance
    compute_cost = costs.compute_cost
    sizes = [a * b for a, b in problem.submesh_choices]
    if tolerance != math.inf:
        flops = layer_flops(problem)
        allowed = imbalance_mask(flops, sizes, context.num_devices, tolerance)
        # A masked copy: the cost model's table stays as it was, and is what is saved.
        compute_cost = np.where(allowed[..., None], compute_cost, np.inf)
    try:
        total, solution = dp(compute_cost)
    except ValueError as e:
        if tolerance != math.inf:
            try:
                _, unbounded = dp(costs.compute_cost)
            except ValueError:
                unbounded = None
            if unbounded is not None:
                raise tolerance_error(
                    tolerance, unbounded, flops, sizes, context.num_devices
                ) from e
        if costs.per_micro_batch_memory is not None or not np.isfinite(costs.compute_cost).any():
            raise ValueError(
                infeasible_message(costs, problem, context.num_devices, context.num_micro_batches)
            ) from e
        raise ValueError(f"{e} (memory_budget_per_device={problem.memory_budget:.4g} bytes)") from e
    dp_result = DPResult(costs, problem=problem, dp_compute_cost=compute_cost, context=context)
    plan = _resolve(solution, total, dp_result)
    if context.cluster.profile is not None:
        # Where the host's throughput bounds the step (devices that share a host's cores),
        # the plan of least total work may be faster than the DP's: priced alike, the
        # faster of the two is taken (stage_work.host_work_table).
        work = host_work_table(context.cluster.profile, compute_cost, problem.submesh_choices)
        try:
            _, fewest = training_dp(
                L,
                context.num_devices,
                1,
                problem.submesh_choices,
                C,
                work,
                costs.max_n_succ_stages,
            )
        except ValueError:
            fewest = None
        if fewest is not None and fewest != solution:
            chosen = np.full_like(compute_cost, np.inf)
            for (start, end), m, c in fewest:
                chosen[start, end - 1, m, c] = compute_cost[start, end - 1, m, c]
            other_total, other = dp(chosen)
            candidate = _resolve(other, other_total, dp_result)
            if candidate.predicted_cost < plan.predicted_cost:
                plan = candidate
    record_last_dp_plan(plan)
    return plan


def stages_for_schedule(plan: StagePlan, schedule: str) -> StagePlan:
    """The stages the DP that made ``plan`` (automatic stages) picks under ``schedule``
    (``stage_dp.DP_SCHEDULES``: its latency and in-flight memory), from the same tables;
    ``plan`` itself when they are the same."""
    dp = plan.dp_result
    if dp is None or dp.problem is None:
        raise ValueError("stages_for_schedule needs a plan of the stage DP (automatic stages)")
    problem, context = dp.problem, dp.context
    total, solution = training_dp(
        problem.num_layers,
        context.num_devices,
        context.num_micro_batches,
        problem.submesh_choices,
        problem.num_configs,
        dp.dp_compute_cost,
        dp.costs.max_n_succ_stages,
        schedule,
    )
    other = _resolve(solution, total, dp)
    same = (other.layer_to_stage, other.submesh_shapes, other.logical_shapes) == (
        plan.layer_to_stage,
        plan.submesh_shapes,
        plan.logical_shapes,
    )
    return plan if same else other


def _resolve(solution, total: float, dp: DPResult) -> StagePlan:
    """The ``StagePlan`` of a DP ``solution`` of cost ``total``: stages, their submeshes
    placed on the cluster, logical shapes, options, latencies and memory from the tables
    (the unbounded ones, reusable under any tolerance; the chosen stages' entries are the
    same in both)."""
    problem, costs, context = dp.problem, dp.costs, dp.context
    layer_to_stage = [0] * problem.num_layers
    shapes, logical, dicts, latencies, memory = [], [], [], [], []
    for s, ((start, end), m, c) in enumerate(solution):
        for layer in range(start, end):
            layer_to_stage[layer] = s
        config = problem.configs[m][c]
        shapes.append(problem.submesh_choices[m])
        logical.append(config.shape)
        dicts.append(config.option_dict or None)
        latencies.append(float(costs.compute_cost[start, end - 1, m, c]))
        memory.append(float(costs.memory[start, end - 1, m, c]))
    schedule = context.schedule if context.schedule in DP_SCHEDULES else "1f1b"
    bound = step_bound(
        context.cluster,
        latencies,
        shapes,
        context.num_micro_batches,
        schedule=make_schedule(schedule, len(latencies), context.num_micro_batches),
    )
    plan = _finish(
        context,
        layer_to_stage,
        shapes,
        logical,
        dicts,
        latencies=tuple(latencies),
        memory=tuple(memory),
        predicted_cost=float(bound(total)),
    )
    return dataclasses.replace(plan, dp_result=dp)


def plan_stages(option: Any, context: StageContext) -> StagePlan:
    """Resolve the stage option ``option`` for ``context`` (a step's layers on a
    cluster): the stage DP for ``AutoStageOption``, ``option.plan(context)`` for the
    others."""
    option = resolve_stage_option(option)
    if isinstance(option, AutoStageOption):
        return plan_auto_stages(option, context)
    return option.plan(context)
