"""Schedules: which stage runs which micro-batch when, and the instruction lists.

Entry point: :func:`alpa.pipeline_parallel.scheduling.schedules.make_schedule` (GPipe,
1F1B, ZB-H1, interleaved 1F1B, DualPipeV, inference). The modules: ``schedules``,
``schedule_record``, ``schedule_choice`` (the schedule the search picks, and why),
``runtime_emitter`` (a schedule and the split program to the runtime's instructions),
``plan_view`` (the plan's pictures: devices by stage, the timeline).

Imports ``program/`` and ``layers/``; nothing of ``stages/``.
"""
