"""Tracing pass: a user's step function to one flat jaxpr.

Entry point: :func:`alpa.tracing.trace.trace_step` (the function and its arguments to a
:class:`~alpa.tracing.trace.TracedStep`, a :class:`~alpa.tracing.trace.StepJaxpr` with the
user's pytrees). The modules: ``trace``, ``jaxpr_util``, ``batch_dims`` and
``batch_draws`` (which values follow the batch), ``flops``, ``primitive_def`` (the pipeline
marker). Imports no planner, runtime, executable, record or method.
"""

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
