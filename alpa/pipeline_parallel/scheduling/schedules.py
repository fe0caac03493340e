"""Pipeline schedules as data.

A schedule says which stage runs which micro-batch, and whether it runs the forward, the
backward or the apply-grad computation, on each clock tick. It is a plain value: a tuple of
ticks, each a tuple of :class:`Task` ``(stage, micro_batch, kind)``, at most one task per
mesh per tick but in the apply tick (stage ``i`` runs on mesh ``i``, but where a schedule
places several stages on one mesh: ``PipelineSchedule.stage_meshes``). The value itself
is :mod:`schedule_record`'s :class:`PipelineSchedule`; this module generates the schedules.
The runtime emitter turns a schedule plus the compiled stages into instruction lists;
nothing here touches devices.

With ``S`` stages and ``M`` micro-batches (``docs/pipeline.md``, By hand, Schedules):

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
* **interleaved 1F1B** (Narayanan et al. 2021, Megatron-LM's virtual pipeline) places
  ``S = v p`` stages on ``p`` meshes, stage ``i`` on mesh ``i mod p``: each mesh holds
  ``v`` chunks of the model, each ``1/v`` of a 1F1B stage. Mesh ``d`` runs micro-batches in
  groups of ``p`` (``M`` must be a multiple of ``p``), all of a group's chunk-0 forwards,
  then its chunk-1 forwards, ...; it warms up with ``2 (p - d - 1) + (v - 1) p`` forwards,
  alternates one forward and one backward (backwards visit the chunks in reverse), and
  drains. With every chunk task one tick, the grid takes ``2 v M + 2 (p - 1)`` ticks: a
  bubble fraction of ``(p - 1) / (v M + p - 1)``, against 1F1B's ``(p - 1) / (M + p - 1)``
  on the same ``p`` meshes (``2 (M + p - 1)`` ticks of ``v`` times longer tasks). The
  price is memory: mesh ``d`` holds at most ``min(2 (p - d - 1) + (v - 1) p + 1, v M)``
  chunks' activations, ``1/v`` of a 1F1B stage's each (1F1B's mesh ``d``: ``p - d``
  stages').
* **DualPipeV** (DeepSeek's DualPipe "cut in half") places ``S = 2 p`` stages on ``p``
  meshes in a V, stage ``i`` on mesh ``min(i, 2 p - 1 - i)``: mesh ``d`` runs stage ``d``
  on the way down and stage ``2 p - 1 - d`` on the way up (the turn, stages ``p - 1`` and
  ``p``, is on one mesh), with ZB-H1's split backward; ``M >= 2 p``. Mesh ``d`` warms up
  with chunk-0 forwards, runs a steady phase of (chunk-0 forward, chunk-1 backward,
  chunk-1 forward, chunk-0 backward), and defers ``W`` s into its drain
  (:class:`_DualPipeVMesh`). With every task one tick and ``p >= 2``, the grid takes
  ``6 M + p - 1`` ticks, every mesh but mesh 0 (whose stage 0 keeps its backward whole)
  busy for ``6 M``: a bubble fraction of ``(p - 1) / (6 M + p - 1)``; in time, with a
  stage of the V half a 1F1B stage on ``p`` meshes (which takes 3 units a micro-batch),
  ``3 M + (p - 1) / 2`` against ZB-H1's ``3 M + (p - 1)`` and 1F1B's ``3 M + 3 (p - 1)``.
  Stage ``i`` holds ``2 p - i`` micro-batches at its peak, each mesh ``2 p + 1``
  half-stages' activations (``p + 1/2`` of a 1F1B stage's, ZB-H1's ``p``).
* **inference** runs forwards only: ``M + S - 1`` ticks.

A training schedule ends with one ``apply`` tick in which every stage applies its
gradients (``micro_batch`` is ``None`` there).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from alpa.pipeline_parallel.scheduling.schedule_record import PipelineSchedule, Task, TaskKind


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


def interleaved_1f1b_schedule(
    num_stages: int, num_micro_batches: int, num_meshes: int | None = None
) -> PipelineSchedule:
    """Interleaved 1F1B (Narayanan et al. 2021): ``num_stages = v p`` stages on
    ``p = num_meshes`` meshes, stage ``i`` on mesh ``i mod p``, so that each mesh holds
    ``v`` chunks of the model (module docstring). ``num_meshes`` defaults to half the
    stages (``v = 2``); ``num_micro_batches`` must be a multiple of ``p``."""
    _check_sizes(num_stages, num_micro_batches)
    p = num_stages // 2 if num_meshes is None else num_meshes
    if not isinstance(p, int) or p < 1 or num_stages % p:
        raise ValueError(
            f"interleaved 1F1B places stage i on mesh i mod num_meshes: num_stages "
            f"({num_stages}) must be a multiple of num_meshes, got num_meshes={p!r}"
        )
    v, M = num_stages // p, num_micro_batches
    if M % p:
        raise ValueError(
            f"interleaved 1F1B runs micro-batches in groups of one per mesh: "
            f"num_micro_batches ({M}) must be a multiple of the number of meshes ({p})"
        )

    def task(k: int, d: int, kind: TaskKind) -> Task:
        chunk = (k // p) % v
        if kind == "backward":
            chunk = v - 1 - chunk
        return Task(chunk * p + d, (k // (p * v)) * p + k % p, kind)

    total, orders = v * M, []
    for d in range(p):
        warmup = min((p - d - 1) * 2 + (v - 1) * p, total)
        order = [task(k, d, "forward") for k in range(warmup)]
        for i in range(total - warmup):
            order += [task(warmup + i, d, "forward"), task(i, d, "backward")]
        order += [task(k, d, "backward") for k in range(total - warmup, total)]
        orders.append(order)
    meshes = tuple(i % p for i in range(num_stages))
    return _clocked("interleaved-1f1b", orders, num_stages, M, meshes)


def dualpipev_schedule(
    num_stages: int, num_micro_batches: int, num_meshes: int | None = None
) -> PipelineSchedule:
    """DualPipeV (DeepSeek's DualPipe cut in half): ``2 p`` stages on ``p`` meshes in a V,
    stage ``i`` on mesh ``min(i, 2 p - 1 - i)``, each mesh holding a stage of each half
    (its chunk 0 on the way down, chunk 1 on the way up), the backward split into ``B``
    and ``W`` as ZB-H1's (module docstring). ``num_micro_batches`` must be at least
    ``2 p``; ``num_meshes``, if given, must be ``num_stages / 2``."""
    _check_sizes(num_stages, num_micro_batches)
    p, M = num_stages // 2, num_micro_batches
    if num_stages % 2 or (num_meshes is not None and num_meshes != p):
        raise ValueError(
            f"DualPipeV places 2 stages on each mesh in a V: num_stages ({num_stages}) must "
            f"be twice num_meshes, got num_meshes={num_meshes!r}"
        )
    if M < 2 * p:
        raise ValueError(
            f"DualPipeV needs at least 2 micro-batches per mesh: num_micro_batches ({M}) "
            f"must be at least {2 * p}"
        )
    orders = [_DualPipeVMesh(d, p, M).order() for d in range(p)]
    meshes = tuple(min(i, num_stages - 1 - i) for i in range(num_stages))
    return _clocked("dualpipev", orders, num_stages, M, meshes)


class _DualPipeVMesh:
    """The order of mesh ``d``'s tasks under DualPipeV, phase by phase: forwards of chunk
    0 only (``2 (p - d - 1)``); chunk-0 / chunk-1 forward pairs (``d + 1``); chunk-1
    ``B``, its ``W``, a chunk-1 forward (``p - d - 1``); the steady phase of a chunk-0
    forward, a chunk-1 backward, a chunk-1 forward and a chunk-0 backward
    (``M - 2 p + d + 1``); chunk-1 backward, forward, chunk-0 backward (``p - d - 1``);
    backward pairs (``d + 1``), whose second half defers its ``W`` s; deferred ``W`` with a
    chunk-0 ``B`` (``p - d - 1``); the remaining ``W`` s. A backward not deferred is ``B``
    then ``W`` at once; stage 0 sends no cotangent and keeps its backward whole."""

    def __init__(self, d: int, p: int, M: int):
        self.d, self.p, self.M = d, p, M
        self.stages = (d, 2 * p - 1 - d)
        self.next = {("forward", 0): 0, ("forward", 1): 0, ("backward", 0): 0, ("backward", 1): 0}
        self.deferred: list[Task] = []
        self.tasks: list[Task] = []

    def forward(self, chunk: int) -> None:
        m = self.next[("forward", chunk)]
        self.next[("forward", chunk)] += 1
        self.tasks.append(Task(self.stages[chunk], m, "forward"))

    def backward(self, chunk: int, defer: bool = False) -> None:
        stage = self.stages[chunk]
        m = self.next[("backward", chunk)]
        self.next[("backward", chunk)] += 1
        self.tasks.append(Task(stage, m, "backward"))
        if stage == 0:
            return
        (self.deferred if defer else self.tasks).append(Task(stage, m, "weight"))

    def weight(self) -> None:
        if self.deferred:
            self.tasks.append(self.deferred.pop(0))

    def order(self) -> list[Task]:
        d, p, M = self.d, self.p, self.M
        for _ in range(2 * (p - d - 1)):
            self.forward(0)
        for _ in range(d + 1):
            self.forward(0)
            self.forward(1)
        for _ in range(p - d - 1):
            self.backward(1, defer=True)
            self.weight()
            self.forward(1)
        for _ in range(M - 2 * p + d + 1):
            self.forward(0)
            self.backward(1)
            self.forward(1)
            self.backward(0)
        for _ in range(p - d - 1):
            self.backward(1)
            self.forward(1)
            self.backward(0)
        defer, half = False, (d + 1) // 2
        for i in range(d + 1):
            defer = defer or (i == half and d % 2 == 1)
            self.backward(1, defer)
            defer = defer or (i == half and d % 2 == 0)
            self.backward(0, defer)
        for _ in range(p - d - 1):
            self.weight()
            self.backward(0, defer=True)
        while self.deferred:
            self.weight()
        return self.tasks


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


def _clocked(
    name: str, orders: list[list[Task]], S: int, M: int, stage_meshes: tuple[int, ...] = ()
) -> PipelineSchedule:
    """The schedule in which each mesh runs its next task of ``orders[mesh]`` at the first
    tick its inputs are ready, then the apply tick. ``S`` counts stages; ``orders`` has one
    list per mesh (one per stage unless ``stage_meshes`` places several on one mesh)."""
    done_at: dict[Task, int] = {}
    positions = [0] * len(orders)
    ticks: list[tuple[Task, ...]] = []
    while any(positions[m] < len(orders[m]) for m in range(len(orders))):
        tick = []
        for m, order in enumerate(orders):
            if positions[m] == len(order):
                continue
            task = order[positions[m]]
            if all(done_at.get(dep, len(ticks)) < len(ticks) for dep in _deps(task, S)):
                tick.append((m, task))
        if not tick:
            raise AssertionError(f"{name} schedule deadlocked")  # a bug, not a user error
        for m, task in tick:
            done_at[task] = len(ticks)
            positions[m] += 1
        ticks.append(tuple(task for _, task in tick))
    return PipelineSchedule(name, S, M, tuple(ticks) + (_apply_tick(S),), stage_meshes)


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
    "interleaved-1f1b": interleaved_1f1b_schedule,
    "dualpipev": dualpipev_schedule,
    "inference": inference_schedule,
}

#: The schedules that place two stages on each mesh: they take the number of meshes.
SHARED_MESH_SCHEDULES = frozenset({"interleaved-1f1b", "dualpipev"})

#: The schedules that run a stage's backward as ``B`` and ``W`` (``weight_split``).
SPLIT_BACKWARD_SCHEDULES = frozenset({"zb-h1", "dualpipev"})


def stage_placement(name: str, num_stages: int) -> tuple[int, ...]:
    """Per stage, the mesh the schedule ``name`` places it on when ``PipeshardParallel``
    plans ``num_stages`` stages for it: stage ``i`` on mesh ``i`` but for
    :data:`SHARED_MESH_SCHEDULES`, which place two stages on each of ``S / 2`` meshes:
    interleaved 1F1B stage ``i`` on mesh ``i mod (S / 2)``, DualPipeV stage ``i`` on mesh
    ``min(i, S - 1 - i)`` (a V)."""
    if name not in SHARED_MESH_SCHEDULES:
        return tuple(range(num_stages))
    if num_stages % 2:
        raise ValueError(
            f"pipeline_schedule={name!r} places 2 stages on each mesh, but there are "
            f"{num_stages} stages (not a multiple of 2)"
        )
    p = num_stages // 2
    if name == "dualpipev":
        return tuple(min(i, num_stages - 1 - i) for i in range(num_stages))
    return tuple(i % p for i in range(num_stages))


#: ``pipeline_schedule="auto"``: the planner prices each training schedule on the plan's
#: stages and takes the fastest that fits (``schedule_choice``).
AUTO = "auto"


def check_schedule_name(name) -> None:
    """Raise ``ValueError`` unless ``name`` is a key of :data:`schedules` or ``"auto"``."""
    if not isinstance(name, str) or (name not in schedules and name != AUTO):
        raise ValueError(
            f"unknown pipeline_schedule {name!r}; expected one of {sorted(schedules)} or 'auto'"
        )


def make_schedule(
    name: str, num_stages: int, num_micro_batches: int, num_meshes: int | None = None
) -> PipelineSchedule:
    """The schedule called ``name`` (a key of :data:`schedules`) of ``num_stages`` stages on
    ``num_meshes`` meshes (``None``: the schedule's default; one stage per mesh for all but
    :data:`SHARED_MESH_SCHEDULES`)."""
    if name == AUTO:
        raise ValueError("pipeline_schedule='auto' is chosen by the planner (plan_pipeshard)")
    check_schedule_name(name)
    if name in SHARED_MESH_SCHEDULES:
        return schedules[name](num_stages, num_micro_batches, num_meshes)
    if num_meshes is not None and num_meshes != num_stages:
        raise ValueError(
            f"pipeline_schedule {name!r} runs one stage per mesh, but {num_stages} stages "
            f"were placed on {num_meshes} meshes; a schedule of "
            f"{sorted(SHARED_MESH_SCHEDULES)} places several stages on one mesh"
        )
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
