"""Layer construction: which pipeline layer every forward equation belongs to.

``ManualLayerOption`` takes the user's cuts: ``alpa.mark_pipeline_boundary()`` calls in
the forward pass split the traced step into ``number of boundaries + 1`` layers, in program
order. Equation ``i`` of the compute-grad part belongs to the layer given by the number of
boundary markers before it; the backward pass, which JAX emits after the whole forward
pass, is placed by ``computation.split_computations``.

Automatic layer construction (``AutoLayerOption``, clustering by FLOPs) is a later issue.
"""

from __future__ import annotations

from dataclasses import dataclass

from jax.extend.core import ClosedJaxpr

from alpa.pipeline_parallel.primitive_def import pipeline_p


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


def manual_layers(closed_jaxpr: ClosedJaxpr) -> tuple[list[int | None], int]:
    """The layer of every equation before the ``alpa.grad`` marker, and the layer count.

    Equations after the marker (apply-grad) get ``None``. Boundaries after the marker are
    an error: they cannot cut a forward pass.
    """
    layers: list[int | None] = []
    layer = 0
    after_grad = False
    for eqn in closed_jaxpr.jaxpr.eqns:
        if eqn.primitive is pipeline_p and eqn.params["mark_type"] == "grad":
            after_grad = True
            layers.append(None)
            continue
        if is_boundary(eqn):
            if after_grad:
                raise ValueError(
                    "mark_pipeline_boundary() was called after alpa.grad: boundaries belong "
                    "in the forward pass (the loss function)"
                )
            layer += 1
            layers.append(None)
            continue
        layers.append(None if after_grad else layer)
    return layers, layer + 1
