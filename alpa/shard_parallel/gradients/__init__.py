"""The gradient rewrites: how a plan's gradients are reduced, scattered and accumulated.

Entry points: :mod:`alpa.shard_parallel.gradients.gradient_sync` (a data-parallel plan's
gradients reduced once per step at the ``alpa.grad`` marker: ``reduce_at_marker``,
``packed_gathers``) and
:func:`alpa.shard_parallel.gradients.gradient_scatter.scattered_in_alpas_order` (Alpa's
``prefer_reduce_scatter`` rewrite of a plan). The modules: ``gradient_sync``,
``gradient_scatter`` (ZeRO's reduce-scatters), ``grad_marking``, ``param_gathers`` (ZeRO-3's
gathers), ``partial_sums`` (an add of two partial results reduced once),
``reduce_scatters``, ``row_sums`` (sums over a split batch dimension, deferred),
``packed_collectives`` (many small collectives as one), ``micro_batches`` (gradient
accumulation's split batch).

Imports ``strategies/`` and its package's records, nothing of ``ilp/`` or ``lowering/``.
"""
