"""The cost model's predicted step times against measured ones, on this machine.

A profile of this machine's devices is made first (``alpa.mesh_profiling.profile_all``,
written to ``--profile``; ``--reuse-profile`` reads an existing one) and set as
``global_config.cluster_profile``, so that every plan below, and every search, prices
with it. Then, for three models written here (``models.py``: an MLP, a GPT with its
blocks written out, the same GPT as one ``nn.scan``), each plan of ``PLANS`` is compiled,
run ``--warmup`` steps and timed over ``--steps`` (each step waited for); the median is
set against the plan's prediction:

* one-mesh plans (``ShardParallel``'s ILP, ``DataParallel``, ``Zero2Parallel``,
  ``Zero3Parallel``, manual ``PartitionSpec`` s): ``executable.predicted_step_seconds``;
* pipelines: ``executable.plan.predicted_cost``.

Per plan the ratio predicted / measured; per model and over all plans Spearman's rank
correlation between predicted and measured; per model whether the plan the search picks
(``PipeshardParallel(stage_option="auto", pipeline_schedule="auto")``: stages,
submeshes, logical shapes, shardings and schedule chosen by the model) is measured within
10 % of the fastest plan of that model. Results go to ``--out`` (JSON) and a table.

    python benchmark/cost_model/bench_cost_model.py [--models mlp gpt scanned_gpt]
    python benchmark/cost_model/bench_cost_model.py --profile none   # the preset's model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import alpa  # noqa: E402
from alpa import mesh_profiling  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPT_SMALL, gpt_setup, mlp_setup  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

MODELS = {
    "mlp": lambda: mlp_setup(width=1024, depth=4, batch_size=512),
    "gpt": lambda: gpt_setup(GPT_SMALL, 32),
    "scanned_gpt": lambda: gpt_setup(dataclasses.replace(GPT_SMALL, scan=True), 32),
}
#: Layers an automatic pipeline cuts each model into.
LAYERS = {"mlp": 4, "gpt": 4, "scanned_gpt": 4}


def _pipe(model: str, stages: int, schedule: str = "1f1b", micro_batches: int = 4):
    per = LAYERS[model] // stages
    width = 8 // stages
    option = alpa.ManualStageOption(
        [list(range(s * per, (s + 1) * per)) for s in range(stages)],
        [(1, width)] * stages,
        [(width, 1)] * stages,
    )
    return alpa.PipeshardParallel(
        num_micro_batches=micro_batches,
        layer_option=alpa.AutoLayerOption(LAYERS[model]),
        stage_option=option,
        pipeline_schedule=schedule,
    )


def _search(model: str, micro_batches: int = 4):
    return alpa.PipeshardParallel(
        num_micro_batches=micro_batches,
        layer_option=alpa.AutoLayerOption(LAYERS[model]),
        stage_option="auto",
        pipeline_schedule="auto",
    )


def _megatron(state):
    """Manual specs for the MLP: its Dense layers split column then row over "model"
    (Megatron's MLP), Adam's moments as their parameters, the batch over "data"."""

    def spec(path, leaf):
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        layer = next((k for k in keys if isinstance(k, str) and k.startswith("Dense_")), None)
        if layer is None or getattr(leaf, "ndim", 0) == 0:
            return P()
        column = int(layer.split("_")[1]) % 2 == 0
        if leaf.ndim == 2:
            return P(None, "model") if column else P("model", None)
        return P("model") if column else P()

    state_specs = jax.tree_util.tree_map_with_path(spec, state)
    mesh = alpa.LocalPhysicalDeviceMesh().get_logical_mesh((2, 4))
    return alpa.ShardParallel(
        devices=mesh,
        manual_sharding_option=alpa.ManualShardingOption(
            ("data", "model"), in_axis_resources=(state_specs, P("data"))
        ),
    )


#: Per model, the plans: name -> method factory (given the model's state).
PLANS = {
    "mlp": {
        "ShardParallel (ILP)": lambda s: alpa.ShardParallel(),
        "DataParallel": lambda s: alpa.DataParallel(),
        "Zero2Parallel": lambda s: alpa.Zero2Parallel(),
        "Zero3Parallel": lambda s: alpa.Zero3Parallel(),
        "manual specs (Megatron 2x4)": _megatron,
        "2 stages, 1F1B": lambda s: _pipe("mlp", 2),
        "4 stages, 1F1B": lambda s: _pipe("mlp", 4),
        "search": lambda s: _search("mlp"),
    },
    "gpt": {
        "ShardParallel (ILP)": lambda s: alpa.ShardParallel(),
        "DataParallel": lambda s: alpa.DataParallel(),
        "Zero3Parallel": lambda s: alpa.Zero3Parallel(),
        "2 stages, 1F1B": lambda s: _pipe("gpt", 2),
        "2 stages, GPipe": lambda s: _pipe("gpt", 2, "gpipe"),
        "2 stages, ZB-H1": lambda s: _pipe("gpt", 2, "zb-h1"),
        "4 stages, 1F1B": lambda s: _pipe("gpt", 4),
        "search": lambda s: _search("gpt"),
    },
    "scanned_gpt": {
        "ShardParallel (ILP)": lambda s: alpa.ShardParallel(),
        "DataParallel": lambda s: alpa.DataParallel(),
        "2 stages, 1F1B": lambda s: _pipe("scanned_gpt", 2),
        "search": lambda s: _search("scanned_gpt"),
    },
}


def spearman(xs, ys) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(values):
        order = np.argsort(values, kind="stable")
        r = np.empty(len(values))
        r[order] = np.arange(len(values), dtype=float)
        for v in set(values):  # ties share their mean rank
            idx = [i for i, x in enumerate(values) if x == v]
            r[idx] = np.mean(r[idx])
        return r

    if len(xs) < 2:
        return float("nan")
    return float(np.corrcoef(ranks(list(xs)), ranks(list(ys)))[0, 1])


def time_plan(step, state, batch, method, warmup: int, steps: int) -> tuple[float, list, object]:
    parallel = alpa.parallelize(step, method=method)
    # Each plan steps its own copy: a step donates the state it replaces.
    state = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)
    start = time.perf_counter()
    for _ in range(warmup):
        state, loss = parallel(state, batch)
        jax.block_until_ready((state, loss))
    compile_s = time.perf_counter() - start
    seconds = []
    for _ in range(steps):
        begin = time.perf_counter()
        state, loss = parallel(state, batch)
        jax.block_until_ready((state, loss))
        seconds.append(time.perf_counter() - begin)
    return compile_s, seconds, parallel.get_last_executable()


def describe(executable) -> dict:
    plan = getattr(executable, "plan", None)
    if hasattr(plan, "predicted_cost"):  # a pipeline
        cost = plan.cost
        return {
            "predicted_s": plan.predicted_cost,
            "stages": [list(s) for s in plan.stage_plan.stage_layers()],
            "submeshes": [list(s) for s in plan.stage_plan.submesh_shapes],
            "logical": [list(m.shape) for m in plan.logical_meshes],
            "schedule": plan.schedule.name,
            "latencies_s": list(cost.latencies),
            "fits": all(cost.fits),
        }
    return {
        "predicted_s": executable.predicted_step_seconds,
        "communication_s": executable.auto_sharding_objective,
        "compute_s": executable.auto_sharding_compute_cost,
        "logical": list(executable.plan.logical_mesh.shape),
    }


def run(args) -> dict:
    profile_s = None
    if args.profile == "none":  # the presets' datasheet figures: the model before profiles
        alpa.global_config.cluster_profile = None
    else:
        if not (args.reuse_profile and os.path.exists(args.profile)):
            start = time.perf_counter()
            mesh_profiling.profile_all(cache_filename=args.profile)
            profile_s = time.perf_counter() - start
        alpa.global_config.cluster_profile = args.profile
    alpa.util.disable_tqdm_globally()
    rows = []
    for model in args.models:
        state, batch, step = MODELS[model]()
        for name, make in PLANS[model].items():
            if args.plans and name not in args.plans:
                continue
            row = {"model": model, "plan": name}
            try:
                method = make(state)
                compile_s, seconds, executable = time_plan(
                    step, state, batch, method, args.warmup, args.steps
                )
                row.update(describe(executable))
                row.update(
                    measured_s=statistics.median(seconds),
                    measured_runs_s=seconds,
                    warmup_s=compile_s,
                )
                row["ratio"] = row["predicted_s"] / row["measured_s"]
            except Exception as error:  # a plan that fails is reported, not fatal
                row["error"] = f"{type(error).__name__}: {error}"[:500]
            rows.append(row)
            _print_row(row)
    return {"profile_s": profile_s, "rows": rows, "summary": summarize(rows)}


def summarize(rows) -> dict:
    ok = [r for r in rows if "ratio" in r]
    summary = {
        "plans": len(ok),
        "ratios_within_goal": sum(0.75 <= r["ratio"] <= 1.33 for r in ok),
        "spearman_all": spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok]),
        "models": {},
    }
    for model in dict.fromkeys(r["model"] for r in ok):
        mine = [r for r in ok if r["model"] == model]
        fastest = min(mine, key=lambda r: r["measured_s"])
        searched = next((r for r in mine if r["plan"] == "search"), None)
        summary["models"][model] = {
            "spearman": spearman([r["predicted_s"] for r in mine], [r["measured_s"] for r in mine]),
            "fastest": fastest["plan"],
            "searched_over_fastest": (
                None if searched is None else searched["measured_s"] / fastest["measured_s"]
            ),
        }
    return summary


def _print_row(row: dict) -> None:
    if "error" in row:
        print(f"{row['model']:12s} {row['plan']:30s} FAILED {row['error'][:120]}", flush=True)
        return
    print(
        f"{row['model']:12s} {row['plan']:30s} predicted {row['predicted_s'] * 1e3:9.1f} ms  "
        f"measured {row['measured_s'] * 1e3:9.1f} ms  ratio {row['ratio']:5.2f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--plans", nargs="*", default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--profile",
        default=os.path.join(HERE, "cpu_profile.json"),
        help="the profile written and used ('none': price with the cpu preset, no profile)",
    )
    parser.add_argument("--reuse-profile", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "results.json"))
    args = parser.parse_args()
    result = run(args)
    result["machine"] = f"{os.cpu_count()} CPU cores, {len(jax.devices())} virtual devices"
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    s = result["summary"]
    print(
        f"{s['ratios_within_goal']}/{s['plans']} plans within [0.75, 1.33]; Spearman over "
        f"all plans {s['spearman_all']:.2f}"
    )
    for model, m in s["models"].items():
        over = m["searched_over_fastest"]
        print(
            f"  {model}: Spearman {m['spearman']:.2f}; fastest measured: {m['fastest']}; "
            f"searched plan / fastest: {'-' if over is None else f'{over:.2f}'}"
        )
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
