"""The jaxpr helpers every pass shares: what a value is, its size, where the ``alpa.grad``
marker is."""

from __future__ import annotations

import math
from collections.abc import Sequence

from jax.extend.core import DropVar, Jaxpr, JaxprEqn, Literal, Var

from alpa.tracing.primitive_def import pipeline_p


def is_var(v) -> bool:
    """``v`` is a variable that holds a value: not a literal, not a dropped output."""
    return isinstance(v, Var) and not isinstance(v, DropVar | Literal)


def nbytes(v) -> int:
    """Bytes of ``v``'s value (exact Python ints; PRNG keys too)."""
    aval = v.aval
    return math.prod(aval.shape) * aval.dtype.itemsize


def is_grad_marker(eqn: JaxprEqn) -> bool:
    """``eqn`` is the marker ``alpa.grad`` leaves where the gradients are complete."""
    return eqn.primitive is pipeline_p and eqn.params["mark_type"] == "grad"


def grad_marker_index(eqns: Sequence[JaxprEqn]) -> int | None:
    """The position of the first ``alpa.grad`` marker among ``eqns``, if there is one."""
    return next((i for i, e in enumerate(eqns) if is_grad_marker(e)), None)


#: Names of the checkpoint primitive (``jax.checkpoint`` / ``flax.linen.remat``).
REMAT_PRIMITIVES = frozenset({"remat2", "checkpoint"})


def planned_bodies(eqn: JaxprEqn) -> tuple[tuple[str, Jaxpr], ...]:
    """The bodies the auto-sharding plan reaches into, each with the name its values take
    after the equation's (``parallel_plan.value_refs``): that of a checkpoint (``remat2``)
    or of a ``scan`` (``""``), the branches of a ``cond`` (``"b0/"``, ``"b1/"``, ...), the
    condition and body of a ``while`` (``"cond/"``, ``"body/"``); none for any other
    equation. ``trace_step`` gives each such body variables of its own, so
    the plan can name the body's values."""
    name = eqn.primitive.name
    if name in REMAT_PRIMITIVES:
        return (("", eqn.params["jaxpr"]),)
    if name == "scan":
        return (("", eqn.params["jaxpr"].jaxpr),)
    if name == "cond":
        return tuple((f"b{i}/", b.jaxpr) for i, b in enumerate(eqn.params["branches"]))
    if name == "while":
        return (
            ("cond/", eqn.params["cond_jaxpr"].jaxpr),
            ("body/", eqn.params["body_jaxpr"].jaxpr),
        )
    return ()
