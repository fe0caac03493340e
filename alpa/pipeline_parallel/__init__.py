"""The inter-operator planner: a step cut into pipeline stages on submeshes.

Entry point: :func:`alpa.pipeline_parallel.pipeshard_passes.plan_pipeshard`, which runs
the passes in order and returns a frozen
:class:`~alpa.pipeline_parallel.pipeshard_plan.PipeshardPlan` without touching a device
(``PipeshardParallel`` in ``alpa/methods/pipeshard_method.py`` calls it). The modules, by part:

* layers: ``layer_construction`` (the entry: ``construct_layers``), ``layer_clustering``,
  ``segments``, ``layer_scans``, ``stacked_rows``, ``remat``, ``layer_facts``;
* stages, the DP, its search and its cost model: ``stage_search`` (the entry:
  ``plan_stages``, a manual or ``AutoStageOption``'s plan), ``stage_construction``,
  ``stage_problem``, ``stage_dp``, ``stage_cost``, ``stage_work``,
  ``measured_stage_cost``, ``stage_imbalance``, ``stage_memory_advice``;
* the split program: ``computation`` (the entry: ``split_computations``),
  ``program_rewrites``, ``weight_split``, ``deferred_sums``, ``user_shardings``,
  ``stage_sharding`` (each stage's ILP, through
  ``shard_parallel.auto_sharding.plan_auto_sharding``), ``propagated_stages``;
* schedules: ``schedules`` (the entry: ``make_schedule``), ``schedule_record``,
  ``schedule_choice``, ``candidate_stages``, then ``runtime_emitter`` (the instruction
  lists);
* the record and its pictures: ``pipeshard_plan``, ``plan_view``; ``primitive_def`` is
  Alpa's import path of the pipeline marker.

Nothing here imports the executables, the saved plan records or a method
(``tests/test_layering.py``); of the runtime it reads the instruction set and the tile
planner.
"""
