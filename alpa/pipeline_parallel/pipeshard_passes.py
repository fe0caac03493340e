"""The inter-op passes of a pipeshard compile: :func:`plan_pipeshard` runs them in order
(``docs/pipeline.md``, Passes) and returns a ``pipeshard_plan.PipeshardPlan``::

    traced step --layers--> LayerAssignment --stages--> StagePlan --split--> PipelineProgram
       --intra-op per stage--> a StagePins per stage --schedule--> PipelineSchedule
       --emit--> PipelineInstructions --resolve--> buffer shardings, RESHARD tile plans
       ==> PipeshardPlan

Each stage is sharded by the same ``plan_auto_sharding`` that ``ShardParallel`` uses, on a
logical view of its submesh built from the ``ClusterSpec`` (alpha-beta per axis), so the
same plan is made whether the cluster is here (the executable then compiles it on the
devices of each submesh) or not (``parallelize(...).plan(*args)`` on a
``VirtualPhysicalMesh``). Only ``AutoStageOption(cost_model="measured")`` runs anything,
and it needs the devices. ``plan_pipeshard(decisions=...)`` replays a plan's layers,
stages and stage shardings without searching; ``pipeline_schedule="auto"`` plans once and
replays under the schedule ``schedule_choice`` picks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from alpa.device_mesh import ClusterSpec, LogicalDeviceMesh, VirtualPhysicalMesh
from alpa.pipeline_parallel.layers.layer_construction import (
    AutoLayerOption,
    LayerAssignment,
    construct_layers,
    resolve_layer_option,
)
from alpa.pipeline_parallel.layers.stacked_rows import RowSplit, split_stacked_rows
from alpa.pipeline_parallel.pipeshard_plan import PipeshardDecisions, PipeshardPlan, layout_of
from alpa.pipeline_parallel.program.computation import PipelineProgram, split_computations
from alpa.pipeline_parallel.program.deferred_sums import (
    defer_gradient_sums,
    stage_data_axes,
    zero2_specs,
)
from alpa.pipeline_parallel.program.program_rewrites import draw_rows_of_full_batch, rematerialize
from alpa.pipeline_parallel.program.propagated_stages import propagates
from alpa.pipeline_parallel.program.stage_sharding import (
    DATA_AXES,
    StagePins,
    plan_stage_shardings,
    positional_vars,
    stage_options,
    tie_donated_outputs,
    uses_ilp,
    value_spec,
)
from alpa.pipeline_parallel.program.user_shardings import pinned_specs
from alpa.pipeline_parallel.program.weight_split import split_weight_gradients
from alpa.pipeline_parallel.scheduling.runtime_emitter import emit_instructions
from alpa.pipeline_parallel.scheduling.schedule_choice import choose, price_schedules
from alpa.pipeline_parallel.scheduling.schedules import (
    AUTO,
    SPLIT_BACKWARD_SCHEDULES,
    make_schedule,
)
from alpa.pipeline_parallel.stages.candidate_stages import dp_candidates, shared_mesh_candidates
from alpa.pipeline_parallel.stages.stage_construction import (
    AutoStageOption,
    StageContext,
    StagePlan,
    resolve_stage_option,
)
from alpa.pipeline_parallel.stages.stage_search import plan_stages
from alpa.runtime.instructions import Op, PipelineInstructions
from alpa.runtime.resharding import worker_transfer_plan
from alpa.runtime.worker_program import TransferPlan
from alpa.shard_parallel.auto_sharding import AutoShardingOption
from alpa.tracing import TracedStep
from alpa.tracing.batch_draws import batch_size, micro_batch_draws
from alpa.tracing.jaxpr_util import eqns_at_positions, is_var


def resolve_value_specs(
    program: PipelineProgram,
    instructions: PipelineInstructions,
    stage_pins: Sequence[StagePins],
    logical_meshes: Sequence[LogicalDeviceMesh],
    names: dict,
) -> dict:
    """The end of the planning chain's sharding decisions: ``(value, mesh) -> spec`` for
    every value a stage computation on that mesh reads or writes, every step input on
    each mesh that reads it and every buffer of ``instructions``, each the spec its stage's
    record (``stage_pins[mesh]``) gives it or, where that names none,
    :func:`stage_sharding.value_spec`'s (a deferred gradient's partial sums, else data
    parallel). Filled here once: the executables
    read it as it is."""
    var_of = {name: v for v, name in names.items()}
    keys = [(v, c.stage) for c in program.computations for v in (*c.invars, *c.outvars)]
    keys += [(v, mesh) for v, meshes in program.input_stages.items() for mesh in meshes]
    keys += [(var_of[name], mesh) for name, _, mesh in instructions.buffer_keys()]
    specs = {}
    for v, mesh in keys:
        if is_var(v) and (v, mesh) not in specs:
            size = logical_meshes[mesh].num_devices
            specs[(v, mesh)] = value_spec(v, mesh, program, stage_pins, size)
    return specs


def resolve_buffers(
    instructions: PipelineInstructions,
    value_specs: dict,
    logical_meshes: Sequence[LogicalDeviceMesh],
    submesh_shapes: Sequence[Sequence[int]],
    names: dict,
) -> tuple[dict, dict]:
    """The sharding of every buffer of ``instructions`` (``(value name, mesh) -> spec``,
    from :func:`resolve_value_specs`) and the tile plan of every ``RESHARD`` between two
    meshes of devices (instruction index -> ``TransferPlan``; one between two stages on
    one mesh, under interleaved 1F1B, is a relayout there). Mesh ``m``'s devices are host-major,
    ``submesh_shapes[m][1]`` per host. Equal moves (same shape, dtype, layouts and devices
    per host) share one plan."""
    var_of = {name: v for v, name in names.items()}
    specs = {}
    for name, _, mesh in instructions.buffer_keys():
        specs[(name, mesh)] = value_specs[(var_of[name], mesh)]
    reshards: dict[int, TransferPlan] = {}
    made: dict[tuple, TransferPlan] = {}
    for i, ins in enumerate(instructions.instructions):
        if ins.op is not Op.RESHARD:
            continue
        (src,), (dst,) = ins.inputs, ins.outputs
        if instructions.physical_mesh(src[2]) == instructions.physical_mesh(dst[2]):
            continue
        aval = var_of[src[0]].aval
        move = (
            tuple(aval.shape),
            aval.dtype,
            layout_of(logical_meshes, specs, src),
            int(submesh_shapes[src[2]][1]),
            layout_of(logical_meshes, specs, dst),
            int(submesh_shapes[dst[2]][1]),
        )
        if move not in made:
            made[move] = worker_transfer_plan(*move)
        reshards[i] = made[move]
    return specs, reshards


def _logical_meshes(
    stage_plan: StagePlan, options: Sequence[AutoShardingOption], cluster: ClusterSpec
) -> list[LogicalDeviceMesh]:
    """Per stage, the logical view of its submesh the ILP plans on: the option's
    ``logical_mesh_shape`` or the stage plan's, with the option's alpha-beta (default:
    the ``cluster``'s)."""
    meshes = []
    for submesh, shape, option in zip(
        stage_plan.submesh_shapes, stage_plan.logical_shapes, options, strict=True
    ):
        virtual = VirtualPhysicalMesh(int(submesh[0]), int(submesh[1]), cluster=cluster)
        meshes.append(
            virtual.get_logical_mesh(
                option.logical_mesh_shape or shape, option.mesh_alpha, option.mesh_beta
            )
        )
    return meshes


def _name_vars(closed_jaxpr) -> dict:
    names: dict = {}
    jaxpr = closed_jaxpr.jaxpr

    def add(v):
        if is_var(v) and v not in names:
            names[v] = f"v{len(names)}"

    for v in list(jaxpr.constvars) + list(jaxpr.invars):
        add(v)
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            add(v)
    return names


@dataclass(frozen=True)
class PipeshardOptions:
    """What ``plan_pipeshard`` plans for: the ``cluster`` (its ``num_nodes`` hosts of
    ``num_devices_per_node`` devices), ``num_micro_batches`` per step under
    ``pipeline_schedule``, and ``PipeshardParallel``'s options (layers, stages, the
    default ``AutoShardingOption``, the user's pins)."""

    cluster: ClusterSpec
    num_micro_batches: int
    pipeline_schedule: str = "1f1b"
    layer_option: Any = None
    stage_option: Any = None
    default_auto_sharding_option: Any = None
    manual_sharding_option: Any = None
    stage_input_shardings: Any = None


def plan_pipeshard(
    traced: TracedStep,
    options: PipeshardOptions,
    args: Sequence[Any] = (),
    devices: Sequence[Any] | None = None,
    decisions: PipeshardDecisions | None = None,
    row_split: RowSplit | None = None,
) -> PipeshardPlan:
    """Plan ``traced`` (traced at micro-batch size) as ``options`` say (module docstring).
    ``row_split`` is how ``traced`` was made from the caller's step (:func:`pipeline_step`),
    kept in the plan.

    With ``pipeline_schedule="auto"``, the stages are planned once (under 1F1B), each
    training schedule is priced on them (``schedule_choice``) and on stages of its own
    (``candidate_stages``: the DP's under GPipe and ZB-H1, two per mesh for interleaved
    1F1B and DualPipeV), and the plan is made again under the fastest that fits: from
    the decisions on the same stages, searched again on other stages; an inference step
    takes the inference schedule.
    """
    if row_split is not None:
        return plan_pipeshard(traced, options, args, devices, decisions).annotated(
            row_split=row_split
        )
    if options.pipeline_schedule != AUTO:
        return _plan_one_schedule(traced, options, args, devices, decisions)
    if traced.grad_marker() is None:
        options = dataclasses.replace(options, pipeline_schedule="inference")
        return _plan_one_schedule(traced, options, args, devices, decisions)
    first = dataclasses.replace(options, pipeline_schedule="1f1b")
    plan = _plan_one_schedule(traced, first, args, devices, decisions)
    cost = plan.cost
    latencies = plan.stage_plan.latencies or cost.latencies
    same_stages = price_schedules(
        latencies,
        cost.memory,
        cost.activation_memory,
        plan.num_micro_batches,
        plan.memory_budget(),
        bound=plan.step_bound(latencies),
    )
    entries = [(c, None) for c in same_stages]
    entries += dp_candidates(plan, options.default_auto_sharding_option)
    entries += shared_mesh_candidates(plan)
    candidates = tuple(c for c, _ in entries)
    best = choose(candidates)
    stage_option = next(o for c, o in entries if c is best)
    if stage_option is not None:
        # Stages of its own: planned again (their shardings searched) on them.
        chosen = dataclasses.replace(
            options, pipeline_schedule=best.name, stage_option=stage_option
        )
        plan = _plan_one_schedule(traced, chosen, args, devices)
    elif best.name != "1f1b":
        chosen = dataclasses.replace(options, pipeline_schedule=best.name)
        plan = _plan_one_schedule(traced, chosen, args, devices, plan.decisions)
    # The 1F1B plan itself keeps its cost, solved above (the layer ILPs, not again).
    return plan.annotated(schedule_candidates=candidates)


def pipeline_step(traced: TracedStep, layer_option) -> tuple[TracedStep, RowSplit | None]:
    """The step a pipeline plans: with ``AutoLayerOption`` (which cuts a scan over
    blocks into one scan per layer, ``layer_scans``: a training step's loss function while
    ``alpa.grad`` traces it, an inference step here), ``traced`` with its stacked
    parameters split into the rows or blocks of rows that each stage reads
    (``stacked_rows``), and how; else ``traced`` as it is."""
    option = resolve_layer_option(layer_option)
    if not isinstance(option, AutoLayerOption):
        return traced, None
    prepare = None
    if traced.grad_marker() is None and not traced.has_backward_pass:

        def prepare(step: TracedStep) -> TracedStep:
            closed = option.inference_step(step.closed_jaxpr)
            return dataclasses.replace(step, closed_jaxpr=closed)

    split = split_stacked_rows(traced, prepare)
    return (traced, None) if split is None else (split.traced, split)


def _plan_one_schedule(
    traced: TracedStep,
    options: PipeshardOptions,
    args: Sequence[Any] = (),
    devices: Sequence[Any] | None = None,
    decisions: PipeshardDecisions | None = None,
) -> PipeshardPlan:
    """:func:`plan_pipeshard` under the one schedule ``options.pipeline_schedule``.

    ``devices`` are the real devices, when there are any (only a measured stage cost model
    uses them). ``args`` are the step's positional arguments (abstract or not), which
    ``manual_sharding_option.in_axis_resources`` is matched against.

    ``decisions`` (:attr:`PipeshardPlan.decisions` of a plan of this same step) replay
    that plan's layers, stages and stage shardings instead of searching for them (no
    layer clustering, stage DP or ILP); the stage and sharding options are then not read,
    and what follows from the decisions (split, schedule, instructions) is derived again.
    """
    _check_differentiated_by_alpa(traced, options)
    layer_option = resolve_layer_option(options.layer_option)
    names = _name_vars(traced.closed_jaxpr)
    if decisions is None:
        layers = construct_layers(traced.closed_jaxpr, layer_option)
        stage_plan = _search_stages(
            traced, layers, names, options, devices, layer_option.remat_layer
        )
        stage_opts = stage_options(
            options.default_auto_sharding_option, stage_plan.autosharding_option_dicts
        )
        logical_meshes = _logical_meshes(stage_plan, stage_opts, options.cluster)
    else:
        check_decisions(decisions, traced, options.cluster.num_devices)
        layers, stage_plan = decisions.layers, decisions.stage_plan
        stage_opts, logical_meshes = decisions.options, list(decisions.logical_meshes)
    program = split_computations(
        traced.closed_jaxpr,
        layers.layers,
        stage_plan.layer_to_stage,
        traced.batch_invars,
        layers.kinds,
    )
    if layer_option.remat_layer and program.is_training:
        program = rematerialize(program)
    if options.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES and program.is_training:
        program = split_weight_gradients(program)
    schedule = _schedule(program, options, stage_plan)
    mesh_sizes = [m.num_devices for m in logical_meshes]
    # Per stage: data parallel (no ILP), or left to XLA's propagation (propagated_stages).
    propagated = [propagates(o, n) for o, n in zip(stage_opts, mesh_sizes, strict=True)]
    data_parallel = [
        not uses_ilp(o, n) and not p
        for o, n, p in zip(stage_opts, mesh_sizes, propagated, strict=True)
    ]
    if decisions is None:
        objectives, stage_pins = _stage_shardings(
            traced, program, args, options, logical_meshes, stage_opts, data_parallel, names
        )
    else:  # its records name the traced step's equations, read only for their values here
        objectives, stage_pins = decisions.objectives, decisions.stage_pins
    program = _draw_and_defer(
        traced, program, options, stage_pins, logical_meshes, data_parallel, propagated, names
    )
    instructions = emit_instructions(program, schedule, names)
    value_specs = resolve_value_specs(program, instructions, stage_pins, logical_meshes, names)
    buffer_specs, reshards = resolve_buffers(
        instructions, value_specs, logical_meshes, stage_plan.submesh_shapes, names
    )
    if decisions is None:
        decisions = PipeshardDecisions(
            layers=layers,
            stage_plan=stage_plan,
            options=tuple(stage_opts),
            logical_meshes=tuple(logical_meshes),
            objectives=objectives,
            stage_pins=_on_traced(stage_pins, traced, program),
        )
    return PipeshardPlan(
        traced=traced,
        names=names,
        cluster=options.cluster,
        decisions=decisions,
        program=program,
        value_specs=value_specs,
        schedule=schedule,
        instructions=instructions,
        buffer_specs=buffer_specs,
        reshards=reshards,
        num_micro_batches=options.num_micro_batches,
        layer_option=layer_option,
    )


def _mesh_sizes_and_shapes(logical_meshes) -> tuple[list[int], list[tuple[int, ...]]]:
    """Per stage, its logical mesh's number of devices and its shape."""
    return [m.num_devices for m in logical_meshes], [tuple(m.shape) for m in logical_meshes]


def _check_differentiated_by_alpa(traced: TracedStep, options: PipeshardOptions) -> None:
    """A training step must differentiate with ``alpa.grad``: said before any layer or
    stage is planned."""
    if traced.grad_marker() is None and traced.has_backward_pass:
        if options.pipeline_schedule != "inference":
            # Differentiated, but not by alpa.grad: no marker says where the gradients are
            # complete, so the step cannot be cut into forward, backward and apply-grad.
            raise ValueError(
                f"{traced.name} differentiates with jax.grad (or jax.value_and_grad / "
                f"jax.vjp), so with num_micro_batches={options.num_micro_batches} "
                "PipeshardParallel cannot tell its gradients (to average over micro-batches) "
                "from its other outputs: use alpa.grad / alpa.value_and_grad in place of "
                "jax.grad / jax.value_and_grad"
            )


def _schedule(program: PipelineProgram, options: PipeshardOptions, stage_plan: StagePlan):
    """The schedule ``options.pipeline_schedule`` names for ``stage_plan``'s stages on its
    meshes, checked against the step's kind."""
    name = options.pipeline_schedule
    if name == "inference" and program.is_training:
        raise ValueError(
            "pipeline_schedule='inference' cannot run a training step (it calls alpa.grad); "
            "use 'gpipe' or '1f1b'"
        )
    schedule = make_schedule(
        name, stage_plan.num_stages, options.num_micro_batches, stage_plan.num_meshes
    )
    placed = schedule.stage_meshes or tuple(range(schedule.num_stages))
    if placed != stage_plan.stage_meshes:
        raise ValueError(
            f"pipeline_schedule={name!r} runs stage i on mesh {list(placed)}[i], but the "
            f"stages were placed on meshes {list(stage_plan.stage_meshes)} (a plan made for "
            "another schedule); plan the stages for this one"
        )
    if not program.is_training and name != "inference":
        raise ValueError(
            f"the step has no alpa.grad, so it is an inference step; pass "
            f"pipeline_schedule='inference' instead of {name!r}"
        )
    return schedule


def _stage_shardings(
    traced,
    program,
    args,
    options: PipeshardOptions,
    logical_meshes,
    stage_opts,
    data_parallel,
    names,
):
    """``(objectives, stage_pins)``: per stage, its ILPs' objectives and its record
    (``stage_sharding.StagePins``): the user's pins, the stage's ILP plans, ZeRO-2 in the
    data-parallel stages that prefer reduce-scatter, and donated outputs tied to their
    inputs, each step a function from the records to new ones."""
    mesh_sizes, mesh_shapes = _mesh_sizes_and_shapes(logical_meshes)
    pinned = pinned_specs(
        traced,
        program,
        args,
        mesh_shapes,
        options.manual_sharding_option,
        options.stage_input_shardings,
        names,
    )
    objectives, stage_pins = plan_stage_shardings(
        traced, program, logical_meshes, stage_opts, names, pinned
    )
    zero2 = [
        o.prefer_reduce_scatter and dp for o, dp in zip(stage_opts, data_parallel, strict=True)
    ]
    stage_pins = zero2_specs(traced, program, stage_pins, mesh_sizes, zero2, DATA_AXES)
    stage_pins = tie_donated_outputs(traced, program, stage_pins, mesh_sizes)
    return objectives, stage_pins


def _draw_and_defer(
    traced,
    program,
    options: PipeshardOptions,
    stage_pins,
    logical_meshes,
    data_parallel,
    propagated,
    names,
) -> PipelineProgram:
    """``program`` with each micro-batch drawing its rows of the full batch's random
    numbers, and every stage's gradients reduced once per step (``names`` gains the new
    values), except in the stages left to XLA's propagation (``propagated``), whose
    backward all-reduces them."""
    if options.num_micro_batches > 1:
        # Micro-batch j draws its rows of the full batch's random numbers (batch_draws).
        draws = micro_batch_draws(traced)
        if draws:
            rows = options.num_micro_batches * batch_size(traced)
            program = draw_rows_of_full_batch(program, draws, rows)
            names[program.row_ids] = f"v{len(names)}"
    # Every stage's gradients: reduced once per step over its data axes, in apply-grad.
    mesh_sizes, mesh_shapes = _mesh_sizes_and_shapes(logical_meshes)
    data_axes = stage_data_axes(traced, program, stage_pins, mesh_shapes, data_parallel, DATA_AXES)
    data_axes = [() if p else axes for axes, p in zip(data_axes, propagated, strict=True)]
    axis_sizes = [dict(zip(DATA_AXES, shape, strict=True)) for shape in mesh_shapes]
    planned = [not dp for dp in data_parallel]
    deferred = defer_gradient_sums(
        program, traced, mesh_sizes, data_axes, axis_sizes, stage_pins, planned
    )
    if deferred is not None:
        program = dataclasses.replace(program, deferred=deferred)
        for v in deferred.partials.values():
            names[v] = f"v{len(names)}"
    return program


def _search_stages(
    traced: TracedStep,
    layers: LayerAssignment,
    names: dict,
    options: PipeshardOptions,
    devices: Sequence[Any] | None,
    remat: bool = False,
) -> StagePlan:
    """The stages ``stage_option`` picks for ``layers`` (the stage DP for ``"auto"``)."""
    stage_option = resolve_stage_option(options.stage_option)
    if isinstance(stage_option, AutoStageOption) and layers.num_layers == 1:
        raise ValueError(
            "stage_option='auto' needs layers to group into stages, but the step has one "
            "layer (no mark_pipeline_boundary() call); pass layer_option="
            "AutoLayerOption(layer_num=...) or mark the boundaries by hand"
        )
    context = StageContext(
        num_layers=layers.num_layers,
        cluster=options.cluster,
        devices=devices,
        traced=traced,
        layers=layers,
        names=names,
        num_micro_batches=options.num_micro_batches,
        option=options.default_auto_sharding_option,
        remat=remat,
        schedule=options.pipeline_schedule,
    )
    return plan_stages(stage_option, context)


def _on_traced(
    stage_pins: Sequence[StagePins], traced: TracedStep, program: PipelineProgram
) -> tuple[StagePins, ...]:
    """The per-stage records the ILPs made (``stage_pins``, their equations those of
    ``program``) with each equation the traced step's at the same position
    (``split_computations`` rewrites some equations' operands, never their positions):
    the plan's decisions, as a replay reads them. An equation the program rewrote after
    the planning (a random draw cut into micro-batch rows) is left out, as it names
    nothing the stage programs run."""
    traced_eqn = eqns_at_positions(program.closed_jaxpr.jaxpr, traced.jaxpr)
    return tuple(pins.rekeyed(lambda v: v, lambda e: traced_eqn.get(id(e))) for pins in stage_pins)


def check_decisions(decisions: PipeshardDecisions, traced: TracedStep, num_devices: int) -> None:
    """Raise ``ValueError`` unless ``decisions`` fit ``traced`` on ``num_devices`` devices."""
    num_eqns = len(traced.closed_jaxpr.jaxpr.eqns)
    if len(decisions.layers.layers) != num_eqns:
        raise ValueError(
            f"the recorded pipeshard decisions place {len(decisions.layers.layers)} equations "
            f"but {traced.name} has {num_eqns}: they were made for another step"
        )
    known = {*traced.jaxpr.constvars, *positional_vars(traced)}
    unknown = [v for pins in decisions.stage_pins for v in pins.var_specs if v not in known]
    if unknown:
        raise ValueError(
            f"the recorded stage shardings name {len(unknown)} values that {traced.name} "
            "does not have: they were made for another step"
        )
    num_stages = decisions.stage_plan.num_stages
    if len(decisions.stage_pins) != num_stages:
        raise ValueError(
            f"the recorded pipeshard decisions hold {len(decisions.stage_pins)} stage_pins "
            f"records but {num_stages} stages: expected one per stage"
        )
    needed = max(stop for _, stop in decisions.stage_plan.device_ranges)
    if needed > num_devices:
        raise ValueError(
            f"the recorded stages use {needed} devices but the cluster has {num_devices}"
        )
