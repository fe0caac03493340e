"""Stacked parameters split by rows between pipeline stages, each stage holding its blocks.

A model whose blocks are one ``nn.scan`` keeps each block parameter as one array with a
leading axis of blocks (``[L, ...]``). ``AutoLayerOption`` cuts the scan into one scan per
layer (``layer_scans``), so layer ``k`` reads the rows of its blocks, ``W[a:b]`` (or a
row ``W[i:i+1]`` of a block written out); but the array itself is one step input, and an
input lives on one mesh: the first stage that read it held every row (and sent the others
theirs), its optimizer state too.

:func:`split_stacked_rows` rewrites the traced step so that such an input is one input
per *part*: its rows cut at the ends of every slice that reads them, a part of one row of
shape ``[...]``, a block of ``n`` rows of shape ``[n, ...]``, each read by the stage of
its own blocks:

* a read of a part (``slice`` of its rows on axis 0) is that part's input;
* the backward pass's transpose of such a read (a ``pad`` of the part into ``[L, ...]``
  with zeros) is the part alone, the other parts known to be zero, and the sum of such
  gradients (``add_any``) adds part by part;
* elementwise equations (an optimizer's update: ``mul``, ``add``, ``sqrt``, ...) and
  reductions (a global norm's ``reduce_sum``) run part by part; a reduction over axis 0
  adds (or takes the max of) the parts' results;
* pipeline markers pass each part that is read after them (a layer's start marker no
  longer carries the parts of the other layers);
* any other equation, or a slice across parts, reads the parts concatenated (correct, but
  the rows travel): the input is then left whole, and the rewrite is made again without
  it.

The outputs computed part by part from split inputs (the updated parameters and optimizer
state) are the parts' outputs (any other output is returned whole), and the executable
gives them back to the caller as one value whose parts stay on their stages' meshes
(``runtime.stage_rows``: one ``jax.Array`` where a sharding can say where the rows are,
else a ``StackedRows``); passed to the step again, each part is read where it is. An input
is split when slices of its rows read it (directly or through markers), or when it has the
shape of one that is (its optimizer state, cut the same way), and the rewrite never
concatenates it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, JaxprEqn, Literal

from alpa.jax_internals import is_scan, scan_parts
from alpa.runtime.stacked_array import StackedRows
from alpa.runtime.stage_rows import join_parts, rows_layout, split_leaf
from alpa.tracing import TracedStep
from alpa.tracing.jaxpr_util import bind_eqn, is_var, read
from alpa.tracing.primitive_def import pipeline_p
from alpa.tracing.trace import inline_calls, new_jaxpr

# Equations that compute each element from the same element of their operands (operands
# of the result's shape, or scalars).
ELEMENTWISE = frozenset(
    "abs add add_any and atan2 cbrt ceil clamp convert_element_type copy copy_p cos div eq "
    "erf erf_inv exp exp2 expm1 floor ge gt imag integer_pow is_finite le log log1p "
    "logistic lt max min mul ne neg nextafter not or pow real reduce_precision rem round "
    "rsqrt select_n sign sin sqrt square stop_gradient sub tan tanh xor".split()
)
# Elementwise equations that map rows of zeros to a row of zeros.
_ZERO_PRESERVING = frozenset("add add_any sub neg mul convert_element_type copy copy_p".split())
_ADDITIVE = frozenset(("add", "add_any"))
# Reductions: the rows' results combined by this primitive when axis 0 is reduced.
_REDUCTIONS = {"reduce_sum": lax.add, "reduce_max": lax.max, "reduce_min": lax.min}


@dataclass(eq=False)
class _Rows:
    """A value of shape ``[L, ...]`` held as its parts: rows ``[a, a + 1)`` (each of shape
    ``[...]``) and blocks ``[a, b)`` of several rows (``[b - a, ...]``), cut at ``bounds``
    (``0 = bounds[0] < ... < bounds[-1] = L``); ``None`` is a part known to be zero.
    ``roots`` are the split inputs it was computed from."""

    rows: list
    bounds: tuple
    aval: Any
    roots: frozenset

    def size(self, i: int) -> int:
        return self.bounds[i + 1] - self.bounds[i]

    def row(self, i: int):
        r = self.rows[i]
        if r is not None:
            return r
        shape = _part_shape(self.aval.shape, self.bounds[i], self.bounds[i + 1])
        return lax.full(shape, 0, self.aval.dtype)

    def whole(self):
        rows = [
            lax.expand_dims(self.row(i), (0,)) if self.size(i) == 1 else self.row(i)
            for i in range(len(self.rows))
        ]
        return lax.concatenate(rows, 0)


def _part_shape(shape: tuple, a: int, b: int) -> tuple:
    return tuple(shape[1:]) if b - a == 1 else (b - a, *shape[1:])


def _sizes(bounds: tuple) -> tuple:
    return tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))


@dataclass(frozen=True)
class RowSplit:
    """How :func:`split_stacked_rows` split a traced step.

    Attributes:
      original: the step as traced (its leaves, what callers pass and get back).
      traced: the step with each split leaf as one leaf per part (a row, or a block of
        rows that one scan reads), and as ``prepare`` rewrote it (with no leaf split, only
        that).
      inputs: per split input leaf of ``original`` (position), the bounds of its parts
        (``(0, ..., L)``: part ``k`` is rows ``bounds[k]:bounds[k + 1]``).
      outputs: per split output leaf of ``original`` (position), the same.
    """

    original: TracedStep
    traced: TracedStep
    inputs: dict
    outputs: dict

    def split_args(self, leaves: Sequence[Any], layouts: dict | None = None) -> list:
        """The leaves of ``traced`` from those of ``original``: a split leaf becomes its
        parts, cut from its shards where ``layouts`` (per split leaf, a
        ``stage_rows.RowsLayout``) has a joined sharding (``stage_rows.split_leaf``), else
        a :class:`StackedRows`' own parts, or slices."""
        out: list = []
        for i, x in enumerate(leaves):
            bounds = self.inputs.get(i)
            if bounds is None:
                out.append(x)
                continue
            layout = (layouts or {}).get(i)
            if layout is None:
                layout = rows_layout(_sizes(bounds), [None] * (len(bounds) - 1), 0)
            out.extend(split_leaf(x, layout))
        return out

    def join_outputs(self, outputs: Sequence[Any], layouts: dict | None = None) -> list:
        """The outputs of ``original`` from those of ``traced``: a split output's parts
        are one ``jax.Array`` where ``layouts`` has a joined sharding for it, else one
        :class:`StackedRows`."""
        avals = [v.aval for v in self.original.jaxpr.outvars]
        return _join(outputs, self.outputs, avals, layouts)

    def join_inputs(self, leaves: Sequence[Any], layouts: dict | None = None) -> list:
        """The leaves of ``original`` from those of ``traced`` (placed rows, say)."""
        return _join(leaves, self.inputs, self.original.in_avals, layouts)


def _join(values: Sequence[Any], split: dict, avals: Sequence[Any], layouts) -> list:
    out: list = []
    it = iter(values)
    for i, aval in enumerate(avals):
        bounds = split.get(i)
        if bounds is None:
            out.append(next(it))
            continue
        parts = [next(it) for _ in bounds[1:]]
        layout = (layouts or {}).get(i)
        if layout is None:
            out.append(StackedRows(parts, _sizes(bounds)))
        else:
            out.append(join_parts(parts, layout, aval.shape))
    return out


# ----------------------------------------------------------------------------- the rewrite


def split_stacked_rows(traced: TracedStep, prepare=None) -> RowSplit | None:
    """``traced`` with its stacked inputs split by rows (module docstring), or ``None``
    when no input's rows are read one at a time and ``prepare`` changed nothing.

    ``prepare(step)``, when given, rewrites the step first without changing its inputs
    and outputs (an inference step's scans written out, ``pipeline_step``); the split
    is made on the prepared step (and on each of its retraces), and ``RowSplit.original``
    stays ``traced``."""
    planned = prepare(traced) if prepare is not None else traced
    candidates = _candidates(planned)
    while candidates:
        closed, concatenated, in_rows, out_rows = _rewrite(planned, candidates)
        if not concatenated:
            split = _split_step(planned, closed, in_rows, out_rows, prepare)
            return RowSplit(traced, split, in_rows, out_rows)
        candidates = {i: n for i, n in candidates.items() if i not in concatenated}
    if planned.closed_jaxpr is traced.closed_jaxpr:
        return None
    return RowSplit(traced, _with_prepared_retraces(planned, prepare), {}, {})


def _with_prepared_retraces(step: TracedStep, prepare) -> TracedStep:
    if step.retrace is None:
        return step
    retrace = step.retrace
    return dataclasses.replace(step, retrace=lambda d: prepare(retrace(d)))


def _candidates(traced: TracedStep) -> dict:
    """Per input that may be split (position), the bounds of its parts: inputs read by
    slices of rows on axis 0 (through markers) of one row or that a scan loops over, cut
    at every such slice's ends, and inputs of their shapes (their optimizer state) cut the
    same way, when all inputs of the shape are cut alike."""
    jaxpr = traced.jaxpr
    origin = {v: i for i, v in enumerate(jaxpr.invars)}
    scanned = {  # the stacked operands of scans
        v for e in jaxpr.eqns if is_scan(e) for v in e.invars[scan_parts(e).first_stacked :]
    }
    read: dict = {}  # input -> the (start, end) of its slices on axis 0
    for eqn in jaxpr.eqns:
        if eqn.primitive is pipeline_p:
            for a, b in zip(eqn.invars, eqn.outvars, strict=False):
                if is_var(a) and a in origin:
                    origin[b] = origin[a]
        elif eqn.primitive.name == "slice" and is_var(eqn.invars[0]) and eqn.invars[0] in origin:
            rows = _rows_of(eqn)
            # One row (a block written out), or the rows a scan loops over; not any
            # other slice (a prefix of a position table, say).
            if rows is not None and (rows[1] - rows[0] == 1 or eqn.outvars[0] in scanned):
                read.setdefault(origin[eqn.invars[0]], set()).add(rows)
    cut = {  # input -> its rows cut at every slice's ends
        i: tuple(sorted({0, traced.in_avals[i].shape[0], *(x for ab in slices for x in ab)}))
        for i, slices in read.items()
    }
    cut_by_shape: dict = {}
    for i, bounds in cut.items():
        cut_by_shape.setdefault(traced.in_avals[i].shape, set()).add(bounds)
    out = {}
    for i, aval in enumerate(traced.in_avals):
        if aval.shape[:1] in ((), (0,), (1,)) or traced.batch_invars[i]:
            continue
        if i in cut:
            out[i] = cut[i]
        elif len(cut_by_shape.get(aval.shape, ())) == 1:
            (out[i],) = cut_by_shape[aval.shape]
    return {i: b for i, b in out.items() if len(b) > 2}


def _rows_of(eqn: JaxprEqn) -> tuple[int, int] | None:
    """The rows ``(start, end)`` a ``slice`` equation reads on axis 0 (with stride 1),
    when they are not all of them."""
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    strides = eqn.params["strides"]
    if strides is not None and strides[0] != 1:
        return None
    if limit[0] - start[0] == eqn.invars[0].aval.shape[0]:
        return None
    return int(start[0]), int(limit[0])


def _rewrite(traced: TracedStep, candidates: dict):
    """The step with ``candidates`` split; the candidates the rewrite had to concatenate;
    the bounds of the parts of each split input and output."""
    closed = traced.closed_jaxpr
    rewriter = _Rewriter(set(candidates.values()))
    out_rows: dict = {}

    def run(*flat):
        it = iter(flat)
        env: dict = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        for i, v in enumerate(closed.jaxpr.invars):
            bounds = candidates.get(i)
            if bounds is None:
                env[v] = next(it)
            else:
                parts = [next(it) for _ in bounds[1:]]
                env[v] = _Rows(parts, bounds, v.aval, frozenset((i,)))
        for eqn in closed.jaxpr.eqns:
            outs = rewriter.eval(eqn, [read(env, v) for v in eqn.invars])
            env.update(zip(eqn.outvars, outs, strict=True))
        result = []
        for j, v in enumerate(closed.jaxpr.outvars):
            value = read(env, v)
            if isinstance(value, _Rows) and value.roots:  # computed from split inputs
                out_rows[j] = value.bounds
                result.extend(value.row(r) for r in range(len(value.rows)))
            else:  # an input left whole (or a gradient alone) is returned whole
                result.append(value.whole() if isinstance(value, _Rows) else value)
        return result

    avals = []
    for i, aval in enumerate(traced.in_avals):
        bounds = candidates.get(i)
        weak = bool(getattr(aval, "weak_type", False))
        if bounds is None:
            avals.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak))
            continue
        for a, b in zip(bounds, bounds[1:], strict=False):
            shape = _part_shape(aval.shape, a, b)
            avals.append(jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=weak))
    new = inline_calls(jax.make_jaxpr(run)(*avals))
    return _without_unread_values(new), rewriter.concatenated, dict(candidates), out_rows


class _Rewriter:
    """Evaluates the step's equations on values some of which are :class:`_Rows`.

    A row read (``slice`` of one row) gives the row with a leading axis of 1 added, and
    the ``squeeze`` / ``reshape`` that removes it gives the row itself again, with no
    equation between: the backward pass then reads the step's input, as in the model
    written out, not a value the forward pass would keep for it. A block read (``slice``
    of the rows of one part, what a scan over some blocks reads) is the part itself.
    ``cuts`` are the bounds of the split inputs (a ``pad`` of a part into ``[L, ...]``
    is held as the parts of the first of them that has it)."""

    def __init__(self, cuts: set):
        self.cuts = sorted(cuts)
        self.concatenated: set = set()
        self._rows_of: dict = {}  # id(a [1, ...] value) -> (it, the [...] row it holds)
        self._zeros: dict = {}  # id -> a broadcast zero (kept alive: ids stay unique)

    def eval(self, eqn: JaxprEqn, values: list) -> list:
        name = eqn.primitive.name
        rows = [x for x in values if isinstance(x, _Rows)]
        if not rows:
            if name == "pad":
                made = self._pad_of_part(eqn, values)
                if made is not None:
                    return [made]
            if name in ("squeeze", "reshape") and id(values[0]) in self._rows_of:
                held, row = self._rows_of[id(values[0])]
                if held is values[0] and eqn.outvars[0].aval.shape == row.shape:
                    return [row]
            if name == "add_any" and any(id(x) in self._zeros for x in values):
                # zeros + x is x (the backward pass's zero cotangents of rows)
                kept = [x for x in values if id(x) not in self._zeros]
                if kept and np.shape(kept[0]) == eqn.outvars[0].aval.shape:
                    return [kept[0]]
            outs = _bind(eqn, values)
            if name == "broadcast_in_dim" and _is_zero(eqn.invars[0]):
                self._zeros[id(outs[0])] = outs[0]
            if name in ("broadcast_in_dim", "reshape") and np.shape(outs[0]) == (
                1,
                *np.shape(values[0]),
            ):  # a row with a leading axis of 1: a row read's transpose pads it
                self._rows_of[id(outs[0])] = (outs[0], values[0])
            return outs
        if eqn.primitive is pipeline_p:
            return _marker(eqn, values)
        if name == "slice" and isinstance(values[0], _Rows):
            part = self._slice_part(eqn, values[0])
            if part is not None:
                return [part]
        out = eqn.outvars[0].aval
        bounds = rows[0].bounds
        if (
            name in ELEMENTWISE
            and out.shape == rows[0].aval.shape
            and all(r.bounds == bounds for r in rows)
            and all(isinstance(x, _Rows) or np.shape(x) in ((), out.shape) for x in values)
        ):
            return [_rowwise(eqn, values, bounds)]
        if name in _REDUCTIONS and len(values) == 1:
            return [_reduce(eqn, values[0])]
        for r in rows:
            self.concatenated.update(r.roots)
        return _bind(eqn, [x.whole() if isinstance(x, _Rows) else x for x in values])

    def _expanded(self, row):
        """``row`` with a leading axis of 1, remembered as holding ``row``."""
        held = lax.expand_dims(row, (0,))
        self._rows_of[id(held)] = (held, row)
        return held

    def _pad_of_part(self, eqn: JaxprEqn, values: list) -> _Rows | None:
        """A ``pad`` of rows ``[a, b)`` into ``[L, ...]`` with zeros (the transpose of a
        part's read), as parts, when ``[a, b)`` is a part of some split input's cut;
        ``None`` for any other pad."""
        operand, fill = eqn.invars
        aval = eqn.outvars[0].aval
        config = eqn.params["padding_config"]
        if (
            not operand.aval.shape
            or not _is_zero(fill)
            or config[0][2] != 0
            or min(config[0][:2]) < 0
            or any(tuple(c) != (0, 0, 0) for c in config[1:])
        ):
            return None
        a = int(config[0][0])
        b = a + operand.aval.shape[0]
        bounds = next(
            (c for c in self.cuts if c[-1] == aval.shape[0] and a in c and b in c and
             c.index(b) == c.index(a) + 1),
            None,
        )  # fmt: skip
        if bounds is None:
            return None
        if b - a == 1:
            held = self._rows_of.get(id(values[0]))
            row = held[1] if held is not None and held[0] is values[0] else None
            part = lax.squeeze(values[0], (0,)) if row is None else row
        else:
            part = values[0]
        rows: list = [None] * (len(bounds) - 1)
        rows[bounds.index(a)] = part
        return _Rows(rows, bounds, aval, frozenset())

    def _slice_part(self, eqn: JaxprEqn, value: _Rows):
        """A ``slice`` of ``value`` whose rows are one of its parts, from that part (a
        row with its leading axis of 1); ``None`` when its rows are not one part."""
        rows = _rows_of(eqn)
        bounds = value.bounds
        if rows is None or rows[0] not in bounds or rows[1] not in bounds:
            return None
        k = bounds.index(rows[0])
        if bounds[k + 1] != rows[1]:
            return None
        n = rows[1] - rows[0]
        part = self._expanded(value.row(k)) if n == 1 else value.row(k)
        start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
        strides = eqn.params["strides"]
        if (
            tuple(limit[1:]) == tuple(value.aval.shape[1:])
            and not any(start[1:])
            and (strides is None or all(s == 1 for s in strides))
        ):
            return part
        rest = None if strides is None else (1, *strides[1:])
        return lax.slice(part, (0, *start[1:]), (n, *limit[1:]), rest)


def _is_zero(v) -> bool:
    return isinstance(v, Literal) and np.shape(v.val) == () and np.asarray(v.val) == 0


def _bind(eqn: JaxprEqn, values: list) -> list:
    outs = bind_eqn(eqn, *values)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _rowwise(eqn: JaxprEqn, values: list, bounds: tuple) -> _Rows:
    name = eqn.primitive.name
    roots = frozenset().union(*(x.roots for x in values if isinstance(x, _Rows)))
    out_rows: list = []
    for i in range(len(bounds) - 1):
        zero = [isinstance(x, _Rows) and x.rows[i] is None for x in values]
        if all(zero) and name in _ZERO_PRESERVING:
            out_rows.append(None)
            continue
        if name in _ADDITIVE and len(values) == 2 and any(zero):
            other = values[1] if zero[0] else values[0]
            if isinstance(other, _Rows) or np.shape(other) != ():  # zero + x is x
                out_rows.append(_row_operand(other, i, bounds))
                continue
        operands = [_row_operand(x, i, bounds) for x in values]
        out_rows.append(_bind(eqn, operands)[0])
    return _Rows(out_rows, bounds, eqn.outvars[0].aval, roots)


def _row_operand(x, i: int, bounds: tuple):
    """Part ``i`` of an operand of a row-wise equation (a scalar is itself)."""
    if isinstance(x, _Rows):
        return x.row(i)
    if np.shape(x) == ():
        return x
    a, b = bounds[i], bounds[i + 1]
    if b - a == 1:
        return lax.index_in_dim(x, a, axis=0, keepdims=False)
    return lax.slice_in_dim(x, a, b, axis=0)


def _reduce(eqn: JaxprEqn, value: _Rows):
    """A reduction of parts: each part over the other axes (a block over its own rows
    too when axis 0 is reduced), then (when axis 0 is reduced) the parts' results
    combined."""
    axes = tuple(eqn.params["axes"])
    results = []
    for i in range(len(value.rows)):
        if value.size(i) == 1:
            inner = tuple(a - 1 for a in axes if a != 0)
            part = value.row(i)
            results.append(
                eqn.primitive.bind(part, **dict(eqn.params, axes=inner)) if inner else part
            )
        else:
            results.append(eqn.primitive.bind(value.row(i), **eqn.params))
    if 0 not in axes:
        return _Rows(results, value.bounds, eqn.outvars[0].aval, value.roots)
    combine = _REDUCTIONS[eqn.primitive.name]
    total = results[0]
    for r in results[1:]:
        total = combine(total, r)
    return total


def _marker(eqn: JaxprEqn, values: list) -> list:
    """A pipeline marker on every row (unread rows are dropped afterwards)."""
    flat: list = []
    for x in values:
        if isinstance(x, _Rows):
            flat.extend(r for r in x.rows if r is not None)
        else:
            flat.append(x)
    marked = iter(_bind(eqn, flat))
    outs = []
    for x in values:
        if isinstance(x, _Rows):
            rows = [None if r is None else next(marked) for r in x.rows]
            outs.append(_Rows(rows, x.bounds, x.aval, x.roots))
        else:
            outs.append(next(marked))
    return outs


def _without_unread_values(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` with each marker's operand-result pairs whose result nothing reads
    removed (a layer's start marker carried every row of a split input), and the
    equations whose results nothing reads."""
    jaxpr = closed.jaxpr
    live = {v for v in jaxpr.outvars if is_var(v)}
    eqns: list = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive is pipeline_p and len(eqn.invars) == len(eqn.outvars):
            pairs = [(a, b) for a, b in zip(eqn.invars, eqn.outvars, strict=True) if b in live]
            if len(pairs) != len(eqn.invars):
                eqn = eqn.replace(invars=[a for a, _ in pairs], outvars=[b for _, b in pairs])
        elif not eqn.effects and not any(v in live for v in eqn.outvars):
            continue  # dead: a zero or a row's leading axis nothing reads any more
        live.update(v for v in eqn.invars if is_var(v))
        eqns.append(eqn)
    eqns.reverse()
    new = new_jaxpr(jaxpr, jaxpr.constvars, jaxpr.invars, jaxpr.outvars, eqns)
    return ClosedJaxpr(new, closed.consts)


def _count(split: dict, i: int) -> int:
    """The number of leaves leaf ``i`` is split into (1 when it is not)."""
    bounds = split.get(i)
    return 1 if bounds is None else len(bounds) - 1


def _split_step(
    traced: TracedStep, closed: ClosedJaxpr, in_rows: dict, out_rows: dict, prepare=None
):
    """The :class:`TracedStep` of the rewritten program: per-leaf fields repeated per
    part, the trees with a tuple of parts in place of each split leaf."""

    def per_row(values: Sequence) -> tuple:
        out: list = []
        for i, x in enumerate(values):
            out.extend([x] * _count(in_rows, i))
        return tuple(out)

    names = []
    for i, name in enumerate(traced.leaf_names):
        bounds = in_rows.get(i)
        if bounds is None:
            names.append(name)
            continue
        for a, b in zip(bounds, bounds[1:], strict=False):
            names.append(f"{name}[{a}]" if b - a == 1 else f"{name}[{a}:{b}]")

    def tree(treedef, split: dict, size: int):
        leaves = [tuple(range(_count(split, i))) if i in split else 0 for i in range(size)]
        return jax.tree.structure(jax.tree.unflatten(treedef, leaves))

    retrace = None
    if traced.retrace is not None:
        original_retrace = traced.retrace

        def retrace(d):
            again = original_retrace(d)
            if prepare is not None:
                again = prepare(again)
            new, _, rows_in, rows_out = _rewrite(again, in_rows)
            return _split_step(again, new, rows_in, rows_out, prepare)

    return dataclasses.replace(
        traced,
        closed_jaxpr=closed,
        in_tree=tree(traced.in_tree, in_rows, len(traced.in_avals)),
        out_tree=tree(traced.out_tree, out_rows, len(traced.jaxpr.outvars)),
        in_avals=tuple(v.aval for v in closed.jaxpr.invars),
        batch_invars=per_row(traced.batch_invars),
        donated_invars=per_row(traced.donated_invars),
        leaf_names=tuple(names),
        grad_invars=per_row(traced.grad_invars) if traced.grad_invars else (),
        retrace=retrace,
    )
