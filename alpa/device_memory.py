"""What a mesh's devices hold, and the most they held since a reset: Alpa's memory statistics.

Alpa's meshes answer ``get_memory_allocated()``, ``get_max_memory_allocated()`` (the
largest over their devices, in bytes) and ``reset_memory_stats()``; its benchmarks report
the peak as a run's memory. The figures come from where they are kept:

* **GPU** (the allocator keeps statistics): ``bytes_in_use`` and ``peak_bytes_in_use`` of
  each device, as Alpa read them. Stock jaxlib cannot clear an allocator's peak (Alpa's
  fork could), so after a reset the peak is the largest of the peak at the reset, which
  later steps can only raise, and what is held now: a reset takes effect once the
  allocator's peak has passed its value at the reset.
* **CPU** (no allocator statistics): what is allocated is the bytes of the live jax arrays'
  shards on each device, and the peak is the largest such figure seen since the reset,
  raised by what the runtimes report of each step (:meth:`MemoryStats.observe`: the bytes
  XLA allocates for the programs a step ran, arguments, outputs and temporaries, and the
  buffers kept after it). It is a lower bound of what the process held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def _allocator(devices: Sequence[Any], key: str) -> int | None:
    stats = [d.memory_stats() for d in devices]
    if stats and all(s and key in s for s in stats):
        return max(int(s[key]) for s in stats)
    return None


def device_peak_bytes(devices: Sequence[Any]) -> int | None:
    """The largest ``peak_bytes_in_use`` of ``devices``, or ``None`` where the platform
    keeps no allocator statistics (CPU)."""
    return _allocator(devices, "peak_bytes_in_use")


def live_bytes(devices: Sequence[Any]) -> int:
    """The most bytes the live jax arrays of this process hold on one of ``devices``
    (each device buffer counted once)."""
    import jax

    wanted = {d.id for d in devices}
    held: dict[int, int] = dict.fromkeys(wanted, 0)
    seen: set[tuple[int, int]] = set()
    for array in jax.live_arrays():
        if array.is_deleted():
            continue
        for shard in array.addressable_shards:
            data = shard.data
            key = (data.device.id, data.unsafe_buffer_pointer())
            if data.device.id in wanted and key not in seen:
                seen.add(key)
                held[data.device.id] += data.nbytes
    return max(held.values(), default=0)


class MemoryStats:
    """The memory statistics of the devices ``devices()`` returns (see the module
    docstring)."""

    def __init__(self, devices: Callable[[], Sequence[Any]]):
        self._devices = devices
        self._peak = 0  # CPU: the high-water mark since the reset; GPU: the peak at it

    def allocated(self) -> int:
        """Bytes a device holds now (the most over the devices)."""
        devices = self._devices()
        in_use = _allocator(devices, "bytes_in_use")
        return live_bytes(devices) if in_use is None else in_use

    def observe(self, step_bytes: int | None = None) -> None:
        """Raise the peak (CPU; on GPU the allocator keeps it) to ``step_bytes``, what a
        step just run held at its most, or without it to what is held now."""
        if device_peak_bytes(self._devices()) is None:
            held = self.allocated() if step_bytes is None else step_bytes
            self._peak = max(self._peak, held)

    def max_allocated(self) -> int:
        """The most bytes a device held since the last :meth:`reset`."""
        peak = device_peak_bytes(self._devices())
        if peak is None:
            self.observe()
            return self._peak
        return peak if peak > self._peak else self.allocated()

    def reset(self) -> None:
        """Start the peak again from what is held now."""
        peak = device_peak_bytes(self._devices())
        self._peak = self.allocated() if peak is None else peak
