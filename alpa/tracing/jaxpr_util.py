"""The jaxpr helpers every pass shares: what a value is, its size, where the ``alpa.grad``
marker is, which equations compute a value (the backward slice), and evaluating equations
by binding their primitives (the passes that rewrite
a function evaluate its equations inside the caller's trace; ``shard_parallel.lowering``
adds the plan's sharding constraints on top)."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence

from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var

from alpa.jax_internals import (
    bind_params,
    cond_branches,
    eqn_context,
    is_cond,
    is_remat,
    is_scan,
    is_while,
    open_jaxpr,
    remat_body,
    scan_parts,
    while_parts,
)
from alpa.tracing.primitive_def import pipeline_p


def is_var(v) -> bool:
    """``v`` is a variable that holds a value: not a literal, not a dropped output."""
    return isinstance(v, Var) and not isinstance(v, DropVar | Literal)


def nbytes(v) -> int:
    """Bytes of ``v``'s value (exact Python ints; PRNG keys too)."""
    aval = v.aval
    return math.prod(aval.shape) * aval.dtype.itemsize


def read(env: dict, v):
    """``v``'s value: a literal's own, else ``env[v]``."""
    return v.val if isinstance(v, Literal) else env[v]


def initial_env(closed: ClosedJaxpr, args: Sequence) -> dict:
    """The environment of ``closed`` called on ``args``: its inputs and constants."""
    env: dict = dict(zip(closed.jaxpr.invars, args, strict=True))
    env.update(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    return env


def bind_eqn(eqn: JaxprEqn, *operands):
    """``eqn``'s primitive bound on ``operands`` under the equation's context (one
    result, or the list of several)."""
    with eqn_context(eqn):
        return eqn.primitive.bind(*operands, **bind_params(eqn))


def eval_eqns(eqns: Sequence[JaxprEqn], env: dict) -> None:
    """Bind every equation's primitive on the values in ``env``; store the results."""
    for eqn in eqns:
        outs = bind_eqn(eqn, *[read(env, v) for v in eqn.invars])
        if not eqn.primitive.multiple_results:
            outs = [outs]
        env.update(zip(eqn.outvars, outs, strict=True))


def read_vars(eqns: Sequence[JaxprEqn], outvars: Sequence = ()) -> set:
    """The variables that ``eqns`` read, with those returned (``outvars``)."""
    read = {v for e in eqns for v in e.invars if is_var(v)}
    read.update(v for v in outvars if is_var(v))
    return read


def live_eqns(jaxpr: Jaxpr) -> list[bool]:
    """Whether each equation of ``jaxpr`` contributes to its results or has an effect: the
    others are dead code, which XLA removes. Unlike ``pe.dce_jaxpr`` this keeps every
    equation as it is (bodies are not pruned), so plans keyed by equation still apply."""
    needed = {v for v in jaxpr.outvars if is_var(v)}
    live = [False] * len(jaxpr.eqns)
    for t in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[t]
        if eqn.effects or any(v in needed for v in eqn.outvars if is_var(v)):
            live[t] = True
            needed.update(v for v in eqn.invars if is_var(v))
    return live


def backward_slice(
    eqns: Sequence[JaxprEqn], roots: Iterable, stop: Collection = ()
) -> list[JaxprEqn]:
    """The equations of ``eqns`` that compute the values ``roots``, in program order: the
    producers of the roots, of their operands, and so on, not past a value in ``stop`` or
    one that no equation of ``eqns`` produces (an input)."""
    producer = {v: e for e in eqns for v in e.outvars if is_var(v)}
    needed: set[int] = set()
    stack = [v for v in roots if is_var(v)]
    while stack:
        v = stack.pop()
        eqn = producer.get(v)
        if v in stop or eqn is None or id(eqn) in needed:
            continue
        needed.add(id(eqn))
        stack += [u for u in eqn.invars if is_var(u)]
    return [e for e in eqns if id(e) in needed]


def is_grad_marker(eqn: JaxprEqn) -> bool:
    """``eqn`` is the marker ``alpa.grad`` leaves where the gradients are complete."""
    return eqn.primitive is pipeline_p and eqn.params["mark_type"] == "grad"


def grad_marker_index(eqns: Sequence[JaxprEqn]) -> int | None:
    """The position of the first ``alpa.grad`` marker among ``eqns``, if there is one."""
    return next((i for i, e in enumerate(eqns) if is_grad_marker(e)), None)


def planned_bodies(eqn: JaxprEqn) -> tuple[tuple[str, Jaxpr], ...]:
    """The bodies the auto-sharding plan reaches into, each with the name its values take
    after the equation's (``plan_refs.value_refs``): that of a checkpoint (``remat2``)
    or of a ``scan`` (``""``), the branches of a ``cond`` (``"b0/"``, ``"b1/"``, ...), the
    condition and body of a ``while`` (``"cond/"``, ``"body/"``); none for any other
    equation. ``trace_step`` gives each such body variables of its own, so
    the plan can name the body's values."""
    if is_remat(eqn):
        return (("", remat_body(eqn)),)
    if is_scan(eqn):
        return (("", scan_parts(eqn).jaxpr),)
    if is_cond(eqn):
        return tuple((f"b{i}/", open_jaxpr(b)[0]) for i, b in enumerate(cond_branches(eqn)))
    if is_while(eqn):
        parts = while_parts(eqn)
        return (("cond/", open_jaxpr(parts.cond)[0]), ("body/", open_jaxpr(parts.body)[0]))
    return ()


def nested_eqns(jaxpr: Jaxpr | Sequence[JaxprEqn]) -> list[JaxprEqn]:
    """The equations of ``jaxpr`` (or the equations given), each followed by those of its
    :func:`planned_bodies`, recursively: one order for two jaxprs of the same structure,
    so that their equations correspond by position."""
    out: list[JaxprEqn] = []
    for eqn in jaxpr.eqns if isinstance(jaxpr, Jaxpr) else jaxpr:
        out.append(eqn)
        for _, body in planned_bodies(eqn):
            out += nested_eqns(body)
    return out


def eqns_at_positions(source: Jaxpr, target: Jaxpr) -> dict[int, JaxprEqn]:
    """``id(e) -> the equation of target at e's position`` for every equation ``e`` of
    ``source`` (:func:`nested_eqns`' order, bodies included): the same equations of two
    jaxprs of one structure (a traced step and its split program, two identical stages),
    whose equations must be as many."""
    return {id(e): t for e, t in zip(nested_eqns(source), nested_eqns(target), strict=True)}
