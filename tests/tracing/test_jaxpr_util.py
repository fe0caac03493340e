"""The shared jaxpr helpers: the backward slice and the nested equation order."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alpa.jax_internals import is_remat
from alpa.tracing.jaxpr_util import backward_slice, nested_eqns


def _jaxpr(f, *args):
    return jax.make_jaxpr(f)(*args).jaxpr


def _names(eqns) -> list[str]:
    return [e.primitive.name for e in eqns]


def test_backward_slice_takes_the_producers_in_program_order():
    def f(x, y):
        a = jnp.sin(x)  # read by c
        b = jnp.cos(y)  # read by d only
        c = a * 2.0
        d = b + 1.0
        return c, d

    jaxpr = _jaxpr(f, 1.0, 2.0)
    c, d = jaxpr.outvars
    assert _names(backward_slice(jaxpr.eqns, [c])) == ["sin", "mul"]
    assert _names(backward_slice(jaxpr.eqns, [d])) == ["cos", "add"]
    # Both roots: every equation once, in the jaxpr's order.
    assert backward_slice(jaxpr.eqns, [d, c]) == list(jaxpr.eqns)
    # An input or a literal root has no producer.
    assert backward_slice(jaxpr.eqns, [jaxpr.invars[0]]) == []


def test_backward_slice_stops_at_the_stop_values():
    def f(x):
        a = jnp.sin(x)
        b = jnp.exp(a)
        return b * a

    jaxpr = _jaxpr(f, 1.0)
    sin, exp, _ = jaxpr.eqns
    # The walk stops at ``a``: its producer is left out, although ``mul`` reads it.
    stop = {sin.outvars[0]}
    assert _names(backward_slice(jaxpr.eqns, jaxpr.outvars, stop=stop)) == ["exp", "mul"]
    # Restricted to some equations: the others' values count as inputs.
    assert backward_slice([exp], [exp.outvars[0]]) == [exp]


def test_nested_eqns_lists_each_body_after_its_equation():
    def f(x):
        y = jax.checkpoint(lambda z: jnp.sin(z) * 2.0)(x)
        return jnp.cos(y)

    jaxpr = _jaxpr(f, 1.0)
    eqns = nested_eqns(jaxpr)
    assert is_remat(eqns[0])
    assert _names(eqns[1:]) == ["sin", "mul", "cos"]
    body = jaxpr.eqns[0].params["jaxpr"]
    assert eqns[1:3] == list(body.eqns)
