r"""The stage dynamic program of the Alpa paper (§5.2): layers -> stages on submeshes.

Given ``L`` layers, ``D`` devices, ``B`` micro-batches, submesh choices ``m`` (each a
``(hosts, devices_per_host)`` slice with ``n_m`` devices) and, per submesh, ``C`` logical
configurations ``c``, the input is

* ``compute_cost[i, j, m, c]``: the latency of one micro-batch through a stage made of
  layers ``i..j`` (inclusive) on submesh ``m`` with configuration ``c`` (``inf``: the stage
  cannot run so, e.g. it does not fit in memory);
* ``max_n_succ_stages[i, j, m, c]``: how many stages may follow that stage (under 1F1B a
  stage holds the activations of as many micro-batches as there are stages after it, so
  its memory bounds that number).

A plan is a sequence of stages ``(layers [s_t, e_t), m_t, c_t)`` that covers the layers in
order and uses exactly ``D`` devices, ``sum_t n_{m_t} = D``. Its pipeline latency is

.. math::  T = \sum_t t_t + (B - 1) \max_t t_t

with :math:`t_t` = ``compute_cost[s_t, e_t - 1, m_t, c_t]`` (the first micro-batch passes
every stage, the other ``B - 1`` follow at the pace of the
slowest). The max makes ``T`` not decomposable, so the DP fixes a bound ``t_max`` and
minimises the sum over plans whose stages all take at most ``t_max``:

.. math::  F(s, k, d) = \min_{k < i \le L,\; m,\; c} F(s - 1, i, d - n_m) + t(k, i - 1, m, c)

subject to ``t(k, i - 1, m, c) <= t_max`` and ``s - 1 <= max_n_succ_stages[k, i - 1, m, c]``,
where ``F(s, k, d)`` is the least sum of latencies of layers ``k..L-1`` placed as ``s``
stages on ``d`` devices, and ``F(0, L, 0) = 0``. The plan of ``min_s F(s, 0, D)`` has a
true maximum ``M <= t_max``, and costs ``F + (B - 1) M``. Running this for every distinct
stage latency as ``t_max`` is exact: the optimal plan's own maximum is one of them, and for
that bound the DP finds a plan at least as good.

The bounds are walked downward, and the DP breaks ties in the sum by the smaller maximum
(the pair ``(sum, max)`` is minimised lexicographically; it has optimal substructure, as
both parts grow monotonically with the rest of the plan). Then the plan found for a bound
``t`` with maximum ``M`` is also the one found for every bound in ``[M, t]`` (it is the
least pair over a larger set and lies in each smaller one), so the walk jumps straight to
the largest bound below ``M``. The DP thus runs once per distinct plan on the way down,
not once per distinct latency, and stops when no plan fits the bound.

**Other schedules** (``training_dp(..., schedule=...)``) change the objective and the
memory constraint, each by the schedule's closed form for equal stages (``schedules``):

* ``"gpipe"``: the same latency, but every stage holds all ``B`` micro-batches:
  ``B - 1 <= max_n_succ_stages`` for every stage;
* ``"zb-h1"``: ``(3 B + S - 1) t / 3`` for ``S`` stages of latency ``t`` (a forward a
  third of it, ``B`` and ``W`` a third each), written as
  :math:`T = \tfrac13 \sum_t t_t + (B - \tfrac13) \max_t t_t`; every stage holds
  ``min(S, B)`` micro-batches, ``min(S, B) - 1 <= max_n_succ_stages``, which depends on
  the number of stages ``S`` of the whole plan: the DP is run for each ``S`` with that
  bound, keeping only plans of exactly ``S`` stages, and the best over ``S`` is taken.

Entry points keep Alpa's names and signatures (research code imports them):
:func:`get_submesh_choices` and :func:`training_dp`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SUBMESH_SPACES = ("power_of_two", "small_power_of_two", "all", "manual")

#: The schedules the DP prices (``training_dp(schedule=...)``).
DP_SCHEDULES = ("1f1b", "gpipe", "zb-h1")


def get_submesh_choices(
    num_hosts: int,
    num_devices_per_host: int,
    space: str = "power_of_two",
    manually_specified_submeshes: Sequence[Sequence[int]] | None = None,
) -> tuple[tuple[int, int], ...]:
    """The submesh shapes a stage may take on a ``num_hosts x num_devices_per_host`` cluster.

    Within one host, ``(1, 1), (1, 2), (1, 4), ... (1, num_devices_per_host)`` (powers of
    two, and the whole host); across hosts, whole hosts: ``(h, num_devices_per_host)`` for
    ``h`` in ``space``: ``"power_of_two"`` (2, 4, 8, ... hosts), ``"small_power_of_two"``
    (2 and 4), ``"all"`` (2, 3, ... ``num_hosts``), or ``"manual"``:
    ``manually_specified_submeshes`` as given, each of which must tile the cluster (fit in
    it, take a divisor of a host's devices, and whole hosts when it spans several).
    """
    for name, value in (("num_hosts", num_hosts), ("num_devices_per_host", num_devices_per_host)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if space not in SUBMESH_SPACES:
        raise ValueError(f"unknown submesh space {space!r}; expected one of {SUBMESH_SPACES}")
    if space == "manual":
        if not manually_specified_submeshes:
            raise ValueError(
                "space='manual' needs manually_specified_submeshes, a list of "
                "(num_hosts, num_devices_per_host) shapes"
            )
        choices = []
        for shape in manually_specified_submeshes:
            hosts, per_host = (int(n) for n in shape)
            if not (1 <= hosts <= num_hosts and 1 <= per_host <= num_devices_per_host):
                raise ValueError(
                    f"manually specified submesh {tuple(shape)} does not fit a cluster of "
                    f"{num_hosts} hosts x {num_devices_per_host} devices"
                )
            if num_devices_per_host % per_host:
                raise ValueError(
                    f"manually specified submesh {tuple(shape)} does not tile a host of "
                    f"{num_devices_per_host} devices: {per_host} does not divide it"
                )
            if hosts > 1 and per_host != num_devices_per_host:
                raise ValueError(
                    f"manually specified submesh {tuple(shape)} spans hosts, so it must take "
                    f"whole hosts ({num_devices_per_host} devices each)"
                )
            choices.append((hosts, per_host))
        return tuple(choices)
    choices = []
    per_host = 1
    while per_host < num_devices_per_host:
        choices.append((1, per_host))
        per_host *= 2
    choices.append((1, num_devices_per_host))
    if space == "all":
        hosts = list(range(2, num_hosts + 1))
    else:
        limit = num_hosts if space == "power_of_two" else min(num_hosts, 4)
        hosts, h = [], 2
        while h <= limit:
            hosts.append(h)
            h *= 2
    choices += [(h, num_devices_per_host) for h in hosts]
    return tuple(choices)


def training_dp(
    num_layers: int,
    num_devices: int,
    num_micro_batches: int,
    submesh_choices: Sequence[Sequence[int]],
    num_autosharding_configs: int,
    compute_cost: np.ndarray,
    max_n_succ_stages: np.ndarray,
    schedule: str = "1f1b",
) -> tuple[float, list[tuple[tuple[int, int], int, int]]]:
    """The plan of least pipeline latency (module docstring) under ``schedule``
    (``"1f1b"``, Alpa's; ``"gpipe"`` or ``"zb-h1"``) and its cost.

    Returns ``(cost, solution)`` with ``solution = [((start, end_exclusive), m, c), ...]``
    in stage order. Raises ``ValueError`` when no plan uses exactly ``num_devices`` devices
    with finite costs (naming what was searched), never returns ``inf``.
    """
    if schedule not in DP_SCHEDULES:
        raise ValueError(f"schedule must be one of {DP_SCHEDULES}, got {schedule!r}")
    num_choices = len(submesh_choices)
    shape = (num_layers, num_layers, num_choices, num_autosharding_configs)
    compute_cost = np.asarray(compute_cost, dtype=np.float64)
    max_n_succ_stages = np.asarray(max_n_succ_stages)
    for name, array in (("compute_cost", compute_cost), ("max_n_succ_stages", max_n_succ_stages)):
        if array.shape != shape:
            raise ValueError(
                f"{name} has shape {array.shape}; expected (num_layers, num_layers, "
                f"len(submesh_choices), num_autosharding_configs) = {shape}"
            )
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    sizes = [int(np.prod(s)) for s in submesh_choices]
    B = num_micro_batches
    if schedule == "zb-h1":
        # Every stage holds min(S, B) micro-batches: one DP per number of stages S.
        runs = [
            (_Rule(lambda s, S=S: min(S, B) - 1, S, 1 / 3, 2 / 3))
            for S in range(1, min(num_layers, num_devices) + 1)
        ]
    elif schedule == "gpipe":
        runs = [_Rule(lambda s: B - 1, None, 1.0, 0.0)]
    else:
        runs = [_Rule(lambda s: s - 1, None, 1.0, 0.0)]
    best_cost, best_solution = np.inf, None
    for rule in runs:
        found = _walk_bounds(
            num_layers, num_devices, B, sizes, compute_cost, max_n_succ_stages, rule
        )
        if found is not None and found[0] < best_cost:
            best_cost, best_solution = found
    if best_solution is None:
        raise ValueError(
            f"no pipeline plan of {num_layers} layers uses exactly {num_devices} devices: "
            "every split of the layers into stages on submeshes "
            f"{[tuple(s) for s in submesh_choices]} has a stage whose cost is inf, uses more "
            "or fewer devices than the cluster has, or has more stages after it than "
            "max_n_succ_stages allows"
        )
    return float(best_cost), best_solution


class _Rule:
    """A schedule's terms for the DP: ``need(s)``, the ``max_n_succ_stages`` a stage needs
    when ``s`` stages (itself included) remain; ``stages``, the plan's number of stages
    when fixed; the cost ``sum_weight * sum + (B - 1 + max_extra) * max``."""

    def __init__(self, need, stages, sum_weight, max_extra):
        self.need, self.stages = need, stages
        self.sum_weight, self.max_extra = sum_weight, max_extra


def _walk_bounds(num_layers, num_devices, num_micro_batches, sizes, compute_cost, max_succ, rule):
    """The best ``(cost, plan)`` under ``rule`` over every bound on the largest stage
    latency (module docstring), or ``None``."""
    bounds = np.unique(compute_cost[np.isfinite(compute_cost)])[::-1]  # largest first
    best = None
    index = 0
    while index < len(bounds):
        found = _dp_within(
            num_layers, num_devices, num_micro_batches, sizes, compute_cost, max_succ,
            bounds[index], rule,
        )  # fmt: skip
        if found is None:
            break  # no plan within this bound, so none within a smaller one
        total, plan, plan_max = found
        if best is None or total < best[0]:
            best = (total, plan)
        index = max(index + 1, int(np.searchsorted(-bounds, -plan_max, side="right")))
    return best


def _dp_within(num_layers, num_devices, num_micro_batches, sizes, cost, max_succ, t_max, rule):
    """The DP for one bound ``t_max``: ``(total cost, plan, its largest stage latency)``, or
    ``None`` when no plan fits the bound.

    For each ``(s, k)`` one numpy reduction takes the minimum over the first stage's end
    layer, submesh and configuration for every device count ``d`` at once; ties go to the
    smallest ``(end, m, c)``.
    """
    L, D, M = num_layers, num_devices, len(sizes)
    inf = np.inf
    f = np.full((L + 1, L + 1, D + 1), inf)  # f[s, k, d]
    stage_max = np.zeros((L + 1, L + 1, D + 1))
    arg = np.full((L + 1, L + 1, D + 1, 3), -1, dtype=np.int64)  # (end, m, c) of stage 1
    f[0, L, 0] = 0.0
    within = np.where(cost <= t_max, cost, inf)  # [k, j, m, c]
    columns = np.arange(D + 1)
    for s in range(1, min(L, D) + 1):
        if not np.isfinite(f[s - 1]).any():
            break
        # shifted[m, i, d] = F(s - 1, i, d - n_m): the rest of the plan after a stage on m.
        shifted = np.full((M, L + 1, D + 1), inf)
        shifted_max = np.zeros((M, L + 1, D + 1))
        for m, n in enumerate(sizes):
            if n <= D:
                shifted[m, :, n:] = f[s - 1, :, : D + 1 - n]
                shifted_max[m, :, n:] = stage_max[s - 1, :, : D + 1 - n]
        for k in range(L - 1, -1, -1):
            # The first stage is layers k..i-1, i = k+1..L (j = i-1 = k..L-1).
            t = np.where(rule.need(s) <= max_succ[k, k:L], within[k, k:L], inf)  # [i', m, c]
            # The rest of the plan does not depend on the stage's configuration, so per
            # (i', m) only its fastest one can be chosen (and gives the smaller maximum
            # too); the first of equals, as the tie rule says.
            best_c = t.argmin(axis=2)  # [i', m]
            t = np.take_along_axis(t, best_c[:, :, None], axis=2)  # [i', m, 1]
            rest = shifted[:, k + 1 :, :].transpose(1, 0, 2)  # [i', m, d]
            rest_max = shifted_max[:, k + 1 :, :].transpose(1, 0, 2)
            total = (rest + t).reshape(-1, D + 1)
            peak = np.maximum(rest_max, t).reshape(-1, D + 1)
            # Least sum, then least maximum among equal sums (module docstring).
            least = total.min(axis=0)
            best = np.where(total == least, peak, inf).argmin(axis=0)
            f[s, k] = total[best, columns]
            stage_max[s, k] = peak[best, columns]
            end, m = np.unravel_index(best, (L - k, M))
            arg[s, k, :, 0], arg[s, k, :, 1], arg[s, k, :, 2] = end + k + 1, m, best_c[end, m]
    sums, peaks = f[1:, 0, D].copy(), stage_max[1:, 0, D]
    if rule.stages is not None:  # plans of exactly that many stages
        sums[np.arange(len(sums)) != rule.stages - 1] = inf
    if not np.isfinite(sums).any():
        return None
    s = int(np.argmin(np.where(sums == sums.min(), peaks, inf))) + 1
    plan_max = float(stage_max[s, 0, D])
    total = rule.sum_weight * f[s, 0, D] + (num_micro_batches - 1 + rule.max_extra) * plan_max
    plan, k, d = [], 0, D
    while s > 0:
        i, m, c = (int(x) for x in arg[s, k, d])
        plan.append(((k, i), m, c))
        s, k, d = s - 1, i, d - sizes[m]
    assert k == L and d == 0, (k, d)
    return float(total), plan, plan_max
