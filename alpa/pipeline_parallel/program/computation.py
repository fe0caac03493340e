"""Computation split: a traced training step becomes per-stage computations.

Input: the flat jaxpr of one step (traced at micro-batch size), the layer of every forward
equation (from the boundary markers, see ``layer_construction``) and the stage of every
layer. Output: a :class:`PipelineProgram`: for every stage a forward, a backward and one or
more apply-grad computations, each a list of equations with the values it reads and
writes, plus where every value lives.

The step's equations fall in three parts:

* **forward**: the equations of layer ``l`` run in the forward computation of its stage;
* **backward**: JAX emits the backward pass after the whole forward pass. ``alpa.grad``
  wraps every layer in ``start`` / ``end`` markers that JAX's transpose mirrors into the
  backward pass (``layer_construction``), so the equations between the mirrored markers of
  layer ``l`` form the backward of its stage. Backward equations outside every pair (the
  cotangent seed, a sum of the cotangents of a value several layers read), and all of
  them in a step cut by operand-less boundaries alone, are placed by their data: no
  later than the backward computations that read them, i.e. on a stage no higher than
  the stages of the backward values they read; among those, on the highest stage on
  which their forward operands already are. Without layer markers, equations of the last
  layer that depend only on forward values form the forward computation of the last
  stage; the cotangent seed (built from constants) starts the backward.
* **apply-grad** (after the ``alpa.grad`` marker): each equation runs on the stage that
  holds most of its operands' bytes, so a stage's gradients and optimizer state never
  leave its mesh; small values such as a global gradient norm move between meshes.
  Because such values create dependencies between stages, apply equations are grouped in
  levels: level ``n + 1`` may read what any stage computed at level ``<= n``.

Equations whose operands are all constants (``iota``, ``broadcast 0.0``, the cotangent
seed) are not placed: every computation that needs their value recomputes it, rather than
receiving it from another mesh.

A layer's ``start`` marker passes its parameters along with its activations; the split
reads a parameter itself wherever its marker copy is read
(:func:`read_step_inputs_through_markers`), so a backward that reads a weight reads the
stage's one copy instead of a copy per micro-batch handed on by the forward.

The values the ``alpa.grad`` marker receives are summed over micro-batches (gradient
accumulation) and divided by the number of micro-batches, so the apply part sees the mean,
as the serial step over the full batch does for a mean loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from jax.extend.core import ClosedJaxpr, JaxprEqn, Var

from alpa.tracing.jaxpr_util import backward_slice, grad_marker_index, is_var, nbytes
from alpa.tracing.primitive_def import passes_through, pipeline_p

if TYPE_CHECKING:
    from alpa.pipeline_parallel.program.deferred_sums import DeferredSums

ComputationKind = Literal["forward", "backward", "weight", "apply"]


@dataclass(frozen=True, eq=False)
class StageComputation:
    """The equations one stage runs for one kind of task.

    ``invars`` are the values read from outside (other computations, step inputs);
    ``outvars`` the values other computations, the accumulation or the outputs read.
    Apply computations of one stage are ordered by ``level``.
    """

    stage: int
    kind: ComputationKind
    level: int
    eqns: tuple[JaxprEqn, ...]
    invars: tuple[Var, ...]
    outvars: tuple[Var, ...]

    @property
    def name(self) -> str:
        suffix = f"_{self.level}" if self.kind == "apply" else ""
        return f"stage{self.stage}_{self.kind}{suffix}"


@dataclass(frozen=True, eq=False)
class PipelineProgram:
    """A step split into stage computations, and where each value lives.

    Attributes:
      closed_jaxpr: the traced step.
      num_stages: number of stages (meshes).
      computations: every computation.
      home: for every produced value, the stage whose mesh computes it; for every step
        input, the stages that read it (its placement).
      per_micro_batch: values that exist once per micro-batch (everything the forward and
        backward computations produce).
      batch_dependent: values that depend on a batch argument.
      accumulated: marker output -> the per-micro-batch value it accumulates.
      aliases: marker output -> step input or literal it equals (nothing to accumulate).
      is_training: whether the step has an ``alpa.grad`` marker.
      row_ids: the last step input when random draws take their rows of the full batch's
        draw (``program_rewrites.draw_rows_of_full_batch``): ``int32[micro-batch]``, the
        full-batch row of each micro-batch row; the runtime feeds ``arange(batch)``
        (``program_rewrites.step_arguments``).
      deferred: the gradients of data-parallel stages carried as per-device partial sums
        and reduced once per step (``deferred_sums.DeferredSums``), or ``None``.
    """

    closed_jaxpr: ClosedJaxpr
    num_stages: int
    computations: tuple[StageComputation, ...]
    home: dict[Var, int]
    input_stages: dict[Var, tuple[int, ...]]
    per_micro_batch: frozenset[Var]
    batch_dependent: frozenset[Var]
    accumulated: dict[Var, Var]
    aliases: dict[Var, Any]
    is_training: bool
    const_eqns: dict[Var, JaxprEqn] = field(default_factory=dict)
    row_ids: Var | None = None
    deferred: DeferredSums | None = None

    def computation(self, stage: int, kind: str, level: int = 0) -> StageComputation | None:
        for comp in self.computations:
            if (comp.stage, comp.kind, comp.level) == (stage, kind, level):
                return comp
        return None

    def apply_levels(self) -> int:
        return 1 + max((c.level for c in self.computations if c.kind == "apply"), default=-1)


def split_computations(
    closed_jaxpr: ClosedJaxpr,
    eqn_layers: Sequence[int | None],
    layer_to_stage: Sequence[int],
    batch_invars: Sequence[bool],
    eqn_kinds: Sequence[str | None] | None = None,
) -> PipelineProgram:
    """Split a step into stage computations (see the module docstring).

    ``eqn_layers[i]`` is the layer of equation ``i`` and ``eqn_kinds[i]`` whether it is
    part of that layer's forward or backward (``layer_construction.manual_layers``).
    Without ``eqn_kinds`` (a step cut by boundaries alone), ``eqn_layers`` covers the
    forward pass and backward equations are placed by their data.
    """
    global_invars = list(closed_jaxpr.jaxpr.invars)
    batch_set = {v for v, b in zip(global_invars, batch_invars, strict=True) if b}
    grad_index = grad_marker_index(closed_jaxpr.jaxpr.eqns)
    is_training = grad_index is not None
    compute_end = grad_index if is_training else len(closed_jaxpr.jaxpr.eqns)
    closed_jaxpr = read_step_inputs_through_markers(
        closed_jaxpr, compute_end, set(global_invars) - batch_set
    )
    jaxpr = closed_jaxpr.jaxpr
    eqns = list(jaxpr.eqns)
    num_stages = max(layer_to_stage) + 1
    const_eqns = _constant_equations(jaxpr)

    where = _Placement(jaxpr, const_eqns, num_stages)
    where.place_compute(eqns[:compute_end], eqn_layers, layer_to_stage, eqn_kinds, is_training)
    accumulated: dict[Var, Var] = {}
    aliases: dict[Var, Any] = {}
    apply_level: dict[JaxprEqn, int] = {}
    if is_training:
        accumulated, aliases = where.grad_marker_values(eqns[grad_index])
        apply_level = where.place_apply(eqns, compute_end, accumulated)

    groups = _groups(eqns, where, apply_level, num_stages, is_training)
    computations = _computations(jaxpr, eqns, groups, const_eqns, accumulated)
    per_micro_batch = frozenset(v for e in eqns[:compute_end] for v in e.outvars if is_var(v))
    readers_of_input: dict[Var, set[int]] = {v: set() for v in global_invars}
    for comp in computations:
        for v in comp.invars:
            if v in readers_of_input:
                readers_of_input[v].add(comp.stage)
    input_stages = {
        v: tuple(sorted(readers_of_input[v] or where.avail.get(v) or {0})) for v in global_invars
    }
    return PipelineProgram(
        closed_jaxpr=closed_jaxpr,
        num_stages=num_stages,
        computations=tuple(computations),
        home=where.home,
        input_stages=input_stages,
        per_micro_batch=per_micro_batch,
        batch_dependent=frozenset(_batch_dependent(eqns, batch_set)),
        accumulated=accumulated,
        aliases=aliases,
        is_training=is_training,
        const_eqns=const_eqns,
    )


def read_step_inputs_through_markers(
    closed_jaxpr: ClosedJaxpr, compute_end: int, step_inputs: set[Var]
) -> ClosedJaxpr:
    """``closed_jaxpr`` with every read of a marker's copy of a step input (a layer's
    ``start`` marker passes its parameters along with its activations) made a read of the
    input itself, and that pair dropped from the marker; markers after ``compute_end``
    (the ``alpa.grad`` marker and apply-grad) are kept as they are.

    A marker is the identity, so the values are equal; the difference is where they
    live. A parameter's marker copy is made in the forward computation, and when the
    backward reads it too (the weight of a matmul, to compute the cotangent of its
    input), the forward would output a copy of the parameter per micro-batch and keep it
    until that micro-batch's backward: up to as many copies of the stage's weights as
    micro-batches in flight. Read from the input, the backward uses the stage's one copy.
    Equation positions are unchanged (a marker left without pairs stays, operand-less).
    """
    jaxpr = closed_jaxpr.jaxpr
    alias: dict[Var, Var] = {}
    for eqn in jaxpr.eqns[:compute_end]:
        if passes_through(eqn):
            for i, o in zip(eqn.invars, eqn.outvars, strict=True):
                if is_var(i) and is_var(o) and (i in step_inputs or i in alias):
                    alias[o] = alias.get(i, i)
    if not alias:
        return closed_jaxpr

    def read(v):
        return alias.get(v, v) if is_var(v) else v

    eqns = []
    for eqn in jaxpr.eqns:
        if passes_through(eqn) and any(is_var(o) and o in alias for o in eqn.outvars):
            kept = [(i, o) for i, o in zip(eqn.invars, eqn.outvars, strict=True) if o not in alias]
            eqn = eqn.replace(invars=[read(i) for i, _ in kept], outvars=[o for _, o in kept])
        elif any(is_var(v) and v in alias for v in eqn.invars):
            eqn = eqn.replace(invars=[read(v) for v in eqn.invars])
        eqns.append(eqn)
    outvars = [read(v) for v in jaxpr.outvars]
    return ClosedJaxpr(jaxpr.replace(eqns=eqns, outvars=outvars), closed_jaxpr.consts)


def _constant_equations(jaxpr) -> dict[Var, JaxprEqn]:
    """Per value computed from constants alone, its equation: recomputed wherever needed."""
    const_eqns: dict[Var, JaxprEqn] = {}
    consts = set(jaxpr.constvars)
    for eqn in jaxpr.eqns:
        if eqn.primitive is pipeline_p or eqn.effects:
            continue
        if all(not is_var(v) or v in consts or v in const_eqns for v in eqn.invars):
            for v in eqn.outvars:
                if is_var(v):
                    const_eqns[v] = eqn
    return const_eqns


def _makes_only_constants(eqn, const_eqns) -> bool:
    return all(v in const_eqns for v in eqn.outvars if is_var(v)) and any(
        is_var(v) for v in eqn.outvars
    )


class _Placement:
    """The stage and kind of every equation, the stage that computes (``home``) and the
    stages that hold (``avail``) every value, filled pass by pass."""

    def __init__(self, jaxpr, const_eqns: dict, num_stages: int):
        self.consts = set(jaxpr.constvars)
        self.const_eqns = const_eqns
        self.num_stages = num_stages
        self.invars = list(jaxpr.invars)
        self.stage_of: dict[JaxprEqn, int] = {}
        self.kind_of: dict[JaxprEqn, str] = {}
        self.home: dict[Var, int] = {}
        self.avail: dict[Var, set[int]] = {v: set() for v in self.invars}
        self.forward_vars: set[Var] = set(self.invars)

    def is_const(self, v) -> bool:
        return not is_var(v) or v in self.consts or v in self.const_eqns

    def place_compute(self, eqns, eqn_layers, layer_to_stage, eqn_kinds, is_training) -> None:
        """The forward and backward equations (those before the ``alpa.grad`` marker)."""
        S_last = self.num_stages - 1
        home, avail, forward_vars = self.home, self.avail, self.forward_vars
        last_layer = len(layer_to_stage) - 1
        for i, eqn in enumerate(eqns):
            if eqn.primitive is pipeline_p and not eqn.outvars:
                continue
            hint = eqn_kinds[i] if eqn_kinds is not None else None
            if eqn.outvars and _makes_only_constants(eqn, self.const_eqns):
                # A constant of the forward part counts as a forward value; without layer
                # markers, one of the last layer's region may be the cotangent seed, which
                # starts the backward.
                if eqn_kinds is not None:
                    is_forward = hint == "forward"
                else:
                    is_forward = not (is_training and eqn_layers[i] in (None, last_layer))
                if is_forward:
                    forward_vars.update(v for v in eqn.outvars if is_var(v))
                continue
            layer = eqn_layers[i]
            reads = [v for v in eqn.invars if is_var(v) and not self.is_const(v)]
            in_tail = is_training and (layer is None or layer == last_layer)
            if hint is not None:
                stage, kind = layer_to_stage[layer], hint
            elif eqn_kinds is not None:
                # A backward equation outside every layer's markers.
                stage = _backward_stage(reads, forward_vars, home, avail, S_last)
                kind = "backward"
            elif not in_tail:
                stage = layer_to_stage[layer if layer is not None else last_layer]
                kind = "forward"
            elif reads and all(
                v in forward_vars for v in eqn.invars if is_var(v) and v not in self.consts
            ):
                stage, kind = S_last, "forward"
            else:
                stage = _backward_stage(reads, forward_vars, home, avail, S_last)
                kind = "backward"
            self.stage_of[eqn], self.kind_of[eqn] = stage, kind
            for v in reads:
                if v in forward_vars and kind == "forward":
                    avail.setdefault(v, set()).add(stage)
            for v in eqn.outvars:
                if is_var(v):
                    home[v] = stage
                    avail[v] = {stage}
                    if kind == "forward":
                        forward_vars.add(v)

    def grad_marker_values(self, marker) -> tuple[dict, dict]:
        """``(accumulated, aliases)`` of the ``alpa.grad`` marker: each output whose
        operand a computation makes (summed over micro-batches), and each that is a
        literal or a step input."""
        accumulated: dict[Var, Var] = {}
        aliases: dict[Var, Any] = {}
        invar_set = set(self.invars)
        for operand, out in zip(marker.invars, marker.outvars, strict=True):
            if not is_var(out):
                continue
            if is_var(operand) and operand in self.home:
                accumulated[out] = operand
                self.home[out] = self.home[operand]
            else:
                aliases[out] = operand
                if is_var(operand) and operand in invar_set:
                    self.home[out] = min(self.avail[operand], default=0)
        return accumulated, aliases

    def place_apply(self, eqns, compute_end: int, accumulated) -> dict[JaxprEqn, int]:
        """The apply-grad equations (those after the marker): their stages, and per
        equation its level (how many changes of stage its operands went through)."""
        apply_eqns = []
        produced_in_compute = {v for e in eqns[:compute_end] for v in e.outvars if is_var(v)}
        for eqn in eqns[compute_end + 1 :]:
            if eqn.primitive is pipeline_p and not eqn.outvars:
                continue
            if _makes_only_constants(eqn, self.const_eqns):
                continue
            for v in eqn.invars:
                if is_var(v) and v in produced_in_compute and v not in self.const_eqns:
                    raise ValueError(
                        "a value computed from the batch before alpa.grad is read after it "
                        "without passing through alpa.grad / alpa.value_and_grad; return it "
                        "from the loss function as auxiliary output (has_aux=True) instead"
                    )
            apply_eqns.append(eqn)
        _place_apply(
            apply_eqns,
            self.is_const,
            self.avail,
            self.home,
            accumulated,
            set(self.invars),
            self.num_stages,
            self.stage_of,
            self.kind_of,
        )
        level_of: dict[Var, int] = {}
        apply_level: dict[JaxprEqn, int] = {}
        for eqn in apply_eqns:
            stage = self.stage_of[eqn]
            level = 0
            for v in eqn.invars:
                if is_var(v) and v in level_of:
                    level = max(level, level_of[v] + (self.home[v] != stage))
            apply_level[eqn] = level
            for v in eqn.outvars:
                if is_var(v):
                    level_of[v] = level
        return apply_level


def _groups(eqns, where: _Placement, apply_level, num_stages: int, is_training: bool) -> dict:
    """``(stage, kind, level) -> equations``, in the jaxpr's order; every stage has a
    forward (and, training, a backward) group, perhaps empty."""
    groups: dict[tuple[int, str, int], list[JaxprEqn]] = {}
    for eqn in eqns:
        if eqn in where.stage_of:
            key = (where.stage_of[eqn], where.kind_of[eqn], apply_level.get(eqn, 0))
            groups.setdefault(key, []).append(eqn)
    for s in range(num_stages):
        groups.setdefault((s, "forward", 0), [])
        if is_training:
            groups.setdefault((s, "backward", 0), [])
    return groups


def _computations(jaxpr, eqns, groups, const_eqns, accumulated) -> list[StageComputation]:
    """One computation per group, with the constants it needs recomputed in it, its
    inputs (what it reads from outside) and its outputs (what others read)."""
    consts = set(jaxpr.constvars)
    # Values read outside the computation that produces them.
    outputs_needed: set[Var] = {v for v in jaxpr.outvars if is_var(v)}
    outputs_needed |= set(accumulated.values())
    readers: dict[Var, set[tuple]] = {}
    for key, group in groups.items():
        for eqn in group:
            for v in eqn.invars:
                if is_var(v):
                    readers.setdefault(v, set()).add(key)

    constant_ids = {id(e) for e in const_eqns.values()}
    constant = [e for e in eqns if id(e) in constant_ids]
    computations = []
    for key in sorted(groups, key=lambda k: (k[1] != "forward", k[1] != "backward", k[2], k[0])):
        group = groups[key]
        produced = {v for e in group for v in e.outvars if is_var(v)}
        needed_consts: list[Var] = []
        invars: dict[Var, None] = {}  # ordered set
        for eqn in group:
            for v in eqn.invars:
                if not is_var(v) or v in produced:
                    continue
                if v in const_eqns:
                    needed_consts.append(v)
                elif v not in consts:
                    invars[v] = None
        # The equations that make the needed constants, in the jaxpr's order.
        const_part = backward_slice(constant, needed_consts)
        outvars = [
            v
            for e in group
            for v in e.outvars
            if is_var(v) and (v in outputs_needed or readers.get(v, set()) - {key})
        ]
        computations.append(
            StageComputation(
                stage=key[0],
                kind=key[1],
                level=key[2],
                eqns=tuple(const_part + group),
                invars=tuple(invars),
                outvars=tuple(outvars),
            )
        )
    return computations


def _place_apply(
    apply_eqns, is_const, avail, home, accumulated, invar_set, num_stages, stage_of, kind_of
) -> None:
    """Stages of apply-grad equations: where most of their operand bytes are.

    Equations none of whose operands has a place yet (``b1 * mu`` of an optimizer state
    read for the first time) are placed afterwards, in reverse order, where most of the
    bytes of their results are read.
    """
    where: dict[Var, set[int]] = {v: set(s) for v, s in avail.items() if v in invar_set}
    for out in accumulated:
        where[out] = {home[out]}
    deferred = []
    for eqn in apply_eqns:
        score = np.zeros(num_stages)
        for v in eqn.invars:
            if is_var(v) and not is_const(v):
                for s in where.get(v, ()):
                    score[s] += nbytes(v)
        if not score.any():
            deferred.append(eqn)
            continue
        _set_apply_stage(
            eqn, int(np.argmax(score)), where, avail, home, invar_set, stage_of, kind_of
        )
    consumers: dict[Var, list] = {}
    for eqn in apply_eqns:
        for v in eqn.invars:
            if is_var(v):
                consumers.setdefault(v, []).append(eqn)
    for eqn in reversed(deferred):
        score = np.zeros(num_stages)
        for v in eqn.outvars:
            for c in consumers.get(v, ()) if is_var(v) else ():
                if c in stage_of:
                    score[stage_of[c]] += nbytes(v)
        _set_apply_stage(
            eqn, int(np.argmax(score)), where, avail, home, invar_set, stage_of, kind_of
        )


def _set_apply_stage(eqn, stage, where, avail, home, invar_set, stage_of, kind_of) -> None:
    stage_of[eqn], kind_of[eqn] = stage, "apply"
    for v in eqn.invars:
        if is_var(v) and v in invar_set:
            where.setdefault(v, set()).add(stage)
            avail.setdefault(v, set()).add(stage)
    for v in eqn.outvars:
        if is_var(v):
            home[v] = stage
            where[v] = {stage}


def _backward_stage(reads, forward_vars, home, avail, last_stage) -> int:
    """The stage of a backward equation: see the module docstring."""
    upper = min((home[v] for v in reads if v not in forward_vars), default=last_stage)
    stage = upper
    for v in reads:
        if v in forward_vars:
            below = [s for s in avail.get(v, ()) if s <= upper]
            stage = min(stage, max(below) if below else upper)
    return stage


def _batch_dependent(eqns, batch_set) -> set:
    """The values computed from ``batch_set``. A pipeline marker is the identity of each
    operand on its own: the parameters a layer's start marker passes along with the
    activation do not become batch values."""
    dependent = set(batch_set)
    for eqn in eqns:
        if passes_through(eqn):
            dependent.update(
                o
                for i, o in zip(eqn.invars, eqn.outvars, strict=True)
                if is_var(i) and i in dependent and is_var(o)
            )
        elif any(is_var(v) and v in dependent for v in eqn.invars):
            dependent.update(v for v in eqn.outvars if is_var(v))
    return dependent
