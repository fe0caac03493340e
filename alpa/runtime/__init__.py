"""Running what the planners decided: placement of arrays, the instruction set of a
pipelined step, and the two runtimes that execute it.

Entry points: :class:`alpa.runtime.local_runtime.LocalPipelineRuntime` (a pipeline's
instructions run in this process, on local submeshes) and
:class:`alpa.runtime.ray_launch.RayStepLauncher` (a step run by the Ray actors that own
the meshes' devices). The modules, by part:

* the instruction set and what it moves: ``instructions`` (``Op``, written by
  ``pipeline_parallel.runtime_emitter``), ``placement``, ``resharding`` (tile plans of a
  cross-mesh move), ``memory``;
* in process: ``local_runtime``, ``mesh_group``, ``stacked_array``, ``stage_rows``;
* on Ray: ``ray_mesh`` (the cluster and its meshes), ``ray_worker`` (the actor of one
  host of one mesh), ``worker_program`` (what the driver ships it), ``worker_ops`` (one
  handler per worker op), ``worker_transfers`` and ``nccl_transport`` (``SEND`` /
  ``RECV``; NCCL on GPUs), ``ray_launch``, ``distributed_array``, ``remote_arrays``,
  ``checkpoint_parts``;
* measuring the devices: ``device_profiling`` (what a cluster profile is made of).

Nothing here imports tracing, a planner, the executables, the saved plan records or a
method (``tests/test_layering.py``).
"""
