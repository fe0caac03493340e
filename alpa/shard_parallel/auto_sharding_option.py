"""``AutoShardingOption``: the options of the auto-sharding pass, Alpa's mutable object.

Users build one and assign fields, as Alpa's programs do; each assignment is checked at
once (the field named, a bad value refused), and a compiling method takes a frozen
snapshot (:func:`snapshot_for_compile`), so that a later assignment never changes a
compiled plan silently. Alpa's programs import it from ``alpa.shard_parallel.auto_sharding``
(and ``alpa``), which re-export it.
"""

from __future__ import annotations

import warnings
from dataclasses import FrozenInstanceError, dataclass, fields


def _check_bool(name: str, value):
    if not isinstance(value, bool):
        raise TypeError(
            f"AutoShardingOption.{name} must be a bool, got {value!r} ({type(value).__name__})"
        )
    return value


def _check_batch_dim(name: str, dim):
    if dim is not None and (isinstance(dim, bool) or dim not in (-1, 0, 1)):
        raise ValueError(
            f"AutoShardingOption.{name} must be None (Alpa's default), -1 (never forced), "
            f"0 or 1 (a logical mesh axis), got {dim!r}"
        )
    return dim


def _check_threshold(name: str, threshold):
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ValueError(
            f"AutoShardingOption.{name} must be a non-negative int (bytes), got {threshold!r}"
        )
    return threshold


def _positive_or_none(what: str):
    """The check of a field that is ``None`` or a positive number (``what`` it counts)."""

    def check(name: str, value):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
        ):
            raise ValueError(f"AutoShardingOption.{name} must be None or {what}, got {value!r}")
        return value

    return check


_check_budget = _positive_or_none("a positive number of bytes")
_check_time_limit = _positive_or_none("positive seconds")


def _pair(value, element_ok) -> tuple | None:
    """``value`` as a tuple of two elements that pass ``element_ok``, else ``None``."""
    try:
        pair = tuple(value)
    except TypeError:
        return None
    ok = len(pair) == 2 and all(not isinstance(v, bool) and element_ok(v) for v in pair)
    return pair if ok else None


def _check_mesh_shape(name: str, shape):
    if shape is None:
        return None
    dims = _pair(shape, lambda d: isinstance(d, int) and d >= 1)
    if dims is None:
        raise ValueError(
            f"AutoShardingOption.{name} must be None or two positive ints, got {shape!r}"
        )
    return dims


def _check_alpha_beta(name: str, value):
    if value is None:
        return None
    pair = _pair(value, lambda v: isinstance(v, int | float) and v >= 0)
    if pair is None:
        raise ValueError(
            f"AutoShardingOption.{name} must be None or two non-negative numbers "
            f"(one per logical mesh axis), got {value!r}"
        )
    return tuple(float(v) for v in pair)


#: Per field, the check an assignment goes through (it returns the value to store).
_FIELD_CHECKS = {
    "enable_auto_sharding": _check_bool,
    "prefer_reduce_scatter": _check_bool,
    "force_batch_dim_to_mesh_dim": _check_batch_dim,
    "force_data_parallel": _check_bool,
    "force_zero_stage_3": _check_bool,
    "force_zero_stage_3_all_gather_threshold": _check_threshold,
    "allow_all_gather": _check_bool,
    "allow_all_to_all": _check_bool,
    "allow_replicated_parameters": _check_bool,
    "allow_mixed_mesh_shape": _check_bool,
    "allow_recompute_heavy_op": _check_bool,
    "memory_budget_per_device": _check_budget,
    "logical_mesh_shape": _check_mesh_shape,
    "mesh_alpha": _check_alpha_beta,
    "mesh_beta": _check_alpha_beta,
    "solver_time_limit": _check_time_limit,
}


@dataclass
class AutoShardingOption:
    """Options of the auto-sharding pass (the fields and meanings of Alpa's option).

    As in Alpa, an option is a mutable object: users build one and assign fields
    (``option.prefer_reduce_scatter = True``) before passing it to a method, or while a
    method holds it. Each assignment is checked at once (the field named, a bad value
    refused, the option left as it was). A method that compiles takes a
    :meth:`snapshot`, a frozen copy, so the plan it compiled never changes under it; an
    assignment to an option some compilation already snapshotted warns that compiled
    executables keep the old value.

    Attributes:
      enable_auto_sharding: run the ILP; ``False`` leaves every intermediate value to XLA and
        replicates inputs that no other option shards.
      prefer_reduce_scatter: offer the ILP reduce-scatter + all-gather where a contraction
        reduces (ZeRO-2 style: gradients and optimizer state sharded, the update on 1/n of
        each parameter) besides one all-reduce; with ``force_data_parallel``, the
        ``Zero2Parallel`` plan. The compiled program has real reduce-scatters.
      force_batch_dim_to_mesh_dim: split the batch dimension over this mesh axis (0 or 1):
        dim 0 of the batch arguments, and the batch dimension of every value computed from
        them (found by tracing the step at a smaller batch). ``None``, Alpa's default: axis
        0 on a logical mesh whose two axes both have more than one device (when the
        step's batch splits over it), else the solver decides; ``-1``: the solver always
        decides (:func:`auto_sharding.forced_batch_axis`).
      force_data_parallel: shard the batch over every device and replicate the rest; the
        program equals ``DataParallel``'s (``Zero2Parallel``'s with
        ``prefer_reduce_scatter``).
      force_zero_stage_3: shard parameters and optimizer state as ZeRO stage 3 does
        (all-gather parameters before their use in the forward pass, and again before
        the backward pass reads them: ``param_gathers``).
      force_zero_stage_3_all_gather_threshold: the bytes of whole tensors that one packed
        all-gather of ZeRO-3's parameters may hold, as Alpa's combiner bound them
        (``ShardingPlan.gather_bound``). :func:`auto_sharding.solve_jaxpr` asked directly with
        ``force_zero_stage_3`` also reads it, as the size from which a parameter must be
        split over every device.
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
        self._check_together()

    def _check_together(self) -> None:
        if self.force_data_parallel and self.force_zero_stage_3:
            raise ValueError(
                "AutoShardingOption: force_data_parallel and force_zero_stage_3 exclude each other"
            )

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_frozen", False):
            raise FrozenInstanceError(
                f"cannot assign AutoShardingOption.{name}: this option is the frozen snapshot "
                "a compilation took; assign the field on the option you passed to the method "
                "(its next compilation takes a new snapshot)"
            )
        check = _FIELD_CHECKS.get(name)
        if check is None:
            raise AttributeError(
                f"AutoShardingOption has no field {name!r}; its fields are "
                f"{', '.join(sorted(_FIELD_CHECKS))}"
            )
        value = check(name, value)
        if self.__dict__.get("_snapshotted", False) and self.__dict__.get(name) != value:
            warnings.warn(
                f"AutoShardingOption.{name} was set after a method compiled a step with this "
                "option: executables already compiled keep the old option "
                "(alpa.clear_executable_cache() recompiles them)",
                UserWarning,
                stacklevel=2,
            )
        object.__setattr__(self, name, value)

    def __hash__(self) -> int:
        if not self.__dict__.get("_frozen", False):
            raise TypeError(
                "an AutoShardingOption is mutable, hence unhashable; hash its snapshot()"
            )
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    @property
    def frozen(self) -> bool:
        """Whether this option is a snapshot (assignments raise)."""
        return self.__dict__.get("_frozen", False)

    def snapshot(self) -> AutoShardingOption:
        """A frozen, hashable copy of the option as it is now: what a compilation plans
        with, so that a later assignment to this option never changes a compiled plan.
        The fields are checked together here (each assignment checked its own)."""
        if self.force_data_parallel and self.force_zero_stage_3:
            raise ValueError(
                "AutoShardingOption: force_data_parallel and force_zero_stage_3 exclude each other"
            )
        if self.frozen:
            return self
        copy = object.__new__(type(self))
        copy.__dict__.update({f.name: getattr(self, f.name) for f in fields(self)}, _frozen=True)
        return copy


def snapshot_for_compile(option: AutoShardingOption) -> AutoShardingOption:
    """``option.snapshot()``, remembering on ``option`` that a compilation took it: a later
    assignment to ``option`` then warns that compiled executables keep the old value."""
    frozen = option.snapshot()
    if frozen is not option:
        object.__setattr__(option, "_snapshotted", True)
    return frozen
