"""What a parallel method compiles a step into: an :class:`~alpa.executables.base.Executable`
per method and runtime (``mesh``: one mesh, in process; ``distributed``: one mesh on Ray
actors; ``pipeshard``: a pipeline, in process; ``pipeshard_ray``: a pipeline on Ray
actors). They sit above the planners and the runtimes, and below the methods."""
