"""``FollowParallel``: run an evaluation step where the training step keeps its state.

``FollowParallel(src_func)`` parallelizes an evaluation step (``eval_step(state, batch)``)
on the mesh of ``src_func``'s last executable, with its first argument pinned to the
sharding ``src_func`` reads that argument in, so evaluating between training steps moves
no parameter. The rest of the step (the batch, the intermediate values) is planned by the
auto-sharding ILP around those pinned inputs.

It needs ``src_func`` compiled (called, or its ``get_executable``). It works for one-mesh
methods (``ShardParallel``, ``DataParallel``, ``Zero2Parallel``, ``Zero3Parallel``) and for
``PipeshardParallel``, on the local and the Ray runtime: an evaluation step following a
pipeline runs as a pipeline on the training step's stages, with the inference schedule,
cut into one layer per stage where it first reads each stage's parameters (Alpa's
``layer_option="follow"``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Var

from alpa.executables.base import Executable
from alpa.executables.distributed import DistributedMeshExecutable
from alpa.executables.mesh import MeshExecutable
from alpa.methods.create_state_parallel import (
    _PIPELINES,
    _check_parallelized,
    _compile,
    _is_spec,
    _ray_mesh,
)
from alpa.methods.pipeshard_method import PipeshardParallel
from alpa.methods.shard_method import ParallelMethod, _check_num_micro_batches
from alpa.pipeline_parallel.layers.layer_construction import ManualLayerOption
from alpa.pipeline_parallel.layers.segments import is_boundary
from alpa.pipeline_parallel.program.user_shardings import stage_inputs
from alpa.pipeline_parallel.scheduling.schedules import check_schedule_name
from alpa.runtime.placement import PlacementSpec
from alpa.shard_parallel.auto_sharding import AutoShardingOption, plan_auto_sharding
from alpa.timer import timed
from alpa.tracing import TracedStep, new_jaxpr
from alpa.tracing.primitive_def import mark_pipeline_boundary


def _following_layers(
    traced: TracedStep, pinned: Sequence[PlacementSpec], mesh_ids: Sequence[Any], num_stages: int
) -> TracedStep:
    """``traced`` cut into ``num_stages`` layers by the stages its followed leaves
    (``pinned``, on the source's meshes ``mesh_ids``) live on, as Alpa's
    ``FollowLayerOption``: scanning the equations in order, each goes to the latest stage
    whose followed leaves have been read so far; a boundary (``mark_pipeline_boundary``)
    is put where the next stage begins, and the step's own boundaries are dropped. Its
    retraces (micro-batches) are cut the same way."""
    stage_of = {
        v: mesh_ids.index(spec.mesh_ids[0])
        for v, spec in zip(traced.jaxpr.invars, pinned, strict=False)
        if spec.mesh_ids and spec.mesh_ids[0] in mesh_ids
    }

    def cut(step: TracedStep) -> TracedStep:
        jaxpr = step.jaxpr
        by_var = dict(
            zip(jaxpr.invars, (stage_of.get(v) for v in traced.jaxpr.invars), strict=True)
        )
        eqns, layer = [], 0
        for eqn in jaxpr.eqns:
            if is_boundary(eqn):
                continue
            reads = [
                by_var[v] for v in eqn.invars if isinstance(v, Var) and by_var.get(v) is not None
            ]
            stage = max([layer, *reads])
            if stage > layer + 1:
                raise ValueError(
                    f"FollowParallel(layer_option='follow'): {step.name} reads no followed "
                    f"leaf of stage {layer + 1} between those of stages {layer} and {stage}, "
                    "so it cannot be cut into one layer per stage; mark its layers with "
                    "mark_pipeline_boundary() and pass layer_option='manual'"
                )
            if stage > layer:
                eqns.append(_BOUNDARY.replace(source_info=eqn.source_info))
                layer = stage
            eqns.append(eqn)
        if layer != num_stages - 1:
            raise ValueError(
                f"FollowParallel(layer_option='follow'): {step.name} reads followed leaves "
                f"of stages 0..{layer} only, of the {num_stages} stages it follows; mark its "
                "layers with mark_pipeline_boundary() and pass layer_option='manual'"
            )
        closed = ClosedJaxpr(
            new_jaxpr(jaxpr, jaxpr.constvars, jaxpr.invars, jaxpr.outvars, eqns),
            step.closed_jaxpr.consts,
        )
        return dataclasses.replace(step, closed_jaxpr=closed, retrace=again(step.retrace))

    def again(retrace):
        return None if retrace is None else (lambda d: cut(retrace(d)))

    return cut(traced)


def _boundary_eqn():
    """A ``mark_pipeline_boundary()`` equation, to insert into a jaxpr."""
    return jax.make_jaxpr(mark_pipeline_boundary)().jaxpr.eqns[0]


_BOUNDARY = _boundary_eqn()


class FollowParallel(ParallelMethod):
    """Parallelize a step as ``src_func`` is: on its mesh (or stages), with the first
    argument in the sharding ``src_func`` reads its first argument in.

    Args:
      src_func: the parallelized step to follow (``alpa.parallelize``), called or
        compiled at least once.
      num_micro_batches: micro-batches of this step (a pipeline's evaluation step; a
        one-mesh step runs its batch whole when ``None``).
      get_input_placement_specs: a callable returning the placement specs of this step's
        first argument (default: those of ``src_func``'s last executable).
      pipeline_schedule: for a pipelined ``src_func``: the schedule of this step
        (``"inference"`` for an evaluation step).
      layer_option: for a pipelined ``src_func``: how this step's layers are cut:
        ``"follow"`` (the default, Alpa's) one layer per stage of ``src_func``, each
        starting where the step first reads a followed leaf of that stage (a scanned
        model whose stacked rows ``src_func`` split between stages: cut as ``src_func``'s
        layer option cut it); ``"manual"`` at its ``mark_pipeline_boundary()`` calls; or
        a layer option.

    The first argument is this step's first argument as ``src_func`` takes it, or (Alpa's
    convention for an evaluation step) the ``params`` of the state ``src_func`` takes.
    ``num_micro_batches`` on an evaluation step that follows a one-mesh step is ignored
    with a warning, as in Alpa.
    """

    def __init__(
        self,
        src_func,
        num_micro_batches: int | None = None,
        get_input_placement_specs=None,
        pipeline_schedule: str = "inference",
        layer_option="follow",
    ):
        _check_parallelized(src_func, "src_func")
        if get_input_placement_specs is not None and not callable(get_input_placement_specs):
            raise TypeError(
                "get_input_placement_specs must be a callable returning placement specs, "
                f"got {type(get_input_placement_specs).__name__}"
            )
        check_schedule_name(pipeline_schedule)
        self.src_func = src_func
        self.num_micro_batches = _check_num_micro_batches(num_micro_batches)
        self.get_input_placement_specs = get_input_placement_specs
        self.pipeline_schedule = pipeline_schedule
        self.layer_option = layer_option

    def _source(self) -> Executable:
        try:
            return self.src_func.get_last_executable()
        except RuntimeError:
            raise RuntimeError(
                f"FollowParallel follows {self.src_func.__name__}, which has not been called "
                "or compiled yet: call it (or its get_executable) first"
            ) from None

    def _pinned_specs(self, traced: TracedStep, source: Executable) -> list[PlacementSpec]:
        if self.get_input_placement_specs is not None:
            specs = self.get_input_placement_specs()
        else:
            specs = source.get_input_placement_specs()[0]
        first = traced.in_tree.children()[0]
        leaves, tree = jax.tree.flatten(specs, is_leaf=_is_spec)
        if tree != first and hasattr(specs, "params"):
            # Alpa's convention: the evaluation step takes ``state.params`` of the state
            # the source takes.
            params_leaves, params_tree = jax.tree.flatten(specs.params, is_leaf=_is_spec)
            if params_tree == first:
                leaves, tree = params_leaves, params_tree
        if tree != first:
            raise ValueError(
                f"the first argument of {traced.name} has the pytree structure {first}, but "
                f"the placement specs it follows (of {self.src_func.__name__}) have {tree}"
            )
        for i, spec in enumerate(leaves):
            aval = traced.in_avals[i]
            if tuple(spec.aval.shape) != tuple(aval.shape):
                raise ValueError(
                    f"{traced.leaf_names[i]} of {traced.name} has shape {aval.shape}, but "
                    f"{self.src_func.__name__} places it with shape {spec.aval.shape}"
                )
        return leaves

    def plan(self, traced: TracedStep, args: Sequence[Any]):
        """The ``ShardingPlan`` on the source's mesh with the first argument pinned (the
        ``PipeshardPlan`` on its stages, for a pipelined source)."""
        source = self._source()
        if isinstance(source, _PIPELINES):
            pipeline, traced = self._pipeline(traced, args, source)
            return pipeline.plan(traced, args)
        self._check_one_mesh(source)
        pinned = self._pinned_specs(traced, source)
        fixed = [s.sharding_specs[0] for s in pinned]
        fixed += [None] * (len(traced.in_avals) - len(fixed))
        return plan_auto_sharding(
            traced, source.plan.logical_mesh, AutoShardingOption(), fixed_in_specs=fixed
        )

    @staticmethod
    def _check_one_mesh(source: Executable) -> None:
        if not isinstance(source, MeshExecutable | DistributedMeshExecutable):
            raise NotImplementedError(
                f"FollowParallel does not support a source compiled to {type(source).__name__}"
            )

    def _pipeline(
        self, traced: TracedStep, args: Sequence[Any], source: Executable
    ) -> tuple[PipeshardParallel, TracedStep]:
        """A pipeline on the source's stages (its stage option replayed on its devices),
        each stage reading the followed argument's leaves it shares with the source's same
        stage in the source's sharding; and the step as that pipeline cuts it.

        Layers, by ``layer_option``: ``"follow"`` (the default, Alpa's) cuts an
        evaluation step into one layer per source stage, where the followed leaves of
        each stage are first read (:func:`_following_layers`), or, when the source split
        a followed stacked leaf's rows between stages, as the source's layer option cut
        it; ``"manual"`` at its ``mark_pipeline_boundary()`` calls; a layer option object
        as it says."""
        pinned = self._pinned_specs(traced, source)
        # A placement names a local pipeline's meshes by stage, a Ray pipeline's by mesh id.
        meshes = getattr(source, "meshes", [])
        mesh_ids = [getattr(m, "mesh_id", s) for s, m in enumerate(meshes)]
        stage_option = source.plan.stage_option()
        layer_option = self.layer_option
        if layer_option in (None, "follow") and any(spec.rows for spec in pinned):
            # A stacked leaf the source split between stages (a scanned model's rows) is
            # split the same way only by the cut that split it: the source's own.
            layer_option = source.plan.layer_option
        elif layer_option in (None, "follow"):
            if traced.grad_marker() is None:
                num_stages = len(stage_option.forward_stage_layer_ids)
                traced = _following_layers(traced, pinned, mesh_ids, num_stages)
                stage_option = dataclasses.replace(
                    stage_option, forward_stage_layer_ids=[[i] for i in range(num_stages)]
                )
            # The cut is now the step's boundaries (a training step: its own).
            layer_option = ManualLayerOption()
        elif layer_option == "manual":
            layer_option = ManualLayerOption()

        def method(stage_input_shardings=None) -> PipeshardParallel:
            return PipeshardParallel(
                # A Ray pipeline runs on the global cluster, whose meshes are cached per
                # device range: the same stages get the same mesh workers.
                devices=getattr(source, "devices", None),
                num_micro_batches=self.num_micro_batches or 1,
                pipeline_schedule=self.pipeline_schedule,
                layer_option=layer_option,
                stage_option=stage_option,
                stage_input_shardings=stage_input_shardings,
            )

        try:
            program = method().plan(traced, args).program
        except ValueError as e:
            if self.layer_option == "manual":
                e.add_note(
                    "FollowParallel(..., layer_option='manual') cuts this step at its "
                    "mark_pipeline_boundary() calls; the default, layer_option='follow', "
                    "cuts it where it reads the parameters of each stage it follows"
                )
            raise
        leaf_of = {v: i for i, v in enumerate(traced.jaxpr.invars[: len(pinned)])}
        shardings = []
        for stage in range(program.num_stages):
            row = []
            for v in stage_inputs(program, stage):
                spec = pinned[leaf_of[v]] if v in leaf_of else None
                if spec is not None and mesh_ids[stage] in spec.mesh_ids:
                    row.append(spec.sharding_specs[spec.mesh_ids.index(mesh_ids[stage])])
                else:  # not followed, or the source reads it on another stage
                    row.append(None)
            shardings.append(row)
        return method(shardings), traced

    def compile_executable(self, traced: TracedStep, args: Sequence[Any]) -> Executable:
        source = self._source()
        if isinstance(source, _PIPELINES):
            with timed("planning"):
                pipeline, traced = self._pipeline(traced, args, source)
            return pipeline.compile_executable(traced, args)
        self._check_one_mesh(source)
        num_micro_batches = self.num_micro_batches
        if (
            num_micro_batches
            and num_micro_batches > 1
            and traced.grad_marker() is None
            and traced.retrace is not None
        ):
            # As Alpa: an evaluation step on one mesh runs its batch whole.
            warnings.warn(
                f"FollowParallel(num_micro_batches={num_micro_batches}) is ignored for "
                f"{traced.name}: it has no alpa.grad, and on one mesh an evaluation step "
                "runs its batch whole",
                UserWarning,
                stacklevel=2,
            )
            num_micro_batches = None
            # parallelize traced it at the micro-batch size: the whole batch instead.
            traced = traced.retrace(Fraction(1, self.num_micro_batches))
        with timed("planning"):
            plan = self.plan(traced, args)
        with timed("compile"):
            return _compile(traced, plan, _ray_mesh(source), num_micro_batches)

    def __repr__(self) -> str:
        return f"FollowParallel(src_func={self.src_func.__name__})"
