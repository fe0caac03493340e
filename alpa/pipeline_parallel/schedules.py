"""Alpa's import path of the schedules (``GpipeSchedule``, ``PipeDreamFlush``,
``gen_linear_pipeline_dependency``); the code lives in
:mod:`alpa.pipeline_parallel.scheduling.schedules`. Scripts written for Alpa import from
here; nothing in alpa does (``tests/test_layering.py``)."""

from alpa.util import forward_to

__getattr__, __dir__ = forward_to("alpa.pipeline_parallel.scheduling.schedules")
