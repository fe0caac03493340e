"""Rewrites of a split step (:class:`~alpa.pipeline_parallel.program.computation.PipelineProgram`)
that the pass chain applies after the split:

* :func:`rematerialize`: each stage's backward recomputes the forward values of its stage
  it reads (``ManualLayerOption(remat_layer=True)``);
* :func:`draw_rows_of_full_batch`: a random draw whose shape follows the batch makes, in
  micro-batch ``j``, micro-batch ``j``'s rows of the full batch's draw, as the serial step
  does; the rows come from a new step input, which :func:`step_arguments` supplies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend.core import ClosedJaxpr, Var

from alpa.pipeline_parallel.program.computation import PipelineProgram
from alpa.tracing import new_jaxpr
from alpa.tracing.batch_draws import new_row_ids, reads_draws, row_id_rewriter
from alpa.tracing.jaxpr_util import backward_slice, is_var


def rematerialize(program: PipelineProgram) -> PipelineProgram:
    """Layer rematerialization (``ManualLayerOption(remat_layer=True)``).

    The backward computation of every stage recomputes the forward values of its own stage
    it reads, from the forward computation's inputs, instead of receiving them: the
    forward keeps as outputs only what other stages, the accumulation or the step's
    outputs read, so the activations of a micro-batch do not stay alive between its
    forward and its backward (the memory/compute trade of ``jax.checkpoint``).
    """
    jaxpr = program.closed_jaxpr.jaxpr
    comps = list(program.computations)
    kept_outside: set[Var] = {v for v in jaxpr.outvars if is_var(v)}
    kept_outside |= set(program.accumulated.values())
    new_comps = {}
    for s in range(program.num_stages):
        fwd, bwd = program.computation(s, "forward"), program.computation(s, "backward")
        if fwd is None or bwd is None or not fwd.eqns or not bwd.eqns:
            continue
        producer = {v: e for e in fwd.eqns for v in e.outvars if is_var(v)}
        residuals = [v for v in bwd.invars if v in producer]
        if not residuals or any(producer[v].effects for v in residuals):
            continue
        recompute = backward_slice(fwd.eqns, residuals)
        if any(e.effects for e in recompute):
            continue
        produced = {v for e in recompute for v in e.outvars if is_var(v)}
        invars = [v for v in bwd.invars if v not in producer]
        for eqn in recompute:
            for v in eqn.invars:
                if is_var(v) and v not in produced and v in fwd.invars and v not in invars:
                    invars.append(v)
        others = {v for c in comps if c is not fwd and c is not bwd for v in c.invars}
        new_comps[fwd] = dataclasses.replace(
            fwd, outvars=tuple(v for v in fwd.outvars if v in others or v in kept_outside)
        )
        # The recomputed forward first; an equation the split also copied into the
        # backward (a cheap one both read, such as an attention mask) moves to the front
        # with it, since a recomputed equation may read its output.
        again = {id(e) for e in recompute}
        bwd_eqns = list(recompute) + [e for e in bwd.eqns if id(e) not in again]
        new_comps[bwd] = dataclasses.replace(bwd, eqns=tuple(bwd_eqns), invars=tuple(invars))
    return dataclasses.replace(program, computations=tuple(new_comps.get(c, c) for c in comps))


def draw_rows_of_full_batch(
    program: PipelineProgram, draws: dict, batch_size: int
) -> PipelineProgram:
    """``program`` in which every random draw in ``draws`` (``tracing.batch_draws``: draws
    whose shape follows the batch) makes micro-batch ``j``'s rows of the draw the full batch
    of ``batch_size`` rows makes, as the serial step does, instead of the same micro-batch
    draw for every ``j``.

    The rows come from a new last step input, :attr:`PipelineProgram.row_ids`, a batch
    input like the others: ``LOAD`` splits ``arange(batch_size)`` into micro-batches on each
    mesh that reads it. The computations that draw read it; nothing else changes.
    """
    if not draws:
        return program

    jaxpr = program.closed_jaxpr.jaxpr
    row_ids = new_row_ids(jaxpr.eqns, draws)
    rewrite = row_id_rewriter(draws, batch_size, row_ids)
    computations, readers = [], set()
    for comp in program.computations:
        if reads_draws(comp.eqns, draws):
            comp = dataclasses.replace(
                comp, eqns=tuple(rewrite(comp.eqns)), invars=(*comp.invars, row_ids)
            )
            readers.add(comp.stage)
        computations.append(comp)
    closed = ClosedJaxpr(
        new_jaxpr(
            jaxpr, jaxpr.constvars, [*jaxpr.invars, row_ids], jaxpr.outvars, rewrite(jaxpr.eqns)
        ),
        program.closed_jaxpr.consts,
    )
    return dataclasses.replace(
        program,
        closed_jaxpr=closed,
        computations=tuple(computations),
        input_stages={**program.input_stages, row_ids: tuple(sorted(readers))},
        batch_dependent=program.batch_dependent | {row_ids},
        row_ids=row_ids,
    )


def step_arguments(program: PipelineProgram, flat_args: Sequence[Any], num_micro_batches: int):
    """The leaves a step of ``program`` reads: the caller's, then the row ids (if any)."""
    if program.row_ids is None:
        return list(flat_args)
    rows = program.row_ids.aval.shape[0] * num_micro_batches
    return [*flat_args, np.arange(rows, dtype=np.int32)]
