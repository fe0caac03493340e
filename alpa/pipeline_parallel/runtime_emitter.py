"""Alpa's import path of the instruction emitter; the code lives in
:mod:`alpa.pipeline_parallel.scheduling.runtime_emitter`. Scripts written for Alpa
import from here; nothing in alpa does (``tests/test_layering.py``)."""

import importlib

_REAL = importlib.import_module("alpa.pipeline_parallel.scheduling.runtime_emitter")


def __getattr__(name: str):
    return getattr(_REAL, name)


def __dir__() -> list[str]:
    return dir(_REAL)
