"""PipeshardParallel: pipeline stages between submeshes, each stage sharded on its own.

``PipeshardParallel`` resolves where its stages run (the local devices, a Ray cluster, or
a cluster that is not here, for ``plan()`` only), has ``pipeline_parallel.pipeshard_passes``
plan the step (layers, stages, per-stage shardings, the instructions of one step) and
compiles the plan for the in-process runtime or for Ray mesh workers.
``get_3d_parallel_method`` is Alpa's hand-set data x operator x pipeline parallelism.
Both are reachable at Alpa's path, ``alpa.parallel_method``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Sequence
from typing import Any

from alpa.cluster import get_global_physical_mesh, get_global_virtual_physical_mesh
from alpa.device_mesh import ClusterSpec, profile_in_file
from alpa.executables.base import Executable
from alpa.executables.pipeshard import PipeshardDriverExecutable
from alpa.executables.pipeshard_ray import PipeshardRayExecutable
from alpa.methods.shard_method import ParallelMethod, ShardParallel
from alpa.pipeline_parallel.layers.layer_construction import (
    AutoLayerOption,
    layer_option_context,
    resolve_layer_option,
)
from alpa.pipeline_parallel.pipeshard_passes import (
    PipeshardOptions,
    pipeline_step,
    plan_pipeshard,
)
from alpa.pipeline_parallel.pipeshard_plan import PipeshardPlan
from alpa.pipeline_parallel.program.user_shardings import (
    check_axis_names,
    check_manual_sharding_option,
    check_stage_input_shardings,
)
from alpa.pipeline_parallel.scheduling.schedules import check_schedule_name
from alpa.pipeline_parallel.stages.stage_construction import (
    ManualStageOption,
    resolve_stage_option,
    submesh_shape,
)
from alpa.resolved_cluster import ResolvedCluster, resolve_cluster
from alpa.runtime.ray_mesh import DistributedPhysicalDeviceMesh
from alpa.shard_parallel.auto_sharding import AutoShardingOption, snapshot_for_compile
from alpa.timer import timed
from alpa.tracing import TracedStep, mark_outputs_as_gradients
from alpa.util import caller_stacklevel


class PipeshardParallel(ParallelMethod):
    """Inter-operator (pipeline) plus intra-operator parallelism.

    Args:
      devices: where the stages run (:func:`~alpa.resolved_cluster.resolve_cluster`):
        ``None`` (the cluster of ``alpa.init``, or the part of it that
        ``set_global_virtual_physical_mesh`` chose), a list of jax devices, a
        ``LocalPhysicalDeviceMesh``, the global cluster, a ``LogicalDeviceMesh`` (its
        devices), or for ``plan()`` only a ``VirtualPhysicalMesh`` or ``ClusterSpec``.
      num_micro_batches: micro-batches per step; divides the batch size.
      default_auto_sharding_option: ``AutoShardingOption`` of every stage (default
        ``AutoShardingOption()``: the ILP shards each stage on its logical submesh); the
        stage option's per-stage dicts override its fields.
      pipeline_schedule: ``"1f1b"``, ``"gpipe"``, ``"zb-h1"`` (zero bubble),
        ``"interleaved-1f1b"`` and ``"dualpipev"`` (two stages on each mesh: stage ``i``
        on mesh ``i mod (S / 2)``, or in a V; uniform or manual stages), ``"inference"``,
        or ``"auto"`` (each training schedule priced on the planned stages, the fastest
        that fits memory taken; ``plan.schedule_candidates``).
      layer_option: ``"manual"``, ``ManualLayerOption`` or ``AutoLayerOption`` (layers by
        clustering the loss function's equations; ``layer_construction``).
      stage_option: ``"auto"`` or ``AutoStageOption`` (the stage DP picks stages,
        submeshes and logical shapes; ``stage_construction``), ``"uniform"``,
        ``UniformStageOption`` or ``ManualStageOption``.
      stage_input_shardings: per stage, a list with a ``PartitionSpec`` (or ``None``) per
        input of the stage (``executable.get_stage_input_names()``), in the submesh's
        axes ``("x", "y")`` or those of ``manual_sharding_option``.
      manual_sharding_option: a ``ManualShardingOption`` whose ``in_axis_resources`` /
        ``out_axis_resources`` pin the step's inputs and outputs on the stages that read
        or produce them, in the axis names ``submesh_axis_names[stage]`` (default
        ``mesh_axis_names``). See ``alpa.pipeline_parallel.program.user_shardings``.
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
        check_schedule_name(pipeline_schedule)
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

    def resolved_cluster(self) -> ResolvedCluster:
        """Where the stages are planned and run: ``devices`` resolved, ``None`` as the
        part of ``alpa.init``'s cluster that ``set_global_virtual_physical_mesh`` chose
        (all of it by default). On Ray, the stages' meshes are sliced from the cluster,
        so one mesh of some of its workers cannot hold them."""
        cluster = resolve_cluster(self.devices, use_global_virtual_mesh=True)
        if isinstance(cluster.mesh, DistributedPhysicalDeviceMesh) and cluster.ray_cluster is None:
            raise TypeError(
                f"devices is {cluster.mesh!r}, a mesh of some of a Ray cluster's workers: "
                "PipeshardParallel slices its stages' meshes from the whole cluster; pass "
                "devices=None (alpa.init('ray')'s cluster, or the part of it "
                "set_global_virtual_physical_mesh chose) or alpa.get_global_cluster()"
            )
        return cluster

    def _priced(self, cluster: ClusterSpec, devices) -> ClusterSpec:
        """``cluster`` with the profile ``AutoStageOption(use_hlo_cost_model=True,
        profiling_database_filename=path)`` names (Alpa's way of asking for measured
        rates): that file's entry for these devices, or its only one for a cluster that
        is not here; a file that does not exist, a warning and ``cluster`` as it is."""
        option = self.stage_option
        path = getattr(option, "profiling_database_filename", None)
        if not getattr(option, "use_hlo_cost_model", False) or path is None:
            return cluster
        if not os.path.exists(path):
            # Alpa's scripts name the database its gen_prof_database.py made first (Alpa
            # raised FileNotFoundError without it); here they run, and say so.
            warnings.warn(
                f"AutoStageOption.profiling_database_filename={path!r} does not exist: "
                f"planning with the {cluster.name!r} preset's datasheet figures instead of "
                "measured rates; make the file with "
                f"alpa.mesh_profiling.profile_all(cache_filename={path!r})",
                stacklevel=caller_stacklevel(),
            )
            return cluster
        kind = devices[0].device_kind if devices else None
        return cluster.with_profile(
            profile_in_file(
                path,
                kind,
                cluster.num_nodes,
                cluster.num_devices_per_node,
                "AutoStageOption.profiling_database_filename",
            )
        )

    def _plan(self, traced: TracedStep, args: Sequence[Any], require_devices: bool):
        cluster = self.resolved_cluster()
        if require_devices:
            cluster.check_here()
        options = PipeshardOptions(
            self._priced(cluster.spec, cluster.devices),
            self.num_micro_batches,
            pipeline_schedule=self.pipeline_schedule,
            layer_option=self.layer_option,
            stage_option=self.stage_option,
            # A snapshot: a later assignment to the user's option never changes this plan.
            default_auto_sharding_option=self._option_snapshot(),
            manual_sharding_option=self.manual_sharding_option,
            stage_input_shardings=self.stage_input_shardings,
        )
        step, row_split = traced, None
        if self.manual_sharding_option is None:  # its specs name the caller's leaves
            step, row_split = pipeline_step(traced, self.layer_option)
        plan = plan_pipeshard(
            step, options, args=args, devices=cluster.devices, row_split=row_split
        )
        return plan, cluster

    def _option_snapshot(self) -> AutoShardingOption | None:
        option = self.default_auto_sharding_option
        if isinstance(option, AutoShardingOption):
            return snapshot_for_compile(option)
        return option  # anything else: stage_options names the bad value

    def plan(self, traced: TracedStep, args: Sequence[Any]) -> PipeshardPlan:
        """The ``PipeshardPlan`` of ``traced``; compiles and runs nothing (only
        ``AutoStageOption(cost_model="measured")`` uses the devices)."""
        return self._plan(traced, args, require_devices=False)[0]

    def trace_context(self) -> contextlib.AbstractContextManager:
        """The layer option: ``alpa.grad`` cuts the loss function as it says."""
        return layer_option_context(self.layer_option)

    def finish_trace(self, traced: TracedStep) -> TracedStep:
        """A training step that returns ``jax.grad``'s gradients (no ``alpa.grad``), with
        one micro-batch: its outputs marked as ``alpa.grad`` would mark them
        (``tracing.mark_outputs_as_gradients``), as Alpa's pipelines accept it. With more
        micro-batches it is refused when planned (what to average is ``alpa.grad``'s to
        say)."""
        if (
            self.pipeline_schedule != "inference"
            and (self.num_micro_batches or 1) == 1
            and traced.has_backward_pass
            and traced.grad_marker() is None
        ):
            return mark_outputs_as_gradients(traced)
        return traced

    def compile_executable(self, traced: TracedStep, args: Sequence[Any]) -> Executable:
        with timed("planning"):
            plan, cluster = self._plan(traced, args, require_devices=True)
        with timed("compile"):
            return compile_pipeshard_plan(plan, cluster)

    def __repr__(self) -> str:
        return (
            f"PipeshardParallel(num_micro_batches={self.num_micro_batches}, "
            f"pipeline_schedule={self.pipeline_schedule!r}, "
            f"stage_option={self.stage_option!r})"
        )


def compile_pipeshard_plan(plan: PipeshardPlan, cluster: ResolvedCluster) -> Executable:
    """``plan`` compiled where ``cluster`` runs it: the in-process runtime over its
    devices, or one mesh of Ray workers per mesh of stages, sliced from its Ray cluster
    (hosts of ``cluster.spec.num_devices_per_node`` devices)."""
    ray_cluster = cluster.ray_cluster
    if ray_cluster is None:
        return PipeshardDriverExecutable(plan, list(cluster.devices))
    per_host = cluster.spec.num_devices_per_node
    meshes = []  # one per mesh of devices: stages may share one (interleaved 1F1B, DualPipeV)
    for start, stop in dict.fromkeys(plan.stage_plan.device_ranges):
        hosts = tuple(range(start // per_host, (stop - 1) // per_host + 1))
        meshes.append(
            ray_cluster.get_physical_mesh(hosts, min(stop - start, per_host), start % per_host)
        )
    return PipeshardRayExecutable(plan, meshes)


# ----------------------------------------------------------------------------- 3-D


def LocalPipelineParallel(num_micro_batches: int = 1) -> PipeshardParallel:  # noqa: N802
    """Alpa's in-process pipeline method (Alpa's name, kept for its programs): the step's
    manual layers (``mark_pipeline_boundary``) run as pipeline stages on this process's
    devices. Every ``PipeshardParallel`` without Ray already runs in this process, so this
    is ``PipeshardParallel(layer_option="manual")``."""
    return PipeshardParallel(num_micro_batches=num_micro_batches, layer_option="manual")


def get_3d_parallel_method(
    num_micro_batches: int,
    data_parallel: int,
    operator_parallel: int,
    pipeline_parallel: int,
    allow_degenerate_into_shard_parallel: bool = True,
    use_remat: bool = True,
    num_devices_per_host: int | None = None,
) -> ParallelMethod:
    """Alpa's hand-set 3-D parallelism: ``pipeline_parallel`` equal stages (layers by
    clustering, one per stage), each on ``data_parallel x operator_parallel`` devices as
    the logical mesh ``(data_parallel, operator_parallel)``, the batch split over mesh
    axis 0. With ``pipeline_parallel == 1`` (and ``allow_degenerate_into_shard_parallel``)
    it is ``ShardParallel`` on that logical mesh of the global mesh.

    ``num_devices_per_host``: devices per host of a stage's submesh (default: the global
    cluster's); a stage of more devices spans whole hosts. ``data_parallel=-1`` (Alpa's
    convention) takes every device the other two degrees leave.
    """
    _check_degree("operator_parallel", operator_parallel)
    _check_degree("pipeline_parallel", pipeline_parallel)
    if data_parallel == -1 and not isinstance(data_parallel, bool):
        data_parallel = _rest_of_devices(operator_parallel * pipeline_parallel)
    _check_degree("data_parallel", data_parallel)
    option = AutoShardingOption(prefer_reduce_scatter=True, force_batch_dim_to_mesh_dim=0)
    stage_devices = data_parallel * operator_parallel
    if pipeline_parallel == 1 and allow_degenerate_into_shard_parallel:
        physical = get_global_physical_mesh()
        if physical.num_devices != stage_devices:
            raise ValueError(
                f"data_parallel * operator_parallel = {stage_devices} but the global mesh has "
                f"{physical.num_devices} devices"
            )
        return ShardParallel(
            devices=physical.get_logical_mesh((data_parallel, operator_parallel)),
            num_micro_batches=num_micro_batches,
            auto_sharding_option=option,
        )
    per_host = num_devices_per_host or get_global_virtual_physical_mesh().num_devices_per_host
    physical_shape = submesh_shape(stage_devices, per_host)
    return PipeshardParallel(
        num_micro_batches=num_micro_batches,
        default_auto_sharding_option=option,
        layer_option=AutoLayerOption(
            layer_num=pipeline_parallel,
            remat_mode="coarse_grained_remat" if use_remat else "none",
        ),
        stage_option=ManualStageOption(
            forward_stage_layer_ids=[[i] for i in range(pipeline_parallel)],
            submesh_physical_shapes=[physical_shape] * pipeline_parallel,
            submesh_logical_shapes=[(data_parallel, operator_parallel)] * pipeline_parallel,
            submesh_autosharding_option_dicts=[{}] * pipeline_parallel,
        ),
    )


def _check_degree(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _rest_of_devices(used: int) -> int:
    """``data_parallel`` for ``-1``: the global mesh's devices over ``used``, the product
    of the other two degrees."""
    total = get_global_virtual_physical_mesh().num_devices
    if total % used:
        raise ValueError(
            f"data_parallel=-1 takes the devices left by operator_parallel * "
            f"pipeline_parallel = {used}, but the global mesh's {total} devices do not divide "
            "by it"
        )
    return total // used
