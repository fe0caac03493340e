"""The MILP holder and its HiGHS solve: the LP relaxation first, the MILP only when the
relaxation's optimum is fractional. Oracles: exhaustive enumeration, hand-solved cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from alpa.shard_parallel.ilp import milp


@pytest.fixture(autouse=True)
def no_answers_kept():
    """Each test's models are solved by the solver, not answered from another test's."""
    milp.clear_solved()
    yield
    milp.clear_solved()


def _count_runs(monkeypatch, starts: list | None = None) -> list[bool]:
    """Record the ``integral`` flag of every HiGHS run (and in ``starts``, the incumbent
    each run was given)."""
    runs: list[bool] = []
    original = milp._run_highs

    def counted(model, time_limit, integral, incumbent=None):
        runs.append(integral)
        if starts is not None:
            starts.append(incumbent)
        return original(model, time_limit, integral, incumbent)

    monkeypatch.setattr(milp, "_run_highs", counted)
    return runs


def _one_hot_model(node_costs, edge_costs, edges):
    """The auto-sharding ILP's shape: one-hot ``s_v`` per node, one-hot ``e_uv`` per edge
    tied to both ends (``sum_b e[a, b] = s_u[a]``, ``sum_a e[a, b] = s_v[b]``)."""
    model = milp.Milp()
    s = [model.add_binaries(c) for c in node_costs]
    for x in s:
        model.add_row(x, [1.0] * len(x), 1.0, 1.0)
    for (u, v), cost in zip(edges, edge_costs, strict=True):
        e = [[model.add_var(cost[a, b], 0.0, 1.0, True) for b in range(len(s[v]))]
             for a in range(len(s[u]))]  # fmt: skip
        for a in range(len(s[u])):
            model.add_row(e[a] + [s[u][a]], [1.0] * len(e[a]) + [-1.0], 0.0, 0.0)
        for b in range(len(s[v])):
            col = [e[a][b] for a in range(len(s[u]))]
            model.add_row(col + [s[v][b]], [1.0] * len(col) + [-1.0], 0.0, 0.0)
    return model, s


def _brute_force(node_costs, edge_costs, edges) -> float:
    best = np.inf
    for choice in itertools.product(*(range(len(c)) for c in node_costs)):
        total = sum(c[k] for c, k in zip(node_costs, choice, strict=True))
        total += sum(edge_costs[k][choice[u], choice[v]] for k, (u, v) in enumerate(edges))
        best = min(best, total)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_one_hot_models_reach_the_exhaustive_optimum(seed):
    rng = np.random.default_rng(seed)
    num_nodes = int(rng.integers(3, 6))
    node_costs = [rng.uniform(0, 10, int(rng.integers(2, 4))) for _ in range(num_nodes)]
    edges = [
        (u, v) for u in range(num_nodes) for v in range(u + 1, num_nodes) if rng.random() < 0.6
    ]
    edge_costs = [rng.uniform(0, 10, (len(node_costs[u]), len(node_costs[v]))) for u, v in edges]
    model, s = _one_hot_model(node_costs, edge_costs, edges)
    values, status = model.solve("highs", 60.0)
    assert status == "optimal"
    assert np.all(values == np.round(values))  # integral, whichever run produced them
    objective = float(np.dot(model.cost, values))
    assert objective == pytest.approx(_brute_force(node_costs, edge_costs, edges), rel=1e-9)
    for x in s:
        assert sum(values[i] for i in x) == 1


def test_an_integral_relaxation_needs_one_run(monkeypatch):
    runs = _count_runs(monkeypatch)
    # Two nodes that prefer different strategies, and an edge that makes them agree: the
    # relaxation's optimum is a vertex of the one-hot polytope (integral).
    model, s = _one_hot_model(
        [[1.0, 4.0], [3.0, 1.0]], [np.array([[0.0, 5.0], [5.0, 0.0]])], [(0, 1)]
    )
    values, status = model.solve("highs", 60.0)
    assert status == "optimal"
    assert runs == [False]
    assert [values[i] for i in s[0]] == [1.0, 0.0]
    assert [values[i] for i in s[1]] == [1.0, 0.0]  # 1 + 3 beats 4 + 1 and 1 + 1 + 5


def test_a_fractional_relaxation_is_solved_as_a_milp(monkeypatch):
    runs = _count_runs(monkeypatch)
    # A knapsack: three items of value 10 and weight 6, capacity 10. The relaxation takes
    # 10/6 of an item (value 16.67); one whole item (value 10) is the integral optimum.
    model = milp.Milp()
    x = model.add_binaries([-10.0, -10.0, -10.0])
    model.add_row(x, [6.0, 6.0, 6.0], -np.inf, 10.0)
    values, status = model.solve("highs", 60.0)
    assert status == "optimal"
    assert runs == [False, True]
    assert sorted(values[i] for i in x) == [0.0, 0.0, 1.0]


@pytest.mark.parametrize("start", [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]], ids=["feasible", "not"])
def test_a_fractional_relaxation_starts_from_the_incumbent(monkeypatch, start):
    """``Milp.incumbent`` builds a start from the relaxation's values; HiGHS gets it for
    the MILP run, and the optimum is the same whether it is feasible (one item) or not
    (all three, over capacity: HiGHS drops it)."""
    starts: list = []
    runs = _count_runs(monkeypatch, starts)
    relaxed_seen = []
    model = milp.Milp()
    x = model.add_binaries([-10.0, -10.0, -10.0])
    model.add_row(x, [6.0, 6.0, 6.0], -np.inf, 10.0)

    def incumbent(relaxed):
        relaxed_seen.append(np.asarray(relaxed))
        return np.asarray(start)

    model.incumbent = incumbent
    values, status = model.solve("highs", 60.0)
    assert status == "optimal" and runs == [False, True]
    assert starts[0] is None and list(starts[1]) == start
    assert sum(relaxed_seen[0]) == pytest.approx(10 / 6)  # the relaxation's values
    assert sorted(values[i] for i in x) == [0.0, 0.0, 1.0]


def test_integer_infeasible_with_a_feasible_relaxation(monkeypatch):
    runs = _count_runs(monkeypatch)
    model = milp.Milp()
    x = model.add_binaries([1.0, 1.0])
    model.add_row(x, [2.0, 2.0], 1.0, 1.0)  # x0 + x1 = 1/2
    values, status = model.solve("highs", 60.0)
    assert (values, status) == (None, "infeasible")
    assert runs == [False, True]


def test_infeasible_relaxation_stops_at_once(monkeypatch):
    runs = _count_runs(monkeypatch)
    model = milp.Milp()
    x = model.add_binaries([1.0])
    model.add_row(x, [1.0], 2.0, 3.0)
    assert model.solve("highs", 60.0) == (None, "infeasible")
    assert runs == [False]


def test_a_continuous_model_runs_once(monkeypatch):
    runs = _count_runs(monkeypatch)
    model = milp.Milp()
    x = model.add_var(1.0, 0.0, 10.0)
    model.add_row([x], [1.0], 2.5, np.inf)
    values, status = model.solve("highs", 60.0)
    assert status == "optimal" and values[x] == pytest.approx(2.5)
    assert runs == [True]  # no integrality to drop


def test_the_auto_sharding_ilp_starts_from_a_local_optimum(monkeypatch):
    """``ilp_solver._solve_ilp`` on three groups of two strategies whose every pair is
    cheaper apart (a frustrated triangle): the relaxation is fractional (every strategy
    at 1/2, objective 0.2), so HiGHS runs the MILP from the incumbent ``_incumbent`` builds
    from it. That start satisfies every row, no group can lower the objective alone, and
    the MILP's answer is the exhaustive optimum (1.1)."""
    from types import SimpleNamespace

    from alpa.shard_parallel.ilp import ilp_solver

    unary = {0: np.array([0.0, 0.1]), 1: np.array([0.0, 0.1]), 2: np.array([0.0, 0.2])}
    apart = np.array([[1.0, 0.0], [0.0, 1.0]])
    adj = {g: {h: apart for h in unary if h != g} for g in unary}
    groups = SimpleNamespace(unary=unary, tie={g: np.zeros(2) for g in unary}, adj=adj)
    seen: list = []
    original = milp._run_highs

    def recorded(model, time_limit, integral, incumbent=None):
        values, status = original(model, time_limit, integral, incumbent)
        seen.append((model, integral, incumbent, values))
        return values, status

    monkeypatch.setattr(milp, "_run_highs", recorded)
    picks, status, _ = ilp_solver._solve_ilp(None, groups, [0, 1, 2], None, 60.0)
    assert status == "optimal" and [integral for _, integral, _, _ in seen] == [False, True]
    model, _, start, _ = seen[1]
    relaxed = seen[0][3]
    assert float(np.dot(model.cost, relaxed)) == pytest.approx(0.2)
    assert np.allclose(relaxed[:6], 0.5)

    rows = np.zeros(len(model.row_lower))
    for r in range(len(rows)):
        lo, hi = model.row_start[r], model.row_start[r + 1]
        rows[r] = np.dot(model.row_value[lo:hi], start[model.row_index[lo:hi]])
    assert np.all(rows >= np.asarray(model.row_lower) - 1e-9)
    assert np.all(rows <= np.asarray(model.row_upper) + 1e-9)

    def total(choice) -> float:
        cost = sum(unary[g][choice[g]] for g in unary)
        return cost + sum(apart[choice[g], choice[h]] for g in unary for h in unary if g < h)

    start_choice = [int(np.argmax(start[[2 * g, 2 * g + 1]])) for g in unary]
    for g in unary:  # a local optimum: no group alone improves it
        for k in range(2):
            moved = list(start_choice)
            moved[g] = k
            assert total(moved) >= total(start_choice) - 1e-12
    best = min(total(c) for c in itertools.product(range(2), repeat=3))
    assert best == pytest.approx(1.1)
    assert total([picks[g] for g in unary]) == pytest.approx(best)


def test_a_turn_is_given_up_only_while_the_solver_runs():
    """``taking_turns``: a second thread waits for the turn while the first runs Python,
    gets it while the first is inside ``turn_given_up`` (around HiGHS's run), and the
    first takes it back afterwards."""
    import threading

    turns = milp.taking_turns(lambda f: f())
    order: list[str] = []
    second = threading.Thread(target=lambda: turns(lambda: order.append("second")))

    def first():
        second.start()
        second.join(0.2)
        assert second.is_alive() and order == []  # the turn is held
        with milp.turn_given_up():
            second.join(10.0)
            assert not second.is_alive() and order == ["second"]
        order.append("first")

    turns(first)
    assert order == ["second", "first"]
    with milp.turn_given_up():  # outside a turn: nothing to give up
        order.append("outside")
    assert order[-1] == "outside"


def _knapsack(capacity: float = 10.0) -> milp.Milp:
    model = milp.Milp()
    x = model.add_binaries([-10.0, -9.0, -3.0])  # one optimum per capacity
    model.add_row(x, [6.0, 6.0, 4.0], -np.inf, capacity)
    return model


def test_an_equal_model_is_answered_without_solving_again(monkeypatch):
    runs = _count_runs(monkeypatch)
    first, status = _knapsack().solve("highs", 60.0)
    assert status == "optimal" and list(first) == [1.0, 0.0, 1.0]
    solved = len(runs)
    first[:] = -1.0  # a caller changing its values changes no other caller's
    again, status = _knapsack().solve("highs", 60.0)
    assert len(runs) == solved and status == "optimal" and list(again) == [1.0, 0.0, 1.0]
    # Another row bound is another model; so is the same model for another solver.
    other, _ = _knapsack(capacity=12.0).solve("highs", 60.0)
    assert len(runs) > solved and list(other) == [1.0, 1.0, 0.0]
    count = len(runs)
    unpresolved = _knapsack()
    unpresolved.presolve = False
    unpresolved.solve("highs", 60.0)
    assert len(runs) > count


def test_an_answer_stopped_by_its_time_limit_is_not_kept(monkeypatch):
    calls = []

    def stopped(model, time_limit):
        calls.append(time_limit)
        return np.zeros(model.num_vars), "feasible (time limit)"

    monkeypatch.setattr(milp, "_solve_highs", stopped)
    for _ in range(2):
        assert _knapsack().solve("highs", 1.0)[1] == "feasible (time limit)"
    assert calls == [1.0, 1.0]


def test_an_equal_model_on_another_thread_waits_for_the_first_answer(monkeypatch):
    import threading

    started, release, calls = threading.Event(), threading.Event(), []
    original = milp._solve_highs

    def slow(model, time_limit):
        calls.append(1)
        started.set()
        release.wait(10)
        return original(model, time_limit)

    monkeypatch.setattr(milp, "_solve_highs", slow)
    answers = []
    first = threading.Thread(target=lambda: answers.append(_knapsack().solve("highs", 60.0)))
    first.start()
    started.wait(10)
    second = threading.Thread(target=lambda: answers.append(_knapsack().solve("highs", 60.0)))
    second.start()
    release.set()
    first.join(10)
    second.join(10)
    assert calls == [1] and len(answers) == 2
    assert all(status == "optimal" and list(v) == [1.0, 0.0, 1.0] for v, status in answers)
