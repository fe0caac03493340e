"""Compile time of a GPT whose blocks are one ``nn.scan``, against its depth (issue 30).

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

Usage: python benchmark/auto_sharding/bench_scan_compile.py [--layers 4 24] [--repeat 3]
       [--hidden 256] [--out benchmark/auto_sharding/scan_compile.json]
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
config = GPTConfig(hidden_size=hidden, num_layers=layers, num_heads=4, seq_len=32,
                   vocab_size=1024, scan_layers=scanned, remat_layers=True)
state, batch, step = get_gpt_train_state_and_step(config, 2)
jax.block_until_ready((state, batch))  # initialization runs asynchronously: not timed
start = time.perf_counter()
p_step = alpa.parallelize(step, method=alpa.ShardParallel(), donate_argnums=())
executable = p_step.get_executable(state, batch)
seconds = time.perf_counter() - start
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


def run_one(layers: int, hidden: int, scanned: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(layers), str(hidden), "1" if scanned else "0"],
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
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--out", default=os.path.join(here, "scan_compile.json"))
    args = parser.parse_args()

    results = []
    for scanned in (True, False):
        for layers in args.layers:
            runs = [run_one(layers, args.hidden, scanned) for _ in range(args.repeat)]
            row = {
                "model": "scan" if scanned else "unrolled",
                "layers": layers,
                "hidden": args.hidden,
                "compile_s": statistics.median(r["compile_s"] for r in runs),
                "compile_s_runs": [r["compile_s"] for r in runs],
                "block_sharded": runs[0]["block_sharded"],
                "bytes_per_device": runs[0]["bytes_per_device"],
            }
            results.append(row)
            print(
                f"{row['model']:>8} {layers:3d} blocks: compile {row['compile_s']:6.2f} s "
                f"(runs {', '.join(f'{s:.2f}' for s in row['compile_s_runs'])}), "
                f"block elements sharded {row['block_sharded']:.3f}, "
                f"{row['bytes_per_device'] / 1e6:.1f} MB per device",
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
