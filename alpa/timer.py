"""Named wall-clock timers: ``alpa.timers`` (Alpa's ``alpa.timer.timers``).

The compiler records how long each compilation spends in its phases under fixed names,
so that a user can see where the first call of a step goes:

=============  ==============================================================
``tracing``    tracing the step to a jaxpr (``jax.make_jaxpr`` and alpa's markers)
``planning``   deciding the plan: the auto-sharding ILP, or layers, stage DP and the
               sharding of every stage for a pipeline (no device is touched)
``compile``    lowering the plan and compiling it with XLA (and, on Ray, loading it on
               the mesh workers)
=============  ==============================================================

``AutoStageOption``'s stage construction (inside ``planning``) is timed under Alpa's
names: ``stage-construction`` in all, and its parts ``stage-construction-compilation``
(the step cut into the computations of every candidate stage on every submesh),
``stage-construction-profiling`` (the stage cost model pricing them: the per-layer
auto-sharding plans of the analytic model, or compiling and timing each candidate) and
``stage-construction-dp`` (the dynamic program).

A timer keeps every interval it measured: ``timers("planning").elapsed()`` is the last
one, ``elapsed(mode="sum")`` the total and ``elapsed(mode="average")`` the mean. A user may
time their own phases with the same object (``timers("step").start()`` / ``.stop()``, or
``with timers("step"):``). ``timers.log(names)`` returns a one-line summary.

These are process-wide on purpose, as in Alpa: a compilation happens inside
``parallelize``'s call and has nowhere else to hand its phase times back. They only ever
grow; ``timers(name).reset()`` or ``timers.reset()`` clears them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Literal

#: The phases the compiler times (module docstring).
COMPILER_PHASES = ("tracing", "planning", "compile")


class Timer:
    """One named timer: a list of measured intervals, in seconds."""

    def __init__(self, name: str):
        self.name = name
        self.costs: list[float] = []
        self._started: float | None = None

    @property
    def started(self) -> bool:
        return self._started is not None

    def start(self) -> Timer:
        if self._started is not None:
            raise RuntimeError(f"timer {self.name!r} is already running")
        self._started = time.perf_counter()
        return self

    def stop(self) -> float:
        """Stop the timer; returns the interval just measured."""
        if self._started is None:
            raise RuntimeError(f"timer {self.name!r} was stopped without being started")
        cost = time.perf_counter() - self._started
        self._started = None
        self.costs.append(cost)
        return cost

    def reset(self) -> None:
        self.costs.clear()
        self._started = None

    def elapsed(self, mode: Literal["last", "sum", "average"] = "last") -> float:
        """Seconds: the last interval, their sum, or their mean (0.0 when none)."""
        if mode not in ("last", "sum", "average"):
            raise ValueError(f"mode must be 'last', 'sum' or 'average', got {mode!r}")
        if not self.costs:
            return 0.0
        if mode == "last":
            return self.costs[-1]
        total = sum(self.costs)
        return total if mode == "sum" else total / len(self.costs)

    def __enter__(self) -> Timer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Timer({self.name!r}, {len(self.costs)} intervals, sum {self.elapsed('sum'):.3f} s)"


class Timers:
    """Timers by name; ``timers(name)`` returns the timer, creating it on first use."""

    def __init__(self):
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        if not isinstance(name, str):
            raise TypeError(f"a timer name must be a str, got {type(name).__name__}: {name!r}")
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = Timer(name)
        return timer

    def __contains__(self, name: str) -> bool:
        return name in self._timers

    def names(self) -> list[str]:
        return list(self._timers)

    def reset(self) -> None:
        for timer in self._timers.values():
            timer.reset()

    def log(self, names: Iterable[str] = COMPILER_PHASES, mode: str = "last") -> str:
        """``"tracing: 0.012 s, planning: 0.310 s, compile: 0.845 s"``."""
        return ", ".join(f"{n}: {self(n).elapsed(mode):.3f} s" for n in names)


#: The process-wide timers (module docstring).
timers = Timers()


@contextlib.contextmanager
def timed(name: str) -> Iterator[None]:
    """Time the block on ``timers(name)``; a block nested in one already timing the same
    phase (a compilation that compiles another step, as ``CreateStateParallel`` does) is
    part of the outer interval."""
    timer = timers(name)
    if timer.started:
        yield
        return
    with timer:
        yield
