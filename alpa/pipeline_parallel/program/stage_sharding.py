"""Intra-op pass per stage: the sharding of every value on every submesh.

Each stage is sharded on its own logical submesh by the auto-sharding ILP
(``alpa.shard_parallel.auto_sharding``) with that stage's ``AutoShardingOption``. The
result is one record per stage (:class:`StagePins`): the ``PartitionSpec`` of every value
the stage reads, computes or holds inside a body, its resharding edges and its partial
sums. A value has one sharding on a stage's mesh, so every computation that writes or
reads it there (and every ``LOAD``, ``RESHARD`` and accumulator into it) agrees.

* The forward and backward computations of a stage are planned **together**, as one
  jaxpr: a value the forward passes to its backward is an intermediate of that jaxpr, so
  both computations use the one sharding the ILP chose for it.
* Apply-grad computations are planned afterwards, one at a time; their inputs that
  already have a sharding on the mesh (parameters, accumulated gradients) keep it, and
  the ILP plans around it (``fixed_in_specs``), as it does around the user's pins.
* A stage with ``enable_auto_sharding=False`` is not planned: its values take XLA's
  propagation from the user's pins (``propagated_stages``).
* Values the ILP does not name (or all values, with ``force_data_parallel=True``) are
  data parallel (:func:`data_parallel_spec`): split
  along dimension 0 over all devices of the submesh when the forward or backward computes
  them from the batch and it divides, else replicated. With ``prefer_reduce_scatter``, a
  data-parallel stage is ZeRO-2 (``deferred_sums.zero2_specs``).
* Stages whose computations are the same equations on the same logical mesh with the
  same option and fixed inputs (the middle stages of a stack of identical blocks) are
  planned by one ILP (:func:`structure_key`); the others take its specs position by
  position.
* A step output that replaces a donated input (the updated parameters and optimizer state
  of a train step, paired as ``ShardParallel`` pairs them) takes that input's sharding on
  its mesh (:func:`tie_donated_outputs`), so the next step's inputs are already in place;
  the apply-grad computation lays it out so, on the device, instead of every step
  starting with a resharding of the whole state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal
from jax.sharding import PartitionSpec

from alpa.device_mesh import MESH_AXIS_NAMES, LogicalDeviceMesh
from alpa.pipeline_parallel.program.computation import PipelineProgram, StageComputation
from alpa.pipeline_parallel.program.propagated_stages import propagate_into, propagates
from alpa.shard_parallel.auto_sharding import (
    AutoShardingOption,
    donated_state_pairs,
    plan_auto_sharding,
)
from alpa.shard_parallel.ilp.milp import taking_turns, turn_given_up
from alpa.tracing import StepJaxpr, TracedStep, new_jaxpr
from alpa.tracing.jaxpr_util import eqns_at_positions, is_var, nested_eqns, planned_bodies
from alpa.tracing.primitive_def import pipeline_p
from alpa.util import map_on_threads

DATA_AXES = MESH_AXIS_NAMES  # every logical submesh has these axes


def stage_options(
    default: AutoShardingOption | None, dicts: Sequence[dict | None]
) -> list[AutoShardingOption]:
    """Per stage, ``default`` (or ``AutoShardingOption()``) updated by the stage's dict."""
    if default is not None and not isinstance(default, AutoShardingOption):
        raise TypeError(
            "default_auto_sharding_option must be an AutoShardingOption, got "
            f"{type(default).__name__}"
        )
    base = default or AutoShardingOption()
    options = []
    for s, d in enumerate(dicts):
        if d is None:
            options.append(base)
            continue
        fields = {f.name for f in dataclasses.fields(AutoShardingOption)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"stage {s}: unknown AutoShardingOption fields {unknown}")
        options.append(dataclasses.replace(base, **d))
    for s, option in enumerate(options):
        if option.force_zero_stage_3:
            raise NotImplementedError(
                f"stage {s}: force_zero_stage_3 is not supported by PipeshardParallel yet"
            )
    return [option.snapshot() for option in options]  # frozen: a plan's options never change


def uses_ilp(option: AutoShardingOption, num_devices: int) -> bool:
    return num_devices > 1 and option.enable_auto_sharding and not option.force_data_parallel


def data_parallel_spec(var, program: PipelineProgram, num_devices: int) -> PartitionSpec:
    """Split along dimension 0 over all devices: a batch argument, or a value the forward
    or backward computes from the batch, when ``num_devices`` divides dimension 0; else
    replicated (parameters; the gradients ``alpa.grad`` returns and all of apply-grad)."""
    shape = var.aval.shape
    per_batch = var in program.per_micro_batch or var in program.input_stages
    if per_batch and var in program.batch_dependent and shape and shape[0] % num_devices == 0:
        return PartitionSpec(DATA_AXES)
    return PartitionSpec()


def value_spec(
    var, mesh: int, program: PipelineProgram, stage_pins: Sequence[StagePins], num_devices: int
):
    """The ``PartitionSpec`` of ``var`` on mesh ``mesh`` (of ``num_devices`` devices): the
    one stage ``mesh``'s record gives it, else ``[n, ...]`` (one slice per device along the
    stage's data axes) for the accumulator of a deferred gradient's partial sums, else
    :func:`data_parallel_spec`."""
    spec = stage_pins[mesh].var_specs.get(var)
    if spec is not None:
        return spec
    deferred = program.deferred
    if deferred is not None and var in deferred.accumulators:
        return deferred.partial_specs[var]
    return data_parallel_spec(var, program, num_devices)


def plan_stage_shardings(
    traced: TracedStep,
    program: PipelineProgram,
    logical_meshes: Sequence[LogicalDeviceMesh],
    options: Sequence[AutoShardingOption],
    names: dict,
    pinned: Sequence[Mapping] | None = None,
    workers: int | None = None,
) -> tuple[dict, tuple[StagePins, ...]]:
    """Per stage the ILP plan objective(s) (``{stage: [objective, ...]}``) of the
    computations the ILP planned, and per stage its record (:class:`StagePins`).

    ``pinned[s]`` (``value -> PartitionSpec``, the user's pins on stage ``s``,
    ``user_shardings``) is kept as it is. A stage's computations are planned in order
    (forward and backward as one, then each apply level, each reading the specs the
    earlier ones chose); stages are independent (each fills its own record), so they are
    planned on threads, ``workers`` at a time (default: one per CPU); the result does not
    depend on it."""
    pinned = list(pinned) if pinned is not None else [{}] * program.num_stages
    shared = _SharedPlans()

    def plan_stage(s: int) -> tuple[list[float], StagePins]:
        specs = dict(pinned[s])
        operands: dict = {}
        sums: dict = {}
        objectives: list[float] = []
        mesh, option = logical_meshes[s], options[s]
        if propagates(option, mesh.num_devices):

            def plan_group(comps) -> None:
                sub, produced = merged_step(
                    traced, program, comps, mesh.num_devices, names, f"stage{s}"
                )
                propagate_into(specs, s, sub, produced, mesh)

        elif uses_ilp(option, mesh.num_devices):
            planning = _Planning(s, program, mesh, option, names, traced, shared)

            def plan_group(comps) -> None:
                objectives.append(planning.plan_into(specs, operands, sums, comps))

        else:
            return objectives, StagePins(specs)
        forward_backward, applies = _stage_groups(program, s)
        if forward_backward:
            plan_group(forward_backward)
        # Each accumulated gradient in the spec of the value its backward computes.
        for out, operand in program.accumulated.items():
            if program.home[out] == s and operand in specs:
                specs[out] = specs[operand]
        for comp in applies:
            plan_group([comp])
        return objectives, StagePins(specs, operands, sums)

    stages = range(program.num_stages)
    planned = map_on_threads(taking_turns(plan_stage), stages, workers, "alpa-stage-sharding")
    objectives = {s: found for s, (found, _) in zip(stages, planned, strict=True) if found}
    return objectives, tuple(pins for _, pins in planned)


def _stage_groups(
    program: PipelineProgram, s: int
) -> tuple[list[StageComputation], list[StageComputation]]:
    """The computations of stage ``s`` with equations, in the groups the intra-op pass
    plans them in (the ILP's, or a compile's for a stage left to XLA): its forward,
    backward and weight-gradient ones together, then each apply-grad one on its own."""
    first = [program.computation(s, kind) for kind in ("forward", "backward", "weight")]
    applies = [c for c in program.computations if c.stage == s and c.kind == "apply" and c.eqns]
    return [c for c in first if c is not None and c.eqns], applies


@dataclasses.dataclass(frozen=True, eq=False)
class StagePins:
    """One stage's sharding plan, as ``shard_parallel``'s lowering takes a plan's pins
    (``lowering.plan_pins``): the stage's computations are lowered from it.

    Its ILP plans (and the user's pins, ZeRO-2 and the donated outputs' ties, each a
    function from these records to new ones) fill it. Not a ``ShardingPlan``: a stage is
    planned as several jaxprs (its forward and backward together, then each apply-grad
    computation), so it has no one list of inputs and outputs, nor one objective, for
    that record's required fields.

    Attributes:
      var_specs: ``value -> PartitionSpec`` for every value the stage's computations read
        or compute, and the values inside the bodies of checkpoint (``remat2``),
        ``scan``, ``while`` and ``cond`` equations; a value has one spec on the stage.
      operand_specs: ``equation -> specs``: the spec each operand of the equation (of the
        step or of such a body) is resharded to before the equation reads it, ``None``
        where it is read as produced: the plan's resharding edges.
      partial_sums: ``add equation -> PartialSum``: the adds of two partial results the
        plan priced as one reduction of their sum; the stage's lowering adds them on each
        device and reduces once (``shard_parallel.gradients.partial_sums``).
    """

    var_specs: Mapping = dataclasses.field(default_factory=dict)
    operand_specs: Mapping = dataclasses.field(default_factory=dict)
    partial_sums: Mapping = dataclasses.field(default_factory=dict)

    def rekeyed(self, value: Callable[[Any], Any], eqn: Callable[[Any], Any]) -> StagePins:
        """This record with each value keyed by ``value(v)`` and each equation by
        ``eqn(e)`` (a ref of a saved plan, the same value or equation of another jaxpr);
        a value or equation that maps to ``None`` is left out."""
        values = {value(v): spec for v, spec in self.var_specs.items()}
        operands = {eqn(e): specs for e, specs in self.operand_specs.items()}
        sums = {eqn(e): p for e, p in self.partial_sums.items()}
        return StagePins(
            {v: spec for v, spec in values.items() if v is not None},
            {e: specs for e, specs in operands.items() if e is not None},
            {e: p for e, p in sums.items() if e is not None},
        )

    def with_specs(self, var_specs: Mapping) -> StagePins:
        """This record with ``var_specs`` added to (and taking precedence over) its own."""
        if not var_specs:
            return self
        return dataclasses.replace(self, var_specs={**self.var_specs, **var_specs})

    def with_defaults(self, var_specs: Mapping) -> StagePins:
        """This record with the entries of ``var_specs`` for values it has no spec for."""
        if not var_specs:
            return self
        return dataclasses.replace(self, var_specs={**var_specs, **self.var_specs})


class _SharedPlans:
    """The ILP plans of one ``plan_stage_shardings``, by structure: the first thread that
    needs a plan solves it, the others wait for it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._plans: dict[tuple, Future] = {}

    def get(self, key: tuple, solve: Callable[[], Any]) -> Any:
        with self._lock:
            future = self._plans.get(key)
            owner = future is None
            if owner:
                future = self._plans[key] = Future()
        if owner:
            try:
                future.set_result(solve())
            except BaseException as e:
                future.set_exception(e)
        with turn_given_up():  # the owner may need the turn to finish
            return future.result()


@dataclasses.dataclass(frozen=True)
class _Planning:
    """The ILP planning of the computations of one stage ``s``."""

    s: int
    program: PipelineProgram
    mesh: LogicalDeviceMesh
    option: AutoShardingOption
    names: dict
    traced: TracedStep
    shared: _SharedPlans

    def plan_into(
        self, specs: dict, operands: dict, sums: dict, comps: Sequence[StageComputation]
    ) -> float | None:
        """Plan ``comps`` as one jaxpr; record in ``specs`` (the stage's ``value ->
        PartitionSpec``), ``operands`` (its resharding edges) and ``sums`` (its partial
        sums) what the plan decides where they have nothing yet; return the ILP
        objective. A computation of the same structure already planned (``shared``) lends
        its plan."""
        s, mesh, option = self.s, self.mesh, self.option
        sub, _ = merged_step(
            self.traced, self.program, comps, mesh.num_devices, self.names, f"stage{s}"
        )
        invars, outvars = sub.jaxpr.invars, sub.jaxpr.outvars
        # Inputs that already have a sharding on this mesh (the user's pins, or parameters
        # and gradients an earlier computation of the stage planned) arrive in it: the ILP
        # plans around them instead of assuming a spec XLA would then have to reshard into.
        fixed = [specs.get(v) for v in invars]

        def solve():
            # The stages' lowering runs the forward and the backward as programs of their
            # own, each resharding its own copy of a value: price it so.
            plan = plan_auto_sharding(
                sub, mesh, option, fixed_in_specs=fixed, comm_first=False,
                shared_reshardings=False,
            )  # fmt: skip
            return sub, plan

        key = (structure_key(sub), repr(mesh), repr(option), tuple(map(repr, fixed)))
        planned, plan = self.shared.get(key, solve)
        if tuple(plan.logical_mesh.shape) != tuple(mesh.shape):
            # The stage's logical mesh already takes the option's ``logical_mesh_shape``
            # (``pipeshard_passes``), and the ILP plans on the mesh it is given.
            raise AssertionError(
                f"stage {s}: the ILP planned on a logical mesh of shape "
                f"{tuple(plan.logical_mesh.shape)}, not the stage's {tuple(mesh.shape)}"
            )
        mine = StagePins(plan.var_specs, plan.operand_specs, plan.partial_sums)
        if planned is not sub:  # the same equations: values and equations match by position
            values = dict(zip(positional_vars(planned), positional_vars(sub), strict=True))
            eqns = eqns_at_positions(planned.jaxpr, sub.jaxpr)
            mine = mine.rekeyed(values.get, lambda e: eqns[id(e)])
        for v, spec in zip(invars, plan.in_specs, strict=True):
            specs.setdefault(v, spec)
        inputs = set(invars)
        for v, spec in mine.var_specs.items():
            if is_var(v) and v not in inputs:  # computed here, or inside a body
                specs.setdefault(v, spec)
        for v, spec in zip(outvars, plan.out_specs, strict=True):
            if spec is not None:
                specs.setdefault(v, spec)
        for e, operand_specs in mine.operand_specs.items():
            operands.setdefault(e, operand_specs)
        for e, partial_sum in mine.partial_sums.items():
            sums.setdefault(e, partial_sum)
        return plan.objective


def positional_vars(step: StepJaxpr) -> list:
    """The values of ``step``'s jaxpr in a fixed order: inputs, then per equation (in
    :func:`~alpa.tracing.jaxpr_util.nested_eqns`' order, bodies included) its outputs
    and the inputs of its bodies."""
    out = list(step.jaxpr.invars)
    for e in nested_eqns(step.jaxpr):
        out += e.outvars
        out += [v for _, body in planned_bodies(e) for v in body.invars]
    return out


def structure_key(step: StepJaxpr) -> str:
    """A digest of ``step``'s equations (:func:`equations_key`) and its batch inputs."""
    return hashlib.sha256(f"{equations_key(step)}\n{step.batch_invars!r}".encode()).hexdigest()


def equations_key(step: StepJaxpr) -> str:
    """A digest of ``step``'s equations, blind to the names of the
    pipeline markers in it: layers 3 and 4 of a stack of identical blocks differ only in
    their markers' ``name=layer_3`` / ``name=layer_4``. Equal keys: the same primitives
    with the same parameters, on values that correspond by position (each value is named
    by the order in which it first appears) and have the same types. Written directly
    rather than through the jaxpr's pretty-printer, which took most of the time of the
    stage-cost ILPs' keys on large models."""
    jaxpr = step.closed_jaxpr.jaxpr
    named: dict = {}  # var -> its text (each var's type is printed once)
    types: dict = {}  # aval -> its text (a model has few distinct ones)

    def type_text(aval) -> str:
        text = types.get(aval)
        if text is None:
            text = types[aval] = aval.str_short()
        return text

    def name(v) -> str:
        if isinstance(v, Literal):
            # A literal by its bytes: numpy's repr of a 0-d literal took 0.8 s of
            # GPT-39B's keys.
            value = np.asarray(v.val)
            return f"lit:{value.dtype}:{value.tobytes().hex()}:{type_text(v.aval)}"
        text = named.get(v)
        if text is None:
            text = named[v] = f"{len(named)}:{type_text(v.aval)}"
        return text

    parts = [",".join(name(v) for v in jaxpr.constvars), ",".join(name(v) for v in jaxpr.invars)]
    for e in jaxpr.eqns:
        params = {
            k: v for k, v in e.params.items() if not (e.primitive is pipeline_p and k == "name")
        }
        parts.append(
            f"{e.primitive.name}[{_params_text(params)}]({','.join(name(v) for v in e.invars)})"
            f"->({','.join(name(v) for v in e.outvars)})"
        )
    parts.append(",".join(name(v) for v in jaxpr.outvars))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _params_text(value) -> str:
    """Equation parameters as text: sub-jaxprs printed in full, callables by name (their
    repr holds an address, which differs between equal layers), the rest by ``repr``."""
    if isinstance(value, dict):
        return ";".join(f"{k}={_params_text(v)}" for k, v in sorted(value.items()))
    if isinstance(value, tuple | list):
        return "(" + ",".join(_params_text(v) for v in value) + ")"
    if isinstance(value, Jaxpr | ClosedJaxpr):
        return str(value)
    if callable(value) and not isinstance(value, type):
        return getattr(value, "__qualname__", type(value).__name__)
    return repr(value)


def merged_step(
    traced: TracedStep,
    program: PipelineProgram,
    comps: Sequence[StageComputation],
    num_devices: int,
    names: dict,
    name: str,
) -> tuple[StepJaxpr, set]:
    """``comps`` as one program (equations in order, each once; inputs: what they read
    from outside; outputs: what they write for others) for the intra-op pass on a mesh of
    ``num_devices`` devices, and the set of values its equations produce. Batch inputs are
    those that depend on the batch and whose dimension 0 ``num_devices`` divides."""
    closed = traced.closed_jaxpr
    eqns, seen = [], set()
    for comp in comps:
        for eqn in comp.eqns:
            if id(eqn) not in seen:
                seen.add(id(eqn))
                eqns.append(eqn)
    produced = {v for e in eqns for v in e.outvars if is_var(v)}
    invars, outvars = [], []
    for comp in comps:
        invars += [v for v in comp.invars if v not in produced and v not in invars]
        outvars += [v for v in comp.outvars if v not in outvars]
    jaxpr = new_jaxpr(closed.jaxpr, closed.jaxpr.constvars, invars, outvars, eqns)
    step_names = dict(zip(closed.jaxpr.invars, traced.leaf_names, strict=True))
    batch = tuple(
        v in program.batch_dependent and bool(v.aval.shape) and v.aval.shape[0] % num_devices == 0
        for v in invars
    )
    sub = StepJaxpr(
        closed_jaxpr=ClosedJaxpr(jaxpr, closed.consts),
        in_avals=tuple(v.aval for v in invars),
        batch_invars=batch,
        donated_invars=(False,) * len(invars),
        leaf_names=tuple(step_names.get(v, names.get(v, str(v))) for v in invars),
        name=name,
    )
    return sub, produced


def tie_donated_outputs(
    traced: TracedStep,
    program: PipelineProgram,
    stage_pins: Sequence[StagePins],
    mesh_sizes: Sequence[int],
) -> tuple[StagePins, ...]:
    """``stage_pins`` with each output that replaces a donated input given the input's
    spec on the output's mesh (new records; ``mesh_sizes[s]``: devices of mesh ``s``; see
    the module docstring)."""
    jaxpr = traced.closed_jaxpr.jaxpr
    ties: list[dict] = [{} for _ in stage_pins]
    for i, o in donated_state_pairs(traced):
        var_in, var_out = jaxpr.invars[i], jaxpr.outvars[o]
        if not is_var(var_out) or var_out not in program.home:
            continue
        mesh = program.home[var_out]
        if mesh not in program.input_stages[var_in]:
            continue
        spec = stage_pins[mesh].var_specs.get(var_in)
        if spec is None:
            spec = data_parallel_spec(var_in, program, mesh_sizes[mesh])
        ties[mesh][var_out] = spec
    return tuple(pins.with_specs(tied) for pins, tied in zip(stage_pins, ties, strict=True))
