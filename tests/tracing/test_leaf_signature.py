"""``leaf_signature``: what an executable is compiled for, per argument leaf. A jax array's
signature is read off its ``aval`` directly (the per-call check of every leaf); it must be
what ``abstractify`` gives, as for any other leaf."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa.tracing.trace import abstractify, leaf_signature


def _from_abstractify(x) -> tuple:
    aval = abstractify(x)
    dtype = aval.dtype
    if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        dtype = np.dtype(dtype)
    return (tuple(aval.shape), dtype, bool(aval.weak_type))


@pytest.mark.parametrize(
    "make",
    [
        lambda: jnp.ones((3, 4)),
        lambda: jnp.ones((2,), jnp.bfloat16),
        lambda: jnp.asarray(1.0),  # weakly typed
        lambda: jnp.array(0) + 1,  # weakly typed int, as TrainState's step after a step
        lambda: jnp.arange(5, dtype=jnp.int8),
        lambda: jax.random.key(0),  # a typed PRNG key keeps its extended dtype
        lambda: np.ones((2, 2), np.float32),  # not a jax array: abstractify's path
        lambda: 3,
        lambda: 2.5,
    ],
)
def test_a_leafs_signature_is_its_abstract_value(make):
    x = make()
    assert leaf_signature(x) == _from_abstractify(x)


def test_weak_and_strong_scalars_differ():
    assert leaf_signature(jnp.asarray(1.0))[2] is True
    assert leaf_signature(jnp.asarray(1.0, jnp.float32))[2] is False
    assert leaf_signature(jnp.asarray(1.0)) != leaf_signature(jnp.asarray(1.0, jnp.float32))


def test_a_traced_leaf_has_the_signature_of_its_value():
    seen = []

    @jax.jit
    def f(x):
        seen.append(leaf_signature(x))
        return x

    f(jnp.ones((2, 3), jnp.float16))
    assert seen == [((2, 3), np.dtype(np.float16), False)]
