"""Alpa's import path of the layer options and the ``manual_layer_construction`` /
``automatic_layer_construction`` decorators; the code lives in
:mod:`alpa.pipeline_parallel.layers.layer_construction`. Scripts written for Alpa import
from here; nothing in alpa does (``tests/test_layering.py``)."""

import importlib

_REAL = importlib.import_module("alpa.pipeline_parallel.layers.layer_construction")


def __getattr__(name: str):
    return getattr(_REAL, name)


def __dir__() -> list[str]:
    return dir(_REAL)
