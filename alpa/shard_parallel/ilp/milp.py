"""A mixed-integer linear program held in arrays, solved by HiGHS or CBC.

The auto-sharding ILP (``ilp_solver``) writes its variables and rows here and reads back
the values; which solver runs is a setting, not a rewrite:

* ``"highs"`` (the default): HiGHS through ``highspy``, in this process: the model is
  handed over as a row-wise sparse matrix, with no file written and no process started.
* ``"cbc"``: CBC through PuLP (a subprocess reading an MPS file), kept to compare with.

Measured on the stage-cost ILPs of GPT-39B on 64 GPUs (``benchmark/pipeline/
bench_ilp_solvers.py``): the same objectives, HiGHS several times faster, most of CBC's
time being PuLP's expression objects, the MPS file and the process start
(``docs/auto_sharding.md``).

A solve returns the variables' values and a status: ``"optimal"``, ``"feasible (time
limit)"`` (stopped at the time limit with a plan: its values are returned), or
``"infeasible"`` / ``"no solution"`` (``values`` is ``None``).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

SOLVERS = ("highs", "cbc")


@dataclass
class Milp:
    """``minimize cost . x`` subject to ``row_lower <= A x <= row_upper`` and
    ``lower <= x <= upper``, ``x[i]`` integral where ``integer[i]``."""

    cost: list[float] = field(default_factory=list)
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    row_start: list[int] = field(default_factory=lambda: [0])
    row_index: list[int] = field(default_factory=list)
    row_value: list[float] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    #: Let HiGHS presolve the model. Off for the auto-sharding ILPs without a memory
    #: budget: on GPT-39B's stage-cost ILPs HiGHS then takes 25-30 % less time for the
    #: same objectives (their LP relaxations are mostly integral already, and presolve
    #: removes little from them).
    presolve: bool = True
    #: ``incumbent(relaxed)``: a feasible solution built from the LP relaxation's values,
    #: handed to HiGHS as its first incumbent when the relaxation is fractional (HiGHS
    #: then spends its time proving rather than searching; the optimum is the same).
    incumbent: Callable[[np.ndarray], np.ndarray] | None = None

    @property
    def num_vars(self) -> int:
        return len(self.cost)

    def add_var(self, cost: float = 0.0, lower: float = 0.0, upper: float = 1.0, integer=False):
        self.cost.append(float(cost))
        self.lower.append(float(lower))
        self.upper.append(float(upper))
        self.integer.append(bool(integer))
        return len(self.cost) - 1

    def add_vars(self, costs, integer: bool = False) -> list[int]:
        """Variables in ``[0, 1]``, one per cost."""
        first = len(self.cost)
        self.cost += [float(c) for c in costs]
        count = len(self.cost) - first
        self.lower += [0.0] * count
        self.upper += [1.0] * count
        self.integer += [bool(integer)] * count
        return list(range(first, first + count))

    def add_binaries(self, costs) -> list[int]:
        return self.add_vars(costs, integer=True)

    def add_row(self, index, value, lower: float, upper: float, distinct: bool = False) -> None:
        """``lower <= sum_k value[k] * x[index[k]] <= upper`` (repeated indices add up;
        ``distinct``: the caller knows there are none, and nothing is merged)."""
        if distinct:
            if len(index) != len(value):
                raise ValueError(f"{len(index)} indices but {len(value)} values")
            self.row_index += [int(i) for i in index]
            self.row_value += [float(v) for v in value]
        else:
            merged: dict[int, float] = {}
            for i, v in zip(index, value, strict=True):
                merged[int(i)] = merged.get(int(i), 0.0) + float(v)
            self.row_index += list(merged)
            self.row_value += list(merged.values())
        self.row_start.append(len(self.row_index))
        self.row_lower.append(float(lower))
        self.row_upper.append(float(upper))

    def solve(self, solver: str, time_limit: float) -> tuple[np.ndarray | None, str]:
        """``(values, status)`` (module docstring). A model equal to one solved before in
        this process (the same arrays, solver and presolve) gets that solve's answer."""
        if solver not in SOLVERS:
            raise ValueError(f"ILP solver must be one of {SOLVERS}, got {solver!r}")
        return _SOLVED.solve(self, solver, time_limit)

    def digest(self, solver: str) -> bytes:
        """What identifies the model's answer: its arrays, ``presolve`` and the solver."""
        h = hashlib.sha256(f"{solver} {self.presolve} {self.num_vars}".encode())
        for values, dtype in (
            (self.cost, np.float64),
            (self.lower, np.float64),
            (self.upper, np.float64),
            (self.integer, np.bool_),
            (self.row_start, np.int64),
            (self.row_index, np.int64),
            (self.row_value, np.float64),
            (self.row_lower, np.float64),
            (self.row_upper, np.float64),
        ):
            h.update(np.asarray(values, dtype=dtype).tobytes())
            h.update(b"|")
        return h.digest()


# ----------------------------------------------------------------------------- answers


class _Solved:
    """The answers of the last models solved, by :meth:`Milp.digest`: a model equal to
    one solved before is not solved again. Planning builds equal ILPs: a stage of one
    layer is planned again as a stage (the same ILP as its layer's in the stage-cost
    table), and ``plan.cost`` prices the chosen stages with the ILPs the search solved.
    GPT-39B on 64 GPUs (``benchmark/pipeline``): 104 solves instead of 121. An equal
    model solved on another thread at the same time is waited for, not solved twice.
    Only ``"optimal"`` and ``"infeasible"`` answers are kept: a solve stopped by its time
    limit is not the model's answer. The answer is the one solving again would give
    (HiGHS on one thread is deterministic); the values are copied out, so no caller
    changes another's."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._answers: collections.OrderedDict = collections.OrderedDict()
        self._running: dict[bytes, threading.Event] = {}
        self._lock = threading.Lock()

    def solve(self, model: Milp, solver: str, time_limit: float):
        key = model.digest(solver)
        while True:
            with self._lock:
                if key in self._answers:
                    self._answers.move_to_end(key)
                    values, status = self._answers[key]
                    return (None if values is None else values.copy()), status
                running = self._running.get(key)
                if running is None:
                    running = self._running[key] = threading.Event()
                    break
            with turn_given_up():  # the thread solving it may need this thread's turn
                running.wait()
        try:
            solve = _solve_highs if solver == "highs" else _solve_cbc
            values, status = solve(model, time_limit)
            if status in ("optimal", "infeasible"):
                with self._lock:
                    kept = None if values is None else np.array(values, copy=True)
                    self._answers[key] = (kept, status)
                    while len(self._answers) > self.capacity:
                        self._answers.popitem(last=False)
            return values, status
        finally:
            with self._lock:
                del self._running[key]
            running.set()

    def clear(self) -> None:
        with self._lock:
            self._answers.clear()


#: The answers kept (each at most a few hundred KB: the variables' values).
_SOLVED = _Solved(capacity=256)


def clear_solved() -> None:
    """Forget every answer kept: the next solve of any model runs the solver."""
    _SOLVED.clear()


# ----------------------------------------------------------------------------- turns

_TURN = threading.local()  # .lock: the turn lock this thread holds, if any


def taking_turns(fn: Callable) -> Callable:
    """``fn`` for worker threads that build ILPs in Python and solve them with HiGHS
    (which leaves the GIL while it runs): a call holds *the turn* while it runs Python
    and gives it up only while HiGHS runs, so one thread's Python overlaps another's
    solve instead of two threads slicing the GIL between them (then both often reach
    HiGHS at once and the Python side sits idle). GPT-39B's stage-cost ILPs on 2 cores:
    10.0 s on two threads without turns, 11.0 s on one (``docs/pipeline.md`` has the
    figure with them)."""
    lock = threading.Lock()

    def in_turn(*args, **kwargs):
        with lock:
            _TURN.lock = lock
            try:
                return fn(*args, **kwargs)
            finally:
                _TURN.lock = None

    return in_turn


@contextlib.contextmanager
def turn_given_up():
    """Within the block, this thread's turn (if it holds one) is free for another."""
    lock = getattr(_TURN, "lock", None)
    if lock is None:
        yield
        return
    lock.release()
    try:
        yield
    finally:
        lock.acquire()


# ----------------------------------------------------------------------------- HiGHS

_BANNER_LOCK = threading.Lock()
_banner_shown = False


def _new_highs():
    """A ``highspy.Highs`` with its output off. HiGHS prints a banner when the first one
    of a process is made, before any option can be set; that one line is sent to
    ``/dev/null`` instead of the user's output."""
    global _banner_shown
    import highspy

    with _BANNER_LOCK:
        if _banner_shown:
            h = highspy.Highs()
        else:
            _banner_shown = True
            saved = os.dup(1)
            try:
                with open(os.devnull, "w") as null:
                    os.dup2(null.fileno(), 1)
                    h = highspy.Highs()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
    h.setOptionValue("output_flag", False)
    return h


#: How far from an integer a value of the LP relaxation may be and still count as one
#: (HiGHS's own ``mip_feasibility_tolerance`` is 1e-6).
INTEGRALITY_TOLERANCE = 1e-6


def _solve_highs(model: Milp, time_limit: float):
    """The LP relaxation first: when its optimum is integral it is the MILP's optimum too
    (the relaxation's feasible set holds the MILP's, so nothing integral is cheaper), and
    HiGHS's MIP root (cuts, heuristics) is skipped. The auto-sharding ILPs mostly have
    integral relaxations: 95 of GPT-39B's 100 stage-cost ILPs, whose HiGHS time falls
    from 10.1 s to 5.6 s with the same objectives (``docs/auto_sharding.md``). Otherwise
    the MILP is solved in full, in the time left."""
    start = time.perf_counter()
    has_integers = any(model.integer)
    values, status = _run_highs(model, time_limit, integral=not has_integers)
    if not has_integers or status == "infeasible":
        return values, status
    if status == "optimal":
        integer = np.asarray(model.integer)
        rounded = np.round(values[integer])
        if np.all(np.abs(values[integer] - rounded) <= INTEGRALITY_TOLERANCE):
            values = values.copy()
            values[integer] = rounded
            return values, "optimal"
    first = None if model.incumbent is None or values is None else model.incumbent(values)
    left = max(time_limit - (time.perf_counter() - start), 0.0)
    return _run_highs(model, left, integral=True, incumbent=first)


def _run_highs(model: Milp, time_limit: float, integral: bool, incumbent=None):
    """One HiGHS run of ``model`` (its integrality dropped unless ``integral``), from
    the feasible solution ``incumbent`` when one is given."""
    import highspy

    h = _new_highs()
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("threads", 1)  # the stage-cost ILPs already run several at a time
    if not model.presolve:
        h.setOptionValue("presolve", "off")
    lp = highspy.HighsLp()
    lp.num_col_ = model.num_vars
    lp.num_row_ = len(model.row_lower)
    lp.col_cost_ = np.asarray(model.cost, dtype=np.float64)
    lp.col_lower_ = np.asarray(model.lower, dtype=np.float64)
    lp.col_upper_ = np.asarray(model.upper, dtype=np.float64)
    lp.row_lower_ = np.asarray(model.row_lower, dtype=np.float64)
    lp.row_upper_ = np.asarray(model.row_upper, dtype=np.float64)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.asarray(model.row_start, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(model.row_index, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(model.row_value, dtype=np.float64)
    if integral:
        kinds = highspy.HighsVarType
        lp.integrality_ = [kinds.kInteger if i else kinds.kContinuous for i in model.integer]
    h.passModel(lp)
    if incumbent is not None:
        start = highspy.HighsSolution()
        start.col_value = np.asarray(incumbent, dtype=np.float64).tolist()
        start.value_valid = True
        h.setSolution(start)
    with turn_given_up():
        h.run()
    status = h.getModelStatus()
    feasible = h.getInfo().primal_solution_status == 2  # kSolutionStatusFeasible
    if status == highspy.HighsModelStatus.kOptimal:
        return np.asarray(h.getSolution().col_value), "optimal"
    if status == highspy.HighsModelStatus.kInfeasible:
        return None, "infeasible"
    if feasible and integral:
        return np.asarray(h.getSolution().col_value), "feasible (time limit)"
    return None, f"no solution ({h.modelStatusToString(status)})"


# ----------------------------------------------------------------------------- CBC

#: CBC options: solve the root LP with the dual simplex before branch and bound. CBC's
#: default root solve takes ~10x longer on these problems (whose relaxations are often
#: integral already); the branch and bound that follows is unchanged.
CBC_OPTIONS = ("dualSimplex",)

_CBC_LOCK = threading.Lock()  # warnings.catch_warnings is process-wide; ILPs run on threads


def _cbc(time_limit: float):
    """CBC: a system ``cbc`` when there is one, else the binary bundled with PuLP."""
    import pulp

    coin = pulp.COIN_CMD(msg=False, timeLimit=time_limit, options=list(CBC_OPTIONS))
    if coin.available():
        return coin
    with _CBC_LOCK, warnings.catch_warnings():
        # PuLP 3.3 deprecates its bundled CBC in favour of a separately installed one.
        warnings.filterwarnings("ignore", "PULP_CBC_CMD is deprecated", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, options=list(CBC_OPTIONS))


def _solve_cbc(model: Milp, time_limit: float):
    """Through PuLP. ``prob.sol_status`` is checked, not only ``LpStatus``: a solve
    stopped at its time limit with a feasible plan reports "Optimal" too."""
    import pulp

    prob = pulp.LpProblem("milp", pulp.LpMinimize)
    x = [
        prob.add_variable(f"x{i}", lo, hi, cat="Integer" if integ else "Continuous")
        for i, (lo, hi, integ) in enumerate(
            zip(model.lower, model.upper, model.integer, strict=True)
        )
    ]
    prob += pulp.LpAffineExpression([(x[i], c) for i, c in enumerate(model.cost) if c != 0])
    for r, (lo, hi) in enumerate(zip(model.row_lower, model.row_upper, strict=True)):
        a, b = model.row_start[r], model.row_start[r + 1]
        expr = pulp.LpAffineExpression(
            [(x[i], v) for i, v in zip(model.row_index[a:b], model.row_value[a:b], strict=True)]
        )
        if lo == hi:
            prob += expr == lo, f"r{r}"
        else:
            if lo > -np.inf:
                prob += expr >= lo, f"l{r}"
            if hi < np.inf:
                prob += expr <= hi, f"u{r}"
    solver = _cbc(time_limit)
    with turn_given_up():  # CBC runs in its own process
        prob.solve(solver)
    values = np.array([v.value() or 0.0 for v in x])
    if prob.sol_status == pulp.LpSolutionOptimal:
        return values, "optimal"
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        return values, "feasible (time limit)"
    if prob.status == pulp.LpStatusInfeasible:
        return None, "infeasible"
    return None, f"no solution ({pulp.LpStatus[prob.status]}, status {prob.sol_status})"
