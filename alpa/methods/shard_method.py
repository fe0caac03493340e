"""The parallel methods on one mesh, and the base class of every method.

A method turns a :class:`~alpa.tracing.TracedStep` into an
:class:`~alpa.executables.base.Executable`. ``ShardParallel`` runs the whole step on one mesh
(intra-operator parallelism); ``DataParallel``, ``Zero2Parallel`` and ``Zero3Parallel`` are
``ShardParallel`` with fixed plans. ``PipeshardParallel``, which cuts the step into
pipeline stages each sharded on its own submesh, is in :mod:`alpa.methods.pipeshard_method`;
the methods that follow another step's plan are in :mod:`alpa.methods.follow_parallel`. Alpa's
path for all of them is :mod:`alpa.parallel_method`.
"""

from __future__ import annotations

import abc
import contextlib
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from alpa.executables.base import Executable
from alpa.executables.distributed import DistributedMeshExecutable
from alpa.executables.mesh import compile_shard_executable
from alpa.resolved_cluster import ResolvedCluster, resolve_cluster
from alpa.runtime.ray_mesh import DistributedPhysicalDeviceMesh
from alpa.shard_parallel.auto_sharding import (
    AutoShardingOption,
    placed_input_specs,
    plan_auto_sharding,
    snapshot_for_compile,
)
from alpa.shard_parallel.gradients.grad_marking import mark_gradients
from alpa.shard_parallel.ilp.ilp_solver import InfeasibleMemoryBudgetError
from alpa.shard_parallel.strategies.data_parallel import data_parallel_plan
from alpa.shard_parallel.strategies.manual_sharding import (
    ManualShardingOption,
    ignored_auto_sharding_fields,
    manual_sharding_plan,
)
from alpa.timer import timed
from alpa.tracing import TracedStep


class ParallelMethod(abc.ABC):
    """What every method offers ``parallelize``."""

    #: Number of micro-batches the batch arguments are split into, or ``None``.
    num_micro_batches: int | None = None

    @abc.abstractmethod
    def compile_executable(self, traced: TracedStep, args: Sequence[Any]) -> Executable:
        """Compile ``traced``; ``args`` are the call's positional arguments (arrays or
        ``jax.ShapeDtypeStruct``), traced at micro-batch size when micro-batching."""

    @abc.abstractmethod
    def plan(self, traced: TracedStep, args: Sequence[Any]) -> Any:
        """Every decision of a compile of ``traced``, without compiling or running
        anything (``devices`` may be a cluster that is not here)."""

    def trace_context(self) -> contextlib.AbstractContextManager:
        """A context that ``parallelize`` traces the step in: options that act while
        tracing (none by default)."""
        return contextlib.nullcontext()

    def finish_trace(self, traced: TracedStep) -> TracedStep:
        """The step as this method plans it, from ``parallelize``'s trace (and each
        retrace) of it: ``traced`` itself by default."""
        return traced


def _check_num_micro_batches(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"num_micro_batches must be a positive int or None, got {value!r}")
    return None if value == 1 else value


def _check_option(value) -> AutoShardingOption:
    if not isinstance(value, AutoShardingOption):
        raise TypeError(
            f"auto_sharding_option must be an AutoShardingOption, got {type(value).__name__}"
        )
    return value


class _AutoShardingOptionHolder:
    """``as_option`` (Alpa's name) and ``auto_sharding_option``: the same mutable
    ``AutoShardingOption`` of a one-mesh method.

    As in Alpa, the method holds the user's option itself, so an assignment to it
    (``method.as_option.prefer_reduce_scatter = True``) acts at the method's next
    compilation; each compilation plans with a frozen snapshot of it
    (``AutoShardingOption.snapshot``), which the executable keeps.
    """

    auto_sharding_option: AutoShardingOption

    @property
    def as_option(self) -> AutoShardingOption:
        return self.auto_sharding_option

    @as_option.setter
    def as_option(self, value: AutoShardingOption) -> None:
        self.auto_sharding_option = _check_option(value)


#: Plans tried against XLA's allocation before a memory budget is declared unmeetable.
BUDGET_ATTEMPTS = 4


def _compile_within_budget(
    method, traced: TracedStep, plan, option: AutoShardingOption, resolve: bool, args=None
) -> Executable:
    """Compile ``plan``; with a ``memory_budget_per_device``, keep the budget's promise:
    the compiled program's allocation (``get_total_allocation_size``: arguments, outputs,
    temporaries) is within it, or the call fails with ``InfeasibleMemoryBudgetError``.

    The ILP's memory model is an estimate (``memory_model``: no collective buffers or
    alignment). When XLA allocates more than the budget, the ILP solves again with its
    budget scaled down by the factor it missed by, up to :data:`BUDGET_ATTEMPTS` plans;
    ``resolve=False`` (a fixed plan, which no budget changes) only checks. ``args``: the
    call's arguments, whose placed leaves each new plan keeps (``placed_input_specs``).
    """
    budget = option.memory_budget_per_device
    cluster = resolve_cluster(method.devices)
    with timed("compile"):
        executable = _compile_one_mesh(cluster, traced, plan, method.num_micro_batches)
    if budget is None or not hasattr(executable, "get_total_allocation_size"):
        return executable  # a Ray mesh's allocation is known to its workers only
    allocated = executable.get_total_allocation_size()
    closest, model_budget = allocated, budget
    attempts = BUDGET_ATTEMPTS - 1 if resolve else 0
    placed = None
    if allocated > budget and attempts and args is not None:
        placed = placed_input_specs(traced, args, plan.logical_mesh, warn=False)
    while allocated > budget and attempts:
        attempts -= 1
        model_budget *= budget / allocated  # the factor the model missed by
        try:
            with timed("planning"):
                plan = plan_auto_sharding(
                    traced,
                    plan.logical_mesh,
                    replace(option, memory_budget_per_device=model_budget),
                    fixed_in_specs=placed,
                    num_micro_batches=method.num_micro_batches,
                )
        except InfeasibleMemoryBudgetError:
            break
        with timed("compile"):
            executable = _compile_one_mesh(cluster, traced, plan, method.num_micro_batches)
        allocated = executable.get_total_allocation_size()
        closest = min(closest, allocated)
    if allocated <= budget:
        return executable
    raise InfeasibleMemoryBudgetError(
        f"memory_budget_per_device={budget:.0f} bytes cannot be met: the closest plan found "
        f"compiles to {closest} bytes per device (XLA's allocation: arguments, outputs and "
        f"temporaries) on logical mesh {plan.logical_mesh.shape}; raise the budget or use "
        "more devices"
    )


def _compile_one_mesh(
    cluster: ResolvedCluster, traced: TracedStep, plan, num_micro_batches
) -> Executable:
    """A one-mesh executable of ``plan``: in this process, or on the Ray workers of the
    ``cluster``'s mesh when they own its devices."""
    mesh = cluster.physical_mesh()
    if isinstance(mesh, DistributedPhysicalDeviceMesh):
        return DistributedMeshExecutable(traced, plan, mesh, num_micro_batches)
    return compile_shard_executable(traced, plan, num_micro_batches)


class ShardParallel(_AutoShardingOptionHolder, ParallelMethod):
    """Intra-operator parallelism: the whole step on one mesh.

    With ``manual_sharding_option`` the user's PartitionSpecs decide. Otherwise the
    auto-sharding pass decides (``alpa.shard_parallel.auto_sharding``).

    Args:
      devices: where the step runs (:func:`~alpa.resolved_cluster.resolve_cluster`):
        ``None`` (the cluster of ``alpa.init``, all of it), a list of jax devices, a
        physical mesh, the global cluster, a ``LogicalDeviceMesh`` (its view), or for
        ``plan()`` only a ``VirtualPhysicalMesh`` or ``ClusterSpec``.
      num_micro_batches: split each batch argument into this many micro-batches and
        accumulate gradients (the step must use ``alpa.grad``).
      auto_sharding_option: options of the auto-sharding pass.
      manual_sharding_option: user-given shardings.
    """

    def __init__(
        self,
        devices=None,
        num_micro_batches: int | None = None,
        auto_sharding_option: AutoShardingOption | None = None,
        manual_sharding_option: ManualShardingOption | None = None,
    ):
        if auto_sharding_option is not None:
            _check_option(auto_sharding_option)
        if manual_sharding_option is not None and not isinstance(
            manual_sharding_option, ManualShardingOption
        ):
            raise TypeError(
                "manual_sharding_option must be a ManualShardingOption, got "
                f"{type(manual_sharding_option).__name__}"
            )
        self.devices = devices
        self.num_micro_batches = _check_num_micro_batches(num_micro_batches)
        self.auto_sharding_option = auto_sharding_option or AutoShardingOption()
        self.manual_sharding_option = manual_sharding_option
        ignored = []
        if auto_sharding_option is not None and manual_sharding_option is not None:
            ignored = ignored_auto_sharding_fields(auto_sharding_option)
        if ignored:
            warnings.warn(
                "ShardParallel got both options: manual_sharding_option decides every "
                f"sharding, so auto_sharding_option's {', '.join(ignored)} "
                f"{'is' if len(ignored) == 1 else 'are'} ignored (of it only "
                "logical_mesh_shape, mesh_alpha and mesh_beta act, to view the devices)",
                UserWarning,
                stacklevel=2,
            )

    def finish_trace(self, traced: TracedStep) -> TracedStep:
        """As :meth:`_FixedPlanParallel.finish_trace` when the option asks for a ZeRO
        plan (``force_data_parallel`` with ``prefer_reduce_scatter``, or
        ``force_zero_stage_3``) or for the ILP's reduce-scatters (``prefer_reduce_scatter``)
        and no manual shardings decide: the lowering then writes the gradients that the
        ILP's plan reduce-scatters over the data axes as one packed reduce-scatter
        (``gradient_sync.reduce_at_marker``), where XLA on CPU would all-reduce and slice
        each."""
        option = self.auto_sharding_option
        if (
            self.manual_sharding_option is None
            and (_zero_stage(option) in (2, 3) or option.prefer_reduce_scatter)
            and self.num_micro_batches is None
        ):
            return mark_gradients(traced)
        return traced

    def plan(
        self,
        traced: TracedStep,
        args: Sequence[Any],
        require_devices: bool = False,
        option: AutoShardingOption | None = None,
    ):
        """The ``ShardingPlan`` of ``traced`` under ``option`` (default: a snapshot of the
        method's option); touches no device."""
        option = self.auto_sharding_option.snapshot() if option is None else option
        cluster = resolve_cluster(self.devices)
        logical_mesh = cluster.logical_mesh(option.logical_mesh_shape, require_devices)
        if self.manual_sharding_option is not None:
            return manual_sharding_plan(traced, logical_mesh, self.manual_sharding_option, args)
        # Arguments the caller placed on this mesh keep their shardings: the ILP plans
        # around them.
        placed = placed_input_specs(traced, args, logical_mesh)
        return plan_auto_sharding(
            traced, logical_mesh, option, fixed_in_specs=placed,
            num_micro_batches=self.num_micro_batches,
        )  # fmt: skip

    def compile_executable(self, traced: TracedStep, args: Sequence[Any]) -> Executable:
        option = snapshot_for_compile(self.auto_sharding_option)
        with timed("planning"):
            plan = self.plan(traced, args, require_devices=True, option=option)
        if self.manual_sharding_option is not None:
            with timed("compile"):
                executable = _compile_one_mesh(
                    resolve_cluster(self.devices), traced, plan, self.num_micro_batches
                )
        else:
            executable = _compile_within_budget(self, traced, plan, option, True, args)
        return _keep_option(executable, option)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_micro_batches={self.num_micro_batches}, "
            f"manual={self.manual_sharding_option is not None})"
        )


class _FixedPlanParallel(_AutoShardingOptionHolder, ParallelMethod):
    """Data parallelism with a ZeRO stage: a ShardParallel whose option fixes the plan.

    As in Alpa, the method is its ``as_option``: ``DataParallel`` is
    ``force_data_parallel``, ``Zero2Parallel`` adds ``prefer_reduce_scatter``,
    ``Zero3Parallel`` is ``force_zero_stage_3``. Changing those fields changes the plan
    (``DataParallel().as_option.prefer_reduce_scatter = True`` is ZeRO-2; clearing
    ``force_data_parallel`` hands the step to the ILP, as ``ShardParallel``); the other
    fields do not act on a fixed plan.
    """

    default_option = AutoShardingOption(force_data_parallel=True).snapshot()

    def __init__(self, devices=None, num_micro_batches: int | None = None):
        self.devices = devices
        self.num_micro_batches = _check_num_micro_batches(num_micro_batches)
        self.auto_sharding_option = replace(self.default_option)  # this method's own copy

    @property
    def zero_stage(self) -> int | None:
        """The ZeRO stage the option asks for (0: plain data parallel), ``None`` when it
        asks for no fixed plan."""
        return _zero_stage(self.auto_sharding_option)

    def finish_trace(self, traced: TracedStep) -> TracedStep:
        """With ZeRO (stage 2 or 3) and one micro-batch, a step differentiated with
        ``jax.grad`` gets the ``alpa.grad`` marker where its gradients are complete
        (``grad_marking.mark_gradients``), so that they are reduce-scattered there in one
        collective, as with ``alpa.grad``. With micro-batches what to accumulate is
        ``alpa.grad``'s to say (the step is refused when planned)."""
        if self.zero_stage in (2, 3) and self.num_micro_batches is None:
            return mark_gradients(traced)
        return traced

    @property
    def splits_only_the_batch(self) -> bool:
        """Whether the plan splits the step by its batch arguments alone (``parallelize``
        warns when there are none: every device would compute the whole step)."""
        return self.zero_stage is not None

    def plan(
        self,
        traced: TracedStep,
        args: Sequence[Any],
        require_devices: bool = False,
        option: AutoShardingOption | None = None,
    ):
        """The fixed ``ShardingPlan`` under ``option`` (default: a snapshot of the
        method's option); touches no device."""
        option = self.auto_sharding_option.snapshot() if option is None else option
        stage = _zero_stage(option)
        if stage is None:  # the user cleared the fixed plan: the ILP decides
            mesh_shape = option.logical_mesh_shape
            logical_mesh = resolve_cluster(self.devices).logical_mesh(mesh_shape, require_devices)
            return plan_auto_sharding(traced, logical_mesh, option)
        logical_mesh = resolve_cluster(self.devices).logical_mesh(None, require_devices)
        return data_parallel_plan(
            traced,
            logical_mesh,
            stage,
            type(self).__name__,
            gather_bound=option.force_zero_stage_3_all_gather_threshold,
        )

    def compile_executable(self, traced: TracedStep, args: Sequence[Any]) -> Executable:
        option = snapshot_for_compile(self.auto_sharding_option)
        with timed("planning"):
            plan = self.plan(traced, args, require_devices=True, option=option)
        # A fixed plan cannot trade communication for memory: its budget is only checked.
        resolve = _zero_stage(option) is None
        executable = _compile_within_budget(self, traced, plan, option, resolve)
        return _keep_option(executable, option)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_micro_batches={self.num_micro_batches})"


def _zero_stage(option: AutoShardingOption) -> int | None:
    if option.force_zero_stage_3:
        return 3
    if option.force_data_parallel:
        return 2 if option.prefer_reduce_scatter else 0
    return None


def _keep_option(executable: Executable, option: AutoShardingOption) -> Executable:
    """Record on ``executable`` the frozen option it was planned with."""
    executable.auto_sharding_option = option
    return executable


class DataParallel(_FixedPlanParallel):
    """Split the batch over all devices; replicate parameters and optimizer state;
    all-reduce gradients."""

    default_option = AutoShardingOption(force_data_parallel=True).snapshot()


class Zero2Parallel(_FixedPlanParallel):
    """Data parallel with the optimizer state sharded over devices (ZeRO stage 2)."""

    default_option = AutoShardingOption(
        force_data_parallel=True, prefer_reduce_scatter=True
    ).snapshot()


class Zero3Parallel(_FixedPlanParallel):
    """Data parallel with parameters and optimizer state sharded (ZeRO stage 3);
    parameters are gathered before use."""

    default_option = AutoShardingOption(force_zero_stage_3=True).snapshot()
