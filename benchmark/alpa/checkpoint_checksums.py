"""What the checksums of a checkpoint cost: save and restore of a ~1 GB state with and
without ``verify`` (alpa/checkpoint_files.py; docs/checkpoints.md quotes the result).

    python benchmark/alpa/checkpoint_checksums.py [--gib 1.0] [--repeat 3] [--dir /tmp/x]

Writes ``benchmark/alpa/results/checkpoint_checksums.json`` and prints a summary. The
files are in the page cache when read back (as right after a save); a cold disk read
costs both paths the same extra time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument(
        "--output",
        default=os.path.join(os.path.dirname(__file__), "results", "checkpoint_checksums.json"),
    )
    args = parser.parse_args()

    import alpa
    from alpa import checkpoint_files

    rows = int(args.gib * 2**30 / 4 / 8 / 4096)  # 8 float32 arrays of rows x 4096
    rng = np.random.default_rng(0)
    state = {f"w{i}": rng.standard_normal((rows, 4096), dtype=np.float32) for i in range(8)}
    nbytes = sum(x.nbytes for x in state.values())
    root = args.dir or tempfile.mkdtemp(prefix="alpa_ckpt_bench_")
    times: dict[str, list[float]] = {"save": [], "seal": [], "restore": [], "restore_verify": []}
    real_seal = checkpoint_files.seal

    def timed_seal(*a, **k):
        start = time.perf_counter()
        real_seal(*a, **k)
        times["seal"].append(time.perf_counter() - start)

    checkpoint_files.seal = timed_seal
    try:
        for i in range(args.repeat):
            start = time.perf_counter()
            alpa.save_checkpoint(root, state, i, keep=1)
            times["save"].append(time.perf_counter() - start)
            for key, verify in (("restore", False), ("restore_verify", True)):
                start = time.perf_counter()
                alpa.restore_checkpoint(root, i, verify=verify)
                times[key].append(time.perf_counter() - start)
    finally:
        checkpoint_files.seal = real_seal
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "bytes": nbytes,
        "cpus": os.cpu_count(),
        "median_s": median,
        "all_s": times,
        "save_checksum_share": median["seal"] / median["save"],
        "restore_verify_overhead": median["restore_verify"] / median["restore"] - 1,
        "crc32_gb_per_s": nbytes / 1e9 / (median["restore_verify"] - median["restore"]),
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    print(f"state {nbytes / 2**30:.2f} GiB, {args.repeat} runs, medians on {os.cpu_count()} CPUs:")
    print(f"  save           {median['save']:.2f} s (of which checksums {median['seal']:.2f} s)")
    print(f"  restore        {median['restore']:.2f} s (verify=False)")
    print(
        f"  restore+verify {median['restore_verify']:.2f} s "
        f"(+{100 * result['restore_verify_overhead']:.0f}%)"
    )
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
