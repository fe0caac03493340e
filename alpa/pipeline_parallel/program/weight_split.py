"""The backward of a stage split in two: input cotangents (``B``) and weight gradients (``W``).

Zero-bubble schedules (ZB-H1, ``schedules.zb_h1_schedule``) rest on one observation: of
a stage's backward, only the cotangents of the stage's inputs are waited for (by the
previous stage's backward); the gradients of its parameters are read by nobody until
apply-grad. So the backward can run in two computations, and the second one, ``W``, can
be moved into the ticks in which the stage would otherwise wait.

:func:`split_weight_gradients` makes the split from the stage's own backward equations,
with nothing recomputed:

* ``B`` is the backward slice (``tracing.jaxpr_util.backward_slice``) of what other
  computations read from the backward: the cotangents sent to the previous stage, and
  anything else read outside (a value apply-grad reads directly);
  A layer marker counts operand by operand (it is the identity of each), so the marker
  that ends a layer's backward sends the cotangent with ``B`` and the gradients with ``W``;
* ``W`` is every other equation of the backward: the parameter gradients the stage
  accumulates for ``alpa.grad``, computed from the forward's activations and from the
  cotangents ``B`` computes on the way (a dense layer's ``dW = x^T dy`` reads ``dy``,
  which ``B`` needs for ``dx = dy W^T``). ``B`` outputs those cotangents for ``W``, one
  buffer per micro-batch in flight, and ``W`` recomputes the constants it needs rather
  than receiving them.

A stage whose backward sends nothing back (the first stage: its inputs are the batch) or
whose equations all feed the cotangents keeps its backward whole; the schedule's ``W``
task of that stage then runs nothing. Numerics are those of the unsplit backward: the
same equations, partitioned.
"""

from __future__ import annotations

import dataclasses

from alpa.pipeline_parallel.program.computation import PipelineProgram, StageComputation
from alpa.tracing.jaxpr_util import backward_slice, is_var
from alpa.tracing.primitive_def import passes_through


def split_weight_gradients(program: PipelineProgram) -> PipelineProgram:
    """``program`` with each stage's backward split into a ``backward`` computation (``B``)
    and a ``weight`` computation (``W``) (module docstring)."""
    jaxpr = program.closed_jaxpr.jaxpr
    step_outputs = {v for v in jaxpr.outvars if is_var(v)}
    constvars = set(jaxpr.constvars)
    computations: list[StageComputation] = []
    for comp in program.computations:
        if comp.kind != "backward" or not comp.eqns:
            computations.append(comp)
            continue
        read_elsewhere = {v for c in program.computations if c is not comp for v in c.invars}
        split = _split(comp, read_elsewhere | step_outputs, program.const_eqns, constvars)
        computations.extend(split)
    return dataclasses.replace(program, computations=tuple(computations))


def _split(comp: StageComputation, read_outside: set, const_eqns: dict, constvars: set) -> list:
    """``[B, W]`` of the backward ``comp``, or ``[comp]`` when one of them would be empty."""
    constant = [e for e in comp.eqns if any(v in const_eqns for v in e.outvars)]
    work = [
        one
        for e in comp.eqns
        if not any(v in const_eqns for v in e.outvars)
        for one in _pair_by_pair(e)
    ]
    needed = [v for v in comp.outvars if v in read_outside]
    b_eqns = backward_slice(work, needed)
    in_b = {id(e) for e in b_eqns}
    w_eqns = [e for e in work if id(e) not in in_b]
    if not b_eqns or not w_eqns:
        return [comp]
    b_made = {v for e in b_eqns for v in e.outvars if is_var(v)}
    w_made = {v for e in w_eqns for v in e.outvars if is_var(v)}
    # Each half recomputes the constants it reads (a mask, an iota).
    b_eqns = backward_slice(constant, _reads(b_eqns, b_made)) + b_eqns
    w_eqns = backward_slice(constant, _reads(w_eqns, w_made)) + w_eqns
    handed = [v for v in _reads(w_eqns, w_made) if v in b_made]  # cotangents W reads
    b_outvars = [v for v in comp.outvars if v in b_made]
    b_outvars += [v for v in handed if v not in b_outvars]
    backward = dataclasses.replace(
        comp, eqns=tuple(b_eqns), invars=_invars(b_eqns, constvars), outvars=tuple(b_outvars)
    )
    weight = dataclasses.replace(
        comp,
        kind="weight",
        eqns=tuple(w_eqns),
        invars=_invars(w_eqns, constvars),
        outvars=tuple(v for v in comp.outvars if v in w_made),
    )
    return [backward, weight]


def _invars(eqns, constvars: set) -> tuple:
    """What ``eqns`` read from outside: the values they read and do not compute, less the
    step's constants (every computation reads those directly)."""
    made = {v for e in eqns for v in e.outvars if is_var(v)}
    return tuple(v for v in _reads(eqns, made) if v not in constvars)


def _pair_by_pair(eqn) -> list:
    """A layer marker as one marker per operand (the same identities): the marker that
    ends a layer's backward carries the input's cotangent and the weights' gradients
    together, and only the first belongs to ``B``."""
    if not passes_through(eqn) or len(eqn.invars) < 2:
        return [eqn]
    return [
        eqn.replace(invars=[i], outvars=[o]) for i, o in zip(eqn.invars, eqn.outvars, strict=True)
    ]


def _reads(eqns, made: set) -> list:
    """The values ``eqns`` read that they do not compute, in order of first reading."""
    return list(dict.fromkeys(v for e in eqns for v in e.invars if is_var(v) and v not in made))
