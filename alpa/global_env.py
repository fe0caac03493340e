"""Process-wide settings: the one documented place for them.

Every setting can be assigned in code (``alpa.global_config.print_compilation_time =
True``) and many are read, when alpa is imported, from the environment variable named in
their comment. Each value is checked where it enters: an assignment of the wrong type or
out of range raises at once, naming the setting, the value and what was expected; a bad
environment variable raises at import, naming the variable. Nothing else in alpa keeps
mutable process-wide state, apart from the cluster that ``alpa.init`` connects to.

**Alpa's settings.** ``global_config`` accepts every setting Alpa's had (Alpa 0.2.3,
``alpa/global_env.py``), so that Alpa's scripts and benchmark drivers run unchanged. A
setting either means here what it meant in Alpa, or is a documented no-op: its comment
starts with "No-op here:" and says why (most of them steer Alpa's NCCL runtime or its
stage profiler, which this alpa does differently). Settings of older Alpa releases that
Alpa 0.2.3 no longer had (:data:`RETIRED_SETTINGS`) are accepted and ignored with a
warning, as Alpa 0.2.3 ignored them. Any other name raises ``AttributeError``: a misspelt
setting would otherwise be stored and never read.

:func:`set_seed` sets ``global_config.seed`` and seeds numpy's and Python's generators.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

# ----------------------------------------------------------------------------- kinds of value


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class _Bool:
    """``True`` or ``False`` (numpy's bools too); from the environment ``1/true/yes/on``
    or ``0/false/no/off/`` (any case)."""

    expected = "True or False"
    env_expected = "one of 1, true, yes, on, 0, false, no, off (any case), or empty"

    def check(self, value: Any) -> bool:
        if isinstance(value, bool | np.bool_):
            return bool(value)
        raise TypeError

    def parse(self, text: str) -> bool:
        text = text.strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ValueError


@dataclass(frozen=True)
class _Number:
    """A number (``integer``: an int) in a range: above ``low`` (or at it, unless
    ``strict``), at most ``high``; ``inf`` allowed only with ``allow_inf``."""

    low: float
    high: float | None = None
    integer: bool = False
    strict: bool = False
    allow_inf: bool = False

    @property
    def expected(self) -> str:
        what = "an int" if self.integer else "a number"
        if self.high is not None:
            left = "(" if self.strict else "["
            return f"{what} in {left}{self.low:g}, {self.high:g}]"
        return f"{what} {'>' if self.strict else '>='} {self.low:g}" + (
            " (inf: no limit)" if self.allow_inf else ""
        )

    env_expected = expected

    def check(self, value: Any) -> int | float:
        if isinstance(value, bool | np.bool_):
            raise TypeError
        if self.integer:
            if not isinstance(value, int | np.integer):
                raise TypeError
            value = int(value)
        else:
            if not isinstance(value, int | float | np.integer | np.floating):
                raise TypeError
            value = float(value)
            if math.isnan(value) or (math.isinf(value) and not self.allow_inf):
                raise ValueError
        if value < self.low or (self.strict and value == self.low):
            raise ValueError
        if self.high is not None and value > self.high:
            raise ValueError
        return value

    def parse(self, text: str) -> int | float:
        return self.check(int(text) if self.integer else float(text))


@dataclass(frozen=True)
class _Choice:
    """One of ``options`` (strings)."""

    options: tuple[str, ...]

    @property
    def expected(self) -> str:
        return "one of " + ", ".join(repr(o) for o in self.options)

    env_expected = expected

    def check(self, value: Any) -> str:
        if not isinstance(value, str):
            raise TypeError
        if value not in self.options:
            raise ValueError
        return value

    def parse(self, text: str) -> str:
        return self.check(text.strip())


@dataclass(frozen=True)
class _BoolText:
    """Alpa kept some JAX environment switches as the strings ``"true"`` / ``"false"``;
    a bool is taken as its string."""

    expected = "'true' or 'false' (or a bool)"
    env_expected = "'true' or 'false'"

    def check(self, value: Any) -> str:
        if isinstance(value, bool | np.bool_):
            return "true" if value else "false"
        if not isinstance(value, str):
            raise TypeError
        if value.strip().lower() not in ("true", "false"):
            raise ValueError
        return value.strip().lower()

    def parse(self, text: str) -> str:
        return self.check(text)


@dataclass(frozen=True)
class _Path:
    """A non-empty path (``str`` or ``os.PathLike``), kept as a ``str``."""

    expected = "a non-empty path (str or os.PathLike)"
    env_expected = "a non-empty path"

    def check(self, value: Any) -> str:
        if not isinstance(value, str | os.PathLike):
            raise TypeError
        value = os.fspath(value)
        if not isinstance(value, str):
            raise TypeError
        if not value:
            raise ValueError
        return value

    def parse(self, text: str) -> str:
        return self.check(text)


@dataclass(frozen=True)
class _ClusterProfile:
    """``None``, the path of a profile file (kept as a ``str``), a
    ``cost_profile.ClusterProfile`` or a ``mesh_profiling.ProfilingResultDatabase``."""

    expected = (
        "None, the path of a cluster profile file, a ClusterProfile or a ProfilingResultDatabase"
    )
    env_expected = "the path of a cluster profile file (empty: none)"

    def check(self, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str | os.PathLike):
            return _Path().check(value)
        from alpa.cost_profile import ClusterProfile

        if isinstance(value, ClusterProfile) or isinstance(getattr(value, "data", None), dict):
            return value
        raise TypeError

    def parse(self, text: str) -> Any:
        return self.check(text) if text.strip() else None


@dataclass(frozen=True)
class _SubmeshShapes:
    """``None``, or a non-empty sequence of ``(num_hosts, num_devices_per_host)`` pairs
    of positive ints, kept as a tuple of tuples."""

    expected = "None or a sequence of (num_hosts, num_devices_per_host) pairs of positive ints"

    def check(self, value: Any) -> tuple[tuple[int, int], ...] | None:
        if value is None:
            return None
        if isinstance(value, str) or not hasattr(value, "__iter__"):
            raise TypeError
        shapes = []
        for shape in value:
            if isinstance(shape, str) or not hasattr(shape, "__len__") or len(shape) != 2:
                raise TypeError
            pair = []
            for n in shape:
                if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
                    raise ValueError
                pair.append(int(n))
            shapes.append(tuple(pair))
        if not shapes:
            raise ValueError
        return tuple(shapes)


def _setting(default: Any, kind: Any, env: str | None = None, invert_env: bool = False):
    """A field of :class:`GlobalConfig`: its default (a value, or a function of none),
    its kind (how a value is checked), and the environment variable it is read from."""
    make = default if callable(default) else (lambda: default)
    return field(default_factory=make, metadata={"kind": kind, "env": env, "invert": invert_env})


_BOOL = _Bool()
_POSITIVE = _Number(0.0, strict=True)
_TIMEOUT = _Number(0.0, strict=True, allow_inf=True)
_COUNT = _Number(0, integer=True)
_SEED = _Number(0, 2**32 - 1, integer=True)
_PORT = _Number(1, 65535, integer=True)

#: Whether this machine has NVIDIA GPUs (``nvidia-smi`` on the path), as Alpa's
#: ``has_cuda`` tested it.
_HAS_CUDA = shutil.which("nvidia-smi") is not None


# ----------------------------------------------------------------------------- the settings


@dataclass
class GlobalConfig:
    """Settings that apply to every compilation in this process (module docstring)."""

    # -- this alpa's own settings

    #: Print which strategy the auto-sharding pass chose for every value, as a table.
    #: Environment: ``ALPA_DEBUG_PRINT_AS_STRATEGY=1``.
    print_auto_sharding_strategy: bool = _setting(False, _BOOL, "ALPA_DEBUG_PRINT_AS_STRATEGY")
    #: Log how long tracing, planning and XLA compilation took for each new executable
    #: (Alpa's setting, the same meaning). Environment: ``ALPA_PRINT_COMPILATION_TIME=1``.
    print_compilation_time: bool = _setting(False, _BOOL, "ALPA_PRINT_COMPILATION_TIME")
    #: Time limit (seconds) for one ILP solve of the auto-sharding pass.
    #: Environment: ``ALPA_ILP_TIME_LIMIT``.
    ilp_time_limit: float = _setting(60.0, _POSITIVE, "ALPA_ILP_TIME_LIMIT")
    #: The MILP solver of the auto-sharding ILP: ``"highs"`` (HiGHS in this process, the
    #: default) or ``"cbc"`` (CBC through PuLP). Environment: ``ALPA_ILP_SOLVER``.
    ilp_solver: str = _setting("highs", _Choice(("highs", "cbc")), "ALPA_ILP_SOLVER")
    #: Show tqdm progress bars (planning, profiling). ``alpa.util.disable_tqdm_globally()``
    #: turns them off. Environment: ``ALPA_DISABLE_TQDM=1`` turns them off.
    use_tqdm: bool = _setting(True, _BOOL, "ALPA_DISABLE_TQDM", invert_env=True)
    #: Folder for on-disk caches (measured stage costs). Environment: ``ALPA_CACHE_DIR``.
    cache_dir: str = _setting(
        lambda: os.path.join(os.path.expanduser("~"), ".cache", "alpa"), _Path(), "ALPA_CACHE_DIR"
    )
    #: The seed that :func:`set_seed` last set: the default ``seed`` of the
    #: ``alpa.testing`` helpers. It does not reach ``jax.random``, whose keys stay
    #: explicit. Environment: ``ALPA_SEED`` (sets this field only; numpy and Python are
    #: seeded by :func:`set_seed` alone).
    seed: int = _setting(0, _SEED, "ALPA_SEED")
    #: The cluster profile plans are priced with (``alpa.mesh_profiling.profile_all``
    #: writes one): the path of a profile file (its entry for this process's devices is
    #: used), a ``cost_profile.ClusterProfile`` or a ``ProfilingResultDatabase``; ``None``
    #: (default) prices with the presets' datasheet figures. Read by
    #: ``ClusterSpec.local()`` (and a Ray cluster's spec) whenever a plan is made.
    #: Environment: ``ALPA_CLUSTER_PROFILE`` (a path; empty: none).
    cluster_profile: Any = _setting(None, _ClusterProfile(), "ALPA_CLUSTER_PROFILE")
    #: Seconds the driver waits for Ray mesh workers to answer one call (a step, a
    #: compile, a fetch, a checkpoint part) before it raises, naming the mesh and host,
    #: and aborts the step on the others (``inf``: no limit). A dead worker is reported
    #: within seconds regardless; this bounds a worker that hangs. Environment:
    #: ``ALPA_RAY_WORKER_TIMEOUT``.
    ray_worker_timeout: float = _setting(3600.0, _TIMEOUT, "ALPA_RAY_WORKER_TIMEOUT")
    #: Seconds ``alpa.init("ray", cluster_address=...)`` waits for the address to accept a
    #: connection before it raises ``ConnectionError`` naming it (Ray itself retries an
    #: address that does not answer without limit). Environment: ``ALPA_RAY_CONNECT_TIMEOUT``.
    ray_connect_timeout: float = _setting(10.0, _TIMEOUT, "ALPA_RAY_CONNECT_TIMEOUT")

    # -- Alpa's settings: devices and Ray workers

    #: Alpa's accelerator backend (``"gpu"``; ``"tpu"`` for its TPU path). No-op here:
    #: alpa reads the platform off the devices it is given (``jax.devices()``, or a Ray
    #: node's GPUs); the default says what this machine has (``"gpu"`` with
    #: ``nvidia-smi``, else ``"cpu"``).
    backend: str = _setting(lambda: "gpu" if _HAS_CUDA else "cpu", _Choice(("gpu", "tpu", "cpu")))
    #: Whether ``nvidia-smi`` is on this machine's path, as Alpa computed it.
    #: Informational; alpa does not read it.
    has_cuda: bool = _setting(lambda: _HAS_CUDA, _BOOL)
    #: The fraction of a GPU's memory XLA preallocates, given to Ray mesh workers on GPUs
    #: as ``XLA_PYTHON_CLIENT_MEM_FRACTION`` when they start (as in Alpa). In this process
    #: JAX reads that variable itself when its GPU backend starts, so assigning it here
    #: later changes nothing. Environment: ``XLA_PYTHON_CLIENT_MEM_FRACTION``.
    xla_client_mem_fraction: float = _setting(
        0.9, _Number(0.0, 1.0, strict=True), "XLA_PYTHON_CLIENT_MEM_FRACTION"
    )
    #: Whether XLA preallocates GPU memory (``"true"`` / ``"false"``), given to Ray mesh
    #: workers on GPUs as ``XLA_PYTHON_CLIENT_PREALLOCATE`` (as in Alpa).
    #: Environment: ``XLA_PYTHON_CLIENT_PREALLOCATE``.
    xla_client_client_preallocate: str = _setting(
        "true", _BoolText(), "XLA_PYTHON_CLIENT_PREALLOCATE"
    )
    #: XLA's GPU kernel autotuning level (0-4), given to Ray mesh workers on GPUs as
    #: ``--xla_gpu_autotune_level`` in their ``XLA_FLAGS`` (as in Alpa). For this process's
    #: own GPUs, put the flag in ``XLA_FLAGS`` before JAX starts.
    xla_gpu_autotune_level: int = _setting(4, _Number(0, 4, integer=True))
    #: Run NCCL over AWS EFA: Ray mesh workers on GPUs get ``FI_PROVIDER=efa``,
    #: ``FI_EFA_USE_DEVICE_RDMA=1``, ``NCCL_PROTO=simple`` and the driver's
    #: ``LD_LIBRARY_PATH`` (as in Alpa). Environment: ``ALPA_USE_AWS_EFA=1``.
    use_aws_efa: bool = _setting(False, _BOOL, "ALPA_USE_AWS_EFA")
    #: How many arrays the driver lets go of before it tells a mesh's workers to free
    #: them, in one message (``0`` or ``1``: at once). Alpa's batched deletion, the same
    #: meaning.
    delete_remote_arrays_threshold: int = _setting(50, _COUNT)
    #: No-op here: Alpa seeded the randomness of its compilation passes with it; alpa's
    #: planning is deterministic (the ILP and the stage DP break ties by order).
    compile_random_seed: int = _setting(42, _SEED)
    #: The seed Alpa's stateful ``jax.random`` replacement drew from; :func:`set_seed`
    #: sets it as Alpa's did. No-op here beyond that: random numbers in a parallelized
    #: function come from the ``jax.random`` keys it is passed, as under ``jax.jit``.
    runtime_random_seed: int = _setting(42, _SEED)
    #: No-op here: the port range of Alpa's XLA gRPC servers. A mesh that spans hosts
    #: coordinates through ``jax.distributed`` on a port the operating system picks free.
    #: Environment: ``XLA_SERVER_PORT_START``.
    xla_server_port_start: int = _setting(20000, _PORT, "XLA_SERVER_PORT_START")
    #: No-op here (see ``xla_server_port_start``). Environment: ``XLA_SERVER_PORT_END``.
    xla_server_port_end: int = _setting(25000, _PORT, "XLA_SERVER_PORT_END")

    # -- Alpa's settings: shard parallel

    #: Synchronize the devices before and after each one-mesh step, so that the
    #: executable's timers measure the computation itself
    #: (``executable.get_execution_time_costs()``), not its dispatch.
    shard_parallel_sync_for_timer: bool = _setting(False, _BOOL)

    # -- Alpa's settings: pipeline compilation

    #: No-op here: Alpa compiled a pipeline without launching its workers, to debug its
    #: runtime. Here a ``PipeshardPlan`` is made without touching a device (the plan of a
    #: step, ``train_step.plan(...)``, or one for a ``ClusterSpec``), and the workers are
    #: only started by a compile for them.
    debug_with_pipeshard_runtime: bool = _setting(False, _BOOL)
    #: No-op here: Alpa's stage profiler ran candidate stages on the whole Ray cluster.
    #: alpa's measured stage costs (``AutoStageOption(stage_cost="measured")``) compile and
    #: time each candidate on the submesh it would use.
    profile_with_whole_ray_cluster: bool = _setting(True, _BOOL)
    #: No-op here: the seconds Alpa gave its stage profiler's Ray tasks. Measured stage
    #: costs here run in this process, each candidate compiled once and cached.
    profile_timeout: float = _setting(500.0, _POSITIVE)
    #: No-op here: how often Alpa retried a stage profile that hung on NCCL (see
    #: ``profile_timeout``).
    profile_maximum_retry: int = _setting(2, _COUNT)
    #: The submesh shapes ``(num_hosts, num_devices_per_host)`` the stage DP of
    #: ``AutoStageOption`` chooses from, instead of its ``submesh_physical_shape_space``
    #: (``None``: those). Each must fit and tile the cluster (Alpa's meaning, checked).
    overwrite_submesh_choices: tuple[tuple[int, int], ...] | None = _setting(None, _SubmeshShapes())
    #: No-op here: Alpa donated the micro-batch buffers to the stage programs that read
    #: them last. Here every buffer of a step is dropped after its last use (the runtime
    #: emitter's ``FREE``), which frees it as a donation would.
    always_donate_micro_batch_vars: bool = _setting(True, _BOOL)
    #: Print the layers an ``AutoLayerOption`` cut a step into: per layer its number of
    #: equations and its FLOPs (Alpa's ``log_layer_slicing_stats``, the same meaning).
    print_auto_layer_stats: bool = _setting(False, _BOOL)

    # -- Alpa's settings: pipeline runtime

    #: Synchronize the devices around each stage computation of a pipelined step, so that
    #: the executable's timers measure the computations themselves.
    pipeline_sync_for_timer: bool = _setting(False, _BOOL)
    #: No-op here: Alpa compiled each stage on its own mesh's workers in parallel (off: on
    #: the driver, to debug). Here the driver lowers every stage and exports it, and each
    #: mesh's workers compile their own stages.
    pipeline_distributed_compile: bool = _setting(True, _BOOL)
    #: No-op here: Alpa created its NCCL communicators when a step was compiled (off: on
    #: first use). Here a mesh pair's NCCL group is always opened when the step that needs
    #: it is loaded on the workers.
    eagerly_create_communicators: bool = _setting(True, _BOOL)
    #: No-op here: Alpa asked every worker whether it was alive after each pipelined step.
    #: Here every wait on workers reports a dead one within seconds
    #: (``ray_worker_timeout`` bounds one that hangs).
    pipeline_check_alive: bool = _setting(False, _BOOL)
    #: No-op here: a debug mode of Alpa's NCCL runtime that sent one-byte signals instead
    #: of the data.
    pipeline_use_signal_send_recv: bool = _setting(False, _BOOL)
    #: No-op here: Alpa's cross-mesh resharding sent a value replicated over the
    #: destination once per host and all-gathered it there (off: to every device). The
    #: tile planner here always sends each piece once per destination host.
    use_local_allgather: bool = _setting(True, _BOOL)
    #: No-op here: Alpa's cross-mesh resharding by NCCL ``"send_recv"`` or
    #: ``"broadcast"``. Here values move by send/recv of the tile plan's pieces.
    resharding_mode: str = _setting("send_recv", _Choice(("send_recv", "broadcast")))
    #: No-op here: whose NCCL Alpa used, ``"cupy"``'s or its forked jaxlib's
    #: (``"xla_extension"``). Here it is cupy's where NCCL is used (stock jaxlib has none
    #: to call).
    nccl_mode: str = _setting("cupy", _Choice(("cupy", "xla_extension")))
    #: No-op here: Alpa's forked XLA overlapped cross-mesh transfers with computation
    #: through events it added. Stock XLA has no such events: a transfer here runs
    #: between the stage computations that produce and read it.
    enable_overlapping: bool = _setting(False, _BOOL)
    #: No-op here: how Alpa spread a resharding's sends over the source devices. The tile
    #: planner here sends each piece from one device that holds it, chosen per piece.
    resharding_loadbalance_mode: str = _setting(
        "normal", _Choice(("normal", "no_loadbalance", "loadbalance_size", "loadbalance_order"))
    )
    #: No-op here (see ``resharding_loadbalance_mode``).
    loadbalance_order_algo: str = _setting("greedy", _Choice(("greedy", "search")))

    # -- Alpa's settings: benchmarks, patches, logging

    #: Let a step called with abstract arguments (``jax.ShapeDtypeStruct``) run on dummy
    #: values created on the devices, to time it without real data: the results are
    #: meaningless, which a data-independent benchmark accepts.
    use_dummy_value_for_benchmarking: bool = _setting(False, _BOOL)
    #: Compute flax's ``nn.Embed`` lookups in float16 (Alpa's patch of flax, which its
    #: OPT serving relied on).
    flax_always_use_fp16_embedding: bool = _setting(False, _BOOL)
    #: Record when every stage computation of a pipelined step starts and ends
    #: (``executable.get_stage_execution_info()``); each computation is then waited for,
    #: so the times are the computations' own. Read at each step.
    collect_trace: bool = _setting(False, _BOOL)

    def __post_init__(self):
        for f in fields(self):
            var = f.metadata["env"]
            text = os.environ.get(var) if var else None
            if text is None:
                continue
            kind = f.metadata["kind"]
            try:
                value = kind.parse(text)
            except (TypeError, ValueError):
                raise ValueError(
                    f"environment variable {var}={text!r} (alpa.global_config.{f.name}): "
                    f"expected {getattr(kind, 'env_expected', kind.expected)}"
                ) from None
            object.__setattr__(self, f.name, (not value) if f.metadata["invert"] else value)

    def __setattr__(self, name: str, value: Any) -> None:
        kind = _KINDS.get(name)
        if kind is None:
            if name in RETIRED_SETTINGS:
                _retired(name, value)
                return
            raise AttributeError(
                f"alpa.global_config has no setting {name!r} (set to {value!r}); neither "
                f"has Alpa's. Its settings are {', '.join(sorted(_KINDS))}"
            )
        try:
            value = kind.check(value)
        except (TypeError, ValueError) as e:
            raise type(e)(
                f"alpa.global_config.{name} = {value!r} ({type(value).__name__}): expected "
                f"{kind.expected}"
            ) from None
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only reached for a name that is not a setting of this alpa.
        if name in RETIRED_SETTINGS:
            return RETIRED_SETTINGS[name][1]
        raise AttributeError(f"alpa.global_config has no setting {name!r}")

    @property
    def ray_accelerator_name(self) -> str:
        """Ray's resource name of ``backend``'s devices (Alpa's property)."""
        return {"gpu": "GPU", "tpu": "TPU", "cpu": "CPU"}[self.backend]


_KINDS: dict[str, Any] = {f.name: f.metadata["kind"] for f in fields(GlobalConfig)}

#: Settings of Alpa releases before 0.2.3 that Alpa itself dropped: name -> (the last
#: Alpa release that had it, its default there). Assigning one warns and does nothing,
#: as in Alpa 0.2.3, which stored and never read it; reading one gives that default.
RETIRED_SETTINGS: dict[str, tuple[str, Any]] = {
    "build_random_seed": ("0.0.3 (became compile_random_seed)", 42),
    "debug_with_local_runtime": ("0.0.3", False),
    "precompile_resharding_tasks": ("0.0.3", True),
    "default_ray_namespace_prefix": ("0.1.1", "alpa-train"),
    "unittest_ray_namespace_prefix": ("0.1.1", "alpa-unittest"),
    "delete_remote_buffers_threshold": ("0.1.1 (became delete_remote_arrays_threshold)", 200),
    "use_scatter_gather": ("0.1.4 (became use_local_allgather)", True),
    "remat_using_while": ("0.2.1", False),
    "use_memzero_for_gradient_accumulation": ("0.2.2", False),
}


def _retired(name: str, value: Any) -> None:
    release, _ = RETIRED_SETTINGS[name]
    warnings.warn(
        f"alpa.global_config.{name} = {value!r} does nothing: Alpa's global_config had this "
        f"setting up to release {release}, and later Alpa releases ignored it too",
        UserWarning,
        stacklevel=3,
    )


global_config = GlobalConfig()


# ----------------------------------------------------------------------------- seeds


def check_seed(seed: object, caller: str) -> int:
    """``seed`` as a Python int, or an error naming ``caller`` unless it is an int in
    ``[0, 2**32)``."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(
            f"{caller}: seed must be an int in [0, 2**32), got {seed!r} ({type(seed).__name__})"
        )
    if not 0 <= seed <= _SEED.high:
        raise ValueError(f"{caller}: seed must be an int in [0, 2**32), got {seed}")
    return int(seed)


def set_seed(seed: int) -> None:
    """Make the random parts of a test or example reproducible.

    It sets ``global_config.seed`` (the default seed of the ``alpa.testing`` helpers, so two
    ``get_mlp_train_state_and_step(...)`` calls after ``set_seed(s)`` build identical states
    and batches) and Alpa's ``global_config.runtime_random_seed``, and seeds numpy's and
    Python's global generators (``np.random.seed``, ``random.seed``).

    Unlike Alpa's ``set_seed``, it does not seed random numbers drawn inside a parallelized
    function: Alpa patched ``jax.random`` into a stateful generator; this alpa patches
    nothing, and a parallelized function draws from the ``jax.random`` keys it is passed,
    as under ``jax.jit``.

    Args:
      seed: an int in ``[0, 2**32)``.
    """
    seed = check_seed(seed, "set_seed")
    global_config.seed = seed
    global_config.runtime_random_seed = seed
    np.random.seed(seed)
    random.seed(seed)
