"""The fast path of a repeated call of a parallelized function (``api.ParallelizedFunc``).

A call that looks like the last one (same number of arguments, same static values, no new
Python scalar among the dynamic ones) is a **cache hit**: the dynamic arguments go straight
to the last executable's :meth:`~alpa.executables.base.Executable.dispatch` (through its
``hit_dispatch``), for a one-mesh executable XLA's compiled program and its C++ fast path,
so alpa adds two Python frames (one reads the step timer's setting) to what ``jax.jit``
costs. If the dispatch refuses the arguments (other shapes, an input
committed to another sharding) the call takes the slow path: the full key, compilation if
needed, placement of the inputs. An executable whose inputs keep arriving in another
sharding gets a dispatch that places them first.
"""

from __future__ import annotations

from alpa import cluster
from alpa.executables.base import Executable

#: What :meth:`CacheHit.__call__` returns when the call does not match.
MISS = object()
PYTHON_SCALARS = (bool, int, float, complex, str)


class CacheHit:
    """What a call needs to reuse the last call's executable without building its key.

    A call matches when it has as many positional arguments, equal static arguments (same
    type and ``==``), and, with ``static_argnums="auto"``, no Python scalar where the last
    call had a dynamic argument (it would be static, hence another executable). Shapes,
    dtypes, pytree structure and placement are left to the executable's dispatch, which
    refuses (``TypeError`` / ``ValueError``) what it was not compiled for.
    """

    __slots__ = (
        "generation",
        "num_args",
        "static",
        "dynamic",
        "donated",
        "auto_static",
        "executable",
        "dispatch",
    )

    def __init__(
        self,
        args,
        static,
        auto_static: bool,
        executable: Executable,
        placing: bool,
        generation: int | None = None,
    ):
        self.generation = generation  # of the global cluster it runs on (None: its own)
        self.num_args = len(args)
        self.static = tuple((i, args[i]) for i in static)
        self.dynamic = tuple(i for i in range(len(args)) if i not in static)
        traced = executable.traced
        self.donated = tuple(
            pos
            for pos, first in zip(
                traced.dynamic_argnums, _first_leaves(traced.in_tree), strict=True
            )
            if first is not None and traced.donated_invars[first]
        )
        self.auto_static = auto_static
        self.executable = executable
        self.dispatch = executable.hit_dispatch(placing)

    def __call__(self, args):
        if len(args) != self.num_args:
            return MISS
        if self.generation is not None and self.generation != cluster.generation():
            return MISS  # alpa.shutdown() since: compile for the new cluster
        for i, value in self.static:
            arg = args[i]
            if arg is not value and (type(arg) is not type(value) or arg != value):
                return MISS
        dynamic = [args[i] for i in self.dynamic]
        if self.auto_static and any(type(a) in PYTHON_SCALARS for a in dynamic):
            return MISS
        try:
            out = self.dispatch(*dynamic)
        except (TypeError, ValueError):
            return MISS
        self.executable._last_outputs = out
        return out


def _first_leaves(in_tree) -> list[int | None]:
    """Per dynamic argument, the index of its first leaf (``None``: it has none)."""
    out, start = [], 0
    for subtree in in_tree.children():
        out.append(start if subtree.num_leaves else None)
        start += subtree.num_leaves
    return out
