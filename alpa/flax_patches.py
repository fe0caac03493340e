"""What Alpa added to flax, installed by ``alpa.init()`` rather than at import.

Alpa patched flax when it was imported: every ``flax.linen.Module`` got ``init_dummy``
(its parameters filled with ``1e-8`` without running the initializers, for benchmarks),
and ``nn.Embed`` got an ``embedding_fp16`` attribute (the table in float16, which Alpa's OPT
serving model multiplies its float16 hidden states with) and computed its lookup in float16
under ``global_config.flax_always_use_fp16_embedding``. Scripts written for Alpa use all
three.

Here nothing is patched at import: :func:`install_flax_patches` adds them when a program
connects alpa to its devices (``alpa.init``, explicit or implied by a first
``parallelize``), which every Alpa program does before building its models:

* ``Module.init_dummy(*args, **kwargs)``: :func:`init_dummy` (the models of ``alpa.model``
  have it without the patch);
* ``Embed.embedding_fp16``: the embedding table cast to float16;
* ``Embed.__call__`` looks up rows of the float16 table while
  ``global_config.flax_always_use_fp16_embedding`` is set, and runs flax's own otherwise.

This module imports flax only when it installs, so that the runtime can read
:data:`DUMMY_VALUE` from it.
"""

from __future__ import annotations

import functools
from typing import Any

#: Alpa's dummy value: every parameter of ``init_dummy``, and every element of a step
#: argument run on dummy values (``use_dummy_value_for_benchmarking``; 0 for integers).
DUMMY_VALUE = 1e-8

_installed: list[bool] = []


def init_dummy(module: Any, *args: Any, **kwargs: Any) -> Any:
    """The variables ``module.init(*args, **kwargs)`` would return, each filled with
    :data:`DUMMY_VALUE` instead of running the initializers: only shapes are traced, and
    the values are placed on the default device at once."""
    import jax
    import numpy as np

    avals = jax.eval_shape(module.init, *args, **kwargs)
    return jax.device_put(jax.tree.map(lambda x: np.full(x.shape, DUMMY_VALUE, x.dtype), avals))


def install_flax_patches() -> None:
    """Add Alpa's ``Module.init_dummy``, ``Embed.embedding_fp16`` and float16 lookups to
    flax (see the module docstring); a second call does nothing."""
    if _installed:
        return
    import flax.linen as nn
    import jax.numpy as jnp
    from flax.linen.module import wrap_method_once

    from alpa.global_env import global_config

    if not hasattr(nn.Module, "init_dummy"):
        nn.Module.init_dummy = init_dummy
    if not hasattr(nn.Embed, "embedding_fp16"):
        nn.Embed.embedding_fp16 = property(lambda self: jnp.asarray(self.embedding, jnp.float16))
    flax_call = getattr(nn.Embed.__call__, "__wrapped__", nn.Embed.__call__)

    @functools.wraps(flax_call)
    def call(self, inputs):
        if not global_config.flax_always_use_fp16_embedding:
            return flax_call(self, inputs)
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError("Input type must be an integer or unsigned integer.")
        return jnp.take(self.embedding_fp16, inputs, axis=0)

    nn.Embed.__call__ = wrap_method_once(call)  # flax's module-state handling, as its own
    _installed.append(True)
