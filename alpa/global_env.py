"""Process-wide settings: the one documented place for them.

Every field can be set in code (``alpa.global_config.print_compilation_time = True``) or,
at import time, through the environment variable named beside it. Nothing else in alpa
keeps mutable process-wide state, apart from the cluster that ``alpa.init`` connects to.
:func:`set_seed` sets ``global_config.seed`` and seeds numpy's and Python's generators.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field, fields

import numpy as np


def _env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return default if value is None else float(value)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


@dataclass
class GlobalConfig:
    """Settings that apply to every compilation in this process."""

    #: Print which strategy the auto-sharding pass chose for every value, as a table.
    #: Environment: ``ALPA_DEBUG_PRINT_AS_STRATEGY=1``.
    print_auto_sharding_strategy: bool = field(
        default_factory=lambda: _env_bool("ALPA_DEBUG_PRINT_AS_STRATEGY", False)
    )
    #: Log how long tracing, planning and XLA compilation took for each new executable.
    #: Environment: ``ALPA_PRINT_COMPILATION_TIME=1``.
    print_compilation_time: bool = field(
        default_factory=lambda: _env_bool("ALPA_PRINT_COMPILATION_TIME", False)
    )
    #: Time limit (seconds) for one ILP solve of the auto-sharding pass.
    #: Environment: ``ALPA_ILP_TIME_LIMIT``.
    ilp_time_limit: float = field(default_factory=lambda: _env_float("ALPA_ILP_TIME_LIMIT", 60.0))
    #: The MILP solver of the auto-sharding ILP: ``"highs"`` (HiGHS in this process, the
    #: default) or ``"cbc"`` (CBC through PuLP). Environment: ``ALPA_ILP_SOLVER``.
    ilp_solver: str = field(default_factory=lambda: os.environ.get("ALPA_ILP_SOLVER", "highs"))
    #: Show tqdm progress bars (planning, profiling). ``alpa.util.disable_tqdm_globally()``
    #: turns them off. Environment: ``ALPA_DISABLE_TQDM=1`` turns them off.
    use_tqdm: bool = field(default_factory=lambda: not _env_bool("ALPA_DISABLE_TQDM", False))
    #: Folder for on-disk caches (measured stage costs). Environment: ``ALPA_CACHE_DIR``.
    cache_dir: str = field(
        default_factory=lambda: os.environ.get(
            "ALPA_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "alpa")
        )
    )
    #: The seed that :func:`set_seed` last set: the default ``seed`` of the
    #: ``alpa.testing`` helpers. It does not reach ``jax.random``, whose keys stay
    #: explicit. Environment: ``ALPA_SEED`` (sets this field only; numpy and Python are
    #: seeded by :func:`set_seed` alone).
    seed: int = field(default_factory=lambda: _env_int("ALPA_SEED", 0))
    #: The cluster profile plans are priced with (``alpa.mesh_profiling.profile_all``
    #: writes one): the path of a profile file (its entry for this process's devices is
    #: used) or a ``cost_profile.ClusterProfile``; ``None`` (default) prices with the
    #: presets' datasheet figures. Read by ``ClusterSpec.local()`` whenever a plan is made.
    #: Environment: ``ALPA_CLUSTER_PROFILE`` (a path).
    cluster_profile: object = field(
        default_factory=lambda: os.environ.get("ALPA_CLUSTER_PROFILE") or None
    )
    #: Seconds the driver waits for Ray mesh workers to answer one call (a step, a
    #: compile, a fetch, a checkpoint part) before it raises, naming the mesh and host,
    #: and aborts the step on the others. A dead worker is reported within seconds
    #: regardless; this bounds a worker that hangs. Environment: ``ALPA_RAY_WORKER_TIMEOUT``.
    ray_worker_timeout: float = field(
        default_factory=lambda: _env_float("ALPA_RAY_WORKER_TIMEOUT", 3600.0)
    )
    #: Seconds ``alpa.init("ray", cluster_address=...)`` waits for the address to accept a
    #: connection before it raises ``ConnectionError`` naming it (Ray itself retries an
    #: address that does not answer without limit). Environment: ``ALPA_RAY_CONNECT_TIMEOUT``.
    ray_connect_timeout: float = field(
        default_factory=lambda: _env_float("ALPA_RAY_CONNECT_TIMEOUT", 10.0)
    )

    def __setattr__(self, name: str, value) -> None:
        # A misspelt or Alpa-only setting would otherwise be stored and ignored in silence.
        names = {f.name for f in fields(self)}
        if name not in names:
            raise AttributeError(
                f"alpa.global_config has no setting {name!r} (set to {value!r}); its settings "
                f"are {', '.join(sorted(names))}"
            )
        object.__setattr__(self, name, value)


global_config = GlobalConfig()


# numpy's legacy global generator takes seeds in [0, 2**32).
_MAX_SEED = 2**32 - 1


def check_seed(seed: object, caller: str) -> int:
    """``seed`` as a Python int, or an error naming ``caller`` unless it is an int in
    ``[0, 2**32)``."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(
            f"{caller}: seed must be an int in [0, 2**32), got {seed!r} ({type(seed).__name__})"
        )
    if not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"{caller}: seed must be an int in [0, 2**32), got {seed}")
    return int(seed)


def set_seed(seed: int) -> None:
    """Make the random parts of a test or example reproducible.

    It sets ``global_config.seed`` (the default seed of the ``alpa.testing`` helpers, so two
    ``get_mlp_train_state_and_step(...)`` calls after ``set_seed(s)`` build identical states
    and batches) and seeds numpy's and Python's global generators (``np.random.seed``,
    ``random.seed``).

    Unlike Alpa's ``set_seed``, it does not seed random numbers drawn inside a parallelized
    function: Alpa patched ``jax.random`` into a stateful generator; this alpa patches
    nothing, and a parallelized function draws from the ``jax.random`` keys it is passed,
    as under ``jax.jit``.

    Args:
      seed: an int in ``[0, 2**32)``.
    """
    seed = check_seed(seed, "set_seed")
    global_config.seed = seed
    np.random.seed(seed)
    random.seed(seed)
