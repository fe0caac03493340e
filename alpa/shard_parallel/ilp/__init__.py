"""The ILP that picks one strategy per node of a strategy graph.

Entry point: :func:`alpa.shard_parallel.ilp.ilp_solver.solve` (a strategy graph and a
memory budget to a choice per node, least communication first or the full objective).
The modules: ``ilp_solver``, ``ilp_shrink`` (nodes merged and dominated strategies
dropped before the solve), ``milp`` (the solver backends: HiGHS, CBC), ``memory_model``
(peak memory per device, and the budget loop), ``auto_sharding_solution`` (a solved
choice read back as a ``ShardingPlan``).

Imports ``strategies/`` and its package's records, nothing above.
"""
