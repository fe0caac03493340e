"""The JSON form of a :class:`~alpa.record.parallel_plan.ParallelPlan`'s parts.

Each part of a plan has a ``*_to_json`` giving plain lists, dicts, strings and numbers, and
a ``*_from_json`` rebuilding the part from them: ``from_json(to_json(x)) == x``. A
``PartitionSpec`` entry is a mesh axis name, a list of them or ``None``; tuples become lists;
a logical mesh keeps its shape, axis names and alpha-beta costs but never its devices (a
plan is replayed on the devices of the method that loads it). The layout of the whole
record and its version (``PLAN_FORMAT``) are :class:`~alpa.record.parallel_plan.ParallelPlan`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from alpa.device_mesh import LogicalDeviceMesh
from alpa.pipeline_parallel.layers.layer_construction import AutoLayerOption, ManualLayerOption
from alpa.pipeline_parallel.program.stage_sharding import StagePins
from alpa.pipeline_parallel.stages.stage_construction import StagePlan
from alpa.runtime.placement import PlacementSpec
from alpa.shard_parallel.auto_sharding import AutoShardingOption
from alpa.shard_parallel.sharding_plan import PartialSum, ShardingPlan


def spec_to_json(spec: PartitionSpec | None) -> list | None:
    """``PartitionSpec('x', None, ('x', 'y'))`` -> ``['x', None, ['x', 'y']]``."""
    if spec is None:
        return None
    out: list = []
    for entry in spec:
        if entry is None or isinstance(entry, str):
            out.append(entry)
        elif isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
            out.append(list(entry))
        else:
            raise ValueError(
                f"cannot record the PartitionSpec {spec}: its entry {entry!r} is not a mesh "
                "axis name, a tuple of them or None"
            )
    return out


def spec_from_json(data: list | None) -> PartitionSpec | None:
    if data is None:
        return None
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in data))


def mesh_to_json(mesh: LogicalDeviceMesh) -> dict:
    return {
        "shape": list(mesh.shape),
        "axis_names": list(mesh.axis_names),
        "mesh_alpha": list(mesh.mesh_alpha),
        "mesh_beta": list(mesh.mesh_beta),
        "device_flops": mesh.device_flops,
        "memory_bandwidth": mesh.memory_bandwidth,
    }


def mesh_from_json(data: Mapping) -> LogicalDeviceMesh:
    return LogicalDeviceMesh(
        tuple(data["shape"]),
        tuple(data["mesh_alpha"]),
        tuple(data["mesh_beta"]),
        axis_names=tuple(data["axis_names"]),
        device_flops=data["device_flops"],
        memory_bandwidth=data["memory_bandwidth"],
    )


def partial_sum_to_json(partial_sum: PartialSum) -> dict:
    return {
        "operand_specs": [[spec_to_json(s) for s in specs] for specs in partial_sum.operand_specs],
        "reduce_axes": list(partial_sum.reduce_axes),
    }


def partial_sum_from_json(data: Mapping) -> PartialSum:
    return PartialSum(
        tuple(tuple(spec_from_json(s) for s in specs) for specs in data["operand_specs"]),
        tuple(data["reduce_axes"]),
    )


def stage_pins_to_json(pins: StagePins) -> dict:
    """A pipeline stage's pins (their values and equations named by refs), each table
    sorted by ref, so that two records of one plan are the same text."""
    return {
        "var_specs": {ref: spec_to_json(pins.var_specs[ref]) for ref in sorted(pins.var_specs)},
        "operand_specs": {
            ref: [spec_to_json(s) for s in pins.operand_specs[ref]]
            for ref in sorted(pins.operand_specs)
        },
        "partial_sums": {
            ref: partial_sum_to_json(pins.partial_sums[ref]) for ref in sorted(pins.partial_sums)
        },
    }


def stage_pins_from_json(data: Mapping) -> StagePins:
    return StagePins(
        {ref: spec_from_json(spec) for ref, spec in data["var_specs"].items()},
        {
            ref: tuple(spec_from_json(s) for s in specs)
            for ref, specs in data["operand_specs"].items()
        },
        {ref: partial_sum_from_json(p) for ref, p in data["partial_sums"].items()},
    )


def sharding_plan_to_json(plan: ShardingPlan) -> dict:
    return {
        "method": plan.method,
        "logical_mesh": mesh_to_json(plan.logical_mesh),
        "in_specs": [spec_to_json(s) for s in plan.in_specs],
        "out_specs": [spec_to_json(s) for s in plan.out_specs],
        "var_specs": {ref: spec_to_json(s) for ref, s in plan.var_specs.items()},
        "operand_specs": {
            ref: [spec_to_json(s) for s in specs] for ref, specs in plan.operand_specs.items()
        },
        "partial_sums": {ref: partial_sum_to_json(p) for ref, p in plan.partial_sums.items()},
        "data_axes": list(plan.data_axes),
        "grad_specs": None
        if plan.grad_specs is None
        else [spec_to_json(s) for s in plan.grad_specs],
        "sync_groups": [list(group) for group in plan.sync_groups],
        "gather_bound": plan.gather_bound,
        "objective": plan.objective,
        "compute_cost": plan.compute_cost,
    }


def sharding_plan_from_json(data: Mapping) -> ShardingPlan:
    grad_specs = data["grad_specs"]
    return ShardingPlan(
        logical_mesh=mesh_from_json(data["logical_mesh"]),
        in_specs=tuple(spec_from_json(s) for s in data["in_specs"]),
        out_specs=tuple(spec_from_json(s) for s in data["out_specs"]),
        var_specs={ref: spec_from_json(s) for ref, s in data["var_specs"].items()},
        operand_specs={
            ref: tuple(spec_from_json(s) for s in specs)
            for ref, specs in data["operand_specs"].items()
        },
        partial_sums={
            ref: partial_sum_from_json(p) for ref, p in data.get("partial_sums", {}).items()
        },
        data_axes=tuple(data["data_axes"]),
        grad_specs=None if grad_specs is None else tuple(spec_from_json(s) for s in grad_specs),
        sync_groups=tuple(tuple(group) for group in data.get("sync_groups", ())),
        gather_bound=data.get("gather_bound"),
        objective=data["objective"],
        method=data["method"],
        compute_cost=data.get("compute_cost"),
    )


def placement_to_json(spec: PlacementSpec) -> dict:
    return {
        "shape": list(spec.aval.shape),
        "dtype": np.dtype(spec.aval.dtype).name,
        "mesh_ids": list(spec.mesh_ids),
        "sharding_specs": [spec_to_json(s) for s in spec.sharding_specs],
    }


def placement_from_json(data: Mapping) -> PlacementSpec:
    return PlacementSpec(
        jax.ShapeDtypeStruct(tuple(data["shape"]), np.dtype(data["dtype"])),
        tuple(data["mesh_ids"]),
        tuple(spec_from_json(s) for s in data["sharding_specs"]),
    )


def layer_option_to_json(option: ManualLayerOption | AutoLayerOption) -> dict:
    kind = "auto" if isinstance(option, AutoLayerOption) else "manual"
    fields = {f.name: getattr(option, f.name) for f in dataclasses.fields(option)}
    if "static_argnums" in fields:
        fields["static_argnums"] = list(fields["static_argnums"])
    return {"kind": kind, **fields}


def layer_option_from_json(data: Mapping) -> ManualLayerOption | AutoLayerOption:
    fields = {k: v for k, v in data.items() if k != "kind"}
    if data["kind"] == "auto":
        fields["static_argnums"] = tuple(fields.get("static_argnums", ()))
        return AutoLayerOption(**fields)
    return ManualLayerOption(**fields)


def option_to_json(option: AutoShardingOption) -> dict:
    out = {}
    for f in dataclasses.fields(option):
        value = getattr(option, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def stage_plan_to_json(plan: StagePlan) -> dict:
    return {
        "layer_to_stage": list(plan.layer_to_stage),
        "device_ranges": [list(r) for r in plan.device_ranges],
        "logical_shapes": [list(s) for s in plan.logical_shapes],
        "autosharding_option_dicts": [
            None if d is None else {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
            for d in plan.autosharding_option_dicts
        ],
        "submesh_shapes": [list(s) for s in plan.submesh_shapes],
        "latencies": None if plan.latencies is None else list(plan.latencies),
        "memory": None if plan.memory is None else list(plan.memory),
        "predicted_cost": plan.predicted_cost,
    }


def stage_plan_from_json(data: Mapping) -> StagePlan:
    def pairs(rows):
        return tuple(tuple(int(n) for n in row) for row in rows)

    def floats(values):
        return None if values is None else tuple(float(v) for v in values)

    return StagePlan(
        layer_to_stage=tuple(data["layer_to_stage"]),
        device_ranges=pairs(data["device_ranges"]),
        logical_shapes=pairs(data["logical_shapes"]),
        autosharding_option_dicts=tuple(data["autosharding_option_dicts"]),
        submesh_shapes=pairs(data["submesh_shapes"]),
        latencies=floats(data["latencies"]),
        memory=floats(data["memory"]),
        predicted_cost=data["predicted_cost"],
    )


# ----------------------------------------------------------------------------- checks


class InconsistentPlanError(ValueError):
    """A plan's pipeline part whose fields disagree (a stage that one field names and
    another has not): what an edited plan file can hold."""


def check_pipeline_decisions(decisions: Any) -> None:
    """Raise :class:`InconsistentPlanError`, naming the field, the bad value and what was
    expected, unless every per-stage field of a pipeline plan's ``decisions`` (a
    ``PipeshardDecisions``) has one entry per stage, every stage a plan names exists, and
    each stage's devices, submesh and logical mesh agree."""
    stage_plan = decisions.stage_plan
    num = len(stage_plan.device_ranges)
    per_stage = {
        "stage_plan.logical_shapes": stage_plan.logical_shapes,
        "stage_plan.submesh_shapes": stage_plan.submesh_shapes,
        "stage_plan.autosharding_option_dicts": stage_plan.autosharding_option_dicts,
        "options": decisions.options,
        "logical_meshes": decisions.logical_meshes,
        "stage_pins": decisions.stage_pins,
    }
    for name, values in per_stage.items():
        if len(values) != num:
            raise InconsistentPlanError(
                f"{name} has {len(values)} entries but stage_plan.device_ranges has {num} "
                f"(one per stage): expected {num}"
            )
    expected = expected_stage(num)
    layers = stage_plan.layer_to_stage
    if len(layers) != decisions.layers.num_layers:
        raise InconsistentPlanError(
            f"stage_plan.layer_to_stage={list(layers)} has {len(layers)} entries but the plan "
            f"has {decisions.layers.num_layers} layers (layers.num_layers): expected one stage "
            "per layer"
        )
    for layer, stage in enumerate(layers):
        if not 0 <= stage < num:
            raise InconsistentPlanError(
                f"stage_plan.layer_to_stage={list(layers)} puts layer {layer} on stage {stage}: "
                f"{expected}"
            )
    if list(layers) != sorted(layers):
        raise InconsistentPlanError(
            f"stage_plan.layer_to_stage={list(layers)} is not in order: expected each stage's "
            "layers after the previous stage's (a pipeline runs its stages in order)"
        )
    for stage in range(num):
        if stage not in layers:
            raise InconsistentPlanError(
                f"stage {stage} has no layer in stage_plan.layer_to_stage={list(layers)}: "
                "expected every stage to hold at least one layer"
            )
        _check_stage_mesh(decisions, stage)
    for stage in decisions.objectives:
        if not 0 <= stage < num:
            raise InconsistentPlanError(f"objectives names stage {stage}: {expected}")


def expected_stage(num: int) -> str:
    """What a stage named in a plan of ``num`` stages must be, for the errors."""
    stages = f"{num} stage" + ("s" if num != 1 else "")
    return f"expected a stage in 0..{num - 1} (stage_plan.device_ranges has {stages})"


def _check_stage_mesh(decisions: Any, stage: int) -> None:
    """Stage ``stage``'s devices, submesh shape and logical shapes agree."""
    stage_plan = decisions.stage_plan
    start, stop = stage_plan.device_ranges[stage]
    sizes = {
        "stage_plan.device_ranges": (stop - start, [start, stop]),
        "stage_plan.submesh_shapes": (
            int(np.prod(stage_plan.submesh_shapes[stage])),
            list(stage_plan.submesh_shapes[stage]),
        ),
        "stage_plan.logical_shapes": (
            int(np.prod(stage_plan.logical_shapes[stage])),
            list(stage_plan.logical_shapes[stage]),
        ),
    }
    if len({n for n, _ in sizes.values()}) != 1:
        said = ", ".join(f"{name}[{stage}]={v} ({n} devices)" for name, (n, v) in sizes.items())
        raise InconsistentPlanError(f"stage {stage} has {said}: expected one number of devices")
    mesh_shape = tuple(decisions.logical_meshes[stage].shape)
    if mesh_shape != tuple(stage_plan.logical_shapes[stage]):
        raise InconsistentPlanError(
            f"logical_meshes[{stage}] has shape {list(mesh_shape)} but "
            f"stage_plan.logical_shapes[{stage}]={list(stage_plan.logical_shapes[stage])}: "
            "expected the same shape"
        )
