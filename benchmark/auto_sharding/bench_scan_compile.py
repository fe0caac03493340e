"""Compile time of a GPT whose blocks are one ``nn.scan``, against its depth.

Scanning the layers is how large JAX models are written because the program does not
grow with the depth: XLA compiles one loop body. Alpa plans the scan's body once
(docs/auto_sharding.md, "Scanned layers are planned"), so the whole compile, from the
trace through the ILP to XLA's executable, should barely grow with the depth either. For
each depth (4 and 24 blocks by default) and both ways of writing the model (``nn.scan``
with ``nn.remat`` blocks, and the same blocks unrolled), this compiles the Adam train step
under ``ShardParallel()`` on 1 x 8 virtual CPU devices and reports:

* ``compile_s``: ``parallelize(...).get_executable(state, batch)`` (trace, strategy graph,
  ILP, lowering and XLA compilation), the median of ``--repeat`` fresh compiles;
* ``block_sharded``: the fraction of the blocks' parameter elements the plan shards;
* ``bytes_per_device``: XLA's memory analysis of the program (arguments, outputs, temps).

Each compile is run in a fresh Python process, so that no cache of an earlier compile
(jax's tracing caches, the strategy graph's rule caches) makes a later one look faster,
after the model's random initialization has finished (jax dispatches it asynchronously:
on 2 cores it would otherwise run during the compile and inflate the deeper model's time).

With ``--method pipeshard`` the same models are compiled as a pipeline
(``PipeshardParallel``, ``AutoLayerOption(2)``, two (1, 4) stages, 2 micro-batches),
whose stage programs keep one scan per layer (``pipeline_parallel.layer_scans``); it
reports the compile time and the equations and scans in the stage programs.

Usage: python benchmark/auto_sharding/bench_scan_compile.py [--layers 4 24] [--repeat 3]
       [--hidden 256] [--method shard|pipeshard] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import os, sys, time, json
os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=8"
import jax, numpy as np
import alpa
from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step
layers, hidden, scanned = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
pipeline = sys.argv[4] == "pipeshard"
config = GPTConfig(hidden_size=hidden, num_layers=layers, num_heads=4, seq_len=32,
                   vocab_size=1024, scan_layers=scanned, remat_layers=True)
if pipeline:  # alpa.value_and_grad: the pipeline's layers are cut in the loss function
    state, batch, step = get_gpt_train_state_and_step(config, 8, grad_func=alpa.value_and_grad)
else:
    state, batch, step = get_gpt_train_state_and_step(config, 2)
jax.block_until_ready((state, batch))  # initialization runs asynchronously: not timed
if pipeline:
    stages = alpa.ManualStageOption([[0], [1]], [(1, 4)] * 2, [(1, 4)] * 2, [{}, {}])
    method = alpa.PipeshardParallel(num_micro_batches=2, layer_option=alpa.AutoLayerOption(2),
                                    stage_option=stages)
else:
    method = alpa.ShardParallel()
start = time.perf_counter()
p_step = alpa.parallelize(step, method=method, donate_argnums=())
executable = p_step.get_executable(state, batch)
seconds = time.perf_counter() - start
if pipeline:
    comps = executable.program.computations
    print(json.dumps({"compile_s": seconds,
                      "stage_eqns": sum(len(c.eqns) for c in comps),
                      "stage_scans": sum(e.primitive.name == "scan" for c in comps
                                         for e in c.eqns)}))
    sys.exit(0)
total = sharded = 0
specs = executable.get_input_placement_specs()[0].params
for path, spec in jax.tree_util.tree_leaves_with_path(specs):
    if "block" in jax.tree_util.keystr(path):
        size = int(np.prod(spec.aval.shape))
        total += size
        sharded += size * any(a is not None for a in spec.sharding_specs[0])
print(json.dumps({"compile_s": seconds, "block_sharded": sharded / total,
                  "bytes_per_device": executable.get_total_allocation_size()}))
"""


def run_one(layers: int, hidden: int, scanned: bool, method: str = "shard") -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(layers), str(hidden), "1" if scanned else "0", method],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 24])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--method",
        choices=("shard", "pipeshard"),
        default="shard",
        help="ShardParallel() on 1 x 8 devices, or PipeshardParallel with AutoLayerOption(2) "
        "on two (1, 4) stages (batch 8 in 2 micro-batches)",
    )
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--out", default=None, help="default: scan_compile[_pipeshard].json")
    args = parser.parse_args()
    suffix = "" if args.method == "shard" else "_pipeshard"
    args.out = args.out or os.path.join(here, f"scan_compile{suffix}.json")

    results = []
    for scanned in (True, False):
        for layers in args.layers:
            runs = [run_one(layers, args.hidden, scanned, args.method) for _ in range(args.repeat)]
            row = {
                "model": "scan" if scanned else "unrolled",
                "method": args.method,
                "layers": layers,
                "hidden": args.hidden,
                "compile_s": statistics.median(r["compile_s"] for r in runs),
                "compile_s_runs": [r["compile_s"] for r in runs],
                **{k: v for k, v in runs[0].items() if k != "compile_s"},
            }
            results.append(row)
            if args.method == "pipeshard":
                what = (
                    f"{row['stage_eqns']} equations in the stage programs, "
                    f"{row['stage_scans']} of them scans"
                )
            else:
                what = (
                    f"block elements sharded {row['block_sharded']:.3f}, "
                    f"{row['bytes_per_device'] / 1e6:.1f} MB per device"
                )
            print(
                f"{row['model']:>8} {layers:3d} blocks: compile {row['compile_s']:6.2f} s "
                f"(runs {', '.join(f'{s:.2f}' for s in row['compile_s_runs'])}), {what}",
                flush=True,
            )
    summary = {}
    for model in ("scan", "unrolled"):
        times = {r["layers"]: r["compile_s"] for r in results if r["model"] == model}
        lo, hi = min(times), max(times)
        summary[model] = times[hi] / times[lo]
        print(f"{model}: compile time at {hi} blocks / at {lo} blocks = {summary[model]:.2f}x")
    with open(args.out, "w") as f:
        json.dump({"results": results, "depth_ratio": summary}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
