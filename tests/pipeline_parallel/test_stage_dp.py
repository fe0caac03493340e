"""The stage DP (``training_dp``) against exhaustive search, and ``get_submesh_choices``.
Pure numpy: no devices."""

import itertools

import numpy as np
import pytest

from alpa.pipeline_parallel.stages.stage_construction import get_submesh_choices, training_dp

CLUSTERS = [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4)]


def _in_flight_ok(plan, max_succ, num_micro_batches, schedule):
    """Whether each stage of ``plan`` holds the micro-batches ``schedule`` keeps on it:
    1F1B the stages after it plus one, GPipe all, ZB-H1 min(S, B) on every stage."""
    n = len(plan)
    for t, (s, e, m, c) in enumerate(plan):
        need = {"1f1b": n - 1 - t, "gpipe": num_micro_batches - 1}.get(
            schedule, min(n, num_micro_batches) - 1
        )
        if need > max_succ[s, e - 1, m, c]:
            return False
    return True


def _latency(times, num_micro_batches, schedule):
    """The schedule's closed form for equal stages as a cost of any stages (stage_dp)."""
    if schedule == "zb-h1":
        return sum(times) / 3 + (num_micro_batches - 1 / 3) * max(times)
    return sum(times) + (num_micro_batches - 1) * max(times)


def exhaustive(num_layers, num_devices, num_micro_batches, sizes, cost, max_succ, schedule="1f1b"):
    """The least pipeline latency over every plan (inf if none), by depth-first search over
    contiguous splits, submeshes and configurations."""
    best = np.inf
    num_choices, num_configs = cost.shape[2], cost.shape[3]

    def stages(start, devices_left):
        if start == num_layers:
            if devices_left == 0:
                yield []
            return
        for end in range(start + 1, num_layers + 1):
            for m, c in itertools.product(range(num_choices), range(num_configs)):
                if sizes[m] <= devices_left and np.isfinite(cost[start, end - 1, m, c]):
                    for rest in stages(end, devices_left - sizes[m]):
                        yield [(start, end, m, c)] + rest

    for plan in stages(0, num_devices):
        if not _in_flight_ok(plan, max_succ, num_micro_batches, schedule):
            continue
        times = [cost[s, e - 1, m, c] for s, e, m, c in plan]
        best = min(best, _latency(times, num_micro_batches, schedule))
    return best


def plan_cost(
    solution, num_layers, num_devices, num_micro_batches, sizes, cost, max_succ, schedule="1f1b"
):
    """The cost of a returned plan, recomputed, after checking that it is a valid plan."""
    assert solution[0][0][0] == 0 and solution[-1][0][1] == num_layers
    for (layers, _, _), (next_layers, _, _) in zip(solution, solution[1:], strict=False):
        assert layers[0] < layers[1] == next_layers[0]
    assert sum(sizes[m] for _, m, _ in solution) == num_devices
    plan = [(s, e, m, c) for (s, e), m, c in solution]
    assert _in_flight_ok(plan, max_succ, num_micro_batches, schedule)
    times = [cost[s, e - 1, m, c] for s, e, m, c in plan]
    return _latency(times, num_micro_batches, schedule)


def random_instance(rng, index):
    hosts, per_host = CLUSTERS[index % len(CLUSTERS)]
    choices = get_submesh_choices(hosts, per_host, "all")
    num_layers = int(rng.integers(1, 7))
    num_configs = int(rng.integers(1, 3))
    shape = (num_layers, num_layers, len(choices), num_configs)
    # Costs on a coarse grid, so that ties between plans are common.
    cost = rng.integers(1, 6, size=shape).astype(float)
    cost[rng.random(shape) < rng.choice([0.0, 0.3, 0.9])] = np.inf
    max_succ = rng.integers(0, num_layers + 1, size=shape)
    return hosts * per_host, int(rng.integers(1, 5)), choices, num_configs, cost, max_succ


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_training_dp_equals_exhaustive_search(schedule):
    """Under each schedule's objective and in-flight memory (stage_dp's docstring)."""
    rng = np.random.default_rng(0)
    solved = unsolvable = with_inf = 0
    for index in range(120):
        num_devices, micro, choices, configs, cost, max_succ = random_instance(rng, index)
        num_layers = cost.shape[0]
        sizes = [a * b for a, b in choices]
        args = (num_layers, num_devices, micro)
        expected = exhaustive(*args, sizes, cost, max_succ, schedule)
        with_inf += bool(np.isinf(cost).any())
        if np.isinf(expected):
            with pytest.raises(ValueError, match=r"no pipeline plan of \d+ layers uses exactly"):
                training_dp(*args, choices, configs, cost, max_succ, schedule=schedule)
            unsolvable += 1
            continue
        got, solution = training_dp(*args, choices, configs, cost, max_succ, schedule=schedule)
        assert got == pytest.approx(expected, abs=1e-6), (index, got, expected)
        recomputed = plan_cost(solution, *args, sizes, cost, max_succ, schedule)
        assert recomputed == pytest.approx(got, abs=1e-6)
        solved += 1
    # The instances cover solvable and unsolvable cases, and infeasible (inf) stages.
    assert solved >= 50 and unsolvable >= 5 and with_inf >= 50, (solved, unsolvable, with_inf)


def test_training_dp_known_answers():
    # Two identical layers, 2 devices, submeshes (1,1) and (1,2): a stage of one layer on
    # one device takes 2, both layers on both devices take 3. With 8 micro-batches the
    # two-stage pipeline (2 + 2 + 7 * 2 = 18) beats one stage (3 + 7 * 3 = 24).
    choices = ((1, 1), (1, 2))
    cost = np.full((2, 2, 2, 1), np.inf)
    cost[0, 0, 0, 0] = cost[1, 1, 0, 0] = 2.0
    cost[0, 1, 1, 0] = 3.0
    max_succ = np.full(cost.shape, 8)
    total, plan = training_dp(2, 2, 8, choices, 1, cost, max_succ)
    assert (total, plan) == (18.0, [((0, 1), 0, 0), ((1, 2), 0, 0)])
    # One micro-batch: no pipelining to gain; one stage on both devices (3 < 4).
    assert training_dp(2, 2, 1, choices, 1, cost, max_succ) == (3.0, [((0, 2), 1, 0)])
    # The first stage may have no stage after it (memory): only the single stage remains.
    max_succ[0, 0, 0, 0] = 0
    assert training_dp(2, 2, 8, choices, 1, cost, max_succ) == (24.0, [((0, 2), 1, 0)])


def test_training_dp_bad_input():
    with pytest.raises(ValueError, match=r"compute_cost has shape \(2, 2, 1, 1\); expected"):
        training_dp(2, 1, 1, ((1, 1),), 2, np.ones((2, 2, 1, 1)), np.ones((2, 2, 1, 2)))
    with pytest.raises(ValueError, match=r"schedule must be one of .* got 'dualpipev'"):
        training_dp(
            2, 1, 1, ((1, 1),), 1, np.ones((2, 2, 1, 1)), np.ones((2, 2, 1, 1)), "dualpipev"
        )


def test_get_submesh_choices():
    assert get_submesh_choices(1, 8) == ((1, 1), (1, 2), (1, 4), (1, 8))
    assert get_submesh_choices(8, 8, "power_of_two")[-3:] == ((2, 8), (4, 8), (8, 8))
    assert get_submesh_choices(8, 8, "small_power_of_two")[-2:] == ((2, 8), (4, 8))
    assert get_submesh_choices(3, 2, "all") == ((1, 1), (1, 2), (2, 2), (3, 2))
    assert get_submesh_choices(2, 4, "manual", [(1, 2), (2, 4)]) == ((1, 2), (2, 4))
    with pytest.raises(ValueError, match="unknown submesh space 'squares'"):
        get_submesh_choices(2, 4, "squares")
    with pytest.raises(ValueError, match=r"\(1, 3\) does not tile a host of 4 devices"):
        get_submesh_choices(2, 4, "manual", [(1, 3)])
    with pytest.raises(ValueError, match=r"\(3, 4\) does not fit a cluster of 2 hosts"):
        get_submesh_choices(2, 4, "manual", [(3, 4)])
    with pytest.raises(ValueError, match=r"\(2, 2\) spans hosts, so it must take whole hosts"):
        get_submesh_choices(2, 4, "manual", [(2, 2)])
    with pytest.raises(ValueError, match="needs manually_specified_submeshes"):
        get_submesh_choices(2, 4, "manual")
    with pytest.raises(ValueError, match="num_hosts must be a positive int, got 0"):
        get_submesh_choices(0, 4)
