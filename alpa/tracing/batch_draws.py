"""Random numbers under micro-batching: each micro-batch draws its rows of the full batch's.

A step with ``num_micro_batches = k`` is traced at the micro-batch size and run ``k`` times.
A random draw inside it whose shape follows the batch (dropout's mask,
``jax.random.bernoulli(key, p, x.shape)``) is then made at micro-batch shape with the same
key in every micro-batch: every micro-batch reuses the first rows of the mask, and the
step differs from the full-batch step it stands for.

This module makes micro-batch ``j`` draw exactly its rows of the full-batch draw. JAX's
threefry ``random_bits`` (with ``jax_threefry_partitionable``, the default) computes element
``e`` of a draw of shape ``F`` as

    bits[e] = threefry2x32(key, (hi(c), lo(c))),    c = sum_d e_d * stride_d(F)

with ``c`` the element's linear index in ``F`` (``random_split`` makes keys the same way).
So the rows ``r`` of the full draw can be computed directly: the same hash over the
counters those rows have in ``F``. Along the dimension that grows with the batch (``dim``,
``per_row`` elements per batch row: ``[b, s, h]`` has 1 along dim 0, a flattened
``[b * s, h]`` has ``s``) element ``i`` is full index ``r[i // per_row] * per_row + i %
per_row``; the other dimensions are whole. The work is one micro-batch's, not the full
batch's, and each device of a data-parallel mesh hashes only its own rows.

The passes:

* :func:`find_batch_draws` compares the step traced at two batch sizes and returns the
  draws whose shape grows with the batch (one dimension, in proportion);
* :func:`with_row_ids` rewrites a jaxpr so that each such draw takes its rows from a new
  last input, ``row_ids: int32[rows]``: the full-batch row of each of the jaxpr's batch
  rows. The caller feeds ``arange(batch_size)`` as a batch input, split into micro-batches
  (and across devices) exactly like the batch, so the rows follow whatever order the
  micro-batches take. The one-mesh lowering feeds it to its micro-batch loop
  (``shard_parallel/lowering/step_function.py``); a pipeline rewrites the stage computations
  that draw with :func:`row_id_rewriter` and ``LOAD`` s the row ids like a batch argument
  (``program_rewrites.draw_rows_of_full_batch``).

Draws that the fast path does not cover (another PRNG implementation, partitionable
threefry off, a batch of keys, more than ``2**32`` elements) draw the full-batch shape and
take their rows: the same numbers, at the full batch's RNG cost.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Jaxpr, JaxprEqn, Var, jaxprs_in_params
from jax.extend.random import threefry2x32_p

from alpa.jax_internals import REMAT_PRIMITIVES, is_remat, remat_body, remat_params
from alpa.tracing.trace import TracedStep, new_jaxpr

#: Primitives that draw random numbers of a shape given by a parameter.
DRAW_PRIMITIVES = frozenset({"random_bits", "random_split"})


@dataclass(frozen=True)
class BatchDraw:
    """A draw whose ``shape`` parameter grows with the batch: ``per_row`` elements along
    dimension ``dim`` of ``shape`` per batch row."""

    dim: int
    per_row: int


# ----------------------------------------------------------------------------- analysis


def has_draws(jaxpr: Jaxpr) -> bool:
    """Whether ``jaxpr`` (or a jaxpr inside it) draws random numbers."""
    return any(True for _ in _draws(jaxpr))


def _draws(jaxpr: Jaxpr):
    """The draw equations of ``jaxpr`` in program order, bodies included, each with the
    name of the primitive whose body holds it (``None`` at top level)."""

    def walk(jaxpr: Jaxpr, inside: str | None):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in DRAW_PRIMITIVES:
                yield eqn, inside
            for sub in jaxprs_in_params(eqn.params):
                yield from walk(sub, inside or eqn.primitive.name)

    yield from walk(jaxpr, None)


def batch_size(traced: TracedStep) -> int:
    """The batch size ``traced`` was traced at (dim 0 of its first batch leaf)."""
    for aval, is_batch in zip(traced.in_avals, traced.batch_invars, strict=True):
        if is_batch and aval.shape:
            return int(aval.shape[0])
    raise ValueError(f"{traced.name} has no batch argument")


def find_batch_draws(small: TracedStep, large: TracedStep) -> dict[JaxprEqn, BatchDraw]:
    """The draws of ``small`` whose shape grows with the batch, found by comparing them
    with the same draws in ``large``, the step traced at another batch size.

    A draw whose shape grows in more than one dimension, or not in proportion to the batch,
    cannot be sliced by rows: a ``ValueError`` says so.
    """
    b_small, b_large = batch_size(small), batch_size(large)
    if b_small == b_large:
        raise ValueError(f"both traces of {small.name} have batch size {b_small}")
    ours, theirs = list(_draws(small.jaxpr)), list(_draws(large.jaxpr))
    if [e.primitive for e, _ in ours] != [e.primitive for e, _ in theirs]:
        raise ValueError(
            f"{small.name} draws different random numbers at batch sizes {b_small} and "
            f"{b_large}; micro-batches cannot draw their rows of the full batch's numbers"
        )
    draws = {}
    for (eqn, inside), (other, _) in zip(ours, theirs, strict=True):
        shape, other_shape = tuple(eqn.params["shape"]), tuple(other.params["shape"])
        grown = [d for d, (m, n) in enumerate(zip(shape, other_shape, strict=True)) if m != n]
        if not grown:
            continue
        d = grown[0]
        per_row, rest = divmod(shape[d], b_small)
        if len(grown) > 1 or rest or per_row * b_large != other_shape[d]:
            raise ValueError(
                f"{small.name} draws random numbers ({eqn.primitive.name}) of shape {shape} "
                f"at batch size {b_small} and {other_shape} at {b_large}: a micro-batch can "
                "draw its rows of the full batch's numbers only when one dimension grows in "
                "proportion to the batch"
            )
        if inside is not None and inside not in REMAT_PRIMITIVES:
            warnings.warn(
                f"{small.name} draws random numbers of batch shape {shape} inside "
                f"`{inside}`: each micro-batch draws its own numbers there, not its rows of "
                "the full batch's",
                stacklevel=2,
            )
            continue
        draws[eqn] = BatchDraw(d, per_row)
    return draws


def micro_batch_draws(traced: TracedStep) -> dict[JaxprEqn, BatchDraw]:
    """:func:`find_batch_draws` of ``traced`` against itself traced at twice its batch
    size (``traced.retrace``); no retrace when the step draws nothing."""
    if not has_draws(traced.jaxpr) or traced.retrace is None:
        return {}
    return find_batch_draws(traced, traced.retrace(Fraction(1, 2)))


# ----------------------------------------------------------------------------- rewrite


def with_row_ids(jaxpr: Jaxpr, draws: Mapping[JaxprEqn, BatchDraw], batch_size: int) -> Jaxpr:
    """``jaxpr`` with a new last input ``row_ids: int32[rows]`` (the full-batch row of each
    of its batch rows) from which every draw in ``draws`` takes its rows of the draw the
    full batch (``batch_size`` rows) makes. Every other equation and variable is kept, so
    a plan made for ``jaxpr`` still names its values. ``rows`` is read from the first
    draw; checkpoint bodies get ``row_ids`` as a new last operand."""
    row_ids = new_row_ids(jaxpr.eqns, draws)
    body = row_id_rewriter(draws, batch_size, row_ids)(jaxpr.eqns)
    return new_jaxpr(jaxpr, jaxpr.constvars, [*jaxpr.invars, row_ids], jaxpr.outvars, body)


def new_row_ids(eqns: Sequence[JaxprEqn], draws: Mapping[JaxprEqn, BatchDraw]) -> Var:
    """A fresh ``int32[rows]`` variable for the row ids of ``eqns``' draws, ``rows`` being
    the batch size they were traced at."""
    for eqn in eqns:
        for inner, _ in _draws_of(eqn):
            draw = draws.get(inner)
            if draw is not None:
                rows = inner.params["shape"][draw.dim] // draw.per_row
                struct = jax.ShapeDtypeStruct((rows,), np.int32)
                return Var(jax.make_jaxpr(lambda r: r)(struct).in_avals[0])
    raise ValueError("the equations make none of the given draws")


def reads_draws(eqns: Sequence[JaxprEqn], draws: Mapping[JaxprEqn, BatchDraw]) -> bool:
    """Whether any of ``eqns`` (bodies included) is one of ``draws``."""
    return any(inner in draws for eqn in eqns for inner, _ in _draws_of(eqn))


def _draws_of(eqn: JaxprEqn):
    if eqn.primitive.name in DRAW_PRIMITIVES:
        yield eqn, None
    for sub in jaxprs_in_params(eqn.params):
        yield from _draws(sub)


def row_id_rewriter(
    draws: Mapping[JaxprEqn, BatchDraw], batch_size: int, row_ids: Var
) -> Callable[[Sequence[JaxprEqn]], list[JaxprEqn]]:
    """A function that rewrites a list of equations as :func:`with_row_ids` does, reading
    ``row_ids``. An equation is rewritten once: lists that share it (a pipeline's forward
    and its rematerializing backward) get the same new equation."""
    memo: dict[JaxprEqn, JaxprEqn] = {}

    def rewrite(eqns: Sequence[JaxprEqn], rows: Var = row_ids) -> list[JaxprEqn]:
        return [one(eqn, rows) for eqn in eqns]

    def one(eqn: JaxprEqn, rows: Var) -> JaxprEqn:
        if eqn in memo:
            return memo[eqn]
        draw = draws.get(eqn)
        if draw is not None:
            new = _draw_rows_eqn(eqn, draw, batch_size, rows)
        elif is_remat(eqn) and reads_draws([eqn], draws):
            body = remat_body(eqn)
            inner = Var(rows.aval)
            new_body = new_jaxpr(
                body, body.constvars, [*body.invars, inner], body.outvars, rewrite(body.eqns, inner)
            )
            params = remat_params(eqn.params, new_body, 1)
            new = eqn.replace(invars=[*eqn.invars, rows], params=params)
        else:
            new = eqn
        memo[eqn] = new
        return new

    return rewrite


def _draw_rows_eqn(eqn: JaxprEqn, draw: BatchDraw, batch_size: int, row_ids: Var) -> JaxprEqn:
    """One ``jit`` equation computing ``eqn``'s rows ``row_ids`` of its full-batch draw,
    writing ``eqn``'s own output variable."""
    key = eqn.invars[0]
    full_shape = list(eqn.params["shape"])
    full_shape[draw.dim] = batch_size * draw.per_row
    fun = partial(
        draw_rows,
        primitive=eqn.primitive,
        params=dict(eqn.params),
        full_shape=tuple(full_shape),
        dim=draw.dim,
        per_row=draw.per_row,
    )
    structs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in (key, row_ids)]
    (call,) = jax.make_jaxpr(jax.jit(fun))(*structs).jaxpr.eqns
    return call.replace(invars=[key, row_ids], outvars=list(eqn.outvars))


# ----------------------------------------------------------------------------- numerics


def draw_rows(key, row_ids, *, primitive, params, full_shape, dim: int, per_row: int):
    """Rows ``row_ids`` (along ``dim``, ``per_row`` elements each) of the draw
    ``primitive.bind(key, shape=full_shape, **params)``, bit for bit."""
    key_rank = len(key.shape)
    shape = list(full_shape)
    shape[dim] = row_ids.shape[0] * per_row
    shape = tuple(shape)
    if _partitionable_threefry(key) and math.prod(full_shape) < 2**32:
        counts = _counters(shape, full_shape, dim, per_row, row_ids)
        k1, k2 = (jax.random.key_data(key)[i] for i in range(2))
        bits1, bits2 = threefry2x32_p.bind(k1, k2, jnp.zeros(shape, jnp.uint32), counts)
        if primitive.name == "random_split":
            data = jnp.stack([bits1, bits2], axis=-1)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))
        return _bits_of_width(bits1, bits2, params["bit_width"])
    full = primitive.bind(key, **{**params, "shape": tuple(full_shape)})
    along = _indices_along(row_ids, per_row)
    return jnp.take(full, along, axis=key_rank + dim)


def _partitionable_threefry(key) -> bool:
    return (
        not key.shape
        and jax.config.jax_threefry_partitionable
        and str(jax.random.key_impl(key)) == "threefry2x32"
    )


def _indices_along(row_ids, per_row: int):
    rows = row_ids.astype(jnp.uint32)
    within = lax.iota(jnp.uint32, per_row)
    return (rows[:, None] * np.uint32(per_row) + within[None, :]).reshape(-1)


def _counters(shape, full_shape, dim: int, per_row: int, row_ids):
    """The linear index in ``full_shape`` of every element of the rows' block ``shape``
    (uint32: the caller checks that the full draw has fewer than 2**32 elements)."""
    strides = [math.prod(full_shape[e + 1 :]) for e in range(len(full_shape))]
    along = _indices_along(row_ids, per_row) * np.uint32(strides[dim])
    counts = lax.broadcast_in_dim(along, shape, (dim,))
    for e in range(len(shape)):
        if e != dim:
            counts = counts + lax.broadcasted_iota(jnp.uint32, shape, e) * np.uint32(strides[e])
    return counts


def _bits_of_width(bits1, bits2, bit_width: int):
    """What threefry ``random_bits`` makes of the two hashed words (JAX's partitionable
    ``_threefry_random_bits_partitionable``)."""
    if bit_width == 64:
        hi = lax.convert_element_type(bits1, np.uint64)
        lo = lax.convert_element_type(bits2, np.uint64)
        return lax.shift_left(hi, np.uint64(32)) | lo
    word = bits1 ^ bits2
    if bit_width == 32:
        return word
    return lax.convert_element_type(word, np.dtype(f"uint{bit_width}"))
