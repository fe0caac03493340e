"""PipeshardPlan: every decision of a pipeshard compile, made without touching a device.

``pipeshard_passes.plan_pipeshard`` makes it (the inter-op passes, in order); this module
is the record and its views. The plan names the sharding of every buffer its instructions
touch and the tile plan of every ``RESHARD`` (which piece of which source device goes to
which destination host), so a runtime only executes it: the local runtime counts those
bytes, the Ray runtime ships the same tile plans to its workers.

A plan prints as a table (stage, layers, submesh, logical shape, latency, memory) with
its schedule grid; :meth:`PipeshardPlan.summary` is its JSON-able record (versioned:
``SUMMARY_FORMAT``) and :meth:`PipeshardPlan.stage_option` replays its stages as a
``ManualStageOption``.
:attr:`PipeshardPlan.decisions` (layers, stages, the per-stage sharding plans that the
stage programs are lowered from), one field of the plan, given back to
``plan_pipeshard(decisions=...)``, makes the same plan without searching again: what
``alpa.plan_to_method`` replays. :attr:`PipeshardPlan.cost` prices it with the analytic
stage model; :meth:`PipeshardPlan.draw` pictures it (``plan_view``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from alpa.device_mesh import ClusterSpec, LogicalDeviceMesh
from alpa.pipeline_parallel.layers.layer_construction import (
    LayerAssignment,
)
from alpa.pipeline_parallel.program.computation import (
    PipelineProgram,
)
from alpa.pipeline_parallel.program.stage_sharding import DATA_AXES, StagePins
from alpa.pipeline_parallel.program.user_shardings import stage_inputs
from alpa.pipeline_parallel.scheduling import plan_view
from alpa.pipeline_parallel.scheduling.schedule_choice import (
    choose,
    held_memory,
    makespan,
    without_activations,
)
from alpa.pipeline_parallel.scheduling.schedule_record import PipelineSchedule
from alpa.pipeline_parallel.stages.layer_facts import per_device_bytes
from alpa.pipeline_parallel.stages.stage_construction import (
    ManualStageOption,
    StageContext,
    StagePlan,
)
from alpa.pipeline_parallel.stages.stage_cost import StagePlanCost, predict_stage_plan
from alpa.pipeline_parallel.stages.stage_problem import LogicalConfig
from alpa.pipeline_parallel.stages.stage_search import layer_problem
from alpa.pipeline_parallel.stages.stage_work import StepBound, step_bound
from alpa.runtime.instructions import Op, PipelineInstructions
from alpa.runtime.worker_program import Layout, TransferPlan
from alpa.saved_format import FORMAT_KEY, read_format
from alpa.shard_parallel.auto_sharding import AutoShardingOption
from alpa.tracing import TracedStep
from alpa.tracing.jaxpr_util import eqns_at_positions

#: Version of the JSON layout ``PipeshardPlan.to_json`` writes (field ``"format"``; the
#: rules for reading other versions are :mod:`alpa.saved_format`'s).
SUMMARY_FORMAT = 1


@dataclass(frozen=True, eq=False)
class PipeshardDecisions:
    """The decisions of a pipeshard plan that took a search to make: the field
    :attr:`PipeshardPlan.decisions` of every plan, and what :func:`plan_pipeshard` takes
    back to replay a plan without searching again (no layer construction, no stage DP, no
    ILP; ``alpa.plan_to_method``).

    Attributes:
      layers: the layer of every equation of the traced step.
      stage_plan: stages, their layers, submeshes and logical shapes.
      options: per stage, its resolved ``AutoShardingOption``.
      logical_meshes: per stage, the logical mesh its sharding was planned on.
      objectives: per stage, the ILP objective(s) of its computations.
      stage_pins: per stage, its sharding plan (``stage_sharding.StagePins``), what the
        stage's ILP plans (and the user's pins, ZeRO-2, the donated outputs' ties)
        decided: the spec of every value its computations read or compute and of the
        values inside the checkpoint, loop and branch bodies of its equations
        (``var_specs``), its resharding edges, the spec each operand is resharded to
        before an equation reads it (``operand_specs``), and the adds of two partial
        results priced as one reduction of their sum (``partial_sums``). Its equations
        are the traced step's; each stage computation is lowered from its stage's
        record on the split program's equations at the same positions
        (:attr:`PipeshardPlan.program_pins`) by ``shard_parallel``'s lowering of a
        plan's pins (``lowering.plan_pins``), as ``ShardParallel`` lowers its one plan,
        so it performs the collectives the ILP priced.
    """

    layers: LayerAssignment
    stage_plan: StagePlan
    options: tuple[AutoShardingOption, ...]
    logical_meshes: tuple[LogicalDeviceMesh, ...]
    objectives: dict
    stage_pins: tuple[StagePins, ...]


@dataclass(frozen=True, eq=False)
class PipeshardPlan:
    """Every decision of a pipeshard compile (module docstring).

    Attributes:
      traced: the traced step (at micro-batch size).
      names: a short name for every value (``v0``, ``v1``, ...) used by instructions.
      cluster: the hardware planned for and its shape: ``num_hosts`` x
        ``num_devices_per_host`` read from it.
      decisions: what the search decided (:class:`PipeshardDecisions`: layers, stages,
        per-stage options, logical meshes, ILP objectives and sharding plans), each also
        read as an attribute of the plan (``plan.stage_plan``, ``plan.stage_pins``, ...).
      program: the stage computations and where every value lives.
      value_specs: ``(value, mesh) -> PartitionSpec`` for every value a stage
        computation on that mesh reads or writes, every step input on the meshes that read
        it and every buffer: its stage record's spec, or the one the end of the chain
        filled in (``pipeshard_passes.resolve_value_specs``).
      schedule_candidates: with ``pipeline_schedule="auto"``, each training schedule
        priced on these stages (``schedule_choice.ScheduleCandidate``: seconds per step,
        memory per stage, whether it fits); :attr:`schedule` is the one chosen.
      schedule: the clock ticks of the pipeline.
      instructions: the typed instruction list of one step.
      buffer_specs: ``(value name, mesh) -> PartitionSpec`` of every buffer the
        instructions read or write (and of the step's inputs and outputs), on that mesh's
        logical shape (:meth:`buffer_layout`).
      reshards: instruction index -> the tile plan of that ``RESHARD``
        (``worker_program.TransferPlan``: source and destination layouts, and which
        piece of which source device goes to which destination host).
      num_micro_batches: micro-batches per step.
      row_split: the ``stacked_rows.RowSplit`` when ``traced`` is the caller's step with
        its stacked parameters split by rows (``user_traced`` is then the caller's).
      layer_option: the layer option the step was traced and cut with (``alpa.grad``
        reads it while tracing, so a replay traces under it again).
    """

    traced: TracedStep
    names: dict
    cluster: ClusterSpec
    decisions: PipeshardDecisions
    program: PipelineProgram
    value_specs: dict
    schedule: PipelineSchedule
    instructions: PipelineInstructions
    buffer_specs: dict
    reshards: dict
    num_micro_batches: int
    layer_option: Any = None
    schedule_candidates: tuple = ()
    row_split: Any = None

    @property
    def layers(self) -> LayerAssignment:
        return self.decisions.layers

    @property
    def stage_plan(self) -> StagePlan:
        return self.decisions.stage_plan

    @property
    def options(self) -> tuple[AutoShardingOption, ...]:
        return self.decisions.options

    @property
    def logical_meshes(self) -> tuple[LogicalDeviceMesh, ...]:
        return self.decisions.logical_meshes

    @property
    def objectives(self) -> dict:
        return self.decisions.objectives

    @property
    def stage_pins(self) -> tuple[StagePins, ...]:
        return self.decisions.stage_pins

    @functools.cached_property
    def program_pins(self) -> tuple[StagePins, ...]:
        """Per stage its sharding plan (:attr:`stage_pins`) with each equation the split
        program's at the same position (``split_computations`` rewrites some equations'
        operands, never their positions): what the stage programs are lowered from."""
        mine = eqns_at_positions(self.traced.jaxpr, self.program.closed_jaxpr.jaxpr)
        return tuple(pins.rekeyed(lambda v: v, lambda e: mine[id(e)]) for pins in self.stage_pins)

    @property
    def user_traced(self) -> TracedStep:
        """The step as its caller traced it (``traced`` before its stacked parameters
        were split by rows; ``traced`` itself when none were)."""
        return self.traced if self.row_split is None else self.row_split.original

    @property
    def num_hosts(self) -> int:
        return self.cluster.num_nodes

    @property
    def num_devices_per_host(self) -> int:
        return self.cluster.num_devices_per_node

    @property
    def num_stages(self) -> int:
        return self.stage_plan.num_stages

    def buffer_layout(self, key) -> Layout:
        """Where buffer ``key`` (``(value name, micro-batch, mesh)``) lives: its mesh's
        logical shape and axis names, and its spec."""
        return layout_of(self.logical_meshes, self.buffer_specs, key)

    def resharded_bytes(self) -> int:
        """Bytes one step's ``RESHARD`` s move between meshes, by their tile plans (each
        piece once per destination host)."""
        return sum(plan.nbytes() for plan in self.reshards.values())

    def stage_option(self) -> ManualStageOption:
        """These stages as a ``ManualStageOption`` (to compile them again without the DP)."""
        plan = self.stage_plan
        return ManualStageOption(
            forward_stage_layer_ids=plan.stage_layers(),
            submesh_physical_shapes=plan.submesh_shapes,
            submesh_logical_shapes=plan.logical_shapes,
            submesh_autosharding_option_dicts=[d or {} for d in plan.autosharding_option_dicts],
        )

    def annotated(self, **changes) -> PipeshardPlan:
        """This plan with fields that do not change what it costs replaced
        (``schedule_candidates``, ``row_split``), its :attr:`cost` kept when already
        solved (``dataclasses.replace`` would drop it and solve its layer ILPs again)."""
        unknown = set(changes) - {"schedule_candidates", "row_split"}
        if unknown:
            raise ValueError(f"annotated changes only what a plan's cost ignores, not {unknown}")
        result = dataclasses.replace(self, **changes)
        if "cost" in self.__dict__:
            result.__dict__["cost"] = self.__dict__["cost"]
        return result

    @functools.cached_property
    def cost(self) -> StagePlanCost:
        """These stages priced by the analytic stage cost model
        (``stage_cost.predict_stage_plan``): the same model the stage DP minimises, for
        manual and uniform stages too, so that a hand plan and an automatic one compare
        on equal terms. Solves the layer ILPs of the stages' configurations. Its memory
        counts each stage's state as this plan shards it (:meth:`_with_planned_state`);
        ``executable.get_step_memory_per_mesh()`` is XLA's figure for the same."""
        plan = self.stage_plan
        stages = [
            (layers, plan.submesh_shapes[s], self.logical_meshes[s].shape, self.options[s])
            for s, layers in enumerate(plan.stage_layers())
        ]
        budget = self.memory_budget()
        cost = self._with_planned_state(self.price_stages(stages), budget)
        cost = self._under_schedule(cost, budget)
        bounded = self.step_bound(cost.latencies)(cost.step_seconds)
        return dataclasses.replace(cost, step_seconds=bounded)

    def step_bound(self, latencies: Sequence[float]) -> StepBound:
        """The host's and the driver's floor under this plan's step time where its
        cluster has a profile (``stage_work.StepBound``), for its stages at
        ``latencies``."""
        plan = self.stage_plan
        busy = len({d for start, stop in plan.device_ranges for d in range(start, stop)})
        return step_bound(
            self.cluster,
            latencies,
            plan.submesh_shapes,
            self.num_micro_batches,
            busy,
            self.schedule,
        )

    def price_stages(self, stages: Sequence[tuple]) -> StagePlanCost:
        """Other stages of this step priced as :attr:`cost` prices this plan's (one stage
        per mesh under 1F1B; their state at the model's sharding): per stage its layers,
        physical submesh shape, logical shape and ``AutoShardingOption``."""
        default = AutoShardingOption()
        priced = []
        for layers, shape, logical, option in stages:
            items = tuple(
                (f.name, _hashable(getattr(option, f.name)))
                for f in dataclasses.fields(option)
                if getattr(option, f.name) != getattr(default, f.name)
            )
            config = LogicalConfig(tuple(logical), items)
            priced.append((layers[0], layers[-1], tuple(shape), config))
        return predict_stage_plan(self.price_problem, priced)

    @functools.cached_property
    def price_problem(self):
        """The stage model's ``StageProblem`` of this step's layers (what
        :meth:`price_stages` prices with)."""
        context = StageContext(
            num_layers=self.layers.num_layers,
            cluster=self.cluster,
            traced=self.traced,
            layers=self.layers,
            names=self.names,
            num_micro_batches=self.num_micro_batches,
            remat=bool(self.layer_option is not None and self.layer_option.remat_layer),
        )
        return layer_problem(context, (), (), AutoShardingOption(), self.memory_budget())

    def _under_schedule(self, cost: StagePlanCost, budget: float) -> StagePlanCost:
        """``cost`` (priced with 1F1B's micro-batches in flight) under this plan's
        schedule: each stage's memory is its mesh's, its state and the activations the
        schedule holds at its peak (``schedule_choice.held_memory``; all the mesh's stages
        at once where stages share meshes: interleaved 1F1B, DualPipeV). Where stages share
        meshes the step's time is the schedule's timeline at the stages' latencies too
        (the stage DP's formula prices one stage per mesh)."""
        schedule = self.schedule
        if schedule.name in ("1f1b", "inference"):
            return cost
        base = without_activations(cost.memory, cost.activation_memory, self.num_micro_batches)
        memory = held_memory(schedule, base, cost.activation_memory)
        seconds = makespan(schedule, cost.latencies) if schedule.stage_meshes else None
        return dataclasses.replace(
            cost,
            step_seconds=cost.step_seconds if seconds is None else seconds,
            memory=memory,
            fits=tuple(m <= budget for m in memory),
        )

    def memory_budget(self) -> float:
        """Bytes per device the stages were planned within: the smallest
        ``memory_budget_per_device`` of the stages' options, else the cluster's memory."""
        return min(
            (o.memory_budget_per_device for o in self.options if o.memory_budget_per_device),
            default=self.cluster.device_memory,
        )

    def _with_planned_state(self, cost: StagePlanCost, budget: float) -> StagePlanCost:
        """``cost`` with each stage's state as this plan shards it: one device's share
        of the step's inputs on the stage's mesh that do not depend on the batch
        (parameters, optimizer state) and of the gradient sums the step keeps there
        (made by an ``ALLOC`` or written by the first micro-batch's backward). The stage
        search prices a layer's optimizer state at its parameters' split; apply-grad's
        ILP, which runs after the search, may split it further (over the data axis, as
        ZeRO-1 does), which only this plan's tables show."""
        if not cost.state_memory:
            return cost
        var_of = {name: v for v, name in self.names.items()}
        instructions = self.instructions
        held = {
            k
            for k in instructions.persistent
            if k[1] is None and var_of[k[0]] not in self.program.batch_dependent
        }
        # Gradient sums (batch-dependent, but held from the first micro-batch's backward to
        # apply-grad): zeros an ALLOC makes, or the first micro-batch's RUN writes them.
        for ins in instructions.instructions:
            if ins.op is Op.ALLOC:
                held.update(ins.outputs)
            elif ins.op is Op.RUN:
                sums = len(instructions.kernels[ins.computation].accumulate)
                held.update(ins.outputs[len(ins.outputs) - sums :])
        state = [0.0] * self.num_stages
        for name, _, mesh in held:
            v = var_of[name]
            logical = self.logical_meshes[mesh]
            spec = self.buffer_specs[(name, mesh)]
            state[mesh] += per_device_bytes(v.aval, spec, logical.shape, logical.axis_names)
        memory = tuple(
            m - old + new for m, old, new in zip(cost.memory, cost.state_memory, state, strict=True)
        )
        return dataclasses.replace(
            cost,
            memory=memory,
            fits=tuple(m <= budget for m in memory),
            state_memory=tuple(state),
        )

    @property
    def predicted_cost(self) -> float:
        """Seconds per step the analytic model predicts: with ``pipeline_schedule="auto"``,
        the chosen candidate's (its timeline, ``schedule_candidates``); else the stage DP's
        value for automatic stages, :attr:`cost` for the others."""
        if self.schedule_candidates:
            return choose(self.schedule_candidates).seconds
        if self.stage_plan.predicted_cost is not None:
            return self.stage_plan.predicted_cost
        return self.cost.step_seconds

    def draw(self, path: str, dpi: int = 100):
        """Write a picture of this plan to ``path`` (``.png`` or ``.svg``; needs
        matplotlib): the cluster's devices coloured by stage, and the schedule as a
        timeline at the predicted latencies, bubbles visible (``plan_view``). Returns a
        ``plan_view.Drawing`` (the size and the blocks drawn)."""
        latencies = self.stage_plan.latencies or self.cost.latencies
        title = (
            f"{self.traced.name} on {self.num_hosts}x{self.num_devices_per_host} "
            f"{self.cluster.name}: predicted {self.predicted_cost:.4g} s/step"
        )
        if self.schedule_candidates:
            title += f"; {self.schedule.name} chosen by pipeline_schedule='auto'"
        return plan_view.draw(
            path,
            self.schedule,
            latencies,
            self.stage_plan.device_ranges,
            self.num_hosts,
            self.num_devices_per_host,
            title=title,
            logical_shapes=[tuple(m.shape) for m in self.logical_meshes],
            dpi=dpi,
        )

    def spec_of(self, var, mesh: int) -> Any:
        """The one ``PartitionSpec`` of ``var`` on mesh ``mesh`` (``value_specs``, else,
        for a value inside a stage computation, the stage record's). A value the plan
        does not place on ``mesh`` is an error."""
        spec = self.value_specs.get((var, mesh))
        if spec is None:
            spec = self.stage_pins[mesh].var_specs.get(var)
        if spec is None:
            raise KeyError(f"the plan places no value {self.names.get(var, var)} on mesh {mesh}")
        return spec

    def stage_input_specs(self) -> list[list[Any]]:
        """Per stage, the ``PartitionSpec`` of each of its inputs (``stage_inputs``
        order): what ``PipeshardParallel(stage_input_shardings=...)`` takes, to compile
        the step again (another batch size) with its stages reading their inputs alike
        (Alpa's ``executable.stage_input_shard_specs``)."""
        return [
            [self.spec_of(v, s) for v in stage_inputs(self.program, s)]
            for s in range(len(self.logical_meshes))
        ]

    def summary(self) -> dict:
        """The plan's decisions as JSON-able data (what ``to_json`` writes)."""
        plan = self.stage_plan
        stages = []
        for s in range(plan.num_stages):
            stages.append(
                {
                    "layers": plan.stage_layers()[s],
                    "submesh": list(plan.submesh_shapes[s]),
                    "devices": list(plan.device_ranges[s]),
                    "logical_shape": list(self.logical_meshes[s].shape),
                    "autosharding_option": plan.autosharding_option_dicts[s] or {},
                    "latency": None if plan.latencies is None else plan.latencies[s],
                    "memory": None if plan.memory is None else plan.memory[s],
                }
            )
        # The values of the stage computations (those inside their bodies have no name).
        specs = sorted(
            (self.names[v], s, str(spec))
            for s, pins in enumerate(self.stage_pins)
            for v, spec in pins.var_specs.items()
            if v in self.names
        )
        deferred = self.program.deferred
        # Gradients of data-parallel stages accumulated per device and reduced once per
        # step, in apply-grad (deferred_sums).
        once = sorted(self.names[v] for v in deferred.partials) if deferred is not None else []
        return {
            FORMAT_KEY: SUMMARY_FORMAT,
            "name": self.traced.name,
            "cluster": {
                "name": self.cluster.name,
                "num_hosts": self.num_hosts,
                "num_devices_per_host": self.num_devices_per_host,
            },
            "num_layers": self.layers.num_layers,
            "num_micro_batches": self.num_micro_batches,
            "schedule": self.schedule.name,
            "schedule_candidates": [
                {
                    "name": c.name,
                    "seconds": c.seconds if c.applicable else None,
                    "memory": list(c.memory),
                    "fits": c.fits,
                    "note": c.note,
                }
                for c in self.schedule_candidates
            ],
            "predicted_cost": plan.predicted_cost,  # automatic stages; cost: any plan
            "stages": stages,
            "ticks": [[str(task) for task in tick] for tick in self.schedule.ticks],
            "instructions": [str(ins) for ins in self.instructions.instructions],
            "buffers": sorted(
                [name, mesh, str(spec)] for (name, mesh), spec in self.buffer_specs.items()
            ),
            "reshards": [
                _reshard_summary(i, self.instructions.instructions[i], plan)
                for i, plan in sorted(self.reshards.items())
            ],
            "shardings": [list(x) for x in specs],
            "gradients_reduced_once_per_step": once,
        }

    def to_json(self) -> str:
        return json.dumps(self.summary(), indent=1)

    @staticmethod
    def from_json(text: str, source: str = "the text") -> dict:
        """The summary a ``to_json`` wrote, of format :data:`SUMMARY_FORMAT` or older (one
        without the field, written before it existed, reads as format 1). ``source`` names
        where ``text`` came from in the errors; a summary of a newer format raises
        ``NewerFormatError``."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(
                f"{source} is not a PipeshardPlan summary: it holds a {type(data).__name__}"
            )
        read_format(data, SUMMARY_FORMAT, "PipeshardPlan summary", source)
        return data

    def format_table(self) -> str:
        summary = self.summary()
        header = ("stage", "layers", "submesh", "devices", "logical", "latency", "memory")
        rows = [header]
        for s, stage in enumerate(summary["stages"]):
            layers = stage["layers"]
            span = f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
            latency = "-" if stage["latency"] is None else f"{stage['latency'] * 1e3:.3f} ms"
            memory = "-" if stage["memory"] is None else f"{stage['memory'] / 2**20:.1f} MiB"
            rows.append(
                (
                    str(s),
                    span,
                    "x".join(map(str, stage["submesh"])),
                    f"{stage['devices'][0]}..{stage['devices'][1] - 1}",
                    "x".join(map(str, stage["logical_shape"])),
                    latency,
                    memory,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        cluster = summary["cluster"]
        title = (
            f"pipeshard plan of {summary['name']}: {summary['num_layers']} layers, "
            f"{self.num_stages} stage{'s' if self.num_stages != 1 else ''} on "
            f"{cluster['num_hosts']}x"
            f"{cluster['num_devices_per_host']} {cluster['name']}, "
            f"{summary['num_micro_batches']} micro-batches, {summary['schedule']}"
        )
        # With pipeline_schedule="auto", the chosen schedule's seconds (the stage DP's
        # value is under the schedule it searched with, not the one chosen).
        predicted = self.predicted_cost if self.schedule_candidates else summary["predicted_cost"]
        if predicted is not None:
            title += f", predicted {predicted * 1e3:.3f} ms/step"
        cost = self.cost
        if not all(cost.fits):
            over = [s for s, fits in enumerate(cost.fits) if not fits]
            title += (
                f"; DOES NOT FIT memory_budget_per_device={self.memory_budget() / 2**20:.1f} "
                f"MiB: stage{'s' if len(over) > 1 else ''} {', '.join(map(str, over))} need "
                + ", ".join(f"{cost.memory[s] / 2**20:.1f}" for s in over)
                + " MiB"
            )
        lines = [title]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        if self.schedule_candidates:
            lines.append(
                f"pipeline_schedule='auto' chose {self.schedule.name}, the fastest that fits "
                "(each schedule at its stages' predicted latencies; those that place two "
                "stages per mesh on stages of their own):"
            )
            lines += [f"  {c.line()}" for c in self.schedule_candidates]
        if self.reshards:
            lines.append(
                f"{len(self.reshards)} RESHARDs per step move "
                f"{self.resharded_bytes() / 2**20:.3f} MiB between meshes (tile plans in "
                "plan.reshards)"
            )
        return "\n".join(lines) + "\n" + self.schedule.grid()

    def __str__(self) -> str:
        return self.format_table()

    def __repr__(self) -> str:
        return f"<PipeshardPlan of {self.traced.name}: {self.num_stages} stages>\n{self}"


def _hashable(value):
    if isinstance(value, list | tuple):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def _reshard_summary(index: int, ins, plan: TransferPlan) -> dict:
    (src,), (dst,) = ins.inputs, ins.outputs
    return {
        "instruction": index,
        "value": src[0],
        "micro_batch": src[1],
        "meshes": [src[2], dst[2]],
        "shape": list(plan.shape),
        "dtype": plan.dtype,
        "bytes": plan.nbytes(),
        # source device (flat id), destination host, box, destination devices
        "pieces": [
            [p.src_device, p.dst_host, [list(b) for b in p.box], list(p.dst_devices)]
            for p in plan.pieces
        ],
    }


def layout_of(logical_meshes: Sequence[LogicalDeviceMesh], specs: dict, key) -> Layout:
    """Buffer ``key`` on its mesh's logical shape, with its spec in ``specs``."""
    mesh = key[2]
    return Layout(tuple(logical_meshes[mesh].shape), DATA_AXES, specs[(key[0], mesh)])
