"""Alpa's import path of the pipeline marker (``mark_pipeline_boundary``, ``pipeline_p``);
the primitive is a tracing concept and lives in :mod:`alpa.tracing.primitive_def` (so
that ``tracing/`` and ``shard_parallel/`` never import ``pipeline_parallel/``). Scripts
written for Alpa import from here; nothing in alpa does (``tests/test_layering.py``)."""

import importlib

_REAL = importlib.import_module("alpa.tracing.primitive_def")


def __getattr__(name: str):
    return getattr(_REAL, name)


def __dir__() -> list[str]:
    return dir(_REAL)
