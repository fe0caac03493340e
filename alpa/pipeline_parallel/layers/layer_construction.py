"""Layer construction: cut a step into pipeline layers, in the forward and backward pass.

Two options decide the cut of the forward pass (the loss function):

* ``ManualLayerOption`` takes the user's cuts: ``alpa.mark_pipeline_boundary()`` calls
  split the forward pass into ``number of boundaries + 1`` layers, in program order.
* ``AutoLayerOption(layer_num)`` ignores boundaries and clusters the loss function's
  equations into ``layer_num`` contiguous layers (paper §5.2, ``layer_clustering``): every
  layer's FLOPs within ``(1 ± layer_eps)`` times the average, and the least bytes crossing
  layer boundaries. ``remat_mode="coarse_grained_remat"`` then recomputes each stage's
  forward in its backward (``program_rewrites.rematerialize``);
  ``remat_mode="fine_grained_remat"`` first wraps ``fine_grained_remat_layer_num``
  clustered segments of the loss function in ``jax.checkpoint`` (``remat``), so that a
  layer is a run of whole checkpointed segments. An inference step (no ``alpa.grad``) is
  clustered the same way, by :func:`construct_layers`.

A boundary binds a marker with no operands, and JAX's AD carries an equation without
operands into the forward sweep only, so the backward pass would keep no trace of the cut.
:func:`mark_layers` (applied by ``alpa.grad`` / ``alpa.value_and_grad`` before they
differentiate, as in Alpa's ``layer_construction``) therefore rewrites the loss function:
it traces it to a jaxpr, cuts the equations into layers (as the active option says) and
re-evaluates them with every layer wrapped in a ``start`` marker on the values that enter
it and an ``end`` marker on the values that leave it::

    start_0(params, x) -> eqns of layer 0 -> end_0(h) -> start_1(h, params) -> ... -> end_1(loss)

Differentiating that function, the marker's transpose mirrors every pair into the backward
pass in reverse order (``end`` of layer ``l``'s tangents becomes the ``start`` of its
backward), so the differentiated step reads, for two layers::

    forward:  start_0 .. end_0  start_1 .. end_1       (the primal markers)
    backward: start_1 .. end_1  start_0 .. end_0       (the transposed tangent markers)

:func:`manual_layers` reads the layer and the kind (forward or backward) of every equation
from these markers; equations of the backward pass outside every pair (the cotangent seed,
sums of cotangents of a value that several layers read) are placed by their data in
``computation.split_computations``. A step whose boundaries were not rewritten (an
inference step, or one differentiated with ``jax.grad``) is cut by its boundaries alone.

The option reaches ``mark_layers``, which runs while the step is traced, through
:func:`layer_option_context`: ``PipeshardParallel`` traces the step inside it
(``ParallelMethod.trace_context``). Outside any context, ``mark_layers`` cuts at the
boundaries, as ``ManualLayerOption()`` does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import InitVar, dataclass
from typing import Literal

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, JaxprEqn, Var

from alpa.global_env import global_config
from alpa.jax_internals import Tracer
from alpa.pipeline_parallel.layers.layer_scans import cut_keeping_scans, is_layer_cut
from alpa.pipeline_parallel.layers.remat import clustered_remat
from alpa.pipeline_parallel.layers.segments import (
    Segments,
    boundary_segments,
    check_eps,
    check_layer_num,
    check_static_argnums,
    clustered_segments,
    is_boundary,
    rewrite_traced,
    segment_interface,
)
from alpa.tracing.flops import eqn_flops
from alpa.tracing.jaxpr_util import (
    eval_eqns,
    grad_marker_index,
    initial_env,
    is_grad_marker,
    read,
)
from alpa.tracing.primitive_def import mark_pipeline_jaxpreqn, pipeline_p

LAYER_PREFIX = "layer_"

EqnKind = Literal["forward", "backward"]
RematMode = Literal["none", "coarse_grained_remat", "fine_grained_remat"]
REMAT_MODES = ("none", "coarse_grained_remat", "fine_grained_remat")

__all__ = [
    "AutoLayerOption",
    "LayerAssignment",
    "ManualLayerOption",
    "construct_layers",
    "is_boundary",
    "is_layer_marker",
    "layer_option_context",
    "manual_layers",
    "mark_layers",
    "resolve_layer_option",
]

# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class ManualLayerOption:
    """Layers are the parts between the user's ``mark_pipeline_boundary()`` calls.

    Attributes:
      remat_layer: each stage's backward recomputes the forward activations of its
        stage instead of keeping them from the forward (``program_rewrites.rematerialize``).
    """

    remat_layer: bool = False

    def __post_init__(self):
        if not isinstance(self.remat_layer, bool):
            raise ValueError(f"remat_layer must be a bool, got {self.remat_layer!r}")

    def rewrite_loss(self, fun: Callable) -> Callable:
        """``fun`` with its boundaries replaced by layer markers (:func:`mark_layers`)."""

        def rewrite(closed: ClosedJaxpr, values: list) -> list:
            return _eval_layered(closed, boundary_segments(closed.jaxpr.eqns), values)

        return rewrite_traced(fun, rewrite)

    def layers(self, closed_jaxpr: ClosedJaxpr) -> LayerAssignment:
        """The layer of every equation of a traced step (:func:`manual_layers`)."""
        return manual_layers(closed_jaxpr)


@dataclass(frozen=True)
class AutoLayerOption:
    """Layers chosen by clustering the loss function's equations (module docstring).

    Attributes:
      layer_num: the number of layers, at most the number of the loss function's
        equations. Layers are the stage DP's units; a multiple of the number of stages
        you expect (or of the model's repeated blocks) cuts best.
      remat_mode: ``"none"``; ``"coarse_grained_remat"`` (each stage's backward
        recomputes its forward, as ``ManualLayerOption(remat_layer=True)``); or
        ``"fine_grained_remat"`` (``fine_grained_remat_layer_num`` clustered segments of
        the loss function under ``jax.checkpoint``, see ``alpa.automatic_remat``).
      fine_grained_remat_layer_num: the number of checkpointed segments (default
        ``layer_num``), at least ``layer_num``; read only with ``"fine_grained_remat"``.
      layer_eps: every layer's FLOPs are within ``(1 - layer_eps)`` to ``(1 + layer_eps)``
        times the average (``layer_eps >= 1``: no lower bound).
        ``eps=`` (Alpa's name) is accepted too.
      static_argnums: positions of loss-function arguments that are constants of the
        trace (arguments that are not arrays always are).
    """

    layer_num: int
    remat_mode: RematMode = "none"
    fine_grained_remat_layer_num: int | None = None
    layer_eps: float = 0.6
    static_argnums: tuple[int, ...] = ()
    eps: InitVar[float | None] = None

    def __post_init__(self, eps):
        name = "AutoLayerOption"
        check_layer_num(self.layer_num, name)
        if self.remat_mode not in REMAT_MODES:
            raise ValueError(
                f"{name}: remat_mode must be one of {REMAT_MODES}, got {self.remat_mode!r}"
            )
        fine = self.fine_grained_remat_layer_num
        if fine is not None:
            check_layer_num(fine, name, "fine_grained_remat_layer_num")
            if self.remat_mode == "fine_grained_remat" and fine < self.layer_num:
                raise ValueError(
                    f"{name}: fine_grained_remat_layer_num={fine} is less than "
                    f"layer_num={self.layer_num}; a layer is a run of whole rematerialized "
                    "segments, so there must be at least as many segments as layers"
                )
        if eps is not None:  # Alpa's name
            if self.layer_eps not in (0.6, eps):
                raise ValueError(
                    f"{name}: got layer_eps={self.layer_eps} and eps={eps}; they are the "
                    "same tolerance, pass one"
                )
            object.__setattr__(self, "layer_eps", eps)
        check_eps(self.layer_eps, name, "layer_eps")
        object.__setattr__(self, "static_argnums", check_static_argnums(self.static_argnums, name))

    @property
    def remat_layer(self) -> bool:
        """Stage-level rematerialization (``program_rewrites.rematerialize``)."""
        return self.remat_mode == "coarse_grained_remat"

    def _clustered(self, eqns: Sequence[JaxprEqn], where: str) -> Segments:
        """``eqns`` (of ``where``: "the loss function", "the inference step") clustered
        into ``layer_num`` layers."""
        what = f"AutoLayerOption(layer_num={self.layer_num}, layer_eps={self.layer_eps})"
        segments = clustered_segments(eqns, self.layer_num, self.layer_eps, what, where)
        if global_config.print_auto_layer_stats:
            print(layer_stats(segments, where))
        return segments

    def rewrite_loss(self, fun: Callable) -> Callable:
        """``fun`` cut into ``layer_num`` clustered layers, each wrapped in layer markers
        (:func:`mark_layers`); with fine-grained remat, over checkpointed segments."""
        if self.remat_mode == "fine_grained_remat":
            segments = self.fine_grained_remat_layer_num or self.layer_num
            fun = clustered_remat(
                fun,
                segments,
                self.layer_eps,
                self.static_argnums,
                f"AutoLayerOption(remat_mode='fine_grained_remat', "
                f"fine_grained_remat_layer_num={segments}, layer_eps={self.layer_eps})",
            )

        def cut(eqns) -> Segments:
            return self._clustered(eqns, "the loss function")

        def rewrite(closed: ClosedJaxpr, values: list) -> list:
            closed, segments = cut_keeping_scans(closed, self.layer_num, cut)
            return _eval_layered(closed, segments, values)

        return rewrite_traced(fun, rewrite, self.static_argnums, inline_jit=True)

    def inference_step(self, closed_jaxpr: ClosedJaxpr) -> ClosedJaxpr:
        """An inference step (no ``alpa.grad`` to rewrite) with its layer-sized scans cut
        as :meth:`layers` clusters it, each layer keeping a scan over its iterations
        (``layer_scans.cut_keeping_scans``); the cuts are boundaries that :meth:`layers`
        then reads. A step without such a scan is returned as it is."""

        def cut(eqns) -> Segments:
            return self._clustered(eqns, "the inference step")

        return cut_keeping_scans(closed_jaxpr, self.layer_num, cut)[0]

    def layers(self, closed_jaxpr: ClosedJaxpr) -> LayerAssignment:
        """The layer of every equation of a traced step: from the markers ``alpa.grad``
        left (a training step), from the cuts :meth:`inference_step` made, else by
        clustering the step's equations (inference)."""
        eqns = closed_jaxpr.jaxpr.eqns
        if any(is_layer_marker(e) or is_grad_marker(e) for e in eqns):
            return manual_layers(closed_jaxpr)
        if any(is_layer_cut(e) for e in eqns):
            layer, layers = 0, []
            for e in eqns:
                layer += is_layer_cut(e)
                layers.append(None if e.primitive is pipeline_p else layer)
            return LayerAssignment(tuple(layers), None, layer + 1)
        body = [e for e in eqns if e.primitive is not pipeline_p]
        segments = self._clustered(body, "the inference step")
        layer_of = {id(e): layer for layer, seg in enumerate(segments) for e in seg}
        return LayerAssignment(tuple(layer_of.get(id(e)) for e in eqns), None, self.layer_num)


LayerOption = ManualLayerOption | AutoLayerOption


def layer_stats(segments: Segments, where: str) -> str:
    """A table of the layers ``segments`` of ``where``: per layer its equations and FLOPs
    (``global_config.print_auto_layer_stats``)."""
    flops = [sum(eqn_flops(e) for e in layer) for layer in segments]
    total = sum(flops) or 1.0
    lines = [f"AutoLayerOption: {len(segments)} layers of {where}"]
    for i, (layer, work) in enumerate(zip(segments, flops, strict=True)):
        lines.append(
            f"  layer {i}: {len(layer)} equations, {work:.4g} FLOPs ({100 * work / total:.1f} %)"
        )
    return "\n".join(lines)


def resolve_layer_option(option) -> LayerOption:
    """``None`` / ``"manual"`` / a ``ManualLayerOption`` / an ``AutoLayerOption``."""
    if option is None or option == "manual":
        return ManualLayerOption()
    if isinstance(option, ManualLayerOption | AutoLayerOption):
        return option
    raise ValueError(
        f"layer_option must be 'manual', a ManualLayerOption or an AutoLayerOption, got "
        f"{option!r} ({type(option).__name__})"
    )


_active_option: ContextVar[LayerOption | None] = ContextVar("alpa_layer_option", default=None)


@contextlib.contextmanager
def layer_option_context(option) -> Iterator[LayerOption]:
    """Within the ``with`` block, :func:`mark_layers` cuts as ``option`` says."""
    resolved = resolve_layer_option(option)
    token = _active_option.set(resolved)
    try:
        yield resolved
    finally:
        _active_option.reset(token)


def current_layer_option() -> LayerOption:
    """The option of the innermost :func:`layer_option_context` (default: manual)."""
    return _active_option.get() or ManualLayerOption()


def construct_layers(closed_jaxpr: ClosedJaxpr, layer_option) -> LayerAssignment:
    """The layer of every equation of a traced step, as ``layer_option`` says: from the
    markers ``alpa.grad`` left, from the boundaries, or (``AutoLayerOption``, inference)
    by clustering the step's equations."""
    return resolve_layer_option(layer_option).layers(closed_jaxpr)


def is_layer_marker(eqn) -> bool:
    return (
        eqn.primitive is pipeline_p
        and eqn.params["mark_type"] in ("start", "end")
        and eqn.params["name"].startswith(LAYER_PREFIX)
    )


# ----------------------------------------------------------------------------- rewriting


def mark_layers(fun: Callable) -> Callable:
    """``fun`` with every layer wrapped in ``start`` / ``end`` layer markers.

    The layers are cut as the active option says (:func:`layer_option_context`; default:
    at ``fun``'s boundaries). The result computes the same values. Without boundaries in
    ``fun``'s own equations (manual) or with ``layer_num=1`` it is ``fun`` re-evaluated
    from its jaxpr. Arguments that are not arrays (Python numbers, strings) are treated as
    constants of the trace.
    """

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        return current_layer_option().rewrite_loss(fun)(*args, **kwargs)

    return wrapped


def manual_layer_construction(
    fun: Callable | None = None, *, static_argnums: Sequence[int] = (), remat_layer: bool = False
):
    """Alpa's decorator: ``fun`` (a loss function) cut into layers at its
    ``mark_pipeline_boundary()`` calls, each layer wrapped in layer markers.

    It is :func:`mark_layers` with a ``ManualLayerOption`` fixed at decoration, for
    Alpa's programs that decorate the loss and differentiate it with ``jax.grad``
    (``alpa.grad`` applies the method's option by itself). Use as ``@manual_layer_
    construction`` or ``manual_layer_construction(fun, remat_layer=True)``.
    ``static_argnums`` is accepted for Alpa's signature: arguments that are not arrays
    are constants of the trace anyway.
    """
    check_static_argnums(static_argnums, "manual_layer_construction")
    return _decorate(fun, ManualLayerOption(remat_layer=remat_layer))


def automatic_layer_construction(
    fun: Callable | None = None,
    *,
    layer_num: int | None = None,
    remat_layer: bool = False,
    static_argnums: Sequence[int] = (),
    eps: float = 0.6,
    cost_criteria: str = "flops",
):
    """Alpa's decorator: ``fun`` (a loss function) clustered into ``layer_num`` layers
    (``AutoLayerOption``), each wrapped in layer markers; ``remat_layer`` is
    ``remat_mode="coarse_grained_remat"``. Use as
    ``@automatic_layer_construction(layer_num=2)`` or
    ``automatic_layer_construction(fun, layer_num=2)``. Layers balance FLOPs
    (``cost_criteria="flops"``, the only criterion here)."""
    if layer_num is None:
        raise TypeError("automatic_layer_construction needs layer_num (the number of layers)")
    if cost_criteria != "flops":
        raise ValueError(
            f"automatic_layer_construction: cost_criteria={cost_criteria!r} is not supported; "
            "layers balance FLOPs ('flops')"
        )
    option = AutoLayerOption(
        layer_num,
        remat_mode="coarse_grained_remat" if remat_layer else "none",
        layer_eps=eps,
        static_argnums=check_static_argnums(static_argnums, "automatic_layer_construction"),
    )
    return _decorate(fun, option)


def _decorate(fun: Callable | None, option: LayerOption):
    """``fun`` rewritten by ``option`` at every call (or the decorator, without ``fun``)."""

    def decorate(f: Callable) -> Callable:
        if not callable(f):
            raise TypeError(f"a layer construction decorator needs a function, got {f!r}")

        @functools.wraps(f)
        def wrapped(*args, **kwargs):
            with layer_option_context(option):
                return option.rewrite_loss(f)(*args, **kwargs)

        return wrapped

    return decorate if fun is None else decorate(fun)


def _eval_layered(closed: ClosedJaxpr, segments: Segments, args: Sequence) -> list:
    """Evaluate ``closed`` on ``args``, segment ``l`` between ``layer_l`` markers."""
    jaxpr = closed.jaxpr
    env = initial_env(closed, args)
    if len(segments) == 1:
        eval_eqns(segments[0], env)
        return [read(env, v) for v in jaxpr.outvars]

    # Values a marker may carry: floating values (they have tangents) that are traced (a
    # concrete constant stays a constant, which every stage can recompute).
    traced = set(jaxpr.invars) | {
        v for v, c in zip(jaxpr.constvars, closed.consts, strict=True) if isinstance(c, Tracer)
    }
    traced |= {v for eqns in segments for eqn in eqns for v in eqn.outvars}

    def markable(v: Var) -> bool:
        # jax's issubdtype: a PRNG key's dtype is not a numpy dtype.
        return v in traced and jax.dtypes.issubdtype(v.aval.dtype, np.inexact)

    interface = segment_interface(closed, segments)
    for layer, (eqns, (entering, leaving)) in enumerate(zip(segments, interface, strict=True)):
        name = f"{LAYER_PREFIX}{layer}"
        entering = [v for v in entering if markable(v)]
        local = dict(env)
        local.update(
            zip(
                entering,
                mark_pipeline_jaxpreqn([env[v] for v in entering], name, "start"),
                strict=True,
            )
        )
        eval_eqns(eqns, local)
        marked = [v for v in leaving if markable(v)]
        env.update((v, local[v]) for v in leaving)
        env.update(
            zip(
                marked, mark_pipeline_jaxpreqn([local[v] for v in marked], name, "end"), strict=True
            )
        )
    return [read(env, v) for v in jaxpr.outvars]


# ----------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class LayerAssignment:
    """The layer of every equation of a traced step.

    Attributes:
      layers: per equation, its layer, or ``None`` (markers, apply-grad equations, and
        backward equations outside every layer).
      kinds: per equation, ``"forward"``, ``"backward"`` or ``None`` (placed by its data);
        ``None`` as a whole for a step cut by boundaries alone, whose backward equations
        are all placed by their data.
      num_layers: the number of layers.
    """

    layers: tuple[int | None, ...]
    kinds: tuple[EqnKind | None, ...] | None
    num_layers: int


def manual_layers(closed_jaxpr: ClosedJaxpr) -> LayerAssignment:
    """The layer of every equation (see the module docstring).

    Equations after the ``alpa.grad`` marker (apply-grad) get ``None``. Boundaries after
    the marker are an error: they cannot cut a forward pass.
    """
    eqns = closed_jaxpr.jaxpr.eqns
    grad_index = grad_marker_index(eqns)
    grad_index = len(eqns) if grad_index is None else grad_index
    for eqn in eqns[grad_index:]:
        if is_boundary(eqn):
            raise ValueError(
                "mark_pipeline_boundary() was called after alpa.grad: boundaries belong "
                "in the forward pass (the loss function)"
            )
    compute = eqns[:grad_index]
    if not any(is_layer_marker(e) for e in compute):
        return _layers_from_boundaries(eqns, grad_index)
    if any(is_boundary(e) for e in compute):
        raise ValueError(
            "mark_pipeline_boundary() was called both in the function that alpa.grad / "
            "alpa.value_and_grad differentiates and outside it (or inside a jax.jit in "
            "it); call it only in the loss function, outside jitted functions"
        )

    index_of: dict[str, int] = {}
    for eqn in compute:
        if is_layer_marker(eqn) and eqn.params["mark_type"] == "start":
            index_of.setdefault(eqn.params["name"], len(index_of))
    num_layers = len(index_of)
    last = next(name for name, i in index_of.items() if i == num_layers - 1)

    layers: list[int | None] = []
    kinds: list[EqnKind | None] = []
    seen: set[tuple[str, str]] = set()
    forward_layer, backward_layer = 0, None
    in_backward = False
    for eqn in compute:
        if is_layer_marker(eqn):
            name, mark_type = eqn.params["name"], eqn.params["mark_type"]
            layer = index_of[name]
            if (name, mark_type) not in seen:  # the primal marker
                seen.add((name, mark_type))
                forward_layer = layer
                layers.append(layer)
                kinds.append("forward")
                in_backward = in_backward or (name == last and mark_type == "end")
            else:  # the transposed tangent marker
                in_backward = True
                backward_layer = layer if mark_type == "start" else None
                layers.append(layer)
                kinds.append("backward")
            continue
        if not in_backward:
            layers.append(forward_layer)
            kinds.append("forward")
        else:
            layers.append(backward_layer)
            kinds.append(None if backward_layer is None else "backward")
    layers += [None] * (len(eqns) - grad_index)
    kinds += [None] * (len(eqns) - grad_index)
    return LayerAssignment(tuple(layers), tuple(kinds), num_layers)


def _layers_from_boundaries(eqns, grad_index: int) -> LayerAssignment:
    """Equation ``i`` before the ``alpa.grad`` marker belongs to the layer given by the
    number of boundaries before it."""
    layers: list[int | None] = []
    layer = 0
    for i, eqn in enumerate(eqns):
        if is_boundary(eqn):
            layer += 1
            layers.append(None)
            continue
        layers.append(layer if i < grad_index else None)
    return LayerAssignment(tuple(layers), None, layer + 1)
