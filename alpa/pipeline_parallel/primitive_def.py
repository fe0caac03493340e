"""Alpa's import path of the pipeline marker (``mark_pipeline_boundary``, ``pipeline_p``);
the primitive is a tracing concept and lives in :mod:`alpa.tracing.primitive_def` (so
that ``tracing/`` and ``shard_parallel/`` never import ``pipeline_parallel/``). Scripts
written for Alpa import from here; nothing in alpa does (``tests/test_layering.py``)."""

from alpa.util import forward_to

__getattr__, __dir__ = forward_to("alpa.tracing.primitive_def")
