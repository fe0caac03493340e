"""A scanned GPT pipelined in two stages: compile time and step time against its depth.

The GPT's blocks are one ``nn.scan`` (with ``nn.remat``); ``AutoLayerOption(2)`` cuts it
into two layers of half the blocks each, one stage per layer (``ManualStageOption``), each
stage on one device: two devices when there are two, else the one device listed twice
(both stages on one accelerator, as ``bench_step_vs_prediction.py`` runs them). Since
``pipeline_parallel.layer_scans`` each stage program runs its blocks as one scan, so its
compile time should not grow with the depth; before, the stage programs held every
iteration written out. For each ``--blocks`` this records:

* ``compile_s``: ``parallelize(...).get_executable(state, batch)``: trace, layers, stage
  plans, XLA compilation of every stage program;
* ``stage_eqns`` / ``stage_scans``: the equations of the stage programs and how many of
  them are scans;
* ``step_ms``: the median of ``--steps`` timed steps after ``--warmup`` (each waited for);
* ``loss_rel_err``: the first step's loss against ``jax.jit``'s of the same step.

Run it with an older alpa on ``PYTHONPATH`` (and ``--label``) to compare: it uses only
the public API. ``--jit`` times ``jax.jit`` of the same step on one device instead, the
blocks as a scan and written out: what XLA itself makes of the loop.

Usage: python benchmark/pipeline/bench_scanned_stages.py [--blocks 4 16] [--tiny]
       [--batch 16] [--micro-batches 4] [--label scan] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
from bench_step_vs_prediction import time_steps  # this folder is the script's sys.path[0]

import alpa
from alpa.model.gpt import GPT_PRESETS, GPTConfig, get_gpt_train_state_and_step


def _config(tiny: bool, blocks: int) -> GPTConfig:
    if tiny:
        base = GPTConfig(seq_len=64, vocab_size=512, hidden_size=128, num_layers=4, num_heads=4)
    else:  # GPT-350M's shape in fp16
        base = dataclasses.replace(GPT_PRESETS["350M"], dtype=jnp.float16)
    return dataclasses.replace(base, num_layers=blocks, scan_layers=True, remat_layers=True)


def run(args, blocks: int) -> dict:
    config = _config(args.tiny, blocks)
    state, batch, step = get_gpt_train_state_and_step(
        config, args.batch, grad_func=alpa.value_and_grad
    )
    jax.block_until_ready((state, batch))
    devices = jax.devices()
    stage_devices = [devices[0], devices[0]] if len(devices) < 2 else devices[:2]
    method = alpa.PipeshardParallel(
        devices=stage_devices,
        num_micro_batches=args.micro_batches,
        layer_option=alpa.AutoLayerOption(2),
        stage_option=alpa.ManualStageOption([[0], [1]], [(1, 1), (1, 1)]),
    )
    start = time.perf_counter()
    parallel = alpa.parallelize(step, method=method, donate_argnums=())
    executable = parallel.get_executable(state, batch)
    compile_s = time.perf_counter() - start
    comps = executable.program.computations
    _, expected_loss = jax.jit(step)(state, batch)
    new_state, loss = parallel(state, batch)
    loss_rel_err = abs(float(loss) - float(expected_loss)) / abs(float(expected_loss))
    seconds, _ = time_steps(parallel, new_state, batch, args)
    return {
        "label": args.label,
        "blocks": blocks,
        "device": str(devices[0].device_kind),
        "stage_devices": len(set(stage_devices)),
        "batch": args.batch,
        "micro_batches": args.micro_batches,
        "compile_s": compile_s,
        "stage_eqns": sum(len(c.eqns) for c in comps),
        "stage_scans": sum(e.primitive.name == "scan" for c in comps for e in c.eqns),
        "step_ms": 1e3 * statistics.median(seconds),
        "step_ms_runs": [1e3 * s for s in seconds],
        "loss_rel_err": loss_rel_err,
    }


def run_jit(args, blocks: int) -> list[dict]:
    """The same GPT's step under ``jax.jit`` on one device, its blocks as one scan and
    written out: how XLA itself compiles and runs the loop against the unrolled blocks
    (``--jit``; no alpa involved)."""
    rows = []
    for scanned in (True, False):
        config = dataclasses.replace(_config(args.tiny, blocks), scan_layers=scanned)
        state, batch, step = get_gpt_train_state_and_step(config, args.batch)
        jax.block_until_ready((state, batch))
        start = time.perf_counter()
        compiled = jax.jit(step).lower(state, batch).compile()
        compile_s = time.perf_counter() - start
        seconds, _ = time_steps(compiled, state, batch, args)
        rows.append(
            {
                "label": "jax.jit, " + ("scan" if scanned else "written out"),
                "blocks": blocks,
                "device": str(jax.devices()[0].device_kind),
                "batch": args.batch,
                "compile_s": compile_s,
                "step_ms": 1e3 * statistics.median(seconds),
                "step_ms_runs": [1e3 * s for s in seconds],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--tiny", action="store_true", help="a small GPT (for CPU)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--label", default="scan")
    parser.add_argument(
        "--jit",
        action="store_true",
        help="time jax.jit of the scanned and the written-out model instead (one device)",
    )
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--out", default=os.path.join(here, "scanned_stages.json"))
    args = parser.parse_args()

    results = []
    if args.jit:
        for blocks in args.blocks:
            for row in run_jit(args, blocks):
                results.append(row)
                print(
                    f"{row['label']:>22} {blocks:3d} blocks on {row['device']}: compile "
                    f"{row['compile_s']:6.2f} s, step {row['step_ms']:.1f} ms",
                    flush=True,
                )
        with open(args.out, "w") as f:
            json.dump({"results": results}, f, indent=1)
        print(f"wrote {args.out}")
        return
    for blocks in args.blocks:
        row = run(args, blocks)
        results.append(row)
        print(
            f"{args.label:>12} {blocks:3d} blocks on {row['device']}: compile "
            f"{row['compile_s']:6.2f} s, {row['stage_eqns']} equations in the stage programs "
            f"({row['stage_scans']} scans), step {row['step_ms']:.1f} ms, loss rel. err. "
            f"{row['loss_rel_err']:.1e}",
            flush=True,
        )
    lo, hi = results[0], results[-1]
    ratio = hi["compile_s"] / lo["compile_s"]
    print(f"{args.label}: compile time at {hi['blocks']} blocks / at {lo['blocks']} = {ratio:.2f}x")
    with open(args.out, "w") as f:
        json.dump({"results": results, "compile_depth_ratio": ratio}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
