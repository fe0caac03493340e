"""Alpa's benchmark suites (GPT, MoE, Wide-ResNet), run on this codebase.

    python benchmark/alpa/benchmark.py --suite gpt.perf_test_auto \\
        [--num-hosts N --num-devices-per-host K] [--cluster ray|local] [--niter 3] \\
        [--warmup 1] [--output results.jsonl|results.tsv]

The script connects to the cluster (``alpa.init(cluster=...)``), looks up the suite's
cases for the cluster's number of devices (``suite_*.py``; the key is ``N * K``), and runs
each case (``benchmark_one_case.run_case``): step time, TFLOP/s per device, parameters,
compilation time, peak memory per mesh and the plan that ran. Each case appends one row
to the results file (JSON lines, or TSV when the name ends in ``.tsv``; default
``benchmark/alpa/results/<suite>.jsonl``) together with the device kind, the cluster shape,
the alpa and jax versions and the date; a table of the suite is printed at the end. A case
that fails is recorded with its error and the suite goes on; the exit status is then 1.

On CPU, ``--num-devices-per-host K`` also gives this process ``K`` virtual devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=K``, set before jax starts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from datetime import datetime, timezone
from pathlib import Path

import suite_gpt
import suite_moe
import suite_wresnet
from benchmark_case import Suite

BENCHMARK_SUITES: dict[str, Suite] = {
    "gpt.perf_test_fast_2d": suite_gpt.perf_test_fast_2d,
    "gpt.perf_test_manual": suite_gpt.perf_test_manual,
    "gpt.perf_test_auto": suite_gpt.perf_test_auto,
    "gpt.perf_test_solution": suite_gpt.perf_test_solution,
    "gpt.grid_search_auto": suite_gpt.grid_search_auto,
    "gpt.cpu_test": suite_gpt.cpu_test,
    "moe.perf_test_fast_2d": suite_moe.perf_test_fast_2d,
    "moe.perf_test_auto": suite_moe.perf_test_auto,
    "moe.perf_test_solution": suite_moe.perf_test_solution,
    "moe.grid_search_auto": suite_moe.grid_search_auto,
    "moe.cpu_test": suite_moe.cpu_test,
    "wresnet.perf_test_2d": suite_wresnet.perf_test_2d,
    "wresnet.perf_test_auto": suite_wresnet.perf_test_auto,
    "wresnet.perf_test_solution": suite_wresnet.perf_test_solution,
    "wresnet.grid_search_auto": suite_wresnet.grid_search_auto,
    "wresnet.cpu_test": suite_wresnet.cpu_test,
}

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: Columns of a TSV results file; nested values are written as JSON.
TSV_COLUMNS = (
    "date", "suite", "case", "model", "model_config", "batch_size", "num_micro_batches",
    "parallel_mode", "parallel_args", "cluster", "num_hosts", "num_devices_per_host",
    "cluster_spec", "device_kind", "num_params", "compile_s", "mean_s", "std_s", "tflops",
    "tflops_ckpt", "peak_memory_per_mesh", "plan", "alpa_version", "jax_version", "status",
)  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(BENCHMARK_SUITES), required=True)
    parser.add_argument("--cluster", choices=("ray", "local"), default="ray")
    parser.add_argument("--num-hosts", type=int, default=None)
    parser.add_argument("--num-devices-per-host", type=int, default=None)
    parser.add_argument("--niter", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="steps before timing")
    parser.add_argument("--output", type=Path, default=None, help="a .jsonl or .tsv file")
    parser.add_argument("--disable-tqdm", action="store_true")
    args = parser.parse_args()
    for name in ("num_hosts", "num_devices_per_host", "niter"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    return args


def force_host_device_count(count: int) -> None:
    """Give the CPU platform ``count`` devices. Only the host platform reads this flag, so
    on GPUs it changes nothing; a count already in ``XLA_FLAGS`` is kept."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"


def write_row(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".tsv":
        new = not path.exists()
        cells = [row.get(c) for c in TSV_COLUMNS]
        line = "\t".join(c if isinstance(c, str) else json.dumps(c) for c in cells)
        with path.open("a") as f:
            if new:
                f.write("\t".join(TSV_COLUMNS) + "\n")
            f.write(line + "\n")
    else:
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def _count(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _number(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def print_table(rows: list[dict]) -> None:
    header = ("case", "model", "mode", "B", "NB", "#dev", "mean s", "std s", "params",
              "TFLOPS", "TFLOPS ckpt", "peak GB/mesh", "compile s", "status")  # fmt: skip
    table = [header]
    for r in rows:
        peaks = r.get("peak_memory_per_mesh")
        table.append(
            (
                str(r["case"]),
                r["model"],
                r["parallel_mode"],
                str(r["batch_size"]),
                str(r["num_micro_batches"]),
                str(r["num_hosts"] * r["num_devices_per_host"]),
                _number(r.get("mean_s"), 3),
                _number(r.get("std_s"), 3),
                _count(r.get("num_params")),
                _number(r.get("tflops"), 4),
                _number(r.get("tflops_ckpt"), 4),
                "-" if peaks is None else " ".join(f"{p / 2**30:.3f}" for p in peaks),
                _number(r.get("compile_s"), 1),
                r["status"][:40],
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def main() -> int:
    args = parse_args()
    if args.num_devices_per_host is not None:
        force_host_device_count(args.num_devices_per_host)
    # jax reads XLA_FLAGS when its first backend starts: import it, and what imports it,
    # only now.
    import jax
    from benchmark_one_case import describe_case, run_case

    import alpa

    if args.disable_tqdm:
        alpa.util.disable_tqdm_globally()
    alpa.init(
        cluster=args.cluster,
        num_nodes=args.num_hosts,
        num_devices_per_node=args.num_devices_per_host,
    )
    virtual_mesh = alpa.get_global_virtual_physical_mesh()
    num_hosts, per_host = virtual_mesh.num_hosts, virtual_mesh.num_devices_per_host
    suite = BENCHMARK_SUITES[args.suite]
    num_devices = num_hosts * per_host
    if num_devices not in suite:
        raise SystemExit(
            f"suite {args.suite} has no cases for {num_devices} devices "
            f"({num_hosts} x {per_host}); it has cases for {sorted(suite)}"
        )
    output = args.output or RESULTS_DIR / f"{args.suite}.jsonl"
    ray_cluster = alpa.get_global_cluster()
    if ray_cluster is not None:  # the devices are the workers'; starting one would hold them
        platform, device_kind = ray_cluster.platform, ray_cluster.spec.name
    else:
        platform, device_kind = jax.devices()[0].platform, jax.devices()[0].device_kind
    environment = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "suite": args.suite,
        "cluster": args.cluster,
        "num_hosts": num_hosts,
        "num_devices_per_host": per_host,
        "cluster_spec": getattr(virtual_mesh.cluster, "name", None),
        "platform": platform,
        "device_kind": device_kind,
        "alpa_version": alpa.__version__,
        "jax_version": jax.__version__,
        "niter": args.niter,
        "warmup": args.warmup,
    }

    rows = []
    for index, case in enumerate(suite[num_devices]):
        print(f"case {index}: {case}", flush=True)
        row = {**environment, "case": index, **describe_case(case)}
        try:
            row.update(run_case(case, args.niter, args.warmup, num_hosts, per_host))
            row["status"] = "ok"
        except Exception as e:  # one case's failure is a result; the suite goes on
            traceback.print_exc()
            row["status"] = f"error: {type(e).__name__}: {e}"
        write_row(output, row)
        rows.append(row)
        shown = {k: row.get(k) for k in ("mean_s", "tflops", "compile_s", "status")}
        print(f"case {index}: {json.dumps(shown)}", flush=True)

    print_table(rows)
    print(f"results: {output}")
    alpa.shutdown()
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
