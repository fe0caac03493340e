"""Methods that follow another step's plan: ``CreateStateParallel`` and ``FollowParallel``.

A training script has three functions that touch the train state: one that creates it,
the training step, and an evaluation step. Only the training step deserves a plan of its
own; the other two should put the state exactly where the training step wants it.

* ``CreateStateParallel(train_step, other_args)`` parallelizes the state-creation function
  so that every leaf of the state it returns is *created* in the sharding that the
  compiled ``train_step(state, *other_args)`` reads it in: on the train step's mesh (for a
  pipeline, the leaf's stage mesh), with each device computing and holding only its shard
  (the output sharding is imposed on XLA's compilation of the creation function, whose
  random initializers are partitionable). The first training step then moves nothing.
* ``FollowParallel(src_func)`` parallelizes an evaluation step (``eval_step(state,
  batch)``) on the mesh of ``src_func``'s last executable, with its first argument pinned
  to the sharding ``src_func`` reads that argument in, so evaluating between training
  steps moves no parameter. The rest of the step (the batch, the intermediate values) is
  planned by the auto-sharding ILP around those pinned inputs.

Both compile the other step first if it has not been compiled (``get_executable`` with
abstract values). They work on one-mesh methods (``ShardParallel``, ``DataParallel``,
``Zero2Parallel``, ``Zero3Parallel``) on the local and the Ray runtime, and on a
``PipeshardParallel`` training step on the local runtime (``CreateStateParallel``: each
leaf created on its stage's submesh; ``FollowParallel``: the evaluation step as a
pipeline on the training step's stages, with the inference schedule).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from alpa.executable import Executable, PlacementSpec, check_dispatch_args, leaf_placer
from alpa.parallel_method import ParallelMethod, PipeshardParallel, _check_num_micro_batches
from alpa.pipeline_parallel.layer_construction import ManualLayerOption
from alpa.pipeline_parallel.pipeshard_executable import PipeshardDriverExecutable
from alpa.pipeline_parallel.resharding import worker_transfer_plan
from alpa.pipeline_parallel.user_shardings import stage_inputs
from alpa.shard_parallel.auto_sharding import AutoShardingOption, plan_auto_sharding
from alpa.shard_parallel.distributed_executable import DistributedMeshExecutable
from alpa.shard_parallel.executable import MeshExecutable, compile_shard_executable
from alpa.shard_parallel.lowering import eval_jaxpr_with_constraints
from alpa.shard_parallel.sharding_plan import ShardingPlan
from alpa.timer import timed
from alpa.tracing import TracedStep, leaf_signature

REPLICATED = PartitionSpec()


def _check_parallelized(value, name: str) -> None:
    if not callable(getattr(value, "get_executable", None)):
        raise TypeError(
            f"{name} must be a function returned by alpa.parallelize, got "
            f"{type(value).__name__}: {value!r}"
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
    leaves, spec_tree = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, PlacementSpec))
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
      other_args: the training step's other arguments (arrays or
        ``jax.ShapeDtypeStruct`` s, e.g. a batch), to compile it for.
    """

    def __init__(self, train_step, other_args: Sequence[Any]):
        _check_parallelized(train_step, "train_step")
        if not isinstance(other_args, Sequence) or isinstance(other_args, str):
            raise TypeError(
                "other_args must be a sequence of train_step's other arguments, got "
                f"{type(other_args).__name__}"
            )
        self.train_step = train_step
        self.other_args = tuple(other_args)

    def _target(self, traced: TracedStep) -> tuple[Executable, list[PlacementSpec]]:
        target = self.train_step.get_executable(_output_avals(traced), *self.other_args)
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
        return _create_state_plan(traced, target, specs)

    def compile_executable(self, traced: TracedStep, args: Sequence[Any]) -> Executable:
        with timed("planning"):
            target, specs = self._target(traced)
        with timed("compile"):
            if isinstance(target, MeshExecutable):
                plan = _create_state_plan(traced, target, specs)
                return compile_shard_executable(traced, plan, None)
            if isinstance(target, DistributedMeshExecutable):
                plan = _create_state_plan(traced, target, specs)
                return DistributedMeshExecutable(
                    traced, plan, target.mesh, None, worker_transfer_plan
                )
            if isinstance(target, PipeshardDriverExecutable):
                return PerMeshOutputsExecutable(traced, [s.placements[0] for s in specs])
        raise NotImplementedError(
            f"CreateStateParallel does not support a train_step compiled to "
            f"{type(target).__name__} yet (a PipeshardParallel step on Ray): create the "
            "state with another method; the first step then places it"
        )

    def __repr__(self) -> str:
        return f"CreateStateParallel(train_step={self.train_step.__name__})"


def _create_state_plan(traced: TracedStep, target, specs: list[PlacementSpec]) -> ShardingPlan:
    return ShardingPlan(
        logical_mesh=target.plan.logical_mesh,
        in_specs=(REPLICATED,) * len(traced.jaxpr.invars),
        out_specs=tuple(spec.sharding_specs[0] for spec in specs),
        method="CreateStateParallel",
    )


class PerMeshOutputsExecutable(Executable):
    """A function whose outputs each live on one of several meshes, in a given sharding
    (``CreateStateParallel`` of a pipeline's state: each leaf on its stage's submesh).

    One program per mesh computes that mesh's outputs from the inputs (replicated on the
    mesh), compiled with the outputs' shardings, so each device computes and holds only
    its shards; work that several meshes' outputs share (splitting a random key) is done
    on each of them.
    """

    def __init__(self, traced: TracedStep, out_shardings: Sequence[NamedSharding]):
        self.traced = traced
        self.num_micro_batches = None
        self.out_shardings = list(out_shardings)
        closed = traced.closed_jaxpr
        groups: dict[Any, list[int]] = {}
        for i, sharding in enumerate(self.out_shardings):
            groups.setdefault(sharding.mesh, []).append(i)
        in_avals = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in traced.in_avals
        ]
        self._signatures = [leaf_signature(a) for a in in_avals]
        self._programs = []  # (output indices, input shardings, compiled)
        for mesh, indices in groups.items():

            def outputs(*leaves, indices=tuple(indices)):
                outs = eval_jaxpr_with_constraints(closed.jaxpr, closed.consts, leaves, {}, {})
                return [outs[i] for i in indices]

            in_shardings = [NamedSharding(mesh, REPLICATED)] * len(in_avals)
            compiled = (
                jax.jit(
                    outputs,
                    in_shardings=in_shardings,
                    out_shardings=[self.out_shardings[i] for i in indices],
                )
                .lower(*in_avals)
                .compile()
            )
            self._programs.append((indices, leaf_placer(in_shardings), compiled))
        self._last_outputs: Any = ()

    def launch(self, flat_args: Sequence[Any]) -> list[jax.Array]:
        outs: list[Any] = [None] * len(self.out_shardings)
        for indices, place, compiled in self._programs:
            for i, value in zip(indices, compiled(*place(list(flat_args))), strict=True):
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
        return [
            PlacementSpec(v.aval, (), (s.spec,), (s,))
            for v, s in zip(self.traced.jaxpr.outvars, self.out_shardings, strict=True)
        ]

    def get_hlo_text(self) -> list[str]:
        """Per mesh, the optimized HLO of its program."""
        return [compiled.as_text() for _, _, compiled in self._programs]

    def dump_debug_info(self, folder: str) -> None:
        import os

        os.makedirs(folder, exist_ok=True)
        for i, text in enumerate(self.get_hlo_text()):
            with open(os.path.join(folder, f"{self.traced.name}.mesh{i}.hlo.txt"), "w") as f:
                f.write(text)


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
    """

    def __init__(
        self,
        src_func,
        num_micro_batches: int | None = None,
        get_input_placement_specs=None,
        pipeline_schedule: str = "inference",
        layer_option=None,
    ):
        _check_parallelized(src_func, "src_func")
        if get_input_placement_specs is not None and not callable(get_input_placement_specs):
            raise TypeError(
                "get_input_placement_specs must be a callable returning placement specs, "
                f"got {type(get_input_placement_specs).__name__}"
            )
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
        leaves, tree = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, PlacementSpec))
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
        if isinstance(source, PipeshardDriverExecutable):
            return self._pipeline(traced, args, source).plan(traced, args)
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
                f"FollowParallel does not support a source compiled to {type(source).__name__} "
                "yet (a PipeshardParallel step on Ray)"
            )

    def _pipeline(
        self, traced: TracedStep, args: Sequence[Any], source: PipeshardDriverExecutable
    ) -> PipeshardParallel:
        """A pipeline on the source's stages (its stage option replayed on its devices,
        layers as the step marks them), each stage reading the followed argument's leaves
        it shares with the source's same stage in the source's sharding."""

        def method(stage_input_shardings=None) -> PipeshardParallel:
            return PipeshardParallel(
                devices=source.devices,
                num_micro_batches=self.num_micro_batches or 1,
                pipeline_schedule=self.pipeline_schedule,
                layer_option=self.layer_option or ManualLayerOption(),
                stage_option=source.plan.stage_option(),
                stage_input_shardings=stage_input_shardings,
            )

        program = method().plan(traced, args).program
        pinned = self._pinned_specs(traced, source)
        leaf_of = {v: i for i, v in enumerate(traced.jaxpr.invars[: len(pinned)])}
        shardings = []
        for stage in range(program.num_stages):
            row = []
            for v in stage_inputs(program, stage):
                spec = pinned[leaf_of[v]] if v in leaf_of else None
                if spec is not None and stage in spec.mesh_ids:
                    row.append(spec.sharding_specs[spec.mesh_ids.index(stage)])
                else:  # not followed, or the source reads it on another stage
                    row.append(None)
            shardings.append(row)
        return method(shardings)

    def compile_executable(self, traced: TracedStep, args: Sequence[Any]) -> Executable:
        source = self._source()
        if isinstance(source, PipeshardDriverExecutable):
            with timed("planning"):
                pipeline = self._pipeline(traced, args, source)
            return pipeline.compile_executable(traced, args)
        self._check_one_mesh(source)
        with timed("planning"):
            plan = self.plan(traced, args)
        with timed("compile"):
            if isinstance(source, DistributedMeshExecutable):
                return DistributedMeshExecutable(
                    traced, plan, source.mesh, self.num_micro_batches, worker_transfer_plan
                )
            return compile_shard_executable(traced, plan, self.num_micro_batches)

    def __repr__(self) -> str:
        return f"FollowParallel(src_func={self.src_func.__name__})"
