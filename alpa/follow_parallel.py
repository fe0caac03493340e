"""Methods that follow another step's plan: ``CreateStateParallel`` and ``FollowParallel``.

A training script has three functions that touch the train state: one that creates it,
the training step, and an evaluation step. Only the training step deserves a plan of its
own; the other two should put the state exactly where the training step wants it.

* ``CreateStateParallel(train_step, other_args)`` parallelizes the state-creation function
  so that every leaf of the state it returns is *created* in the sharding that the
  compiled ``train_step(state, other_args)`` reads it in (``other_args`` is the step's
  second argument, as in Alpa: the batch): on the train step's mesh (for a
  pipeline, the leaf's stage mesh), with each device computing and holding only its shard
  (the output sharding is imposed on XLA's compilation of the creation function, whose
  random initializers are partitionable). The first training step then moves nothing.
* ``FollowParallel(src_func)`` parallelizes an evaluation step (``eval_step(state,
  batch)``) on the mesh of ``src_func``'s last executable, with its first argument pinned
  to the sharding ``src_func`` reads that argument in, so evaluating between training
  steps moves no parameter. The rest of the step (the batch, the intermediate values) is
  planned by the auto-sharding ILP around those pinned inputs.

Both compile the other step first if it has not been compiled (``get_executable`` with
abstract values). They work for one-mesh methods (``ShardParallel``, ``DataParallel``,
``Zero2Parallel``, ``Zero3Parallel``) and for ``PipeshardParallel``, on the local and the
Ray runtime: ``CreateStateParallel`` creates each leaf of a pipeline's state on its stage's
submesh (one program per submesh); ``FollowParallel`` runs an evaluation step as a pipeline
on the training step's stages, with the inference schedule, cut into one layer per stage
where it first reads each stage's parameters (Alpa's ``layer_option="follow"``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import warnings
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Var
from jax.sharding import PartitionSpec

from alpa.device_mesh import LogicalDeviceMesh
from alpa.executables.base import Executable, check_dispatch_args
from alpa.executables.distributed import DistributedMeshExecutable
from alpa.executables.mesh import MeshExecutable, compile_shard_executable
from alpa.executables.pipeshard import PipeshardDriverExecutable
from alpa.executables.pipeshard_ray import PipeshardRayExecutable
from alpa.pipeline_parallel.layer_construction import ManualLayerOption
from alpa.pipeline_parallel.schedules import check_schedule_name
from alpa.pipeline_parallel.segments import is_boundary
from alpa.pipeline_parallel.user_shardings import stage_inputs
from alpa.pipeshard_method import PipeshardParallel
from alpa.runtime.placement import PlacementSpec
from alpa.runtime.resharding import worker_transfer_plan
from alpa.shard_method import ParallelMethod, _check_num_micro_batches
from alpa.shard_parallel.auto_sharding import AutoShardingOption, plan_auto_sharding
from alpa.shard_parallel.sharding_plan import ShardingPlan
from alpa.timer import timed
from alpa.tracing import TracedStep, leaf_signature, new_jaxpr
from alpa.tracing.primitive_def import mark_pipeline_boundary

REPLICATED = PartitionSpec()


def _is_spec(x) -> bool:
    return isinstance(x, PlacementSpec)


_PIPELINES = (PipeshardDriverExecutable, PipeshardRayExecutable)


def _check_parallelized(value, name: str) -> None:
    if not callable(getattr(value, "get_executable", None)):
        raise TypeError(
            f"{name} must be a function returned by alpa.parallelize, got "
            f"{type(value).__name__}: {value!r}"
        )


def _positional_range(fun) -> tuple[int, float] | None:
    """How many positional arguments ``fun`` takes: ``(required, most)`` (``most`` is
    ``inf`` with ``*args``), or ``None`` when its signature cannot be read."""
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):
        return None
    required, most = 0, 0.0
    for p in signature.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            most = math.inf
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            most += 1
            required += p.default is p.empty
    return required, most


def _step_args(train_step, other_args: Any) -> tuple[Any, ...]:
    """The arguments after the state that ``CreateStateParallel`` compiles ``train_step``
    with: Alpa's ``(other_args,)`` whenever the step takes two arguments; the elements of
    a tuple or list ``other_args`` when the step needs exactly that many more (Alpa's
    reading could not call it)."""
    fun = getattr(train_step, "fun", train_step)
    counts = _positional_range(fun)
    if counts is None:
        return (other_args,)
    required, most = counts
    if required <= 2 <= most:
        return (other_args,)
    if isinstance(other_args, tuple | list) and required <= 1 + len(other_args) <= most:
        return tuple(other_args)
    name = getattr(train_step, "__name__", "train_step")
    takes = f"{required}" if required == most else f"{required} to {most:g}"
    given = (
        f"a {type(other_args).__name__} of {len(other_args)}"
        if isinstance(other_args, tuple | list)
        else f"a {type(other_args).__name__}"
    )
    raise TypeError(
        f"CreateStateParallel({name}, other_args) calls {name}(state, other_args), as Alpa "
        f"does, but {name}{inspect.signature(fun)} takes {takes} positional arguments; "
        f"other_args is {given}. Pass the one argument after the state, or a tuple of the "
        f"{required - 1} arguments after it"
    )


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


def _output_avals(traced: TracedStep):
    """The step's outputs as ``jax.ShapeDtypeStruct`` s, in the output pytree."""
    avals = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
        for v in traced.jaxpr.outvars
    ]
    return jax.tree.unflatten(traced.out_tree, avals)


def _first_argument_specs(target: Executable, tree, what: str) -> list[PlacementSpec]:
    """The placement specs of ``target``'s first dynamic argument, flat, checked to have
    the pytree structure ``tree``."""
    specs = target.get_input_placement_specs()[0]
    leaves, spec_tree = jax.tree.flatten(specs, is_leaf=_is_spec)
    if spec_tree != tree:
        raise ValueError(
            f"{what} has the pytree structure {tree}, but the first argument of "
            f"{target.traced.name} has {spec_tree}"
        )
    return leaves


# ----------------------------------------------------------------------------- create state


class CreateStateParallel(ParallelMethod):
    """Create the train state in the sharding that ``train_step`` wants it in.

    Args:
      train_step: the parallelized training step (``alpa.parallelize``); its first
        argument is the state.
      other_args: the training step's second argument, as in Alpa (a batch: a dict of
        arrays or ``jax.ShapeDtypeStruct`` s); the step is compiled as
        ``train_step(state, other_args)``. For a step that needs more arguments after the
        state (which Alpa could not follow), a tuple or list of exactly those arguments.
    """

    def __init__(self, train_step, other_args: Any):
        _check_parallelized(train_step, "train_step")
        self.train_step = train_step
        self.other_args = other_args
        self._step_args = _step_args(train_step, other_args)

    def _target(self, traced: TracedStep) -> tuple[Executable, list[PlacementSpec]]:
        try:
            target = self.train_step.get_executable(_output_avals(traced), *self._step_args)
        except Exception as error:
            other = self.other_args
            if len(self._step_args) == 1 and isinstance(other, tuple | list) and len(other) == 1:
                error.add_note(
                    f"CreateStateParallel compiled {self.train_step.__name__}(state, "
                    f"other_args) with other_args={type(other).__name__} of one element as "
                    "its second argument, as Alpa does; if that element is the batch, pass "
                    "it itself: CreateStateParallel(train_step, batch)"
                )
            raise
        what = f"the state that {traced.name} returns"
        return target, _first_argument_specs(target, traced.out_tree, what)

    def plan(self, traced: TracedStep, args: Sequence[Any]) -> ShardingPlan:
        """For a one-mesh training step: its mesh, every input replicated, every output
        in the training step's sharding of that state leaf."""
        target, specs = self._target(traced)
        if not isinstance(target, MeshExecutable | DistributedMeshExecutable):
            raise TypeError(
                f"the plan of a CreateStateParallel is a ShardingPlan for a one-mesh "
                f"train_step; {self.train_step.__name__} compiled to "
                f"{type(target).__name__} (compile it to see its per-mesh placement)"
            )
        return _creation_plan(traced, target.plan.logical_mesh, specs)

    def compile_executable(self, traced: TracedStep, args: Sequence[Any]) -> Executable:
        with timed("planning"):
            target, specs = self._target(traced)
        with timed("compile"):
            if isinstance(target, MeshExecutable | DistributedMeshExecutable):
                plan = _creation_plan(traced, target.plan.logical_mesh, specs)
                return _compile(traced, plan, _ray_mesh(target))
            if isinstance(target, PipeshardDriverExecutable | PipeshardRayExecutable):
                return PerMeshOutputsExecutable(traced, specs)
        raise NotImplementedError(
            f"CreateStateParallel does not support a train_step compiled to {type(target).__name__}"
        )

    def __repr__(self) -> str:
        return f"CreateStateParallel(train_step={self.train_step.__name__})"


def _creation_plan(
    traced: TracedStep, logical_mesh: LogicalDeviceMesh, specs: Sequence[PlacementSpec]
) -> ShardingPlan:
    """Every input replicated on ``logical_mesh``, output ``i`` in ``specs[i]``'s sharding
    (on its first mesh)."""
    return ShardingPlan(
        logical_mesh=logical_mesh,
        in_specs=(REPLICATED,) * len(traced.jaxpr.invars),
        out_specs=tuple(spec.sharding_specs[0] for spec in specs),
        method="CreateStateParallel",
    )


def _compile(
    traced: TracedStep, plan: ShardingPlan, ray_mesh, num_micro_batches: int | None = None
) -> Executable:
    """``plan`` compiled in this process, or on the workers of ``ray_mesh``."""
    if ray_mesh is not None:
        return DistributedMeshExecutable(
            traced, plan, ray_mesh, num_micro_batches, worker_transfer_plan
        )
    return compile_shard_executable(traced, plan, num_micro_batches)


def _ray_mesh(executable: Executable):
    """The Ray mesh of a one-mesh executable, ``None`` for a local one."""
    return executable.mesh if isinstance(executable, DistributedMeshExecutable) else None


def _mesh_of(placement) -> tuple[Any, LogicalDeviceMesh, Any]:
    """``(key, logical mesh, Ray mesh or None)`` of a placement: a local ``NamedSharding``
    or a Ray ``(mesh, Layout)`` pair."""
    if isinstance(placement, tuple):
        mesh, layout = placement
        logical = LogicalDeviceMesh(tuple(layout.mesh_shape), axis_names=tuple(layout.axis_names))
        return (id(mesh), logical.shape, logical.axis_names), logical, mesh
    jax_mesh = placement.mesh
    logical = LogicalDeviceMesh(
        tuple(jax_mesh.devices.shape),
        devices=tuple(jax_mesh.devices.flat),
        axis_names=tuple(jax_mesh.axis_names),
    )
    return jax_mesh, logical, None


class PerMeshOutputsExecutable(Executable):
    """A function whose outputs each live on one of several meshes, in a given sharding
    (``CreateStateParallel`` of a pipeline's state: each leaf on its stage's submesh).

    Per mesh, a one-mesh executable of the function cut down to that mesh's outputs (XLA
    drops the work they do not need) computes them from the inputs, replicated on the
    mesh, with the outputs' shardings imposed, so each device computes and holds only its
    shards; work that several meshes' outputs share (splitting a random key) is done on
    each of them. The meshes are local submeshes or Ray meshes alike.
    """

    def __init__(self, traced: TracedStep, specs: Sequence[PlacementSpec]):
        self.traced = traced
        self.num_micro_batches = None
        self._specs = list(specs)
        groups: dict[Any, tuple[LogicalDeviceMesh, Any, list[int]]] = {}
        for i, spec in enumerate(specs):
            key, logical, ray_mesh = _mesh_of(spec.placements[0])
            groups.setdefault(key, (logical, ray_mesh, []))[2].append(i)
        jaxpr = traced.jaxpr
        self._parts: list[tuple[list[int], Executable]] = []
        for logical, ray_mesh, indices in groups.values():
            outvars = [jaxpr.outvars[i] for i in indices]
            part = dataclasses.replace(
                traced,
                closed_jaxpr=ClosedJaxpr(
                    new_jaxpr(jaxpr, jaxpr.constvars, jaxpr.invars, outvars, jaxpr.eqns),
                    traced.closed_jaxpr.consts,
                ),
                out_tree=jax.tree.structure([0] * len(indices)),
                donated_invars=(False,) * len(jaxpr.invars),  # every part reads the inputs
            )
            plan = _creation_plan(part, logical, [specs[i] for i in indices])
            self._parts.append((indices, _compile(part, plan, ray_mesh)))
        self._signatures = [leaf_signature(a) for a in traced.in_avals]
        self._last_outputs: Any = ()

    def launch(self, flat_args: Sequence[Any]) -> list[Any]:
        outs: list[Any] = [None] * len(self._specs)
        for indices, executable in self._parts:
            for i, value in zip(indices, executable.launch(list(flat_args)), strict=True):
                outs[i] = value
        self._last_outputs = outs
        return outs

    def dispatch(self, *dynamic_args: Any) -> Any:
        leaves = check_dispatch_args(self.traced, dynamic_args, self._signatures)
        return jax.tree.unflatten(self.traced.out_tree, self.launch(leaves))

    def preshard_flat_args(self, flat_args: Sequence[Any]) -> list[Any]:
        return list(flat_args)  # each mesh's program places its own copy

    def flat_input_placement_specs(self) -> list[PlacementSpec]:
        return [PlacementSpec(v.aval, (), ()) for v in self.traced.jaxpr.invars]

    def flat_output_placement_specs(self) -> list[PlacementSpec]:
        return list(self._specs)

    def get_hlo_text(self) -> list[str]:
        """Per mesh, the optimized HLO of its program."""
        return [executable.get_hlo_text() for _, executable in self._parts]

    def dump_debug_info(self, folder: str) -> None:
        for i, (_, executable) in enumerate(self._parts):
            executable.dump_debug_info(os.path.join(folder, f"mesh{i}"))


# ----------------------------------------------------------------------------- follow


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
        starting where the step first reads a followed leaf of that stage; ``"manual"``
        at its ``mark_pipeline_boundary()`` calls; or a layer option.

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
        each stage are first read (:func:`_following_layers`); ``"manual"`` at its
        ``mark_pipeline_boundary()`` calls; a layer option object as it says."""
        pinned = self._pinned_specs(traced, source)
        # A placement names a local pipeline's meshes by stage, a Ray pipeline's by mesh id.
        meshes = getattr(source, "meshes", [])
        mesh_ids = [getattr(m, "mesh_id", s) for s, m in enumerate(meshes)]
        stage_option = source.plan.stage_option()
        layer_option = self.layer_option
        if layer_option in (None, "follow"):
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
