"""The measured stage cost model: every candidate stage compiled and timed.

:class:`MeasuredStageCost` compiles every candidate stage on the real submesh
(``ShardParallel``'s intra-op pass and lowering) and times it; results are cached on disk
keyed by the stage's jaxpr, submesh, logical shape and options, so a stage is measured
once per machine. The cache file carries its layout's version (``"format"``:
:data:`CACHE_FORMAT`; a file without it is format 1, the latencies as the whole object);
one of a newer format is refused by name, not read as latencies or overwritten. Memory
is priced as in the analytic model: the tables it fills are ``stage_cost``'s
(``stage_cost.fill_tables``), with measured latencies.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from alpa.pipeline_parallel.program.stage_sharding import structure_key
from alpa.pipeline_parallel.stages.stage_cost import LayerPlans, fill_tables, stage_memory
from alpa.pipeline_parallel.stages.stage_problem import StageCosts, StageProblem
from alpa.saved_format import FORMAT_KEY, read_format
from alpa.shard_parallel.auto_sharding import AutoShardingOption, plan_auto_sharding
from alpa.tracing import StepJaxpr

#: Version of the cache file's layout: ``{"format": 2, "latencies": {key: seconds}}``.
#: Format 1 (no ``"format"``) was the ``{key: seconds}`` object alone.
CACHE_FORMAT = 2


class MeasuredStageCost:
    """Latency measured by compiling and running every candidate stage on its submesh.

    Args:
      devices: the devices submeshes are cut from (default ``jax.devices()``).
      cache_file: a JSON file of measured latencies (default
        ``~/.cache/alpa/stage_costs.json``); entries are keyed by the stage's jaxpr,
        submesh, logical shape and options.
      repeat: timed runs per stage (the median is kept), after one warm-up run.
    """

    def __init__(
        self, devices: Sequence[Any] | None = None, cache_file: str | None = None, repeat: int = 3
    ):
        self.devices = devices
        self.cache_file = cache_file or os.path.join(
            os.path.expanduser("~"), ".cache", "alpa", "stage_costs.json"
        )
        self.repeat = repeat
        self.measured = 0  # stages compiled and timed by the last call (not from the cache)

    def __call__(self, problem: StageProblem) -> StageCosts:
        import jax

        from alpa.device_mesh import LocalPhysicalDeviceMesh
        from alpa.util import progress

        devices = list(self.devices or jax.devices())
        cache = self._load()
        facts = problem.layer_facts
        L = problem.num_layers
        candidates = [
            (i, j, m, c, config)
            for m, configs in enumerate(problem.configs)
            for c, config in enumerate(configs)
            for i in range(L)
            for j in range(i, L)
        ]
        latencies: dict = {}
        self.measured = 0
        for i, j, m, c, config in progress(candidates, desc="measuring stages"):
            n = int(np.prod(problem.submesh_choices[m]))
            if n > len(devices):
                continue
            step, _ = problem.stage_step(i, j, n)
            option = problem.config_option(config)
            key = hashlib.sha256(
                json.dumps(
                    [
                        structure_key(step),
                        list(problem.submesh_choices[m]),
                        list(config.shape),
                        repr(option),
                        devices[0].platform,
                    ]
                ).encode()
            ).hexdigest()
            if key not in cache:
                mesh = LocalPhysicalDeviceMesh(devices[:n]).get_logical_mesh(config.shape)
                cache[key] = self._time(step, mesh, option)
                self.measured += 1
            latencies[(i, j, m, c)] = cache[key]
        self._save(cache)

        def latency(i, j, m, c, config):
            return latencies.get((i, j, m, c), np.inf)

        memory = stage_memory(problem, LayerPlans(problem, facts))
        return fill_tables(problem, latency, memory)

    def _time(self, step: StepJaxpr, mesh, option: AutoShardingOption) -> float:
        import jax
        import jax.numpy as jnp

        from alpa.shard_parallel.lowering.compile import compile_plan

        plan = plan_auto_sharding(
            step, mesh, option, comm_first=False, shared_reshardings=False
        )  # as the stages run
        compiled, in_shardings = compile_plan(step, plan, None)
        args = [
            jax.device_put(jnp.zeros(a.shape, a.dtype), s)
            for a, s in zip(step.in_avals, in_shardings, strict=True)
        ]

        def launch():
            return compiled(*jax.tree.unflatten(step.trees()[0], args))

        jax.block_until_ready(launch())
        times = []
        for _ in range(self.repeat):
            start = time.perf_counter()
            jax.block_until_ready(launch())
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    def _load(self) -> dict:
        """The cached latencies; none when the file is missing or unreadable (a cache is
        measured again). One of a newer format raises ``NewerFormatError``."""
        try:
            with open(self.cache_file) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        version = read_format(
            data,
            CACHE_FORMAT,
            "stage-cost cache",
            repr(self.cache_file),
            remedy="pass MeasuredStageCost(cache_file=...) (or AutoStageOption("
            "profiling_database_filename=...)) another file, or remove it to measure again",
        )
        latencies = data if version == 1 else data.get("latencies", {})
        return {k: v for k, v in latencies.items() if isinstance(v, int | float)}

    def _save(self, cache: dict) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.cache_file)), exist_ok=True)
        tmp = self.cache_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({FORMAT_KEY: CACHE_FORMAT, "latencies": cache}, f)
        os.replace(tmp, self.cache_file)
