"""Alpa's ``stage_imbalance_tolerance``: which candidate stages are balanced enough.

A stage of layers ``i..j`` on ``n`` of the cluster's ``N`` devices is a candidate for the
stage DP only if its share of the devices, ``n / N``, is within a factor ``1 + t`` of its
share of the step's FLOPs (forward and backward of its layers), as Alpa bounds the
candidates it profiles. :func:`imbalance_mask` is that bound as a table the DP's costs
are masked with (``stage_search.plan_auto_stages``); :func:`tolerance_error` says,
when the bound leaves no plan, which tolerance the unbounded plan would need.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def imbalance_mask(
    layer_flops: Sequence[float],
    submesh_sizes: Sequence[int],
    num_devices: int,
    tolerance: float,
) -> np.ndarray:
    r"""``allowed[i, j, m]``: whether a stage of layers ``i..j`` (inclusive) on submesh
    choice ``m`` is a candidate under ``stage_imbalance_tolerance=tolerance`` (Alpa's
    bound, applied where its candidate stages are generated).

    With ``d = n_m / N`` the stage's share of the ``N = num_devices`` devices and
    ``f = sum(F[i..j]) / sum(F)`` its share of the FLOPs ``F = layer_flops``, the stage
    is dropped when

    .. math::  d > f (1 + t) \quad \mathrm{or} \quad d < f / (1 + t).

    ``t = inf`` drops nothing (no ``0 * inf``). A stage of zero-FLOP layers has ``f = 0``,
    so under a finite ``t`` it is no candidate on its own, only joined to layers with work;
    when every layer has zero FLOPs the layers count as equal shares instead. Entries with
    ``j < i`` (no stage) are ``False``.
    """
    num_layers = len(layer_flops)
    sizes = np.asarray(submesh_sizes, dtype=np.float64)
    is_stage = np.triu(np.ones((num_layers, num_layers), dtype=bool))[:, :, None]
    if math.isinf(tolerance):
        return np.broadcast_to(is_stage, (num_layers, num_layers, len(sizes))).copy()
    flops_ratio = _flops_ratio(layer_flops)[:, :, None]  # [i, j, 1]
    device_ratio = sizes[None, None, :] / num_devices  # [1, 1, m]
    return is_stage & _within(flops_ratio, device_ratio, tolerance)


def _flops_ratio(layer_flops: Sequence[float]) -> np.ndarray:
    """``ratio[i, j]``: the share of layers ``i..j`` in the FLOPs of all layers (equal
    shares when no layer has any; by prefix sums, exact for integer counts)."""
    flops = np.asarray(layer_flops, dtype=np.float64)
    if not flops.sum() > 0:
        flops = np.ones(len(flops))
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    return (prefix[None, 1:] - prefix[:-1, None]) / prefix[-1]


def _within(flops_ratio, device_ratio, tolerance: float):
    """Whether a device share is within a factor ``1 + tolerance`` of a FLOP share
    (arrays or scalars)."""
    too_many = device_ratio > flops_ratio * (1 + tolerance)
    too_few = device_ratio < flops_ratio / (1 + tolerance)
    return np.logical_not(too_many | too_few)


def _tolerance_needed(flops_ratio: float, device_ratio: float) -> float:
    """The least ``stage_imbalance_tolerance`` that keeps a stage (:func:`imbalance_mask`),
    rounded up to three significant digits."""
    if flops_ratio == 0:
        return math.inf
    needed = max(device_ratio / flops_ratio, flops_ratio / device_ratio) - 1
    if needed <= 0:
        return 0.0
    scale = 10.0 ** (2 - math.floor(math.log10(needed)))
    value = math.ceil(needed * scale) / scale
    if not _within(flops_ratio, device_ratio, value):
        value += 1 / scale
    return value


def tolerance_error(tolerance, unbounded, flops, sizes, num_devices: int) -> ValueError:
    """The error for a ``stage_imbalance_tolerance`` that leaves no plan, naming the least
    tolerance that keeps the plan the DP chooses without one."""
    ratios = _flops_ratio(flops)
    needed, stages = 0.0, []
    for (start, end), m, _ in unbounded:
        flops_ratio = float(ratios[start, end - 1])
        device_ratio = sizes[m] / num_devices
        needed = max(needed, _tolerance_needed(flops_ratio, device_ratio))
        stages.append(
            f"layers {start}..{end - 1} on {sizes[m]} devices ({flops_ratio:.1%} of the "
            f"FLOPs, {device_ratio:.1%} of the devices)"
        )
    if math.isinf(needed):
        advice = "which no finite tolerance allows (a stage with no FLOPs); pass math.inf"
    else:
        advice = f"which needs stage_imbalance_tolerance >= {needed:g}; pass a larger value"
    return ValueError(
        f"stage_imbalance_tolerance={tolerance:g} excludes every pipeline plan: each plan "
        f"of the {len(flops)} layers that fits has a stage whose share of the "
        f"{num_devices} devices is not within a factor {1 + tolerance:g} of its "
        f"share of the FLOPs. Without the bound the DP would choose {'; '.join(stages)}, "
        f"{advice}"
    )
