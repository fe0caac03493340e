"""The sharding strategies the ILP chooses among, and the fixed plans.

Entry point: :func:`alpa.shard_parallel.strategies.strategy_graph.build_strategy_graph`
(a jaxpr on a logical mesh to a graph with one node per value and, on each node, its
candidate strategies with their compute, communication and resharding costs). The modules:
``strategy_rules`` (the registry of per-primitive rules), ``strategy_rules_contraction``,
``strategy_rules_random``, ``strategy_graph``, ``strategy_graph_bodies`` (loop, branch and
checkpoint bodies), ``strategy_graph_caches``, ``strategy_graph_record`` (the graph as
data), ``strategy_costs``, ``shared_resharding``, ``sharding_spec`` (Alpa's
``ShardingSpec`` and the layout vocabulary); and the whole-step plans that need no ILP:
``data_parallel`` (data parallel, ZeRO-2/3) and ``manual_sharding`` (the user's specs).

Imports nothing of the other sub-packages; of its package, only the records
(``sharding_plan``, ``auto_sharding_option``).
"""
