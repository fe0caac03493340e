"""A pipeline schedule as a value: :class:`PipelineSchedule`, clock ticks of
:class:`Task` s, with what the planner and the pictures read off it (the stages of each
mesh, the micro-batches in flight, the grid). The schedules themselves are generated in
:mod:`schedules`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

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
    stage_meshes: tuple[int, ...] = ()

    @property
    def num_ticks(self) -> int:
        return len(self.ticks)

    @property
    def num_meshes(self) -> int:
        return max(self.stage_meshes) + 1 if self.stage_meshes else self.num_stages

    def mesh_of(self, stage: int) -> int:
        """The mesh stage ``stage`` runs on (``stage`` itself unless the schedule places
        several stages on one mesh: ``stage_meshes``)."""
        return self.stage_meshes[stage] if self.stage_meshes else stage

    def tasks(self) -> list[Task]:
        """All tasks in execution order (tick by tick, stage by stage)."""
        return [task for tick in self.ticks for task in tick]

    def split_stages(self) -> frozenset[int]:
        """The stages whose backward runs as ``backward`` and ``weight`` tasks (ZB-H1)."""
        return frozenset(t.stage for t in self.tasks() if t.kind == "weight")

    def stages_of(self, mesh: int) -> list[int]:
        """The stages that run on ``mesh``."""
        return [s for s in range(self.num_stages) if self.mesh_of(s) == mesh]

    def in_flight_changes(self) -> Iterator[tuple[int, list[int]]]:
        """Each time a stage's micro-batches in flight change (a forward starts one; its
        backward, the ``weight`` half where the stage's backward is split, ends it): that
        stage, and every stage's count then (one list, updated in place)."""
        split = self.split_stages()
        in_flight = [0] * self.num_stages
        for task in self.tasks():
            if task.kind == "forward":
                in_flight[task.stage] += 1
            elif task.kind == ("weight" if task.stage in split else "backward"):
                in_flight[task.stage] -= 1
            else:
                continue
            yield task.stage, in_flight

    def max_in_flight(self) -> list[int]:
        """Per stage, the most micro-batches whose forward ran but whose backward (the
        ``weight`` half, where the stage's backward is split) did not."""
        peak = [0] * self.num_stages
        for stage, in_flight in self.in_flight_changes():
            peak[stage] = max(peak[stage], in_flight[stage])
        return peak

    def max_in_flight_per_mesh(self) -> list[int]:
        """Per mesh, the most (stage, micro-batch) pairs of its stages whose forward ran
        but whose backward (``weight`` half where split) did not: the activations the mesh
        holds, counted in stage-sized units (:meth:`max_in_flight` where every mesh runs
        one stage)."""
        stages = [self.stages_of(m) for m in range(self.num_meshes)]
        peak = [0] * self.num_meshes
        for stage, in_flight in self.in_flight_changes():
            m = self.mesh_of(stage)
            peak[m] = max(peak[m], sum(in_flight[t] for t in stages[m]))
        return peak

    def grid(self) -> str:
        """The schedule as a grid: one row per mesh (a stage, unless the schedule places
        several stages on one mesh: then a cell names the stage, ``F3:2`` is micro-batch
        3's forward of stage 2), one column per tick."""
        several = bool(self.stage_meshes)

        def label(task: Task) -> str:
            if several and task.kind != "apply":
                return f"{task.label()}:{task.stage}"
            return task.label()

        width = max(3, len(str(self.num_micro_batches)) + 2)
        if several:
            width += len(str(self.num_stages)) + 1
        rows_name = "mesh " if several else "stage"
        header = f"{rows_name} |" + "".join(f"{t:>{width}}" for t in range(self.num_ticks))
        title = f"{self.name}: {self.num_stages} stages x {self.num_micro_batches} micro-batches"
        if several:
            title += f" on {self.num_meshes} meshes"
        rows = [title, header]
        for mesh in range(self.num_meshes):
            cells = []
            for tick in self.ticks:
                task = next((t for t in tick if self.mesh_of(t.stage) == mesh), None)
                cells.append(f"{label(task) if task else '.':>{width}}")
            rows.append(f"{mesh:>5} |" + "".join(cells))
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.grid()
