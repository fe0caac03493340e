"""Tracing pass: user function -> flat ClosedJaxpr (see ``trace.py``)."""

from alpa.tracing.trace import (
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
    "TracedStep",
    "abstractify",
    "inline_calls",
    "leaf_signature",
    "mark_outputs_as_gradients",
    "new_jaxpr",
    "note_grad_inputs",
    "trace_step",
]
