"""``CreateStateParallel``: create the train state where the training step reads it.

A training script has three functions that touch the train state: one that creates it,
the training step, and an evaluation step. Only the training step deserves a plan of its
own; the other two should put the state exactly where the training step wants it
(``FollowParallel``, in ``alpa.methods.follow_parallel``, does it for the evaluation step).

``CreateStateParallel(train_step, other_args)`` parallelizes the state-creation function
so that every leaf of the state it returns is *created* in the sharding that the compiled
``train_step(state, other_args)`` reads it in (``other_args`` is the step's second
argument, as in Alpa: the batch): on the train step's mesh (for a pipeline, the leaf's
stage mesh), with each device computing and holding only its shard (the output sharding
is imposed on XLA's compilation of the creation function, whose random initializers are
partitionable). The first training step then moves nothing.

It compiles the training step first if it has not been compiled (``get_executable``
with abstract values). It works for one-mesh methods (``ShardParallel``,
``DataParallel``, ``Zero2Parallel``, ``Zero3Parallel``) and for ``PipeshardParallel``, on
the local and the Ray runtime, creating each leaf of a pipeline's state on its stage's
submesh (one program per submesh).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr
from jax.sharding import PartitionSpec

from alpa.device_mesh import LogicalDeviceMesh
from alpa.executables.base import Executable, check_dispatch_args
from alpa.executables.distributed import DistributedMeshExecutable
from alpa.executables.mesh import MeshExecutable, compile_shard_executable
from alpa.executables.pipeshard import PipeshardDriverExecutable
from alpa.executables.pipeshard_ray import PipeshardRayExecutable
from alpa.methods.shard_method import ParallelMethod
from alpa.runtime.placement import PlacementSpec
from alpa.shard_parallel.sharding_plan import ShardingPlan
from alpa.timer import timed
from alpa.tracing import TracedStep, leaf_signature, new_jaxpr

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
        target, specs = self._state_target(traced)
        if not isinstance(target, MeshExecutable | DistributedMeshExecutable):
            raise TypeError(
                f"the plan of a CreateStateParallel is a ShardingPlan for a one-mesh "
                f"train_step; {self.train_step.__name__} compiled to "
                f"{type(target).__name__} (compile it to see its per-mesh placement)"
            )
        return _creation_plan(traced, target.plan.logical_mesh, specs)

    def compile_executable(self, traced: TracedStep, args: Sequence[Any]) -> Executable:
        with timed("planning"):
            target, specs = self._state_target(traced)
        with timed("compile"):
            if isinstance(target, MeshExecutable | DistributedMeshExecutable):
                plan = _creation_plan(traced, target.plan.logical_mesh, specs)
                return _compile(traced, plan, _ray_mesh(target))
            if isinstance(target, PipeshardDriverExecutable | PipeshardRayExecutable):
                return PerMeshOutputsExecutable(traced, specs)
        raise NotImplementedError(
            f"CreateStateParallel does not support a train_step compiled to {type(target).__name__}"
        )

    def _state_target(self, traced: TracedStep) -> tuple[Executable, list[PlacementSpec]]:
        """:meth:`_target`, after checking that ``traced`` returns a state of the structure
        ``train_step`` took before; an error compiling ``train_step`` says what alpa
        passed it as the state."""
        step = self.train_step.__name__
        returned = _describe(traced.out_tree)
        last = getattr(self.train_step, "_last_executable", None)
        if last is not None and last.traced.in_tree.children():
            taken = last.traced.in_tree.children()[0]
            if taken != traced.out_tree:
                raise ValueError(
                    f"{traced.name} returns {returned}, but {step} takes "
                    f"{_describe(taken)} as its first argument, the state: "
                    f"CreateStateParallel creates the state {step} takes; return the whole "
                    "state (e.g. the TrainState), not part of it such as its parameters"
                )
        try:
            return self._target(traced)
        except Exception as e:
            returned_state = jax.tree.unflatten(traced.out_tree, [0] * traced.out_tree.num_leaves)
            if hasattr(returned_state, "params"):  # a state: the error is about something else
                raise
            e.add_note(
                f"CreateStateParallel compiled {step} with what {traced.name} returns, "
                f"{returned}, as its first argument (the state); {traced.name} must return "
                f"the whole state {step} takes (e.g. a TrainState), not its parameters alone"
            )
            raise

    def __repr__(self) -> str:
        return f"CreateStateParallel(train_step={self.train_step.__name__})"


def _describe(tree) -> str:
    """A pytree structure in words: ``a dict of 4 leaves (keys ['Dense_0', ...])``."""
    example = jax.tree.unflatten(tree, [0] * tree.num_leaves)
    keys = f" (keys {sorted(example)[:4]})" if isinstance(example, dict) else ""
    return f"a {type(example).__name__} of {tree.num_leaves} leaves{keys}"


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
        return DistributedMeshExecutable(traced, plan, ray_mesh, num_micro_batches)
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
