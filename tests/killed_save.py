"""One checkpoint save, killed with SIGKILL at a chosen point: the crash that atomicity
must survive (tests/test_serialization.py, tests/runtime/test_ray_runtime.py and the
larger sweep benchmark/alpa/checkpoint_kills.py run it as a subprocess).

    python killed_save.py CKPT_DIR STEP SEED MODE AT [--keep N] [--ray ADDRESS]

saves ``state(SEED)`` as step ``STEP`` and kills itself:

* ``MODE=op``: right after the ``AT``-th file-system commit operation of the save
  (``os.rename`` or ``shutil.rmtree``, orbax's own included; ``AT=0``: before the first),
  which lands a kill between any two renames of the commit;
* ``MODE=time``: ``AT`` seconds after the save started;
* ``MODE=none``: not at all.

It prints ``ops=<n>`` (the operations the save made) and ``seconds=<s>`` (how long the
save took) and exits 0 when the save finished before the kill.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np

ROWS, COLS = 2048, 1024  # 8 MiB of float32 per array: a save takes a fraction of a second


def state(seed: int) -> dict:
    """The host state a save of ``seed`` writes; every seed gives other values."""
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": rng.standard_normal((ROWS, COLS)).astype(np.float32),
            "v": rng.standard_normal((ROWS, COLS)).astype(np.float32),
        },
        "n": seed,
    }


def run(ckpt, step: int, seed: int, mode: str, at: float, *extra) -> int:
    """Run this script: save ``state(seed)`` as ``step`` under ``ckpt``, killed at
    ``(mode, at)``; its exit code (``-SIGKILL`` when killed, 0 when the save finished)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    args = [sys.executable, __file__, str(ckpt), str(step), str(seed), mode, str(at)]
    result = subprocess.run(
        [*args, *map(str, extra)], capture_output=True, text=True, env=env, timeout=180
    )
    assert result.returncode in (0, -signal.SIGKILL), result.stderr
    return result.returncode


def save_seconds(ckpt, step: int, seed: int) -> float:
    """Seconds a save like the killed ones takes here when nothing kills it (run the
    same way), to time kills as fractions of it on a machine of any speed."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    args = [sys.executable, __file__, str(ckpt), str(step), str(seed), "none", "0"]
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("seconds="))
    return float(line.split("=", 1)[1])


def restored_seed(ckpt, step: int, seeds) -> int:
    """Which of ``seeds`` step ``step`` holds, after checking that it restores completely
    and bit-exactly as that seed's state."""
    import alpa

    restored = alpa.restore_checkpoint(ckpt, step)
    seed = int(restored["n"])
    assert seed in seeds, (seed, seeds)
    expected = state(seed)
    for name in ("w", "v"):
        np.testing.assert_array_equal(
            np.asarray(restored["params"][name]), expected["params"][name]
        )
    return seed


def _kill() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), 9)


def _kill_after_ops(at: int) -> list[int]:
    """Patch ``os.rename`` and ``shutil.rmtree`` to count calls and kill after the
    ``at``-th; the count."""
    count = [0]
    real_rename, real_rmtree = os.rename, shutil.rmtree

    def counted(real):
        def op(*args, **kwargs):
            result = real(*args, **kwargs)
            count[0] += 1
            if count[0] == at:
                _kill()
            return result

        return op

    os.rename, shutil.rmtree = counted(real_rename), counted(real_rmtree)
    return count


def main() -> None:
    # The alpa of this checkout, not an installed one (a script's path is its folder).
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("step", type=int)
    parser.add_argument("seed", type=int)
    parser.add_argument("mode", choices=["op", "time", "none"])
    parser.add_argument("at", type=float)
    parser.add_argument("--keep", type=int, default=None)
    parser.add_argument("--ray", default=None, help="address of a running Ray cluster")
    args = parser.parse_args()

    import alpa

    target = state(args.seed)
    if args.ray is not None:
        import ray
        from jax.sharding import PartitionSpec as P

        from alpa.runtime.worker_program import Layout

        ray.init(address=args.ray, _node_ip_address="127.0.0.1", log_to_driver=False)
        alpa.init("ray", num_devices_per_node=4)
        mesh = alpa.get_global_cluster().get_physical_mesh((0,), 2)
        layout = Layout((1, 2), ("x", "y"), P("y"))
        target["params"] = {k: mesh.put(v, layout) for k, v in target["params"].items()}
    else:
        # Load orbax and alpa's checkpoint code before the clock starts.
        alpa.save_checkpoint(os.path.join(args.ckpt_dir, "..", "warmup"), {"x": 1}, 0)
    if args.mode == "op":
        if args.at == 0:
            _kill()
        count = _kill_after_ops(int(args.at))
    else:
        count = _kill_after_ops(-1)
        if args.mode == "time":
            threading.Timer(args.at, _kill).start()
    start = time.perf_counter()
    alpa.save_checkpoint(args.ckpt_dir, target, args.step, keep=args.keep)
    print(f"ops={count[0]}", flush=True)
    print(f"seconds={time.perf_counter() - start:.4f}", flush=True)
    os._exit(0)  # no Ray or thread teardown: the save is what was measured


if __name__ == "__main__":
    main()
