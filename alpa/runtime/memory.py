"""Device memory figures shared by the executables and the Ray mesh workers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def allocation_bytes(compiled: Any) -> int:
    """Bytes one device allocates for a compiled program (arguments + outputs +
    temporaries, less what outputs alias), from XLA's memory analysis."""
    stats = compiled.memory_analysis()
    return int(
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    )


def device_peak_bytes(devices: Sequence[Any]) -> int | None:
    """The largest ``peak_bytes_in_use`` of ``devices``, or ``None`` where the platform
    keeps no allocator statistics (CPU)."""
    stats = [d.memory_stats() for d in devices]
    if all(s and "peak_bytes_in_use" in s for s in stats):
        return max(int(s["peak_bytes_in_use"]) for s in stats)
    return None
