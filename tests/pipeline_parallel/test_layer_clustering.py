"""The layer-clustering DP against exhaustive search on small random graphs. Pure numpy."""

import itertools

import numpy as np
import pytest

from alpa.pipeline_parallel.layer_clustering import cluster_layers, layer_input_bytes


def random_graph(rng):
    """``N`` equations in order, each producing one value and reading up to 3 earlier
    values or step inputs. Value ids: step inputs first, then equation ``e``'s output."""
    n = int(rng.integers(1, 10))
    num_inputs = 2
    producer = [-1] * num_inputs + list(range(n))
    nbytes = list(rng.integers(1, 50, size=num_inputs + n))
    eqn_inputs = []
    for e in range(n):
        available = num_inputs + e
        k = int(rng.integers(0, min(3, available) + 1))
        eqn_inputs.append(list(rng.choice(available, size=k, replace=False)))
    flops = list(rng.integers(0, 10, size=n))
    return flops, eqn_inputs, producer, nbytes


def crossing_bytes(starts, n, eqn_inputs, producer, nbytes):
    """Bytes read by each layer from values earlier layers produced, each once per layer:
    straight from the definition, not from layer_input_bytes."""
    bounds = [0, *starts, n]
    total = 0
    for left, right in zip(bounds, bounds[1:], strict=False):
        read = {v for e in range(left, right) for v in eqn_inputs[e]}
        total += sum(nbytes[v] for v in read if 0 <= producer[v] < left)
    return total


def exhaustive(flops, eqn_inputs, producer, nbytes, layer_num, tolerance):
    n = len(flops)
    cap = sum(flops) / layer_num * (1 + tolerance)
    best = np.inf
    for starts in itertools.combinations(range(1, n), layer_num - 1):
        bounds = [0, *starts, n]
        if all(sum(flops[a:b]) <= cap + 1e-9 for a, b in zip(bounds, bounds[1:], strict=False)):
            best = min(best, crossing_bytes(starts, n, eqn_inputs, producer, nbytes))
    return best


def test_cluster_layers_equals_exhaustive_search():
    rng = np.random.default_rng(0)
    solved = infeasible = 0
    for _ in range(200):
        flops, eqn_inputs, producer, nbytes = random_graph(rng)
        n = len(flops)
        layer_num = int(rng.integers(1, n + 1))
        tolerance = float(rng.choice([0.0, 0.25, 0.5, 1.0]))
        expected = exhaustive(flops, eqn_inputs, producer, nbytes, layer_num, tolerance)
        table = layer_input_bytes(eqn_inputs, producer, nbytes)
        if np.isinf(expected):
            with pytest.raises(ValueError, match=r"keeps every layer within tolerance="):
                cluster_layers(flops, table, layer_num, tolerance)
            infeasible += 1
            continue
        starts, cost = cluster_layers(flops, table, layer_num, tolerance)
        assert cost == expected
        assert len(starts) == layer_num - 1 and list(starts) == sorted(set(starts))
        assert crossing_bytes(starts, n, eqn_inputs, producer, nbytes) == cost
        cap = sum(flops) / layer_num * (1 + tolerance)
        bounds = [0, *starts, n]
        assert all(sum(flops[a:b]) <= cap + 1e-9 for a, b in zip(bounds, bounds[1:], strict=False))
        solved += 1
    assert solved >= 50 and infeasible >= 5, (solved, infeasible)


def test_cluster_layers_cuts_where_little_crosses():
    # a -> b -> c -> d, one FLOP each; b's output is 100 bytes, c's 1 byte, a's 10 bytes.
    # Two layers within 100% of the average (2 FLOPs): cut after a, b or c; after c is
    # cheapest (only c's 1-byte output crosses).
    producer = [0, 1, 2, 3]
    nbytes = [10, 100, 1, 1]
    eqn_inputs = [[], [0], [1], [2]]
    table = layer_input_bytes(eqn_inputs, producer, nbytes)
    assert cluster_layers([1, 1, 1, 1], table, 2, tolerance=1.0) == ((3,), 1.0)
    # Balanced exactly (tolerance 0): the cut must be after b, whatever it costs.
    assert cluster_layers([1, 1, 1, 1], table, 2, tolerance=0.0) == ((2,), 100.0)


def test_cluster_layers_bad_input():
    table = np.zeros((4, 4))
    with pytest.raises(ValueError, match=r"layer_num=0 must be between 1 and the 3 equations"):
        cluster_layers([1, 1, 1], table, 0)
    with pytest.raises(ValueError, match=r"layer_num=4 must be between 1 and the 3 equations"):
        cluster_layers([1, 1, 1], table, 4)
    with pytest.raises(ValueError, match="tolerance must be >= 0, got -0.5"):
        cluster_layers([1, 1, 1], table, 2, tolerance=-0.5)
    with pytest.raises(ValueError, match=r"no cut of the 3 forward equations into layer_num=2"):
        cluster_layers([6, 0, 4], np.zeros((4, 4)), 2, tolerance=0.0)  # a 6 > 5 either way
