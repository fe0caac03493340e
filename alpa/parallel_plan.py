"""Alpa's import path of ``ParallelPlan`` and its parts; the code lives in
:mod:`alpa.record.parallel_plan`. Scripts written for Alpa import from here; nothing in
alpa does (``tests/test_layering.py``)."""

from alpa.util import forward_to

__getattr__, __dir__ = forward_to("alpa.record.parallel_plan")
