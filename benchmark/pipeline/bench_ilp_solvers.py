"""HiGHS against CBC on the same auto-sharding ILPs: the stage-cost ILPs of a GPT plan.

Plans GPT (default GPT-39B on 8 x 8 A100-40GB, batch 1024, 64 micro-batches,
``AutoLayerOption(16, remat_mode="coarse_grained_remat")``, ``stage_option="auto"``, on
abstract inputs) and, for every ILP the planner solves (``ilp_solver.solve``), solves the
same strategy graph with both solvers (``global_config.ilp_solver``), timing each solve
(building the model and running the solver; the graph is built once) and comparing the
objectives of the two plans under the graph's cost model. The plan itself is made with
HiGHS's answers. Writes ``benchmark/pipeline/ilp_solvers.json`` and prints a summary.

Usage: python benchmark/pipeline/bench_ilp_solvers.py [--case 39B:64] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax.numpy as jnp
import numpy as np

import alpa
from alpa.device_mesh import ClusterSpec
from alpa.global_env import global_config
from alpa.model.gpt import GPT_PRESETS, get_gpt_train_state_and_step
from alpa.shard_parallel import auto_sharding
from alpa.shard_parallel.ilp import ilp_solver, milp

LAYER_NUM = {"1.3B": 6, "2.6B": 8, "6.7B": 8, "15B": 16, "39B": 16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="39B:64")
    parser.add_argument("--out", default="benchmark/pipeline/ilp_solvers.json")
    args = parser.parse_args()
    alpa.util.disable_tqdm_globally()
    model, gpus = args.case.split(":")
    config = dataclasses.replace(GPT_PRESETS[model], dtype=jnp.float16)
    per_node = min(int(gpus), 8)
    cluster = ClusterSpec.preset("a100-40gb", int(gpus) // per_node, per_node)
    state, data, step = get_gpt_train_state_and_step(
        config, 1024, grad_func=alpa.value_and_grad, abstract=True
    )
    records = []
    original = ilp_solver.solve

    def both(graph, memory_budget=None, time_limit=60.0, comm_first=True):
        result = {}
        for solver in ("cbc", "highs"):
            global_config.ilp_solver = solver
            milp.clear_solved()  # each solver solves, none answers from an earlier equal model
            start = time.perf_counter()
            solution = original(graph, memory_budget, time_limit, comm_first)
            result[solver] = (time.perf_counter() - start, solution)
        global_config.ilp_solver = "highs"
        records.append(
            {
                "nodes": len(graph.nodes),
                "ilp_variables": result["highs"][1].num_ilp_variables,
                "cbc_s": result["cbc"][0],
                "highs_s": result["highs"][0],
                "cbc_objective": result["cbc"][1].objective,
                "highs_objective": result["highs"][1].objective,
                "cbc_status": result["cbc"][1].status,
                "highs_status": result["highs"][1].status,
            }
        )
        return result["highs"][1]

    ilp_solver.solve = both
    auto_sharding.ilp_solver.solve = both
    method = alpa.PipeshardParallel(
        devices=cluster,
        num_micro_batches=64,
        layer_option=alpa.AutoLayerOption(LAYER_NUM[model], remat_mode="coarse_grained_remat"),
        stage_option="auto",
    )
    alpa.parallelize(step, method=method).plan(state, data)
    ilp_solver.solve = original

    cbc = np.array([r["cbc_s"] for r in records])
    highs = np.array([r["highs_s"] for r in records])
    gap = np.array(
        [
            abs(r["cbc_objective"] - r["highs_objective"]) / max(abs(r["cbc_objective"]), 1e-30)
            for r in records
        ]
    )
    summary = {
        "case": args.case,
        "ilps": len(records),
        "cbc_total_s": float(cbc.sum()),
        "highs_total_s": float(highs.sum()),
        "speedup": float(cbc.sum() / highs.sum()),
        "max_relative_objective_gap": float(gap.max()),
        "ilps_with_gap_over_1e-6": int((gap > 1e-6).sum()),
        "statuses": sorted({(r["cbc_status"], r["highs_status"]) for r in records}),
    }
    with open(args.out, "w") as f:
        json.dump({"machine": "2-core CPU", "summary": summary, "ilps": records}, f, indent=1)
    print(
        f"{args.case}: {len(records)} ILPs; CBC {cbc.sum():.1f} s, HiGHS {highs.sum():.1f} s "
        f"({summary['speedup']:.1f}x); largest relative objective gap {gap.max():.2e} "
        f"({summary['ilps_with_gap_over_1e-6']} ILPs over 1e-6)"
    )
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
