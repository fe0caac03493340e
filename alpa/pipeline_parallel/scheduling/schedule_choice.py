"""``pipeline_schedule="auto"``: each training schedule priced on the plan's stages, the
fastest that fits memory chosen.

The schedules trade bubble against activation memory (``schedules`` states both in closed
form): GPipe and 1F1B take the same time, GPipe holding every micro-batch's activations;
ZB-H1 fills most of 1F1B's bubble with the weight-gradient halves of the backward and holds
``min(S, M)`` micro-batches on every stage where 1F1B's stage ``i`` holds
``min(S - i, M)``. Which one is fastest *within memory* depends on the plan, so it is
decided on it:

* **time**: the schedule run at the stages' predicted latencies per micro-batch
  (``plan_view.timeline``: a forward a third of the latency, the backward the rest,
  halved between ``B`` and ``W`` where the schedule splits it, each task as soon as its
  stage and its inputs are ready), its makespan less the apply-grad blocks;
* **memory**: per stage, the analytic model's bytes per device under 1F1B
  (``StagePlanCost.memory``: state, temporaries, activations of its in-flight
  micro-batches) with the in-flight count replaced by the schedule's
  (``PipelineSchedule.max_in_flight``), against the budget the stages were planned for.

The fastest candidate that fits is chosen (on a tie, the one that holds less); when none
fits, the one that holds the least, and the plan says so. The stages themselves are the
stage DP's, which prices every schedule as 1F1B: the candidates are compared on the same
stages, so ``"auto"`` predicts no worse than any single schedule on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from alpa.pipeline_parallel.scheduling.plan_view import timeline
from alpa.pipeline_parallel.scheduling.schedule_record import PipelineSchedule
from alpa.pipeline_parallel.scheduling.schedules import make_schedule

#: The training schedules ``"auto"`` chooses from.
CANDIDATES = ("gpipe", "1f1b", "zb-h1")


@dataclass(frozen=True)
class ScheduleCandidate:
    """One schedule priced on a plan's stages: ``seconds`` per step (the timeline's
    makespan), ``memory`` per stage (bytes per device) and whether every stage ``fits``.
    ``note`` says on which stages, where they are not the plan's (``candidate_stages``),
    or why the schedule does not apply (``not applicable: ...``; ``seconds`` is then
    infinite)."""

    name: str
    seconds: float
    memory: tuple[float, ...]
    fits: bool
    note: str = ""

    @property
    def applicable(self) -> bool:
        return self.seconds != float("inf")

    def line(self) -> str:
        if not self.applicable:
            return f"{self.name}: {self.note}"
        peak = max(self.memory) / 2**30 if self.memory else 0.0
        fits = "fits" if self.fits else "does not fit"
        note = f"; {self.note}" if self.note else ""
        return f"{self.name}: {self.seconds:.4g} s/step, peak {peak:.3g} GiB/device ({fits}{note})"


def price_schedules(
    latencies: Sequence[float],
    memory: Sequence[float],
    activation_memory: Sequence[float],
    num_micro_batches: int,
    budget: float,
    candidates: Sequence[str] = CANDIDATES,
    bound: Callable[..., float] | None = None,
) -> list[ScheduleCandidate]:
    """Each of ``candidates`` priced (module docstring) on stages of ``latencies`` (seconds
    per micro-batch) whose 1F1B ``memory`` holds ``activation_memory`` bytes per
    micro-batch in flight; ``bound`` as in :func:`price_schedule`."""
    return [
        price_schedule(
            make_schedule(name, len(latencies), num_micro_batches),
            latencies,
            memory,
            activation_memory,
            budget,
            bound=bound,
        )
        for name in candidates
    ]


def price_schedule(
    schedule: PipelineSchedule,
    latencies: Sequence[float],
    memory: Sequence[float],
    activation_memory: Sequence[float],
    budget: float,
    note: str = "",
    bound: Callable[..., float] | None = None,
) -> ScheduleCandidate:
    """``schedule`` priced on its stages: time, its timeline at ``latencies`` (raised to
    ``bound``'s floor, ``stage_work.StepBound``, where the cluster has a profile); memory,
    the 1F1B ``memory`` per stage (``StagePlanCost.memory``) with the schedule's
    micro-batches of ``activation_memory`` in flight, per mesh (module docstring)."""
    base = without_activations(memory, activation_memory, schedule.num_micro_batches)
    held = held_memory(schedule, base, activation_memory)
    fits = all(m <= budget for m in held)
    seconds = makespan(schedule, latencies)
    if bound is not None:
        seconds = bound(seconds, schedule)
    return ScheduleCandidate(schedule.name, seconds, held, fits, note)


def makespan(schedule: PipelineSchedule, latencies: Sequence[float]) -> float:
    """Seconds from the first task to the last backward of ``schedule`` run at
    ``latencies`` (``plan_view.timeline``), apply-grad left out."""
    return max((b.end for b in timeline(schedule, latencies) if b.kind != "apply"), default=0.0)


def without_activations(
    memory: Sequence[float], activation_memory: Sequence[float], num_micro_batches: int
) -> tuple[float, ...]:
    """Per stage, the analytic model's bytes per device (``StagePlanCost.memory``, 1F1B's
    ``min(S - s, M)`` micro-batches in flight on stage ``s``) less its activations."""
    S, M = len(memory), max(1, num_micro_batches)
    pairs = enumerate(zip(memory, activation_memory, strict=True))
    return tuple(m - a * min(S - s, M) for s, (m, a) in pairs)


def held_memory(
    schedule: PipelineSchedule, base: Sequence[float], activation_memory: Sequence[float]
) -> tuple[float, ...]:
    """Per stage, the peak bytes per device of its mesh under ``schedule``: each stage's
    ``base`` bytes plus ``activation_memory`` per micro-batch it holds in flight, summed
    over the stages of the mesh (several under interleaved 1F1B) at every step of the
    schedule."""
    stages_of = {m: schedule.stages_of(m) for m in range(schedule.num_meshes)}
    peak = {m: sum(base[s] for s in stages) for m, stages in stages_of.items()}
    for stage, in_flight in schedule.in_flight_changes():
        m = schedule.mesh_of(stage)
        held = sum(base[t] + activation_memory[t] * in_flight[t] for t in stages_of[m])
        peak[m] = max(peak[m], held)
    return tuple(peak[schedule.mesh_of(s)] for s in range(schedule.num_stages))


def choose(candidates: Sequence[ScheduleCandidate]) -> ScheduleCandidate:
    """The fastest candidate that fits (on a tie, the one that holds less), else the one
    that holds the least."""
    fitting = [c for c in candidates if c.fits]
    if fitting:
        return min(fitting, key=lambda c: (c.seconds, max(c.memory, default=0.0)))
    applicable = [c for c in candidates if c.applicable]
    return min(applicable, key=lambda c: max(c.memory, default=0.0))
