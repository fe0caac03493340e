"""Intra-operator auto-sharding: the entry point of the ILP pass (paper §4).

``plan_auto_sharding(step, logical_mesh, option)`` turns a program into a
:class:`~alpa.shard_parallel.sharding_plan.ShardingPlan`: the program is a
:class:`~alpa.tracing.StepJaxpr`, a flat jaxpr and the role of each input (batch,
donated, differentiated parameter, optimizer state by its name), the same for a user's
traced step (``ShardParallel`` and the one-mesh methods) and for a pipeline stage's
computations cut out of one (``pipeline_parallel.stage_sharding``). It builds the
strategy graph of the jaxpr, prices every strategy and every resharding with the
alpha-beta cost model, and solves the integer linear program that picks one strategy per
value. The passes live in their own
modules, the options in :mod:`auto_sharding_option` (re-exported here, Alpa's import
path); this one wires the passes together.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any
from typing import Literal as TypingLiteral

import jax
from jax.sharding import NamedSharding, PartitionSpec

from alpa.device_mesh import STAGE_AXIS_NAME, LogicalDeviceMesh
from alpa.global_env import global_config
from alpa.shard_parallel.auto_sharding_option import (  # noqa: F401  (Alpa's import path)
    AutoShardingOption,
    snapshot_for_compile,
)
from alpa.shard_parallel.gradients.gradient_scatter import scattered_in_alpas_order
from alpa.shard_parallel.gradients.gradient_sync import data_parallel_in_specs, written_sync
from alpa.shard_parallel.ilp import ilp_solver
from alpa.shard_parallel.ilp.auto_sharding_solution import AutoShardingSolution
from alpa.shard_parallel.ilp.memory_model import solve_within_budget
from alpa.shard_parallel.sharding_plan import ShardingPlan
from alpa.shard_parallel.strategies.sharding_spec import (
    Spec,
    from_partition_spec,
    mesh_axes,
    nbytes,
    num_shards,
    replicated,
    user_partition_spec,
)
from alpa.shard_parallel.strategies.strategy_graph import build_strategy_graph
from alpa.shard_parallel.strategies.strategy_graph_record import GraphOptions
from alpa.tracing import StepJaxpr

# ----------------------------------------------------------------------------- planning


def plan_auto_sharding(
    step: StepJaxpr,
    logical_mesh: LogicalDeviceMesh,
    option: AutoShardingOption,
    fixed_in_specs: Sequence[PartitionSpec | None] | None = None,
    partial_sums: bool = True,
    comm_first: bool = True,
    shared_reshardings: bool = True,
    num_micro_batches: int | None = None,
) -> ShardingPlan:
    """The ShardingPlan of ``step`` on ``logical_mesh`` chosen by the ILP.

    ``force_data_parallel`` and ``force_zero_stage_3`` are the fixed plans of
    ``DataParallel`` and ``Zero3Parallel`` (the same program), and ``force_data_parallel``
    with ``prefer_reduce_scatter`` is ``Zero2Parallel``'s; with
    ``enable_auto_sharding=False`` every input is replicated and XLA decides the rest.
    ``fixed_in_specs[i]``, when not ``None``, is the sharding input ``i`` arrives in (over
    ``logical_mesh.axis_names``): the ILP plans around it instead of choosing it.
    ``partial_sums=False`` prices every reduction on its own, for a lowering that does not
    add partial results before reducing them (``strategy_graph_record.PartialSumSite``).
    ``comm_first=False`` solves the full objective, communication plus compute, from the
    start (``ilp_solver.solve``). ``shared_reshardings=False`` prices a resharding once per
    reader, for a lowering that splits the step into several programs (a pipeline stage's
    forward and backward), each resharding its own copy (``shared_resharding``).
    ``num_micro_batches``: the step's gradient accumulation, where it has one; with
    ``prefer_reduce_scatter`` its gradients are then reduce-scattered over the plan's data
    axes only (``gradient_scatter``: the micro-batched lowering carries partial sums over
    one group of axes).
    """
    if option.force_data_parallel or option.force_zero_stage_3:
        from alpa.shard_parallel.strategies.data_parallel import data_parallel_plan

        stage = 3 if option.force_zero_stage_3 else 2 if option.prefer_reduce_scatter else 0
        return data_parallel_plan(
            step,
            logical_mesh,
            zero_stage=stage,
            gather_bound=option.force_zero_stage_3_all_gather_threshold,
        )
    if not option.enable_auto_sharding:
        jaxpr = step.closed_jaxpr.jaxpr
        return ShardingPlan(
            logical_mesh=logical_mesh,
            in_specs=(PartitionSpec(),) * len(jaxpr.invars),
            out_specs=(None,) * len(jaxpr.outvars),
            method="replicated (auto-sharding disabled)",
        )
    if option.prefer_reduce_scatter and comm_first:
        plan = _reduce_scatter_in_alpas_order(
            step, logical_mesh, option, fixed_in_specs, partial_sums, shared_reshardings,
            one_group=bool(num_micro_batches and num_micro_batches > 1),
        )  # fmt: skip
        if plan is not None:
            return plan
    solution = solve_auto_sharding(
        step, logical_mesh, option, fixed_in_specs, partial_sums, comm_first, shared_reshardings
    )
    if global_config.print_auto_sharding_strategy:
        print(solution.format_table())
    return solution.to_sharding_plan()


def _reduce_scatter_in_alpas_order(
    step, logical_mesh, option, fixed_in_specs, partial_sums, shared_reshardings, one_group
) -> ShardingPlan | None:
    """``prefer_reduce_scatter`` as Alpa applied it, where that is written out here: the
    all-reduce plan is solved first (communication first, no reduce-scatter strategies),
    then its gradient all-reduces are rewritten (``gradient_scatter``), and the objective
    reported is the all-reduce plan's. ``None`` where the plan cannot be so rewritten:
    the ILP then solves with its reduce-scatter strategies."""
    plain = replace(option, prefer_reduce_scatter=False).snapshot()
    solution = solve_auto_sharding(
        step, logical_mesh, plain, fixed_in_specs, partial_sums,
        shared_reshardings=shared_reshardings,
    )  # fmt: skip
    plan = scattered_in_alpas_order(
        step, solution.to_sharding_plan(), fixed_in_specs, one_group=one_group
    )
    if plan is not None and global_config.print_auto_sharding_strategy:
        print(solution.format_table())
    return plan


def placed_input_specs(
    traced, args: Sequence[Any], mesh: LogicalDeviceMesh, warn: bool = True
) -> tuple[PartitionSpec | None, ...] | None:
    """The specs (over ``mesh.axis_names``) of the step's input leaves that the caller
    already placed with a ``NamedSharding`` on ``mesh`` under other names
    (``sharding_spec.user_partition_spec``), ``None`` for the others; ``None`` when no
    leaf is so placed. The ILP plans around them (``fixed_in_specs``) rather than
    re-placing them. A leaf placed on another mesh is re-placed, with a warning when that
    mesh is the user's (axis names other than alpa's: alpa's own executables move state
    between their meshes as a matter of course)."""
    dynamic = tuple(args[i] for i in traced.dynamic_argnums)
    specs, foreign = [], []
    for name, leaf in zip(traced.leaf_names, jax.tree.leaves(dynamic), strict=True):
        sharding = getattr(leaf, "sharding", None)
        spec = None
        if isinstance(sharding, NamedSharding):
            spec = user_partition_spec(sharding, mesh)
            # alpa's own meshes: a stage's, or a pipeline's stages' (rows split by stage)
            ours = (tuple(mesh.axis_names), (STAGE_AXIS_NAME, *mesh.axis_names))
            if spec is None and tuple(sharding.mesh.axis_names) not in ours:
                foreign.append(f"{name} (on {sharding.mesh})")
        specs.append(spec)
    if foreign and warn:
        warnings.warn(
            f"{len(foreign)} argument leaves are placed on another mesh than the plan's "
            f"logical mesh {mesh.shape}, and are re-placed: {', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}",
            stacklevel=3,
        )
    return tuple(specs) if any(s is not None for s in specs) else None


def plan_objective(step: StepJaxpr, plan: ShardingPlan) -> tuple[float, float]:
    """``(communication, compute)``: the two terms of ``plan``'s objective under the
    ILP's cost model, so that plans of any method compare: its own for a plan the ILP
    made; for any other (data parallel, ZeRO, manual specs) those of the cheapest plan
    that takes the step's inputs in ``plan``'s shardings, which is what the fixed plan
    pins (the rest it leaves to XLA, priced here at its best).

    A plan whose lowering writes its gradient synchronisation out as packed collectives
    (ZeRO-2 and ZeRO-3: ``gradient_sync.written_sync``) is priced as what that lowering
    does: data parallelism's plan of the step (the batch split alike, every other input
    replicated), its gradients' all-reduce replaced by the packed reduce-scatter, plus
    the packed all-gathers (ZeRO-2's updated parameters, ZeRO-3's parameters)."""
    if plan.objective is not None:
        compute = plan.compute_cost or 0.0
        return plan.objective - compute, compute
    sync = written_sync(step, plan)
    in_specs = plan.in_specs if sync is None else data_parallel_in_specs(step, plan)
    solution = solve_auto_sharding(
        step, plan.logical_mesh, AutoShardingOption(), fixed_in_specs=in_specs
    )
    communication = float(solution.objective - solution.compute)
    if sync is not None:
        reductions = ilp_solver.collectives(solution.graph, solution.solution.choice)
        all_reduced = sum(
            c.nbytes for _, reduces, c in reductions if c.kind == "all-reduce" and reduces
        )
        communication += sync.cost_change(solution.mesh, all_reduced)
    return communication, float(solution.compute)


def solve_auto_sharding(
    step: StepJaxpr,
    logical_mesh: LogicalDeviceMesh,
    option: AutoShardingOption | None = None,
    fixed_in_specs: Sequence[PartitionSpec | None] | None = None,
    partial_sums: bool = True,
    comm_first: bool = True,
    shared_reshardings: bool = True,
) -> AutoShardingSolution:
    """Build the strategy graph of ``step``, solve the ILP, return the decision."""
    marker = step.grad_marker()
    option = AutoShardingOption() if option is None else option
    given = option.force_batch_dim_to_mesh_dim
    axis = forced_batch_axis(option, _effective_mesh(logical_mesh, option))
    if axis != given:
        option = replace(option, force_batch_dim_to_mesh_dim=axis).snapshot()
    batch_dims = _forced_batch_dims(step, logical_mesh, option)
    if given is None and axis is not None and batch_dims is None:
        # Alpa's default, where the batch does not split over axis 0: not forced
        option = replace(option, force_batch_dim_to_mesh_dim=None).snapshot()
    return solve_jaxpr(
        step.closed_jaxpr,
        logical_mesh,
        option,
        batch_invars=step.batch_invars,
        grad_operands=tuple(marker.invars) if marker is not None else None,
        state_pairs=donated_state_pairs(step),
        memory_model="xla",
        fixed_in_specs=fixed_in_specs,
        batch_dims=batch_dims,
        partial_sums=partial_sums,
        comm_first=comm_first,
        shared_reshardings=shared_reshardings,
    )


def forced_batch_axis(option: AutoShardingOption, mesh: LogicalDeviceMesh) -> int | None:
    """The mesh axis ``option`` forces the batch dimension onto on ``mesh``, ``None`` for
    none: ``force_batch_dim_to_mesh_dim`` when set (``-1``: none); unset, Alpa's default,
    axis 0 when both of ``mesh``'s axes have more than one device (a 2-D mesh is data
    parallel on its first axis and shards the model on its second), except under
    ``force_data_parallel`` and ``force_zero_stage_3``, which split the batch over every
    device."""
    axis = option.force_batch_dim_to_mesh_dim
    if axis == -1:
        return None
    forces_all = option.force_data_parallel or option.force_zero_stage_3
    if axis is None and not forces_all and mesh.shape[0] > 1 and mesh.shape[1] > 1:
        return 0
    return axis


def _forced_batch_dims(step: StepJaxpr, logical_mesh, option) -> Mapping | None:
    """The batch dimensions of the step's values where ``force_batch_dim_to_mesh_dim``
    needs them: those that shrink when the step is step at ``1/n`` of the batch, ``n``
    the size of the forced axis (``micro_batches.batch_dims``)."""
    axis = None if option is None else option.force_batch_dim_to_mesh_dim
    if axis is None:
        return None
    from alpa.shard_parallel.gradients.micro_batches import batch_dims, leaves_with_rows
    from alpa.shard_parallel.strategies.data_parallel import batch_rows
    from alpa.tracing.batch_dims import static_batch_dims

    # Batch dimensions are those that shrink ``size`` times at ``1/size`` of the batch; on
    # an axis of one device (nothing to split: the batch stays whole) any divisor of the
    # batch size finds them, and a batch of one row has those the jaxpr's rules carry.
    size = _effective_mesh(logical_mesh, option).shape[axis]
    if size == 1:
        rows = batch_rows(step) or 1
        size = next((d for d in range(2, rows + 1) if rows % d == 0), 1)
        if size == 1:
            return static_batch_dims(step.jaxpr, leaves_with_rows(step), 1, partial=True)
    return batch_dims(step, size)


def donated_state_pairs(step: StepJaxpr) -> tuple[tuple[int, int], ...]:
    """Each donated input paired with the first unpaired output of the same shape and dtype,
    in order: how a train step returns its updated state."""
    jaxpr = step.closed_jaxpr.jaxpr
    taken: set[int] = set()
    pairs = []
    for i, (var, donated) in enumerate(zip(jaxpr.invars, step.donated_invars, strict=True)):
        if not donated:
            continue
        for o, out in enumerate(jaxpr.outvars):
            if (
                o not in taken
                and out.aval.shape == var.aval.shape
                and (out.aval.dtype == var.aval.dtype)
            ):
                taken.add(o)
                pairs.append((i, o))
                break
    return tuple(pairs)


def solve_jaxpr(
    closed_jaxpr,
    logical_mesh: LogicalDeviceMesh,
    option: AutoShardingOption | None = None,
    batch_invars=None,
    grad_operands=None,
    state_pairs=(),
    memory_model: TypingLiteral["jaxpr", "xla"] = "jaxpr",
    fixed_in_specs: Sequence[PartitionSpec | None] | None = None,
    batch_dims: Mapping | None = None,
    partial_sums: bool = True,
    comm_first: bool = True,
    shared_reshardings: bool = True,
) -> AutoShardingSolution:
    """The auto-sharding decision for a flat ``ClosedJaxpr``.

    ``batch_invars[i]`` says whether input ``i`` holds a batch (dimension 0 is the batch);
    default: no input does. ``state_pairs`` lists ``(input, output)`` indices of state the
    step returns updated (see :func:`build_strategy_graph`). ``memory_model`` says what
    ``option.memory_budget_per_device`` bounds: ``"jaxpr"``, the jaxpr values live at each
    point (the solver's own liveness); ``"xla"``, the allocation XLA reports for the
    compiled step (:func:`memory_model.xla_memory_graph`; what :func:`solve_auto_sharding` uses).
    ``fixed_in_specs[i]`` (a ``PartitionSpec`` or ``None``) fixes input ``i``'s sharding.
    ``batch_dims[var]``, the batch dimensions of each value, lets
    ``force_batch_dim_to_mesh_dim`` force every value's batch dimension, not only the
    batch arguments'. Only a value set in the option forces here: Alpa's default on 2-D
    meshes (:func:`forced_batch_axis`) is resolved by :func:`solve_auto_sharding`, which
    knows the step.
    ``partial_sums`` prices an add of two partial results reduced alike as one reduction
    (the lowering must then add before reducing; ``partial_sums.py``).
    ``shared_reshardings`` prices a resharding once for the readers of one spec
    (``shared_resharding.py``; the lowering must then reshard once, in one program).
    ``comm_first`` picks the solve (``ilp_solver.solve``): the least communication, compute
    breaking ties, unless a contraction would then run on fewer devices than it can; with
    ``False``, the least communication plus compute.
    """
    if memory_model not in ("jaxpr", "xla"):
        raise ValueError(f"memory_model must be 'jaxpr' or 'xla', got {memory_model!r}")
    option = AutoShardingOption() if option is None else option
    if not isinstance(option, AutoShardingOption):
        raise TypeError(
            f"option must be an AutoShardingOption, got {option!r} ({type(option).__name__})"
        )
    if not isinstance(logical_mesh, LogicalDeviceMesh):
        raise TypeError(
            f"logical_mesh must be a LogicalDeviceMesh, got {type(logical_mesh).__name__}"
        )
    invars = closed_jaxpr.jaxpr.invars
    if batch_invars is None:
        batch_invars = (False,) * len(invars)
    batch_invars = tuple(bool(b) for b in batch_invars)
    if len(batch_invars) != len(invars):
        raise ValueError(
            f"batch_invars has {len(batch_invars)} entries but the jaxpr has {len(invars)} inputs"
        )
    if option.force_batch_dim_to_mesh_dim == -1:
        option = replace(option, force_batch_dim_to_mesh_dim=None).snapshot()
    mesh = _effective_mesh(logical_mesh, option)
    graph_options = GraphOptions(
        allow_mixed_mesh_shape=option.allow_mixed_mesh_shape,
        allow_recompute_heavy_op=option.allow_recompute_heavy_op,
        prefer_reduce_scatter=option.prefer_reduce_scatter,
        allow_all_gather=option.allow_all_gather,
        allow_all_to_all=option.allow_all_to_all,
        carry_partial_sums=partial_sums,
        share_reshardings=shared_reshardings,
    )
    if fixed_in_specs is not None and len(fixed_in_specs) != len(invars):
        raise ValueError(
            f"fixed_in_specs has {len(fixed_in_specs)} entries but the jaxpr has "
            f"{len(invars)} inputs"
        )
    fixed = [
        None if p is None else from_partition_spec(p, len(v.aval.shape), mesh)
        for v, p in zip(invars, fixed_in_specs or (None,) * len(invars), strict=True)
    ]
    input_filter = _input_filter(option, mesh, batch_invars, invars, fixed)
    forced = option.force_batch_dim_to_mesh_dim
    batch_axis = None
    if forced is not None and batch_dims is not None:
        batch_axis = (batch_dims, forced, mesh.shape[forced] > 1)
    graph = build_strategy_graph(
        closed_jaxpr, mesh, graph_options, input_filter, state_pairs, batch_axis
    )
    time_limit = option.solver_time_limit or global_config.ilp_time_limit
    budget = option.memory_budget_per_device
    if budget is None or memory_model == "jaxpr":
        solution = ilp_solver.solve(graph, budget, time_limit, comm_first)
    else:
        solution = solve_within_budget(graph, budget, time_limit, state_pairs, comm_first)
    return AutoShardingSolution(
        graph, solution, batch_invars, grad_operands, tuple(tuple(p) for p in state_pairs)
    )


def _effective_mesh(mesh: LogicalDeviceMesh, option: AutoShardingOption) -> LogicalDeviceMesh:
    if option.force_data_parallel:
        return mesh.one_axis()
    shape = option.logical_mesh_shape
    if shape is not None and shape != mesh.shape:
        if math.prod(shape) != mesh.num_devices:
            raise ValueError(
                f"AutoShardingOption.logical_mesh_shape={shape} needs {math.prod(shape)} "
                f"devices but the mesh has {mesh.num_devices}"
            )
        mesh = replace(mesh, shape=shape)
    return mesh.with_alpha_beta(option.mesh_alpha, option.mesh_beta)


def _input_filter(option, mesh, batch_invars, invars, fixed: Sequence[Spec | None]):
    """Which specs each jaxpr input may take, given the forcing options and the inputs
    whose sharding is fixed (they take exactly that one)."""
    all_axes = mesh_axes(mesh)

    def batch_axes() -> tuple[int, ...] | None:
        if option.force_data_parallel or option.force_zero_stage_3:
            return all_axes
        if option.force_batch_dim_to_mesh_dim is not None:
            axis = option.force_batch_dim_to_mesh_dim
            return (axis,) if mesh.shape[axis] > 1 else ()
        return None

    forced_batch = batch_axes()

    def allowed(index: int, shape, specs: list[Spec]) -> list[Spec]:
        if fixed[index] is not None:
            return [fixed[index]]
        is_batch = batch_invars[index] if index < len(batch_invars) else False
        if is_batch:
            if forced_batch is None or not shape:
                return specs
            keep = [s for s in specs if s[0] == forced_batch]
            if option.force_data_parallel or option.force_zero_stage_3:
                keep = [s for s in keep if all(not a for a in s[1:])]
            return keep
        if option.force_data_parallel:
            return [replicated(len(shape))]
        aval = invars[index].aval
        size = nbytes(shape, aval.dtype.itemsize)
        if option.force_zero_stage_3 and size >= option.force_zero_stage_3_all_gather_threshold:
            full = [s for s in specs if num_shards(s, mesh) == mesh.num_devices]
            return full or specs
        if not option.allow_replicated_parameters and shape:
            sharded = [s for s in specs if num_shards(s, mesh) > 1]
            return sharded or specs
        return specs

    return allowed
