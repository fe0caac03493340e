"""Where a ``jax.grad`` step's gradients are complete: the ``alpa.grad`` marker, found.

A step differentiated with ``alpa.grad`` carries a marker where its gradients are
complete, and the lowering reduces the gradients there, once (``gradient_sync.py``):
with ZeRO, one reduce-scatter of all of them packed together. Alpa's users (and Alpa's
own tests) differentiate with plain ``jax.grad``, which leaves no marker. The gradients
are still plain to see in the jaxpr: JAX names the backward pass ``transpose(jvp(...))``
in each equation's name stack (``tracing/trace.py``), so a gradient is a value the
backward pass makes and something after it reads (the optimizer's update) or the step
returns.

:func:`mark_gradients` puts the marker there: after the last equation that makes a
gradient, on every gradient, its results read in place of the gradients by every
equation after it (and by the step's outputs). A reader placed before the marker (the
optimizer already reading an early gradient while the backward pass goes on) keeps
reading the unmarked value, so the program computes what it computed; the lowering
then reduces that gradient where it is made, as it would without the marker.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import JaxprEqn, Var

from alpa.tracing import StepJaxpr
from alpa.tracing.trace import insert_grad_marker


def _in_backward_pass(eqn: JaxprEqn) -> bool:
    stack = getattr(eqn.source_info.name_stack, "stack", ())
    return any(getattr(entry, "name", None) == "transpose" for entry in stack)


def gradient_vars(traced: StepJaxpr) -> list[Var]:
    """The gradients of ``traced``, in the order the backward pass makes them: floating
    point values made by an equation of the backward pass and read by an equation
    outside it or returned by the step."""
    jaxpr = traced.jaxpr
    backward = {v for e in jaxpr.eqns if _in_backward_pass(e) for v in e.outvars}
    read_after = [
        v
        for e in jaxpr.eqns
        if not _in_backward_pass(e)
        for v in e.invars
        if isinstance(v, Var) and v in backward
    ]
    read_after += [v for v in jaxpr.outvars if isinstance(v, Var) and v in backward]
    grads = set(read_after)
    made = [v for e in jaxpr.eqns for v in e.outvars if v in grads]
    return [v for v in dict.fromkeys(made) if jnp.issubdtype(v.aval.dtype, jnp.inexact)]


def mark_gradients(traced: StepJaxpr) -> StepJaxpr:
    """``traced`` with the ``alpa.grad`` marker on its gradients (module docstring);
    ``traced`` itself when it has a marker already, no backward pass or no gradient."""
    if traced.grad_marker() is not None or not traced.has_backward_pass:
        return traced
    grads = gradient_vars(traced)
    if not grads:
        return traced
    jaxpr = traced.jaxpr
    made_at = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    cut = max(made_at[v] for v in grads) + 1
    return insert_grad_marker(traced, grads, cut)
