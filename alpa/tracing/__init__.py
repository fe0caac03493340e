"""Tracing pass: user function -> flat ClosedJaxpr (see ``trace.py``)."""

from alpa.tracing.trace import TracedStep, inline_calls, trace_step

__all__ = ["TracedStep", "inline_calls", "trace_step"]
