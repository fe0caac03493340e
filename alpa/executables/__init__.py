"""What a parallel method compiles a step into: an :class:`~alpa.executables.base.Executable`
per method and runtime (``mesh``: one mesh, in process; ``distributed``: one mesh on Ray
actors; ``pipeshard``: a pipeline, in process; ``pipeshard_ray``: a pipeline on Ray
actors). They sit above the planners and the runtimes, and below the methods.

Entry points: :class:`~alpa.executables.mesh.MeshExecutable`,
:class:`~alpa.executables.distributed.DistributedMeshExecutable`,
:class:`~alpa.executables.pipeshard.PipeshardDriverExecutable` and
:class:`~alpa.executables.pipeshard_ray.PipeshardRayExecutable` (both on
``pipeshard_base.PipeshardExecutable``); ``stage_programs`` lowers a pipeline's stage
computations, ``worker_projection`` holds the Ray workers' instruction handlers."""
