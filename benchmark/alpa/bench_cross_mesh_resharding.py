"""Cross-mesh resharding between two Ray meshes: bytes/s per transport.

Two meshes of ``--num-devices`` devices each, on two different hosts when the cluster has
two (else on one host, different workers). For each array size and pair of layouts, the
value moves from the first mesh to the second:

* ``workers``: the runtime's path (``alpa.runtime.ray_launch.reshard_array``): the tile
  plan's pieces go from the source worker straight to the destination workers through
  Ray (its object store for large pieces), each piece once per destination host;
* ``driver``: the baseline the runtime avoids: fetch the value to the driver, put it on
  the destination mesh.

The rate is the tile plan's bytes over the median wall time of ``--repeat`` moves. Between
GPU meshes whose workers have NCCL, ``workers`` is NCCL send/recv (docs/ray.md); the
``transport`` column then says ``workers (nccl)``.

    python benchmark/alpa/bench_cross_mesh_resharding.py                   # alpa.init("ray")
    python benchmark/alpa/bench_cross_mesh_resharding.py --simulate-nodes 2  # 2 local nodes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "cross_mesh_resharding.json"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-devices", type=int, default=4, help="devices per mesh")
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--simulate-nodes",
        type=int,
        default=0,
        help="start a local Ray of this many simulated nodes on 127.0.0.1 (CPU)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    return parser.parse_args()


def main():
    args = parse_args()
    cluster = None
    if args.simulate_nodes:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # nodes on 127.0.0.1
        import ray
        from ray.cluster_utils import Cluster

        node = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False}
        cluster = Cluster(initialize_head=True, head_node_args=node)
        for _ in range(args.simulate_nodes - 1):
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)

    import numpy as np
    from jax.sharding import PartitionSpec as P

    import alpa
    from alpa.runtime.ray_launch import ensure_nccl_group, reshard_array
    from alpa.runtime.resharding import worker_transfer_plan
    from alpa.runtime.worker_program import Layout

    alpa.init("ray", num_devices_per_node=args.num_devices)
    devices = alpa.get_global_cluster()
    n = args.num_devices
    if devices.num_hosts < 2:
        raise SystemExit("needs a Ray cluster of two hosts (or --simulate-nodes 2)")
    src = devices.get_physical_mesh((0,), n)
    dst = devices.get_physical_mesh((1,), n)
    layouts = {
        "replicated": Layout((1, n), ("x", "y"), P()),
        "row": Layout((1, n), ("x", "y"), P("y")),
        "column": Layout((1, n), ("x", "y"), P(None, "y")),
    }
    pairs = [("row", "row"), ("row", "column"), ("column", "replicated")]
    rows = []
    for size_mb in args.sizes_mb:
        side = int((size_mb * (1 << 20) / 4) ** 0.5) // n * n
        value = np.random.default_rng(0).standard_normal((side, side), dtype=np.float32)
        for src_name, dst_name in pairs:
            x = src.put(value, layouts[src_name])
            plan = worker_transfer_plan(
                value.shape, value.dtype, layouts[src_name], n, layouts[dst_name], n
            )
            nccl = ensure_nccl_group(src, dst)
            for transport in ("workers", "driver"):
                times = []
                for _ in range(args.repeat):
                    tic = time.perf_counter()
                    if transport == "workers":
                        y = reshard_array(x, dst, layouts[dst_name])
                    else:
                        fetched = src.call("fetch", [x.name])[0][0]  # uncached fetch
                        y = dst.put(fetched, layouts[dst_name])
                    times.append(time.perf_counter() - tic)
                    np.testing.assert_array_equal(np.asarray(y), value)
                    del y
                    dst.flush_deletes(wait=True)  # free the copy before the next move
                seconds = statistics.median(times)
                rows.append(
                    {
                        "size_mb": value.nbytes / (1 << 20),
                        "src": src_name,
                        "dst": dst_name,
                        "transport": "workers (nccl)"
                        if nccl and transport == "workers"
                        else transport,
                        "plan_bytes": plan.nbytes(),
                        "median_s": seconds,
                        "bytes_per_s": plan.nbytes() / seconds,
                    }
                )
                print(
                    f"{value.nbytes / (1 << 20):7.1f} MB {src_name:>10} -> {dst_name:<10} "
                    f"{transport:>8}: {seconds * 1e3:8.2f} ms  "
                    f"{plan.nbytes() / seconds / 1e9:6.2f} GB/s",
                    flush=True,
                )
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "platform": devices.platform,
        "num_hosts": devices.num_hosts,
        "devices_per_mesh": n,
        "simulated_nodes": args.simulate_nodes,
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {args.output}")
    alpa.shutdown()
    if cluster is not None:
        import ray

        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
