"""The stage DP's problem: the step split per layer, the submeshes and their views.

A :class:`StageProblem` is what a stage cost model (``stage_cost``) is given: the step
split with one stage per layer, the submesh choices ``(hosts, devices_per_host)`` and,
per submesh, its logical configurations (:class:`LogicalConfig`: a 2-D logical shape and
``AutoShardingOption`` fields, from the space ``get_logical_configs`` names). The model
returns :class:`StageCosts`, the tables the DP (``stage_dp``) reads.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from alpa.device_mesh import ClusterSpec, VirtualPhysicalMesh
from alpa.pipeline_parallel.program.computation import PipelineProgram
from alpa.pipeline_parallel.program.stage_sharding import merged_step
from alpa.pipeline_parallel.stages.layer_facts import LayerFacts, compute_layer_facts, layer_comps
from alpa.shard_parallel.auto_sharding import AutoShardingOption
from alpa.tracing import StepJaxpr, TracedStep

LOGICAL_SHAPE_SPACES = (
    "single_node_model_parallel",
    "all",
    "same_as_physical",
    "data_parallel_only",
    "model_parallel_only",
)


@dataclass(frozen=True)
class LogicalConfig:
    """One way to view a submesh: a 2-D logical shape and ``AutoShardingOption`` fields
    (kept sorted by name, so that the same option given in another order is the same
    configuration: one column of the stage DP's tables, one ILP per layer)."""

    shape: tuple[int, int]
    option_items: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "option_items", tuple(sorted(self.option_items)))

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
      num_micro_batches: micro-batches per step (the gradient reductions, once per step,
        are amortised over them).
      remat: each stage's backward recomputes its forward (stage-level remat).
    """

    traced: TracedStep
    program: PipelineProgram
    names: dict
    submesh_choices: tuple[tuple[int, int], ...]
    configs: tuple[tuple[LogicalConfig, ...], ...]
    cluster: ClusterSpec
    option: AutoShardingOption
    memory_budget: float
    num_micro_batches: int = 1
    remat: bool = False

    @property
    def num_layers(self) -> int:
        return self.program.num_stages

    @functools.cached_property
    def layer_facts(self) -> list[LayerFacts]:
        """Every layer's facts (FLOPs, state, activations), computed once."""
        return [compute_layer_facts(self.program, layer) for layer in range(self.num_layers)]

    @property
    def num_configs(self) -> int:
        return max(len(c) for c in self.configs)

    def layer_comps(self, layers: Sequence[int]) -> list:
        return layer_comps(self.program, layers)

    def stage_step(self, first: int, last: int, num_devices: int) -> tuple[StepJaxpr, set]:
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
    # [i, j, m, c]: of ``memory``, the part held per micro-batch in flight (the rest is
    # held once: state, temporaries); ``None`` where the model does not say (a table
    # saved by an older alpa, a cost model of the user's).
    per_micro_batch_memory: np.ndarray | None = None


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
    (split over the ``n`` devices, as a data-parallel stage splits them; under stage
    remat, only the batch values entering a layer) exceed ``memory_budget``, the ILP must
    split the parameters there (Alpa's option of that name). The layer ILPs are otherwise
    solved without the budget, which they would keep data parallel where communication
    says so. The stages compile with the configuration's option, so the plan priced is
    the plan run."""
    if problem.option.force_data_parallel or not problem.option.allow_replicated_parameters:
        return problem
    facts = problem.layer_facts
    state = max(f.state_bytes for f in facts)
    if problem.remat:
        activation = max(f.entering_bytes + f.batch_arg_bytes for f in facts)
    else:
        activation = max(f.activation_bytes for f in facts)
    configs = []
    for (hosts, per_host), choices in zip(problem.submesh_choices, problem.configs, strict=True):
        n = hosts * per_host
        layers = problem.num_layers * n / num_devices
        in_flight = num_devices / n
        average_stage = layers * (state + in_flight * activation / n)
        if n > 1 and average_stage > problem.memory_budget:
            choices = tuple(
                dict.fromkeys(
                    LogicalConfig(
                        c.shape,
                        tuple({**c.option_dict, "allow_replicated_parameters": False}.items()),
                    )
                    for c in choices
                )
            )
        configs.append(choices)
    return dataclasses.replace(problem, configs=tuple(configs))


def layer_flops(problem: StageProblem) -> np.ndarray:
    """Per layer ``l``, :math:`F_l`: the FLOPs (``tracing.flops``) of its forward and
    backward, as the analytic model counts them (Alpa's stage imbalance bound weighs
    layers by the same sum)."""
    return np.array([facts.flops for facts in problem.layer_facts])
