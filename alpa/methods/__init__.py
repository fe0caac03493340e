"""The parallel methods: what ``alpa.parallelize(method=...)`` takes.

Entry points: :class:`~alpa.methods.shard_method.ShardParallel` (and ``DataParallel``,
``Zero2Parallel``, ``Zero3Parallel``), :class:`~alpa.methods.pipeshard_method.PipeshardParallel`,
:class:`~alpa.methods.planned_parallel.PlannedParallel` (a saved plan compiled again),
:class:`~alpa.methods.create_state_parallel.CreateStateParallel` and
:class:`~alpa.methods.follow_parallel.FollowParallel`. Each resolves ``devices=``
(``alpa.resolved_cluster``), runs a planner and builds an executable. Users import them
from ``alpa`` or Alpa's path ``alpa.parallel_method``.
"""
