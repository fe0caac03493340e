"""Tracing pass: user function -> flat ClosedJaxpr (see ``trace.py``)."""

from alpa.tracing.jaxpr_util import grad_marker_index, is_grad_marker, is_var, nbytes
from alpa.tracing.trace import (
    StepJaxpr,
    TracedStep,
    abstractify,
    inline_calls,
    leaf_signature,
    mark_outputs_as_gradients,
    new_jaxpr,
    note_grad_inputs,
    trace_step,
)

__all__ = [
    "StepJaxpr",
    "TracedStep",
    "grad_marker_index",
    "is_grad_marker",
    "is_var",
    "nbytes",
    "abstractify",
    "inline_calls",
    "leaf_signature",
    "mark_outputs_as_gradients",
    "new_jaxpr",
    "note_grad_inputs",
    "trace_step",
]
