"""The split program: stage computations, their gradients and each stage's sharding.

Entry point: :func:`alpa.pipeline_parallel.program.computation.split_computations` (the
step as forward, backward and apply-grad computations per stage). The modules:
``computation``, ``program_rewrites``, ``weight_split`` (zero-bubble's weight-gradient
parts), ``deferred_sums`` (gradients summed once per step), ``user_shardings``,
``stage_sharding`` (each stage's ILP, through
``shard_parallel.auto_sharding.plan_auto_sharding``), ``propagated_stages``.

Imports ``layers/`` at most; nothing of ``scheduling/`` or ``stages/``.
"""
