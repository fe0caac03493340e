"""Alpa's import path of ``ParallelPlan`` and its parts; the code lives in
:mod:`alpa.record.parallel_plan`. Scripts written for Alpa import from here; nothing in
alpa does (``tests/test_layering.py``)."""

import importlib

_REAL = importlib.import_module("alpa.record.parallel_plan")


def __getattr__(name: str):
    return getattr(_REAL, name)


def __dir__() -> list[str]:
    return dir(_REAL)
