"""PipeshardParallel: pipeline stages on submeshes, each stage sharded on its own mesh.

The user's boundaries (``alpa.mark_pipeline_boundary()``) cut the forward pass into layers
(``layer_option``); consecutive layers form stages, each on a slice of the devices
(``stage_option``); micro-batches flow through a schedule (``pipeline_schedule``). See
``pipeshard_executable`` for the passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from alpa.executable import Executable
from alpa.parallel_method import ParallelMethod
from alpa.pipeline_parallel.layer_construction import resolve_layer_option
from alpa.pipeline_parallel.pipeshard_executable import compile_pipeshard_executable
from alpa.pipeline_parallel.schedules import schedules
from alpa.pipeline_parallel.stage_construction import resolve_stage_option
from alpa.pipeline_parallel.user_shardings import (
    check_axis_names,
    check_manual_sharding_option,
    check_stage_input_shardings,
)
from alpa.tracing import TracedStep


class PipeshardParallel(ParallelMethod):
    """Inter-operator (pipeline) plus intra-operator parallelism.

    Args:
      devices: ``None`` (the devices of ``alpa.init``), a ``LocalPhysicalDeviceMesh`` or a
        list of jax devices.
      num_micro_batches: micro-batches per step; divides the batch size.
      default_auto_sharding_option: ``AutoShardingOption`` of every stage (default
        ``AutoShardingOption()``: the ILP shards each stage on its logical submesh); the
        stage option's per-stage dicts override its fields.
      pipeline_schedule: ``"1f1b"``, ``"gpipe"`` or ``"inference"``.
      layer_option: ``"manual"`` or ``ManualLayerOption``.
      stage_option: ``"uniform"``, ``UniformStageOption`` or ``ManualStageOption``.
      stage_input_shardings: per stage, a list with a ``PartitionSpec`` (or ``None``) per
        input of the stage (``executable.get_stage_input_names()``), in the submesh's
        axes ``("x", "y")`` or those of ``manual_sharding_option``.
      manual_sharding_option: a ``ManualShardingOption`` whose ``in_axis_resources`` /
        ``out_axis_resources`` pin the step's inputs and outputs on the stages that read
        or produce them, in the axis names ``submesh_axis_names[stage]`` (default
        ``mesh_axis_names``). See ``alpa.pipeline_parallel.user_shardings``.
    """

    def __init__(
        self,
        devices=None,
        num_micro_batches: int = 1,
        default_auto_sharding_option=None,
        pipeline_schedule: str = "1f1b",
        layer_option=None,
        stage_option=None,
        stage_input_shardings=None,
        manual_sharding_option=None,
    ):
        if (
            isinstance(num_micro_batches, bool)
            or not isinstance(num_micro_batches, int)
            or num_micro_batches < 1
        ):
            raise ValueError(f"num_micro_batches must be a positive int, got {num_micro_batches!r}")
        if pipeline_schedule not in schedules:
            raise ValueError(
                f"unknown pipeline_schedule {pipeline_schedule!r}; expected one of "
                f"{sorted(schedules)}"
            )
        if manual_sharding_option is not None:
            manual_sharding_option = check_manual_sharding_option(manual_sharding_option)
        if stage_input_shardings is not None:
            stage_input_shardings = check_stage_input_shardings(stage_input_shardings)
        check_axis_names(manual_sharding_option, stage_input_shardings)
        self.manual_sharding_option = manual_sharding_option
        self.stage_input_shardings = stage_input_shardings
        self.devices = devices
        self.num_micro_batches = num_micro_batches
        self.default_auto_sharding_option = default_auto_sharding_option
        self.pipeline_schedule = pipeline_schedule
        self.layer_option = resolve_layer_option(layer_option)
        self.stage_option = resolve_stage_option(stage_option)

    def _devices(self) -> list[Any]:
        devices = self.devices
        if devices is None:
            from alpa.api import get_global_physical_mesh

            return list(get_global_physical_mesh().devices)
        if hasattr(devices, "devices"):
            return list(devices.devices)
        return list(devices)

    def compile_executable(self, traced: TracedStep, args: Sequence[Any]) -> Executable:
        return compile_pipeshard_executable(
            traced,
            self._devices(),
            self.num_micro_batches,
            pipeline_schedule=self.pipeline_schedule,
            layer_option=self.layer_option,
            stage_option=self.stage_option,
            default_auto_sharding_option=self.default_auto_sharding_option,
            manual_sharding_option=self.manual_sharding_option,
            stage_input_shardings=self.stage_input_shardings,
            args=args,
        )

    def __repr__(self) -> str:
        return (
            f"PipeshardParallel(num_micro_batches={self.num_micro_batches}, "
            f"pipeline_schedule={self.pipeline_schedule!r}, "
            f"stage_option={self.stage_option!r})"
        )
