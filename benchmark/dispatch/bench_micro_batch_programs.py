"""Step time of gradient accumulation as a program per part against one program.

Since 2026-11-27 a one-mesh step with ``num_micro_batches=k`` runs as Alpa ran it: a
program per part (``shard_parallel/lowering/compile.py``'s ``MicroBatchedProgram``: prepare, a loop
over micro-batches ``0 .. k-2``, accumulate_last, apply), 4 dispatches a step (3 with one
micro-batch). Before, it was one program
with a ``lax.scan`` over the micro-batches (still what Ray's one-mesh executable runs,
``lowering.build_step_function``). This times both, compiled from the same plan, on the
same MLP regression step (flax-free, optax adam, ``DataParallel``), interleaved, one step of
each at a time, every step waited for, and reports the median step time of each and their
ratio.

Results go to ``benchmark/dispatch/micro_batch_programs.json`` (``--out``) and a table is
printed.

Usage: python benchmark/dispatch/bench_micro_batch_programs.py [--rounds 5] [--steps 10]
       [--sizes tiny 1ms 25ms] [--micro-batches 2 8] [--out ...]
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import alpa  # noqa: E402
from alpa.shard_parallel.lowering.compile import donated_argnums, full_batch_avals  # noqa: E402
from alpa.shard_parallel.lowering.step_function import build_step_function  # noqa: E402
from alpa.testing import assert_allclose, get_mlp_train_state_and_step  # noqa: E402

# (batch, hidden, layers) of each size, as benchmark/dispatch/bench_dispatch.py names them.
SIZES = {"tiny": (64, 32, 2), "1ms": (256, 256, 4), "25ms": (1024, 1024, 6)}


def one_program(executable):
    """The step the executable's plan gives, as one jitted program with a ``lax.scan`` over
    the micro-batches (what ``compile_plan`` compiled before the program per part)."""
    traced, plan, k = executable.traced, executable.plan, executable.num_micro_batches
    mesh = plan.logical_mesh.get_jax_mesh()
    inner = build_step_function(traced, plan, mesh, k)
    in_tree, out_tree = traced.in_tree, traced.out_tree

    def step(*args):
        return jax.tree.unflatten(out_tree, inner(*jax.tree.leaves(args)))

    in_shardings = [NamedSharding(mesh, s) for s in plan.in_specs]
    out_shardings = [None if s is None else NamedSharding(mesh, s) for s in plan.out_specs]
    jitted = jax.jit(
        step,
        in_shardings=jax.tree.unflatten(in_tree, in_shardings),
        out_shardings=jax.tree.unflatten(out_tree, out_shardings),
        donate_argnums=donated_argnums(traced),
    )
    return jitted.lower(*jax.tree.unflatten(in_tree, full_batch_avals(traced, k))).compile()


def median_step_seconds(step, state, batch, rounds_steps) -> tuple[list[float], object]:
    seconds = []
    for _ in range(rounds_steps):
        begin = time.perf_counter()
        state = step(state, batch)
        jax.block_until_ready(state)
        seconds.append(time.perf_counter() - begin)
    return seconds, state


def bench(size: str, k: int, rounds: int, steps: int) -> dict:
    batch_size, hidden, layers = SIZES[size]
    state, batch, train_step = get_mlp_train_state_and_step(batch_size, hidden, layers)
    parallel = alpa.parallelize(train_step, method=alpa.DataParallel(num_micro_batches=k))
    reference = jax.jit(train_step)(state, batch)
    copy = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)
    state_a = parallel(state, batch)  # compiles; the state is donated
    executable = parallel.get_last_executable()
    single = one_program(executable)
    state_b = single(copy, batch)
    # The two layouts compute the same numbers, to the bit; against jax.jit of the full
    # batch they differ by the micro-batches' summation order (Adam's first update
    # amplifies it where a gradient is near zero), reported.
    assert_allclose(state_a.params, state_b.params, rtol=0, atol=0)
    gap = jax.tree.map(lambda x, y: float(abs(x - y).max()), state_a.params, reference.params)
    per_part, whole = [], []
    for _ in range(rounds):
        seconds, state_a = median_step_seconds(parallel, state_a, batch, steps)
        per_part += seconds
        seconds, state_b = median_step_seconds(single, state_b, batch, steps)
        whole += seconds
    a, b = statistics.median(per_part), statistics.median(whole)
    return {
        "size": size,
        "micro_batches": k,
        "programs_per_step": 4 if k > 1 else 3,  # prepare, accumulate(s), apply
        "program_per_part_ms": 1e3 * a,
        "one_program_ms": 1e3 * b,
        "ratio": a / b,
        "max_abs_diff_vs_jax_jit": max(jax.tree.leaves(gap)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "1ms", "25ms"], choices=SIZES)
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[2, 8])
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "micro_batch_programs.json")
    )
    args = parser.parse_args()
    alpa.init("local")
    devices = jax.devices()
    results = {
        "devices": f"{len(devices)} x {devices[0].device_kind}",
        "cases": [
            bench(size, k, args.rounds, args.steps)
            for size in args.sizes
            for k in args.micro_batches
        ],
    }
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"devices: {results['devices']}")
    print(f"{'size':>6} {'k':>3} {'programs':>9} {'per part ms':>12} {'one ms':>9} {'ratio':>6}")
    for c in results["cases"]:
        print(
            f"{c['size']:>6} {c['micro_batches']:>3} {c['programs_per_step']:>9} "
            f"{c['program_per_part_ms']:>12.3f} {c['one_program_ms']:>9.3f} {c['ratio']:>6.2f}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
