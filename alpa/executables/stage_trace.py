"""Stage traces: when each stage computation of a pipelined step ran.

With ``alpa.global_config.collect_trace`` set (read at every step), a pipelined step waits
for every stage computation it runs and records when it started and ended (wall clock,
``time.time()``; on Ray, each mesh's first worker's clock). Waiting makes the times the
computations' own, at the price of the overlap a step has without it; the records of
all traced steps accumulate, as Alpa's tracer's did, until :meth:`StageTrace.clear`.

``executable.get_stage_execution_info()`` returns them as Alpa did: per stage
computation, in the order of the plan's computations (each stage's forward, backward and
apply-gradient programs), the list of its runs as ``(start, stop, host_ids, devices)``,
where ``host_ids`` and ``devices`` say where its mesh is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StageTrace:
    """The recorded runs of one executable's stage computations (module docstring)."""

    num_computations: int
    runs: list[tuple[int, float, float]] = field(default_factory=list)

    def add(self, computation: int, start: float, stop: float) -> None:
        if not 0 <= computation < self.num_computations:
            raise ValueError(
                f"computation {computation} is not one of the {self.num_computations} traced"
            )
        self.runs.append((computation, start, stop))

    def clear(self) -> None:
        self.runs.clear()

    def info(
        self, where: Callable[[int], tuple[Sequence[int], Sequence[Any]]]
    ) -> list[list[tuple[float, float, tuple[int, ...], tuple[Any, ...]]]]:
        """Per computation, its runs as ``(start, stop, host_ids, devices)`` in the order
        they ran; ``where(computation)`` gives its mesh's hosts and devices."""
        out: list[list] = [[] for _ in range(self.num_computations)]
        places = [where(c) for c in range(self.num_computations)]
        for computation, start, stop in sorted(self.runs, key=lambda run: run[1]):
            hosts, devices = places[computation]
            out[computation].append((start, stop, tuple(hosts), tuple(devices)))
        return out
