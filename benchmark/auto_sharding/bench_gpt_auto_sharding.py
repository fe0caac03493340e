"""Planning time of the auto-sharding pass on GPT train steps (``docs/auto_sharding.md``).

For each GPT preset (125M, 350M, 1.3B; adamw; abstract inputs, so no weights are allocated)
and each logical mesh (8,1), (2,4), (1,8) of an 8-device cluster, this traces the train
step, builds the strategy graph, solves the ILP, and reports: jaxpr equations, graph nodes,
decision groups after shrinking, ILP nodes/edges/variables, mean strategies per group, the
time of each phase, and the objective (communication + compute, docs/auto_sharding.md) next
to the hand plans (data parallel, Megatron-style model parallel, and the 2-D combination)
evaluated with the same cost model: each hand plan is the ILP with the parameters' specs
fixed to the hand choice; ``hand_*_ratio`` is the ILP's objective over the hand plan's.

Timings (seconds): ``model_init_time_s`` builds the abstract train state (``jax.eval_shape``
of the flax init; user code, before planning); ``trace_time_s`` is ``trace_step``;
``graph_build_time_s`` and ``solve_time_s`` are the two halves of ``solve_jaxpr``;
``planning_time_s`` = trace + graph build + solve (trace to plan). With ``--compile``,
``compile_time_s`` is XLA's lowering + compilation of the planned step through
``compile_shard_executable`` on abstract inputs, on 8 virtual CPU devices (set below, before
jax is imported), so no weights are allocated either.

Usage: python benchmark/auto_sharding/bench_gpt_auto_sharding.py [--models 125M 350M 1.3B]
       [--meshes 8,1 2,4 1,8] [--out benchmark/auto_sharding/results.json] [--batch 16]
       [--compile [MODEL ...]] [--num-layers N]
Results of the full run (2-core machine, shared): benchmark/auto_sharding/results.json.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from alpa.device_mesh import LogicalDeviceMesh  # noqa: E402
from alpa.model.gpt import GPT_PRESETS, get_gpt_train_state_and_step  # noqa: E402
from alpa.shard_parallel.auto_sharding import (  # noqa: E402
    AutoShardingOption,
    donated_state_pairs,
    solve_jaxpr,
)
from alpa.shard_parallel.ilp import ilp_solver  # noqa: E402
from alpa.shard_parallel.strategies import strategy_graph as sg  # noqa: E402
from alpa.shard_parallel.strategies.sharding_spec import Spec  # noqa: E402
from alpa.tracing.trace import trace_step  # noqa: E402


def make_gpt(name: str, batch_size: int, num_layers: int | None):
    config = GPT_PRESETS[name]
    if num_layers is not None:
        config = dataclasses.replace(config, num_layers=num_layers)
    state, batch, step = get_gpt_train_state_and_step(config, batch_size, abstract=True)
    leaves = jax.tree_util.tree_flatten_with_path((state, batch))[0]
    names = [jax.tree_util.keystr(path) for path, _ in leaves]
    return step, (state, batch), names


def trace_gpt(name: str, batch_size: int, num_layers: int | None):
    step, args, names = make_gpt(name, batch_size, num_layers)
    return trace_step(step, args, (), (1,), (0,), names)


def hand_filter(kind: str, mesh: LogicalDeviceMesh, names, batch_invars):
    """Parameter specs of a hand plan: dp (replicated), megatron (kernels split on their
    output features on the model axis; the projections after attention and the second MLP
    kernel on their input features), or 2d (data on axis 0, Megatron on axis 1)."""
    model_axis = 1 if mesh.shape[1] > 1 else 0

    def wanted(name: str, shape) -> Spec | None:
        rank = len(shape)
        if kind == "dp" or rank == 0:
            return ((),) * rank
        row = any(key in name for key in ("out_proj", "fc2", "output", "proj']"))
        if "kernel" in name and rank == 2:
            return ((model_axis,), ()) if row else ((), (model_axis,))
        if "embedding" in name and rank == 2:
            return ((model_axis,), ())
        return ((),) * rank

    def allowed(index, shape, specs):
        if batch_invars[index]:
            if kind == "megatron" or not shape:
                return [s for s in specs if all(not a for a in s)]
            data = (0,) if kind == "2d" or model_axis == 1 and mesh.shape[0] > 1 else (0, 1)
            keep = [s for s in specs if s[0] == tuple(a for a in data if mesh.shape[a] > 1)]
            return [s for s in keep if all(not a for a in s[1:])] or specs
        spec = wanted(names[index], shape)
        return [s for s in specs if s == spec] or specs

    return allowed


def run(model: str, mesh_shape, batch_size: int, num_layers: int | None, compile_: bool) -> dict:
    start = time.perf_counter()
    step, args, names = make_gpt(model, batch_size, num_layers)
    made_at = time.perf_counter()
    traced = trace_step(step, args, (), (1,), (0,), names)
    traced_at = time.perf_counter()
    devices = tuple(jax.devices()[:8]) if len(jax.devices()) >= 8 else None
    mesh = LogicalDeviceMesh(mesh_shape, (1.0, 1.0), (1.0, 0.1), devices=devices)
    pairs = donated_state_pairs(traced)
    solution = solve_jaxpr(
        traced.closed_jaxpr, mesh, AutoShardingOption(), traced.batch_invars, None, pairs
    )
    done = time.perf_counter()
    sol = solution.solution
    result = {
        "model": model,
        "num_layers": num_layers or GPT_PRESETS[model].num_layers,
        "mesh": list(mesh_shape),
        "batch_size": batch_size,
        "jaxpr_eqns": solution.graph.num_eqns,
        "graph_nodes": len(solution.graph.nodes),
        "graph_edges": len(solution.graph.edges),
        "groups_after_following": sol.num_groups,
        "ilp_nodes": sol.num_ilp_nodes,
        "ilp_edges": sol.num_ilp_edges,
        "ilp_variables": sol.num_ilp_variables,
        "mean_strategies_per_group": round(sol.mean_strategies, 2),
        "model_init_time_s": round(made_at - start, 2),
        "trace_time_s": round(traced_at - made_at, 2),
        "graph_build_time_s": round(done - traced_at - sol.solve_time, 2),
        "solve_time_s": round(sol.solve_time, 2),
        "planning_time_s": round(done - made_at, 2),
        "status": sol.status,
        "objective": solution.objective,
        "communication": ilp_solver.communication_cost(solution.graph, sol.choice),
        "compute": ilp_solver.compute_cost(solution.graph, sol.choice),
    }
    jaxpr = traced.closed_jaxpr
    for kind in ("dp", "megatron", "2d"):
        if kind == "2d" and 1 in mesh_shape:
            continue
        graph = sg.build_strategy_graph(
            jaxpr, mesh, sg.GraphOptions(),
            hand_filter(kind, mesh, traced.leaf_names, traced.batch_invars), pairs,
        )  # fmt: skip
        result[f"hand_{kind}_objective"] = ilp_solver.solve(graph).objective
    hands = {k: v for k, v in result.items() if k.startswith("hand_")}
    for key, value in hands.items():
        result[key.replace("_objective", "_ratio")] = round(solution.objective / value, 4)
    if compile_:
        if devices is None:
            raise RuntimeError("--compile needs 8 devices; XLA_FLAGS was set before this run")
        from alpa.executables.mesh import compile_shard_executable

        tic = time.perf_counter()
        compile_shard_executable(traced, solution.to_sharding_plan(), None)
        result["compile_time_s"] = round(time.perf_counter() - tic, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["125M", "350M", "1.3B"])
    parser.add_argument("--meshes", nargs="+", default=["8,1", "2,4", "1,8"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument(
        "--compile", nargs="*", default=None, metavar="MODEL",
        help="also compile the planned step (for the given models; all when none given)",
    )  # fmt: skip
    parser.add_argument("--out", default="benchmark/auto_sharding/results.json")
    args = parser.parse_args()
    results = []
    for model in args.models:
        for mesh in args.meshes:
            shape = tuple(int(x) for x in mesh.split(","))
            compile_ = args.compile is not None and (not args.compile or model in args.compile)
            row = run(model, shape, args.batch, args.num_layers, compile_)
            print(json.dumps(row), flush=True)
            results.append(row)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("model  mesh   planning s  objective  ILP / data parallel  / Megatron  / 2-D")
    for row in results:
        ratios = [row.get(f"hand_{k}_ratio") for k in ("dp", "megatron", "2d")]
        cells = ["-" if r is None else f"{r:.4f}" for r in ratios]
        print(
            f"{row['model']:5}  {str(tuple(row['mesh'])):6}  {row['planning_time_s']:9.2f}  "
            f"{row['objective']:.4g}  {cells[0]:>19}  {cells[1]:>10}  {cells[2]:>5}"
        )


if __name__ == "__main__":
    main()
