"""Reproduce XLA's CPU abort "Termination timeout for all reduce RendezvousKey ... exceeded"
with plain ``jax.jit`` (no alpa), and show what avoids it (docs/dispatch.md, known issues).

Each variant runs in a child process on 8 virtual CPU devices: a data-parallel MLP step
(hand-sharded ``jax.jit``, one gradient all-reduce per step) called ``--steps`` times.

* ``back_to_back``: every step dispatched without waiting for the previous one;
* ``synced``: ``jax.block_until_ready`` after every step;
* ``bounded``: wait for the step two calls back (at most two steps in flight).

A child that does not finish within ``--timeout`` seconds is killed. Writes
``benchmark/dispatch/rendezvous.json`` and prints one line per variant: exit code (-6 is
SIGABRT, XLA's abort), seconds, and the rendezvous line of the child's log if any.

Usage: python benchmark/dispatch/repro_cpu_rendezvous_abort.py [--steps 200] [--timeout 150]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, AxisType

mode, steps, hidden, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))

def step(w, x):
    loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    return w - 0.01 * g, loss  # w is donated to the next step; the loss is not

f = jax.jit(step, in_shardings=(rep, rows), out_shardings=(rep, rep), donate_argnums=0)
w = jax.device_put(jnp.ones((hidden, hidden)) / hidden, rep)
x = jax.device_put(jnp.ones((batch, hidden)), rows)
w, loss = f(w, x)
loss.block_until_ready()
losses = []
for i in range(steps):
    w, loss = f(w, x)
    if mode == "synced":
        loss.block_until_ready()
    elif mode == "bounded":
        losses.append(loss)
        if len(losses) > 2:
            losses.pop(0).block_until_ready()
w.block_until_ready()
print("finished", steps, "steps")
"""


def run(mode: str, steps: int, hidden: int, batch: int, timeout: float) -> dict:
    tic = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, mode, str(steps), str(hidden), str(batch)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        code, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, log = "timeout", (e.stdout or b"").decode() + (e.stderr or b"").decode()
    lines = [line for line in log.splitlines() if "Termination timeout" in line]
    return {
        "mode": mode,
        "steps": steps,
        "hidden": hidden,
        "batch": batch,
        "exit_code": code,
        "seconds": round(time.perf_counter() - tic, 1),
        "rendezvous_abort": bool(lines),
        "log_line": lines[0][:240] if lines else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=150.0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "rendezvous.json"))
    args = parser.parse_args()
    rows = []
    for mode in ("back_to_back", "synced", "bounded"):
        rows.append(run(mode, args.steps, args.hidden, args.batch, args.timeout))
        r = rows[-1]
        print(
            f"{mode:<13} exit {r['exit_code']!s:<8} {r['seconds']:6.1f} s  "
            f"abort={r['rendezvous_abort']}  {r['log_line'][:120]}",
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
