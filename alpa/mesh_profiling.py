"""Profiling a cluster: the measured rates the cost model prices plans with.

``profile_all`` measures the devices at hand and writes one file, a
:class:`ProfilingResultDatabase` of ``cost_profile.ClusterProfile`` entries keyed by device
kind and cluster shape, which ``ClusterSpec.from_profile(path)``,
``ClusterSpec.local(profile=path)``, ``global_config.cluster_profile`` and
``AutoStageOption(use_hlo_cost_model=True, profiling_database_filename=path)`` read.
Alpa's names (``alpa.mesh_profiling.ProfilingResultDatabase``, ``profile_all``) are kept;
the file is JSON, not Alpa's pickle, and holds what this cost model reads
(``cost_profile``'s docstring says how each figure is used):

1. matmuls over a grid of shapes per dtype, on one device alone;
2. a chain of elementwise operations (memory-bound work) over sizes, one device alone;
3. how one device's throughput falls while ``k`` devices of the host work at once;
4. each collective (all-reduce, all-gather, reduce-scatter, all-to-all) over sizes, for
   every group layout of the logical views of the host's power-of-two submeshes;
5. cross-mesh transfers over sizes;
6. the driver's cost per pipeline instruction (a two-stage pipeline of a small MLP run
   at 1 and at 8 micro-batches: the extra seconds over the extra instructions) and per
   launch of a one-mesh program.

On the 8 virtual CPU devices of a 2-core machine it takes about a minute with the
defaults, shown as a progress bar. On a Ray cluster (``device_cluster`` the
``DeviceCluster`` of ``alpa.init("ray")``), 1-4 run on every host's mesh worker at once
(``MeshHostWorker.profile_devices``, each on its own devices) and the slowest host's
figures are kept;
collectives between hosts and cross-mesh transfers are not measured there, and fall back
to the ``ClusterSpec``'s alpha-beta model.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from alpa.cost_profile import (
    PROFILE_FORMAT,
    ClusterProfile,
    Curve,
    load_profiles,
    save_profiles,
)
from alpa.global_env import global_config
from alpa.runtime import device_profiling

#: The collectives a profile measures.
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


class ProfilingResultDatabase:
    """Profiles by key (``"<device kind>/<hosts>x<devices per host>"``), as Alpa's class
    of that name held its results per mesh.

    ``query(cluster_key, mesh_shape=None)`` returns the profile of ``cluster_key`` (a full
    key, or a device kind); ``mesh_shape`` (``(hosts, devices per host)``) picks among
    several cluster shapes of one kind (default: the one with the most devices)."""

    def __init__(self, data: dict[str, ClusterProfile] | None = None):
        self.data: dict[str, ClusterProfile] = dict(data or {})

    def query(self, cluster_key: str, mesh_shape: Sequence[int] | None = None) -> ClusterProfile:
        if cluster_key in self.data:
            return self.data[cluster_key]
        matches = [p for p in self.data.values() if p.device_kind == cluster_key]
        if mesh_shape is not None:
            shape = tuple(mesh_shape)
            matches = [p for p in matches if (p.num_hosts, p.num_devices_per_host) == shape]
        if not matches:
            shape = f" of shape {tuple(mesh_shape)}" if mesh_shape is not None else ""
            raise KeyError(
                f"no profile for {cluster_key!r}{shape}; the database holds {sorted(self.data)}"
            )
        return max(matches, key=lambda p: p.num_hosts * p.num_devices_per_host)

    def only(self) -> ClusterProfile:
        """The database's one profile (an error naming its keys when it holds several or
        none)."""
        if len(self.data) != 1:
            raise ValueError(
                f"the profile database holds {len(self.data)} profiles {sorted(self.data)}; "
                "name the one to use (ProfilingResultDatabase.query)"
            )
        return next(iter(self.data.values()))

    def update_one_mesh(self, cluster_key, mesh_shape, mesh_result: ClusterProfile) -> None:
        """Add ``mesh_result`` under its own key (Alpa's signature; the key and shape
        are the profile's)."""
        self.data[mesh_result.key] = mesh_result

    def update(self, new_database: ProfilingResultDatabase) -> None:
        self.data.update(new_database.data)

    def save(self, filename: str) -> None:
        save_profiles(filename, self.data.values())

    def load(self, filename: str) -> None:
        self.data.update(load_profiles(filename))

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        return f"ProfilingResultDatabase({sorted(self.data)})"


def default_profile_path() -> str:
    """Where :func:`profile_all` writes by default."""
    return os.path.join(global_config.cache_dir, "cluster_profile.json")


# ----------------------------------------------------------------------------- profiling


def profile_all(
    device_cluster: Any = None,
    cluster_key: str | None = None,
    max_comm_size_intra_node: int = 24,
    max_comm_size_inter_node: int = 24,
    max_fail_retry: int = 0,
    cache_filename: str | None = None,
    dot_range: Sequence[int] | None = None,
    *,
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    min_comm_size: int = 12,
    instruction_cost: bool = True,
) -> ProfilingResultDatabase:
    """Measure the cluster (module docstring) and write its profile to ``cache_filename``
    (default :func:`default_profile_path`; the file's other profiles are kept). Returns
    the database written.

    Args (Alpa's, with these meanings):
      device_cluster: ``None`` or ``"local"``: this process's devices; or the Ray
        ``DeviceCluster`` of ``alpa.init("ray")`` (``alpa.get_global_cluster()``).
      cluster_key: the device kind the profile is filed under (default the devices'
        ``device_kind``).
      max_comm_size_intra_node: the largest collective measured, ``2**size`` bytes per
        device (from ``2**min_comm_size``, every factor of 4).
      max_comm_size_inter_node: accepted for Alpa's scripts (collectives between hosts
        are not measured: module docstring).
      max_fail_retry: accepted for Alpa's scripts; a failed measurement raises.
      cache_filename: the file written.
      dot_range: the matmul grid's sizes (each of ``m, k, n``); default ``(32, 128, 512,
        2048)`` on CPU, ``(128, 512, 2048, 8192)`` on accelerators.
    Args (alpa's):
      dtypes: the matmul dtypes measured.
      min_comm_size: the smallest collective, ``2**min_comm_size`` bytes per device.
      instruction_cost: measure the driver's cost per pipeline instruction (compiles a
        small two-stage pipeline: a few seconds).
    """
    for name, value in (
        ("max_comm_size_intra_node", max_comm_size_intra_node),
        ("max_comm_size_inter_node", max_comm_size_inter_node),
        ("min_comm_size", min_comm_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 40:
            raise ValueError(
                f"profile_all: {name} must be an int in [0, 40] (log2 of bytes), got {value!r}"
            )
    if min_comm_size > max_comm_size_intra_node:
        raise ValueError(
            f"profile_all: min_comm_size={min_comm_size} exceeds "
            f"max_comm_size_intra_node={max_comm_size_intra_node}"
        )
    if dot_range is not None and (
        len(dot_range) < 2 or any(not isinstance(s, int) or s < 1 for s in dot_range)
    ):
        raise ValueError(
            f"profile_all: dot_range needs two or more positive int sizes, got {dot_range!r}"
        )
    unknown = [d for d in dtypes if d not in ("float32", "bfloat16", "float16", "float64")]
    if not dtypes or unknown:
        raise ValueError(
            f"profile_all: dtypes must name float dtypes (float32, bfloat16, float16, "
            f"float64), got {tuple(dtypes)!r}"
        )
    request = {
        "dot_sizes": None if dot_range is None else sorted(set(dot_range)),
        "dtypes": list(dtypes),
        "kinds": list(COLLECTIVES),
        "comm_sizes": device_profiling.powers_of_two(min_comm_size, max_comm_size_intra_node, 2),
    }
    start = time.perf_counter()
    if device_cluster is None or device_cluster == "local":
        profile = _profile_local(request, cluster_key, instruction_cost)
    else:
        profile = _profile_ray(device_cluster, request, cluster_key, instruction_cost)
    meta = {**profile.meta, "seconds": round(time.perf_counter() - start, 1)}
    profile = _with(profile, meta=meta)
    database = ProfilingResultDatabase()
    path = cache_filename or default_profile_path()
    if os.path.exists(path):
        database.load(path)
    database.update_one_mesh(profile.key, None, profile)
    database.save(path)
    return database


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="profiling", disable=not global_config.use_tqdm)


def _profile_local(request: dict, cluster_key: str | None, instruction_cost: bool):
    devices = jax.devices()
    platform = devices[0].platform
    steps = device_profiling.profile_steps(request, len(devices), platform)
    with _progress_bar(steps + 2) as bar:
        host = device_profiling.profile_host(devices, request, bar.update)
        transfers = (
            device_profiling.time_transfers(devices, request["comm_sizes"])
            if len(devices) > 1
            else None
        )
        bar.update(1)
        instruction = launch = 0.0
        if instruction_cost:
            instruction = pipeline_instruction_seconds()
            launch = device_profiling.time_launch(devices)
        bar.update(1)
    return _assemble([host], cluster_key, 1, len(devices), transfers, instruction, launch)


def _profile_ray(device_cluster, request: dict, cluster_key: str | None, instruction_cost: bool):
    num_hosts = device_cluster.num_hosts
    per_host = device_cluster.num_devices // num_hosts
    with _progress_bar(2) as bar:
        # The cluster's mesh of every host: each host's worker measures its own devices,
        # the hosts at once.
        mesh = device_cluster.get_physical_mesh()
        hosts = mesh.call("profile_devices", request)
        bar.update(1)
        instruction = pipeline_instruction_seconds() if instruction_cost else 0.0
        bar.update(1)
    return _assemble(hosts, cluster_key, num_hosts, per_host, None, instruction, instruction)


def _assemble(
    hosts: Sequence[dict],
    cluster_key: str | None,
    num_hosts: int,
    per_host: int,
    transfers: Curve | None,
    instruction: float,
    launch: float,
) -> ClusterProfile:
    """One profile of the hosts' measurements (``device_profiling.profile_host``): the
    slowest host's, by its elementwise chain at 16 MiB."""
    slowest = max(hosts, key=lambda h: Curve.from_json(h["memory"])(1 << 24))
    # A host's measurements are in the profile file's own form: read as the file is.
    measured = (
        "platform",
        "dot",
        "memory",
        "copy",
        "concurrency",
        "memory_concurrency",
        "collectives",
    )
    return ClusterProfile.from_json(
        {
            **{name: slowest[name] for name in measured},
            "format": PROFILE_FORMAT,
            "device_kind": cluster_key or slowest["device_kind"],
            "num_hosts": num_hosts,
            "num_devices_per_host": per_host,
            "cross_mesh": None if transfers is None else transfers.to_json(),
            "instruction_seconds": instruction,
            "launch_seconds": launch,
            "meta": {
                "jax": jax.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "hosts_measured": len(hosts),
            },
        }
    )


def _with(profile: ClusterProfile, **changes) -> ClusterProfile:
    import dataclasses

    return dataclasses.replace(profile, **changes)


# ----------------------------------------------------------------------------- host cost


def pipeline_instruction_seconds(micro_batches: tuple[int, int] = (1, 8)) -> float:
    """The driver's seconds per pipeline instruction: a two-stage pipeline of a small MLP
    (each stage on half of the cluster's devices) run at ``micro_batches[0]`` and at
    ``micro_batches[1]`` micro-batches of the same batch; the extra seconds per step over
    the extra instructions per step (the device work is the same batch in both)."""
    from alpa.api import grad, parallelize
    from alpa.cluster import get_global_num_devices
    from alpa.methods.pipeshard_method import PipeshardParallel
    from alpa.pipeline_parallel.stages.stage_construction import ManualStageOption
    from alpa.tracing.primitive_def import mark_pipeline_boundary

    half = max(get_global_num_devices() // 2, 1)
    width, rows = 64, 64

    def step(params, batch):
        def loss(params):
            h = jnp.tanh(batch @ params["w0"])
            mark_pipeline_boundary()
            return jnp.mean(jnp.tanh(h @ params["w1"]) ** 2)

        grads = grad(loss)(params)
        return {k: params[k] - 0.01 * grads[k] for k in params}

    params = {"w0": jnp.full((width, width), 0.01), "w1": jnp.full((width, width), 0.02)}
    batch = jnp.ones((rows, width))
    timings = []
    for b in micro_batches:
        method = PipeshardParallel(
            num_micro_batches=b,
            layer_option="manual",
            stage_option=ManualStageOption([[0], [1]], [(1, half), (1, half)]),
        )
        parallel = parallelize(step, method=method, donate_argnums=())
        out = parallel(params, batch)
        jax.block_until_ready(out)
        seconds = []
        for _ in range(5):
            begin = time.perf_counter()
            jax.block_until_ready(parallel(params, batch))
            seconds.append(time.perf_counter() - begin)
        count = len(parallel.get_last_executable().plan.instructions.instructions)
        timings.append((statistics.median(seconds), count))
    (t0, n0), (t1, n1) = timings
    return max(t1 - t0, 0.0) / max(n1 - n0, 1)
