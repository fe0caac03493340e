"""What one benchmark case is: a batch, a model, micro-batches and a way to parallelize.

A suite (``suite_gpt``, ``suite_moe``, ``suite_wresnet``) maps a device count to a list of
:class:`BenchmarkCase`; ``benchmark.py --suite gpt.perf_test_auto`` runs the list whose key is
the number of devices of the cluster. Cases are plain data (no jax, no alpa), so the suites
can be read, listed and compared without starting a backend.

The model configurations keep the fields and names of Alpa's suites (``GPTModelConfig``,
``MoEModelConfig``, ``WResNetModelConfig``) plus a ``dtype`` (``"float16"`` as in Alpa's GPU
runs, ``"float32"`` on CPU). The parallel arguments are Alpa's four parallel modes:

=================  ===================  ================================================
class              Alpa's mode          method built by ``benchmark_one_case``
=================  ===================  ================================================
``ShardArgs``      ``"2d_shard"``       ``ShardParallel`` on one logical mesh
``UniformArgs``    ``"uniform"``        ``PipeshardParallel``: ``pp`` equal stages, each
                                        on a ``dp x op`` submesh, layers at the model's
                                        block boundaries (``ManualLayerOption``)
``SolutionArgs``   ``"load_solution"``  ``PipeshardParallel``: ``AutoLayerOption`` and the
                                        stages of a known plan (``ManualStageOption``)
``SearchArgs``     ``"search"``         ``PipeshardParallel``: ``AutoLayerOption`` and
                                        ``stage_option="auto"`` (the stage DP)
=================  ===================  ================================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

DTypeName = Literal["float32", "float16", "bfloat16"]
RematMode = Literal["none", "coarse_grained_remat", "fine_grained_remat"]

#: Alpa's per-stage option that maps the batch dimension to logical mesh axis 0.
FORCE_DP: Mapping[str, Any] = {"force_batch_dim_to_mesh_dim": 0}

# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class GPTModelConfig:
    """A GPT (``alpa.model.gpt``); Alpa's field order."""

    seq_len: int
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    dtype: DTypeName = "float16"


@dataclass(frozen=True)
class MoEModelConfig:
    """An MoE language model (``alpa.model.moe``): a GPT whose every other block has
    ``num_experts`` experts routing groups of ``expert_group_size`` tokens; Alpa's fields."""

    seq_len: int
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    num_experts: int
    expert_group_size: int
    dtype: DTypeName = "float16"


@dataclass(frozen=True)
class WResNetModelConfig:
    """A Wide-ResNet (``alpa.model.wide_resnet``) of ``num_layers`` (10, 18, 34: basic
    blocks; 50, 101, 152, 200: bottleneck blocks) with ``num_channels`` base filters and an
    ImageNet stem; Alpa's fields."""

    image_size: int
    num_layers: int
    num_channels: int
    width_factor: int
    dtype: DTypeName = "float32"
    num_classes: int = 1024


ModelConfig = GPTModelConfig | MoEModelConfig | WResNetModelConfig

# ----------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class ShardArgs:
    """``ShardParallel`` on one logical mesh of all devices."""

    logical_mesh_shape: tuple[int, int]
    prefer_reduce_scatter: bool = False
    force_batch_dim_mapping: bool = False


@dataclass(frozen=True)
class UniformArgs:
    """``pp`` pipeline stages of equal layers, each on a ``(dp, op)`` logical submesh;
    ``dp * op * pp`` is the number of devices. ``use_remat`` recomputes each stage's
    forward in its backward (``ManualLayerOption(remat_layer=True)``)."""

    dp: int
    op: int
    pp: int
    prefer_reduce_scatter: bool = True
    use_remat: bool = True
    force_batch_dim_mapping: bool = True


@dataclass(frozen=True)
class SolutionArgs:
    """A known plan: ``layer_num`` clustered layers; per stage its layers, physical
    submesh ``(hosts, devices_per_host)``, logical shape and ``AutoShardingOption`` fields
    (``ManualStageOption``)."""

    layer_num: int
    forward_stage_layer_ids: Sequence[Sequence[int]]
    submesh_physical_shapes: Sequence[tuple[int, int]]
    submesh_logical_shapes: Sequence[tuple[int, int]]
    submesh_autosharding_option_dicts: Sequence[Mapping[str, Any]]
    remat_mode: RematMode = "coarse_grained_remat"
    prefer_reduce_scatter: bool = True


@dataclass(frozen=True)
class SearchArgs:
    """``layer_num`` clustered layers; stages, submeshes and logical shapes chosen by the
    stage DP. ``auto_stage_option`` holds ``AutoStageOption`` fields."""

    layer_num: int
    auto_stage_option: Mapping[str, Any] = field(default_factory=dict)
    remat_mode: RematMode = "coarse_grained_remat"
    prefer_reduce_scatter: bool = True


ParallelArgs = ShardArgs | UniformArgs | SolutionArgs | SearchArgs

# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class BenchmarkCase:
    """One row of a suite: the global batch size, the model, the number of micro-batches
    the batch is split into, and the parallel method."""

    batch_size: int
    model_config: ModelConfig
    num_micro_batches: int
    parallel_args: ParallelArgs

    def __post_init__(self) -> None:
        if self.batch_size % self.num_micro_batches:
            raise ValueError(
                f"num_micro_batches={self.num_micro_batches} does not divide "
                f"batch_size={self.batch_size}"
            )


#: A suite: per number of devices, the cases to run on a cluster of that many devices.
Suite = Mapping[int, Sequence[BenchmarkCase]]


#: Alpa's stage-search space for GPT and MoE: small power-of-two submeshes, every logical
#: shape.
TRANSFORMER_AUTO_STAGE_OPTION = {
    "submesh_physical_shape_space": "small_power_of_two",
    "submesh_logical_shape_space": "all",
}


def search_cases(
    model_config, batch_size: int, num_micro_batches: list[int], layer_nums: list[int]
) -> list[BenchmarkCase]:
    """Stage-search cases of one model: every (micro-batches, layer number) pair."""
    return [
        BenchmarkCase(
            batch_size,
            model_config,
            micro_batches,
            SearchArgs(layer_num, TRANSFORMER_AUTO_STAGE_OPTION),
        )
        for micro_batches in num_micro_batches
        for layer_num in layer_nums
    ]


def transformer_cpu_cases(model_config) -> list[BenchmarkCase]:
    """The ``cpu_test`` cases of GPT and MoE on 8 devices, one per parallel mode."""
    return [
        BenchmarkCase(16, model_config, 2, ShardArgs((2, 4))),
        BenchmarkCase(32, model_config, 4, UniformArgs(2, 2, 2, use_remat=False)),
        BenchmarkCase(
            32,
            model_config,
            4,
            SolutionArgs(
                4,
                [[0, 1], [2, 3]],
                [(1, 4)] * 2,
                [(4, 1), (2, 2)],
                [FORCE_DP, {}],
                remat_mode="fine_grained_remat",
            ),
        ),
        BenchmarkCase(32, model_config, 4, SearchArgs(4, remat_mode="none")),
    ]
