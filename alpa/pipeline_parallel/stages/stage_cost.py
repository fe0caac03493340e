"""Stage costs for the stage DP: what one stage of layers ``i..j`` costs on a submesh.

The DP (``stage_dp.training_dp``) reads two tables indexed ``[i, j, m, c]``: the latency
of one micro-batch through a stage of layers ``i..j`` (inclusive) on submesh choice ``m``
with logical configuration ``c``, and how many stages may follow it (its memory). A
``stage_problem.StageCostModel`` fills them from a ``stage_problem.StageProblem``: the
step split with one stage per layer, the submesh choices and, per submesh, its logical
configurations (what each layer reads: ``layer_facts``).

Two models:

* :class:`AnalyticStageCost` (the default; needs no device, so it plans for a
  ``ClusterSpec`` that is not here). Per layer ``l`` and configuration, the forward and
  backward equations of ``l`` are planned by the same auto-sharding ILP the stage would
  be compiled with, on that logical submesh; the latency of one micro-batch is

  .. math::  t(i, j, m, c) = \\sum_{l=i}^{j} \\Big(\\frac{F_l + r F^{fwd}_l}{n_m R}
             + K_l(m, c) + \\frac{G_l(m, c)}{B}\\Big) + [i > 0] \\, \\frac{2 X_i}{W}

  with :math:`F_l` the layer's FLOPs, forward and backward (``tracing.flops``),
  :math:`F^{fwd}_l` its forward's, recomputed in the backward when ``r = 1``
  (``remat_layer`` / ``remat_mode="coarse_grained_remat"``), :math:`R` the device's peak
  FLOP/s, :math:`K_l` the seconds of the collectives the ILP's plan runs once per
  micro-batch (alpha-beta model of the cluster; the ILP's objective also holds a compute
  estimate, which is not added again), :math:`G_l` the seconds of its gradient
  reductions over the data axes, which every stage defers to apply-grad
  (``deferred_sums``) and so runs once per step, amortised over the :math:`B`
  micro-batches (a data-parallel configuration: one all-reduce of the layer's parameter
  bytes over the submesh), :math:`X_i` the bytes entering layer ``i`` from earlier layers
  (sent forward, their cotangents sent back) and :math:`W` the cross-mesh bandwidth
  (``inf``: free). Layers with identical jaxprs are planned once.

  Memory per device: the stage's state (parameters, optimizer state, gradient sums) at
  the fraction of the parameters' bytes the ILP's input shardings leave on one device;
  per micro-batch in flight, the activations its forward keeps for its backward (the
  values that depend on the batch, each at the bytes per device of the ILP's sharding of
  it; split over the submesh in a data-parallel configuration), or under ``r = 1`` only
  the batch values entering the stage; and once, the temporaries of its largest layer
  (``layer_facts.temporary_bytes``: the jaxpr's liveness, leaving out the elementwise values XLA
  fuses away where the cluster's backend fuses, ``ClusterSpec.fuses_elementwise``) and
  the cotangent its backward sends to the stage before. Under ``r = 1`` the temporaries
  are the backward's while it recomputes one micro-batch's activations: at layer ``l``,
  the activations layers ``i..l-1`` keep plus the liveness of ``l``'s forward and
  backward with its own kept activations freed at their last read
  (:func:`stage_memory`, ``layer_facts.recomputed_bytes``).
  Under 1F1B a stage followed by ``k`` stages holds
  ``k + 1`` micro-batches, so ``max_n_succ_stages = floor((budget - state - once) /
  per_micro_batch) - 1`` (``-1``, and an ``inf`` latency, when not even one fits). The
  layer ILPs run without the budget; on a submesh where the replicated state of an
  average stage cannot fit next to its micro-batches in flight, its configurations ask
  the ILP to split parameters (``stage_problem.split_parameters_under_memory_pressure``).

  :func:`predict_stage_plan` prices any stage plan (manual ones too) with the same
  model, so a hand plan and the DP's compare on equal terms.

* ``measured_stage_cost.MeasuredStageCost``: compiles and times every candidate stage on
  the real submesh; memory as in the analytic model.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from alpa.pipeline_parallel.program.deferred_sums import splits_over
from alpa.pipeline_parallel.program.stage_sharding import equations_key, uses_ilp
from alpa.pipeline_parallel.stages.layer_facts import (
    LayerFacts,
    held_values,
    per_device_bytes,
    recomputed_bytes,
    temporary_bytes,
)
from alpa.pipeline_parallel.stages.stage_problem import LogicalConfig, StageCosts, StageProblem
from alpa.pipeline_parallel.stages.stage_work import equations_seconds, instructions_per_micro_batch
from alpa.shard_parallel.auto_sharding import (
    solve_auto_sharding,
)
from alpa.shard_parallel.ilp import ilp_solver
from alpa.shard_parallel.ilp.milp import taking_turns
from alpa.shard_parallel.strategies.sharding_spec import Collective, num_shards
from alpa.tracing import StepJaxpr
from alpa.tracing.jaxpr_util import nbytes
from alpa.util import map_on_threads


@dataclass(frozen=True)
class LayerPlanCost:
    """What one layer costs in one configuration of a submesh (per device).

    Attributes:
      communication: seconds of the collectives run once per micro-batch.
      gradient_sync: seconds of the gradient reductions over the data axes, run once per
        step (``deferred_sums``).
      communication_bytes: the bytes per device of those per-micro-batch collectives, by
        HLO kind (``sharding_spec.Collective``'s convention: the buffer an all-reduce
        reduces, the result an all-gather gathers, ...).
      gradient_sync_bytes: the same of the once-per-step gradient reductions.
      param_fraction: the fraction of the parameters' bytes on one device.
      kept_bytes: per micro-batch, the activations its forward keeps for its backward.
      entering_bytes: per micro-batch, the batch values it reads from earlier layers.
      batch_arg_bytes: per micro-batch, the step's batch arguments it reads.
      temporary_bytes: what its forward and backward hold only while they run: the
        most bytes of the values they compute and free again (not its inputs, outputs
        or kept activations) live at once (``layer_facts.temporary_bytes``).
      recomputed_bytes: under stage remat, the most bytes its backward holds at once
        while it recomputes its forward and runs, the kept activations among them, each
        until its last read (``layer_facts.recomputed_bytes``).
      gathered_bytes: the copies of its parameters its plan gathers to a larger share
        per device than they are stored in (a parameter split for storage and gathered
        for its use, as ZeRO-3 does): the bytes per device of each distinct gathered
        copy. XLA holds them while the programs that read them run.
      compute: with a cluster profile, the seconds one device spends on its forward and
        backward per micro-batch at the measured rates (``stage_work``); else 0.
      apply: with a cluster profile, the seconds of its apply-grad, once per step.
    """

    communication: float
    gradient_sync: float
    communication_bytes: dict
    gradient_sync_bytes: dict
    param_fraction: float
    kept_bytes: float
    entering_bytes: float
    batch_arg_bytes: float
    temporary_bytes: float = 0.0
    recomputed_bytes: float = 0.0
    gathered_bytes: float = 0.0
    compute: float = 0.0
    apply: float = 0.0


def _data_parallel_layer(
    problem: StageProblem, facts: LayerFacts, step: StepJaxpr, m: int, config
) -> LayerPlanCost:
    """A layer with no ILP (its ``step`` on the submesh): everything batch-dependent
    split over the ``n`` devices, parameters replicated, one all-reduce of its gradients
    per step."""
    n = int(np.prod(problem.submesh_choices[m]))
    batch = problem.program.batch_dependent
    sync = 0.0
    reductions = []
    mesh = problem.logical_mesh(m, config)
    if n > 1:
        flat = mesh.one_axis()
        sync = flat.all_reduce_cost(facts.param_bytes, 1)
        reductions.append(Collective("all-reduce", 1, facts.param_bytes))
    compute = apply = 0.0
    bytes_of = lambda v: nbytes(v) / n if v in batch else float(nbytes(v))  # noqa: E731
    fused = problem.cluster.fuses_elementwise
    if mesh.rates is not None:
        eqns = step.closed_jaxpr.jaxpr.eqns
        compute = equations_seconds(eqns, mesh, lambda v: 1.0 / n if v in batch else 1.0)
        apply = equations_seconds(facts.apply_eqns, mesh, lambda v: 1.0)
    return LayerPlanCost(
        communication=0.0,
        gradient_sync=sync,
        communication_bytes=ilp_solver.bytes_by_kind(()),
        gradient_sync_bytes=ilp_solver.bytes_by_kind(reductions),
        param_fraction=1.0,
        kept_bytes=facts.activation_bytes / n,
        entering_bytes=facts.entering_bytes / n,
        batch_arg_bytes=facts.batch_arg_bytes / n,
        temporary_bytes=temporary_bytes(
            step.closed_jaxpr.jaxpr, held_values(step, facts), bytes_of, fused=fused
        ),
        recomputed_bytes=recomputed_bytes(step, facts, bytes_of, fused=fused),
        compute=compute,
        apply=apply,
    )


def _ilp_layer(
    problem: StageProblem, facts: LayerFacts, step: StepJaxpr, m: int, config: LogicalConfig
) -> LayerPlanCost:
    """One layer's ``step`` planned by the ILP on submesh choice ``m`` with ``config``."""
    mesh = problem.logical_mesh(m, config)
    option = problem.config_option(config)
    # Priced as the stages run (the forward and the backward reshard their own copies).
    # The latency takes the plan's communication only: its compute is F_l / (n_m R)
    # (module docstring), and the ILP's objective holds its own compute estimate too.
    solution = solve_auto_sharding(step, mesh, option, comm_first=False, shared_reshardings=False)
    graph, choice = solution.graph, solution.solution.choice
    communication = ilp_solver.communication_cost(graph, choice)
    # The gradient row sums reduced over the data axes: deferred to once per step.
    data_axes = solution.data_axes()
    data = {list(mesh.axis_names).index(a) for a in data_axes}
    # A gradient row sum reduced over data axes (and perhaps model axes too): its
    # reductions over the data axes are the ones deferred, unless they split it there;
    # over a model axis (a row sum that also sums a dimension split there) it stays in
    # the backward, per micro-batch.
    gradient_nodes = {
        node.id for node in graph.nodes if any(v in facts.gradients for v in node.outvars)
    }
    once, per_micro = [], []
    sync = 0.0
    # A gradient the plan splits over a data axis is reduced in the backward, per
    # micro-batch, into its split (``deferred_sums.defer_gradient_sums``, as ZeRO-3).
    split_gradients = {
        node
        for node in gradient_nodes
        if any(
            splits_over(solution.partition_spec(g), data_axes)
            for v in graph.nodes[node].outvars
            for g in facts.gradients.get(v, ())
        )
    }
    for node, reduces, collective in ilp_solver.collectives(graph, choice):
        deferred = node in gradient_nodes and node not in split_gradients
        if reduces and deferred and collective.axis in data:
            once.append(collective)
            sync += collective.cost(mesh)
            if graph.nodes[node].combined and collective.kind == "all-reduce":
                # Paid once per axis (``strategy_costs.combined_latency``).
                sync -= mesh.collective_latency("all-reduce", collective.axis)
        else:
            per_micro.append(collective)
    plan_mesh = solution.mesh
    shape, names = plan_mesh.shape, plan_mesh.axis_names
    n = mesh.num_devices

    def planned(v) -> float:
        # Bytes per device as the ILP priced them; a value the plan does not name is
        # counted split over the submesh.
        source = graph.sources.get(v)
        if source is None:
            return nbytes(v) / n
        node, k = source
        return graph.nodes[node].out_bytes[k][choice[node]]

    def local(values) -> float:
        return sum(planned(v) for v in values)

    program_inputs = set(problem.program.closed_jaxpr.jaxpr.invars)
    whole = local_params = 0.0
    for v in step.jaxpr.invars:
        if v in program_inputs and v not in problem.program.batch_dependent:
            whole += nbytes(v)
            local_params += per_device_bytes(v.aval, solution.partition_spec(v), shape, names)
    fraction = local_params / whole if whole else 1.0
    parameters = {
        node
        for node in graph.input_nodes
        if any(
            v in program_inputs and v not in problem.program.batch_dependent
            for v in graph.nodes[node].outvars
        )
    }
    compute = apply = 0.0
    if mesh.rates is not None:
        compute = float(ilp_solver.compute_cost(graph, choice))
        apply = equations_seconds(facts.apply_eqns, mesh, lambda v: fraction)
    return LayerPlanCost(
        communication=float(communication) - sync,
        gradient_sync=sync,
        communication_bytes=ilp_solver.bytes_by_kind(per_micro),
        gradient_sync_bytes=ilp_solver.bytes_by_kind(once),
        param_fraction=fraction,
        kept_bytes=local(facts.kept),
        entering_bytes=local(facts.entering),
        batch_arg_bytes=local(facts.batch_args),
        temporary_bytes=temporary_bytes(
            step.closed_jaxpr.jaxpr,
            held_values(step, facts),
            planned,
            fused=problem.cluster.fuses_elementwise,
        ),
        recomputed_bytes=recomputed_bytes(
            step, facts, planned, fused=problem.cluster.fuses_elementwise
        ),
        gathered_bytes=_gathered_bytes(graph, choice, parameters),
        compute=compute,
        apply=apply,
    )


def _gathered_bytes(graph, choice, sources) -> float:
    """The bytes per device of the distinct larger copies (``(value, spec)``) the chosen
    plan reshards the values of the ``sources`` nodes into for their readers."""
    mesh = graph.mesh
    copies = {}
    for edge in graph.edges:
        if edge.src not in sources or not edge.src_specs:
            continue
        src, dst = edge.src_specs[choice[edge.src]], edge.dst_specs[choice[edge.dst]]
        if dst is None:
            continue
        stored = edge.nbytes / num_shards(src, mesh)
        held = edge.nbytes / num_shards(dst, mesh)
        if held > stored:
            copies[(edge.src, dst)] = held
    return float(sum(copies.values()))


class LayerPlans:
    """Every layer's :func:`_ilp_layer` on every configuration, solved up front, one ILP per
    distinct (layer jaxpr, submesh, configuration); ``get(layer, m, config)`` reads it.

    The ILPs run ``workers`` at a time on threads (default: one per CPU): each builds its
    strategy graph in Python, under the GIL, while CBC solves another in its own process,
    so even two cores overlap the two halves. Results do not depend on the order.
    """

    def __init__(self, problem: StageProblem, facts, workers: int | None = None):
        self._problem, self._facts = problem, facts
        steps: dict = {}  # (layer, devices) -> (its step, its structure key)
        equations: dict = {}  # layer -> equations_key of its step (the same for every n)
        jobs: dict = {}  # ILP key -> (layer, step, m, config)

        def ilp_key(layer: int, m: int, config: LogicalConfig):
            n = int(np.prod(problem.submesh_choices[m]))
            if not uses_ilp(problem.config_option(config), n):
                return None
            if (layer, n) not in steps:
                # The layer's step on n devices differs between n only in which inputs
                # are split as the batch.
                step, _ = problem.stage_step(layer, layer, n)
                if layer not in equations:
                    equations[layer] = equations_key(step)
                steps[layer, n] = (step, (equations[layer], step.batch_invars))
            step, structure = steps[layer, n]
            key = (structure, problem.submesh_choices[m], config)
            jobs.setdefault(key, (layer, step, m, config))
            return key

        self._keys = {  # (layer, m, config) -> its ILP's key; None: planned without one
            (layer, m, config): ilp_key(layer, m, config)
            for m, configs in enumerate(problem.configs)
            for config in configs
            for layer in range(problem.num_layers)
        }
        solved = map_on_threads(
            taking_turns(lambda job: _ilp_layer(problem, facts[job[0]], *job[1:])),
            list(jobs.values()),
            workers,
            "alpa-stage-ilp",
        )
        self._solved = dict(zip(jobs, solved, strict=True))
        self._steps = {key: step for key, (step, _) in steps.items()}
        self._data_parallel: dict = {}

    def get(self, layer: int, m: int, config: LogicalConfig) -> LayerPlanCost:
        key = self._keys[layer, m, config]
        if key is None:
            if (layer, m, config) not in self._data_parallel:
                n = int(np.prod(self._problem.submesh_choices[m]))
                if (layer, n) not in self._steps:
                    self._steps[layer, n] = self._problem.stage_step(layer, layer, n)[0]
                step = self._steps[layer, n]
                self._data_parallel[layer, m, config] = _data_parallel_layer(
                    self._problem, self._facts[layer], step, m, config
                )
            return self._data_parallel[layer, m, config]
        return self._solved[key]


def stage_memory(problem: StageProblem, plans: LayerPlans):
    """``memory(i, j, m, c, config) -> (state, per_micro_batch, once)`` bytes per device of
    a stage of layers ``i..j`` (module docstring): its state, the activations it keeps per
    micro-batch in flight, and what it holds once: the temporaries of its forward or
    backward (its layers run one after another and reuse them: the largest layer's), the
    cotangent its backward sends to the stage before and, under remat, one micro-batch's
    activations while its backward recomputes them.

    Under remat the backward runs the forwards of layers ``i..j``, then their backwards
    from ``j`` down: while layer ``l``'s forward and backward run, the activations layers
    ``i..l-1`` keep for their own backwards are held, and layer ``l``'s are live only until
    their last read (``LayerPlanCost.recomputed_bytes``), so it holds
    ``max_l (sum_{k<l} kept_k + recomputed_l)``, not every layer's kept activations plus
    the largest temporaries."""

    def memory(i, j, m, c, config):
        state = per_micro = once = temporaries = recomputing = 0.0
        facts = problem.layer_facts
        for layer in range(i, j + 1):
            cost = plans.get(layer, m, config)
            state += facts[layer].state_bytes * cost.param_fraction
            if problem.remat:
                # Kept: what enters the stage (the first layer's inputs from earlier
                # layers) and the batch arguments its layers read. The backward
                # recomputes every layer's forward, whose gathered parameters it reads
                # again: they stay, with the activations, until its layer's backward.
                per_micro += cost.batch_arg_bytes + (cost.entering_bytes if layer == i else 0.0)
                once += cost.gathered_bytes
                temporaries = max(
                    temporaries, cost.temporary_bytes, recomputing + cost.recomputed_bytes
                )
                recomputing += cost.kept_bytes
            else:
                per_micro += cost.kept_bytes
                temporaries = max(temporaries, cost.temporary_bytes + cost.gathered_bytes)
            if layer == i and problem.program.is_training:
                # The cotangent of what entered the stage, which its backward sends back.
                once += cost.entering_bytes
        return state, per_micro, once + temporaries

    return memory


def fill_tables(problem: StageProblem, latency_of, memory_of) -> StageCosts:
    """Tables from per-(layers, m, c) latency and (state, per micro-batch, once) bytes per
    device."""
    L, M, C = problem.num_layers, len(problem.submesh_choices), problem.num_configs
    cost = np.full((L, L, M, C), np.inf)
    succ = np.full((L, L, M, C), -1, dtype=np.int64)
    memory = np.full((L, L, M, C), np.inf)
    activations = np.full((L, L, M, C), np.inf)
    for m, configs in enumerate(problem.configs):
        for c, config in enumerate(configs):
            for i in range(L):
                for j in range(i, L):
                    state, per_micro, once = memory_of(i, j, m, c, config)
                    memory[i, j, m, c] = state + once + per_micro
                    activations[i, j, m, c] = per_micro
                    # Capped where it no longer binds: no plan has more than L - 1 stages
                    # after one, nor holds more than M micro-batches (GPipe and ZB-H1 in
                    # the DP read the table as micro-batches in flight, less one).
                    cap = max(L, problem.num_micro_batches)
                    fits = _stages_that_fit(problem.memory_budget, state + once, per_micro, cap)
                    if fits < 0:
                        continue
                    succ[i, j, m, c] = fits
                    cost[i, j, m, c] = latency_of(i, j, m, c, config)
    return StageCosts(cost, succ, memory, activations)


def _stages_that_fit(budget: float, fixed: float, per_micro: float, cap: int) -> int:
    """How many stages may follow a stage holding ``fixed`` bytes and ``per_micro`` per
    micro-batch in flight (1F1B: ``k`` followers, ``k + 1`` micro-batches), at most
    ``cap``; -1: none."""
    if per_micro > 0:
        fits = math.floor((budget - fixed) / per_micro) - 1
    else:
        fits = cap if fixed <= budget else -1
    return min(fits, cap)


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

    def stage_model(self, problem: StageProblem):
        """``(latency, memory, collective_bytes)``: functions of ``(i, j, m, c, config)``
        giving a stage's seconds per micro-batch, its ``(state, per micro-batch, once)``
        bytes, and its collectives' ``(per micro-batch, once per step)`` bytes by kind
        with its parameters' bytes per device."""
        cluster = problem.cluster
        bandwidth = self.cross_mesh_bandwidth or cluster.inter_node_bandwidth
        facts = problem.layer_facts
        plans = LayerPlans(problem, facts, self.workers)
        remat = 1.0 if problem.remat else 0.0
        micro = max(1, problem.num_micro_batches)

        profile = cluster.profile

        def latency(i, j, m, c, config):
            if profile is not None:
                return measured_latency(i, j, m, config)
            n = int(np.prod(problem.submesh_choices[m]))
            total = 0.0
            for layer in range(i, j + 1):
                cost = plans.get(layer, m, config)
                flops = facts[layer].flops + remat * facts[layer].forward_flops
                total += flops / (n * cluster.device_flops)
                total += cost.communication + cost.gradient_sync / micro
            if i > 0:
                total += 2 * facts[i].entering_bytes / bandwidth
            return total

        def measured_latency(i, j, m, config):
            # ``stage_work``'s module docstring: the same terms at the profile's rates.
            total = 0.0
            for layer in range(i, j + 1):
                cost = plans.get(layer, m, config)
                share = facts[layer].forward_flops / facts[layer].flops if facts[layer].flops else 0
                total += cost.compute * (1.0 + remat * share) + cost.communication
                total += (cost.gradient_sync + cost.apply) / micro
            if i > 0:
                entering = facts[i].entering_bytes
                if self.cross_mesh_bandwidth is None and profile.cross_mesh is not None:
                    total += 2 * profile.cross_mesh(entering)
                else:
                    total += 2 * entering / bandwidth
            return total + profile.instruction_seconds * instructions_per_micro_batch(i == 0)

        def collective_bytes(i, j, m, c, config):
            per_micro, once, params = Counter(), Counter(), 0.0
            for layer in range(i, j + 1):
                cost = plans.get(layer, m, config)
                per_micro.update(cost.communication_bytes)
                once.update(cost.gradient_sync_bytes)
                params += facts[layer].param_bytes * cost.param_fraction
            return dict(per_micro), dict(once), params

        return latency, stage_memory(problem, plans), collective_bytes

    def __call__(self, problem: StageProblem) -> StageCosts:
        latency, memory, _ = self.stage_model(problem)
        return fill_tables(problem, latency, memory)


@dataclass(frozen=True)
class StagePlanCost:
    """The analytic model's price of one stage plan.

    Attributes:
      step_seconds: ``sum(latencies) + (B - 1) * max(latencies)``, the DP's objective.
      latencies: per stage, seconds per micro-batch.
      memory: per stage, bytes per device with its micro-batches in flight under 1F1B.
      fits: per stage, whether that memory is within the budget.
      collective_bytes: per stage, the bytes per device of the collectives its forward
        and backward run per micro-batch, by HLO kind (``"all-reduce"``, ...; in
        ``sharding_spec.Collective``'s convention): what ``K`` prices.
      gradient_sync_bytes: per stage, the same of its gradient reductions, run once per
        step in apply-grad: what ``G`` prices.
      state_memory: per stage, the part of ``memory`` that is state (parameters,
        optimizer state, gradient sums).
      activation_memory: per stage, the part of ``memory`` held per micro-batch in
        flight (under remat, only the values entering the stage).
      parameter_memory: per stage, its parameters' bytes per device (the gradient sums
        are as many; the optimizer state is the rest of ``state_memory``).
    """

    step_seconds: float
    latencies: tuple[float, ...]
    memory: tuple[float, ...]
    fits: tuple[bool, ...]
    collective_bytes: tuple[dict, ...] = ()
    gradient_sync_bytes: tuple[dict, ...] = ()
    state_memory: tuple[float, ...] = ()
    activation_memory: tuple[float, ...] = ()
    parameter_memory: tuple[float, ...] = ()


def predict_stage_plan(
    problem: StageProblem,
    stages: Sequence[tuple[int, int, tuple[int, int], LogicalConfig]],
    model: AnalyticStageCost | None = None,
) -> StagePlanCost:
    """Price ``stages`` (per stage: first layer, last layer, submesh, logical
    configuration) with the analytic model, as the DP prices its own plans: a hand plan
    and the DP's compare on equal terms. Only the ILPs of the given configurations are
    solved. ``problem``'s submesh choices and configurations are replaced by the stages'."""
    shapes = tuple(dict.fromkeys(tuple(s[2]) for s in stages))
    configs = tuple(
        tuple(dict.fromkeys(s[3] for s in stages if tuple(s[2]) == shape)) for shape in shapes
    )
    problem = dataclasses.replace(problem, submesh_choices=shapes, configs=configs)
    latency_of, memory_of, bytes_of = (model or AnalyticStageCost()).stage_model(problem)
    latencies, memory, fits, per_micro_bytes, once_bytes = [], [], [], [], []
    states, activations, params = [], [], []
    num_stages = len(stages)
    for s, (i, j, shape, config) in enumerate(stages):
        m = shapes.index(tuple(shape))
        c = configs[m].index(config)
        latencies.append(latency_of(i, j, m, c, config))
        state, per_micro, once = memory_of(i, j, m, c, config)
        in_flight = min(num_stages - s, max(1, problem.num_micro_batches))
        memory.append(state + once + in_flight * per_micro)
        fits.append(memory[-1] <= problem.memory_budget)
        states.append(state)
        activations.append(per_micro)
        sent, synced, local_params = bytes_of(i, j, m, c, config)
        per_micro_bytes.append(sent)
        once_bytes.append(synced)
        params.append(local_params)
    micro = max(1, problem.num_micro_batches)
    total = sum(latencies) + (micro - 1) * max(latencies)
    return StagePlanCost(
        float(total),
        tuple(latencies),
        tuple(memory),
        tuple(fits),
        tuple(per_micro_bytes),
        tuple(once_bytes),
        tuple(states),
        tuple(activations),
        tuple(params),
    )
