"""Alpa's import path of ``CreateStateParallel``; the code lives in
:mod:`alpa.methods.create_state_parallel`. Scripts written for Alpa import from here;
nothing in alpa does (``tests/test_layering.py``)."""

import importlib

_REAL = importlib.import_module("alpa.methods.create_state_parallel")


def __getattr__(name: str):
    return getattr(_REAL, name)


def __dir__() -> list[str]:
    return dir(_REAL)
