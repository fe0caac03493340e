"""Shardings the user pins in a pipeshard step: ``manual_sharding_option`` and
``stage_input_shardings`` of ``PipeshardParallel``.

Both produce, per stage, ``value -> PartitionSpec`` entries of the stage's record
(``stage_sharding.StagePins``) before the intra-op pass runs; the pass keeps them and chooses the
rest, taking a pinned input of a computation as a fixed input spec of its ILP (pinned
outputs are constraints the ILP does not see; XLA reshards to them).

* ``manual_sharding_option`` (``ManualShardingOption``) gives PartitionSpecs for the whole
  step: ``in_axis_resources`` (one entry per positional argument, a spec or a pytree
  prefix of the argument) for the step's inputs on every mesh that reads them (the first
  stage reads the batch, each stage its parameters), ``out_axis_resources`` for the
  step's outputs on the mesh that produces them (the last stage's loss, each stage's
  updated parameters). Axis names are the stage's ``submesh_axis_names`` (default:
  ``mesh_axis_names`` for every stage): one name spans all devices of the submesh, two
  name its two logical axes. ``in_axis_resources=None`` / ``out_axis_resources=None``
  pin nothing; a ``None`` leaf replicates an input and leaves an output to the stage.
  ``pipeline_intermediate_axes`` pins the values passed between stages
  (:func:`_pin_intermediates`).
* ``stage_input_shardings[s]`` gives, for stage ``s``, one PartitionSpec (or ``None``:
  the stage decides) per input of the stage, in the order of
  ``executable.get_stage_input_names()[s]``: the values its forward and backward
  computations read from outside (step inputs, activations and cotangents of other
  stages). Its axis names are those of ``manual_sharding_option`` when given, else the
  logical submesh's ``("x", "y")``. It takes precedence over ``manual_sharding_option``.

Every spec is checked when the step compiles: the axis names (also when the method is
built), that no axis is used twice, the number of entries against the value's rank, and
that each split dimension divides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.extend.core import Var
from jax.sharding import PartitionSpec

from alpa.device_mesh import entry_names
from alpa.pipeline_parallel.program.computation import PipelineProgram
from alpa.pipeline_parallel.program.stage_sharding import DATA_AXES
from alpa.shard_parallel.strategies.manual_sharding import (
    ManualShardingOption,
    broadcast_prefix_specs,
    check_spec_axis_names,
)
from alpa.tracing import TracedStep
from alpa.tracing.jaxpr_util import is_var


def check_stage_input_shardings(value) -> tuple[tuple[PartitionSpec | None, ...] | None, ...]:
    """Eager structural check: a sequence with, per stage, ``None`` or a sequence of
    ``PartitionSpec`` / ``None``."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(
            "stage_input_shardings must be a list with one entry per stage (a list of "
            f"PartitionSpec or None per stage input, or None), got {type(value).__name__}"
        )
    out = []
    for s, specs in enumerate(value):
        if specs is None:
            out.append(None)
            continue
        if isinstance(specs, str | PartitionSpec) or not isinstance(specs, Sequence):
            raise TypeError(
                f"stage_input_shardings[{s}] must be a list of PartitionSpec or None (one "
                f"per input of stage {s}), got {specs!r}"
            )
        for i, spec in enumerate(specs):
            if spec is not None and not isinstance(spec, PartitionSpec):
                raise TypeError(
                    f"stage_input_shardings[{s}][{i}] must be a PartitionSpec or None, got "
                    f"{type(spec).__name__}: {spec!r}"
                )
        out.append(tuple(specs))
    return tuple(out)


def check_manual_sharding_option(option) -> ManualShardingOption:
    if not isinstance(option, ManualShardingOption):
        raise TypeError(
            "manual_sharding_option must be an alpa.ManualShardingOption, got "
            f"{type(option).__name__}: {option!r}"
        )
    for s, names in enumerate(option.submesh_axis_names or ()):
        _check_names(names, f"manual_sharding_option.submesh_axis_names[{s}]")
    return option


def check_axis_names(
    option: ManualShardingOption | None,
    stage_input_shardings: Sequence[Sequence[PartitionSpec | None] | None] | None,
) -> None:
    """The eager part of the axis-name checks: every spec names axes of its submesh(es)."""
    per_stage = option.submesh_axis_names if option is not None else None
    default = option.mesh_axis_names if option is not None else DATA_AXES
    if per_stage is not None and stage_input_shardings is not None:
        if len(per_stage) != len(stage_input_shardings):
            raise ValueError(
                f"stage_input_shardings has {len(stage_input_shardings)} stages but "
                f"manual_sharding_option.submesh_axis_names has {len(per_stage)}"
            )
    for s, specs in enumerate(stage_input_shardings or ()):
        names = tuple(per_stage[s]) if per_stage is not None else default
        for i, spec in enumerate(specs or ()):
            _check_spec_names(spec, names, f"stage_input_shardings[{s}][{i}]", f"stage {s}'s")
    if option is None:
        return
    known = tuple(dict.fromkeys(n for names in (per_stage or (default,)) for n in names))
    for what, tree in (
        ("in_axis_resources", option.in_axis_resources),
        ("out_axis_resources", option.out_axis_resources),
    ):
        leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, PartitionSpec))
        for spec in leaves:
            if isinstance(spec, PartitionSpec):
                _check_spec_names(spec, known, f"manual_sharding_option.{what}", "the")


def _check_spec_names(spec, names, where: str, whose: str) -> None:
    if spec is not None:
        check_spec_axis_names(spec, names, where, str(spec), f"{whose} submesh axis names")


def _check_names(names, where: str) -> tuple[str, ...]:
    if (
        not isinstance(names, tuple | list)
        or not 1 <= len(names) <= 2
        or not all(isinstance(n, str) for n in names)
        or len(set(names)) != len(names)
    ):
        raise ValueError(f"{where} must be 1 or 2 distinct axis names, got {names!r}")
    return tuple(names)


def stage_axis_names(option: ManualShardingOption | None, num_stages: int) -> list[tuple[str, ...]]:
    """The user's axis names of every stage's submesh."""
    if option is None:
        return [DATA_AXES] * num_stages
    if option.submesh_axis_names is None:
        return [option.mesh_axis_names] * num_stages
    if len(option.submesh_axis_names) != num_stages:
        raise ValueError(
            f"manual_sharding_option.submesh_axis_names has "
            f"{len(option.submesh_axis_names)} entries but the pipeline has {num_stages} "
            "stages"
        )
    return [tuple(n) for n in option.submesh_axis_names]


def stage_inputs(program: PipelineProgram, stage: int) -> list[Var]:
    """The values stage ``stage``'s forward and backward computations read from outside,
    in order (the inputs ``stage_input_shardings[stage]`` describes)."""
    comps = [program.computation(stage, kind) for kind in ("forward", "backward", "weight")]
    comps = [c for c in comps if c is not None and c.eqns]
    produced = {v for c in comps for e in c.eqns for v in e.outvars if is_var(v)}
    inputs: list[Var] = []
    for comp in comps:
        inputs += [v for v in comp.invars if v not in produced and v not in inputs]
    return inputs


def pinned_specs(
    traced: TracedStep,
    program: PipelineProgram,
    args: Sequence[Any],
    mesh_shapes: Sequence[tuple[int, int]],
    manual_sharding_option: ManualShardingOption | None,
    stage_input_shardings: Sequence[Sequence[PartitionSpec | None] | None] | None,
    names: dict,
) -> list[dict[Var, PartitionSpec]]:
    """Per stage, the specs the user pins (see the module docstring), in the mesh axes
    ``("x", "y")`` of the executable's submeshes."""
    num_stages = program.num_stages
    axis_names = stage_axis_names(manual_sharding_option, num_stages)
    pinned: list[dict[Var, PartitionSpec]] = [{} for _ in range(num_stages)]

    def pin(v, s, spec, where):
        pinned[s][v] = _translate(spec, v, axis_names[s], mesh_shapes[s], s, where)

    jaxpr = traced.closed_jaxpr.jaxpr
    option = manual_sharding_option
    if option is not None and option.in_axis_resources is not None:
        in_res = option.in_axis_resources
        if not isinstance(in_res, tuple | list) or len(in_res) != len(args):
            raise ValueError(
                "manual_sharding_option.in_axis_resources must have one entry per positional "
                f"argument ({len(args)}), got {in_res!r}"
            )
        specs: list = []
        for pos in traced.dynamic_argnums:
            specs += broadcast_prefix_specs(in_res[pos], args[pos], f"in_axis_resources[{pos}]")
        for v, spec, leaf in zip(jaxpr.invars, specs, traced.leaf_names, strict=True):
            for s in program.input_stages[v]:
                pin(
                    v, s, PartitionSpec() if spec is None else spec, f"in_axis_resources for {leaf}"
                )
    if option is not None and option.out_axis_resources is not None:
        dummy = _unflatten(traced.out_tree, len(jaxpr.outvars))
        specs = broadcast_prefix_specs(option.out_axis_resources, dummy, "out_axis_resources")
        for i, (v, spec) in enumerate(zip(jaxpr.outvars, specs, strict=True)):
            if spec is None or not is_var(v) or v in program.aliases or v not in program.home:
                continue
            if v in program.const_eqns:
                continue
            pin(v, program.home[v], spec, f"out_axis_resources for output {i}")

    if option is not None and option.pipeline_intermediate_axes:
        _pin_intermediates(program, jaxpr, option.pipeline_intermediate_axes, axis_names, pin)

    if stage_input_shardings is not None:
        if len(stage_input_shardings) != num_stages:
            raise ValueError(
                f"stage_input_shardings has {len(stage_input_shardings)} entries but the "
                f"pipeline has {num_stages} stages"
            )
        for s, specs in enumerate(stage_input_shardings):
            if specs is None:
                continue
            inputs = stage_inputs(program, s)
            if len(specs) != len(inputs):
                listed = ", ".join(_describe(v, traced, names) for v in inputs)
                raise ValueError(
                    f"stage_input_shardings[{s}] has {len(specs)} specs but stage {s} has "
                    f"{len(inputs)} inputs: {listed}"
                )
            for i, (v, spec) in enumerate(zip(inputs, specs, strict=True)):
                if spec is not None:
                    pin(
                        v,
                        s,
                        spec,
                        f"stage_input_shardings[{s}][{i}] ({_describe(v, traced, names)})",
                    )
    return pinned


def _pin_intermediates(program: PipelineProgram, jaxpr, axes, axis_names, pin) -> None:
    """``ManualShardingOption.pipeline_intermediate_axes``: each value a stage reads from
    another stage, split as ``axes`` say on the stage that reads it and on the one that
    computes it, where their submesh has the axis and the dimension divides."""
    step_inputs = set(jaxpr.invars)
    for s in range(program.num_stages):
        for v in stage_inputs(program, s):
            home = program.home.get(v)
            if v in step_inputs or home is None or home == s:
                continue
            for stage in (s, home):
                shape = v.aval.shape
                dims: dict[int, list[str]] = {}
                for name, dim in axes:
                    if name in axis_names[stage] and dim < len(shape):
                        dims.setdefault(dim, []).append(name)
                if not dims:
                    continue
                spec = PartitionSpec(
                    *(
                        None
                        if d not in dims
                        else (dims[d][0] if len(dims[d]) == 1 else tuple(dims[d]))
                        for d in range(max(dims) + 1)
                    )
                )
                try:
                    pin(v, stage, spec, f"pipeline_intermediate_axes for {v}")
                except ValueError:
                    continue  # the dimension does not divide over the axis: left as planned


def input_names(program: PipelineProgram, traced: TracedStep, names: dict) -> list[list[str]]:
    return [
        [_describe(v, traced, names) for v in stage_inputs(program, s)]
        for s in range(program.num_stages)
    ]


def _describe(v, traced: TracedStep, names: dict) -> str:
    jaxpr = traced.closed_jaxpr.jaxpr
    leaf = dict(zip(jaxpr.invars, traced.leaf_names, strict=True)).get(v)
    shape = f"{v.aval.dtype}[{','.join(str(d) for d in v.aval.shape)}]"
    return f"{leaf} {shape}" if leaf is not None else f"{names.get(v, v)} {shape}"


def _unflatten(tree, n: int):
    return jax.tree.unflatten(tree, [0] * n)


def _translate(
    spec: PartitionSpec, v, names: tuple[str, ...], mesh_shape, stage: int, where: str
) -> PartitionSpec:
    """``spec`` in the user's axis names of stage ``stage`` -> the mesh's ``("x", "y")``."""
    if len(names) == 1:
        mapping = {names[0]: DATA_AXES}
    else:
        mapping = {names[0]: (DATA_AXES[0],), names[1]: (DATA_AXES[1],)}
    sizes = dict(zip(DATA_AXES, mesh_shape, strict=True))
    shape = v.aval.shape
    if len(spec) > len(shape):
        raise ValueError(
            f"{where}: {spec} has {len(spec)} entries but the value has "
            f"{len(shape)} dimensions (shape {tuple(shape)})"
        )
    _check_spec_names(spec, tuple(mapping), where, f"stage {stage}'s")
    entries = []
    for dim, entry in enumerate(spec):
        if entry is None:
            entries.append(None)
            continue
        axes = tuple(a for n in entry_names(entry) for a in mapping[n])
        parts = math.prod(sizes[a] for a in axes)
        if shape[dim] % parts:
            raise ValueError(
                f"{where}: {spec} splits dimension {dim} of size {shape[dim]} "
                f"into {parts} parts on stage {stage}'s submesh, which does not divide it"
            )
        entries.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)
