"""Alpa's import path of the stage options (``AutoStageOption``, ``ManualStageOption``,
``UniformStageOption``) and ``get_last_dp_result``; the code lives in
:mod:`alpa.pipeline_parallel.stages.stage_construction`. Scripts written for Alpa import
from here; nothing in alpa does (``tests/test_layering.py``)."""

from alpa.util import forward_to

__getattr__, __dir__ = forward_to("alpa.pipeline_parallel.stages.stage_construction")
