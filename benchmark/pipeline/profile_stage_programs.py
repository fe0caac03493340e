"""Where a pipelined step's device time goes, program by program, next to ``jax.jit``'s.

The GPU run of ``bench_step_vs_prediction.py`` found the two stage programs of a GPT slower
per FLOP than the same step under ``jax.jit`` (same FLOPs, within 1 %). This script runs
that configuration (two stages, both on the one device when there is one) under
``jax.profiler`` and reads the trace back (``jax.profiler.ProfileData``): the device time
of every kernel, summed per XLA module (each stage's forward/backward program, its
apply-grad, the ``jax.jit`` step) and per operation. Besides the whole-batch ``jax.jit``
step it runs ``jax.jit`` on one micro-batch (``batch / micro_batches`` rows), the size a
stage program works on, so that the two effects separate: what the smaller batch costs
XLA, and what the stage programs cost beyond it.

    python benchmark/pipeline/profile_stage_programs.py            # GPT-350M shape, fp16
    python benchmark/pipeline/profile_stage_programs.py --tiny     # a quick run on CPU

Writes ``--out`` (JSON) and prints a summary.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import importlib.util
import json
import os
import tempfile
import time
import warnings

import jax

import alpa

HERE = os.path.dirname(os.path.abspath(__file__))


@functools.cache
def _bench_module():
    """``bench_step_vs_prediction.py`` (its setup and arguments), loaded once."""
    spec = importlib.util.spec_from_file_location(
        "bench_step_vs_prediction", os.path.join(HERE, "bench_step_vs_prediction.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def device_time_by_module(path: str) -> dict:
    """Kernel time in an ``.xplane.pb`` trace, by XLA module: ``{module: {"ms": total,
    "kernels": count, "ops": {hlo_op: ms}}}``. Device planes (``/device:...``) where the
    trace has them, else the host's XLA threads (CPU)."""
    data = jax.profiler.ProfileData.from_file(path)
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    if not planes:
        planes = [p for p in data.planes if p.name.startswith("/host:CPU")]
    out: dict = collections.defaultdict(
        lambda: {"ms": 0.0, "kernels": 0, "ops": collections.Counter()}
    )
    with warnings.catch_warnings():  # jaxlib 0.11's event stats warn when read
        warnings.filterwarnings("ignore", "builtin type event_stats", DeprecationWarning)
        for plane in planes:
            _add_events(plane, out)
    return out


def _add_events(plane, out: dict) -> None:
    for line in plane.lines:
        for event in line.events:
            stats = dict(event.stats)
            module = stats.get("hlo_module")
            if module is None:
                continue
            ms = event.duration_ns / 1e6
            entry = out[module]
            entry["ms"] += ms
            entry["kernels"] += 1
            entry["ops"][stats.get("hlo_op", event.name)] += ms


def _profiled(fn, steps: int) -> tuple[dict, float]:
    """``fn()`` run ``steps`` times under the profiler: kernel time per module per step,
    and the wall seconds per step."""
    with tempfile.TemporaryDirectory() as trace_dir:
        start = time.perf_counter()
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                jax.block_until_ready(fn())
        wall = (time.perf_counter() - start) / steps
        (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        modules = device_time_by_module(path)
    result = {}
    for name, entry in modules.items():
        top = entry["ops"].most_common(8)
        result[name] = {
            "ms_per_step": entry["ms"] / steps,
            "kernels_per_step": entry["kernels"] / steps,
            "top_ops_ms_per_step": {op: ms / steps for op, ms in top},
        }
    return result, wall


def run(args) -> dict:
    _, state, batch, step, method = _bench_module().two_stage_gpt(args)
    devices = jax.devices()
    parallel = alpa.parallelize(step, method=method, donate_argnums=())
    jitted = jax.jit(step)
    micro = args.batch // args.micro_batches
    micro_batch = jax.tree.map(lambda x: x[:micro], batch)
    runs = {
        "pipelined": lambda: parallel(state, batch),
        "jit_whole_batch": lambda: jitted(state, batch),
        "jit_one_micro_batch": lambda: jitted(state, micro_batch),
    }
    result = {
        "device": str(devices[0].device_kind),
        "jax": jax.__version__,
        "batch": args.batch,
        "micro_batches": args.micro_batches,
        "blocks": args.blocks,
        "runs": {},
    }
    for name, fn in runs.items():
        for _ in range(args.warmup):
            jax.block_until_ready(fn())
        modules, wall = _profiled(fn, args.steps)
        result["runs"][name] = {
            "wall_ms_per_step": wall * 1e3,
            "device_ms_per_step": sum(m["ms_per_step"] for m in modules.values()),
            "modules": modules,
        }
    return result


def summary(result: dict) -> str:
    lines = [
        f"{result['device']} (jax {result['jax']}), batch {result['batch']}, "
        f"{result['micro_batches']} micro-batches, {result['blocks']} blocks"
    ]
    for name, run_ in result["runs"].items():
        lines.append(
            f"{name}: wall {run_['wall_ms_per_step']:.2f} ms/step, kernels "
            f"{run_['device_ms_per_step']:.2f} ms/step"
        )
        ranked = sorted(run_["modules"].items(), key=lambda kv: -kv[1]["ms_per_step"])
        for module, entry in ranked[:6]:
            top = ", ".join(
                f"{op} {ms:.2f}" for op, ms in list(entry["top_ops_ms_per_step"].items())[:3]
            )
            lines.append(
                f"    {module}: {entry['ms_per_step']:.2f} ms, "
                f"{entry['kernels_per_step']:.0f} kernels ({top})"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _bench_module().add_arguments(parser, steps=3)
    parser.add_argument("--out", default=os.path.join(HERE, "stage_programs_profile.json"))
    args = parser.parse_args()
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(summary(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
