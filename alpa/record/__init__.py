"""The saved plan: every decision of a compile, as data and as JSON.

Entry point: :class:`alpa.record.parallel_plan.ParallelPlan` (``executable.
get_parallel_plan()``; ``save`` / ``load``; ``alpa.plan_to_method`` compiles a step from
it again). The modules: ``parallel_plan``, ``plan_json`` (each part's JSON),
``plan_refs`` (values and equations named by position, so a plan binds to a fresh trace).

Imports the planners and the executables' records; no method.
"""
