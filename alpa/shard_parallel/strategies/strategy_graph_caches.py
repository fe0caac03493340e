"""The strategy graph builder's caches: work done once for a stack of layers.

A stack of identical layers repeats the same equations on the same shapes, so the builder
does each piece of work once: a strategy rule runs once per distinct (primitive, parameters,
operand and result shapes and dtypes, operand specs) (rules read nothing else, in particular
not literal values or variable identity), and one read-only cost matrix serves every edge
with the same producer specs, consumer specs and byte size.

The caches outlive one graph: every graph built on one logical mesh with one set of options
shares them (:func:`shared_caches`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from jax.extend.core import JaxprEqn, Literal

from alpa.device_mesh import LogicalDeviceMesh

if TYPE_CHECKING:
    from alpa.shard_parallel.strategies.strategy_graph_record import GraphOptions

#: How many (mesh, options) pairs keep their builder caches (:func:`shared_caches`).
SHARED_CACHE_LIMIT = 64
_shared: OrderedDict = OrderedDict()
_shared_lock = threading.Lock()
_CACHE_NAMES = ("priced", "cost", "matrix", "rule", "shards", "bytes", "outputs", "operands")


def shared_caches(mesh: LogicalDeviceMesh, options: GraphOptions) -> dict[str, dict]:
    """The builder caches of every graph built on ``mesh`` (by value: shape, axis names,
    rates) with ``options``, the last :data:`SHARED_CACHE_LIMIT` pairs kept. Their entries
    depend only on the mesh, the options and their own keys, so the graphs of different
    programs share them: the stage-cost ILPs of a model's distinct layers on one logical
    submesh run each equation's strategy rule, pricing and resharding matrices once.
    Threads share them too: an entry computed twice is computed alike."""
    key = (mesh, options)
    with _shared_lock:
        caches = _shared.get(key)
        if caches is None:
            caches = _shared[key] = {name: {} for name in _CACHE_NAMES}
            while len(_shared) > SHARED_CACHE_LIMIT:
                _shared.popitem(last=False)
        else:
            _shared.move_to_end(key)
    return caches


def by_identity(cache: dict, objects: tuple, extra: tuple, make: Callable):
    """``make()``, kept in ``cache`` under the identities of ``objects`` (and ``extra``)
    rather than their hashes: spec tuples and strategy lists are costly to hash and recur
    as the very same objects. Each entry holds ``objects``, so their ids stay theirs."""
    key = (*map(id, objects), *extra)
    hit = cache.get(key)
    # Tuple equality tests each pair by identity first: the same objects compare in one
    # step each; equal ones (an id reused after a collection) give the same value anyway.
    if hit is not None and hit[0] == objects:
        return hit[1]
    value = make()
    cache[key] = (objects, value)
    return value


def rule_key(eqn: JaxprEqn, operand_specs) -> tuple | None:
    """What a strategy rule reads: the primitive, its parameters, the operands' and results'
    shapes and dtypes (and which operands are literals), and the operands' specs.

    Two equations with equal keys get the same strategies, so the rule runs once for all the
    layers of a stack. ``None`` when a parameter is unhashable (the rule then always runs).
    """
    try:
        params = tuple(sorted(eqn.params.items()))
        key = (
            eqn.primitive,
            params,
            tuple(_aval_key(v.aval, isinstance(v, Literal)) for v in eqn.invars),
            tuple(_aval_key(v.aval, False) for v in eqn.outvars),
            operand_specs,
        )
        hash(key)
    except TypeError:
        return None
    return key


def _aval_key(aval, literal: bool) -> tuple:
    return (literal, tuple(getattr(aval, "shape", ())), getattr(aval, "dtype", None))
