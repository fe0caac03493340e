"""Automatic pipelines for GPT on clusters that are not here: how fast, and how good.

For each case (GPT size, ``ClusterSpec`` preset, nodes x GPUs), this builds the train step
on abstract inputs (``jax.ShapeDtypeStruct``; no weights allocated, no device touched) and
calls ``parallelize(step, method=PipeshardParallel(devices=cluster,
layer_option=AutoLayerOption(...), stage_option="auto")).plan(state, batch)`` with the
analytic stage cost model. It writes, per case, the time split

* ``trace_s``: tracing the step (without the layer clustering inside ``alpa.grad``),
* ``layer_clustering_s``: the layer clustering DP (``segments.clustered_segments``),
* ``stage_cost_s``: the stage cost table (``AnalyticStageCost``: one ILP per distinct
  layer and submesh configuration),
* ``dp_s``: the stage DP (``training_dp``),
* ``rest_s``: the rest of ``plan()`` (computation split, each chosen stage's ILP, schedule,
  instructions),

the chosen plan (stages, layers, submeshes, logical shapes) and its predicted iteration
time, and how good that is:

* ``limit_s``: the model's FLOPs (``alpa.util.compute_gpt_tflops``'s count, forward and
  backward; a recomputed forward is not model FLOPs) at the cluster's peak,
* ``hand_s``: the Megatron-style hand plan priced by the same analytic model
  (``PipeshardPlan.cost``): one stage per node (the layers split evenly), each on its
  node's 8 GPUs with a logical ``(1, 8)`` mesh on which the ILP must split every weight
  (``allow_replicated_parameters=False``: Megatron's tensor parallelism inside a node,
  pipeline stages across nodes),
* ``predicted / limit`` and ``predicted / hand`` (a plan that does not fit the memory
  budget is marked "(no fit)" wherever its price is printed),

to a JSON file, and prints a summary table.

Alpa (OSDI 2022) needed 2,393 s for GPT-39B on 64 GPUs (1,583 s compiling, 804 s
profiling, 1.65 s DP); the goals here, on a 2-core machine: GPT-39B/64 under 20 s,
GPT-175B/1024 under 120 s.

Usage: python benchmark/pipeline/bench_auto_pipeline.py [--cases 1.3B:8 39B:64 ...]
       [--out benchmark/pipeline/results.json] [--batch 1024] [--micro-batches 64]
       [--remat coarse_grained_remat|none] [--no-hand] [--draw DIR] [--repeat N]
       [--schedule 1f1b|gpipe|zb-h1|auto]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import jax.numpy as jnp

import alpa
from alpa.device_mesh import ClusterSpec
from alpa.model.gpt import GPT_PRESETS, get_gpt_train_state_and_step
from alpa.pipeline_parallel.layers import layer_construction, segments
from alpa.pipeline_parallel.stages import stage_construction
from alpa.pipeline_parallel.stages.stage_cost import AnalyticStageCost
from alpa.util import compute_gpt_tflops

# (model, GPUs): Alpa's weak-scaling pairs, and GPT-39B on 64 GPUs as in its paper.
DEFAULT_CASES = ("1.3B:8", "2.6B:16", "6.7B:32", "15B:64", "39B:64", "175B:1024")

# Layers the step is clustered into, per model: the counts of Alpa's own GPT searches
# (its benchmark suite's perf_test_auto, benchmark/alpa/suite_gpt.py), each a divisor of
# the model's transformer blocks (24, 32, 32, 48, 48).
LAYER_NUM = {"1.3B": 6, "2.6B": 8, "6.7B": 8, "15B": 16, "39B": 16, "175B": 32}


# GPT-3 175B (96 layers, hidden 12288, 96 heads), the largest of Alpa's weak-scaling table.
MODELS = {
    **GPT_PRESETS,
    "175B": dataclasses.replace(GPT_PRESETS["39B"], hidden_size=12288, num_layers=96, num_heads=96),
}


class Timers:
    """Accumulated seconds of the functions ``wrap`` patched."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, name: str, key: str):
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)


def run_case(
    model: str,
    num_gpus: int,
    batch: int,
    micro_batches: int,
    timers: Timers,
    layer_num: int | None = None,
    remat: str = "coarse_grained_remat",
    hand: bool = True,
    draw_dir: str | None = None,
    schedule: str = "1f1b",
) -> dict:
    config = dataclasses.replace(MODELS[model], dtype=jnp.float16)  # as Alpa's runs
    per_node = min(num_gpus, 8)
    cluster = ClusterSpec.preset("a100-40gb", num_gpus // per_node, per_node)
    layer_num = layer_num or LAYER_NUM.get(model, min(config.num_layers, 16))
    state, data, step = get_gpt_train_state_and_step(
        config, batch, grad_func=alpa.value_and_grad, abstract=True
    )
    method = alpa.PipeshardParallel(
        devices=cluster,
        num_micro_batches=micro_batches,
        layer_option=alpa.AutoLayerOption(layer_num=layer_num, remat_mode=remat),
        stage_option="auto",
        pipeline_schedule=schedule,
    )
    timers.seconds.clear()
    parallel = alpa.parallelize(step, method=method)
    start = time.perf_counter()
    plan = parallel.plan(state, data)
    total = time.perf_counter() - start
    split = dict(timers.seconds)
    if draw_dir is not None:  # after the timing
        tag = "" if plan.schedule.name == "1f1b" else f"_{plan.schedule.name.replace('-', '_')}"
        plan.draw(f"{draw_dir}/gpt{model.lower()}_{num_gpus}{tag}_plan.png")
    trace = split.get("trace", 0.0) - split.get("layer_clustering", 0.0)
    known = trace + sum(split.get(k, 0.0) for k in ("layer_clustering", "stage_cost", "dp"))
    stages = plan.summary()["stages"]
    flops = 1e12 * compute_gpt_tflops(
        batch,
        config.seq_len,
        config.num_layers,
        config.hidden_size,
        config.vocab_size,
        num_gpus,
        1.0,
    )
    limit = flops / cluster.device_flops
    hand_s = hand_plan = hand_fits = None
    if hand:
        hand_s, hand_fits, hand_plan = _hand_plan(
            step, state, data, cluster, micro_batches, layer_num, remat
        )
    return {
        "model": model,
        "num_gpus": num_gpus,
        "cluster": f"{cluster.num_nodes}x{cluster.num_devices_per_node} {cluster.name}",
        "batch_size": batch,
        "num_micro_batches": micro_batches,
        "layer_num": layer_num,
        "total_s": total,
        "trace_s": trace,
        "layer_clustering_s": split.get("layer_clustering", 0.0),
        "stage_cost_s": split.get("stage_cost", 0.0),
        "dp_s": split.get("dp", 0.0),
        "rest_s": total - known,
        "predicted_iteration_s": plan.predicted_cost,
        "limit_s": limit,
        "predicted_over_limit": plan.predicted_cost / limit,
        "hand_s": hand_s,
        "hand_fits": hand_fits,
        "predicted_over_hand": None if hand_s is None else plan.predicted_cost / hand_s,
        "fits": all(plan.cost.fits),
        "hand_plan": hand_plan,
        "stages": [
            {k: s[k] for k in ("layers", "submesh", "logical_shape", "latency", "memory")}
            for s in stages
        ],
        "plan": str(plan).splitlines()[: len(stages) + 2 + len(plan.schedule_candidates) + 1],
        "schedule": plan.schedule.name,
        # pipeline_schedule="auto": each schedule on the chosen stages (schedule_choice).
        "schedule_candidates": plan.summary()["schedule_candidates"],
    }


def _hand_plan(step, state, data, cluster, micro_batches, layer_num, remat):
    """The Megatron-style plan (module docstring) priced by the analytic model: seconds per
    step and its first lines (``None`` when the layers do not split evenly over nodes)."""
    nodes = cluster.num_nodes
    if layer_num % nodes:
        return None, None, None
    per = layer_num // nodes
    stage_option = alpa.ManualStageOption(
        forward_stage_layer_ids=[list(range(s * per, (s + 1) * per)) for s in range(nodes)],
        submesh_physical_shapes=[(1, cluster.num_devices_per_node)] * nodes,
        submesh_logical_shapes=[(1, cluster.num_devices_per_node)] * nodes,
        # Megatron splits every weight over the node (tensor parallelism).
        submesh_autosharding_option_dicts=[{"allow_replicated_parameters": False}] * nodes,
    )
    method = alpa.PipeshardParallel(
        devices=cluster,
        num_micro_batches=micro_batches,
        layer_option=alpa.AutoLayerOption(layer_num=layer_num, remat_mode=remat),
        stage_option=stage_option,
    )
    plan = alpa.parallelize(step, method=method).plan(state, data)
    cost = plan.cost
    lines = [
        f"hand plan: {nodes} stages x {per} layers on (1,{cluster.num_devices_per_node}), "
        f"predicted {cost.step_seconds * 1e3:.1f} ms/step"
    ]
    for s, (lat, mem, fits) in enumerate(zip(cost.latencies, cost.memory, cost.fits, strict=True)):
        over = "" if fits else " (over budget)"
        lines.append(f"  stage {s}: {lat * 1e3:.3f} ms, {mem / 2**20:.1f} MiB{over}")
    if not all(cost.fits):
        lines[0] += " (does not fit the memory budget)"
    return cost.step_seconds, all(cost.fits), lines


def _median_of_runs(case: str, args) -> dict:
    """``case`` planned ``args.repeat`` times, each by this script in a process of its own;
    the median run's result (the lower of the two middle ones), with every run's seconds
    in ``total_s_runs``."""
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.repeat):
            out = os.path.join(folder, f"run{i}.json")
            command = [sys.executable, __file__, "--cases", case, "--out", out]
            command += ["--batch", str(args.batch), "--micro-batches", str(args.micro_batches)]
            command += ["--remat", args.remat, "--schedule", args.schedule]
            if args.layer_num is not None:
                command += ["--layer-num", str(args.layer_num)]
            if args.no_hand or i > 0:  # the hand plan's price is the same every run
                command.append("--no-hand")
            if args.draw is not None and i == 0:
                command += ["--draw", args.draw]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                runs.append(json.load(f)["results"][0])
    hand = {k: runs[0][k] for k in ("hand_s", "hand_fits", "predicted_over_hand", "hand_plan")}
    runs.sort(key=lambda r: r["total_s"])
    result = runs[(len(runs) - 1) // 2] | hand
    result["total_s_runs"] = [r["total_s"] for r in runs]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES))
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--micro-batches", type=int, default=64)
    parser.add_argument("--out", default="benchmark/pipeline/results.json")
    parser.add_argument(
        "--layer-num", type=int, default=None, help="layers for every case (default: LAYER_NUM)"
    )
    parser.add_argument(
        "--remat",
        default="coarse_grained_remat",
        choices=["none", "coarse_grained_remat"],
        help="AutoLayerOption.remat_mode (Alpa's GPT benchmark: coarse_grained_remat)",
    )
    parser.add_argument("--no-hand", action="store_true", help="skip the hand plan")
    parser.add_argument(
        "--schedule",
        default="1f1b",
        help="pipeline_schedule of every case ('auto': each schedule priced on the chosen "
        "stages, the fastest that fits taken; the candidates go to the results)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="plan each case this many times, each in a fresh process (a second plan in "
        "one process reuses warm caches), and report the median run; this machine's speed "
        "varies by a fifth between runs. Every run's seconds go to the results",
    )
    parser.add_argument(
        "--draw",
        default=None,
        metavar="DIR",
        help="also draw each case's plan into DIR/gpt<model>_<gpus>[_<schedule>]_plan.png "
        "(matplotlib; the schedule named unless 1f1b)",
    )
    args = parser.parse_args()
    alpa.util.disable_tqdm_globally()
    # Only trace-time work is timed; nothing here compiles or touches a device.

    timers = Timers()
    timers.wrap(alpa.api.ParallelizedFunc, "_trace", "trace")
    timers.wrap(segments, "clustered_segments", "layer_clustering")
    timers.wrap(layer_construction, "clustered_segments", "layer_clustering")
    timers.wrap(AnalyticStageCost, "__call__", "stage_cost")
    timers.wrap(stage_construction, "training_dp", "dp")

    results = []
    for case in args.cases:
        model, gpus = case.split(":")
        if args.repeat > 1:
            result = _median_of_runs(case, args)
        else:
            result = run_case(
                model,
                int(gpus),
                args.batch,
                args.micro_batches,
                timers,
                args.layer_num,
                args.remat,
                not args.no_hand,
                args.draw,
                args.schedule,
            )
            result["total_s_runs"] = [result["total_s"]]
        results.append(result)
        print("\n".join(result["plan"] + (result["hand_plan"] or [])), flush=True)
        with open(args.out, "w") as f:
            json.dump({"machine": "2-core CPU", "results": results}, f, indent=1)

    header = (
        "model",
        "GPUs",
        "total s",
        "runs s",
        "trace",
        "layers",
        "stage costs",
        "DP",
        "rest",
        "stages",
        "predicted s/iter",
        "limit s",
        "/limit",
        "hand s",
        "/hand",
    )
    rows = [header]
    for r in results:
        rows.append(
            (
                r["model"],
                str(r["num_gpus"]),
                f"{r['total_s']:.1f}",
                "-"
                if len(r["total_s_runs"]) < 2
                else f"{min(r['total_s_runs']):.1f}-{max(r['total_s_runs']):.1f}",
                f"{r['trace_s']:.1f}",
                f"{r['layer_clustering_s']:.2f}",
                f"{r['stage_cost_s']:.1f}",
                f"{r['dp_s']:.2f}",
                f"{r['rest_s']:.1f}",
                str(len(r["stages"])),
                f"{r['predicted_iteration_s']:.3f}" + ("" if r.get("fits", True) else " (no fit)"),
                f"{r['limit_s']:.3f}",
                f"{r['predicted_over_limit']:.2f}",
                "-"
                if r["hand_s"] is None
                else f"{r['hand_s']:.3f}" + ("" if r.get("hand_fits", True) else " (no fit)"),
                "-" if r["predicted_over_hand"] is None else f"{r['predicted_over_hand']:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
