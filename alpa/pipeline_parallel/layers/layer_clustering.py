r"""Layer clustering: cut a step's forward equations into ``layer_num`` contiguous layers.

This is the pure core of ``AutoLayerOption`` (paper §5.2, "operator clustering"): the
forward pass, a sequence of ``N`` equations with FLOPs :math:`w_e`, is cut into ``K``
contiguous layers so that

* every layer's FLOPs :math:`w(l, r)` are within :math:`\epsilon` of the average
  :math:`\bar w = \sum_e w_e / K`, on both sides:
  :math:`(1 - \epsilon)\,\bar w \le w(l, r) \le (1 + \epsilon)\,\bar w` (the balance the
  stage DP needs: a layer is its unit of work; without the lower bound, layers of a few
  cheap equations that read little would be "free" cuts, and the remaining layers would
  carry up to :math:`(1 + \epsilon)\,\bar w` each);
* the bytes that cross layer boundaries are least. A layer ``[l, r)`` reads
  :math:`\mathrm{in}(l, r)` bytes from earlier layers: the values its equations read that
  equations before ``l`` produced, each value counted once per layer that reads it (the
  bytes a pipeline would send to that layer's stage). Step inputs (parameters, the batch)
  are not counted: every layer reads them from where they live;
* among cuts with the least crossing bytes, :math:`\sum w(l, r)^2` is least: the most
  even one (a stack of identical blocks, where every block boundary costs the same bytes,
  is cut into equal layers).

With :math:`G(q, r)` the pair (crossing bytes, :math:`\sum w^2`) of the best cut of
equations ``[0, r)`` into ``q`` layers, compared lexicographically (both parts add, so the
order is kept under the DP's sums),

.. math::  G(q, r) = \min_{l < r:\ w(l, r) \in [(1 - \epsilon) \bar w, (1 + \epsilon) \bar w]}
           G(q - 1, l) + \big(\mathrm{in}(l, r),\ w(l, r)^2\big), \qquad G(0, 0) = (0, 0),

and the answer is :math:`G(K, N)`. ``in(l, r)`` for all pairs is filled in :math:`O(N^2)`
numpy work (:func:`layer_input_bytes`: one mark per read, then two running sums); the DP
takes :math:`O(K N W)` for the :math:`W` lefts in the band of each ``r`` (a contiguous
run, since FLOPs are non-negative), vectorised over ``l`` and ``q``. Byte counts are
integers, so ties between them are exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def layer_input_bytes(
    eqn_inputs: Sequence[Sequence[int]], producer: Sequence[int], nbytes: Sequence[int]
) -> np.ndarray:
    """``in[l, r]``: bytes that equations ``l..r-1`` read from equations before ``l``.

    Args:
      eqn_inputs: per equation, the ids of the values it reads (any order, repeats fine).
      producer: per value id, the equation that produces it, or ``-1`` for a step input.
      nbytes: per value id, its size in bytes.
    """
    n = len(eqn_inputs)
    readers: dict[int, list[int]] = {}
    for e, values in enumerate(eqn_inputs):
        for value in values:
            if producer[value] >= 0:
                readers.setdefault(value, []).append(e)
    # Value v (made by p, read by r_1 < ... < r_k) is counted in in[l, r] when its first
    # reader at or after l is some r_i < r, that is for l in (r_{i-1}, r_i] (r_0 = p) and
    # r > r_i. Mark +bytes at (r_{i-1} + 1, r_i + 1) and -bytes at (r_i + 1, r_i + 1),
    # then sum down the rows and along the columns.
    rows, cols, amounts = [], [], []
    for value, reads in readers.items():
        previous = producer[value]
        for r in sorted(set(reads)):
            rows += [previous + 1, r + 1]
            cols += [r + 1, r + 1]
            amounts += [nbytes[value], -nbytes[value]]
            previous = r
    cost = np.zeros((n + 2, n + 1))
    np.add.at(cost, (np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)), amounts)
    np.cumsum(cost, axis=0, out=cost)
    np.cumsum(cost, axis=1, out=cost)
    return cost[: n + 1]


def cluster_layers(
    flops: Sequence[float], input_bytes: np.ndarray, layer_num: int, tolerance: float = 0.5
) -> tuple[tuple[int, ...], float]:
    """Cut ``len(flops)`` equations into ``layer_num`` layers (module docstring).

    Returns ``(starts, crossing_bytes)``: the first equation of every layer after the first
    (``layer_num - 1`` increasing positions) and the least crossing bytes; among cuts with
    those bytes, the one whose layers' FLOPs have the least sum of squares. Raises
    ``ValueError`` for a ``layer_num`` outside ``1..len(flops)`` or when no cut keeps every
    layer within the tolerance.
    """
    n = len(flops)
    if isinstance(layer_num, bool) or not isinstance(layer_num, int | np.integer):
        raise TypeError(f"layer_num must be an int, got {type(layer_num).__name__}")
    if not 1 <= layer_num <= n:
        raise ValueError(
            f"layer_num={layer_num} must be between 1 and the {n} equations of the forward "
            "pass (each layer needs at least one)"
        )
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if min(flops) < 0:
        raise ValueError(f"flops must be >= 0, got {min(flops)} (equation {int(np.argmin(flops))})")
    input_bytes = np.asarray(input_bytes, dtype=np.float64)
    if input_bytes.shape != (n + 1, n + 1):
        raise ValueError(f"input_bytes has shape {input_bytes.shape}; expected {(n + 1, n + 1)}")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(flops, dtype=np.float64))])
    average = prefix[-1] / layer_num
    cap = average * (1 + tolerance) * (1 + 1e-12) + 1e-12
    floor = average * (1 - tolerance) * (1 - 1e-12) - 1e-12
    inf = np.inf
    g = np.full((layer_num + 1, n + 1), inf)  # crossing bytes
    squares = np.full((layer_num + 1, n + 1), inf)  # sum of squared layer FLOPs
    back = np.full((layer_num + 1, n + 1), -1, dtype=np.int64)
    g[0, 0] = squares[0, 0] = 0.0
    # FLOPs are >= 0, so the lefts whose layer [left, right) is within the band form one
    # run; every q is updated at once from the finished columns left < right.
    first_left = np.searchsorted(prefix, prefix - cap, side="left")
    last_left = np.searchsorted(prefix, prefix - floor, side="right") - 1
    for right in range(1, n + 1):
        lo, hi = int(first_left[right]), min(int(last_left[right]), right - 1)
        if lo > hi:
            continue
        lefts = np.arange(lo, hi + 1)
        work = prefix[right] - prefix[lefts]
        candidates = g[:-1, lefts] + input_bytes[lefts, right]  # row q - 1: layers 1..q
        least = candidates.min(axis=1)
        balance = np.where(
            candidates == least[:, None], squares[:-1, lefts] + work**2, inf
        )  # ties on bytes only; rows with no finite candidate stay inf
        best = np.argmin(balance, axis=1)
        found = np.isfinite(least)
        g[1:, right] = least
        squares[1:, right] = np.where(found, balance.min(axis=1), inf)
        back[1:, right] = np.where(found, lefts[best], -1)
    if not np.isfinite(g[layer_num, n]):
        raise ValueError(
            f"no cut of the {n} forward equations into layer_num={layer_num} layers keeps "
            f"every layer within tolerance={tolerance} of the average FLOPs "
            f"({average:.4g}); raise the tolerance or lower layer_num"
        )
    starts, right = [], n
    for q in range(layer_num, 0, -1):
        right = int(back[q, right])
        starts.append(right)
    assert starts[-1] == 0
    return tuple(reversed(starts[:-1])), float(g[layer_num, n])
