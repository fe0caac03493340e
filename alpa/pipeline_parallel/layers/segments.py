"""Segments: a function's equations cut into contiguous runs and evaluated run by run.

Layer construction (a ``start`` / ``end`` marker pair around every run) and segment
rematerialization (every run under ``jax.checkpoint``) rewrite a function the same way:

1. trace it to a jaxpr on its array arguments (:func:`rewrite_traced`);
2. cut the equations into contiguous segments, either at the user's
   ``mark_pipeline_boundary()`` calls (:func:`boundary_segments`) or by layer clustering
   (:func:`clustered_segments`: FLOPs within a tolerance of the average, least bytes
   crossing segments; ``layer_clustering``);
3. evaluate the segments in order, each wrapped in what the rewrite adds, reading from one
   environment the values earlier segments produced (:func:`segment_interface` says which
   values enter and leave a segment).

The argument checks of the public options and wrappers built on this are here too.

Evaluating equations by binding their primitives inside the caller's trace keeps the
rewrite transparent to JAX: the result traces, differentiates and jits as ``fun`` does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar

import jax
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, JaxprEqn, Var

from alpa.jax_internals import TRANSPARENT_CALLS, scan_parts
from alpa.pipeline_parallel.layers.layer_clustering import cluster_layers, layer_input_bytes
from alpa.tracing.flops import eqn_flops
from alpa.tracing.jaxpr_util import is_var
from alpa.tracing.primitive_def import pipeline_p
from alpa.tracing.trace import inline_calls

Segments = list[list[JaxprEqn]]


def is_boundary(eqn: JaxprEqn) -> bool:
    return eqn.primitive is pipeline_p and eqn.params["mark_type"] == "boundary"


# ----------------------------------------------------------------------------- tracing


def rewrite_traced(
    fun: Callable,
    rewrite: Callable[[ClosedJaxpr, list], list],
    static_argnums: Sequence[int] = (),
    inline_jit: bool = False,
) -> Callable:
    """``fun`` traced on its array arguments, then evaluated by ``rewrite(closed, values)``.

    ``rewrite`` returns the flat outputs of ``closed`` for the flat array arguments
    ``values``. Arguments that are not arrays (Python numbers, strings) and those at
    ``static_argnums`` are constants of the trace. With ``inline_jit``, ``jax.jit`` calls
    inside ``fun`` are inlined first, so that a cut may fall inside them.
    """

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        static = {i % len(args) for i in static_argnums if -len(args) <= i < len(args)}
        leaves, tree = jax.tree.flatten((args, kwargs))
        static_leaves: set[int] = set()
        offset = 0  # (args, kwargs) flattens to the leaves of each argument in turn
        for i, arg in enumerate(args):
            n = len(jax.tree.leaves(arg))
            if i in static:
                static_leaves.update(range(offset, offset + n))
            offset += n
        dynamic = [
            i
            for i, x in enumerate(leaves)
            if isinstance(x, jax.Array | np.ndarray) and i not in static_leaves
        ]

        def flat_fun(*values):
            full = list(leaves)
            for i, value in zip(dynamic, values, strict=True):
                full[i] = value
            call_args, call_kwargs = jax.tree.unflatten(tree, full)
            return fun(*call_args, **call_kwargs)

        values = [leaves[i] for i in dynamic]
        closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*values)
        if inline_jit:
            closed = inline_calls(closed, TRANSPARENT_CALLS)
        outs = rewrite(closed, values)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return wrapped


def layer_scan_indices(closed: ClosedJaxpr, num_layers: int) -> set[int]:
    """The positions of ``closed``'s *layer scans*: its scans (of more than one
    iteration) that hold at least one layer's share of the FLOPs (``1 / num_layers``).
    Only scans of ``closed`` itself, not those inside their bodies."""
    eqns = closed.jaxpr.eqns
    total = sum(eqn_flops(e) for e in eqns)
    return {
        j
        for j, e in enumerate(eqns)
        if e.primitive is lax.scan_p
        and scan_parts(e).length > 1
        and eqn_flops(e) * num_layers >= total > 0
    }


# ----------------------------------------------------------------------------- cutting


def boundary_segments(eqns: Sequence[JaxprEqn]) -> Segments:
    """The equations between ``mark_pipeline_boundary()`` calls (boundaries dropped):
    ``number of boundaries + 1`` segments, some possibly empty."""
    segments: Segments = [[]]
    for eqn in eqns:
        if is_boundary(eqn):
            segments.append([])
        else:
            segments[-1].append(eqn)
    return segments


def clustered_segments(
    eqns: Sequence[JaxprEqn],
    num_segments: int,
    tolerance: float,
    what: str,
    subject: str = "the function",
) -> Segments:
    """``eqns`` (boundaries dropped) cut into ``num_segments`` contiguous segments by layer
    clustering: each segment's FLOPs (``tracing.flops.eqn_flops``) within ``(1 - tolerance)``
    to ``(1 + tolerance)`` times the average, the least bytes read across segments, and of
    those cuts the most even (``layer_clustering``).

    ``what`` names the user's option in errors (``"AutoLayerOption(layer_num=4,
    layer_eps=0.6)"``), ``subject`` what was cut (``"the loss function"``).
    """
    eqns = [e for e in eqns if not is_boundary(e)]
    n = len(eqns)
    memo, memo_key = _cut_memo.get(), None
    if memo is not None:
        memo_key = (
            tuple((e.primitive, len(e.invars), len(e.outvars)) for e in eqns),
            num_segments,
            tolerance,
        )
        starts = memo.get(memo_key)
        if starts is not None:
            return _cut(eqns, starts)
    if num_segments > n:
        raise ValueError(
            f"{what}: cannot cut the {n} equations of {subject} into {num_segments} "
            f"layers (each layer needs at least one equation); use at most {n} layers"
        )
    value_id: dict[Var, int] = {}
    producer: list[int] = []
    nbytes: list[int] = []

    def vid(v: Var, eqn_index: int) -> int:
        if v not in value_id:
            value_id[v] = len(producer)
            producer.append(eqn_index)
            nbytes.append(_nbytes(v))
        return value_id[v]

    eqn_inputs = []
    for i, eqn in enumerate(eqns):
        eqn_inputs.append([vid(v, -1) for v in eqn.invars if is_var(v)])
        for v in eqn.outvars:
            if is_var(v):
                vid(v, i)
    flops = [eqn_flops(e) for e in eqns]
    table = layer_input_bytes(eqn_inputs, producer, nbytes)
    try:
        starts, _ = cluster_layers(flops, table, num_segments, tolerance)
    except ValueError as error:  # the only one left: no cut within the tolerance
        raise ValueError(
            f"{what}: no cut of the {n} equations of {subject} into {num_segments} layers "
            f"keeps every layer within {max(0.0, 1 - tolerance):g}x to {1 + tolerance:g}x the "
            f"average FLOPs ({sum(flops) / num_segments:.4g}); a few equations weigh too much "
            "or too little to balance "
            "at this granularity. Use a larger eps (layer_eps) or fewer layers."
        ) from error
    if memo is not None:
        memo[memo_key] = tuple(starts)
    return _cut(eqns, starts)


def _cut(eqns: Sequence[JaxprEqn], starts: Sequence[int]) -> Segments:
    bounds = [0, *starts, len(eqns)]
    return [list(eqns[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


_cut_memo: ContextVar[dict | None] = ContextVar("alpa_segment_cut_memo", default=None)


@contextlib.contextmanager
def reuse_cuts(memo: dict) -> Iterator[None]:
    """Within the block, :func:`clustered_segments` cuts equations whose primitives (in
    order, with their operand and result counts) were cut before under the same ``memo``
    where they were cut then, without clustering again. ``alpa.parallelize`` shares one
    memo between a step's trace and its retrace at the per-device batch size
    (``micro_batches.batch_dims``): the two then have the same layers, equation for
    equation, which the retrace needs, and the clustering runs once."""
    token = _cut_memo.set(memo)
    try:
        yield
    finally:
        _cut_memo.reset(token)


def _nbytes(v: Var) -> int:
    aval = v.aval
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return int(np.prod(shape, dtype=np.int64)) * int(getattr(dtype, "itemsize", 0))


# ----------------------------------------------------------------------------- evaluating


def segment_interface(closed: ClosedJaxpr, segments: Segments) -> list[tuple[list, list]]:
    """Per segment, ``(entering, leaving)``: the variables its equations read that it does
    not produce (step inputs, constants, earlier segments' values), and the variables it
    produces that later segments or the outputs read; each in first-use order."""
    jaxpr = closed.jaxpr
    outputs = {v for v in jaxpr.outvars if is_var(v)}
    last_read: dict[Var, int] = {}
    for k, eqns in enumerate(segments):
        for eqn in eqns:
            for v in eqn.invars:
                if is_var(v):
                    last_read[v] = k
    interface = []
    for k, eqns in enumerate(segments):
        produced = {v for eqn in eqns for v in eqn.outvars}
        entering = unique(v for eqn in eqns for v in eqn.invars if is_var(v) and v not in produced)
        leaving = unique(
            v
            for eqn in eqns
            for v in eqn.outvars
            if is_var(v) and (v in outputs or last_read.get(v, -1) > k)
        )
        interface.append((entering, leaving))
    return interface


def unique(values) -> list:
    return list(dict.fromkeys(values))


# ----------------------------------------------------------------------------- checks


def check_callable(fun, name: str) -> None:
    if not callable(fun):
        raise TypeError(f"{name} expects a callable fun, got {type(fun).__name__}: {fun!r}")


def check_layer_num(value, name: str, arg: str = "layer_num") -> None:
    """``value`` (argument ``arg`` of ``name``) must be an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(
            f"{name}: {arg} must be an int >= 1, got {value!r} ({type(value).__name__})"
        )
    if value < 1:
        raise ValueError(f"{name}: {arg} must be an int >= 1, got {value}")


def check_eps(eps, name: str, arg: str) -> None:
    if isinstance(eps, bool) or not isinstance(eps, int | float):
        raise TypeError(f"{name}: {arg} must be a number >= 0, got {eps!r} ({type(eps).__name__})")
    if not eps >= 0 or eps == float("inf"):
        raise ValueError(
            f"{name}: {arg} must be a finite number >= 0 (the tolerated excess of a "
            f"layer's FLOPs over the average, as a fraction), got {eps}"
        )


def check_static_argnums(static_argnums, name: str) -> tuple[int, ...]:
    if isinstance(static_argnums, int) and not isinstance(static_argnums, bool):
        return (static_argnums,)
    if isinstance(static_argnums, Sequence) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in static_argnums
    ):
        return tuple(static_argnums)
    raise TypeError(
        f"{name}: static_argnums must be an int or a tuple of ints, got {static_argnums!r}"
    )
