"""``layer_scans.cut_keeping_scans``: a function whose layer-sized scan is cut written out,
rebuilt with one scan per run of whole iterations between the cuts.

Oracles: the rebuilt function computes the original's values and gradients; it has one
boundary per cut and exactly the pieces the cuts leave (a run of two or more whole
iterations a scan over its slice, an iteration alone or one a cut divides written out),
for a forward and a ``reverse`` scan (whose pieces run last-to-first); the user's own
boundaries do not cut (``AutoLayerOption`` clusters instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import alpa
from alpa.pipeline_parallel.layers.layer_scans import cut_keeping_scans
from alpa.pipeline_parallel.layers.segments import is_boundary
from alpa.tracing.jaxpr_util import eval_eqns, read

L = 6


def _fun(reverse: bool, boundary: bool = False):
    def f(w, x):
        if boundary:
            alpa.mark_pipeline_boundary()

        def body(h, wi):
            h = jnp.tanh(h @ wi)
            return h, h.sum()

        h, ys = lax.scan(body, x, w, reverse=reverse)
        return (h**2).sum() + (ys * jnp.arange(1.0, L + 1)).sum()

    return f


def _cut_before(kind: str, positions):
    """A ``cut`` that starts a segment at the ``kind`` equation of each iteration
    position in ``positions`` ("slice": where the iteration starts; "tanh": inside it)."""

    def cut(eqns):
        found = [i for i, e in enumerate(eqns) if e.primitive.name == kind]
        starts = sorted(found[p] for p in positions)
        bounds = [0, *starts, len(eqns)]
        return [list(eqns[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]

    return cut


def _pieces(closed):
    """The scan lengths and the number of written-out iterations (their ``tanh``) at the
    top level of ``closed``, in order, and its boundaries."""
    out = []
    for e in closed.jaxpr.eqns:
        if e.primitive.name == "scan":
            out.append(("scan", e.params["length"]))
        elif e.primitive.name == "tanh":
            out.append("one")
        elif is_boundary(e):
            out.append("|")
    return out


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(
    "kind, positions, expected",
    [
        # Between iterations: three scans of two.
        ("slice", (2, 4), [("scan", 2), "|", ("scan", 2), "|", ("scan", 2)]),
        # Inside iteration 3, before its tanh: a scan of three, iteration 3 written out
        # with the cut in it, a scan of two.
        ("tanh", (3,), [("scan", 3), "|", "one", ("scan", 2)]),
        # After the first iteration: it alone is written out.
        ("slice", (1,), ["one", "|", ("scan", 5)]),
    ],
)
def test_the_pieces_the_cuts_leave_compute_the_same(reverse, kind, positions, expected):
    f = _fun(reverse)
    w = jax.random.normal(jax.random.key(0), (L, 8, 8)) * 0.3
    x = jax.random.normal(jax.random.key(1), (4, 8))
    closed = jax.make_jaxpr(f)(w, x)
    new, segments = cut_keeping_scans(closed, 2, _cut_before(kind, positions))
    assert _pieces(new) == expected
    assert len(segments) == len(positions) + 1

    def rebuilt(w, x):
        return jax.core.eval_jaxpr(new.jaxpr, new.consts, w, x)[0]

    np.testing.assert_allclose(rebuilt(w, x), f(w, x), rtol=1e-6)
    for a, b in zip(jax.grad(rebuilt, (0, 1))(w, x), jax.grad(f, (0, 1))(w, x), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_users_boundaries_do_not_cut():
    closed = jax.make_jaxpr(_fun(False, boundary=True))(jnp.ones((L, 8, 8)), jnp.ones((4, 8)))
    assert any(is_boundary(e) for e in closed.jaxpr.eqns)
    new, segments = cut_keeping_scans(closed, 2, _cut_before("slice", (3,)))
    assert _pieces(new) == [("scan", 3), "|", ("scan", 3)]
    assert len(segments) == 2


def test_cuts_the_rebuilt_function_cannot_hold_leave_the_function_written_out():
    """Two cuts at one place (here an empty segment between them) cannot be boundaries of
    the rebuilt function: the function is then returned written out, with the segments
    the cut made, which compute the original's values."""
    f = _fun(False)
    w, x = jnp.ones((L, 8, 8)) * 0.1, jnp.ones((4, 8))
    closed = jax.make_jaxpr(f)(w, x)

    def cut(eqns):
        start = [i for i, e in enumerate(eqns) if e.primitive.name == "slice"][3]
        return [list(eqns[:start]), [], list(eqns[start:])]

    new, segments = cut_keeping_scans(closed, 2, cut)
    assert len(segments) == 3 and not any(e.primitive.name == "scan" for e in new.jaxpr.eqns)
    env = dict(zip(new.jaxpr.invars, (w, x), strict=True))
    env.update(zip(new.jaxpr.constvars, new.consts, strict=True))
    for segment in segments:
        eval_eqns(segment, env)
    np.testing.assert_allclose(read(env, new.jaxpr.outvars[0]), f(w, x), rtol=1e-6)
