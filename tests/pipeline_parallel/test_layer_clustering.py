"""The layer-clustering DP against exhaustive search on small random graphs. Pure numpy."""

import itertools

import numpy as np
import pytest

from alpa.pipeline_parallel.layers.layer_clustering import cluster_layers, layer_input_bytes


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


def within_band(flops, starts, layer_num, tolerance):
    average = sum(flops) / layer_num
    bounds = [0, *starts, len(flops)]
    return all(
        average * (1 - tolerance) - 1e-9 <= sum(flops[a:b]) <= average * (1 + tolerance) + 1e-9
        for a, b in zip(bounds, bounds[1:], strict=False)
    )


def sum_of_squares(flops, starts):
    bounds = [0, *starts, len(flops)]
    return sum(sum(flops[a:b]) ** 2 for a, b in zip(bounds, bounds[1:], strict=False))


def exhaustive(flops, eqn_inputs, producer, nbytes, layer_num, tolerance):
    """(least crossing bytes, least sum of squared layer FLOPs among those cuts)."""
    n = len(flops)
    best = (np.inf, np.inf)
    for starts in itertools.combinations(range(1, n), layer_num - 1):
        if within_band(flops, starts, layer_num, tolerance):
            key = (
                crossing_bytes(starts, n, eqn_inputs, producer, nbytes),
                sum_of_squares(flops, starts),
            )
            best = min(best, key)
    return best


def test_layer_input_bytes_follows_its_definition():
    """Every entry of the table against the bytes read across ``l`` by ``l..r-1``, value
    by value, on random graphs (reads repeated within an equation included)."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        flops, eqn_inputs, producer, nbytes = random_graph(rng)
        eqn_inputs = [list(r) + list(r[:1]) for r in eqn_inputs]  # a repeated read
        n = len(flops)
        table = layer_input_bytes(eqn_inputs, producer, nbytes)
        assert table.shape == (n + 1, n + 1)
        for left in range(n + 1):
            for right in range(n + 1):
                read = {v for e in range(left, right) for v in eqn_inputs[e]}
                expected = sum(nbytes[v] for v in read if 0 <= producer[v] < left)
                assert table[left, right] == expected, (left, right)


def test_cluster_layers_equals_exhaustive_search():
    rng = np.random.default_rng(0)
    solved = infeasible = broken_ties = 0
    for _ in range(300):
        flops, eqn_inputs, producer, nbytes = random_graph(rng)
        n = len(flops)
        layer_num = int(rng.integers(1, n + 1))
        tolerance = float(rng.choice([0.0, 0.25, 0.5, 1.0]))
        expected, expected_squares = exhaustive(
            flops, eqn_inputs, producer, nbytes, layer_num, tolerance
        )
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
        assert within_band(flops, starts, layer_num, tolerance)
        assert sum_of_squares(flops, starts) == expected_squares
        least_bytes_cuts = [
            s
            for s in itertools.combinations(range(1, n), layer_num - 1)
            if within_band(flops, s, layer_num, tolerance)
            and crossing_bytes(s, n, eqn_inputs, producer, nbytes) == cost
        ]
        broken_ties += len({sum_of_squares(flops, s) for s in least_bytes_cuts}) > 1
        solved += 1
    # Enough instances of each kind, and ties that only the balance breaks.
    assert solved >= 50 and infeasible >= 5 and broken_ties >= 10, (
        solved,
        infeasible,
        broken_ties,
    )


def test_cluster_layers_cuts_equal_blocks_into_equal_layers():
    # Six identical blocks of two equations (a heavy one, then a light one that writes the
    # 8-byte value the next block reads). Every block boundary costs the same 8 bytes; the
    # cut into 3 layers is the even one (2 blocks each), not any other within the band.
    flops = [10, 1] * 6
    producer = list(range(12))
    nbytes = [100, 8] * 6  # the heavy equation's output is read only inside its block
    eqn_inputs = [[e - 1] if e else [] for e in range(12)]
    table = layer_input_bytes(eqn_inputs, producer, nbytes)
    assert cluster_layers(flops, table, 3, tolerance=0.6) == ((4, 8), 16.0)


def test_cluster_layers_keeps_cheap_layers_out():
    # A chain of six one-FLOP equations (10-byte outputs), then two free equations that
    # read only step inputs. Without a lower bound, the free pair would be a layer of its
    # own that reads nothing; within 50% of the average (1.5 FLOPs) every layer holds 1 or
    # 2 FLOPs, so the chain is cut 3 times (30 bytes).
    flops = [1] * 6 + [0, 0]
    producer = list(range(8))
    nbytes = [10] * 8
    eqn_inputs = [[e - 1] if e else [] for e in range(6)] + [[], []]
    table = layer_input_bytes(eqn_inputs, producer, nbytes)
    starts, cost = cluster_layers(flops, table, 4, tolerance=0.5)
    bounds = [0, *starts, 8]
    assert all(1 <= sum(flops[a:b]) <= 2 for a, b in zip(bounds, bounds[1:], strict=False))
    assert cost == 30.0
    # With tolerance 1 (no lower bound, up to 3 FLOPs): [0, 3) [3, 6) [6, 7) [7, 8).
    assert cluster_layers(flops, table, 4, tolerance=1.0) == ((3, 6, 7), 10.0)


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
    with pytest.raises(ValueError, match=r"flops must be >= 0, got -1 \(equation 1\)"):
        cluster_layers([1, -1, 1], table, 2)
    with pytest.raises(ValueError, match=r"no cut of the 3 forward equations into layer_num=2"):
        cluster_layers([6, 0, 4], np.zeros((4, 4)), 2, tolerance=0.0)  # a 6 > 5 either way
