"""ParallelPlan: every decision of a compile, as data that outlives the process.

The search is the slow part of planning a step: the auto-sharding ILP (paper §4) and the
stage DP (§5); lowering and XLA only follow what they decided.
``executable.get_parallel_plan()`` records the decisions, and ``alpa.plan_to_method(plan)``
turns the record back into a parallel method that makes the same executable without
searching again::

    plan = p_step.get_executable(state, batch).get_parallel_plan()
    plan.save("plan.json")
    ...                                        # later, maybe in another process
    method = alpa.plan_to_method(alpa.ParallelPlan.load("plan.json"))
    p_step = alpa.parallelize(train_step, method=method)   # same HLO; no ILP, no DP

What a plan records:

* **one mesh** (``ShardParallel``, ``DataParallel``, ZeRO): the ``ShardingPlan``, i.e. the
  logical mesh (shape, axis names, alpha-beta), a ``PartitionSpec`` for every input and
  output, the intermediate values and the operands it pins, the data axes and the
  gradient specs;
* **pipeshard**: the schedule and layer option, the layer of every equation, the stages
  (layers, submeshes, logical shapes, auto-sharding options) and the sharding table
  ``(value, stage) -> PartitionSpec``; the split, the schedule's ticks and the
  instruction lists follow from these and are derived again;
* both: ``num_micro_batches``, the cluster shape, and where every input is placed.

Values and equations of the traced jaxpr are named by position (:func:`value_refs`:
``in3`` is input 3, ``eqn12.0`` output 0 of equation 12, ``const0`` a constant), which a
fresh trace of the same function reproduces. A plan keeps a fingerprint of the step it was
made for (:func:`step_fingerprint`); applied to any other step it raises ``ValueError``.
Devices are not recorded: a replay runs on the method's ``devices`` (default: the global
mesh), which must have the recorded number of devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np
from jax.extend.core import DropVar, Jaxpr, JaxprEqn, Var
from jax.sharding import PartitionSpec

from alpa.device_mesh import LogicalDeviceMesh
from alpa.executable import Executable, PlacementSpec
from alpa.parallel_method import (
    ParallelMethod,
    PipeshardParallel,
    _compile_one_mesh,
    resolve_logical_mesh,
)
from alpa.pipeline_parallel.layer_construction import (
    AutoLayerOption,
    LayerAssignment,
    ManualLayerOption,
)
from alpa.pipeline_parallel.pipeshard_plan import (
    PipeshardDecisions,
    PipeshardPlan,
    plan_pipeshard,
)
from alpa.pipeline_parallel.stage_construction import StagePlan
from alpa.shard_parallel.auto_sharding import AutoShardingOption
from alpa.shard_parallel.executable import full_batch_avals
from alpa.shard_parallel.sharding_plan import PartialSum, ShardingPlan
from alpa.tracing import TracedStep
from alpa.tracing.trace import REMAT_PRIMITIVES

#: Version of the JSON layout ``ParallelPlan.to_json`` writes.
PLAN_FORMAT = 1

# ----------------------------------------------------------------------------- naming


def value_refs(jaxpr: Jaxpr) -> dict[Var, str]:
    """A name for every value of ``jaxpr`` by its position: ``const{i}``, ``in{i}``,
    ``eqn{t}.{k}`` (output ``k`` of equation ``t``). The auto-sharding plan also pins the
    values inside checkpoint (``remat2``) bodies: in the body of equation ``t``, ``eqn{t}/``
    followed by the body's own names (``eqn3/in0``, ``eqn3/eqn5.0``), recursively."""
    refs: dict[Var, str] = {}
    for i, v in enumerate(jaxpr.constvars):
        refs[v] = f"const{i}"

    def name(jaxpr: Jaxpr, prefix: str) -> None:
        for i, v in enumerate(jaxpr.invars):
            refs.setdefault(v, f"{prefix}in{i}")
        for t, eqn in enumerate(jaxpr.eqns):
            for k, v in enumerate(eqn.outvars):
                if isinstance(v, Var) and not isinstance(v, DropVar):
                    refs.setdefault(v, f"{prefix}eqn{t}.{k}")
            if eqn.primitive.name in REMAT_PRIMITIVES:
                name(eqn.params["jaxpr"], f"{prefix}eqn{t}/")

    name(jaxpr, "")
    return refs


def eqn_refs(jaxpr: Jaxpr) -> dict[str, JaxprEqn]:
    """Every equation of ``jaxpr`` by a name of its position: ``eqn{t}``, and in the body of
    a checkpoint equation ``t``, ``eqn{t}/eqn{u}`` (as :func:`value_refs`)."""
    refs: dict[str, JaxprEqn] = {}

    def name(jaxpr: Jaxpr, prefix: str) -> None:
        for t, eqn in enumerate(jaxpr.eqns):
            refs[f"{prefix}eqn{t}"] = eqn
            if eqn.primitive.name in REMAT_PRIMITIVES:
                name(eqn.params["jaxpr"], f"{prefix}eqn{t}/")

    name(jaxpr, "")
    return refs


def step_fingerprint(traced: TracedStep) -> str:
    """A hash of what a plan depends on: the printed jaxpr (every equation with its
    shapes), the input avals, and which inputs are batch and donated."""
    # A parameter printed as a Python object may carry its address; it is not the step's.
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", str(traced.closed_jaxpr))
    parts = [
        text,
        repr([_aval_text(a) for a in traced.in_avals]),
        repr(traced.batch_invars),
        repr(traced.donated_invars),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _aval_text(aval) -> str:
    weak = "~" if getattr(aval, "weak_type", False) else ""
    return f"{weak}{np.dtype(aval.dtype).name}{list(aval.shape)}"


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ClusterInfo:
    """The shape of the devices a plan was made for."""

    num_hosts: int
    num_devices_per_host: int

    def __post_init__(self):
        for name in ("num_hosts", "num_devices_per_host"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ClusterInfo.{name} must be a positive int, got {value!r}")

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.num_devices_per_host


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline part of a plan.

    Attributes:
      pipeline_schedule: ``"1f1b"``, ``"gpipe"`` or ``"inference"``.
      layer_option: the layer option the step was traced with (``alpa.grad`` cuts the
        loss function as it says, so a replay traces under it again).
      decisions: layers, stages, per-stage options and logical meshes, and the sharding
        table keyed by ``(value ref, stage)`` (:func:`value_refs`).
    """

    pipeline_schedule: str
    layer_option: ManualLayerOption | AutoLayerOption
    decisions: PipeshardDecisions


@dataclass(frozen=True)
class ParallelPlan:
    """Every decision of a compile of one step (module docstring).

    Attributes:
      method: what made the plan (``"auto-sharding ILP"``, ``"DataParallel"``,
        ``"PipeshardParallel"``, ...).
      step_name: the step function's name.
      fingerprint: :func:`step_fingerprint` of the traced step.
      input_names: per input leaf, its name (``argument 1['x']``).
      input_avals: per input leaf, its dtype and shape as the caller passes it (the
        full batch).
      cluster_info: the devices the plan was made for.
      num_micro_batches: micro-batches per step (``None``: no gradient accumulation).
      sharding_plan: for one mesh, the ``ShardingPlan``, its values named by
        :func:`value_refs` and its logical mesh without devices.
      pipeline_plan: for a pipeline, its :class:`PipelinePlan`.
      input_placement_specs: per input leaf (full batch), the meshes and specs it is
        placed on.
    """

    method: str
    step_name: str
    fingerprint: str
    input_names: tuple[str, ...]
    input_avals: tuple[str, ...]
    cluster_info: ClusterInfo
    num_micro_batches: int | None
    sharding_plan: ShardingPlan | None = None
    pipeline_plan: PipelinePlan | None = None
    input_placement_specs: tuple[PlacementSpec, ...] = ()

    def __post_init__(self):
        if (self.sharding_plan is None) == (self.pipeline_plan is None):
            raise ValueError(
                "a ParallelPlan holds exactly one of sharding_plan (one mesh) and "
                "pipeline_plan (pipeshard)"
            )
        if len(self.input_names) != len(self.input_avals):
            raise ValueError(
                f"input_names has {len(self.input_names)} entries but input_avals has "
                f"{len(self.input_avals)}"
            )
        k = self.num_micro_batches
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"num_micro_batches must be None or a positive int, got {k!r}")

    # -- recording

    @classmethod
    def of(cls, executable: Executable) -> ParallelPlan:
        """The record of a compiled executable (``executable.get_parallel_plan()``)."""
        plan = getattr(executable, "plan", None)
        specs = executable.flat_input_placement_specs()
        if isinstance(plan, PipeshardPlan):
            return cls.from_pipeshard_plan(plan, specs)
        if isinstance(plan, ShardingPlan):
            mesh = getattr(executable, "mesh", None)  # a Ray mesh knows its hosts
            if mesh is not None:
                info = ClusterInfo(mesh.num_hosts, mesh.num_devices_per_host)
            else:
                info = ClusterInfo(1, plan.logical_mesh.num_devices)
            return cls.from_sharding_plan(
                executable.traced, plan, executable.num_micro_batches, info, specs
            )
        raise TypeError(f"{type(executable).__name__} keeps no plan to record")

    @classmethod
    def from_sharding_plan(
        cls,
        traced: TracedStep,
        plan: ShardingPlan,
        num_micro_batches: int | None,
        cluster_info: ClusterInfo,
        input_placement_specs: Sequence[PlacementSpec] = (),
    ) -> ParallelPlan:
        """The record of a one-mesh compile of ``traced`` with ``plan``."""
        return cls(
            method=plan.method or "ShardParallel",
            num_micro_batches=num_micro_batches,
            cluster_info=cluster_info,
            sharding_plan=_portable_sharding_plan(plan, traced.jaxpr),
            input_placement_specs=_portable_placements(
                input_placement_specs, traced, num_micro_batches
            ),
            **_step_fields(traced, num_micro_batches),
        )

    @classmethod
    def from_pipeshard_plan(
        cls, plan: PipeshardPlan, input_placement_specs: Sequence[PlacementSpec] = ()
    ) -> ParallelPlan:
        """The record of a pipeshard compile made from ``plan``."""
        traced = plan.traced
        refs = value_refs(traced.jaxpr)
        decisions = plan.decisions()
        decisions = replace(
            decisions,
            logical_meshes=tuple(replace(m, devices=None) for m in decisions.logical_meshes),
            stage_specs={(refs[v], s): spec for (v, s), spec in decisions.stage_specs.items()},
        )
        layer_option = plan.layer_option or ManualLayerOption()
        return cls(
            method="PipeshardParallel",
            num_micro_batches=plan.num_micro_batches,
            cluster_info=ClusterInfo(plan.num_hosts, plan.num_devices_per_host),
            pipeline_plan=PipelinePlan(plan.schedule.name, layer_option, decisions),
            input_placement_specs=_portable_placements(
                input_placement_specs, traced, plan.num_micro_batches
            ),
            **_step_fields(traced, plan.num_micro_batches),
        )

    # -- replay

    def check_step(self, traced: TracedStep) -> None:
        """Raise ``ValueError`` unless ``traced`` is the step this plan was made for."""
        if step_fingerprint(traced) == self.fingerprint:
            return
        here = tuple(_aval_text(a) for a in full_batch_avals(traced, self.num_micro_batches))
        if len(here) != len(self.input_avals):
            detail = (
                f"it has {len(self.input_avals)} input leaves, {traced.name} is called with "
                f"{len(here)}"
            )
        else:
            diffs = [
                (name, mine, theirs)
                for name, mine, theirs in zip(self.input_names, self.input_avals, here, strict=True)
                if mine != theirs
            ]
            if diffs:
                name, mine, theirs = diffs[0]
                detail = f"{name} was {mine} there and is {theirs} here"
            else:
                detail = (
                    f"{traced.name} has the same inputs but computes something else "
                    "(its traced jaxpr differs)"
                )
        raise ValueError(
            f"this ParallelPlan was made for another step ({self.step_name}): {detail}. A "
            "plan replays only the step and input shapes it was recorded for; plan this "
            "step with a parallel method instead"
        )

    # -- serialization

    def to_dict(self) -> dict:
        """The plan as JSON-able data."""
        data: dict[str, Any] = {
            "format": PLAN_FORMAT,
            "method": self.method,
            "step_name": self.step_name,
            "fingerprint": self.fingerprint,
            "input_names": list(self.input_names),
            "input_avals": list(self.input_avals),
            "cluster_info": dataclasses.asdict(self.cluster_info),
            "num_micro_batches": self.num_micro_batches,
            "sharding_plan": None,
            "pipeline_plan": None,
            "input_placement_specs": [_placement_to_json(p) for p in self.input_placement_specs],
        }
        if self.sharding_plan is not None:
            data["sharding_plan"] = _sharding_plan_to_json(self.sharding_plan)
        if self.pipeline_plan is not None:
            data["pipeline_plan"] = _pipeline_plan_to_json(self.pipeline_plan)
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> ParallelPlan:
        """The plan :meth:`to_dict` returned."""
        if not isinstance(data, Mapping) or data.get("format") != PLAN_FORMAT:
            found = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(
                f"not a ParallelPlan of format {PLAN_FORMAT} (what ParallelPlan.to_json "
                f"writes): format is {found!r}"
            )
        sharding = data["sharding_plan"]
        pipeline = data["pipeline_plan"]
        return cls(
            method=data["method"],
            step_name=data["step_name"],
            fingerprint=data["fingerprint"],
            input_names=tuple(data["input_names"]),
            input_avals=tuple(data["input_avals"]),
            cluster_info=ClusterInfo(**data["cluster_info"]),
            num_micro_batches=data["num_micro_batches"],
            sharding_plan=None if sharding is None else _sharding_plan_from_json(sharding),
            pipeline_plan=None if pipeline is None else _pipeline_plan_from_json(pipeline),
            input_placement_specs=tuple(
                _placement_from_json(p) for p in data["input_placement_specs"]
            ),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ParallelPlan:
        return cls.from_dict(json.loads(text))

    def save(self, path: str) -> None:
        """Write the plan to ``path`` as JSON."""
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> ParallelPlan:
        """The plan :meth:`save` wrote to ``path``."""
        with open(path) as f:
            return cls.from_json(f.read())

    # -- reading

    def __str__(self) -> str:
        info = self.cluster_info
        lines = [
            f"ParallelPlan of {self.step_name} ({self.method}) on {info.num_hosts} x "
            f"{info.num_devices_per_host} devices, num_micro_batches={self.num_micro_batches}"
        ]
        if self.sharding_plan is not None:
            plan = self.sharding_plan
            mesh = plan.logical_mesh
            lines.append(
                f"logical mesh {mesh.shape} axes {mesh.axis_names}; "
                f"{len(plan.var_specs)} intermediate values and "
                f"{len(plan.operand_specs)} equations' operands pinned"
            )
            rows = [("input", "shape", "sharding")]
            rows += [
                (name, aval, str(spec))
                for name, aval, spec in zip(
                    self.input_names, self.input_avals, plan.in_specs, strict=True
                )
            ]
        else:
            pipeline = self.pipeline_plan
            stage_plan = pipeline.decisions.stage_plan
            lines.append(
                f"{pipeline.decisions.layers.num_layers} layers, {stage_plan.num_stages} "
                f"stages, schedule {pipeline.pipeline_schedule}"
            )
            rows = [("stage", "layers", "devices", "logical mesh")]
            for s, layers in enumerate(stage_plan.stage_layers()):
                start, stop = stage_plan.device_ranges[s]
                mesh = pipeline.decisions.logical_meshes[s]
                rows.append((str(s), str(layers), f"{start}..{stop - 1}", str(mesh.shape)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        return "\n".join(lines)


def _step_fields(traced: TracedStep, num_micro_batches: int | None) -> dict:
    avals = full_batch_avals(traced, num_micro_batches)
    return {
        "step_name": traced.name,
        "fingerprint": step_fingerprint(traced),
        "input_names": tuple(traced.leaf_names),
        "input_avals": tuple(_aval_text(a) for a in avals),
    }


# ----------------------------------------------------------------------------- methods


def plan_to_method(plan: ParallelPlan, devices=None) -> PlannedParallel:
    """A parallel method that compiles the step ``plan`` was recorded for exactly as
    recorded, without searching (no ILP, no stage DP). ``devices``: as a method's
    (default: the global mesh); it must have the plan's number of devices."""
    if not isinstance(plan, ParallelPlan):
        raise TypeError(
            "plan_to_method expects a ParallelPlan (executable.get_parallel_plan() or "
            f"ParallelPlan.load(path)), got {type(plan).__name__}"
        )
    return PlannedParallel(plan, devices)


class PlannedParallel(ParallelMethod):
    """The method of a recorded :class:`ParallelPlan` (:func:`plan_to_method`).

    ``plan()`` rebuilds the recorded ``ShardingPlan`` / ``PipeshardPlan`` for a fresh
    trace of the step, after checking that the trace is the recorded step; compiling it
    gives the recorded executable. A pipeline is traced under the recorded layer option,
    as ``PipeshardParallel`` traces it (an ``AutoLayerOption`` cuts the loss function
    while tracing); its stages and shardings are replayed.
    """

    def __init__(self, plan: ParallelPlan, devices=None):
        self.parallel_plan = plan
        self.devices = devices
        self.num_micro_batches = plan.num_micro_batches
        pipeline = plan.pipeline_plan
        self._pipeshard = None
        if pipeline is not None:
            # The recorded schedule and layer option; its stage and sharding options are
            # never read, the recorded decisions take their place.
            self._pipeshard = PipeshardParallel(
                devices=devices,
                num_micro_batches=plan.num_micro_batches or 1,
                pipeline_schedule=pipeline.pipeline_schedule,
                layer_option=pipeline.layer_option,
            )

    def trace_context(self) -> contextlib.AbstractContextManager:
        if self._pipeshard is None:
            return contextlib.nullcontext()
        return self._pipeshard.trace_context()

    def plan(self, traced: TracedStep, args: Sequence[Any], require_devices: bool = False):
        """The recorded plan of ``traced``: a ``ShardingPlan`` or a ``PipeshardPlan``."""
        self.parallel_plan.check_step(traced)
        if self._pipeshard is None:
            return self._sharding_plan(traced, require_devices)
        return self._pipeshard_plan(traced, args, require_devices)[0]

    def compile_executable(self, traced: TracedStep, args: Sequence[Any]) -> Executable:
        self.parallel_plan.check_step(traced)
        if self._pipeshard is None:
            plan = self._sharding_plan(traced, require_devices=True)
            return _compile_one_mesh(self.devices, traced, plan, self.num_micro_batches)
        plan, devices = self._pipeshard_plan(traced, args, require_devices=True)
        return self._pipeshard._compile_plan(plan, devices)

    def _sharding_plan(self, traced: TracedStep, require_devices: bool) -> ShardingPlan:
        recorded = self.parallel_plan.sharding_plan
        mesh = resolve_logical_mesh(self.devices, None, require_devices)
        if mesh.num_devices != recorded.logical_mesh.num_devices:
            raise ValueError(
                f"the ParallelPlan of {self.parallel_plan.step_name} was made for "
                f"{recorded.logical_mesh.num_devices} devices but devices has "
                f"{mesh.num_devices}"
            )
        logical = replace(recorded.logical_mesh, devices=mesh.devices)
        return _bound_sharding_plan(recorded, traced.jaxpr, logical)

    def _pipeshard_plan(self, traced: TracedStep, args, require_devices: bool):
        inner = self._pipeshard
        num_hosts, per_host, cluster, devices = inner._cluster()
        info = self.parallel_plan.cluster_info
        if (num_hosts, per_host) != (info.num_hosts, info.num_devices_per_host):
            raise ValueError(
                f"the ParallelPlan of {self.parallel_plan.step_name} was made for a cluster "
                f"of {info.num_hosts} x {info.num_devices_per_host} devices but devices is "
                f"{num_hosts} x {per_host}"
            )
        if devices is None and require_devices and inner._ray_cluster() is None:
            raise ValueError(
                f"devices is {type(self.devices).__name__} (a cluster that is not here, no "
                "devices): it can be planned for with parallelize(...).plan(*args), not run"
            )
        pipeline = self.parallel_plan.pipeline_plan
        recorded = pipeline.decisions
        vars_by_ref = {ref: v for v, ref in value_refs(traced.jaxpr).items()}
        decisions = replace(
            recorded,
            stage_specs={
                (_lookup(vars_by_ref, ref, traced), s): spec
                for (ref, s), spec in recorded.stage_specs.items()
            },
        )
        plan = plan_pipeshard(
            traced,
            num_hosts,
            per_host,
            cluster,
            inner.num_micro_batches,
            pipeline_schedule=pipeline.pipeline_schedule,
            layer_option=pipeline.layer_option,
            args=args,
            devices=devices,
            decisions=decisions,
        )
        return plan, devices

    def __repr__(self) -> str:
        plan = self.parallel_plan
        return (
            f"PlannedParallel({plan.method} plan of {plan.step_name}, "
            f"num_micro_batches={plan.num_micro_batches})"
        )


def _lookup(vars_by_ref: dict, ref: str, traced: TracedStep) -> Var:
    var = vars_by_ref.get(ref)
    if var is None:
        raise ValueError(
            f"the ParallelPlan names a value {ref!r} that {traced.name} does not have: it "
            "was made for another step"
        )
    return var


# ----------------------------------------------------------------------------- one mesh


def _portable_sharding_plan(plan: ShardingPlan, jaxpr: Jaxpr) -> ShardingPlan:
    """``plan`` with its values and equations named by position, its mesh without
    devices."""
    refs = value_refs(jaxpr)
    eqns = {id(e): ref for ref, e in eqn_refs(jaxpr).items()}
    return replace(
        plan,
        logical_mesh=replace(plan.logical_mesh, devices=None),
        var_specs={refs[v]: spec for v, spec in plan.var_specs.items()},
        operand_specs={eqns[id(e)]: s for e, s in plan.operand_specs.items()},
        partial_sums={eqns[id(e)]: p for e, p in plan.partial_sums.items()},
    )


def _bound_sharding_plan(
    plan: ShardingPlan, jaxpr: Jaxpr, logical_mesh: LogicalDeviceMesh
) -> ShardingPlan:
    """The portable ``plan`` on the values and equations of ``jaxpr``, on
    ``logical_mesh``."""
    vars_by_ref = {ref: v for v, ref in value_refs(jaxpr).items()}
    eqns_by_ref = eqn_refs(jaxpr)

    def find(table: dict, ref: str):
        if ref not in table:
            raise ValueError(
                f"the ParallelPlan names {ref!r}, which this step does not have: it was "
                "made for another step"
            )
        return table[ref]

    if len(plan.in_specs) != len(jaxpr.invars) or len(plan.out_specs) != len(jaxpr.outvars):
        raise ValueError(
            f"the ParallelPlan has {len(plan.in_specs)} inputs and {len(plan.out_specs)} "
            f"outputs, this step {len(jaxpr.invars)} and {len(jaxpr.outvars)}: it was made "
            "for another step"
        )
    return replace(
        plan,
        logical_mesh=logical_mesh,
        var_specs={find(vars_by_ref, r): spec for r, spec in plan.var_specs.items()},
        operand_specs={find(eqns_by_ref, r): s for r, s in plan.operand_specs.items()},
        partial_sums={find(eqns_by_ref, r): p for r, p in plan.partial_sums.items()},
    )


# ----------------------------------------------------------------------------- JSON


def _spec_to_json(spec: PartitionSpec | None) -> list | None:
    """``PartitionSpec('x', None, ('x', 'y'))`` -> ``['x', None, ['x', 'y']]``."""
    if spec is None:
        return None
    out: list = []
    for entry in spec:
        if entry is None or isinstance(entry, str):
            out.append(entry)
        elif isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
            out.append(list(entry))
        else:
            raise ValueError(
                f"cannot record the PartitionSpec {spec}: its entry {entry!r} is not a mesh "
                "axis name, a tuple of them or None"
            )
    return out


def _spec_from_json(data: list | None) -> PartitionSpec | None:
    if data is None:
        return None
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in data))


def _mesh_to_json(mesh: LogicalDeviceMesh) -> dict:
    return {
        "shape": list(mesh.shape),
        "axis_names": list(mesh.axis_names),
        "mesh_alpha": list(mesh.mesh_alpha),
        "mesh_beta": list(mesh.mesh_beta),
        "device_flops": mesh.device_flops,
        "memory_bandwidth": mesh.memory_bandwidth,
    }


def _mesh_from_json(data: Mapping) -> LogicalDeviceMesh:
    return LogicalDeviceMesh(
        tuple(data["shape"]),
        tuple(data["mesh_alpha"]),
        tuple(data["mesh_beta"]),
        axis_names=tuple(data["axis_names"]),
        device_flops=data["device_flops"],
        memory_bandwidth=data["memory_bandwidth"],
    )


def _sharding_plan_to_json(plan: ShardingPlan) -> dict:
    return {
        "method": plan.method,
        "logical_mesh": _mesh_to_json(plan.logical_mesh),
        "in_specs": [_spec_to_json(s) for s in plan.in_specs],
        "out_specs": [_spec_to_json(s) for s in plan.out_specs],
        "var_specs": {ref: _spec_to_json(s) for ref, s in plan.var_specs.items()},
        "operand_specs": {
            ref: [_spec_to_json(s) for s in specs] for ref, specs in plan.operand_specs.items()
        },
        "partial_sums": {
            ref: {
                "operand_specs": [[_spec_to_json(s) for s in specs] for specs in p.operand_specs],
                "reduce_axes": list(p.reduce_axes),
            }
            for ref, p in plan.partial_sums.items()
        },
        "data_axes": list(plan.data_axes),
        "grad_specs": None
        if plan.grad_specs is None
        else [_spec_to_json(s) for s in plan.grad_specs],
        "objective": plan.objective,
    }


def _sharding_plan_from_json(data: Mapping) -> ShardingPlan:
    grad_specs = data["grad_specs"]
    return ShardingPlan(
        logical_mesh=_mesh_from_json(data["logical_mesh"]),
        in_specs=tuple(_spec_from_json(s) for s in data["in_specs"]),
        out_specs=tuple(_spec_from_json(s) for s in data["out_specs"]),
        var_specs={ref: _spec_from_json(s) for ref, s in data["var_specs"].items()},
        operand_specs={
            ref: tuple(_spec_from_json(s) for s in specs)
            for ref, specs in data["operand_specs"].items()
        },
        partial_sums={
            ref: PartialSum(
                tuple(tuple(_spec_from_json(s) for s in specs) for specs in p["operand_specs"]),
                tuple(p["reduce_axes"]),
            )
            for ref, p in data.get("partial_sums", {}).items()
        },
        data_axes=tuple(data["data_axes"]),
        grad_specs=None if grad_specs is None else tuple(_spec_from_json(s) for s in grad_specs),
        objective=data["objective"],
        method=data["method"],
    )


def _portable_placements(
    specs: Sequence[PlacementSpec], traced: TracedStep, num_micro_batches: int | None
) -> tuple[PlacementSpec, ...]:
    """``specs`` without their devices, each leaf at the size the caller passes it."""
    if not specs:
        return ()
    avals = full_batch_avals(traced, num_micro_batches)
    return tuple(
        PlacementSpec(aval, tuple(p.mesh_ids), tuple(p.sharding_specs))
        for p, aval in zip(specs, avals, strict=True)
    )


def _placement_to_json(spec: PlacementSpec) -> dict:
    return {
        "shape": list(spec.aval.shape),
        "dtype": np.dtype(spec.aval.dtype).name,
        "mesh_ids": list(spec.mesh_ids),
        "sharding_specs": [_spec_to_json(s) for s in spec.sharding_specs],
    }


def _placement_from_json(data: Mapping) -> PlacementSpec:
    return PlacementSpec(
        jax.ShapeDtypeStruct(tuple(data["shape"]), np.dtype(data["dtype"])),
        tuple(data["mesh_ids"]),
        tuple(_spec_from_json(s) for s in data["sharding_specs"]),
    )


def _layer_option_to_json(option: ManualLayerOption | AutoLayerOption) -> dict:
    kind = "auto" if isinstance(option, AutoLayerOption) else "manual"
    fields = {f.name: getattr(option, f.name) for f in dataclasses.fields(option)}
    if "static_argnums" in fields:
        fields["static_argnums"] = list(fields["static_argnums"])
    return {"kind": kind, **fields}


def _layer_option_from_json(data: Mapping) -> ManualLayerOption | AutoLayerOption:
    fields = {k: v for k, v in data.items() if k != "kind"}
    if data["kind"] == "auto":
        fields["static_argnums"] = tuple(fields.get("static_argnums", ()))
        return AutoLayerOption(**fields)
    return ManualLayerOption(**fields)


def _option_to_json(option: AutoShardingOption) -> dict:
    out = {}
    for f in dataclasses.fields(option):
        value = getattr(option, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _stage_plan_to_json(plan: StagePlan) -> dict:
    return {
        "layer_to_stage": list(plan.layer_to_stage),
        "device_ranges": [list(r) for r in plan.device_ranges],
        "logical_shapes": [list(s) for s in plan.logical_shapes],
        "autosharding_option_dicts": [
            None if d is None else {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
            for d in plan.autosharding_option_dicts
        ],
        "submesh_shapes": [list(s) for s in plan.submesh_shapes],
        "latencies": None if plan.latencies is None else list(plan.latencies),
        "memory": None if plan.memory is None else list(plan.memory),
        "predicted_cost": plan.predicted_cost,
    }


def _stage_plan_from_json(data: Mapping) -> StagePlan:
    def pairs(rows):
        return tuple(tuple(int(n) for n in row) for row in rows)

    def floats(values):
        return None if values is None else tuple(float(v) for v in values)

    return StagePlan(
        layer_to_stage=tuple(data["layer_to_stage"]),
        device_ranges=pairs(data["device_ranges"]),
        logical_shapes=pairs(data["logical_shapes"]),
        autosharding_option_dicts=tuple(data["autosharding_option_dicts"]),
        submesh_shapes=pairs(data["submesh_shapes"]),
        latencies=floats(data["latencies"]),
        memory=floats(data["memory"]),
        predicted_cost=data["predicted_cost"],
    )


def _pipeline_plan_to_json(plan: PipelinePlan) -> dict:
    d = plan.decisions
    layers = d.layers
    return {
        "pipeline_schedule": plan.pipeline_schedule,
        "layer_option": _layer_option_to_json(plan.layer_option),
        "layers": {
            "layers": list(layers.layers),
            "kinds": None if layers.kinds is None else list(layers.kinds),
            "num_layers": layers.num_layers,
        },
        "stage_plan": _stage_plan_to_json(d.stage_plan),
        "options": [_option_to_json(o) for o in d.options],
        "logical_meshes": [_mesh_to_json(m) for m in d.logical_meshes],
        # Sorted, so that two records of one plan are the same text.
        "stage_specs": sorted(
            ([ref, s, _spec_to_json(spec)] for (ref, s), spec in d.stage_specs.items()),
            key=lambda row: (row[1], row[0]),
        ),
        "objectives": [[s, list(v)] for s, v in sorted(d.objectives.items())],
    }


def _pipeline_plan_from_json(data: Mapping) -> PipelinePlan:
    layers = data["layers"]
    decisions = PipeshardDecisions(
        layers=LayerAssignment(
            tuple(layers["layers"]),
            None if layers["kinds"] is None else tuple(layers["kinds"]),
            layers["num_layers"],
        ),
        stage_plan=_stage_plan_from_json(data["stage_plan"]),
        options=tuple(AutoShardingOption(**o) for o in data["options"]),
        logical_meshes=tuple(_mesh_from_json(m) for m in data["logical_meshes"]),
        stage_specs={(ref, s): _spec_from_json(spec) for ref, s, spec in data["stage_specs"]},
        objectives={s: list(v) for s, v in data["objectives"]},
    )
    return PipelinePlan(
        data["pipeline_schedule"], _layer_option_from_json(data["layer_option"]), decisions
    )
