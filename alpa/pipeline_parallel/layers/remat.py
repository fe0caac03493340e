"""Segment rematerialization: ``alpa.manual_remat`` and ``alpa.automatic_remat``.

``jax.checkpoint(f)`` keeps none of ``f``'s intermediate values for the backward pass: the
backward recomputes them from ``f``'s inputs. Around a whole model it would keep nothing
but recompute the whole forward pass at once; around each of ``K`` segments of the model,
the forward pass keeps only the values that enter segments, and the backward of segment
``k`` first recomputes segment ``k``'s intermediates, so at most one segment's
intermediates are alive at a time. The cost is one more forward pass.

* :func:`manual_remat` cuts at the user's ``mark_pipeline_boundary()`` calls and keeps
  the boundaries between the checkpointed segments, so ``alpa.grad`` and
  ``PipeshardParallel`` still see the user's layers;
* :func:`automatic_remat` cuts into ``layer_num`` segments by layer clustering (FLOPs
  within ``eps`` of the average, least bytes crossing segments; ``segments``,
  ``layer_clustering``), ignoring boundaries.

The result computes the same values and the same derivatives; in its jaxpr every segment
is one ``checkpoint`` (``remat2``) equation, whose derivative is a ``checkpoint`` equation
of the backward pass that recomputes the segment. ``AutoLayerOption(remat_mode=
"fine_grained_remat")`` applies :func:`automatic_remat` to the loss function before its
layers are clustered, so a layer is a run of whole checkpointed segments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.extend.core import ClosedJaxpr

from alpa.jax_internals import Tracer
from alpa.pipeline_parallel.layers.segments import (
    Segments,
    boundary_segments,
    check_callable,
    check_eps,
    check_layer_num,
    check_static_argnums,
    clustered_segments,
    rewrite_traced,
    segment_interface,
)
from alpa.tracing.jaxpr_util import eval_eqns, initial_env, read
from alpa.tracing.primitive_def import mark_pipeline_boundary


def manual_remat(fun: Callable | None = None, *, static_argnums: int | Sequence[int] = ()):
    """Rematerialize every segment of ``fun`` between its ``mark_pipeline_boundary()``
    calls (``jax.checkpoint`` per segment; module docstring).

    Usable as ``manual_remat(f)`` or ``@manual_remat(static_argnums=...)``. Arguments at
    ``static_argnums`` and arguments that are not arrays are constants of the trace.
    """
    static = check_static_argnums(static_argnums, "manual_remat")

    def decorate(f):
        check_callable(f, "manual_remat")

        def rewrite(closed: ClosedJaxpr, values: list) -> list:
            segments = boundary_segments(closed.jaxpr.eqns)
            return eval_checkpointed(closed, segments, values, keep_boundaries=True)

        return rewrite_traced(f, rewrite, static)

    return decorate if fun is None else decorate(fun)


def automatic_remat(
    fun: Callable | None = None,
    layer_num: int | None = None,
    *,
    static_argnums: int | Sequence[int] = (),
    eps: float = 0.6,
):
    """Rematerialize ``fun`` in ``layer_num`` segments chosen by layer clustering
    (``jax.checkpoint`` per segment; module docstring).

    Usable as ``automatic_remat(f, layer_num=4)`` or ``@automatic_remat(layer_num=4)``.

    Args:
      fun: the function (e.g. a loss function).
      layer_num: the number of segments, at most the number of ``fun``'s equations.
      static_argnums: positions of arguments that are constants of the trace (arguments
        that are not arrays always are).
      eps: each segment's FLOPs are within ``(1 - eps)`` to ``(1 + eps)`` times the average.
    """
    check_layer_num(layer_num, "automatic_remat")
    check_eps(eps, "automatic_remat", "eps")
    static = check_static_argnums(static_argnums, "automatic_remat")
    what = f"automatic_remat(layer_num={layer_num}, eps={eps})"

    def decorate(f):
        check_callable(f, "automatic_remat")
        return clustered_remat(f, layer_num, eps, static, what)

    return decorate if fun is None else decorate(fun)


def clustered_remat(
    fun: Callable, layer_num: int, eps: float, static_argnums: Sequence[int], what: str
) -> Callable:
    """:func:`automatic_remat` without argument checks; ``what`` names the user's option
    in errors."""

    def rewrite(closed: ClosedJaxpr, values: list) -> list:
        segments = clustered_segments(closed.jaxpr.eqns, layer_num, eps, what, "the function")
        return eval_checkpointed(closed, segments, values, keep_boundaries=False)

    return rewrite_traced(fun, rewrite, static_argnums, inline_jit=True)


def eval_checkpointed(
    closed: ClosedJaxpr, segments: Segments, args: Sequence, keep_boundaries: bool
) -> list:
    """Evaluate ``closed`` on ``args`` with every segment under ``jax.checkpoint``; with
    ``keep_boundaries``, a ``mark_pipeline_boundary()`` between consecutive segments."""
    env = initial_env(closed, args)
    # Concrete constants stay constants of each segment (not checkpoint operands), so that
    # later passes still see them as constants.
    concrete = {
        v
        for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True)
        if not isinstance(c, Tracer)
    }
    interface = segment_interface(closed, segments)
    for k, (eqns, (entering, leaving)) in enumerate(zip(segments, interface, strict=True)):
        if k and keep_boundaries:
            mark_pipeline_boundary()
        if not leaving and not any(e.effects for e in eqns):
            continue  # nothing of it is used
        operands = [v for v in entering if v not in concrete]
        consts = {v: env[v] for v in entering if v in concrete}

        def body(*xs, eqns=eqns, operands=operands, leaving=leaving, consts=consts):
            local = dict(consts)
            local.update(zip(operands, xs, strict=True))
            eval_eqns(eqns, local)
            return [local[v] for v in leaving]

        outs = jax.checkpoint(body)(*[env[v] for v in operands])
        env.update(zip(leaving, outs, strict=True))
    return [read(env, v) for v in closed.jaxpr.outvars]
