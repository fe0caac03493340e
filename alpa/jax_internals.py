"""JAX's version-sensitive internals, read in one place.

alpa reads more of JAX than its public API: the parameters of the control-flow and call
primitives (a ``scan``'s body and its counts of constants and carries, a ``while``'s
condition and body, a ``cond``'s branches, the body of a ``jit``, ``closed_call``,
``custom_jvp_call``, ``custom_vjp_call`` or checkpoint), the names those primitives go by,
and a few objects that only ``jax.core`` and ``jax.interpreters`` export. These change
from one JAX release to the next. This module is the only one of alpa that reads them
(``tests/test_jax_internals.py`` fails on a read anywhere else), so that a JAX upgrade
touches this file; ``jax.extend``'s public types (``jax.extend.core.Jaxpr``, ``Var``, ...)
and ``jax.lax``'s primitives (``lax.scan_p``) may be used anywhere.

Every accessor takes an equation (``JaxprEqn``) or the parameters of one (what
``eqn.primitive.get_bind_params`` returns) and names what it returns:

* :func:`scan_parts` -> :class:`ScanParts` (body, ``num_consts``, ``num_carry``, ``length``,
  ``reverse``); :func:`scan_params` rebuilds a scan's parameters with a new body that
  takes extra leading constants;
* :func:`while_parts` -> :class:`WhileParts`; :func:`while_params`;
* :func:`cond_branches`; :func:`cond_params`;
* :func:`remat_body`; :func:`remat_params`;
* :func:`call_body` (the body of a call-like equation that inlining removes);
* the predicates :func:`is_scan`, :func:`is_while`, :func:`is_cond`, :func:`is_remat`,
  and the name sets :data:`REMAT_PRIMITIVES`,
  :data:`TRANSPARENT_CALLS`, :data:`CUSTOM_DERIVATIVE_CALLS`, :data:`CALL_BODY_PARAMS`;
* :func:`open_jaxpr` (a body as an open jaxpr and its constants, whichever of the two jaxpr
  types it is);
* :func:`bind_params` and :func:`eqn_context`: what binding an equation's primitive again
  takes (its parameters as ``bind`` wants them, and the context it was traced under);
* re-exports: ``ShapedArray``, ``Tracer`` (``jax.core``); ``ad``, ``batching``, ``mlir``
  and ``canonicalize_dtype_handlers`` (``jax.interpreters``).

**JAX 0.10** (the pinned version, ``jax>=0.10,<0.11``) is what alpa's tests run on.

**JAX 0.11**, read from JAX's source and not run here (no 0.11 installs here; the pin stays
until a run on 0.11 passes), is handled by feature detection, never by version strings:

* ``scan`` describes its operands with the ``FlatTree`` parameters ``ft_in`` (constants,
  carries, stacked inputs) and ``ft_out`` (carries, stacked outputs) instead of
  ``num_consts`` / ``num_carry``: read by the lengths of ``ft_in``'s three parts, and
  rebuilt with ``jax._src.flattree``'s ``pack`` / ``nones`` when constants are added;
* ``Jaxpr`` and ``ClosedJaxpr`` are one class (a jaxpr carries its constants; ``.jaxpr``
  returns the jaxpr itself; ``ClosedJaxpr(jaxpr, consts)`` still builds one):
  :func:`open_jaxpr` serves both;
* after 0.11.0, ``closed_call`` (and ``core_call``) became ``eval_jaxpr``, whose body is
  its ``call_jaxpr`` parameter: ``eval_jaxpr`` is one of :data:`TRANSPARENT_CALLS`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from jax.core import ShapedArray, Tracer
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn
from jax.interpreters import ad, batching, mlir
from jax.interpreters.xla import canonicalize_dtype_handlers

__all__ = [
    "bind_params",
    "eqn_context",
    "CALL_BODY_PARAMS",
    "CUSTOM_DERIVATIVE_CALLS",
    "REMAT_PRIMITIVES",
    "TRANSPARENT_CALLS",
    "ScanParts",
    "ShapedArray",
    "Tracer",
    "WhileParts",
    "ad",
    "batching",
    "call_body",
    "canonicalize_dtype_handlers",
    "cond_branches",
    "cond_params",
    "is_cond",
    "is_remat",
    "is_scan",
    "is_while",
    "mlir",
    "open_jaxpr",
    "remat_body",
    "remat_params",
    "scan_params",
    "scan_parts",
    "while_params",
    "while_parts",
]

# ----------------------------------------------------------------------------- names

#: Names of the checkpoint primitive (``jax.checkpoint`` / ``flax.linen.remat``).
REMAT_PRIMITIVES = frozenset({"remat2", "checkpoint"})

#: Call primitives that only call their body (no derivative rule of their own): ``jit``
#: (``pjit`` before JAX 0.5), ``closed_call``, ``core_call``, and ``eval_jaxpr``, which
#: replaced the last two after JAX 0.11.0.
TRANSPARENT_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "eval_jaxpr"})

#: Every call-like primitive whose body can be inlined, and the parameter that holds the
#: body: the transparent calls and the custom-derivative calls.
CALL_BODY_PARAMS: Mapping[str, str] = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "eval_jaxpr": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}

#: The calls whose derivative rules are not their bodies' (kept until differentiated).
CUSTOM_DERIVATIVE_CALLS = frozenset({"custom_jvp_call", "custom_vjp_call"})

_SCAN, _WHILE, _COND = "scan", "while", "cond"


def _params(
    eqn_or_params: JaxprEqn | Mapping[str, Any], accessor: str, kinds: Collection[str], key: str
) -> Mapping[str, Any]:
    """The parameters of ``eqn_or_params``, checked to be those of one of the primitives
    ``kinds`` (the names ``accessor`` reads), else a ``ValueError`` that says so."""
    if isinstance(eqn_or_params, JaxprEqn):
        name = eqn_or_params.primitive.name
        if name not in kinds:
            raise ValueError(
                f"{accessor}: eqn is a `{name}` equation; expected one of {sorted(kinds)}"
            )
        return eqn_or_params.params
    if not isinstance(eqn_or_params, Mapping) or key not in eqn_or_params:
        raise ValueError(
            f"{accessor}: expected an equation or the parameters of one of {sorted(kinds)}, "
            f"got {type(eqn_or_params).__name__} {_short(eqn_or_params)}"
        )
    return eqn_or_params


def _short(value: Any) -> str:
    text = repr(sorted(value) if isinstance(value, Mapping) else value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_scan(eqn: JaxprEqn) -> bool:
    """``eqn`` is a ``jax.lax.scan``."""
    return eqn.primitive.name == _SCAN


def is_while(eqn: JaxprEqn) -> bool:
    """``eqn`` is a ``jax.lax.while_loop`` (or a ``fori_loop`` lowered to one)."""
    return eqn.primitive.name == _WHILE


def is_cond(eqn: JaxprEqn) -> bool:
    """``eqn`` is a ``jax.lax.cond`` / ``switch``."""
    return eqn.primitive.name == _COND


def is_remat(eqn: JaxprEqn) -> bool:
    """``eqn`` is a checkpoint (``jax.checkpoint``, ``flax.linen.remat``)."""
    return eqn.primitive.name in REMAT_PRIMITIVES


# ----------------------------------------------------------------------------- jaxprs


def open_jaxpr(body: Jaxpr | ClosedJaxpr) -> tuple[Jaxpr, list]:
    """``body`` as an open jaxpr and the values of its constants: those a closed jaxpr
    carries, none for an open one. (In JAX 0.11 the two types are one class, whose
    ``.jaxpr`` is itself and whose ``.consts`` are its attached constants.)"""
    if isinstance(body, ClosedJaxpr):
        return body.jaxpr, list(body.consts)
    return body, []


def call_body(eqn: JaxprEqn, names: Collection[str] | None = None) -> Jaxpr | ClosedJaxpr | None:
    """The body of the call-like equation ``eqn`` (one of :data:`CALL_BODY_PARAMS`, and of
    ``names`` when given), or ``None`` for any other equation."""
    name = eqn.primitive.name
    if names is not None and name not in names:
        return None
    param = CALL_BODY_PARAMS.get(name)
    return eqn.params.get(param) if param else None


def remat_body(eqn_or_params: JaxprEqn | Mapping[str, Any]) -> Jaxpr:
    """The body of a checkpoint equation (an open jaxpr: a checkpoint closes over
    nothing)."""
    return _params(eqn_or_params, "remat_body", REMAT_PRIMITIVES, "jaxpr")["jaxpr"]


def remat_params(params: Mapping[str, Any], body: Jaxpr, num_extra: int) -> dict:
    """The parameters of a checkpoint equation with body ``body``, which takes
    ``num_extra`` operands after the original ones (constants: no optimization barrier
    needed)."""
    prevent_cse = params["prevent_cse"]
    if isinstance(prevent_cse, tuple):  # one flag per operand
        prevent_cse = prevent_cse + (False,) * num_extra
    return {**params, "jaxpr": body, "prevent_cse": prevent_cse}


# ----------------------------------------------------------------------------- scan


@dataclass(frozen=True)
class ScanParts:
    """A ``scan``'s parameters by meaning. Its operands are ``num_consts`` constants,
    ``num_carry`` initial carries, then the stacked inputs; its results the final carries,
    then the stacked outputs. ``body`` takes the same operands (one row of each stacked
    input) and returns the new carries and one row of each stacked output."""

    body: ClosedJaxpr
    num_consts: int
    num_carry: int
    length: int
    reverse: bool

    @property
    def first_stacked(self) -> int:
        """The position of the first stacked operand (after the constants and carries)."""
        return self.num_consts + self.num_carry

    @property
    def jaxpr(self) -> Jaxpr:
        """The body as an open jaxpr."""
        return open_jaxpr(self.body)[0]

    @property
    def consts(self) -> list:
        """The values of the body's own constants."""
        return open_jaxpr(self.body)[1]


def scan_parts(eqn_or_params: JaxprEqn | Mapping[str, Any]) -> ScanParts:
    """The parts of a ``scan`` equation (or of its parameters)."""
    params = _params(eqn_or_params, "scan_parts", (_SCAN,), "jaxpr")
    if "ft_in" in params:  # JAX 0.11: FlatTrees of (consts, carries, xs), unverified here
        num_consts, num_carry, _ = (len(part) for part in params["ft_in"].unpack())
    else:
        num_consts, num_carry = params["num_consts"], params["num_carry"]
    return ScanParts(
        body=params["jaxpr"],
        num_consts=num_consts,
        num_carry=num_carry,
        length=params["length"],
        reverse=params["reverse"],
    )


def scan_params(
    params: Mapping[str, Any],
    *,
    body: ClosedJaxpr | None = None,
    num_new_consts: int = 0,
    length: int | None = None,
) -> dict:
    """The parameters of a ``scan`` like ``params``, with the body ``body`` (which takes
    ``num_new_consts`` constants before the original operands) and the trip count
    ``length``, where given."""
    params = dict(params)
    if body is not None:
        params["jaxpr"] = body
    if length is not None:
        params["length"] = length
    if not num_new_consts:
        return params
    if "ft_in" in params:  # JAX 0.11, unverified here
        from jax._src import flattree  # noqa: PLC0415 (only JAX 0.11 has it)

        consts, carry, xs = params["ft_in"].unpack()
        params["ft_in"] = flattree.pack((flattree.nones(len(consts) + num_new_consts), carry, xs))
    else:
        params["num_consts"] += num_new_consts
    return params


# ----------------------------------------------------------------------------- while


@dataclass(frozen=True)
class WhileParts:
    """A ``while``'s parameters by meaning. Its operands are ``cond_nconsts`` constants
    of the condition, ``body_nconsts`` of the body, then the initial carries."""

    cond: ClosedJaxpr
    body: ClosedJaxpr
    cond_nconsts: int
    body_nconsts: int


def while_parts(eqn_or_params: JaxprEqn | Mapping[str, Any]) -> WhileParts:
    """The parts of a ``while`` equation (or of its parameters)."""
    params = _params(eqn_or_params, "while_parts", (_WHILE,), "body_jaxpr")
    return WhileParts(
        cond=params["cond_jaxpr"],
        body=params["body_jaxpr"],
        cond_nconsts=params["cond_nconsts"],
        body_nconsts=params["body_nconsts"],
    )


def while_params(
    params: Mapping[str, Any],
    cond: ClosedJaxpr,
    body: ClosedJaxpr,
    num_new_cond_consts: int,
    num_new_body_consts: int,
) -> dict:
    """The parameters of a ``while`` like ``params`` with condition ``cond`` and body
    ``body``, each taking that many new constants before its original ones."""
    return {
        **params,
        "cond_jaxpr": cond,
        "body_jaxpr": body,
        "cond_nconsts": params["cond_nconsts"] + num_new_cond_consts,
        "body_nconsts": params["body_nconsts"] + num_new_body_consts,
    }


# ----------------------------------------------------------------------------- cond


def cond_branches(eqn_or_params: JaxprEqn | Mapping[str, Any]) -> tuple[ClosedJaxpr, ...]:
    """The branches of a ``cond`` equation, in index order (operand 0 picks one; each
    branch takes the other operands)."""
    return tuple(_params(eqn_or_params, "cond_branches", (_COND,), "branches")["branches"])


def cond_params(params: Mapping[str, Any], branches) -> dict:
    """The parameters of a ``cond`` like ``params`` with branches ``branches``."""
    return {**params, "branches": tuple(branches)}


def bind_params(eqn: JaxprEqn) -> dict:
    """``eqn``'s parameters as its primitive's ``bind`` takes them (a copy)."""
    return dict(eqn.primitive.get_bind_params(eqn.params))


def eqn_context(eqn: JaxprEqn):
    """The context manager ``eqn`` was traced under (its config and compute type), to
    bind its primitive again under."""
    return eqn.ctx.manager
