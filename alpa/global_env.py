"""Process-wide settings: the one documented place for them.

Every field can be set in code (``alpa.global_config.print_compilation_time = True``) or,
at import time, through the environment variable named beside it. Nothing else in alpa
keeps mutable process-wide state, apart from the cluster that ``alpa.init`` connects to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def _env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return default if value is None else float(value)


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
    #: Show tqdm progress bars (planning, profiling). ``alpa.util.disable_tqdm_globally()``
    #: turns them off. Environment: ``ALPA_DISABLE_TQDM=1`` turns them off.
    use_tqdm: bool = field(default_factory=lambda: not _env_bool("ALPA_DISABLE_TQDM", False))
    #: Folder for on-disk caches (measured stage costs). Environment: ``ALPA_CACHE_DIR``.
    cache_dir: str = field(
        default_factory=lambda: os.environ.get(
            "ALPA_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "alpa")
        )
    )


global_config = GlobalConfig()
