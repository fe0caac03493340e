"""A pipelined GPT step, measured, against what the stage cost model predicts for it.

Two stages (the GPT's blocks split in halves by its pipeline markers), each on one device:
two devices when there are two, else the one device listed twice
(``PipeshardParallel(devices=[d, d])``: both stages on one accelerator, one after the
other). It runs ``--warmup`` steps, then times ``--steps`` steps (each to
``block_until_ready``) and reports the median, next to:

* ``plan.cost.step_seconds``: the model's ``sum + (B - 1) * max`` of the stage
  latencies, which assumes each stage has its device to itself;
* where both stages share one device, ``B * sum`` of the latencies: the stages cannot
  overlap there, so this is the model's figure for that run;
* the same step under ``jax.jit`` on one device and the whole batch (no pipeline): what
  XLA makes of the model's FLOPs, against the peak rate the model prices them at; and
  XLA's cost analysis of both (FLOPs and bytes accessed of one step, pipelined with each
  program counted as often as it runs, ``get_kernel_costs``, and under ``jax.jit``);
* one step with every instruction waited for (``collect_trace``): per stage, its forward
  and backward time per micro-batch next to its predicted latency, its apply-grad and
  its transfers (``last_step_blocks``);
* per stage, the predicted memory per device (``plan.cost.memory``, and its state and
  per-micro-batch terms), XLA's figure for the same (``get_step_memory_per_mesh``, and
  per program, ``get_kernel_memory``) and the allocator's peak where the platform keeps
  one (GPU).

The cluster the model prices is this machine's (``ClusterSpec.local()``: on a GPU the
preset of its kind, on CPU the virtual-device figures), so on CPU the seconds mean little;
the script is written for a GPU and runs anywhere. Results go to ``--out`` (JSON) and a
summary is printed.

    python benchmark/pipeline/bench_step_vs_prediction.py            # GPT-350M shape, 4 blocks
    python benchmark/pipeline/bench_step_vs_prediction.py --tiny     # a quick run on CPU
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

import alpa
from alpa.model.gpt import GPT_PRESETS, GPTConfig, get_gpt_train_state_and_step
from alpa.pipeline_parallel.stages.stage_construction import ManualStageOption
from alpa.runtime.memory import device_peak_bytes

HERE = os.path.dirname(os.path.abspath(__file__))


def _config(tiny: bool, blocks: int) -> GPTConfig:
    if tiny:
        return GPTConfig(
            seq_len=64, vocab_size=512, hidden_size=128, num_layers=blocks, num_heads=4
        )
    return dataclasses.replace(GPT_PRESETS["350M"], num_layers=blocks, dtype=jnp.float16)


def two_stage_gpt(args):
    """``(config, state, batch, step, method)``: the GPT of ``args``, its blocks in two
    halves, one stage on each of two devices, or both on the one device there is."""
    config = dataclasses.replace(_config(args.tiny, args.blocks), add_manual_pipeline_markers=True)
    state, batch, step = get_gpt_train_state_and_step(
        config, args.batch, grad_func=alpa.value_and_grad
    )
    devices = jax.devices()
    stage_devices = [devices[0], devices[0]] if len(devices) < 2 else devices[:2]
    half = args.blocks // 2
    method = alpa.PipeshardParallel(
        devices=stage_devices,
        num_micro_batches=args.micro_batches,
        stage_option=ManualStageOption(
            [list(range(half)), list(range(half, args.blocks))], [(1, 1), (1, 1)]
        ),
    )
    return config, state, batch, step, method


def add_arguments(parser: argparse.ArgumentParser, steps: int) -> None:
    """The model and run arguments both GPU scripts take."""
    parser.add_argument("--tiny", action="store_true", help="a small GPT (for CPU)")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=steps)


def time_steps(step, state, batch, args) -> tuple[list[float], object]:
    """Seconds of ``args.steps`` steps (each waited for) after ``args.warmup``, and the
    state they leave."""
    for _ in range(args.warmup):
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    seconds = []
    for _ in range(args.steps):
        begin = time.perf_counter()
        state, loss = step(state, batch)
        jax.block_until_ready((state, loss))
        seconds.append(time.perf_counter() - begin)
    return seconds, state


def run(args) -> dict:
    config, state, batch, step, method = two_stage_gpt(args)
    devices = jax.devices()
    shared = len(devices) < 2
    parallel = alpa.parallelize(step, method=method)
    seconds, state = time_steps(parallel, state, batch, args)
    executable = parallel.get_last_executable()
    cost = executable.plan.cost
    k = args.micro_batches
    # One more step with every instruction waited for: the device time of each stage's
    # forward and backward programs, next to the latency the model gives the stage.
    executable.collect_trace = True
    state, loss = parallel(state, batch)
    jax.block_until_ready((state, loss))
    blocks = executable.last_step_blocks()
    traced_s = sum(b.end - b.start for b in blocks)
    per_stage = [
        {
            kind: sum(b.end - b.start for b in blocks if b.stage == s and b.kind == kind)
            for kind in ("forward", "backward", "apply", "transfer")
        }
        for s in range(len(cost.latencies))
    ]
    executable.collect_trace = False
    # Read before the jax.jit baseline below, whose buffers the allocator would count.
    allocator_peak = device_peak_bytes(devices[:1] if shared else devices[:2])
    # The same step under jax.jit on one device, whole batch: what XLA makes of the model
    # without a pipeline, the yardstick for the model's compute rate.
    serial = jax.jit(step).lower(state, batch).compile()  # compiled once: run and costed
    jax.block_until_ready(serial(state, batch))  # run once, not timed
    serial_cost = serial.cost_analysis()
    kernel_costs = executable.get_kernel_costs()
    serial_seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        jax.block_until_ready(serial(state, batch))
        serial_seconds.append(time.perf_counter() - start)
    return {
        "device": f"{devices[0].platform} {devices[0].device_kind}",
        "stages_share_one_device": shared,
        "config": {
            "hidden": config.hidden_size,
            "blocks": config.num_layers,
            "seq_len": config.seq_len,
            "vocab": config.vocab_size,
            "dtype": str(jnp.dtype(config.dtype)),
            "batch": args.batch,
            "micro_batches": k,
        },
        "cluster": executable.plan.cluster.name,
        "measured_s": statistics.median(seconds),
        "measured_runs_s": seconds,
        "predicted_s": cost.step_seconds,
        "predicted_one_device_s": k * sum(cost.latencies),
        "stage_latencies_s": list(cost.latencies),
        "traced_step_s": traced_s,
        "traced_per_stage_s": per_stage,
        "serial_jit_s": statistics.median(serial_seconds),
        # XLA's cost analysis: the step's FLOPs and bytes accessed, pipelined (each program
        # as often as it runs) and under jax.jit; per program in xla_kernel_costs.
        "xla_step_flops": sum(r["runs"] * r["flops"] for r in kernel_costs),
        "xla_step_bytes_accessed": sum(r["runs"] * r["bytes_accessed"] for r in kernel_costs),
        "serial_flops": float(serial_cost.get("flops", 0.0)),
        "serial_bytes_accessed": float(serial_cost.get("bytes accessed", 0.0)),
        "xla_kernel_costs": kernel_costs,
        "predicted_memory": list(cost.memory),
        "xla_memory": executable.get_step_memory_per_mesh(),
        # The prediction's terms (state; activations per micro-batch in flight; the rest,
        # held once: temporaries and the cotangent sent back) and XLA's per program.
        "predicted_state_memory": list(cost.state_memory),
        "predicted_activation_memory": list(cost.activation_memory),
        "xla_kernel_memory": executable.get_kernel_memory(),
        "allocator_peak": allocator_peak,
        "loss": float(loss),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser, steps=5)
    parser.add_argument("--out", default=os.path.join(HERE, "step_vs_prediction.json"))
    args = parser.parse_args()
    alpa.util.disable_tqdm_globally()
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    shared = result["stages_share_one_device"]
    k = result["config"]["micro_batches"]
    model = result["predicted_one_device_s"] if shared else result["predicted_s"]
    print(
        f"{result['device']}, 2 stages{' on one device' if shared else ''}, "
        f"{result['config']['micro_batches']} micro-batches, cluster {result['cluster']}"
    )
    print(
        f"measured {result['measured_s'] * 1e3:.2f} ms/step (median of {args.steps}); "
        f"predicted {model * 1e3:.2f} ms ({'B x sum' if shared else 'sum + (B-1) max'}); "
        f"measured / predicted {result['measured_s'] / model:.2f}"
    )
    print(
        f"jax.jit of the same step (whole batch, one device): {result['serial_jit_s'] * 1e3:.2f} "
        f"ms; one step with each instruction waited for: {result['traced_step_s'] * 1e3:.2f} ms"
    )
    print(
        f"XLA's cost analysis, pipelined / jax.jit: FLOPs "
        f"{result['xla_step_flops'] / result['serial_flops']:.3f}, bytes accessed "
        f"{result['xla_step_bytes_accessed'] / result['serial_bytes_accessed']:.2f}"
    )
    for s, (p, x) in enumerate(zip(result["predicted_memory"], result["xla_memory"], strict=True)):
        t = result["traced_per_stage_s"][s]
        run_ms = (t["forward"] + t["backward"]) / k * 1e3
        predicted_ms = result["stage_latencies_s"][s] * 1e3
        print(
            f"stage {s}: per micro-batch forward + backward {run_ms:.2f} ms run, "
            f"{predicted_ms:.2f} ms predicted; apply "
            f"{t['apply'] * 1e3:.2f} ms, transfers {t['transfer'] * 1e3:.2f} ms; "
            f"memory predicted {p / 2**20:.1f} MiB, XLA {x / 2**20:.1f} MiB"
        )
    if result["allocator_peak"] is not None:
        print(f"allocator peak {result['allocator_peak'] / 2**20:.1f} MiB")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
