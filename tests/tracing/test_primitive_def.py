"""The pipeline marker: identity under jit, grad, vmap; its transpose mirrors start/end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa.tracing.primitive_def import (
    mark_pipeline_boundary,
    mark_pipeline_jaxpreqn,
    pipeline_p,
)


def _markers(jaxpr):
    return [
        (e.params["name"], e.params["mark_type"]) for e in jaxpr.eqns if e.primitive is pipeline_p
    ]


def _f(w, x):
    (h,) = mark_pipeline_jaxpreqn([x @ w], "l0", "end")
    mark_pipeline_boundary()
    (h,) = mark_pipeline_jaxpreqn([h], "l1", "start")
    return jnp.sum(jnp.tanh(h))


def test_marker_is_identity_under_jit_grad_and_vmap():
    w, x = jnp.ones((3, 2)) * 0.1, jnp.arange(12.0).reshape(4, 3)

    def plain(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    np.testing.assert_allclose(jax.jit(_f)(w, x), plain(w, x), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(_f)(w, x), jax.grad(plain)(w, x), rtol=1e-6)
    batched = jax.vmap(_f, in_axes=(None, 0))(w, x[None].repeat(2, 0))
    np.testing.assert_allclose(batched, [plain(w, x)] * 2, rtol=1e-6)


def test_transpose_mirrors_markers_into_the_backward_pass():
    jaxpr = jax.make_jaxpr(jax.grad(_f))(jnp.ones((3, 2)), jnp.ones((4, 3))).jaxpr
    marks = _markers(jaxpr)
    # Forward: end of l0, the operand-less boundary, start of l1. Backward: mirrored, in
    # reverse order (l1's start becomes an end, l0's end a start).
    assert marks[:3] == [("l0", "end"), ("boundary", "boundary"), ("l1", "start")]
    assert marks[3:] == [("l1", "end"), ("l0", "start")]


def test_unknown_mark_type():
    with pytest.raises(ValueError, match="mark_type must be one of"):
        mark_pipeline_jaxpreqn([jnp.ones(2)], "x", "middle")
