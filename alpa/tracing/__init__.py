"""Tracing pass: user function -> flat ClosedJaxpr (see ``trace.py``)."""

from alpa.tracing.trace import TracedStep, inline_calls, new_jaxpr, trace_step

__all__ = ["TracedStep", "inline_calls", "new_jaxpr", "trace_step"]
