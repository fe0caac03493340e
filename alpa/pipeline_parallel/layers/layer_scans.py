"""Layers cut inside a scan over blocks, each layer keeping a scan over its own blocks.

A model whose blocks are one ``scan`` (``nn.scan``, ``lax.scan``) is one equation, which
layer clustering cannot cut. :func:`cut_keeping_scans` lets it cut the scan as it cuts the
model written out, and then keeps the loops:

1. every scan that holds at least one layer's share of the FLOPs (a *layer scan*,
   ``segments.layer_scan_indices``) is written out, every iteration's body
   equations in turn, each equation tagged with its place ``(equation of the function,
   iteration, equation of the body)``;
2. the written-out equations are cut (clustering, ``cut``): the cuts, and so the layers,
   are those of the model unrolled;
3. the function is rebuilt with a boundary at each cut, every layer scan split at the
   cuts that fall inside it: a run of two or more whole iterations between cuts is a
   scan over the slices ``x[a:b]`` of its stacked operands (the same body, ``length =
   b - a``), and an iteration alone, or one a cut divides, is written out.

A stage program then runs one scan per run of iterations in each of its layers, and its
compile time no longer grows with its blocks; a stacked parameter is read by blocks of
rows, which ``stacked_rows`` splits into inputs of their own. The rebuilt function
computes the same values in the same order (the iterations of a ``reverse`` scan run
last-to-first in each piece, as in the whole scan); its stacked outputs are the pieces'
outputs put together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, JaxprEqn

from alpa.jax_internals import TRANSPARENT_CALLS, scan_params, scan_parts
from alpa.pipeline_parallel.layers.segments import (
    Segments,
    boundary_segments,
    is_boundary,
    layer_scan_indices,
)
from alpa.tracing.jaxpr_util import eval_eqns, initial_env, read
from alpa.tracing.primitive_def import pipeline_p
from alpa.tracing.trace import inline_calls

# The name of the markers that tag the written-out equations with their place.
_TAG = "alpa_scan_place"
#: The name of the boundaries the rebuilt function has at the cuts (``AutoLayerOption``
#: reads an inference step's layers from them: ``is_layer_cut``).
LAYER_CUT = "layer_cut"

Place = tuple[int, int, int]  # (equation of the function, iteration position, body equation)


def cut_keeping_scans(
    closed: ClosedJaxpr, num_layers: int, cut: Callable[[Sequence[JaxprEqn]], Segments]
) -> tuple[ClosedJaxpr, Segments]:
    """``closed`` rebuilt with its layer scans split where ``cut`` cuts them written out,
    and its segments (module docstring): the rebuilt function has a boundary named
    :data:`LAYER_CUT` at each cut, and the user's boundaries are dropped. ``cut`` takes
    the written-out equations and returns them cut into segments; without a layer scan,
    it cuts ``closed``'s own and ``closed`` is returned as it is."""
    scans = layer_scan_indices(closed, num_layers)
    if not scans:
        return closed, cut(closed.jaxpr.eqns)
    eqns = closed.jaxpr.eqns
    bodies = {j: inline_calls(scan_parts(eqns[j]).body, TRANSPARENT_CALLS) for j in scans}
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]

    def written_out(*args):
        return _evaluate(closed, bodies, args, tag=True)

    tagged = inline_calls(jax.make_jaxpr(written_out)(*avals), TRANSPARENT_CALLS)
    untagged, places = [], []
    place: Place = (0, 0, 0)
    for eqn in tagged.jaxpr.eqns:
        if eqn.primitive is pipeline_p and eqn.params["name"].startswith(_TAG):
            place = _read_tag(eqn.params["name"])
        else:
            untagged.append(eqn)
            places.append(place)
    place_of = {id(e): p for e, p in zip(untagged, places, strict=True)}
    segments = cut(untagged)
    cuts = {place_of[id(seg[0])] for seg in segments[1:] if seg}

    def rebuilt(*args):
        return _evaluate(closed, bodies, args, cuts=cuts)

    new = inline_calls(jax.make_jaxpr(rebuilt)(*avals), TRANSPARENT_CALLS)
    new_segments = boundary_segments(new.jaxpr.eqns)
    if len(new_segments) != len(segments):
        # Two cuts at one place (inside an equation the tags do not look into): the
        # function written out, cut where the clustering cut it.
        return tagged, segments
    return new, new_segments


def is_layer_cut(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` is a boundary :func:`cut_keeping_scans` put at a cut."""
    return eqn.primitive is pipeline_p and eqn.params["name"] == LAYER_CUT


def _mark(place: Place, tag: bool, cuts) -> None:
    """Before the equation at ``place``: its tag (``tag``), else a boundary if a cut is
    there."""
    if tag:
        pipeline_p.bind(name=f"{_TAG}:{place[0]}:{place[1]}:{place[2]}", mark_type="boundary")
    elif place in cuts:
        pipeline_p.bind(name=LAYER_CUT, mark_type="boundary")


def _read_tag(name: str) -> Place:
    _, j, p, k = name.split(":")
    return int(j), int(p), int(k)


def _evaluate(
    closed: ClosedJaxpr,
    bodies: dict,
    args: Sequence,
    tag: bool = False,
    cuts: frozenset | set = frozenset(),
) -> list:
    """``closed`` on ``args``, its layer scans (``bodies``: their inlined bodies) written
    out with every equation tagged (``tag``), or split at ``cuts`` (a boundary at each)."""
    env = initial_env(closed, args)
    for j, eqn in enumerate(closed.jaxpr.eqns):
        if is_boundary(eqn):  # the user's cuts: AutoLayerOption clusters instead
            continue
        _mark((j, 0, 0), tag, cuts)
        if j not in bodies:
            eval_eqns([eqn], env)
            continue
        operands = [read(env, v) for v in eqn.invars]
        outs = _pieces(eqn, bodies[j], operands, j, tag, cuts)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(env, v) for v in closed.jaxpr.outvars]


def _pieces(eqn: JaxprEqn, body: ClosedJaxpr, operands: list, j: int, tag: bool, cuts) -> list:
    """The outputs of the scan ``eqn`` (equation ``j``) on ``operands``: its iterations
    written out and tagged (``tag``), else split at the ``cuts`` that fall inside it."""
    params, parts = eqn.params, scan_parts(eqn)
    length, reverse = parts.length, parts.reverse
    n_consts, n_carry = parts.num_consts, parts.num_carry
    consts, carry = operands[:n_consts], operands[n_consts : n_consts + n_carry]
    xs = operands[n_consts + n_carry :]
    n_ys = len(eqn.outvars) - n_carry

    def iteration(position: int) -> int:
        return length - 1 - position if reverse else position

    # Pieces in execution order: ("scan", first, end) over positions, or ("one", p).
    pieces: list = []
    if tag:
        pieces = [("one", p) for p in range(length)]
    else:
        start = 0
        for p in range(length):
            if p > start and (j, p, 0) in cuts:  # a cut between iterations
                pieces += _runs(start, p)
                start = p
            if any((j, p, k) in cuts for k in range(1, len(body.jaxpr.eqns))):
                pieces += _runs(start, p)  # a cut divides iteration p: written out
                pieces.append(("one", p))
                start = p + 1
        pieces += _runs(start, length)

    blocks: dict = {}  # first iteration -> the piece's stacked outputs
    for piece in pieces:
        if piece[0] == "one":
            p = piece[1]
            i = iteration(p)
            if p > 0 or tag:  # a cut before iteration 0 is the scan's own, marked before it
                _mark((j, p, 0), tag, cuts)
            env = initial_env(body, [*consts, *carry, *[x[i] for x in xs]])
            for k, body_eqn in enumerate(body.jaxpr.eqns):
                if k > 0:
                    _mark((j, p, k), tag, cuts)
                eval_eqns([body_eqn], env)
            outs = [read(env, v) for v in body.jaxpr.outvars]
            carry = outs[:n_carry]
            blocks[i] = [jnp.expand_dims(y, 0) for y in outs[n_carry:]]
            continue
        _, first, end = piece
        if first > 0:
            _mark((j, first, 0), tag, cuts)
        a, b = (length - end, length - first) if reverse else (first, end)
        sliced = [lax.slice_in_dim(x, a, b, axis=0) for x in xs]
        outs = lax.scan_p.bind(*consts, *carry, *sliced, **scan_params(params, length=b - a))
        carry = list(outs[:n_carry])
        blocks[a] = list(outs[n_carry:])
    _mark((j, length, 0), tag, cuts)
    if not n_ys:
        return list(carry)
    ordered = [blocks[i] for i in sorted(blocks)]
    if len(ordered) == 1:
        return [*carry, *ordered[0]]
    ys = [lax.concatenate([part[y] for part in ordered], 0) for y in range(n_ys)]
    return [*carry, *ys]


def _runs(first: int, end: int) -> list:
    """The iterations ``first .. end - 1`` (positions) as one scan, or written out when
    there is only one."""
    if end - first >= 2:
        return [("scan", first, end)]
    return [("one", p) for p in range(first, end)]
