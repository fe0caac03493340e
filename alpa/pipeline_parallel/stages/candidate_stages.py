"""``pipeline_schedule="auto"``'s candidates on stages other than the plan's.

``pipeline_schedule="auto"`` prices GPipe, 1F1B and ZB-H1 on the stages the stage DP chose
under 1F1B (``schedule_choice``). Two kinds of candidates have stages of their own:

**The DP's stages under each schedule** (:func:`dp_candidates`): the stage DP prices GPipe
and ZB-H1 by their own latency and in-flight memory (``stage_dp``'s docstring); run again
on the same tables (``stage_search.stages_for_schedule``), it may pick other stages
(fewer to fit GPipe's memory; for ZB-H1, whose bubble weighs a third of 1F1B's, other
cuts). Where it does, the schedule is priced on those stages too: the DP's latencies, the
analytic model's memory per stage (``PipeshardPlan.price_stages``) with the schedule's
micro-batches in flight, the timeline's time.

**Two stages per mesh**: interleaved 1F1B and DualPipeV need ``2 p`` stages on ``p``
meshes (``schedules.stage_placement``), which the stage DP, one stage per mesh, does not
search. :func:`shared_mesh_candidates` builds one candidate for each, from the DP's plan:

* **meshes**: ``p`` equal submeshes of the cluster, each of the DP's most common submesh
  size (the largest on a tie), fewer where the step has not ``2 p`` layers (``p`` is then
  the largest that divides the devices into host-aligned submeshes with ``2 p <= L``),
  with the logical shape and options of a DP stage on that submesh (``(1, n)`` and the
  first stage's options when none is);
* **stages**: the ``L`` layers cut into ``2 p`` contiguous stages whose largest FLOP sum
  (forward and backward, ``stage_problem.layer_flops``) is the least (a DP over the cuts;
  the meshes are equal, so FLOPs are time);
* **price**: the analytic stage model's latencies and memory of those stages
  (``PipeshardPlan.price_stages``), the schedule's timeline for time and its in-flight
  activations per mesh for memory (``schedule_choice.makespan``, ``held_memory``), as
  every other candidate is priced.

A schedule that cannot run the plan's micro-batches on ``p`` meshes (interleaved 1F1B:
``M`` a multiple of ``p``; DualPipeV: ``M >= 2 p``) is
reported with the reason and not chosen, as is a step whose layers or devices make fewer
than 2 such meshes (both stages on one mesh is no pipeline).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from alpa.pipeline_parallel.program.stage_sharding import stage_options
from alpa.pipeline_parallel.scheduling.schedule_choice import ScheduleCandidate, price_schedule
from alpa.pipeline_parallel.scheduling.schedules import SHARED_MESH_SCHEDULES, make_schedule
from alpa.pipeline_parallel.stages.stage_construction import (
    ManualStageOption,
    StagePlan,
    submesh_shape,
)
from alpa.pipeline_parallel.stages.stage_problem import layer_flops
from alpa.pipeline_parallel.stages.stage_search import stages_for_schedule
from alpa.pipeline_parallel.stages.stage_work import step_bound


def dp_candidates(plan, default_option) -> list[tuple[ScheduleCandidate, StagePlan]]:
    """GPipe and ZB-H1 on the stages the DP that made ``plan`` picks under each (module
    docstring), where they differ from ``plan``'s; none for stages not made by the DP.
    ``default_option`` is ``PipeshardParallel``'s ``default_auto_sharding_option``."""
    if plan.stage_plan.dp_result is None:
        return []
    out = []
    for name in ("gpipe", "zb-h1"):
        try:
            stages = stages_for_schedule(plan.stage_plan, name)
        except ValueError:  # no plan of the DP fits this schedule's memory
            reason = f"the stage DP finds no stages within memory under {name}"
            out.append((_not_applicable(name, reason), None))
            continue
        if stages is plan.stage_plan:
            continue
        options = stage_options(default_option, stages.autosharding_option_dicts)
        cost = plan.price_stages(
            [
                (layers, stages.submesh_shapes[s], stages.logical_shapes[s], options[s])
                for s, layers in enumerate(stages.stage_layers())
            ]
        )
        candidate = price_schedule(
            make_schedule(name, stages.num_stages, plan.num_micro_batches),
            stages.latencies,
            cost.memory,
            cost.activation_memory,
            plan.memory_budget(),
            note=f"the stage DP's {stages.num_stages} stages under {name}",
            bound=step_bound(
                plan.cluster, stages.latencies, stages.submesh_shapes, plan.num_micro_batches
            ),
        )
        out.append((candidate, stages))
    return out


def shared_mesh_candidates(plan) -> list[tuple[ScheduleCandidate, ManualStageOption | None]]:
    """Per schedule of :data:`~alpa.pipeline_parallel.scheduling.schedules.SHARED_MESH_SCHEDULES`,
    its candidate priced on stages derived from ``plan`` (a ``PipeshardPlan``, module
    docstring) and the ``ManualStageOption`` that makes them (``None`` with the reason in
    the candidate where the schedule does not apply)."""
    out = []
    meshes = _meshes(plan)
    for name in sorted(SHARED_MESH_SCHEDULES):
        if isinstance(meshes, str):
            out.append((_not_applicable(name, meshes), None))
            continue
        p, shape, logical, option, option_dict = meshes
        reason = _refusal(name, p, plan.num_micro_batches)
        if reason:
            out.append((_not_applicable(name, reason), None))
            continue
        problem = plan.price_problem
        chunks = balanced_cuts(layer_flops(problem), 2 * p)
        cost = plan.price_stages([(c, shape, logical, option) for c in chunks])
        candidate = price_schedule(
            make_schedule(name, 2 * p, plan.num_micro_batches, p),
            cost.latencies,
            cost.memory,
            cost.activation_memory,
            plan.memory_budget(),
            note=f"{2 * p} stages on {p} meshes of {shape[0]}x{shape[1]}",
            bound=step_bound(
                plan.cluster,
                cost.latencies,
                [shape] * (2 * p),
                plan.num_micro_batches,
                busy_devices=p * shape[0] * shape[1],
            ),
        )
        stage_option = ManualStageOption(
            forward_stage_layer_ids=chunks,
            submesh_physical_shapes=[shape] * (2 * p),
            submesh_logical_shapes=[logical] * (2 * p),
            submesh_autosharding_option_dicts=[option_dict] * (2 * p),
        )
        out.append((candidate, stage_option))
    return out


def _not_applicable(name: str, reason: str) -> ScheduleCandidate:
    return ScheduleCandidate(name, float("inf"), (), False, note=f"not applicable: {reason}")


def _refusal(name: str, p: int, num_micro_batches: int) -> str:
    if name == "interleaved-1f1b" and num_micro_batches % p:
        return f"{num_micro_batches} micro-batches are not a multiple of {p} meshes"
    if name == "dualpipev" and num_micro_batches < 2 * p:
        return f"{num_micro_batches} micro-batches are fewer than 2 x {p} meshes"
    return ""


def _meshes(plan):
    """``(p, physical shape, logical shape, AutoShardingOption, option dict)`` of the
    candidates' equal meshes (module docstring), or why there are none."""
    stages = plan.stage_plan
    num_layers = plan.layers.num_layers
    sizes = Counter(a * b for a, b in stages.submesh_shapes)
    size = max(sizes, key=lambda n: (sizes[n], n))
    num_devices = plan.num_hosts * plan.num_devices_per_host
    p = min(num_devices // size, num_layers // 2)
    while p > 1:
        if num_devices % p == 0 and _fits_hosts(num_devices // p, plan.num_devices_per_host):
            break
        p -= 1
    if p < 2:
        return (
            f"no 2 meshes of 2 stages: {num_devices} devices in submeshes of the stage "
            f"DP's {size}, {num_layers} layers"
        )
    shape = submesh_shape(num_devices // p, plan.num_devices_per_host)
    source = next(
        (s for s in range(stages.num_stages) if tuple(stages.submesh_shapes[s]) == shape), None
    )
    if source is None:  # no DP stage on such a submesh: (1, n), the first stage's options
        logical, source = (1, shape[0] * shape[1]), 0
    else:
        logical = tuple(plan.logical_meshes[source].shape)
    option_dict = stages.autosharding_option_dicts[source]
    return p, shape, logical, plan.options[source], dict(option_dict or {})


def _fits_hosts(size: int, per_host: int) -> bool:
    return size <= per_host or size % per_host == 0


def balanced_cuts(flops, k: int) -> list[list[int]]:
    """The layers ``0..L-1`` cut into ``k <= L`` contiguous non-empty groups whose largest
    sum of ``flops`` is the least (the first such cut in layer order)."""
    flops = np.asarray(flops, dtype=float)
    L = len(flops)
    if not 1 <= k <= L:
        raise ValueError(f"cannot cut {L} layers into {k} non-empty stages")
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    # best[j][i]: the least largest sum cutting layers 0..i-1 into j groups.
    best = np.full((k + 1, L + 1), np.inf)
    cut = np.zeros((k + 1, L + 1), dtype=int)
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, L + 1):
            for h in range(j - 1, i):
                value = max(best[j - 1][h], prefix[i] - prefix[h])
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, h
    groups, i = [], L
    for j in range(k, 0, -1):
        h = cut[j][i]
        groups.append(list(range(h, i)))
        i = h
    return groups[::-1]
