"""Checks of a parallelized call: argument mistakes named in the user's terms.

``alpa.parallelize`` sorts a step's positional arguments into static, batch and donated
ones. A mistake in that sorting is legal Python and often traces: the parameters split
on dim 0 as if they were the batch, a state whose buffers an earlier call took, an array
where a hashable constant belongs. Left alone it fails far from its cause (a shape error
in a plan, XLA's "Array has been deleted", a crash), or never fails and only wastes (a
batch nothing splits, a recompile per call). Each check here names the argument, says why
it is wrong and how to fix it:

* :func:`check_static_args`: an array in ``static_argnums``;
* :func:`check_batch_is_not_state` / :func:`check_batch_is_not_differentiated`: the
  parameters in a batch position. A flax ``TrainState`` is never a batch; nor is an
  argument whose every leaf ``alpa.grad`` differentiates (``TracedStep.grad_invars``).
  Input gradients of a real batch (adversarial training) differentiate one leaf of it,
  so an argument of one leaf is left alone: the rule never fires on a real batch;
* :class:`DonationLog`: an argument donated to an earlier call, passed again;
* :func:`check_not_shut_down`: a Ray ``DistributedArray`` whose mesh was shut down;
* :class:`CompileWarnings`: warnings, once per parallelized function, about what makes
  compiles wasteful.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from alpa.jax_internals import ShapedArray
from alpa.tracing import TracedStep

#: Distinct values of a static Python number after which a warning says it recompiles.
RECOMPILE_WARN_VALUES = 3


def is_train_state(x) -> bool:
    from flax.training.train_state import TrainState

    return isinstance(x, TrainState)


def _arrays_in(arg) -> list:
    return [
        x
        for x in jax.tree.leaves(arg)
        if isinstance(x, jax.Array | np.ndarray) or getattr(x, "is_distributed_array", False)
    ]


# ----------------------------------------------------------------------------- argnums


def check_static_args(name: str, args, static: Sequence[int], static_argnums) -> None:
    """An array is no static argument: it is not hashable, and as a compile-time
    constant it would compile the step again for every new value."""
    for pos in static:
        arrays = _arrays_in(args[pos])
        if not arrays:
            continue
        what = jax.typeof(arrays[0]).str_short()
        if len(jax.tree.leaves(args[pos])) > 1:
            what = f"a {type(args[pos]).__name__} holding {what} and more"
        raise TypeError(
            f"argument {pos} of {name} is in static_argnums={tuple(static_argnums)} but is "
            f"an array ({what}): arrays cannot be static, as they are not hashable and a "
            f"static value compiles the step again for every new value; remove {pos} from "
            "static_argnums"
        )


def batch_argnums_phrase(batch_argnums: tuple[int, ...] | None) -> str:
    """How the batch positions were chosen, in the words of ``parallelize``'s argument."""
    if batch_argnums is None:
        return "batch_argnums=(1,), the default for a call with two or more arguments"
    return f"batch_argnums={batch_argnums}"


def check_batch_is_not_state(name: str, args, batch: Sequence[int], phrase: str) -> None:
    """A ``TrainState`` in a batch position is the parameters in the batch's place
    (``train_step(batch, state)``, or ``batch_argnums`` off by one)."""
    for pos in batch:
        if not is_train_state(args[pos]):
            continue
        others = [
            i for i, a in enumerate(args) if i != pos and not is_train_state(a) and _arrays_in(a)
        ]
        fix = f"batch_argnums=({others[0]},)" if len(others) == 1 else "batch_argnums="
        raise ValueError(
            f"argument {pos} of {name} is a batch argument ({phrase}) but it is a flax "
            "TrainState, which holds the parameters: they would be split on dim 0 as a "
            f"batch. Name the position of the batch with {fix}"
        )


def check_batch_is_not_differentiated(traced: TracedStep, phrase: str) -> None:
    """A batch argument of several leaves that ``alpa.grad`` differentiates, every one,
    is the parameters in the batch's place."""
    if not traced.grad_invars:
        return
    start = 0
    for pos, subtree in zip(traced.dynamic_argnums, traced.in_tree.children(), strict=True):
        span = range(start, start + subtree.num_leaves)
        start += subtree.num_leaves
        if (
            len(span) > 1
            and traced.batch_invars[span[0]]
            and all(traced.grad_invars[i] for i in span)
        ):
            raise ValueError(
                f"argument {pos} of {traced.name} is a batch argument ({phrase}) but "
                "alpa.grad differentiates every one of its leaves, so it looks like the "
                "parameters: they would be split on dim 0 as a batch. Name the position "
                "of the batch with batch_argnums="
            )


# ----------------------------------------------------------------------------- donation


def is_deleted(x) -> bool:
    deleted = getattr(x, "is_deleted", None)
    return deleted is not None and deleted()


class DonationLog:
    """The arguments donated to earlier calls that are still alive, so that passing one
    again is named as the mistake it is. Without it the call fails with XLA's "Array has
    been deleted", or, for an input donated on several devices, crashes the process (jax
    0.10 on CPU, also under ``jax.jit``).

    An argument is matched by identity and counts only if a leaf of it is deleted: a
    donation whose buffers were copies (an input placed first; the pipeshard runtime)
    leaves the argument usable. Arguments are held weakly, in an ``id``-keyed
    ``WeakValueDictionary``, so an entry dies with its argument and an ``id`` is never
    matched to a later object; one that cannot be weakly referenced (a dict) is held
    until the next call. A training loop (``state = step(state, batch)``) drops each
    state as it goes, so the log stays empty and a call pays one emptiness test.
    """

    __slots__ = ("_alive", "_last")

    def __init__(self):
        self._alive: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._last: dict[int, Any] = {}

    def record(self, args, positions: Sequence[int]) -> None:
        self._last = {}
        for pos in positions:
            arg = args[pos]
            try:
                self._alive[id(arg)] = arg
            except TypeError:
                self._last[id(arg)] = arg

    def find_deleted(self, args) -> int | None:
        """The position of an argument donated before whose arrays are deleted."""
        if not self._alive and not self._last:
            return None
        for pos, arg in enumerate(args):
            key = id(arg)
            if (self._alive.get(key) is arg or self._last.get(key) is arg) and any(
                is_deleted(x) for x in jax.tree.leaves(arg)
            ):
                return pos
        return None


def reused_donation_error(name: str, pos: int, arg, donate_argnums) -> ValueError:
    what = "a TrainState" if is_train_state(arg) else f"a {type(arg).__name__}"
    if donate_argnums == "auto":
        why = (
            "donate_argnums='auto' donates TrainState arguments, so that the step updates "
            "the state in place"
        )
    else:
        why = f"donate_argnums={tuple(donate_argnums)} donates it"
    return ValueError(
        f"argument {pos} ({what}) of {name} was donated to an earlier call of {name}, whose "
        f"outputs reused its buffers, so its arrays are deleted: {why}. Pass what that call "
        f"returned instead (state = {name}(state, ...)), or parallelize with "
        "donate_argnums=() to keep the arguments alive (at the cost of memory)"
    )


def check_not_deleted(name: str, leaves: Sequence[Any], leaf_names: Callable[[], list]) -> None:
    """A deleted input (donated to another step, or deleted by hand) is named here; XLA
    would fail on it with no word of which argument it is. ``leaf_names()`` gives the
    leaves' names (computed only for the message)."""
    if not any(is_deleted(x) for x in leaves):
        return
    leaf = next(n for n, x in zip(leaf_names(), leaves, strict=True) if is_deleted(x))
    raise ValueError(
        f"{leaf} of {name} is a deleted array: its buffer was donated to an earlier call of "
        "a parallelized step (donate_argnums) or deleted. Pass the value that call returned "
        "instead"
    )


def check_not_shut_down(name: str, leaves: Sequence[Any], leaf_names: Callable[[], list]) -> None:
    """A Ray ``DistributedArray`` whose mesh was shut down (and that was not fetched
    before) holds no data any more: named here, with what lived where and what to do,
    where JAX would say only that it is not a valid JAX type."""
    for i, x in enumerate(leaves):
        mesh = getattr(x, "mesh", None)  # a replicated array has one per mesh, checked there
        if not getattr(x, "is_distributed_array", False) or mesh is None:
            continue
        if getattr(x, "_fetched", None) is None and mesh.is_shut_down:
            try:
                x._check()
            except RuntimeError as e:
                raise RuntimeError(f"{leaf_names()[i]} of {name}: {e}") from None


def check_concrete(name: str, leaves: Sequence[Any], leaf_names: Callable[[], list]) -> None:
    """An abstract input (``jax.ShapeDtypeStruct``, ``jax.core.ShapedArray``) runs only as
    dummy values, under ``global_config.use_dummy_value_for_benchmarking`` (Alpa's
    benchmarks compile and time a step on a state they never allocate); otherwise it is
    named here, before anything is sent to a device or a worker."""
    from alpa.global_env import global_config

    abstract = (jax.ShapeDtypeStruct, ShapedArray)
    if global_config.use_dummy_value_for_benchmarking or not any(
        isinstance(x, abstract) for x in leaves
    ):
        return
    leaf, x = next(
        (n, x) for n, x in zip(leaf_names(), leaves, strict=True) if isinstance(x, abstract)
    )
    raise ValueError(
        f"{leaf} of {name} is abstract ({x}), without data: a step runs on arrays. "
        "get_executable(...) and plan(...) take abstract arguments; to run the step on dummy "
        "values made where it reads them (a benchmark's timing), set "
        "alpa.global_config.use_dummy_value_for_benchmarking = True"
    )


# ----------------------------------------------------------------------------- warnings


class CompileWarnings:
    """Warnings, once per parallelized function, about what makes a compile wasteful: a
    batch that nothing splits, a static Python number that keeps changing."""

    def __init__(self, name: str):
        self.name = name
        self._warned: set[Any] = set()
        # Per auto-static position, the Python numbers it has taken (each one compiled).
        self._static_numbers: dict[int, set] = {}

    def on_compile(self, method, args, static, batch_argnums, static_argnums) -> None:
        """Called before each new executable is compiled (``stacklevel`` points at the
        user's call through ``ParallelizedFunc.__call__`` / ``_compile``)."""
        if (
            batch_argnums == ()
            and getattr(method, "splits_only_the_batch", False)
            and self._once("no batch")
        ):
            warnings.warn(
                f"{self.name} is parallelized with {type(method).__name__} and "
                "batch_argnums=(): no argument is split, so every device computes the whole "
                "batch. Name the batch's position, e.g. batch_argnums=(1,)",
                UserWarning,
                stacklevel=4,
            )
        if static_argnums != "auto":
            return
        for pos in static:
            value = args[pos]
            if type(value) not in (int, float, complex):  # bool and str have few values
                continue
            seen = self._static_numbers.setdefault(pos, set())
            seen.add((type(value), value))
            if len(seen) >= RECOMPILE_WARN_VALUES and self._once(("static", pos)):
                warnings.warn(
                    f"argument {pos} of {self.name} is a Python {type(value).__name__}, "
                    f"hence static (static_argnums='auto'), and has taken {len(seen)} "
                    "values: each new value compiles the step again. Pass it as an array "
                    f"(jnp.asarray({value!r})), or list the static positions with "
                    f"static_argnums=(...) leaving {pos} out",
                    UserWarning,
                    stacklevel=4,
                )

    def _once(self, key) -> bool:
        if key in self._warned:
            return False
        self._warned.add(key)
        return True
