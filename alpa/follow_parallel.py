"""Alpa's import path of ``FollowParallel``; the code lives in
:mod:`alpa.methods.follow_parallel`. Scripts written for Alpa import from here; nothing
in alpa does (``tests/test_layering.py``)."""

import importlib

_REAL = importlib.import_module("alpa.methods.follow_parallel")


def __getattr__(name: str):
    return getattr(_REAL, name)


def __dir__() -> list[str]:
    return dir(_REAL)
