"""The public entry points: ``parallelize``, ``grad`` (``init`` / ``shutdown`` are in
``alpa.cluster``, re-exported here).

``parallelize`` wraps a step function. On each call it sorts the positional arguments into
static ones (hashable Python values, part of the compilation key) and dynamic ones (pytrees
of arrays), looks up an executable compiled for those shapes, dtypes and static values,
compiles one if there is none (trace -> plan -> lower -> XLA), and runs it. A second call
with the same shapes neither traces nor compiles.

Leaves are keyed as ``jax.jit`` keys them (``alpa.tracing.leaf_signature``): a Python
scalar is a weakly typed array, so ``TrainState.create``'s ``step=0`` and the ``step`` array
the first call returns are the same key, and the step compiles once.

A call that looks like the last one takes a fast path, straight to the last executable
(:mod:`alpa.call_cache`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from alpa import cluster
from alpa.call_cache import MISS, CacheHit
from alpa.call_checks import (
    CompileWarnings,
    DonationLog,
    batch_argnums_phrase,
    check_batch_is_not_differentiated,
    check_batch_is_not_state,
    check_concrete,
    check_not_deleted,
    check_not_shut_down,
    check_static_args,
    is_train_state,
    reused_donation_error,
)
from alpa.cluster import (  # noqa: F401 (alpa.api.init etc., as in Alpa)
    get_global_physical_mesh,
    get_global_virtual_physical_mesh,
    init,
    shutdown,
)
from alpa.executables.base import Executable
from alpa.jax_internals import ShapedArray
from alpa.methods.shard_method import ParallelMethod, ShardParallel
from alpa.pipeline_parallel.layers.layer_construction import mark_layers
from alpa.pipeline_parallel.layers.segments import reuse_cuts
from alpa.shard_parallel.strategies.data_parallel import rows_per_example
from alpa.timer import timed
from alpa.tracing import TracedStep, abstractify, leaf_signature, note_grad_inputs, trace_step
from alpa.tracing.primitive_def import mark_pipeline_jaxpreqn

logger = logging.getLogger("alpa")

# ----------------------------------------------------------------------------- gradients


def value_and_grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    reduce_axes: Sequence[Any] = (),
) -> Callable:
    """``jax.value_and_grad`` that also marks where the gradients are complete.

    The marker cuts the traced step into compute-grad (everything the gradients need)
    and apply-grad (the rest), which gradient accumulation and pipelining rely on.
    Before differentiating, ``fun``'s ``mark_pipeline_boundary()`` cuts become layer
    markers on the values that cross them (``layer_construction.mark_layers``), so the
    backward pass carries the mirrored cuts.
    """
    del reduce_axes
    inner = jax.value_and_grad(
        mark_layers(fun),
        argnums=argnums,
        has_aux=has_aux,
        holomorphic=holomorphic,
        allow_int=allow_int,
    )

    @functools.wraps(fun)
    def marked(*args, **kwargs):
        # Which step inputs are differentiated, for parallelize's checks of batch_argnums.
        positions = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        note_grad_inputs([args[i] for i in positions if -len(args) <= i < len(args)])
        out = inner(*args, **kwargs)
        leaves, tree = jax.tree.flatten(out)
        return jax.tree.unflatten(tree, mark_pipeline_jaxpreqn(leaves, "grad", "grad"))

    return marked


def grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    reduce_axes: Sequence[Any] = (),
) -> Callable:
    """``jax.grad`` that marks the gradients (see :func:`value_and_grad`)."""
    inner = value_and_grad(fun, argnums, has_aux, holomorphic, allow_int, reduce_axes)

    @functools.wraps(fun)
    def marked(*args, **kwargs):
        value, grads = inner(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return marked


# ----------------------------------------------------------------------------- parallelize


#: Every live ParallelizedFunc, for :func:`clear_executable_cache`.
_all_parallelized: weakref.WeakSet = weakref.WeakSet()


def clear_executable_cache() -> None:
    """Forget every compiled executable of every parallelized function (the next call
    compiles again)."""
    for f in list(_all_parallelized):
        f._cache.clear()
        f._hit = None
        f._last_executable = None


def parallelize(
    fun: Callable | None = None,
    *,
    static_argnums: Sequence[int] | str = "auto",
    donate_argnums: Sequence[int] | str = "auto",
    batch_argnums: Sequence[int] | None = None,
    method: ParallelMethod | None = None,
):
    """Parallelize a step function; usable as ``@parallelize`` or ``@parallelize(...)``.

    Args:
      fun: the step, written as for one device.
      static_argnums: positions of arguments that are compile-time constants, or
        ``"auto"``: Python scalars and strings, and arguments with no array inside.
      donate_argnums: positions whose buffers the step may reuse, or ``"auto"``: every
        flax ``TrainState`` argument. A donated argument is used up: passing it to a later
        call is an error that names it (pass what the call returned).
      batch_argnums: positions of the batch arguments: split on dim 0 over devices and
        into micro-batches. Default: ``(1,)`` (Alpa's ``train_step(state, batch)``) for a
        call with two or more positional arguments whose argument 1 is not in
        ``static_argnums``, none otherwise. A ``TrainState``, or an argument whose every
        leaf ``alpa.grad`` differentiates, is refused as a batch: it is the parameters.
      method: a :class:`~alpa.parallel_method.ParallelMethod`; default ``ShardParallel()``.
    """

    def decorate(f):
        if not callable(f):
            raise TypeError(f"parallelize expects a callable fun, got {type(f).__name__}: {f!r}")
        if method is not None and not isinstance(method, ParallelMethod):
            raise TypeError(
                "method must be a parallel method such as alpa.ShardParallel(), "
                "alpa.DataParallel() or alpa.PipeshardParallel(), got "
                f"{type(method).__name__}: {method!r}"
            )
        _check_argnums(static_argnums, "static_argnums")
        _check_argnums(donate_argnums, "donate_argnums")
        if batch_argnums is not None:
            _check_argnums(batch_argnums, "batch_argnums", allow_auto=False)
        return ParallelizedFunc(
            f,
            static_argnums,
            donate_argnums,
            None if batch_argnums is None else tuple(batch_argnums),
            method or ShardParallel(),
        )

    if fun is None:
        return decorate
    return decorate(fun)


def _check_argnums(value, name: str, allow_auto: bool = True) -> None:
    if allow_auto and value == "auto":
        return
    if isinstance(value, int) and not isinstance(value, bool):
        raise TypeError(f"{name} must be a tuple of ints, got the int {value}; write ({value},)")
    if (
        not isinstance(value, Sequence)
        or isinstance(value, str)
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    ):
        expected = "'auto' or a tuple of ints" if allow_auto else "a tuple of ints"
        raise TypeError(f"{name} must be {expected}, got {value!r}")


def _is_array_leaf(x) -> bool:
    return (
        isinstance(
            x,
            jax.Array
            | np.ndarray
            | np.generic
            | jax.ShapeDtypeStruct
            | bool
            | int
            | float
            | complex,
        )
        or getattr(x, "is_distributed_array", False)
        or getattr(x, "is_stacked_rows", False)  # a pipeline's rows on their meshes
        or _is_aval(x)
    )


def _is_aval(x) -> bool:
    """A ``jax.core.ShapedArray``-like abstract value (what ``jax.typeof`` returns)."""
    return isinstance(x, ShapedArray)


def _function_name(fun: Callable) -> str:
    """A name for messages: ``fun.__name__``, or for a ``functools.partial`` (which has
    none, and which Alpa's programs parallelize) its function's, or the type's."""
    while isinstance(fun, functools.partial):
        fun = fun.func
    return getattr(fun, "__name__", type(fun).__name__)


class ParallelizedFunc:
    """A parallelized step. Calling it compiles (once per input signature) and runs."""

    def __init__(
        self, fun: Callable, static_argnums, donate_argnums, batch_argnums, method: ParallelMethod
    ):
        self.fun = fun
        self.static_argnums = static_argnums
        self.donate_argnums = donate_argnums
        self.batch_argnums = batch_argnums
        self.method = method
        self._cache: dict[Any, Executable] = {}
        self._last_executable: Executable | None = None
        self._hit: CacheHit | None = None
        self._donations = DonationLog()
        self.name = _function_name(fun)
        self._warnings = CompileWarnings(self.name)
        functools.update_wrapper(self, fun)
        _all_parallelized.add(self)

    # -- argument handling

    def _resolve_argnums(self, args: Sequence[Any]):
        n = len(args)
        static = None
        if self.static_argnums != "auto":
            static = self._positions(self.static_argnums, n, "static_argnums")
            check_static_args(self.name, args, static, self.static_argnums)
        batch_argnums = self.batch_argnums
        if batch_argnums is None:  # the default: Alpa's (1,), when there is an argument 1
            # that the user did not make static
            batch_argnums = (1,) if n >= 2 and 1 not in (static or ()) else ()
        elif tuple(batch_argnums) == (1,) and n == 1:
            # Alpa's default written out (its programs pass it to one-argument functions
            # too): no batch argument, as in Alpa.
            batch_argnums = ()
        for pos in batch_argnums:
            if not -n <= pos < n:
                raise ValueError(
                    f"batch_argnums={batch_argnums} is out of range for a call of "
                    f"{self.name} with {n} positional arguments"
                )
        batch = tuple(sorted(p % n for p in batch_argnums))
        phrase = batch_argnums_phrase(self.batch_argnums)
        check_batch_is_not_state(self.name, args, batch, phrase)
        if static is None:
            static = tuple(i for i, a in enumerate(args) if i not in batch and _is_auto_static(a))
        if self.donate_argnums == "auto":
            donate = tuple(i for i, a in enumerate(args) if is_train_state(a))
        else:
            donate = self._positions(self.donate_argnums, n, "donate_argnums")
        overlap = set(static) & (set(donate) | set(batch))
        if overlap:
            raise ValueError(
                f"arguments {sorted(overlap)} are static, so they cannot also "
                "be batch or donated arguments"
            )
        return static, batch, tuple(d for d in donate if d not in static)

    def _positions(self, argnums, n: int, name: str) -> tuple[int, ...]:
        for pos in argnums:
            if not -n <= pos < n:
                raise ValueError(
                    f"{name}={tuple(argnums)} is out of range for a call of "
                    f"{self.name} with {n} positional arguments"
                )
        return tuple(sorted(p % n for p in argnums))

    def _flatten(self, args, static):
        leaves, names = [], []
        for i, arg in enumerate(args):
            if i in static:
                try:
                    hash(arg)
                except TypeError:
                    raise TypeError(
                        f"argument {i} of {self.name} is static (static_argnums) but "
                        f"not hashable: {type(arg).__name__}"
                    ) from None
                continue
            for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
                name = f"argument {i}{jax.tree_util.keystr(path)}"
                if not _is_array_leaf(leaf):
                    raise TypeError(
                        f"{name} of {self.name} is a {type(leaf).__name__}, not an "
                        "array: dynamic arguments must be pytrees of arrays. Mark the "
                        "argument static with static_argnums, or remove the leaf."
                    )
                leaves.append(leaf)
                names.append(name)
        return leaves, names

    def _check_micro_batches(self, args, batch) -> int:
        k = self.method.num_micro_batches or 1
        rows = leaves_with_rows(args, batch)
        for pos in batch:
            leaves = jax.tree_util.tree_flatten_with_path(args[pos])[0]
            for (path, leaf), with_rows in zip(leaves, rows[pos], strict=True):
                shape = np.shape(leaf)
                where = f"argument {pos}{jax.tree_util.keystr(path)}"
                if not shape:
                    raise ValueError(
                        f"{where} is a batch argument but is a scalar; batch "
                        "leaves need a batch dimension 0"
                    )
                if with_rows and shape[0] % k:
                    raise ValueError(
                        f"num_micro_batches={k} does not divide batch size {shape[0]} of {where}"
                    )
        return k

    # -- compilation

    def _compile(self, args) -> tuple[Executable, list, tuple[int, ...]]:
        static, batch, donate = self._resolve_argnums(args)
        leaves, names = self._flatten(args, static)
        key = (
            tuple((i, args[i]) for i in static),
            jax.tree.structure(tuple(a for i, a in enumerate(args) if i not in static)),
            tuple(leaf_signature(x) for x in leaves),
            batch,
            donate,
            self._cluster_generation(),
        )
        executable = self._cache.get(key)
        if executable is None:
            self._warnings.on_compile(
                self.method, args, static, self.batch_argnums, self.static_argnums
            )
            k = self._check_micro_batches(args, batch)
            traced = self._trace(args, static, batch, donate, names, k)
            executable = self.method.compile_executable(traced, traced_args(args, batch, k))
            self._cache[key] = executable
        self._last_executable = executable
        return executable, leaves, static

    def _cluster_generation(self) -> int | None:
        """The global cluster's generation when the method runs on it (no ``devices`` of
        its own): after ``alpa.shutdown()`` and another ``init`` the step is compiled
        again, for the new cluster, never run on the old one's devices."""
        return cluster.generation() if getattr(self.method, "devices", None) is None else None

    def _trace(self, args, static, batch, donate, names, k: int) -> TracedStep:
        cuts: dict = {}  # the layer clustering's cuts, shared with the retraces
        traces: dict = {}  # divisor -> its trace: every pass asking for one shares it
        rows = leaves_with_rows(args, batch)
        # The retraces outlive the call (the executable keeps them): they hold the
        # arguments' shapes, never the arrays, which the caller may let go.
        shapes = abstract_args(args, static)

        def trace_at(divisor: int) -> TracedStep:
            if divisor in traces:
                return traces[divisor]
            try:
                traces[divisor] = trace_once(divisor)
            except Exception as e:
                # The first trace's error, or a retrace's (a pass asking for the step at
                # another batch size): either says what alpa split as the batch.
                notes = getattr(e, "__notes__", ())
                if batch and not any(n.startswith("alpa traced ") for n in notes):
                    e.add_note(self._batch_note(shapes, batch, k, divisor))
                raise
            return traces[divisor]

        def trace_once(divisor) -> TracedStep:
            abstract = traced_args(shapes, batch, divisor)
            # The method's options that act while tracing (PipeshardParallel's layer
            # option, read by alpa.grad's layer rewrite) hold for every (re)trace, and
            # a retrace cuts the layers where the first trace did.
            with self.method.trace_context(), reuse_cuts(cuts), timed("tracing"):
                traced = trace_step(self.fun, abstract, static, batch, donate, names)
            # A batch leaf without a row per example is read whole: not the batch.
            with_rows = [
                r
                for i in traced.dynamic_argnums
                for r in rows.get(i, [False] * len(jax.tree.leaves(shapes[i])))
            ]
            traced = dataclasses.replace(
                traced,
                batch_invars=tuple(
                    b and r for b, r in zip(traced.batch_invars, with_rows, strict=True)
                ),
            )
            traced = dataclasses.replace(traced, retrace=lambda d: trace_at(divisor * d))
            return self.method.finish_trace(traced)

        traced = trace_at(k)
        check_batch_is_not_differentiated(traced, batch_argnums_phrase(self.batch_argnums))
        return traced

    def _batch_note(self, args, batch, k: int, divisor=None) -> str:
        """What alpa split as the batch, for an error raised while tracing (``k``
        micro-batches; at ``divisor``, a retrace at another batch size): a call whose
        arguments are in another order than ``batch_argnums`` says shows there."""
        split = []
        for pos in batch:
            leaves = jax.tree_util.tree_flatten_with_path(args[pos])[0]
            if not leaves:
                continue
            path, leaf = leaves[0]
            rows = np.shape(leaf)[0]
            where = f"argument {pos}{jax.tree_util.keystr(path)}"
            more = f" and {len(leaves) - 1} more leaves" if len(leaves) > 1 else ""
            per = f" ({rows // k} rows per micro-batch)" if k > 1 else ""
            if divisor is not None and divisor != k:
                per = f" (traced again with {int(rows / divisor)} rows)"
            split.append(f"{where} (dim 0 of {rows}){more}{per}")
        return (
            f"alpa traced {self.name} with {', '.join(split)} as the batch "
            f"({batch_argnums_phrase(self.batch_argnums)}); if the arguments are in another "
            "order, pass the batch's position as batch_argnums"
        )

    # -- public

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise TypeError(
                f"{self.name} was parallelized: pass its arguments "
                f"positionally (got keyword arguments {sorted(kwargs)})"
            )
        reused = self._donations.find_deleted(args)
        if reused is not None:
            raise reused_donation_error(self.name, reused, args[reused], self.donate_argnums)
        hit = self._hit
        if hit is not None:
            out = hit(args)
            if out is not MISS:
                self._donations.record(args, hit.donated)
                return out
        executable, leaves, static = self._compile(args)
        check_not_deleted(self.name, leaves, lambda: self._flatten(args, static)[1])
        check_not_shut_down(self.name, leaves, lambda: self._flatten(args, static)[1])
        check_concrete(self.name, leaves, lambda: self._flatten(args, static)[1])
        placing = hit is not None and hit.executable is executable
        outs = executable.launch(leaves)
        # The next call that looks like this one skips the key; if this executable's
        # dispatch just refused these arguments, its inputs arrive elsewhere: place first.
        self._hit = CacheHit(
            args, static, self.static_argnums == "auto", executable, placing,
            self._cluster_generation(),
        )  # fmt: skip
        self._donations.record(args, self._hit.donated)
        return jax.tree.unflatten(executable.traced.out_tree, outs)

    def get_executable(self, *args) -> Executable:
        """Compile for these arguments (arrays or ``jax.ShapeDtypeStruct``) without
        running."""
        return self._compile(args)[0]

    def plan(self, *args):
        """The method's plan for these arguments (arrays or ``jax.ShapeDtypeStruct``)
        without compiling or running anything: a ``PipeshardPlan`` for
        ``PipeshardParallel``, a ``ShardingPlan`` otherwise. The method's ``devices`` may
        be a cluster that is not here (a ``VirtualPhysicalMesh``, a ``ClusterSpec`` or a
        ``LogicalDeviceMesh`` without devices: ``alpa.resolved_cluster``)."""
        static, batch, donate = self._resolve_argnums(args)
        _, names = self._flatten(args, static)
        k = self._check_micro_batches(args, batch)
        traced = self._trace(args, static, batch, donate, names, k)
        return self.method.plan(traced, traced_args(args, batch, k))

    def get_last_executable(self) -> Executable:
        if self._last_executable is None:
            raise RuntimeError(f"{self.name} has not been called or compiled yet")
        return self._last_executable

    def preshard_dynamic_args(self, *args):
        """Place the dynamic arguments where the executable wants them; returns the
        arguments with the dynamic ones replaced by placed arrays."""
        executable, leaves, static = self._compile(args)
        placed = iter(executable.preshard_flat_args(leaves))
        out = []
        for i, arg in enumerate(args):
            if i in static:
                out.append(arg)
            else:
                out.append(jax.tree.map(lambda _: next(placed), arg))
        return tuple(out)


def _is_auto_static(arg) -> bool:
    if isinstance(arg, bool | int | float | str):
        return True
    if is_train_state(arg):
        return False
    leaves = jax.tree.leaves(arg)
    return not any(_is_array_leaf(x) for x in leaves)


def abstract_args(args, static: Sequence[int]) -> list:
    """``args`` with every leaf of a dynamic argument as a ``jax.ShapeDtypeStruct`` (its
    ``NamedSharding`` kept, which tracing reads), the static ones as they are."""

    def struct(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        aval = abstractify(x)
        sharding = getattr(x, "sharding", None)
        sharding = sharding if isinstance(sharding, NamedSharding) else None
        return jax.ShapeDtypeStruct(
            aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=sharding
        )

    return [a if i in static else jax.tree.map(struct, a) for i, a in enumerate(args)]


def traced_args(args, batch: Sequence[int], divisor: int) -> list:
    """Arguments for tracing: dynamic ones abstract, the batch leaves with a row per
    example (:func:`leaves_with_rows`) with dim 0 divided. A batch leaf the caller placed
    with a ``NamedSharding`` keeps it where its shape stays (one micro-batch): the plan
    takes it as placed (``placed_input_specs``), as any other argument."""
    out = list(args)
    rows = leaves_with_rows(args, batch)
    for i in batch:
        leaves, tree = jax.tree.flatten(args[i])
        shapes = []
        for x, with_rows in zip(leaves, rows[i], strict=True):
            aval = abstractify(x)
            shape = tuple(aval.shape)
            sharding = getattr(x, "sharding", None)
            if with_rows and divisor != 1:
                shape, sharding = (shape[0] // divisor, *shape[1:]), None
            if not isinstance(sharding, NamedSharding):
                sharding = None
            shapes.append(
                jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type, sharding=sharding)
            )
        out[i] = jax.tree.unflatten(tree, shapes)
    return out


def leaves_with_rows(args, batch: Sequence[int]) -> dict[int, list[bool]]:
    """Per batch argument, per leaf, whether it holds a row per example: its dim 0 is the
    batch's size (``data_parallel.most_common_rows`` of the batch leaves' dim 0). A
    batch leaf with another dim 0 (a PRNG key's data, ``uint32[2]``, in the batch dict)
    is not cut into micro-batches: every micro-batch reads it whole, and the step treats
    it as an input that is not the batch (replicated by the fixed plans)."""
    sizes = {
        i: [np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(args[i])] for i in batch
    }
    flags = iter(rows_per_example([d for ds in sizes.values() for d in ds]))
    return {i: [next(flags) for _ in ds] for i, ds in sizes.items()}
