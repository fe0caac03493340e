"""How a :class:`~alpa.record.parallel_plan.ParallelPlan` names the traced step it was made for.

Values and equations are named by their position in the jaxpr (:func:`value_refs`,
:func:`eqn_refs`), which a fresh trace of the same function reproduces, so a plan saved
in one process binds to the step traced in another (``planned_parallel``). The step
itself is identified by :func:`step_fingerprint`.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np
from jax.extend.core import DropVar, Jaxpr, JaxprEqn, Var

from alpa.tracing import TracedStep
from alpa.tracing.jaxpr_util import planned_bodies


def value_refs(jaxpr: Jaxpr) -> dict[Var, str]:
    """A name for every value of ``jaxpr`` by its position: ``const{i}``, ``in{i}``,
    ``eqn{t}.{k}`` (output ``k`` of equation ``t``). The auto-sharding plan also pins the
    values inside checkpoint (``remat2``) and ``scan`` bodies and ``cond`` branches: in the
    body of equation ``t``, ``eqn{t}/`` followed by the body's own names (``eqn3/in0``,
    ``eqn3/eqn5.0``), in branch ``i`` ``eqn{t}/b{i}/`` (``eqn3/b1/eqn0.0``), recursively."""
    refs: dict[Var, str] = {}
    for i, v in enumerate(jaxpr.constvars):
        refs[v] = f"const{i}"

    def name(jaxpr: Jaxpr, prefix: str) -> None:
        for i, v in enumerate(jaxpr.invars):
            refs.setdefault(v, f"{prefix}in{i}")
        for t, eqn in enumerate(jaxpr.eqns):
            for k, v in enumerate(eqn.outvars):
                if isinstance(v, Var) and not isinstance(v, DropVar):
                    refs.setdefault(v, f"{prefix}eqn{t}.{k}")
            for suffix, body in planned_bodies(eqn):
                name(body, f"{prefix}eqn{t}/{suffix}")

    name(jaxpr, "")
    return refs


def eqn_refs(jaxpr: Jaxpr) -> dict[str, JaxprEqn]:
    """Every equation of ``jaxpr`` by a name of its position: ``eqn{t}``, and in the body of
    a checkpoint or scan equation ``t``, ``eqn{t}/eqn{u}`` (``eqn{t}/b{i}/eqn{u}`` in a
    ``cond``'s branch ``i``) (as :func:`value_refs`)."""
    refs: dict[str, JaxprEqn] = {}

    def name(jaxpr: Jaxpr, prefix: str) -> None:
        for t, eqn in enumerate(jaxpr.eqns):
            refs[f"{prefix}eqn{t}"] = eqn
            for suffix, body in planned_bodies(eqn):
                name(body, f"{prefix}eqn{t}/{suffix}")

    name(jaxpr, "")
    return refs


def step_fingerprint(traced: TracedStep) -> str:
    """A hash of what a plan depends on: the printed jaxpr (every equation with its
    shapes), the input avals, and which inputs are batch and donated."""
    # A parameter printed as a Python object may carry its address; it is not the step's.
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", str(traced.closed_jaxpr))
    parts = [
        text,
        repr([aval_text(a) for a in traced.in_avals]),
        repr(traced.batch_invars),
        repr(traced.donated_invars),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def aval_text(aval) -> str:
    """An input's aval as a plan records it: ``~`` when weakly typed, dtype, shape."""
    weak = "~" if getattr(aval, "weak_type", False) else ""
    return f"{weak}{np.dtype(aval.dtype).name}{list(aval.shape)}"
