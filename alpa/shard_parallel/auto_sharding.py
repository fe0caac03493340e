"""Intra-operator auto-sharding: the entry point of the ILP pass (paper §4, DESIGN §4).

``plan_auto_sharding(traced, logical_mesh, option)`` turns a traced step into a
:class:`~alpa.shard_parallel.sharding_plan.ShardingPlan`: it builds the strategy graph of the
jaxpr, prices every strategy and every resharding with the alpha-beta cost model, and solves
the integer linear program that picks one strategy per value. The passes live in their own
modules; this one holds the options and wires the passes together.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AutoShardingOption:
    """Options of the auto-sharding pass (the fields and meanings of Alpa's option).

    Attributes:
      enable_auto_sharding: run the ILP; ``False`` leaves every intermediate value to XLA and
        replicates inputs that no other option shards.
      prefer_reduce_scatter: when a gradient is reduced, prefer reduce-scatter + all-gather
        (ZeRO-2 style: gradients and optimizer state sharded) over one all-reduce.
      force_batch_dim_to_mesh_dim: split the batch dimension (dim 0 of the batch arguments)
        over this mesh axis (0 or 1); ``None`` lets the solver decide.
      force_data_parallel: shard the batch over every device and replicate the rest; the
        program equals ``DataParallel``'s.
      force_zero_stage_3: shard parameters and optimizer state as ZeRO stage 3 does
        (all-gather parameters before use).
      force_zero_stage_3_all_gather_threshold: in ZeRO-3, parameters smaller than this many
        bytes stay replicated.
      allow_all_gather: strategies that all-gather a value are allowed.
      allow_all_to_all: strategies that need an all-to-all are allowed.
      allow_replicated_parameters: parameters may stay replicated on every device.
      allow_mixed_mesh_shape: one tensor dimension may be split over both mesh axes
        (a 1-D view of a 2-D mesh) in addition to one axis per dimension.
      allow_recompute_heavy_op: heavy ops (dot, conv) may be recomputed on every device
        (replicated compute) instead of being split.
      memory_budget_per_device: bytes each device may hold at any liveness point, or
        ``None`` for no limit.
      logical_mesh_shape: the 2-D shape used to view the devices; default ``(1, n)``.
      mesh_alpha, mesh_beta: alpha-beta parameters per logical mesh axis; default: those
        of the cluster.
      solver_time_limit: seconds for one ILP solve; default ``global_config.ilp_time_limit``.
    """

    enable_auto_sharding: bool = True
    prefer_reduce_scatter: bool = False
    force_batch_dim_to_mesh_dim: int | None = None
    force_data_parallel: bool = False
    force_zero_stage_3: bool = False
    force_zero_stage_3_all_gather_threshold: int = 1 << 25
    allow_all_gather: bool = True
    allow_all_to_all: bool = True
    allow_replicated_parameters: bool = True
    allow_mixed_mesh_shape: bool = False
    allow_recompute_heavy_op: bool = False
    memory_budget_per_device: float | None = None
    logical_mesh_shape: tuple[int, int] | None = None
    mesh_alpha: tuple[float, float] | None = None
    mesh_beta: tuple[float, float] | None = None
    solver_time_limit: float | None = None

    def __post_init__(self):
        for name in (
            "enable_auto_sharding",
            "prefer_reduce_scatter",
            "force_data_parallel",
            "force_zero_stage_3",
            "allow_all_gather",
            "allow_all_to_all",
            "allow_replicated_parameters",
            "allow_mixed_mesh_shape",
            "allow_recompute_heavy_op",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"AutoShardingOption.{name} must be a bool, got {value!r} "
                    f"({type(value).__name__})"
                )
        dim = self.force_batch_dim_to_mesh_dim
        if dim is not None and (isinstance(dim, bool) or dim not in (0, 1)):
            raise ValueError(
                f"AutoShardingOption.force_batch_dim_to_mesh_dim must be None, 0 or 1 "
                f"(a logical mesh axis), got {dim!r}"
            )
        threshold = self.force_zero_stage_3_all_gather_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(
                "AutoShardingOption.force_zero_stage_3_all_gather_threshold must be a "
                f"non-negative int (bytes), got {threshold!r}"
            )
        budget = self.memory_budget_per_device
        if budget is not None and (isinstance(budget, bool) or not budget > 0):
            raise ValueError(
                "AutoShardingOption.memory_budget_per_device must be None or a positive "
                f"number of bytes, got {budget!r}"
            )
        shape = self.logical_mesh_shape
        if shape is not None:
            shape = tuple(shape)
            if len(shape) != 2 or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape
            ):
                raise ValueError(
                    "AutoShardingOption.logical_mesh_shape must be None or two positive "
                    f"ints, got {self.logical_mesh_shape!r}"
                )
            object.__setattr__(self, "logical_mesh_shape", shape)
        for name in ("mesh_alpha", "mesh_beta"):
            value = getattr(self, name)
            if value is None:
                continue
            value = tuple(value)
            if len(value) != 2 or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in value
            ):
                raise ValueError(
                    f"AutoShardingOption.{name} must be None or two non-negative numbers "
                    f"(one per logical mesh axis), got {getattr(self, name)!r}"
                )
            object.__setattr__(self, name, tuple(float(v) for v in value))
        limit = self.solver_time_limit
        if limit is not None and (isinstance(limit, bool) or not limit > 0):
            raise ValueError(
                f"AutoShardingOption.solver_time_limit must be None or positive seconds, "
                f"got {limit!r}"
            )
        if self.force_data_parallel and self.force_zero_stage_3:
            raise ValueError(
                "AutoShardingOption: force_data_parallel and force_zero_stage_3 exclude each other"
            )


def plan_auto_sharding(traced, logical_mesh, option: AutoShardingOption):
    """The ShardingPlan of ``traced`` on ``logical_mesh`` chosen by the ILP."""
    raise NotImplementedError("the auto-sharding ILP lands in the next commit")
