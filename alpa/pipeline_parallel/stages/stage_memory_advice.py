"""Why no pipeline plan fits memory, by how much, and what would make one fit.

When the stage DP finds no plan within ``memory_budget_per_device``, the error says:

* **the least memory any plan needs**: the smallest budget under which the DP finds a
  plan, by bisection over budgets (each budget gives its own ``max_n_succ_stages``
  tables from the cost model's memory terms: a stage holding ``F`` bytes once and ``A``
  per micro-batch in flight fits ``k`` stages after it under 1F1B when
  ``F + (k + 1) A <= budget``), and that plan's fullest stage;
* **what would help**, each with its size where the model can tell it: stage remat
  (``AutoLayerOption(remat_mode="coarse_grained_remat")``: a stage keeps per micro-batch
  only what enters it), or under remat smaller layers (a stage's backward holds its
  layers' recomputed activations at once), more micro-batches (each micro-batch's
  activations shrink with its rows), more devices (the step's state, parameters,
  gradients and optimizer state, is at least the whole of it over all devices).
"""

from __future__ import annotations

import numpy as np

from alpa.pipeline_parallel.stages.stage_dp import training_dp
from alpa.pipeline_parallel.stages.stage_problem import StageCosts, StageProblem

GIB = float(1 << 30)


def _size(num_bytes: float) -> str:
    if num_bytes >= 0.1 * GIB:
        return f"{num_bytes / GIB:.3g} GiB"
    if num_bytes >= 0.1 * (1 << 20):
        return f"{num_bytes / (1 << 20):.3g} MiB"
    return f"{num_bytes:.4g} bytes"


def _fits(budget: float, costs: StageCosts, problem: StageProblem, num_devices: int, B: int):
    """The DP's plan when every stage's memory is set against ``budget`` (``None``: none
    fits)."""
    known = np.isfinite(costs.memory)
    per_micro = np.where(known, costs.per_micro_batch_memory, 0.0)
    fixed = np.where(known, costs.memory, 0.0) - per_micro
    cap = max(problem.num_layers, B)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(per_micro > 0, np.floor((budget - fixed) / per_micro) - 1, cap)
    k = np.where(fixed > budget, -1, np.minimum(k, cap))
    k = np.where(known, k, -1).astype(np.int64)
    # Any plan will do: every stage that fits costs the same.
    latency = np.where(k >= 0, 1.0, np.inf)
    try:
        return training_dp(
            problem.num_layers,
            num_devices,
            B,
            problem.submesh_choices,
            problem.num_configs,
            latency,
            k,
        )[1]
    except ValueError:
        return None


def least_memory_plan(costs: StageCosts, problem: StageProblem, num_devices: int, B: int):
    """``(bytes, solution)``: the smallest budget (within 1 %) under which some plan
    fits, and that plan (``training_dp``'s solution); ``(inf, None)`` when none fits
    under any."""
    finite = costs.memory[np.isfinite(costs.memory)]
    if finite.size == 0 or costs.per_micro_batch_memory is None:
        return float("inf"), None
    high = float(
        finite.max()
        + np.nanmax(np.where(np.isfinite(costs.memory), costs.per_micro_batch_memory, 0)) * B
    )
    solution = _fits(high, costs, problem, num_devices, B)
    if solution is None:
        return float("inf"), None
    low = float(finite.min())
    while high - low > 0.01 * high:
        middle = (low + high) / 2
        found = _fits(middle, costs, problem, num_devices, B)
        if found is None:
            low = middle
        else:
            high, solution = middle, found
    return high, solution


def infeasible_message(costs: StageCosts, problem: StageProblem, num_devices: int, B: int) -> str:
    """The error of a step with no plan within ``problem.memory_budget`` (module
    docstring)."""
    budget = problem.memory_budget
    lines = [f"no pipeline plan of the step fits memory_budget_per_device={_size(budget)}"]
    if costs.per_micro_batch_memory is None:
        lines[0] += f" (the smallest stage alone needs {_size(np.min(costs.memory))})"
        return "; ".join(lines)
    need, solution = least_memory_plan(costs, problem, num_devices, B)
    worst = None
    if solution is not None:
        stages = len(solution)
        for s, ((start, end), m, c) in enumerate(solution):
            fixed = (
                costs.memory[start, end - 1, m, c]
                - costs.per_micro_batch_memory[start, end - 1, m, c]
            )
            per = costs.per_micro_batch_memory[start, end - 1, m, c]
            in_flight = min(stages - s, B)
            total = fixed + in_flight * per
            if worst is None or total > worst[0]:
                worst = (total, s, start, end, m, c, fixed, per, in_flight)
        total, s, start, end, m, c, fixed, per, in_flight = worst
        shape = problem.submesh_choices[m]
        logical = problem.configs[m][c].shape
        lines[0] += (
            f": the plan that needs the least needs {_size(need)} per device, "
            f"{_size(need - budget)} over (its fullest stage, {s} of {stages}: "
            f"layers {start}-{end - 1} on {shape[0]}x{shape[1]} devices, logical "
            f"{tuple(logical)}, holds {_size(fixed)} once (state, temporaries) and "
            f"{_size(per)} per micro-batch for {in_flight} micro-batch"
            f"{'es' if in_flight != 1 else ''} in flight)"
        )
    else:
        lines[0] += f" (the smallest stage alone needs {_size(np.min(costs.memory))})"
    lines.append("what would help: " + "; ".join(_advice(problem, num_devices, B, worst)))
    return ". ".join(lines)


def _advice(problem: StageProblem, num_devices: int, B: int, worst) -> list[str]:
    facts = problem.layer_facts
    advice = []
    if worst is not None:
        _, _, start, end, m, _, _, per, in_flight = worst
        n = int(np.prod(problem.submesh_choices[m]))
        if not problem.remat and per > 0:
            kept = (
                facts[start].entering_bytes
                + sum(facts[layer].batch_arg_bytes for layer in range(start, end))
            ) / n
            advice.append(
                "stage remat, AutoLayerOption(remat_mode='coarse_grained_remat'): a stage "
                f"keeps per micro-batch only what enters it (that stage: about "
                f"{_size(kept)} instead of {_size(per)} per micro-batch)"
            )
        if problem.remat:
            advice.append(
                f"smaller layers (AutoLayerOption(layer_num={2 * problem.num_layers})): under "
                "stage remat a stage's backward holds the recomputed activations of its "
                f"layers at once, and a stage of layers {start}-{end - 1} holds "
                f"{_size(worst[6])} once"
            )
        if per > 0:
            advice.append(
                f"more micro-batches (num_micro_batches={2 * B}: each micro-batch's "
                f"activations about halve, {_size(in_flight * per / 2)} instead of "
                f"{_size(in_flight * per)} for that stage's micro-batches in flight)"
            )
    state = sum(f.state_bytes for f in facts)
    budget = problem.memory_budget
    needed = int(np.ceil(state / budget)) if budget > 0 else num_devices
    advice.append(
        f"more devices (the step's state, parameters, gradients and optimizer state, is "
        f"{_size(state)}: at best {_size(state / num_devices)} on each of "
        f"{num_devices} devices"
        + (f"; it alone needs at least {needed} devices" if needed > num_devices else "")
        + ")"
    )
    return advice
