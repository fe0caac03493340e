"""``StackedRows``: a stacked array held as parts on several meshes, usable as an array.

A pipeline that splits a stacked parameter between its stages (a scanned model's
``[L, ...]`` block parameters, ``pipeline_parallel.stacked_rows``) holds each stage's rows
on that stage's mesh. When one ``jax.sharding.NamedSharding`` can say where every row is,
the step returns the rows as one ``jax.Array`` (``runtime.stage_rows``). When none can
(stages of different sizes, or holding different numbers of rows, or sharding their rows
differently), it returns a :class:`StackedRows`: the parts as they are, each where its
stage reads it, and one value to the caller's code.

So that the caller's code runs on it as on an array, the type is registered with JAX and
with flax, and does arithmetic itself:

* **JAX.** Its abstract value is the whole array's ``ShapedArray``
  (``jax.experimental.hijax.register_hitype``), and a value that enters a computation
  (an argument of ``jax.jit``, an operand of an eager ``jnp`` function, a constant a traced
  function reads) is canonicalized to the whole array, its rows put together on the host
  (``jax.interpreters.xla.canonicalize_dtype_handlers``). ``jnp.asarray`` and
  ``np.asarray`` read it the same way. The result of such a computation is an ordinary
  ``jax.Array``.
* **Python arithmetic** (``0.9 * a + 0.1 * b`` in a ``jax.tree.map``, an optimizer's
  moments) with a scalar or with another ``StackedRows`` cut alike runs part by part and
  keeps every part on its mesh; with any other array it runs on the whole array.
  ``astype`` runs part by part; reductions and reshapes (``sum``, ``reshape``, ``T``, ...)
  on the whole array.
* **flax serialization** (``to_bytes``, ``to_state_dict``) sees the whole array on the
  host; ``from_state_dict`` into a ``StackedRows`` puts each part back where the target's
  part is. orbax's ``StandardCheckpointer`` writes it as the host array it reads as.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental.hijax import register_hitype

from alpa.jax_internals import ShapedArray, canonicalize_dtype_handlers


class StackedRows:
    """A stacked array (``[L, ...]``) held as its rows (``[...]`` each) or blocks of rows
    (``[n, ...]``), each on the mesh of the pipeline stage that reads it (module
    docstring). Pass it back to the step and each part stays where it is; use it as an
    array anywhere else.

    ``sizes`` gives the number of rows of each part (default: one each); a part of one
    row is held without the leading axis, a block of several with it. Every part has the
    same row shape and dtype."""

    is_stacked_rows = True
    # numpy's binary operators defer to ours (``np.float32(0.9) * rows``).
    __array_priority__ = 100

    def __init__(self, rows: Sequence[Any], sizes: Sequence[int] | None = None):
        rows = list(rows)
        if not rows:
            raise ValueError("StackedRows needs at least one row")
        sizes = tuple(sizes) if sizes is not None else (1,) * len(rows)
        if len(sizes) != len(rows) or any(
            isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1 for n in sizes
        ):
            raise ValueError(
                f"StackedRows: sizes={sizes} must give each of the {len(rows)} parts a "
                "number of rows >= 1 (one int per part)"
            )
        self.rows = rows
        self.sizes = tuple(int(n) for n in sizes)
        first = rows[0]
        self.dtype = np.dtype(first.dtype) if _is_numpy_dtype(first.dtype) else first.dtype
        row_shape = _row_shape(first, self.sizes[0], 0)
        for i, (part, n) in enumerate(zip(rows, self.sizes, strict=True)):
            shape = _row_shape(part, n, i)
            if shape != row_shape:
                raise ValueError(
                    f"StackedRows: part {i} has rows of shape {shape} (part shape "
                    f"{tuple(np.shape(part))}, sizes[{i}]={n}), but part 0 has rows of shape "
                    f"{row_shape}: every part must hold rows of one shape"
                )
            if part.dtype != first.dtype:
                raise ValueError(
                    f"StackedRows: part {i} has dtype {part.dtype}, part 0 has {first.dtype}: "
                    "every part must have one dtype"
                )
        self.shape = (sum(self.sizes), *row_shape)
        self.weak_type = bool(getattr(first, "weak_type", False))
        _register_with_flax()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    @property
    def aval(self) -> ShapedArray:
        return ShapedArray(self.shape, self.dtype, weak_type=self.weak_type)

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None):
        del copy
        parts = [
            np.asarray(r)[None] if n == 1 else np.asarray(r)
            for r, n in zip(self.rows, self.sizes, strict=True)
        ]
        out = np.concatenate(parts)
        return out if dtype is None else out.astype(dtype)

    def __jax_array__(self):
        # ``jnp.asarray(x)``: the rows are on several meshes, put together on the host.
        return jax.numpy.asarray(np.asarray(self))

    def __getitem__(self, index):
        return self.__jax_array__()[index]

    def _on_devices(self) -> bool:
        """Whether every part is a local array (arithmetic part by part can run on it)."""
        return all(isinstance(r, jax.Array | np.ndarray) for r in self.rows)

    def astype(self, dtype):
        if not self._on_devices():
            return self.__jax_array__().astype(dtype)
        return StackedRows([r.astype(dtype) for r in self.rows], self.sizes)

    @property
    def T(self):  # noqa: N802 (numpy's name)
        return self.__jax_array__().T

    def block_until_ready(self):
        for r in self.rows:
            jax.block_until_ready(r)
        return self

    def is_deleted(self) -> bool:
        return any(getattr(r, "is_deleted", lambda: False)() for r in self.rows)

    def delete(self) -> None:
        for r in self.rows:
            if hasattr(r, "delete"):
                r.delete()

    def __repr__(self) -> str:
        return (
            f"StackedRows(shape={self.shape}, dtype={self.dtype}, rows={len(self.rows)}"
            + ("" if set(self.sizes) == {1} else f", sizes={self.sizes}")
            + ")"
        )


def _is_numpy_dtype(dtype) -> bool:
    try:
        np.dtype(dtype)
    except TypeError:
        return False
    return True


def _row_shape(part, n: int, i: int) -> tuple:
    shape = tuple(np.shape(part))
    if n == 1:
        return shape
    if not shape or shape[0] != n:
        raise ValueError(
            f"StackedRows: part {i} has shape {shape} but sizes[{i}]={n}: a part of n > 1 "
            "rows is a block with a leading axis of n"
        )
    return shape[1:]


# ----------------------------------------------------------------------------- arithmetic


def _binary(op: Callable, swap: bool = False) -> Callable:
    """The operator ``op`` on a ``StackedRows`` (``swap``: the reflected one): part by part
    with a scalar or a ``StackedRows`` cut alike (the parts stay on their meshes), else
    on the whole array."""

    def method(self: StackedRows, other):
        if isinstance(other, StackedRows):
            if other.sizes == self.sizes and self._on_devices() and other._on_devices():
                pairs = zip(self.rows, other.rows, strict=True)
                rows = [op(b, a) if swap else op(a, b) for a, b in pairs]
                return StackedRows(rows, self.sizes)
            other = other.__jax_array__()
        elif not _is_operand(other):
            return NotImplemented
        elif np.ndim(other) == 0 and self._on_devices():
            other = _scalar(other)
            return StackedRows(
                [op(other, r) if swap else op(r, other) for r in self.rows], self.sizes
            )
        whole = self.__jax_array__()
        return op(other, whole) if swap else op(whole, other)

    return method


def _scalar(x):
    """A scalar operand that every part can read wherever it is: a JAX scalar (on some
    device) as a Python number when weakly typed, else a numpy scalar of its dtype (the
    same type promotion)."""
    if isinstance(x, jax.Array):
        value = np.asarray(x)
        return value.item() if x.weak_type else value[()]
    return x


def _is_operand(x) -> bool:
    return isinstance(x, int | float | complex | np.generic | np.ndarray | jax.Array)


def _unary(op: Callable) -> Callable:
    def method(self: StackedRows):
        return StackedRows([op(r) for r in self.rows], self.sizes)

    return method


def _on_whole(name: str) -> Callable:
    def method(self: StackedRows, *args, **kwargs):
        return getattr(self.__jax_array__(), name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"``{name}`` of the whole array (its rows put together)."
    return method


#: Python's binary operators, by the name of their method.
_BINARY_OPERATORS = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "pow": operator.pow,
}
_COMPARISONS = {
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
}
_UNARY_OPERATORS = {"neg": operator.neg, "pos": operator.pos, "abs": operator.abs}
#: Array methods that read the whole array: reductions, reshapes, products.
_WHOLE_ARRAY_METHODS = (
    "all any argmax argmin clip conj copy dot flatten item max mean min prod ravel "
    "reshape round squeeze std sum tolist transpose var"
).split()

for _name, _op in _BINARY_OPERATORS.items():
    setattr(StackedRows, f"__{_name}__", _binary(_op))
    setattr(StackedRows, f"__r{_name}__", _binary(_op, swap=True))
for _name, _op in _COMPARISONS.items():
    setattr(StackedRows, f"__{_name}__", _binary(_op))
for _name, _op in _UNARY_OPERATORS.items():
    setattr(StackedRows, f"__{_name}__", _unary(_op))
StackedRows.__matmul__ = _binary(operator.matmul)  # never part by part: the whole array
for _name in _WHOLE_ARRAY_METHODS:
    setattr(StackedRows, _name, _on_whole(_name))


# ----------------------------------------------------------------------------- registration


# JAX: the abstract value of the whole array; a concrete value is the whole array on
# the host. ``register_hitype`` records the abstract value (and an identity
# canonicalization, replaced here by the conversion).
register_hitype(StackedRows, lambda x: x.aval)
canonicalize_dtype_handlers[StackedRows] = np.asarray

_flax_registered = False


def _register_with_flax() -> None:
    """Register with flax's serialization, once (when the first ``StackedRows`` is made:
    flax is imported only by what uses it)."""
    global _flax_registered
    if _flax_registered:
        return
    from flax import serialization

    serialization.register_serialization_state(StackedRows, _to_state_dict, _from_state_dict)
    _flax_registered = True


def _to_state_dict(x: StackedRows) -> np.ndarray:
    return np.asarray(x)


def _from_state_dict(target: StackedRows, state: Any) -> Any:
    """``state`` (the whole array) cut into ``target``'s parts, each put where the
    target's part is (a host array where a part is not a ``jax.Array``)."""
    state = np.asarray(state)
    if state.shape != target.shape:
        raise ValueError(
            f"restoring a StackedRows of shape {target.shape} from an array of shape {state.shape}"
        )
    if not all(isinstance(r, jax.Array) for r in target.rows):
        return state
    parts = stacked_parts(state, target.sizes)
    placed = [jax.device_put(p, r.sharding) for p, r in zip(parts, target.rows, strict=True)]
    return StackedRows(placed, target.sizes)


def stacked_parts(value: Any, sizes: Sequence[int]) -> list:
    """``value`` (``[sum(sizes), ...]``) cut into parts of ``sizes`` rows: a part of one
    row without the leading axis (``value[a]``), a block with it (``value[a:b]``)."""
    parts, start = [], 0
    for n in sizes:
        parts.append(value[start] if n == 1 else value[start : start + n])
        start += n
    return parts
