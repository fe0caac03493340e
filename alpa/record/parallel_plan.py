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
  (layers, submeshes, logical shapes, auto-sharding options) and, per stage, its
  sharding record (``stage_sharding.StagePins``: the spec of every value of its
  computations and of the values inside their bodies, resharded operands, partial
  sums); the split, the schedule's ticks and the instruction lists follow from
  these and are derived again;
* both: ``num_micro_batches``, the cluster shape, and where every input is placed.

Values and equations of the traced jaxpr are named by position (``plan_refs.value_refs``:
``in3`` is input 3, ``eqn12.0`` output 0 of equation 12, ``const0`` a constant), which a
fresh trace of the same function reproduces. A plan keeps a fingerprint of the step it was
made for (``plan_refs.step_fingerprint``); applied to any other step it raises ``ValueError``.
Devices are not recorded: a replay runs on the method's ``devices`` (default: the global
mesh), which must have the recorded number of devices.

The JSON form of each part is in :mod:`alpa.record.plan_json`; the method that replays a plan,
``PlannedParallel``, in :mod:`alpa.methods.planned_parallel`. The saved JSON carries the version of
its layout (``"format"``: :data:`PLAN_FORMAT`); a plan without it reads as format 1, and one
of a newer format is refused by the name of its file (:mod:`alpa.saved_format`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from jax.extend.core import Jaxpr

from alpa.pipeline_parallel.layers.layer_construction import (
    AutoLayerOption,
    LayerAssignment,
    ManualLayerOption,
)
from alpa.pipeline_parallel.pipeshard_plan import (
    PipeshardDecisions,
    PipeshardPlan,
)
from alpa.pipeline_parallel.program.stage_sharding import StagePins
from alpa.record.plan_json import (
    InconsistentPlanError,
    check_pipeline_decisions,
    expected_stage,
    layer_option_from_json,
    layer_option_to_json,
    mesh_from_json,
    mesh_to_json,
    option_to_json,
    partial_sum_from_json,
    placement_from_json,
    placement_to_json,
    sharding_plan_from_json,
    sharding_plan_to_json,
    spec_from_json,
    stage_pins_from_json,
    stage_pins_to_json,
    stage_plan_from_json,
    stage_plan_to_json,
)
from alpa.record.plan_refs import aval_text, eqn_refs, step_fingerprint, value_refs
from alpa.runtime.placement import PlacementSpec
from alpa.saved_format import FORMAT_KEY, read_format
from alpa.shard_parallel.auto_sharding import AutoShardingOption
from alpa.shard_parallel.lowering.compile import full_batch_avals
from alpa.shard_parallel.sharding_plan import ShardingPlan
from alpa.tracing import TracedStep

if TYPE_CHECKING:  # the executables import this record; it knows only their interface
    from alpa.executables.base import Executable

#: Version of the JSON layout ``ParallelPlan.to_json`` writes (field ``"format"``; the
#: rules for reading other versions are :mod:`alpa.saved_format`'s).
PLAN_FORMAT = 3

# Format 3: a pipeline plan's stages each have one sharding record ("stage_pins"), the
# specs of all the stage's values in it. Format 2 kept the specs of the values the stage
# computations read and write in a table of [ref, stage, spec] rows ("stage_specs"),
# beside the records; format 1 kept the records' fields in three such tables too
# ("body_specs", "operand_specs", "partial_sums"). Both are read into format 3's records
# (:func:`_stage_pins_of_format_1`, :func:`_with_stage_specs_of_format_2`).

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
      pipeline_schedule: a name of ``schedules.schedules`` (``"1f1b"``, ``"gpipe"``,
        ``"zb-h1"``, ``"interleaved-1f1b"``, ``"dualpipev"``, ``"inference"``).
      layer_option: the layer option the step was traced with (``alpa.grad`` cuts the
        loss function as it says, so a replay traces under it again).
      decisions: layers, stages, per-stage options and logical meshes, and per stage its
        sharding record keyed by value and equation refs (``plan_refs.value_refs``,
        ``plan_refs.eqn_refs``).
      split_rows: whether the step's stacked parameters were split by rows
        (``stacked_rows``): the refs name values of the split step, which a replay makes
        again.
    """

    pipeline_schedule: str
    layer_option: ManualLayerOption | AutoLayerOption
    decisions: PipeshardDecisions
    split_rows: bool = False


@dataclass(frozen=True)
class ParallelPlan:
    """Every decision of a compile of one step (module docstring).

    Attributes:
      method: what made the plan (``"auto-sharding ILP"``, ``"DataParallel"``,
        ``"PipeshardParallel"``, ...).
      step_name: the step function's name.
      fingerprint: ``plan_refs.step_fingerprint`` of the traced step.
      input_names: per input leaf, its name (``argument 1['x']``).
      input_avals: per input leaf, its dtype and shape as the caller passes it (the
        full batch).
      cluster_info: the devices the plan was made for.
      num_micro_batches: micro-batches per step (``None``: no gradient accumulation).
      sharding_plan: for one mesh, the ``ShardingPlan``, its values named by
        ``plan_refs.value_refs`` and its logical mesh without devices.
      pipeline_plan: for a pipeline, its :class:`PipelinePlan`.
      input_placement_specs: per input leaf (full batch), the meshes and specs it is
        placed on.
      batch_inputs, donated_inputs: per input leaf, whether it is split as the batch
        (``batch_argnums``) and whether it is donated (``donate_argnums``): said when a
        step differs from the plan's only there (``None`` in plans saved before them).
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
    batch_inputs: tuple[bool, ...] | None = None
    donated_inputs: tuple[bool, ...] | None = None

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
        eqns = {id(e): ref for ref, e in eqn_refs(traced.jaxpr).items()}
        decisions = replace(
            plan.decisions,
            logical_meshes=tuple(replace(m, devices=None) for m in plan.logical_meshes),
            stage_pins=tuple(
                pins.rekeyed(refs.__getitem__, lambda e: eqns[id(e)]) for pins in plan.stage_pins
            ),
        )
        layer_option = plan.layer_option or ManualLayerOption()
        return cls(
            method="PipeshardParallel",
            num_micro_batches=plan.num_micro_batches,
            cluster_info=ClusterInfo(plan.num_hosts, plan.num_devices_per_host),
            pipeline_plan=PipelinePlan(
                plan.schedule.name, layer_option, decisions, plan.row_split is not None
            ),
            input_placement_specs=_portable_placements(
                input_placement_specs, plan.user_traced, plan.num_micro_batches
            ),
            **_step_fields(plan.user_traced, plan.num_micro_batches),
        )

    # -- replay

    def check_step(self, traced: TracedStep) -> None:
        """Raise ``ValueError`` unless ``traced`` is the step this plan was made for."""
        if step_fingerprint(traced) == self.fingerprint:
            return
        here = tuple(aval_text(a) for a in full_batch_avals(traced, self.num_micro_batches))
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
            flags = _flag_difference(self, traced)
            if diffs:
                name, mine, theirs = diffs[0]
                detail = f"{name} was {mine} there and is {theirs} here"
            elif flags is not None:
                detail = f"{traced.name} has the same inputs, but {flags}"
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
            FORMAT_KEY: PLAN_FORMAT,
            "method": self.method,
            "step_name": self.step_name,
            "fingerprint": self.fingerprint,
            "input_names": list(self.input_names),
            "input_avals": list(self.input_avals),
            "cluster_info": dataclasses.asdict(self.cluster_info),
            "num_micro_batches": self.num_micro_batches,
            "sharding_plan": None,
            "pipeline_plan": None,
            "input_placement_specs": [placement_to_json(p) for p in self.input_placement_specs],
            "batch_inputs": _flags(self.batch_inputs),
            "donated_inputs": _flags(self.donated_inputs),
        }
        if self.sharding_plan is not None:
            data["sharding_plan"] = sharding_plan_to_json(self.sharding_plan)
        if self.pipeline_plan is not None:
            data["pipeline_plan"] = _pipeline_plan_to_json(self.pipeline_plan)
        return data

    @classmethod
    def from_dict(cls, data: Mapping, source: str = "the plan") -> ParallelPlan:
        """The plan :meth:`to_dict` returned, of format :data:`PLAN_FORMAT` or older (a
        plan without the field reads as format 1); ``source`` names where ``data`` came
        from in the errors. A plan of a newer format raises ``NewerFormatError``."""
        if not isinstance(data, Mapping):
            raise ValueError(
                f"{source} is not a ParallelPlan (what ParallelPlan.to_dict returns): it is "
                f"a {type(data).__name__}"
            )
        version = read_format(data, PLAN_FORMAT, "ParallelPlan", source)
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
            sharding_plan=None if sharding is None else sharding_plan_from_json(sharding),
            pipeline_plan=None if pipeline is None else _pipeline_plan_from_json(pipeline, version),
            input_placement_specs=tuple(
                placement_from_json(p) for p in data["input_placement_specs"]
            ),
            batch_inputs=_flags(data.get("batch_inputs")),
            donated_inputs=_flags(data.get("donated_inputs")),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str, source: str = "the text") -> ParallelPlan:
        """The plan in ``text`` (:meth:`to_json`'s, this format or an older one);
        ``source`` names where it came from in the errors for a text that is not a whole
        plan, or a plan of a newer format (``NewerFormatError``)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            ends = e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string")
            cut = " (it ends there: a truncated file?)" if ends else ""
            raise ValueError(
                f"{source} is not a ParallelPlan: its JSON is invalid at line {e.lineno} "
                f"column {e.colno} ({e.msg}){cut}"
            ) from None
        if not isinstance(data, dict):
            raise ValueError(f"{source} is not a ParallelPlan: it holds a {type(data).__name__}")
        try:
            return cls.from_dict(data, source)
        except KeyError as e:
            raise ValueError(
                f"{source} is not a whole ParallelPlan: it has no field {e.args[0]!r}"
            ) from None
        except InconsistentPlanError as e:
            raise InconsistentPlanError(f"{source}: the pipeline_plan's {e}") from None

    def save(self, path: str) -> None:
        """Write the plan to ``path`` as JSON."""
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> ParallelPlan:
        """The plan :meth:`save` wrote to ``path``."""
        with open(path) as f:
            return cls.from_json(f.read(), source=repr(str(path)))

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
        "input_avals": tuple(aval_text(a) for a in avals),
        "batch_inputs": _flags(traced.batch_invars),
        "donated_inputs": _flags(traced.donated_invars),
    }


def _flags(values) -> tuple[bool, ...] | None:
    return None if values is None else tuple(bool(v) for v in values)


def _flag_difference(plan: ParallelPlan, traced: TracedStep) -> str | None:
    """How ``traced``'s batch or donated inputs differ from ``plan``'s, in the user's
    terms (``None``: they do not, or the plan did not record them)."""
    for recorded, here, what, argnums in (
        (plan.donated_inputs, traced.donated_invars, "donated", "donate_argnums"),
        (plan.batch_inputs, traced.batch_invars, "split as the batch", "batch_argnums"),
    ):
        if recorded is None or len(recorded) != len(here):
            continue
        for name, was, now in zip(plan.input_names, recorded, here, strict=True):
            if bool(was) != bool(now):
                now_text, was_text = (what if f else f"not {what}" for f in (now, was))
                return (
                    f"{name} is {now_text} here and was {was_text} when the plan was "
                    f"made ({argnums} differ)"
                )
    return None


# ----------------------------------------------------------------------------- methods


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


# ----------------------------------------------------------------------------- JSON


def _pipeline_plan_to_json(plan: PipelinePlan) -> dict:
    d = plan.decisions
    layers = d.layers
    return {
        "pipeline_schedule": plan.pipeline_schedule,
        "layer_option": layer_option_to_json(plan.layer_option),
        "split_rows": plan.split_rows,
        "layers": {
            "layers": list(layers.layers),
            "kinds": None if layers.kinds is None else list(layers.kinds),
            "num_layers": layers.num_layers,
        },
        "stage_plan": stage_plan_to_json(d.stage_plan),
        "options": [option_to_json(o) for o in d.options],
        "logical_meshes": [mesh_to_json(m) for m in d.logical_meshes],
        "objectives": [[s, list(v)] for s, v in sorted(d.objectives.items())],
        "stage_pins": [stage_pins_to_json(pins) for pins in d.stage_pins],
    }


def _pipeline_plan_from_json(data: Mapping, version: int) -> PipelinePlan:
    layers = data["layers"]
    stage_plan = stage_plan_from_json(data["stage_plan"])
    num_stages = len(stage_plan.device_ranges)
    if version >= 2:
        stage_pins = tuple(stage_pins_from_json(pins) for pins in data["stage_pins"])
    else:
        stage_pins = _stage_pins_of_format_1(data, num_stages)
    if version < 3:
        stage_pins = _with_stage_specs_of_format_2(data["stage_specs"], stage_pins, num_stages)
    decisions = PipeshardDecisions(
        layers=LayerAssignment(
            tuple(layers["layers"]),
            None if layers["kinds"] is None else tuple(layers["kinds"]),
            layers["num_layers"],
        ),
        stage_plan=stage_plan,
        options=tuple(AutoShardingOption(**o).snapshot() for o in data["options"]),
        logical_meshes=tuple(mesh_from_json(m) for m in data["logical_meshes"]),
        objectives={s: list(v) for s, v in data["objectives"]},
        stage_pins=stage_pins,
    )
    check_pipeline_decisions(decisions)  # an edited file's stages, before they reach a pass
    return PipelinePlan(
        data["pipeline_schedule"],
        layer_option_from_json(data["layer_option"]),
        decisions,
        data.get("split_rows", False),  # absent from plans saved before rows were split
    )


def _stage_pins_of_format_1(data: Mapping, num_stages: int) -> tuple[StagePins, ...]:
    """The per-stage records of a format-1 pipeline plan, whose three tables
    ``body_specs``, ``operand_specs`` and ``partial_sums`` were keyed by ``(ref, stage)``
    (each absent from plans saved before the stages' lowering took it: those were priced
    without it, and lower without it)."""
    tables = {
        "body_specs": spec_from_json,
        "operand_specs": lambda specs: tuple(spec_from_json(spec) for spec in specs),
        "partial_sums": partial_sum_from_json,
    }
    per_stage = [_rows_per_stage(n, data.get(n, []), num_stages, r) for n, r in tables.items()]
    return tuple(StagePins(*(table[s] for table in per_stage)) for s in range(num_stages))


def _with_stage_specs_of_format_2(
    rows: Sequence, stage_pins: tuple[StagePins, ...], num_stages: int
) -> tuple[StagePins, ...]:
    """The per-stage records of a format-1 or format-2 pipeline plan, which kept the specs
    of the values its stage computations read and write in a table of
    ``[ref, stage, spec]`` rows (``rows``), with each row's spec in its stage's record."""
    specs = _rows_per_stage("stage_specs", rows, num_stages, spec_from_json)
    # Records beyond the stages are refused by name after (their count against the stages).
    return tuple(
        pins.with_specs(specs[s]) if s < num_stages else pins for s, pins in enumerate(stage_pins)
    )


def _rows_per_stage(name: str, rows: Sequence, num_stages: int, read) -> list[dict]:
    """Per stage, ``ref -> read(entry)`` of the ``[ref, stage, entry]`` rows of the older
    layouts' table ``name``; a row on a stage the plan lacks is refused by name."""
    per_stage: list[dict] = [{} for _ in range(num_stages)]
    for ref, stage, entry in rows:
        if not (isinstance(stage, int) and 0 <= stage < num_stages):
            raise InconsistentPlanError(
                f"{name} has an entry for {ref!r} on stage {stage}: " + expected_stage(num_stages)
            )
        per_stage[stage][ref] = read(entry)
    return per_stage
