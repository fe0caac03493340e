"""The intra-operator planner: one program sharded on one logical mesh.

Entry points: :func:`alpa.shard_parallel.auto_sharding.plan_auto_sharding` (a
:class:`~alpa.tracing.StepJaxpr` and a ``LogicalDeviceMesh`` to a
:class:`~alpa.shard_parallel.sharding_plan.ShardingPlan`, by the ILP, or the fixed plans
of data parallelism and ZeRO its options ask for) and
:func:`alpa.shard_parallel.lowering.compile.compile_plan` (a plan lowered and compiled by XLA).
``ShardParallel`` and the data-parallel methods (``alpa/methods/shard_method.py``) call both; each
pipeline stage is planned by the first (``pipeline_parallel.stage_sharding``). The
modules, by part:

* strategies, per primitive and for the whole jaxpr: ``strategy_rules`` (the registry),
  ``strategy_rules_contraction``, ``strategy_rules_random``, ``strategy_graph`` (the
  entry: ``build_strategy_graph``), ``strategy_graph_bodies``, ``strategy_graph_caches``,
  ``strategy_graph_record``, ``strategy_costs``, ``sharding_spec``;
* the ILP: ``ilp_solver`` (the entry: ``solve``), ``ilp_shrink``, ``milp``,
  ``memory_model``, ``auto_sharding_solution``, ``auto_sharding_option``;
* fixed plans and the gradient rewrites: ``data_parallel``, ``manual_sharding``,
  ``gradient_scatter``, ``gradient_sync``, ``grad_marking``, ``param_gathers``;
* the lowering of a plan: ``lowering`` (the entry: ``build_step_function``),
  ``constrained_eval``, ``partial_sums``, ``reduce_scatters``, ``row_sums``,
  ``packed_collectives``, ``shared_resharding``, ``micro_batches``, then ``compile``;
* the record: ``sharding_plan``.

Nothing here imports the pipeline planner, a runtime, the executables, the saved plan
records or a method (``tests/test_layering.py``).
"""
