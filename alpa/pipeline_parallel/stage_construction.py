"""Stage construction: which layers form each stage, and the submesh each stage runs on.

``ManualStageOption`` takes both from the user; ``UniformStageOption`` splits layers and
devices evenly. Either resolves to a :class:`StagePlan`. Submeshes are consecutive slices
of the devices, in stage order. The dynamic program that chooses both (paper §5.2) is in
``stage_dp`` (``get_submesh_choices``, ``training_dp``, re-exported here at Alpa's path);
``AutoStageOption``, which feeds it stage costs, is not there yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from alpa.pipeline_parallel.stage_dp import get_submesh_choices, training_dp  # noqa: F401


@dataclass(frozen=True)
class ManualStageOption:
    """Stages chosen by hand.

    Attributes:
      forward_stage_layer_ids: per stage, the layer ids it runs, e.g. ``[[0], [1]]``; all
        layers, in order, each once.
      submesh_physical_shapes: per stage, ``(num_hosts, num_devices_per_host)``.
      submesh_logical_shapes: per stage, the 2-D logical mesh shape.
      submesh_autosharding_option_dicts: per stage, ``AutoShardingOption`` fields.
    """

    forward_stage_layer_ids: Sequence[Sequence[int]]
    submesh_physical_shapes: Sequence[Sequence[int]]
    submesh_logical_shapes: Sequence[Sequence[int]] | None = None
    submesh_autosharding_option_dicts: Sequence[dict] | None = None

    def __post_init__(self):
        ids = tuple(tuple(int(i) for i in stage) for stage in self.forward_stage_layer_ids)
        shapes = tuple(tuple(int(n) for n in s) for s in self.submesh_physical_shapes)
        object.__setattr__(self, "forward_stage_layer_ids", ids)
        object.__setattr__(self, "submesh_physical_shapes", shapes)
        if not ids or any(not stage for stage in ids):
            raise ValueError(f"forward_stage_layer_ids needs a non-empty list per stage: {ids}")
        flat = [i for stage in ids for i in stage]
        if flat != list(range(len(flat))):
            raise ValueError(
                f"forward_stage_layer_ids {[list(s) for s in ids]} must list layers "
                f"0..{len(flat) - 1} in order, each exactly once"
            )
        for name, value in (
            ("submesh_physical_shapes", shapes),
            ("submesh_logical_shapes", self.submesh_logical_shapes),
            ("submesh_autosharding_option_dicts", self.submesh_autosharding_option_dicts),
        ):
            if value is not None and len(value) != len(ids):
                raise ValueError(
                    f"{name} has {len(value)} entries but forward_stage_layer_ids has "
                    f"{len(ids)} stages"
                )
        for shape in shapes:
            if len(shape) != 2 or min(shape) < 1:
                raise ValueError(f"submesh physical shape must be two positive ints: {shape}")
        if self.submesh_logical_shapes is not None:
            logical = tuple(tuple(int(n) for n in s) for s in self.submesh_logical_shapes)
            for phys, log in zip(shapes, logical, strict=True):
                if len(log) != 2 or log[0] * log[1] != phys[0] * phys[1]:
                    raise ValueError(
                        f"submesh logical shape {log} does not have the "
                        f"{phys[0] * phys[1]} devices of physical shape {phys}"
                    )
            object.__setattr__(self, "submesh_logical_shapes", logical)


@dataclass(frozen=True)
class UniformStageOption:
    """Equal stages on equal submeshes.

    Attributes:
      num_stages: number of stages (default: one per layer); must divide the layers.
      submesh_physical_shape: the shape of every submesh (default: the devices split
        evenly, ``(1, num_devices // num_stages)``).
      submesh_logical_shape: the logical shape of every submesh.
      submesh_autosharding_option: ``AutoShardingOption`` fields for every stage.
    """

    num_stages: int | None = None
    submesh_physical_shape: Sequence[int] | None = None
    submesh_logical_shape: Sequence[int] | None = None
    submesh_autosharding_option: dict | None = None

    def __post_init__(self):
        if self.num_stages is not None and (
            not isinstance(self.num_stages, int) or self.num_stages < 1
        ):
            raise ValueError(f"num_stages must be a positive int, got {self.num_stages!r}")


@dataclass(frozen=True)
class StagePlan:
    """Resolved stages: layers, device slices and logical shapes per stage."""

    layer_to_stage: tuple[int, ...]
    device_ranges: tuple[tuple[int, int], ...]
    logical_shapes: tuple[tuple[int, int], ...]
    autosharding_option_dicts: tuple[dict | None, ...]

    @property
    def num_stages(self) -> int:
        return len(self.device_ranges)


def resolve_stage_option(option) -> ManualStageOption | UniformStageOption:
    if option is None or option == "uniform":
        return UniformStageOption()
    if isinstance(option, ManualStageOption | UniformStageOption):
        return option
    raise ValueError(
        f"stage_option must be 'uniform', a UniformStageOption or a ManualStageOption, "
        f"got {option!r} ({type(option).__name__})"
    )


def plan_stages(option: Any, num_layers: int, num_devices: int) -> StagePlan:
    """Resolve ``option`` for a step of ``num_layers`` layers on ``num_devices`` devices."""
    option = resolve_stage_option(option)
    if isinstance(option, ManualStageOption):
        ids = option.forward_stage_layer_ids
        num_assigned = sum(len(s) for s in ids)
        if num_assigned != num_layers:
            raise ValueError(
                f"the step has {num_layers} layers ({num_layers - 1} "
                f"mark_pipeline_boundary calls) but forward_stage_layer_ids assigns "
                f"{num_assigned} layers"
            )
        layer_to_stage = tuple(s for s, stage in enumerate(ids) for _ in stage)
        shapes = option.submesh_physical_shapes
        logical = option.submesh_logical_shapes or tuple((1, a * b) for a, b in shapes)
        dicts = tuple(option.submesh_autosharding_option_dicts or (None,) * len(ids))
    else:
        num_stages = option.num_stages or num_layers
        if num_layers % num_stages:
            raise ValueError(
                f"UniformStageOption(num_stages={num_stages}) does not divide the "
                f"{num_layers} layers of the step"
            )
        per = num_layers // num_stages
        layer_to_stage = tuple(layer // per for layer in range(num_layers))
        if option.submesh_physical_shape is not None:
            shape = tuple(option.submesh_physical_shape)
        else:
            if num_devices % num_stages:
                raise ValueError(
                    f"{num_stages} stages cannot split {num_devices} devices evenly; pass "
                    "UniformStageOption(submesh_physical_shape=...)"
                )
            shape = (1, num_devices // num_stages)
        shapes = (shape,) * num_stages
        logical = (tuple(option.submesh_logical_shape or (1, shape[0] * shape[1])),) * num_stages
        dicts = (option.submesh_autosharding_option,) * num_stages
    needed = sum(a * b for a, b in shapes)
    if needed > num_devices:
        raise ValueError(
            f"submesh_physical_shapes {[list(s) for s in shapes]} need {needed} devices "
            f"but only {num_devices} exist"
        )
    ranges, start = [], 0
    for a, b in shapes:
        ranges.append((start, start + a * b))
        start += a * b
    return StagePlan(layer_to_stage, tuple(ranges), tuple(tuple(s) for s in logical), dicts)
