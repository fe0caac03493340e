"""FLOP counts against closed forms."""

import jax
import jax.numpy as jnp

from alpa.tracing.flops import eqn_flops, jaxpr_flops


def _eqns(fn, *shapes):
    return jax.make_jaxpr(fn)(*[jnp.ones(s) for s in shapes]).jaxpr.eqns


def test_dot_general_batched():
    (eqn,) = _eqns(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), (3, 4, 5), (3, 5, 6))
    assert eqn_flops(eqn) == 2 * 3 * 4 * 6 * 5


def test_conv():
    (eqn,) = _eqns(
        lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), "SAME"), (2, 3, 8, 8), (7, 3, 3, 3)
    )
    assert eqn_flops(eqn) == 2 * (2 * 7 * 8 * 8) * (3 * 3 * 3)


def test_reduction_counts_its_input_and_scan_its_trips():
    (eqn,) = _eqns(lambda x: x.sum(), (4, 5))
    assert eqn_flops(eqn) == 20

    def body(c, x):
        return c @ x, None

    eqns = _eqns(lambda c, xs: jax.lax.scan(body, c, xs)[0], (4, 4), (7, 4, 4))
    assert jaxpr_flops(eqns) == 7 * 2 * 4 * 4 * 4
