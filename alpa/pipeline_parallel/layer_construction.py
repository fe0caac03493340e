"""Layer construction: cut a step into pipeline layers, in the forward and backward pass.

``ManualLayerOption`` takes the user's cuts: ``alpa.mark_pipeline_boundary()`` calls split
the forward pass into ``number of boundaries + 1`` layers, in program order.

A boundary binds a marker with no operands, and JAX's AD carries an equation without
operands into the forward sweep only, so the backward pass would keep no trace of the cut.
:func:`mark_layers` (applied by ``alpa.grad`` / ``alpa.value_and_grad`` before they
differentiate, as in Alpa's ``layer_construction``) therefore rewrites the loss function:
it traces it to a jaxpr, cuts the equations at the boundaries into layers and re-evaluates
them with every layer wrapped in a ``start`` marker on the values that enter it and an
``end`` marker on the values that leave it::

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

Automatic layer construction (``AutoLayerOption``, clustering by FLOPs) is a later issue.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Var
from jax.extend.core import Literal as JaxLiteral

from alpa.tracing.primitive_def import mark_pipeline_jaxpreqn, pipeline_p

LAYER_PREFIX = "layer_"

EqnKind = Literal["forward", "backward"]


@dataclass(frozen=True)
class ManualLayerOption:
    """Layers are the parts between the user's ``mark_pipeline_boundary()`` calls.

    Attributes:
      remat_layer: each stage's backward recomputes the forward activations of its
        stage instead of keeping them from the forward (``computation.rematerialize``).
    """

    remat_layer: bool = False

    def __post_init__(self):
        if not isinstance(self.remat_layer, bool):
            raise ValueError(f"remat_layer must be a bool, got {self.remat_layer!r}")


def resolve_layer_option(option) -> ManualLayerOption:
    """``None`` / ``"manual"`` / a ``ManualLayerOption``."""
    if option is None or option == "manual":
        return ManualLayerOption()
    if isinstance(option, ManualLayerOption):
        return option
    raise ValueError(
        f"layer_option must be 'manual' or a ManualLayerOption, got {option!r} "
        f"({type(option).__name__})"
    )


def is_boundary(eqn) -> bool:
    return eqn.primitive is pipeline_p and eqn.params["mark_type"] == "boundary"


def is_layer_marker(eqn) -> bool:
    return (
        eqn.primitive is pipeline_p
        and eqn.params["mark_type"] in ("start", "end")
        and eqn.params["name"].startswith(LAYER_PREFIX)
    )


# ----------------------------------------------------------------------------- rewriting


def mark_layers(fun: Callable) -> Callable:
    """``fun`` with its boundaries replaced by layer ``start`` / ``end`` markers.

    The result computes the same values. Without boundaries in ``fun``'s own equations it
    is ``fun`` re-evaluated from its jaxpr. Arguments that are not arrays (Python numbers,
    strings) are treated as constants of the trace.
    """

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        leaves, tree = jax.tree.flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array | np.ndarray)]

        def flat_fun(*values):
            full = list(leaves)
            for i, value in zip(dynamic, values, strict=True):
                full[i] = value
            call_args, call_kwargs = jax.tree.unflatten(tree, full)
            return fun(*call_args, **call_kwargs)

        values = [leaves[i] for i in dynamic]
        closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*values)
        outs = _eval_layered(closed, values)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return wrapped


def _eval_layered(closed: ClosedJaxpr, args) -> list:
    jaxpr = closed.jaxpr
    segments: list[list] = [[]]
    for eqn in jaxpr.eqns:
        if is_boundary(eqn):
            segments.append([])
        else:
            segments[-1].append(eqn)
    env: dict = dict(zip(jaxpr.invars, args, strict=True))
    env.update(zip(jaxpr.constvars, closed.consts, strict=True))
    if len(segments) == 1:
        _eval_eqns(segments[0], env)
        return [_read(env, v) for v in jaxpr.outvars]

    # Values a marker may carry: floating values (they have tangents) that are traced (a
    # concrete constant stays a constant, which every stage can recompute).
    traced = set(jaxpr.invars) | {
        v
        for v, c in zip(jaxpr.constvars, closed.consts, strict=True)
        if isinstance(c, jax.core.Tracer)
    }
    layer_of: dict[Var, int] = {}
    for layer, eqns in enumerate(segments):
        for eqn in eqns:
            for v in eqn.outvars:
                layer_of[v] = layer
                traced.add(v)
    read_by: dict[Var, set[int]] = {}
    for layer, eqns in enumerate(segments):
        for eqn in eqns:
            for v in eqn.invars:
                if isinstance(v, Var) and not isinstance(v, JaxLiteral):
                    read_by.setdefault(v, set()).add(layer)
    outputs = {v for v in jaxpr.outvars if isinstance(v, Var) and not isinstance(v, JaxLiteral)}

    def markable(v) -> bool:
        return v in traced and np.issubdtype(np.dtype(v.aval.dtype), np.inexact)

    for layer, eqns in enumerate(segments):
        name = f"{LAYER_PREFIX}{layer}"
        entering = _unique(
            v
            for eqn in eqns
            for v in eqn.invars
            if isinstance(v, Var) and not isinstance(v, JaxLiteral) and layer_of.get(v) != layer
        )
        entering = [v for v in entering if markable(v)]
        local = dict(env)
        local.update(
            zip(
                entering,
                mark_pipeline_jaxpreqn([env[v] for v in entering], name, "start"),
                strict=True,
            )
        )
        _eval_eqns(eqns, local)
        leaving = _unique(
            v
            for eqn in eqns
            for v in eqn.outvars
            if v in outputs or any(r > layer for r in read_by.get(v, ()))
        )
        marked = [v for v in leaving if markable(v)]
        env.update((v, local[v]) for v in leaving)
        env.update(
            zip(
                marked, mark_pipeline_jaxpreqn([local[v] for v in marked], name, "end"), strict=True
            )
        )
    return [_read(env, v) for v in jaxpr.outvars]


def _unique(values) -> list:
    return list(dict.fromkeys(values))


def _read(env, v):
    return v.val if isinstance(v, JaxLiteral) else env[v]


def _eval_eqns(eqns, env: dict) -> None:
    for eqn in eqns:
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(
                *[_read(env, v) for v in eqn.invars], **eqn.primitive.get_bind_params(eqn.params)
            )
        if not eqn.primitive.multiple_results:
            outs = [outs]
        env.update(zip(eqn.outvars, outs, strict=True))


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
    grad_index = next(
        (
            i
            for i, e in enumerate(eqns)
            if e.primitive is pipeline_p and e.params["mark_type"] == "grad"
        ),
        len(eqns),
    )
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
