r"""The train state of ``alpa.model``, with Alpa's mixed precision: a master copy and loss scaling.

**Master copy.** A model computed in float16 keeps its parameters in float16, but an
optimizer that adds float16 updates to float16 weights loses them below the weights' last
bit. With ``TrainState.create(..., use_master_copy=True)`` the state holds the parameters
twice: ``master_copy`` in float32, which the optimizer reads and updates (its state is the
master copy's), and ``params`` in float16, the master copy rounded after every update, which
the model reads (its gradients are float16):

.. math::
    (u, s') = \mathrm{tx.update}(g, s, m), \qquad m' = m + u, \qquad p' = \mathrm{fp16}(m').

``TrainState.create_aval`` builds the same state from parameter avals
(``jax.ShapeDtypeStruct``), allocating nothing: the state Alpa's benchmarks compile for, and
run on dummy values (``global_config.use_dummy_value_for_benchmarking``).

**Dynamic loss scaling** (:class:`DynamicScale`, stored in ``TrainState.dynamic_scale``):
float16 gradients of small losses underflow to zero. The loss is multiplied by a scale
:math:`S` before differentiating and the gradients divided by it after, in float32. When a
gradient is not finite the step is to be skipped and :math:`S` halves; after
``growth_interval`` finite steps in a row it doubles. The gradient is taken by
``alpa.value_and_grad``, so the boundary between compute-grad and apply-grad is marked as
gradient accumulation and pipelining need.

**init_dummy.** Alpa's benchmarks initialize a model with ``model.init_dummy(rng, *inputs)``:
every parameter filled with ``1e-8``, without running the initializers. Alpa added the method
to every flax ``Module`` by patching flax at import; here nothing is patched at import: the
models of ``alpa.model`` have it (:class:`DummyInit`), ``alpa.init()`` adds it to every flax
module (``alpa.flax_patches``), and :func:`init_dummy` does the same for any module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import train_state
from flax.training.dynamic_scale import DynamicScaleResult

from alpa.flax_patches import init_dummy  # noqa: F401 (Alpa's path: alpa.model.model_util)


def _cast(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


class TrainState(train_state.TrainState):
    """flax's ``TrainState`` plus ``batch_stats`` (batch normalization's statistics) and
    Alpa's ``master_copy`` and ``dynamic_scale`` (see the module docstring); each is
    ``None`` when unused.

    A train step replaces ``batch_stats`` with the statistics the forward pass in
    training mode returned: ``state.apply_gradients(grads=grads, batch_stats=new)``.
    """

    batch_stats: Any = None
    master_copy: Any = None
    dynamic_scale: Any = None

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """One optimizer step: ``step + 1``, and ``params`` (with a master copy: the master
        copy, then ``params`` rounded from it) and ``opt_state`` updated by ``grads``."""
        if self.master_copy is None:
            return super().apply_gradients(grads=grads, **kwargs)
        grads = jax.tree.map(lambda g, m: jnp.asarray(g, m.dtype), grads, self.master_copy)
        updates, opt_state = self.tx.update(grads, self.opt_state, self.master_copy)
        master = optax.apply_updates(self.master_copy, updates)
        params = jax.tree.map(lambda m, p: jnp.asarray(m, p.dtype), master, self.params)
        return self.replace(
            step=self.step + 1,
            params=params,
            master_copy=master,
            opt_state=opt_state,
            **kwargs,
        )

    @classmethod
    def create(
        cls,
        *,
        apply_fn: Callable,
        params: Any,
        tx: optax.GradientTransformation,
        use_master_copy: bool = False,
        **kwargs: Any,
    ) -> TrainState:
        """A state at step 0 (an int32 array, as Alpa's), its optimizer state initialized;
        with ``use_master_copy``, ``params`` in float16 and a float32 ``master_copy``."""
        master = None
        if use_master_copy:
            master = _cast(params, jnp.float32)
            params = _cast(params, jnp.float16)
        return cls(
            step=np.array(0, dtype=np.int32),
            apply_fn=apply_fn,
            params=params,
            tx=tx,
            opt_state=tx.init(params if master is None else master),
            master_copy=master,
            **kwargs,
        )

    @classmethod
    def create_aval(
        cls,
        *,
        apply_fn: Callable,
        params: Any,
        tx: optax.GradientTransformation,
        use_master_copy: bool = False,
        **kwargs: Any,
    ) -> TrainState:
        """:meth:`create` from parameter avals: every array of the state is a
        ``jax.ShapeDtypeStruct`` (the step too), nothing is allocated."""

        def build(params: Any) -> TrainState:
            return cls.create(
                apply_fn=apply_fn,
                params=params,
                tx=tx,
                use_master_copy=use_master_copy,
                **kwargs,
            )

        structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        return jax.eval_shape(build, structs)


class DynamicScale(struct.PyTreeNode):
    """Dynamic loss scaling of float16 gradients (see the module docstring), as flax's
    ``DynamicScale`` with the gradient taken by ``alpa.value_and_grad``.

    ``dynamic_scale.value_and_grad(loss_fn)(params)`` returns flax's
    ``DynamicScaleResult(dynamic_scale, finite, aux, grad)``: the scale for the next step,
    whether every gradient is finite (skip the update where it is not:
    ``jnp.where(finite, new, old)``), the unscaled loss (and aux) and float32 gradients.

    Attributes:
      growth_factor: the scale's factor after ``growth_interval`` finite steps.
      backoff_factor: the scale's factor after a step with a non-finite gradient.
      growth_interval: finite steps in a row before the scale grows.
      fin_steps: finite steps in a row so far.
      scale: the loss's current factor.
    """

    growth_factor: float = struct.field(pytree_node=False, default=2.0)
    backoff_factor: float = struct.field(pytree_node=False, default=0.5)
    growth_interval: int = struct.field(pytree_node=False, default=2000)
    fin_steps: Any = 0
    scale: Any = 65536.0

    def value_and_grad(
        self,
        fun: Callable[..., Any],
        argnums: int | Sequence[int] = 0,
        has_aux: bool = False,
        axis_name: str | None = None,
    ) -> Callable[..., DynamicScaleResult]:
        """``alpa.value_and_grad`` of ``fun`` with the loss scaled (see the class)."""
        from alpa.api import value_and_grad

        @functools.wraps(fun)
        def scaled(*args: Any) -> Any:
            out = fun(*args)
            return (self.scale * out[0], out[1]) if has_aux else self.scale * out

        grad_fn = value_and_grad(scaled, argnums, has_aux)

        def unscaled(*args: Any) -> DynamicScaleResult:
            value, grads = grad_fn(*args)
            value = (value[0] / self.scale, value[1]) if has_aux else value / self.scale
            grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32) / self.scale, grads)
            if axis_name is not None:
                grads = jax.lax.pmean(grads, axis_name)
            finite = jnp.array(True)
            for g in jax.tree.leaves(grads):
                finite &= jnp.all(jnp.isfinite(g))
            grow = self.fin_steps == self.growth_interval
            grown = jnp.where(grow & finite, self.scale * self.growth_factor, self.scale)
            scale = jnp.where(finite, grown, self.scale * self.backoff_factor)
            fin_steps = jnp.where(grow | ~finite, 0, self.fin_steps + 1)
            new = self.replace(fin_steps=fin_steps, scale=scale)
            return DynamicScaleResult(new, finite, value, grads)

        return unscaled


class DummyInit:
    """Gives a flax module Alpa's ``init_dummy`` method (:func:`init_dummy`)."""

    def init_dummy(self, *args: Any, **kwargs: Any) -> Any:
        """``init`` with every parameter ``1e-8``: Alpa's fast initialization for
        benchmarks (``alpa.flax_patches.init_dummy``)."""
        return init_dummy(self, *args, **kwargs)
