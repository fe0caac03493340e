"""Stage construction: which layers form each stage, and the submesh each stage runs on.

Every stage option resolves to a ``StagePlan`` (``stage_search.plan_stages``):

* ``ManualStageOption`` takes layers and submesh shapes from the user;
* ``UniformStageOption`` splits layers and devices evenly;
* ``AutoStageOption`` (``stage_option="auto"``) runs the dynamic program of the paper
  (§5.2, ``stage_dp.training_dp``) on the stage costs of a ``StageCostModel``
  (``stage_cost``): it picks, at once, the layers of each stage, its submesh and its
  logical shape and auto-sharding option. Its ``stage_imbalance_tolerance`` first drops
  the candidate stages whose share of the devices is far from their share of the FLOPs
  (``stage_imbalance.imbalance_mask``).

A submesh is a host-aligned 2-D slice ``(hosts, devices_per_host)`` of the cluster
(:func:`place_submeshes`); ``StagePlan.device_ranges`` are its devices as a range of the
cluster's devices numbered host by host. ``get_submesh_choices`` and ``training_dp`` are
re-exported here at Alpa's path; ``get_last_dp_result()`` says what the last DP chose.
The DP's run on a step (its cost tables, its solution resolved to a ``StagePlan``, the
same tables under another schedule) is ``stage_search``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from alpa.device_mesh import ClusterSpec
from alpa.pipeline_parallel.scheduling.schedules import stage_placement
from alpa.pipeline_parallel.stages.stage_dp import (  # noqa: F401 (Alpa's path)
    SUBMESH_SPACES,
    get_submesh_choices,
    training_dp,
)


@dataclass(frozen=True)
class ManualStageOption:
    """Stages chosen by hand.

    Attributes:
      forward_stage_layer_ids: per stage, the layer ids it runs, e.g. ``[[0], [1]]``; all
        layers, in order, each once.
      submesh_physical_shapes: per stage, ``(num_hosts, num_devices_per_host)``.
      submesh_logical_shapes: per stage, the 2-D logical mesh shape.
      submesh_autosharding_option_dicts: per stage, ``AutoShardingOption`` fields.
    """

    forward_stage_layer_ids: Sequence[Sequence[int]]
    submesh_physical_shapes: Sequence[Sequence[int]]
    submesh_logical_shapes: Sequence[Sequence[int]] | None = None
    submesh_autosharding_option_dicts: Sequence[dict] | None = None

    def __post_init__(self):
        ids = tuple(tuple(int(i) for i in stage) for stage in self.forward_stage_layer_ids)
        shapes = tuple(tuple(int(n) for n in s) for s in self.submesh_physical_shapes)
        object.__setattr__(self, "forward_stage_layer_ids", ids)
        object.__setattr__(self, "submesh_physical_shapes", shapes)
        if not ids or any(not stage for stage in ids):
            raise ValueError(f"forward_stage_layer_ids needs a non-empty list per stage: {ids}")
        flat = [i for stage in ids for i in stage]
        if flat != list(range(len(flat))):
            raise ValueError(
                f"forward_stage_layer_ids {[list(s) for s in ids]} must list layers "
                f"0..{len(flat) - 1} in order, each exactly once"
            )
        for name, value in (
            ("submesh_physical_shapes", shapes),
            ("submesh_logical_shapes", self.submesh_logical_shapes),
            ("submesh_autosharding_option_dicts", self.submesh_autosharding_option_dicts),
        ):
            if value is not None and len(value) != len(ids):
                raise ValueError(
                    f"{name} has {len(value)} entries but forward_stage_layer_ids has "
                    f"{len(ids)} stages"
                )
        for shape in shapes:
            if len(shape) != 2 or min(shape) < 1:
                raise ValueError(f"submesh physical shape must be two positive ints: {shape}")
        if self.submesh_logical_shapes is not None:
            logical = tuple(tuple(int(n) for n in s) for s in self.submesh_logical_shapes)
            for phys, log in zip(shapes, logical, strict=True):
                if len(log) != 2 or log[0] * log[1] != phys[0] * phys[1]:
                    raise ValueError(
                        f"submesh logical shape {log} does not have the "
                        f"{phys[0] * phys[1]} devices of physical shape {phys}"
                    )
            object.__setattr__(self, "submesh_logical_shapes", logical)

    def plan(self, context: StageContext) -> StagePlan:
        return _manual_plan(self, context)


@dataclass(frozen=True)
class UniformStageOption:
    """Equal stages on equal submeshes.

    Attributes:
      num_stages: number of stages (default: one per layer); must divide the layers.
      submesh_physical_shape: the shape of every submesh (default: the devices split
        evenly, ``(1, num_devices // num_stages)``).
      submesh_logical_shape: the logical shape of every submesh.
      submesh_autosharding_option: ``AutoShardingOption`` fields for every stage.
    """

    num_stages: int | None = None
    submesh_physical_shape: Sequence[int] | None = None
    submesh_logical_shape: Sequence[int] | None = None
    submesh_autosharding_option: dict | None = None

    def __post_init__(self):
        if self.num_stages is not None and (
            not isinstance(self.num_stages, int) or self.num_stages < 1
        ):
            raise ValueError(f"num_stages must be a positive int, got {self.num_stages!r}")

    def plan(self, context: StageContext) -> StagePlan:
        return _uniform_plan(self, context)


@dataclass(frozen=True)
class AutoStageOption:
    """Stages, submeshes and logical shapes chosen by the stage DP (paper §5.2).

    Attributes (Alpa's, with Alpa's meanings):
      submesh_physical_shape_space: submesh shapes a stage may take
        (``get_submesh_choices``): ``"power_of_two"``, ``"small_power_of_two"``, ``"all"``
        or ``"manual"`` (then ``manually_specified_submeshes``).
      manually_specified_submeshes: ``(hosts, devices_per_host)`` shapes for ``"manual"``.
      submesh_logical_shape_space: logical views of each submesh
        (``stage_problem.get_logical_configs``), default ``"single_node_model_parallel"``.
      stage_imbalance_tolerance: a number ``t >= 0``: a stage of layers ``i..j`` on ``n``
        of the cluster's ``N`` devices is a candidate only if ``n / N`` is within a
        factor ``1 + t`` of the stage's share of the step's FLOPs (forward and backward,
        ``stage_imbalance``); ``0`` asks for exact balance, ``inf`` (default) for no
        bound. The stage cost tables saved for ``get_last_dp_result`` and
        ``cached_profile_result`` are the unbounded ones, so they serve any tolerance.
      use_hlo_cost_model: ``True`` selects the analytic model (an estimate from the
        program, no profiling) whatever ``cost_model`` says; with
        ``profiling_database_filename``, at the rates of that cluster profile
        (``alpa.mesh_profiling.profile_all``): Alpa's HLO cost model read its profiling
        database of collectives the same way.
      profiling_database_filename: with ``use_hlo_cost_model``, the cluster profile the
        plan is priced with (its entry for these devices; for a cluster that is not here,
        a file of one profile); with ``cost_model="measured"``, that model's disk cache.
      cached_profile_result: a ``.npz`` file of stage cost tables written by an earlier
        DP (``get_last_dp_result()[0]``) for the same step and cluster: reused instead of
        costing the stages again.

    Attributes (alpa's):
      cost_model: ``"analytic"`` (default: FLOPs at the cluster's rate plus the ILP's
        communication, no devices needed), ``"measured"`` (compile and time every
        candidate stage on this process's devices) or a ``StageCostModel``.
      memory_budget_per_device: bytes a stage may use per device (default: the
        ``AutoShardingOption``'s ``memory_budget_per_device``, else the cluster's device
        memory).
      layer_profile_mode: Alpa's ``"composite"`` (default) or ``"individual"``, accepted
        for Alpa's programs: the analytic model always prices a stage as the sum of its
        layers (Alpa's ``"individual"``), the measured one always times whole candidate
        stages (``"composite"``).
    """

    submesh_physical_shape_space: str = "power_of_two"
    manually_specified_submeshes: Sequence[Sequence[int]] | None = None
    submesh_logical_shape_space: str = "single_node_model_parallel"
    stage_imbalance_tolerance: float = math.inf
    use_hlo_cost_model: bool = False
    profiling_database_filename: str | None = None
    cached_profile_result: str | None = None
    cost_model: Any = "analytic"
    memory_budget_per_device: float | None = None
    layer_profile_mode: str = "composite"

    def __post_init__(self):
        from alpa.pipeline_parallel.stages.stage_problem import LOGICAL_SHAPE_SPACES

        if self.layer_profile_mode not in ("composite", "individual"):
            raise ValueError(
                "AutoStageOption.layer_profile_mode must be 'composite' or 'individual', got "
                f"{self.layer_profile_mode!r}"
            )

        if self.submesh_physical_shape_space not in SUBMESH_SPACES:
            raise ValueError(
                f"submesh_physical_shape_space must be one of {SUBMESH_SPACES}, got "
                f"{self.submesh_physical_shape_space!r}"
            )
        if self.submesh_logical_shape_space not in LOGICAL_SHAPE_SPACES:
            raise ValueError(
                f"submesh_logical_shape_space must be one of {LOGICAL_SHAPE_SPACES}, got "
                f"{self.submesh_logical_shape_space!r}"
            )
        tolerance = self.stage_imbalance_tolerance
        if (
            isinstance(tolerance, bool)
            or not isinstance(tolerance, numbers.Real)
            or math.isnan(tolerance)
            or tolerance < 0
        ):
            raise ValueError(
                "AutoStageOption.stage_imbalance_tolerance must be a number >= 0 (math.inf: "
                f"no bound), got {tolerance!r} ({type(tolerance).__name__})"
            )
        object.__setattr__(self, "stage_imbalance_tolerance", float(tolerance))
        if not (self.cost_model in ("analytic", "measured") or callable(self.cost_model)):
            raise ValueError(
                f"cost_model must be 'analytic', 'measured' or a StageCostModel, got "
                f"{self.cost_model!r}"
            )
        budget = self.memory_budget_per_device
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int | float) or not budget > 0
        ):
            raise ValueError(
                "AutoStageOption.memory_budget_per_device must be None or a positive number "
                f"of bytes, got {budget!r}"
            )

    def cost_model_instance(self, devices: Sequence[Any] | None):
        from alpa.pipeline_parallel.stages.measured_stage_cost import MeasuredStageCost
        from alpa.pipeline_parallel.stages.stage_cost import AnalyticStageCost

        if self.use_hlo_cost_model or self.cost_model == "analytic":
            return AnalyticStageCost()
        if self.cost_model == "measured":
            if devices is None:
                raise ValueError(
                    "AutoStageOption(cost_model='measured') needs real devices; a plan for "
                    "a ClusterSpec that is not here uses cost_model='analytic'"
                )
            return MeasuredStageCost(devices, self.profiling_database_filename)
        return self.cost_model


@dataclass(frozen=True)
class StagePlan:
    """Resolved stages: layers, submeshes and logical shapes per stage.

    Attributes:
      layer_to_stage: per layer, its stage.
      submesh_shapes: per stage, its ``(hosts, devices_per_host)``.
      device_ranges: per stage, ``[start, stop)`` of the cluster's devices (numbered host
        by host) its submesh takes.
      logical_shapes: per stage, its 2-D logical mesh shape.
      autosharding_option_dicts: per stage, ``AutoShardingOption`` fields or ``None``.
      latencies: per stage, the cost model's latency per micro-batch (auto stages only).
      memory: per stage, the cost model's bytes per device (auto stages only).
      predicted_cost: the DP's pipeline latency of one step (auto stages only).
      dp_result: what the stage DP chose from (auto stages only; not part of the plan's
        identity or its JSON): ``get_last_dp_result()`` reads the last one.
    """

    layer_to_stage: tuple[int, ...]
    device_ranges: tuple[tuple[int, int], ...]
    logical_shapes: tuple[tuple[int, int], ...]
    autosharding_option_dicts: tuple[dict | None, ...]
    submesh_shapes: tuple[tuple[int, int], ...] = ()
    latencies: tuple[float, ...] | None = None
    memory: tuple[float, ...] | None = None
    predicted_cost: float | None = None
    dp_result: Any = field(default=None, compare=False, repr=False)  # stage_search.DPResult

    @property
    def num_stages(self) -> int:
        return len(self.device_ranges)

    @property
    def stage_meshes(self) -> tuple[int, ...]:
        """Per stage, its mesh: stages with the same devices share one (interleaved
        schedules); meshes are numbered in the order of their first stage."""
        first: dict[tuple[int, int], int] = {}
        return tuple(first.setdefault(tuple(r), len(first)) for r in self.device_ranges)

    @property
    def num_meshes(self) -> int:
        return len(set(self.device_ranges))

    def plan(self, context: StageContext) -> StagePlan:
        """Itself: a plan made already is a stage option too (``pipeline_schedule="auto"``
        plans its candidates' stages with them)."""
        return self

    def stage_layers(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(self.num_stages)]
        for layer, stage in enumerate(self.layer_to_stage):
            out[stage].append(layer)
        return out


@dataclass(frozen=True, eq=False)
class StageContext:
    """What a stage option plans from.

    Attributes:
      num_layers: layers of the step.
      cluster: the cluster's hardware and shape (a ``ClusterSpec``: ``num_hosts`` x
        ``num_devices_per_host`` read from it).
      devices: the real devices, or ``None`` when planning for a cluster that is not here.
      traced, layers, names: the traced step, its ``LayerAssignment`` and value names
        (auto stages cost the layers' computations).
      num_micro_batches: micro-batches per step.
      option: the default ``AutoShardingOption``.
      remat: each stage's backward recomputes its forward (the layer option's
        ``remat_layer``), which the cost model prices.
      schedule: the pipeline schedule the stages are planned for: it says which mesh each
        stage runs on (``schedules.stage_placement``; all but interleaved 1F1B and
        DualPipeV place one stage per mesh).
    """

    num_layers: int
    cluster: ClusterSpec
    devices: Sequence[Any] | None = None
    traced: Any = None
    layers: Any = None
    names: dict | None = None
    num_micro_batches: int = 1
    option: Any = None
    remat: bool = False
    schedule: str = "1f1b"

    def stage_meshes(self, num_stages: int) -> tuple[int, ...]:
        """Per stage of ``num_stages``, the mesh the schedule places it on."""
        return stage_placement(self.schedule, num_stages)

    @property
    def num_hosts(self) -> int:
        return self.cluster.num_nodes

    @property
    def num_devices_per_host(self) -> int:
        return self.cluster.num_devices_per_node

    @property
    def num_devices(self) -> int:
        return self.cluster.num_devices


def resolve_stage_option(option) -> ManualStageOption | UniformStageOption | AutoStageOption:
    if isinstance(option, StagePlan):  # stages planned already ("auto"'s candidates)
        return option
    if option is None or option == "uniform":
        return UniformStageOption()
    if option == "auto":
        return AutoStageOption()
    if isinstance(option, ManualStageOption | UniformStageOption | AutoStageOption):
        return option
    raise ValueError(
        f"stage_option must be 'uniform', 'auto', a UniformStageOption, a ManualStageOption "
        f"or an AutoStageOption, got {option!r} ({type(option).__name__})"
    )


def _manual_plan(option: ManualStageOption, context: StageContext) -> StagePlan:
    ids = option.forward_stage_layer_ids
    num_layers = context.num_layers
    num_assigned = sum(len(s) for s in ids)
    if num_assigned != num_layers:
        raise ValueError(
            f"the step has {num_layers} layers ({num_layers - 1} "
            f"mark_pipeline_boundary calls) but forward_stage_layer_ids assigns "
            f"{num_assigned} layers"
        )
    layer_to_stage = tuple(s for s, stage in enumerate(ids) for _ in stage)
    shapes = option.submesh_physical_shapes
    logical = option.submesh_logical_shapes or tuple((1, a * b) for a, b in shapes)
    dicts = tuple(option.submesh_autosharding_option_dicts or (None,) * len(ids))
    return _finish(context, layer_to_stage, shapes, logical, dicts)


def _uniform_plan(option: UniformStageOption, context: StageContext) -> StagePlan:
    num_layers, num_devices = context.num_layers, context.num_devices
    num_stages = option.num_stages or num_layers
    if num_layers % num_stages:
        raise ValueError(
            f"UniformStageOption(num_stages={num_stages}) does not divide the "
            f"{num_layers} layers of the step"
        )
    per = num_layers // num_stages
    layer_to_stage = tuple(layer // per for layer in range(num_layers))
    if option.submesh_physical_shape is not None:
        shape = tuple(option.submesh_physical_shape)
    else:
        num_meshes = len(set(context.stage_meshes(num_stages)))
        if num_devices % num_meshes:
            raise ValueError(
                f"{num_stages} stages on {num_meshes} meshes cannot split {num_devices} "
                "devices evenly; pass UniformStageOption(submesh_physical_shape=...)"
            )
        shape = _even_shape(context, num_devices // num_meshes)
    shapes = (shape,) * num_stages
    logical = (tuple(option.submesh_logical_shape or (1, shape[0] * shape[1])),) * num_stages
    dicts = (option.submesh_autosharding_option,) * num_stages
    return _finish(context, layer_to_stage, shapes, logical, dicts)


def _even_shape(context: StageContext, size: int) -> tuple[int, int]:
    per_host = context.num_devices_per_host
    if size <= per_host:
        return (1, size)
    if size % per_host:
        raise ValueError(
            f"a submesh of {size} devices is not whole hosts of {per_host} devices; pass "
            "UniformStageOption(submesh_physical_shape=...)"
        )
    return (size // per_host, per_host)


def _finish(context, layer_to_stage, shapes, logical, dicts, **extra) -> StagePlan:
    shapes = tuple(tuple(int(n) for n in s) for s in shapes)
    logical = tuple(tuple(int(n) for n in s) for s in logical)
    meshes = context.stage_meshes(len(shapes))
    first = _check_placement(context.schedule, meshes, shapes, logical)
    mesh_shapes = [shapes[s] for s in first]
    needed = sum(a * b for a, b in mesh_shapes)
    if needed > context.num_devices:
        raise ValueError(
            f"submesh_physical_shapes {[list(s) for s in mesh_shapes]} need {needed} "
            f"devices but only {context.num_devices} exist"
        )
    ranges = place_submeshes(mesh_shapes, context.num_hosts, context.num_devices_per_host)
    return StagePlan(
        tuple(layer_to_stage),
        tuple(ranges[m] for m in meshes),
        logical,
        tuple(dicts),
        shapes,
        **extra,
    )


def _check_placement(schedule: str, meshes, shapes, logical) -> list[int]:
    """Per mesh, its first stage: the stages ``schedule`` places on one mesh (``meshes``,
    per stage) must have the first one's physical and logical submesh shape."""
    first: dict[int, int] = {}
    for s, m in enumerate(meshes):
        f = first.setdefault(m, s)
        if shapes[s] != shapes[f] or logical[s] != logical[f]:
            raise ValueError(
                f"stage {s} runs on mesh {m} with stage {f} (pipeline_schedule={schedule!r} "
                f"places stages {[t for t, n in enumerate(meshes) if n == m]} there), so it "
                f"needs stage {f}'s submesh: physical {shapes[f]} and logical {logical[f]}, "
                f"but has {shapes[s]} and {logical[s]}"
            )
    return [first[m] for m in sorted(first)]


def submesh_shape(num_devices: int, num_devices_per_host: int) -> tuple[int, int]:
    """The host-aligned submesh ``(hosts, devices_per_host)`` of ``num_devices`` devices:
    part of one host, or whole hosts."""
    if num_devices <= num_devices_per_host:
        return (1, num_devices)
    if num_devices % num_devices_per_host == 0:
        return (num_devices // num_devices_per_host, num_devices_per_host)
    raise ValueError(
        f"a stage of {num_devices} devices neither fits in a host of {num_devices_per_host} "
        "devices nor spans whole hosts"
    )


def place_submeshes(
    shapes: Sequence[Sequence[int]], num_hosts: int, num_devices_per_host: int
) -> tuple[tuple[int, int], ...]:
    """Per stage, the ``[start, stop)`` device range of its submesh on the cluster.

    A submesh spanning hosts takes whole hosts; one within a host takes a contiguous run
    of that host's devices. Larger submeshes are placed first, each at the lowest free
    position where it fits (for power-of-two widths this packs any set of shapes whose
    devices fit). A set that cannot be placed is a ``ValueError``.
    """
    per_host = num_devices_per_host
    free = np.ones((num_hosts, per_host), dtype=bool)
    ranges: list[tuple[int, int] | None] = [None] * len(shapes)
    order = sorted(range(len(shapes)), key=lambda s: -shapes[s][0] * shapes[s][1])
    for s in order:
        hosts, width = (int(n) for n in shapes[s])
        if hosts > 1 and width != per_host:
            raise ValueError(
                f"submesh {(hosts, width)} spans hosts, so it must take whole hosts "
                f"({per_host} devices each)"
            )
        spot = None
        for h in range(num_hosts - hosts + 1):
            for d in range(per_host - width + 1):
                if free[h : h + hosts, d : d + width].all():
                    spot = (h, d)
                    break
            if spot is not None:
                break
        if spot is None:
            raise ValueError(
                f"submeshes {[tuple(x) for x in shapes]} cannot be placed on a cluster of "
                f"{num_hosts} hosts x {per_host} devices"
            )
        h, d = spot
        free[h : h + hosts, d : d + width] = False
        start = h * per_host + d
        ranges[s] = (start, start + hosts * width)
    return tuple(ranges)


# The plan of the last stage DP (stage_search records it): Alpa's get_last_dp_result()
# takes no argument.
_last_auto_plan: StagePlan | None = None


def record_last_dp_plan(plan: StagePlan) -> None:
    """Remember ``plan``, made by the stage DP, for :func:`get_last_dp_result`."""
    global _last_auto_plan
    _last_auto_plan = plan


def get_last_dp_result() -> tuple:
    """What the last stage DP chose, as in Alpa: ``(compute_cost_file_name,
    forward_stage_layer_ids, submesh_shapes, logical_mesh_shapes,
    autosharding_option_dicts)``, read from its plan's ``dp_result``. The file (``.npz``)
    holds the stage cost tables (``compute_cost``, ``max_n_succ_stages``, ``memory``),
    before any ``stage_imbalance_tolerance`` is applied; it is written on the first call
    (:meth:`DPResult.save`), not by the DP. All ``None`` before any DP ran."""
    plan = _last_auto_plan
    if plan is None or plan.dp_result is None:
        return (None, None, None, None, None)
    return (
        plan.dp_result.save(),
        plan.stage_layers(),
        [list(s) for s in plan.submesh_shapes],
        [list(s) for s in plan.logical_shapes],
        [dict(d or {}) for d in plan.autosharding_option_dicts],
    )
