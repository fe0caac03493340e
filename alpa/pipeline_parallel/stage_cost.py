"""Stage costs for the stage DP: what one stage of layers ``i..j`` costs on a submesh.

The DP (``stage_dp.training_dp``) reads two tables indexed ``[i, j, m, c]``: the latency
of one micro-batch through a stage of layers ``i..j`` (inclusive) on submesh choice ``m``
with logical configuration ``c``, and how many stages may follow it (its memory). A
:class:`StageCostModel` fills them from a :class:`StageProblem`: the step split with one
stage per layer, the submesh choices and, per submesh, its logical configurations.

Two models:

* :class:`AnalyticStageCost` (the default; needs no device, so it plans for a
  ``ClusterSpec`` that is not here). Per layer ``l`` and configuration, the forward and
  backward equations of ``l`` are planned by the same auto-sharding ILP the stage would
  be compiled with, on that logical submesh; the latency is

  .. math::  t(i, j, m, c) = \\sum_{l=i}^{j} \\Big(\\frac{F_l}{n_m R} + K_l(m, c)\\Big)
             + [i > 0] \\, \\frac{2 X_i}{W}

  with :math:`F_l` the layer's FLOPs (``tracing.flops``), :math:`R` the device's peak
  FLOP/s, :math:`K_l` the communication of the ILP's plan (seconds under the alpha-beta
  model of the cluster; the ILP's objective also holds a compute estimate, which is not
  added again), :math:`X_i` the bytes entering layer ``i`` from
  earlier layers (sent forward, their cotangents sent back) and :math:`W` the cross-mesh
  bandwidth (``inf``: free). Layers with identical jaxprs are planned once.

  Memory per device: the stage's state (parameters, optimizer state, gradient sums) at
  the fraction of the parameters' bytes the ILP's input shardings leave on one device,
  plus per micro-batch in flight the activations its forward keeps for its backward
  (the values that depend on the batch: weights the forward hands on, and values computed
  from weights alone, are not counted per micro-batch), split over the submesh. Under
  1F1B a stage followed by ``k`` stages holds ``k + 1`` micro-batches, so
  ``max_n_succ_stages = floor((budget - state) / activations) - 1`` (``-1``, and an
  ``inf`` latency, when not even one fits). The layer ILPs run without
  the budget; on a submesh where the replicated state of an average stage cannot fit
  next to its micro-batches in flight, its configurations ask the ILP to split
  parameters (:func:`split_parameters_under_memory_pressure`).

* :class:`MeasuredStageCost`: compiles every candidate stage on the real submesh
  (``ShardParallel``'s intra-op pass and lowering) and times it; results are cached on
  disk keyed by the stage's jaxpr, submesh, logical shape and options, so a stage is
  measured once per machine. Memory as in the analytic model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from jax.sharding import PartitionSpec

from alpa.device_mesh import ClusterSpec, VirtualPhysicalMesh
from alpa.pipeline_parallel.computation import PipelineProgram, _is_var, _nbytes
from alpa.pipeline_parallel.stage_sharding import merged_step, structure_key, uses_ilp
from alpa.shard_parallel import ilp_solver
from alpa.shard_parallel.auto_sharding import (
    AutoShardingOption,
    plan_auto_sharding,
    solve_auto_sharding,
)
from alpa.tracing import TracedStep
from alpa.tracing.flops import jaxpr_flops
from alpa.util import map_on_threads

LOGICAL_SHAPE_SPACES = (
    "single_node_model_parallel",
    "all",
    "same_as_physical",
    "data_parallel_only",
    "model_parallel_only",
)


@dataclass(frozen=True)
class LogicalConfig:
    """One way to view a submesh: a 2-D logical shape and ``AutoShardingOption`` fields."""

    shape: tuple[int, int]
    option_items: tuple[tuple[str, Any], ...] = ()

    @property
    def option_dict(self) -> dict:
        return dict(self.option_items)


def get_logical_configs(
    submesh: Sequence[int], space: str, batch_size: int | None = None
) -> tuple[LogicalConfig, ...]:
    """The logical configurations of a ``(hosts, devices_per_host)`` submesh in ``space``.

    ``single_node_model_parallel`` (Alpa's default): ``(n / mp, mp)`` with the batch on
    axis 0 for every model-parallel degree ``mp`` within one host whose data-parallel
    degree divides ``batch_size``, and ``(n, 1)`` with the ILP free; ``all``: the same
    with ``mp`` up to ``n``; ``same_as_physical``: the physical shape;
    ``data_parallel_only``: ``(n, 1)``; ``model_parallel_only``: ``(1, n)``.
    """
    if space not in LOGICAL_SHAPE_SPACES:
        raise ValueError(
            f"submesh_logical_shape_space must be one of {LOGICAL_SHAPE_SPACES}, got {space!r}"
        )
    hosts, per_host = int(submesh[0]), int(submesh[1])
    n = hosts * per_host
    forced = (("force_batch_dim_to_mesh_dim", 0),)
    if space == "same_as_physical":
        return (LogicalConfig((hosts, per_host)),)
    if space == "data_parallel_only":
        return (LogicalConfig((n, 1), forced),)
    if space == "model_parallel_only":
        return (LogicalConfig((1, n), forced),)
    max_mp = per_host if space == "single_node_model_parallel" else n
    configs = [LogicalConfig((n, 1))]
    for mp in range(2, max_mp + 1):
        dp = n // mp
        if n % mp == 0 and (batch_size is None or batch_size % dp == 0):
            configs.append(LogicalConfig((dp, mp), forced))
    return tuple(configs)


@dataclass(frozen=True, eq=False)
class StageProblem:
    """What a stage cost model needs.

    Attributes:
      traced: the traced step (at micro-batch size).
      program: the step split with one stage per layer (stage ``l`` = layer ``l``).
      names: a readable name for every value (for messages).
      submesh_choices: ``(hosts, devices_per_host)`` per submesh choice ``m``.
      configs: per submesh choice, its logical configurations ``c``.
      cluster: the hardware the plan is for.
      option: the ``AutoShardingOption`` each configuration's fields update.
      memory_budget: bytes per device a stage may use.
    """

    traced: TracedStep
    program: PipelineProgram
    names: dict
    submesh_choices: tuple[tuple[int, int], ...]
    configs: tuple[tuple[LogicalConfig, ...], ...]
    cluster: ClusterSpec
    option: AutoShardingOption
    memory_budget: float

    @property
    def num_layers(self) -> int:
        return self.program.num_stages

    @property
    def num_configs(self) -> int:
        return max(len(c) for c in self.configs)

    def layer_comps(self, layers: Sequence[int]) -> list:
        layers = list(layers)
        comps = []
        # Program order: forwards in layer order, then backwards in reverse.
        for kind, order in (("forward", layers), ("backward", layers[::-1])):
            for layer in order:
                comp = self.program.computation(layer, kind)
                if comp is not None and comp.eqns:
                    comps.append(comp)
        return comps

    def stage_step(self, first: int, last: int, num_devices: int) -> tuple[TracedStep, set]:
        """Layers ``first..last``'s forward and backward as one step (``merged_step``)."""
        comps = self.layer_comps(range(first, last + 1))
        return merged_step(
            self.traced, self.program, comps, num_devices, self.names, f"layers{first}_{last}"
        )

    def logical_mesh(self, m: int, config: LogicalConfig):
        hosts, per_host = self.submesh_choices[m]
        virtual = VirtualPhysicalMesh(hosts, per_host, cluster=self.cluster)
        return virtual.get_logical_mesh(config.shape)

    def config_option(self, config: LogicalConfig) -> AutoShardingOption:
        return dataclasses.replace(self.option, **config.option_dict)


@dataclass(frozen=True)
class StageCosts:
    """The DP's inputs, with what they were made of (for the plan's report)."""

    compute_cost: np.ndarray  # [i, j, m, c], seconds per micro-batch, inf = infeasible
    max_n_succ_stages: np.ndarray  # [i, j, m, c]
    memory: np.ndarray  # [i, j, m, c], bytes per device with one micro-batch in flight


class StageCostModel(Protocol):
    """Fills the DP's tables for a :class:`StageProblem`."""

    def __call__(self, problem: StageProblem) -> StageCosts: ...


def split_parameters_under_memory_pressure(problem: StageProblem, num_devices: int) -> StageProblem:
    """``problem`` with ``allow_replicated_parameters=False`` in the configurations of
    every multi-device submesh on which replicated state cannot fit next to the
    activations a stage there keeps. A stage on ``n`` of the cluster's ``D`` devices holds
    ``k = L * n / D`` of the ``L`` layers on average and is one of ``D / n`` stages, so
    under 1F1B the first of them keeps ``D / n`` micro-batches in flight. When the
    replicated state of ``k`` layers (parameters, optimizer state and gradient sums whole;
    the largest layer's, times ``k``) plus ``D / n`` micro-batches of their activations
    (split over the ``n`` devices, as the memory model splits them) exceed
    ``memory_budget``, the ILP must split the parameters there (Alpa's option of that
    name). The layer ILPs are otherwise solved without the budget, which they would keep
    data parallel where communication says so. The stages compile with the
    configuration's option, so the plan priced is the plan run."""
    if problem.option.force_data_parallel or not problem.option.allow_replicated_parameters:
        return problem
    facts = [_layer_facts(problem, layer) for layer in range(problem.num_layers)]
    state = max(f.state_bytes for f in facts)
    activation = max(f.activation_bytes for f in facts)
    configs = []
    for (hosts, per_host), choices in zip(problem.submesh_choices, problem.configs, strict=True):
        n = hosts * per_host
        layers = problem.num_layers * n / num_devices
        in_flight = num_devices / n
        average_stage = layers * (state + in_flight * activation / n)
        if n > 1 and average_stage > problem.memory_budget:
            choices = tuple(
                LogicalConfig(
                    c.shape,
                    tuple(sorted({**c.option_dict, "allow_replicated_parameters": False}.items())),
                )
                for c in choices
            )
        configs.append(choices)
    return dataclasses.replace(problem, configs=tuple(configs))


# ----------------------------------------------------------------------------- per layer


@dataclass(frozen=True)
class _LayerFacts:
    flops: float
    state_bytes: float  # parameters, optimizer state and gradient sums of the layer
    param_bytes: float  # the parameters its forward/backward read
    activation_bytes: float  # per micro-batch: batch values its forward keeps for its backward
    entering_bytes: float  # per micro-batch: what it reads from earlier layers


def _layer_facts(problem: StageProblem, layer: int) -> _LayerFacts:
    program = problem.program
    invars = set(program.closed_jaxpr.jaxpr.invars)
    comps = problem.layer_comps([layer])
    forward = program.computation(layer, "forward")
    backward = program.computation(layer, "backward")
    flops = jaxpr_flops(e for c in comps for e in c.eqns)
    read = {v for c in comps for v in c.invars}
    params = [v for v in read if v in invars and v not in program.batch_dependent]
    param_bytes = float(sum(_nbytes(v) for v in params))
    state = [
        v
        for v in invars
        if v not in program.batch_dependent and layer in program.input_stages.get(v, ())
    ]
    state_bytes = float(sum(_nbytes(v) for v in state)) + param_bytes  # + gradient sums
    kept = set()
    if forward is not None and backward is not None:
        # Per micro-batch: what depends on the batch. Weights the forward hands on to the
        # backward (a marker passes them along) are the parameters' own buffers, in state.
        kept = set(forward.outvars) & set(backward.invars) & program.batch_dependent
    activation = float(sum(_nbytes(v) for v in kept))
    entering = 0.0
    if forward is not None:
        entering = float(
            sum(
                _nbytes(v)
                for v in forward.invars
                if _is_var(v) and v not in invars and program.home.get(v, layer) < layer
            )
        )
    return _LayerFacts(flops, state_bytes, param_bytes, activation, entering)


def layer_flops(problem: StageProblem) -> np.ndarray:
    """Per layer ``l``, :math:`F_l`: the FLOPs (``tracing.flops``) of its forward and
    backward, as the analytic model counts them (Alpa's stage imbalance bound weighs
    layers by the same sum)."""
    return np.array([_layer_facts(problem, layer).flops for layer in range(problem.num_layers)])


def _per_device_bytes(aval, spec: PartitionSpec | None, mesh_shape, axis_names) -> float:
    total = float(np.prod(aval.shape, dtype=np.float64) * aval.dtype.itemsize)  # keys too
    if spec is None:
        return total
    split = 1
    for entry in spec:
        for axis in entry if isinstance(entry, tuple) else (entry,):
            if axis is not None:
                split *= mesh_shape[list(axis_names).index(axis)]
    return total / split


def _ilp_layer(problem: StageProblem, step: TracedStep, m: int, config: LogicalConfig):
    """(communication seconds, fraction of the parameters' bytes on one device) of one
    layer's ``step`` on submesh choice ``m`` with ``config``."""
    mesh = problem.logical_mesh(m, config)
    option = problem.config_option(config)
    # Priced as the stages run (no partial sums carried through adds). The latency
    # takes the plan's communication only: its compute is F_l / (n_m R) (module
    # docstring), and the ILP's objective holds its own compute estimate too.
    solution = solve_auto_sharding(step, mesh, option, partial_sums=False)
    plan = solution.to_sharding_plan()
    communication = ilp_solver.communication_cost(solution.graph, solution.solution.choice)
    invars = step.jaxpr.invars
    program_inputs = set(problem.program.closed_jaxpr.jaxpr.invars)
    whole, local = 0.0, 0.0
    for v, spec in zip(invars, plan.in_specs, strict=True):
        if v in program_inputs and v not in problem.program.batch_dependent:
            whole += _nbytes(v)
            local += _per_device_bytes(
                v.aval, spec, plan.logical_mesh.shape, plan.logical_mesh.axis_names
            )
    fraction = local / whole if whole else 1.0
    return float(communication), fraction


class _LayerPlans:
    """Every layer's :func:`_ilp_layer` on every configuration, solved up front, one ILP per
    distinct (layer jaxpr, submesh, configuration); ``get(layer, m, config)`` reads it.

    The ILPs run ``workers`` at a time on threads (default: one per CPU): each builds its
    strategy graph in Python, under the GIL, while CBC solves another in its own process,
    so even two cores overlap the two halves. Results do not depend on the order.
    """

    def __init__(self, problem: StageProblem, workers: int | None = None):
        steps: dict = {}  # (layer, devices) -> (its step, its structure key)
        jobs: dict = {}  # ILP key -> (step, m, config)

        def ilp_key(layer: int, m: int, config: LogicalConfig):
            n = int(np.prod(problem.submesh_choices[m]))
            if not uses_ilp(problem.config_option(config), n):
                return None
            if (layer, n) not in steps:
                step, _ = problem.stage_step(layer, layer, n)
                steps[layer, n] = (step, structure_key(step))
            step, structure = steps[layer, n]
            key = (structure, problem.submesh_choices[m], config)
            jobs.setdefault(key, (step, m, config))
            return key

        self._keys = {  # (layer, m, config) -> its ILP's key; None: planned without one
            (layer, m, config): ilp_key(layer, m, config)
            for m, configs in enumerate(problem.configs)
            for config in configs
            for layer in range(problem.num_layers)
        }
        solved = map_on_threads(
            lambda job: _ilp_layer(problem, *job), list(jobs.values()), workers, "alpa-stage-ilp"
        )
        self._solved = dict(zip(jobs, solved, strict=True))

    def get(self, layer: int, m: int, config: LogicalConfig) -> tuple[float, float]:
        key = self._keys[layer, m, config]
        return (0.0, 1.0) if key is None else self._solved[key]


def _stage_memory(problem: StageProblem, facts: Sequence[_LayerFacts], plans: _LayerPlans):
    """``memory(i, j, m, c, config) -> (state, activation)`` bytes per device of a stage of
    layers ``i..j`` (module docstring)."""

    def memory(i, j, m, c, config):
        n = int(np.prod(problem.submesh_choices[m]))
        state = activation = 0.0
        for layer in range(i, j + 1):
            _, fraction = plans.get(layer, m, config)
            state += facts[layer].state_bytes * fraction
            activation += facts[layer].activation_bytes / n
        return state, activation

    return memory


def _fill(problem: StageProblem, latency_of, memory_of) -> StageCosts:
    """Tables from per-(layers, m, c) latency and (state, activation) bytes per device."""
    L, M, C = problem.num_layers, len(problem.submesh_choices), problem.num_configs
    cost = np.full((L, L, M, C), np.inf)
    succ = np.full((L, L, M, C), -1, dtype=np.int64)
    memory = np.full((L, L, M, C), np.inf)
    budget = problem.memory_budget
    for m, configs in enumerate(problem.configs):
        for c, config in enumerate(configs):
            for i in range(L):
                for j in range(i, L):
                    state, activation = memory_of(i, j, m, c, config)
                    memory[i, j, m, c] = state + activation
                    if activation > 0:
                        fits = math.floor((budget - state) / activation) - 1
                    else:
                        fits = L if state <= budget else -1
                    fits = min(fits, L)
                    if fits < 0:
                        continue
                    succ[i, j, m, c] = fits
                    cost[i, j, m, c] = latency_of(i, j, m, c, config)
    return StageCosts(cost, succ, memory)


class AnalyticStageCost:
    """Latency from FLOPs and the ILP's communication cost (module docstring).

    Args:
      cross_mesh_bandwidth: bytes/s between stages; default the cluster's inter-node
        bandwidth; ``float("inf")`` makes transfers free.
      workers: layer ILPs solved at once, on threads (default: one per CPU; the tables do
        not depend on it).
    """

    def __init__(self, cross_mesh_bandwidth: float | None = None, workers: int | None = None):
        if workers is not None and (isinstance(workers, bool) or workers < 1):
            raise ValueError(f"AnalyticStageCost: workers must be >= 1, got {workers!r}")
        self.cross_mesh_bandwidth = cross_mesh_bandwidth
        self.workers = workers

    def __call__(self, problem: StageProblem) -> StageCosts:
        cluster = problem.cluster
        bandwidth = self.cross_mesh_bandwidth or cluster.inter_node_bandwidth
        facts = [_layer_facts(problem, layer) for layer in range(problem.num_layers)]
        plans = _LayerPlans(problem, self.workers)

        def latency(i, j, m, c, config):
            n = int(np.prod(problem.submesh_choices[m]))
            total = 0.0
            for layer in range(i, j + 1):
                comm, _ = plans.get(layer, m, config)
                total += facts[layer].flops / (n * cluster.device_flops) + comm
            if i > 0:
                total += 2 * facts[i].entering_bytes / bandwidth
            return total

        return _fill(problem, latency, _stage_memory(problem, facts, plans))


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
        facts = [_layer_facts(problem, layer) for layer in range(problem.num_layers)]
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

        memory = _stage_memory(problem, facts, _LayerPlans(problem))
        return _fill(problem, latency, memory)

    def _time(self, step: TracedStep, mesh, option: AutoShardingOption) -> float:
        import jax
        import jax.numpy as jnp

        from alpa.shard_parallel.executable import compile_shard_executable

        plan = plan_auto_sharding(step, mesh, option, partial_sums=False)  # as the stages run
        executable = compile_shard_executable(step, plan, None)
        args = [jnp.zeros(a.shape, a.dtype) for a in step.in_avals]
        args = executable.preshard_flat_args(args)
        jax.block_until_ready(executable.launch(args))
        times = []
        for _ in range(self.repeat):
            start = time.perf_counter()
            jax.block_until_ready(executable.launch(args))
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    def _load(self) -> dict:
        try:
            with open(self.cache_file) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def _save(self, cache: dict) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.cache_file)), exist_ok=True)
        tmp = self.cache_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(cache, f)
        os.replace(tmp, self.cache_file)
