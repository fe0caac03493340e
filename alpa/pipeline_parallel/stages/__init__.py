"""Stages: the stage DP, its search and its cost model.

Entry point: :func:`alpa.pipeline_parallel.stages.stage_search.plan_stages` (a manual,
uniform or ``AutoStageOption``'s plan of stages on submeshes). The modules:
``stage_search``, ``stage_construction`` (Alpa's stage options, submeshes on the
cluster), ``stage_problem``, ``stage_dp`` (the DP), ``stage_cost`` (the cost model: one
ILP per distinct layer range and submesh), ``layer_facts``, ``stage_work``,
``measured_stage_cost``, ``stage_imbalance``, ``stage_memory_advice``,
``candidate_stages`` (the schedules priced per candidate plan).

Imports the other three sub-packages.
"""
