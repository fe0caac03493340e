"""Dispatch overhead of a parallelized step against ``jax.jit`` of the same step.

What a user runs: a flax ``TrainState`` with optax adam, an MLP regression step, steady state
after warm-up. The reference is ``jax.jit`` of the same step function (``alpa.grad`` is
``jax.grad`` plus an identity marker, so plain ``jax.jit`` runs it too). Each case times the
alpa step and its ``jax.jit`` reference in interleaved turns, one step of each at a time
(``--rounds`` x ``--steps`` steps each), every step waited for (``jax.block_until_ready``),
and reports the median step time of each and their ratio.

Cases:

* ``tiny`` / ``1ms`` / ``25ms`` MLP steps on **1 device** (``ShardParallel`` on one device vs
  plain ``jax.jit``) and on **8 devices** (``DataParallel`` vs a hand-sharded ``jax.jit``:
  parameters and optimizer state replicated, batch split on dim 0, state donated).
* a **2-stage pipeline** (``PipeshardParallel``, 1F1B, a small MLP whose step time is the
  driver's) on 4+4 devices and on 1+1 devices, with 4 and 16 micro-batches: instructions
  per step, driver time per instruction (the time a call takes to return, every
  instruction dispatched, divided by the instructions), how much of it is spent inside
  the instructions' JAX calls, what the same calls take each alone (inputs ready, devices
  idle: JAX's own cost for them), and the step time against ``DataParallel`` of the same
  step on the same devices;
* **JAX's floor**: a compiled call on meshes of 1 to 8 devices with 1 and 12 arguments,
  and a ``device_put`` between two 4-device meshes, without alpa.

Results go to ``benchmark/dispatch/results.json`` (``--out``) and a table is printed; the
table in ``docs/dispatch.md`` is this output.

Usage: python benchmark/dispatch/bench_dispatch.py [--rounds 7] [--steps 20]
       [--cases tiny 1ms 25ms pipeline] [--out benchmark/dispatch/results.json]
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import alpa  # noqa: E402
from alpa.testing import regression_train_step  # noqa: E402

# (hidden width, layers, batch) of each MLP size; on this 2-core machine the 1-device jit step
# takes about 0.05 ms, 1 ms and 25 ms.
SIZES = {"tiny": (16, 2, 8), "1ms": (128, 4, 128), "25ms": (384, 4, 512)}


class MLP(nn.Module):
    hidden: int
    layers: int
    boundary: bool = False

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            if self.boundary and i == self.layers // 2:
                alpa.mark_pipeline_boundary()
            x = nn.relu(nn.Dense(self.hidden)(x))
        return x


def make_state(hidden: int, layers: int, batch_size: int, boundary: bool = False):
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.standard_normal((batch_size, hidden), dtype=np.float32)),
        "y": jnp.asarray(rng.standard_normal((batch_size, hidden), dtype=np.float32)),
    }
    model = MLP(hidden, layers, boundary)
    params = model.init(jax.random.PRNGKey(0), batch["x"])
    # TrainState.create, as users write it: step=0 is a Python int.
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3)), batch


def copy_tree(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def timed_rounds(fns: dict, states: dict, batch, rounds: int, steps: int) -> dict:
    """Median seconds per step of each ``fns[name](state, batch) -> state``, interleaved
    step by step (one step of each in turn), so that drift of a shared machine hits all
    alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds * steps):
        for name, fn in fns.items():
            tic = time.perf_counter()
            states[name] = fn(states[name], batch)
            jax.block_until_ready(states[name])
            times[name].append(time.perf_counter() - tic)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_mlp(size: str, num_devices: int, rounds: int, steps: int) -> dict:
    hidden, layers, batch_size = SIZES[size]
    devices = jax.devices()[:num_devices]
    state, batch = make_state(hidden, layers, batch_size)
    if num_devices == 1:
        method = alpa.ShardParallel(devices=devices)
        jitted = jax.jit(regression_train_step(alpa.grad), donate_argnums=(0,))
        reference = "jax.jit"
    else:
        method = alpa.DataParallel(devices=devices)
        mesh = jax.make_mesh(
            (num_devices,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices
        )
        replicated = NamedSharding(mesh, PartitionSpec())
        rows = NamedSharding(mesh, PartitionSpec("d"))
        jitted = jax.jit(
            regression_train_step(alpa.grad),
            in_shardings=(replicated, rows),
            out_shardings=replicated,
            donate_argnums=(0,),
        )
        batch = jax.device_put(batch, rows)
        reference = "jax.jit (hand-sharded)"
    parallel = alpa.parallelize(regression_train_step(alpa.grad), method=method)
    states = {"alpa": copy_tree(state), "jit": copy_tree(state)}
    fns = {"alpa": parallel, "jit": jitted}
    for name in fns:  # warm-up: compile, and reach the steady state's input placement
        for _ in range(3):
            states[name] = fns[name](states[name], batch)
        jax.block_until_ready(states[name])
    medians = timed_rounds(fns, states, batch, rounds, steps)
    return {
        "case": f"{size} MLP, {num_devices} device{'s' if num_devices > 1 else ''}",
        "method": type(method).__name__,
        "reference": reference,
        "hidden": hidden,
        "layers": layers,
        "batch": batch_size,
        "jit_ms": medians["jit"] * 1e3,
        "alpa_ms": medians["alpa"] * 1e3,
        "ratio": medians["alpa"] / medians["jit"],
    }


def instruction_count(executable) -> int:
    return len(executable.instructions.instructions)


# Pipeline model: small enough that a step's time is the driver's (the 2-stage step of
# docs/dispatch.md's measurements), large enough to be a real MLP.
PIPELINE = (64, 4, 64)


def bench_pipeline(num_micro_batches: int, stage_devices: int, rounds: int, steps: int) -> dict:
    hidden, layers, batch_size = PIPELINE
    devices = jax.devices()[: 2 * stage_devices]
    state, batch = make_state(hidden, layers, batch_size, boundary=True)
    pipeshard = alpa.PipeshardParallel(
        devices=devices,
        num_micro_batches=num_micro_batches,
        layer_option="manual",
        stage_option=alpa.ManualStageOption(
            forward_stage_layer_ids=[[0], [1]],
            submesh_physical_shapes=[(1, stage_devices)] * 2,
        ),
        pipeline_schedule="1f1b",
        default_auto_sharding_option=alpa.AutoShardingOption(force_data_parallel=True),
    )
    fns = {
        "pipeshard": alpa.parallelize(regression_train_step(alpa.grad), method=pipeshard),
        "dp": alpa.parallelize(
            regression_train_step(alpa.grad), method=alpa.DataParallel(devices=devices)
        ),
    }
    states = {name: copy_tree(state) for name in fns}
    for name in fns:
        for _ in range(3):
            states[name] = fns[name](states[name], batch)
        jax.block_until_ready(states[name])
    medians = timed_rounds(fns, states, batch, rounds, steps)

    # Driver time: how long one call takes to return (every instruction dispatched), and
    # how much of it is spent inside the instructions (their JAX calls) rather than in the
    # loop around them.
    executable = fns["pipeshard"].get_last_executable()
    num_instructions = instruction_count(executable)
    dispatch, inside = [], []
    pipe_state = states["pipeshard"]
    for _ in range(rounds * steps):
        tic = time.perf_counter()
        pipe_state = fns["pipeshard"](pipe_state, batch)
        dispatch.append(time.perf_counter() - tic)
        inside.append(sum(e.end - e.start for e in executable.runtime.events))
        jax.block_until_ready(pipe_state)
    # JAX's own time for the same instructions: each called alone, its inputs ready and the
    # devices idle (``collect_trace`` waits for every instruction before the next), timed
    # until its call returns.
    alone = []
    executable.collect_trace = True
    for _ in range(rounds * steps):
        pipe_state = fns["pipeshard"](pipe_state, batch)
        alone.append(sum(e.returned - e.start for e in executable.runtime.events))
    executable.collect_trace = False
    jax.block_until_ready(pipe_state)
    dispatch_s, inside_s = statistics.median(dispatch), statistics.median(inside)
    alone_s = statistics.median(alone)
    return {
        "case": f"2-stage pipeline ({stage_devices}+{stage_devices} dev), "
        f"{num_micro_batches} micro-batches",
        "method": f"PipeshardParallel (1f1b, 2 x {stage_devices} devices)",
        "reference": f"DataParallel ({2 * stage_devices} devices)",
        "hidden": hidden,
        "layers": layers,
        "batch": batch_size,
        "stage_devices": stage_devices,
        "instructions_per_step": num_instructions,
        "driver_us_per_instruction": dispatch_s / num_instructions * 1e6,
        "in_instructions_us_per_instruction": inside_s / num_instructions * 1e6,
        "alone_us_per_instruction": alone_s / num_instructions * 1e6,
        "outside_instructions_us_per_step": (dispatch_s - inside_s) * 1e6,
        "dispatch_ms": dispatch_s * 1e3,
        "pipeshard_ms": medians["pipeshard"] * 1e3,
        "dp_ms": medians["dp"] * 1e3,
        "ratio_vs_dp": medians["pipeshard"] / medians["dp"],
    }


def _call_us(fn, repeats: int) -> float:
    """Median microseconds until ``fn()`` returns, each call waited for before the next."""
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - tic)
        jax.block_until_ready(out)
    return statistics.median(times) * 1e6


def bench_jax_floor(repeats: int = 200) -> dict:
    """JAX's own cost, no alpa: a compiled ``a + 1`` on [8, 64] float32 per argument, on a
    mesh of 1, 2, 4 and 8 devices with 1 and 12 arguments; and a ``jax.device_put`` of its
    result from one 4-device mesh to another (same layout). Each call is waited for before
    the next and timed until it returns."""

    def mesh(devices):
        return jax.make_mesh(
            (1, len(devices)),
            ("x", "y"),
            axis_types=(jax.sharding.AxisType.Auto,) * 2,
            devices=devices,
        )

    row: dict = {"case": "jax floor (no alpa)"}
    for n in (1, 2, 4, 8):
        sharding = NamedSharding(mesh(jax.devices()[:n]), PartitionSpec(None, "y"))
        for num_args in (1, 12):
            xs = [jax.device_put(jnp.ones((8, 64)), sharding) for _ in range(num_args)]
            program = (
                jax.jit(lambda *a: [v + 1 for v in a], out_shardings=[sharding] * num_args)
                .lower(*xs)
                .compile()
            )
            row[f"run_{n}_devices_{num_args}_args_us"] = _call_us(
                lambda p=program, a=xs: p(*a), repeats
            )
    src, dst = (
        NamedSharding(mesh(jax.devices()[4 * i : 4 * i + 4]), PartitionSpec(None, "y"))
        for i in range(2)
    )
    x = jax.device_put(jnp.ones((8, 64)), src)
    row["device_put_4_to_4_devices_us"] = _call_us(lambda: jax.device_put(x, dst), repeats)
    return row


def print_table(rows: list[dict]) -> None:
    print(f"{'case':<52} {'reference':<24} {'ref ms':>8} {'alpa ms':>8} {'ratio':>6}")
    for r in rows:
        if "jit_ms" in r:
            print(
                f"{r['case']:<52} {r['reference']:<24} {r['jit_ms']:8.3f} {r['alpa_ms']:8.3f} "
                f"{r['ratio']:6.2f}"
            )
        elif "dp_ms" in r:
            print(
                f"{r['case']:<52} {r['reference']:<24} {r['dp_ms']:8.3f} "
                f"{r['pipeshard_ms']:8.3f} {r['ratio_vs_dp']:6.2f}"
            )
    for r in rows:
        if "instructions_per_step" in r:
            print(
                f"{r['case']}: {r['instructions_per_step']} instructions per step; driver "
                f"{r['driver_us_per_instruction']:.0f} us per instruction "
                f"({r['in_instructions_us_per_instruction']:.0f} us inside its JAX calls; "
                f"the same calls alone, devices idle: "
                f"{r['alone_us_per_instruction']:.0f} us); "
                f"{r['outside_instructions_us_per_step']:.0f} us per step outside them"
            )
        elif "device_put_4_to_4_devices_us" in r:
            calls = ", ".join(
                f"{n} dev {r[f'run_{n}_devices_1_args_us']:.0f} / "
                f"{r[f'run_{n}_devices_12_args_us']:.0f}"
                for n in (1, 2, 4, 8)
            )
            print(
                f"{r['case']}: a compiled call with 1 / 12 arguments (us): {calls}; "
                f"device_put between 4-device meshes {r['device_put_4_to_4_devices_us']:.0f} us"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--cases", nargs="+", default=["tiny", "1ms", "25ms", "pipeline"], help="cases to run"
    )
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results.json"))
    args = parser.parse_args()
    alpa.init("local")
    rows = []
    for size in ("tiny", "1ms", "25ms"):
        if size not in args.cases:
            continue
        # Few steps for the 25 ms case: it is the step, not the dispatch, that is timed.
        steps = args.steps if size != "25ms" else max(3, args.steps // 5)
        for num_devices in (1, 8):
            rows.append(bench_mlp(size, num_devices, args.rounds, steps))
            print(rows[-1], flush=True)
    if "pipeline" in args.cases:
        for stage_devices in (4, 1):
            for k in (4, 16):
                rows.append(bench_pipeline(k, stage_devices, args.rounds, args.steps))
                print(rows[-1], flush=True)
        rows.append(bench_jax_floor())
        print(rows[-1], flush=True)
    print_table(rows)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}",
        "devices": f"{len(jax.devices())} x {jax.devices()[0].platform}",
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
