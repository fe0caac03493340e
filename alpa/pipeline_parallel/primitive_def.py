"""Alpa's module path for the pipeline marker; the primitive is a tracing concept and lives
in :mod:`alpa.tracing.primitive_def` (so that ``tracing/`` and ``shard_parallel/`` never
import ``pipeline_parallel/``). Scripts written for Alpa import it from here."""

from alpa.tracing.primitive_def import (  # noqa: F401
    mark_pipeline_boundary,
    mark_pipeline_jaxpreqn,
    pipeline_p,
)
