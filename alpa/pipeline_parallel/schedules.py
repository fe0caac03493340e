"""Pipeline schedules as data.

A schedule says which stage runs which micro-batch, and whether it runs the forward, the
backward or the apply-grad computation, on each clock tick. It is a plain value: a tuple of
ticks, each a tuple of :class:`Task` ``(stage, micro_batch, kind)``, at most one task per
stage per tick (stage ``i`` runs on mesh ``i``). The runtime emitter turns a schedule plus
the compiled stages into instruction lists; nothing here touches devices.

With ``S`` stages and ``M`` micro-batches (DESIGN §5):

* **GPipe** runs all forwards, then all backwards. Forward of micro-batch ``m`` on stage
  ``s`` happens at tick ``s + m``; backward at tick ``(M + S - 1) + (S - 1 - s) + m``.
  ``2 (M + S - 1)`` compute ticks; stage ``i`` holds the activations of all ``M``
  micro-batches at its peak.
* **1F1B** (PipeDream-flush) lets stage ``i`` run ``S - i - 1`` warm-up forwards, then
  alternate one forward and one backward, then drain the remaining backwards. Every task
  runs at the first tick its inputs are ready. It takes the same ``2 (M + S - 1)`` compute
  ticks as GPipe, but stage ``i`` never holds more than ``S - i`` micro-batches of
  activations.
* **ZB-H1** (zero bubble, Qi et al. 2023, "handcrafted 1"): the backward is split into
  ``B``, the cotangents of the stage's inputs that the previous stage waits for, and ``W``,
  the weight gradients nothing waits for (``weight_split.split_weight_gradients``). Stage
  ``i`` runs 1F1B's ``S - i - 1`` warm-up forwards, then one forward and one ``B`` per
  step, and its ``W`` of micro-batch ``m`` after the ``B`` of micro-batch ``m + i``: the
  ``W`` s it holds back fill the ticks in which 1F1B's stage ``i`` waits for cotangents in
  the drain. Every task is one tick (``F``, ``B`` and ``W`` taken as equally long), and for
  ``M >= S`` the grid takes ``3 M + S - 1`` ticks: a bubble fraction of
  ``(S - 1) / (3 M + S - 1)``, where 1F1B (with ``B`` and ``W`` as one backward of two
  ticks) takes ``3 M + 3 (S - 1)``, ``3 (S - 1) / (3 M + 3 (S - 1))``. The price is
  memory: a micro-batch's activations live until its ``W``, so every stage holds
  ``min(S, M)`` micro-batches at its peak, 1F1B's stage 0 figure (1F1B's stage ``i``
  holds ``min(S - i, M)``).
* **inference** runs forwards only: ``M + S - 1`` ticks.

A training schedule ends with one ``apply`` tick in which every stage applies its
gradients (``micro_batch`` is ``None`` there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

TaskKind = Literal["forward", "backward", "weight", "apply"]


@dataclass(frozen=True)
class Task:
    """One unit of work: ``stage`` runs ``kind`` on ``micro_batch`` (``None`` for apply).
    ``weight`` is the weight-gradient half of a split backward (ZB-H1's ``W``)."""

    stage: int
    micro_batch: int | None
    kind: TaskKind

    def label(self) -> str:
        if self.kind == "apply":
            return "A"
        return f"{self.kind[0].upper()}{self.micro_batch}"


@dataclass(frozen=True)
class PipelineSchedule:
    """Clock ticks of tasks for ``num_stages`` stages and ``num_micro_batches``."""

    name: str
    num_stages: int
    num_micro_batches: int
    ticks: tuple[tuple[Task, ...], ...]

    @property
    def num_ticks(self) -> int:
        return len(self.ticks)

    def tasks(self) -> list[Task]:
        """All tasks in execution order (tick by tick, stage by stage)."""
        return [task for tick in self.ticks for task in tick]

    def split_stages(self) -> frozenset[int]:
        """The stages whose backward runs as ``backward`` and ``weight`` tasks (ZB-H1)."""
        return frozenset(t.stage for t in self.tasks() if t.kind == "weight")

    def max_in_flight(self) -> list[int]:
        """Per stage, the most micro-batches whose forward ran but whose backward (the
        ``weight`` half, where the stage's backward is split) did not."""
        split = self.split_stages()
        in_flight = [0] * self.num_stages
        peak = [0] * self.num_stages
        for task in self.tasks():
            if task.kind == "forward":
                in_flight[task.stage] += 1
            elif task.kind == ("weight" if task.stage in split else "backward"):
                in_flight[task.stage] -= 1
            peak[task.stage] = max(peak[task.stage], in_flight[task.stage])
        return peak

    def grid(self) -> str:
        """The schedule as a grid: one row per stage, one column per tick."""
        width = max(3, len(str(self.num_micro_batches)) + 2)
        header = "stage |" + "".join(f"{t:>{width}}" for t in range(self.num_ticks))
        rows = [
            f"{self.name}: {self.num_stages} stages x {self.num_micro_batches} micro-batches",
            header,
        ]
        for stage in range(self.num_stages):
            cells = []
            for tick in self.ticks:
                task = next((t for t in tick if t.stage == stage), None)
                cells.append(f"{task.label() if task else '.':>{width}}")
            rows.append(f"{stage:>5} |" + "".join(cells))
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.grid()


def _check_sizes(num_stages: int, num_micro_batches: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_micro_batches", num_micro_batches)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _apply_tick(num_stages: int) -> tuple[Task, ...]:
    return tuple(Task(s, None, "apply") for s in range(num_stages))


def gpipe_schedule(num_stages: int, num_micro_batches: int) -> PipelineSchedule:
    """All forwards, then all backwards, then apply (GPipe)."""
    _check_sizes(num_stages, num_micro_batches)
    S, M = num_stages, num_micro_batches
    fill = M + S - 1
    ticks: list[list[Task]] = [[] for _ in range(2 * fill)]
    for s in range(S):
        for m in range(M):
            ticks[s + m].append(Task(s, m, "forward"))
            ticks[fill + (S - 1 - s) + m].append(Task(s, m, "backward"))
    ordered = [tuple(sorted(t, key=lambda task: task.stage)) for t in ticks]
    return PipelineSchedule("gpipe", S, M, tuple(ordered) + (_apply_tick(S),))


def one_f_one_b_schedule(num_stages: int, num_micro_batches: int) -> PipelineSchedule:
    """1F1B (PipeDream-flush): warm-up forwards, alternate 1F/1B, drain, then apply."""
    _check_sizes(num_stages, num_micro_batches)
    orders = [_one_f_one_b_order(s, num_stages, num_micro_batches) for s in range(num_stages)]
    return _clocked("1f1b", orders, num_stages, num_micro_batches)


def zb_h1_schedule(num_stages: int, num_micro_batches: int) -> PipelineSchedule:
    """ZB-H1: 1F1B with each backward split into ``B`` and ``W``, stage ``i`` holding its
    ``W`` s back by ``i`` micro-batches to fill the drain (module docstring)."""
    _check_sizes(num_stages, num_micro_batches)
    S, M = num_stages, num_micro_batches
    orders = []
    for s in range(S):
        order, next_w = [], 0
        for task in _one_f_one_b_order(s, S, M):
            order.append(task)
            if task.kind == "backward" and task.micro_batch - next_w >= s:
                order.append(Task(s, next_w, "weight"))
                next_w += 1
        order += [Task(s, m, "weight") for m in range(next_w, M)]
        orders.append(order)
    return _clocked("zb-h1", orders, S, M)


def _one_f_one_b_order(s: int, S: int, M: int) -> list[Task]:
    """Stage ``s``'s work under 1F1B: ``S - s - 1`` warm-up forwards, then alternate one
    forward and one backward, then the remaining backwards."""
    warmup = min(S - s - 1, M)
    order = [Task(s, m, "forward") for m in range(warmup)]
    next_f, next_b = warmup, 0
    while next_b < M:
        if next_f < M:
            order.append(Task(s, next_f, "forward"))
            next_f += 1
        order.append(Task(s, next_b, "backward"))
        next_b += 1
    return order


def _clocked(name: str, orders: list[list[Task]], S: int, M: int) -> PipelineSchedule:
    """The schedule in which each stage runs its next task of ``orders[stage]`` at the
    first tick its inputs are ready, then the apply tick."""
    done_at: dict[Task, int] = {}
    positions = [0] * S
    ticks: list[tuple[Task, ...]] = []
    while any(positions[s] < len(orders[s]) for s in range(S)):
        tick = []
        for s in range(S):
            if positions[s] == len(orders[s]):
                continue
            task = orders[s][positions[s]]
            if all(done_at.get(dep, len(ticks)) < len(ticks) for dep in _deps(task, S)):
                tick.append(task)
        if not tick:
            raise AssertionError(f"{name} schedule deadlocked")  # a bug, not a user error
        for task in tick:
            done_at[task] = len(ticks)
            positions[task.stage] += 1
        ticks.append(tuple(tick))
    return PipelineSchedule(name, S, M, tuple(ticks) + (_apply_tick(S),))


def inference_schedule(num_stages: int, num_micro_batches: int) -> PipelineSchedule:
    """Forwards only: micro-batch ``m`` on stage ``s`` at tick ``s + m``."""
    _check_sizes(num_stages, num_micro_batches)
    S, M = num_stages, num_micro_batches
    ticks: list[list[Task]] = [[] for _ in range(M + S - 1)]
    for s in range(S):
        for m in range(M):
            ticks[s + m].append(Task(s, m, "forward"))
    return PipelineSchedule("inference", S, M, tuple(tuple(t) for t in ticks))


def _deps(task: Task, num_stages: int) -> list[Task]:
    """The tasks whose outputs ``task`` reads (the dependency order every schedule keeps)."""
    s, m = task.stage, task.micro_batch
    if task.kind == "forward":
        return [Task(s - 1, m, "forward")] if s > 0 else []
    if task.kind == "backward":
        deps = [Task(s, m, "forward")]
        if s < num_stages - 1:
            deps.append(Task(s + 1, m, "backward"))
        return deps
    if task.kind == "weight":
        return [Task(s, m, "backward")]
    return []


task_dependencies = _deps

#: Schedules by the name ``PipeshardParallel(pipeline_schedule=...)`` takes.
schedules: dict[str, Callable[[int, int], PipelineSchedule]] = {
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
    "zb-h1": zb_h1_schedule,
    "inference": inference_schedule,
}


#: ``pipeline_schedule="auto"``: the planner prices each training schedule on the plan's
#: stages and takes the fastest that fits (``schedule_choice``).
AUTO = "auto"


def check_schedule_name(name) -> None:
    """Raise ``ValueError`` unless ``name`` is a key of :data:`schedules` or ``"auto"``."""
    if not isinstance(name, str) or (name not in schedules and name != AUTO):
        raise ValueError(
            f"unknown pipeline_schedule {name!r}; expected one of {sorted(schedules)} or 'auto'"
        )


def make_schedule(name: str, num_stages: int, num_micro_batches: int) -> PipelineSchedule:
    """The schedule called ``name`` (a key of :data:`schedules`)."""
    if name == AUTO:
        raise ValueError("pipeline_schedule='auto' is chosen by the planner (plan_pipeshard)")
    check_schedule_name(name)
    return schedules[name](num_stages, num_micro_batches)


# ----------------------------------------------------------------------------- Alpa's view
#
# Alpa's programs and tests read a schedule through classes built from a stage dependency
# matrix: ``2 S`` "stages" for ``S`` meshes (forward stage ``i`` and backward stage
# ``2 S - 1 - i`` on mesh ``i``), apply-grad stages placed by ``apply_grad_placement``, and
# ``schedules[clock][mesh]`` a ``(micro_batch, stage)`` pair or ``None``. The classes below
# are that view of the schedules above; the runtime uses the schedules above only.


def gen_linear_pipeline_dependency(num_stage: int) -> np.ndarray:
    """Alpa's dependency matrix of a linear pipeline of ``num_stage`` (forward then
    backward) stages: ``d[i, j] = 1`` when stage ``i`` reads stage ``j``'s output (the stage
    before it, and the backward stage of a forward stage its activations)."""
    if isinstance(num_stage, bool) or not isinstance(num_stage, int) or num_stage < 2:
        raise ValueError(f"num_stage must be an int >= 2, got {num_stage!r}")
    d = np.zeros((num_stage, num_stage), dtype=int)
    for i in range(num_stage - 1):
        d[i + 1, i] = 1
    for i in range(num_stage // 2):
        d[num_stage - 1 - i, i] = 1
    return d


class _AlpaScheduleView:
    """``schedules``, ``num_clock``, ``stage_placement`` and ``mesh_placement`` of one of
    this module's schedules, in Alpa's stage numbering."""

    _make: Callable[[int, int], PipelineSchedule]

    def __init__(self, *, dependency, meshes, apply_grad_placement, num_batch: int = 1):
        dependency = np.asarray(dependency)
        num_stage = dependency.shape[0]
        num_mesh = len(meshes)
        if num_stage != 2 * num_mesh:
            raise ValueError(
                f"{type(self).__name__}: the dependency has {num_stage} stages but there are "
                f"{num_mesh} meshes; a linear pipeline has a forward and a backward stage "
                "per mesh"
            )
        self.dependency = dependency
        self.meshes = meshes
        self.num_stage = num_stage
        self.num_mesh = num_mesh
        self.num_batch = num_batch
        self.apply_grad_placement = dict(apply_grad_placement)
        self.schedule = type(self)._make(num_mesh, num_batch)
        apply_on = {mesh: stage for stage, mesh in self.apply_grad_placement.items()}
        self.schedules: list[list[tuple[int, int] | None]] = []
        for tick in self.schedule.ticks:
            row: list[tuple[int, int] | None] = [None] * num_mesh
            for task in tick:
                if task.kind == "forward":
                    row[task.stage] = (task.micro_batch, task.stage)
                elif task.kind == "backward":
                    row[task.stage] = (task.micro_batch, num_stage - 1 - task.stage)
                elif task.stage in apply_on:
                    row[task.stage] = (0, apply_on[task.stage])
            self.schedules.append(row)

    @property
    def num_clock(self) -> int:
        return len(self.schedules)

    def stage_placement(self, stage_idx: int) -> set[int]:
        """The meshes stage ``stage_idx`` runs on (one)."""
        if stage_idx in self.apply_grad_placement:
            return {self.apply_grad_placement[stage_idx]}
        return {stage_idx if stage_idx < self.num_mesh else self.num_stage - 1 - stage_idx}

    def mesh_placement(self, mesh_idx: int) -> set[int]:
        """The stages mesh ``mesh_idx`` runs: its forward, its backward, its apply-grad."""
        stages = {mesh_idx, self.num_stage - 1 - mesh_idx}
        stages |= {s for s, m in self.apply_grad_placement.items() if m == mesh_idx}
        return stages

    def pprint_schedule(self) -> str:
        return self.schedule.grid()


class GpipeSchedule(_AlpaScheduleView):
    """Alpa's name for the GPipe schedule (:func:`gpipe_schedule`)."""

    _make = staticmethod(gpipe_schedule)


class PipeDreamFlush(_AlpaScheduleView):
    """Alpa's name for the 1F1B schedule (:func:`one_f_one_b_schedule`)."""

    _make = staticmethod(one_f_one_b_schedule)
