"""What the driver ships to a Ray mesh worker: exported programs and instruction lists.

Everything here is plain, picklable data, made on the driver once per compiled step and sent
to every worker of a mesh at compile time (``docs/ray.md``, What runs where). A step then
sends one small message per worker: which buffers or host arrays are the step's inputs and
which names its outputs get.

* :class:`ExportedFn` is one XLA program: the StableHLO that ``jax.export`` serialized on
  the driver (lowered for an abstract mesh, so the driver needs no device of the worker's
  kind), and the mesh shape, axis names and ``PartitionSpec`` of every input and output.
  The worker deserializes it and compiles it on its own devices.
* :class:`WorkerInstruction` is one step of a worker's program, with a typed opcode
  (:class:`WorkerOp`). Buffers live in integer slots; after an instruction its ``free``
  slots are dropped. The ops:

  - ``INPUT``: step argument ``arg`` (a host array, a buffer the worker holds, or a
    :class:`DummyValue`) into ``out_slots[0]``, laid out as ``layouts[layout]``.
  - ``LOAD``: the ``k`` micro-batches of step argument ``arg`` into ``out_slots``.
  - ``RUN``: ``out_slots = fns[fn](in_slots)``.
  - ``ALLOC``: ``out_slots = fns[fn]()`` (zeros: a kernel's running sums; the plan's
    ``Op.ALLOC``).
  - ``SEND`` / ``RECV``: one value between meshes, tile by tile
    (:class:`TransferPlan`); the sending worker pushes its pieces to each destination
    worker, the receiving worker assembles its devices' tiles.
  - ``CONCAT``: the per-micro-batch values ``in_slots`` joined along axis 0.
  - ``MEAN``: the mean of the per-micro-batch values ``in_slots`` (a scalar loss).

* :class:`TransferPlan` is the tile plan of one value between two meshes (made by
  ``runtime.resharding``): which piece each source host sends to each destination host.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from alpa.flax_patches import DUMMY_VALUE

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Layout:
    """Where a value lives on a worker's mesh: logical shape, axis names and spec."""

    mesh_shape: tuple[int, int]
    axis_names: tuple[str, ...]
    spec: Any  # jax.sharding.PartitionSpec

    def shard_indices(self, shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
        """Per device of the mesh, in the workers' order (row-major over ``mesh_shape``:
        host by host, each host's devices in order), the slice of an array of ``shape``
        that device holds (what ``NamedSharding.devices_indices_map`` gives)."""
        sizes = dict(zip(self.axis_names, self.mesh_shape, strict=True))
        entries = tuple(self.spec) + (None,) * (len(shape) - len(tuple(self.spec)))
        indices = []
        for flat in range(math.prod(self.mesh_shape)):
            coords = dict(
                zip(self.axis_names, np.unravel_index(flat, self.mesh_shape), strict=True)
            )
            index = []
            for size, entry in zip(shape, entries, strict=True):
                axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
                part, parts = 0, 1
                for axis in axes:
                    part, parts = part * sizes[axis] + int(coords[axis]), parts * sizes[axis]
                index.append(slice(part * (size // parts), (part + 1) * (size // parts)))
            indices.append(tuple(index))
        return indices


@dataclass(frozen=True)
class DummyValue:
    """A step argument the driver has only the shape and dtype of (a
    ``jax.ShapeDtypeStruct`` under ``global_config.use_dummy_value_for_benchmarking``):
    the worker fills each of its devices' shards with :data:`DUMMY_VALUE` itself."""

    shape: tuple[int, ...]
    dtype: Any

    def host(self) -> np.ndarray:
        return np.full(self.shape, DUMMY_VALUE, self.dtype)


@dataclass(frozen=True)
class ExportedFn:
    """One compiled-on-the-worker program (see the module docstring)."""

    name: str
    serialized: bytes
    in_layouts: tuple[Layout, ...]
    out_layouts: tuple[Layout | None, ...]  # None: as the exported program leaves it
    donate_argnums: tuple[int, ...] = ()


@dataclass(frozen=True)
class Piece:
    """Box ``box`` (global coordinates) of the tile of source device ``src_device`` (flat
    id on the source mesh) goes to destination host ``dst_host``, where the destination
    devices ``dst_devices`` (flat ids) each keep a copy."""

    src_device: int
    dst_host: int
    box: Box
    dst_devices: tuple[int, ...]


@dataclass(frozen=True)
class TransferPlan:
    """The tile plan of one value from a source mesh to a destination mesh: which box of
    which source device's tile goes to which destination host, once per host
    (``runtime.resharding``, paper §6). The one tile-plan type: the planner makes it
    (``plan_resharding``, ``worker_transfer_plan``), the ``PipeshardPlan`` records one
    per ``RESHARD``, the local runtime counts its bytes, Ray workers and the NCCL
    transport execute it.

    Devices are flat ids, host-major on both meshes: device ``d`` sits on host
    ``d // devices_per_host``. ``dtype`` (a numpy dtype name) prices the plan in bytes;
    ``dst_layout`` is where a Ray worker lays the assembled value out (``None`` for a
    plan of tiles alone, as ``plan_resharding`` makes)."""

    shape: tuple[int, ...]
    src_boxes: tuple[Box, ...]  # per source device, its tile
    dst_boxes: tuple[Box, ...]  # per destination device, its tile
    src_devices_per_host: int
    dst_devices_per_host: int
    pieces: tuple[Piece, ...]
    dtype: str | None = None
    dst_layout: Layout | None = None

    def __post_init__(self):
        for side, boxes, per_host in (
            ("src", self.src_boxes, self.src_devices_per_host),
            ("dst", self.dst_boxes, self.dst_devices_per_host),
        ):
            if per_host < 1 or len(boxes) % per_host:
                raise ValueError(
                    f"{side}_devices_per_host={per_host} does not divide the "
                    f"{len(boxes)} {side} devices"
                )

    @property
    def src_mesh_shape(self) -> tuple[int, int]:
        """``(hosts, devices per host)`` of the source mesh."""
        return len(self.src_boxes) // self.src_devices_per_host, self.src_devices_per_host

    @property
    def dst_mesh_shape(self) -> tuple[int, int]:
        """``(hosts, devices per host)`` of the destination mesh."""
        return len(self.dst_boxes) // self.dst_devices_per_host, self.dst_devices_per_host

    def pieces_to(self, host: int) -> list[tuple[int, Piece]]:
        """``(index, piece)`` of the pieces destination host ``host`` receives."""
        return [(i, p) for i, p in enumerate(self.pieces) if p.dst_host == host]

    def pieces_from(self, host: int) -> list[tuple[int, Piece]]:
        """``(index, piece)`` of the pieces source host ``host`` sends."""
        per_host = self.src_devices_per_host
        return [(i, p) for i, p in enumerate(self.pieces) if p.src_device // per_host == host]

    def num_elements_sent(self) -> int:
        """Elements that cross from the source mesh to destination hosts (each piece once)."""
        return sum(math.prod(hi - lo for lo, hi in p.box) for p in self.pieces)

    def nbytes(self) -> int:
        """Bytes the plan sends (each piece once)."""
        if self.dtype is None:
            raise ValueError("a tile plan without a dtype has no size in bytes")
        return self.num_elements_sent() * np.dtype(self.dtype).itemsize

    def table(self) -> str:
        """The plan, one piece a row."""
        rows = [
            f"reshard {self.shape} {self.dtype or ''}: {self.src_mesh_shape} -> "
            f"{self.dst_mesh_shape} (hosts, devices per host)"
        ]
        for p in self.pieces:
            rows.append(
                f"  dev {p.src_device} -> host {p.dst_host} {list(p.box)} "
                f"for devices {list(p.dst_devices)}"
            )
        return "\n".join(rows)


def local_slices(box: Box, within: Box) -> tuple[slice, ...]:
    """``box`` (global coordinates) as slices of the tile ``within``."""
    return tuple(slice(lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(box, within, strict=True))


class WorkerOp(str, enum.Enum):
    INPUT = "INPUT"
    LOAD = "LOAD"
    RUN = "RUN"
    ALLOC = "ALLOC"
    SEND = "SEND"
    RECV = "RECV"
    CONCAT = "CONCAT"
    MEAN = "MEAN"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class WorkerInstruction:
    op: WorkerOp
    in_slots: tuple[int, ...] = ()
    out_slots: tuple[int, ...] = ()
    fn: int | None = None  # RUN / ALLOC: index into WorkerProgram.fns
    arg: int | None = None  # INPUT / LOAD: index of the step argument
    layout: Layout | None = None  # INPUT / LOAD / RECV: where the value goes
    micro_batch_size: int | None = None  # LOAD
    transfer: TransferPlan | None = None  # SEND / RECV
    tag: int | None = None  # SEND / RECV: pairs a send with its receive within a step
    peer_mesh: int | None = None  # SEND: destination mesh id / RECV: source mesh id
    free: tuple[int, ...] = ()


@dataclass(frozen=True)
class WorkerProgram:
    """A mesh's part of a compiled step: what each of its workers runs, in order.

    ``outputs`` are the slots whose values the step keeps (stored under the buffer names
    the driver gives with each step); every other slot is dropped by the end of it.
    ``micro_batch_of`` (per slot, when given) names the ``(stage's mesh, micro-batch)`` of
    an activation a ``RUN`` writes for a later ``RUN`` (``instructions.activation_keys``),
    else ``None``: the worker counts the micro-batches in flight by it.
    """

    fns: tuple[ExportedFn, ...]
    instructions: tuple[WorkerInstruction, ...]
    num_slots: int
    outputs: tuple[int, ...]
    micro_batch_of: tuple[tuple[int, int] | None, ...] = ()
