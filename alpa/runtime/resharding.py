"""Cross-mesh resharding, planned tile by tile (paper §6).

A value produced by one pipeline stage on its mesh is read by another stage on another mesh,
possibly with another sharding. This module plans the move as pure tile arithmetic:

* A :class:`MeshSharding` places an array on a mesh of shape ``(num_hosts,
  devices_per_host)``: each array dimension is split over zero or more mesh axes (0 = hosts,
  1 = devices in a host, like a ``PartitionSpec``); devices that get the same tile are
  replicas. Device ``(h, d)`` has the flat id ``h * devices_per_host + d``.
* The tiles of one sharding are either equal or disjoint, so for every destination host
  and every distinct destination tile on it, the pieces ``source tile ∩ destination tile``
  (over distinct source tiles) cover that destination tile exactly, without overlap.
* Each piece is sent **once per destination host**, from one replica of its source tile
  (replicas take turns, to spread the load), and then copied inside the host to every
  device that needs it. A destination replicated over the devices of a host therefore
  receives each byte once, not once per device.

The plan is data (``worker_program.TransferPlan``, the one tile-plan type, whose
:class:`~alpa.runtime.worker_program.Piece` s are the boxes that move); :func:`apply_plan`
executes it on numpy arrays, which is how tests check that every needed byte arrives
exactly once and the array is reproduced. The in-process runtime moves values with
``jax.device_put`` and counts the plan's bytes (``LocalPipelineRuntime.resharded_bytes``);
a Ray or NCCL backend sends the plan's pieces.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from alpa.device_mesh import MESH_AXIS_NAMES, entry_names
from alpa.runtime.worker_program import Box, Layout, Piece, TransferPlan, local_slices


@dataclass(frozen=True)
class MeshSharding:
    """An array sharded on a ``(num_hosts, devices_per_host)`` mesh.

    ``dim_axes[d]`` lists the mesh axes (0, 1) that split array dimension ``d``, major
    first; ``()`` means the dimension is not split. Mesh axes used by no dimension hold
    replicas.
    """

    mesh_shape: tuple[int, int]
    dim_axes: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        mesh_shape = tuple(self.mesh_shape)
        if len(mesh_shape) != 2 or not all(isinstance(n, int) and n >= 1 for n in mesh_shape):
            raise ValueError(f"mesh_shape must be two positive ints, got {self.mesh_shape!r}")
        dim_axes = tuple(tuple(axes) for axes in self.dim_axes)
        used = [a for axes in dim_axes for a in axes]
        if any(a not in (0, 1) for a in used) or len(used) != len(set(used)):
            raise ValueError(f"each mesh axis (0 or 1) may split one dimension once: {dim_axes}")
        object.__setattr__(self, "mesh_shape", mesh_shape)
        object.__setattr__(self, "dim_axes", dim_axes)

    @classmethod
    def from_partition_spec(cls, mesh_shape, spec, ndim: int, axis_names=MESH_AXIS_NAMES):
        """From a ``jax.sharding.PartitionSpec`` over named mesh axes."""
        entries = list(spec) + [None] * (ndim - len(spec))
        dim_axes = []
        for entry in entries:
            dim_axes.append(tuple(axis_names.index(n) for n in entry_names(entry)))
        return cls(tuple(mesh_shape), tuple(dim_axes))

    @property
    def num_devices(self) -> int:
        return self.mesh_shape[0] * self.mesh_shape[1]

    def host_of(self, device: int) -> int:
        return device // self.mesh_shape[1]

    def device_boxes(self, shape: Sequence[int]) -> list[Box]:
        """The tile of every device (flat id order) of an array of ``shape``."""
        if len(shape) != len(self.dim_axes):
            raise ValueError(f"sharding has {len(self.dim_axes)} dims, array shape is {shape}")
        boxes = []
        for h, d in itertools.product(range(self.mesh_shape[0]), range(self.mesh_shape[1])):
            coord = (h, d)
            box = []
            for size, axes in zip(shape, self.dim_axes, strict=True):
                parts = math.prod(self.mesh_shape[a] for a in axes)
                if size % parts:
                    raise ValueError(
                        f"dimension of size {size} cannot be split into {parts} equal tiles"
                    )
                index = 0
                for a in axes:
                    index = index * self.mesh_shape[a] + coord[a]
                step = size // parts
                box.append((index * step, (index + 1) * step))
            boxes.append(tuple(box))
        return boxes


def plan_resharding(
    shape: Sequence[int], src: MeshSharding, dst: MeshSharding, dtype: Any = None
) -> TransferPlan:
    """Which slices of which source devices each destination host receives (``dtype``,
    if given, prices the plan in bytes)."""
    shape = tuple(int(n) for n in shape)
    src_boxes, dst_boxes = src.device_boxes(shape), dst.device_boxes(shape)
    return TransferPlan(
        shape=shape,
        src_boxes=tuple(src_boxes),
        dst_boxes=tuple(dst_boxes),
        src_devices_per_host=src.mesh_shape[1],
        dst_devices_per_host=dst.mesh_shape[1],
        pieces=tuple(plan_box_transfers(src_boxes, dst_boxes, dst.mesh_shape[1])),
        dtype=None if dtype is None else np.dtype(dtype).name,
    )


def plan_box_transfers(
    src_boxes: Sequence[Box], dst_boxes: Sequence[Box], dst_devices_per_host: int
) -> list[Piece]:
    """The pieces of :func:`plan_resharding` from the tiles themselves: ``src_boxes[d]``
    is the tile of source device ``d``, ``dst_boxes[d]`` that of destination device ``d``,
    whose host is ``d // dst_devices_per_host``."""
    src_replicas: dict[Box, list[int]] = {}
    for device, box in enumerate(src_boxes):
        src_replicas.setdefault(box, []).append(device)
    turn = dict.fromkeys(src_replicas, 0)
    pieces = []
    for host in range(len(dst_boxes) // dst_devices_per_host):
        host_tiles: dict[Box, list[int]] = {}
        first = host * dst_devices_per_host
        for device in range(first, first + dst_devices_per_host):
            host_tiles.setdefault(dst_boxes[device], []).append(device)
        for dst_box, devices in host_tiles.items():
            for src_box, replicas in src_replicas.items():
                box = _intersect(src_box, dst_box)
                if box is None:
                    continue
                sender = replicas[turn[src_box] % len(replicas)]
                turn[src_box] += 1
                pieces.append(Piece(sender, host, box, tuple(devices)))
    return pieces


def apply_plan(plan: TransferPlan, src_shards: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Execute ``plan`` on numpy shards (one per source device); return destination shards.

    Only the plan's pieces move data, so a destination element that no piece covers
    stays NaN (or -1 for integers) and shows up in a comparison.
    """
    dtype = src_shards[0].dtype
    fill = np.nan if np.issubdtype(dtype, np.floating) else -1
    out = [np.full([b - a for a, b in box], fill, dtype) for box in plan.dst_boxes]
    for p in plan.pieces:
        piece = src_shards[p.src_device][local_slices(p.box, plan.src_boxes[p.src_device])]
        for device in p.dst_devices:
            if device // plan.dst_devices_per_host != p.dst_host:
                raise AssertionError(f"piece for host {p.dst_host} names device {device}")
            out[device][local_slices(p.box, plan.dst_boxes[device])] = piece
    return out


def shard_array(array: np.ndarray, sharding: MeshSharding) -> list[np.ndarray]:
    """Per device, its tile of ``array``."""
    return [array[tuple(slice(a, b) for a, b in box)] for box in sharding.device_boxes(array.shape)]


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in box) else box


def worker_transfer_plan(
    shape: Sequence[int],
    dtype: Any,
    src_layout: Layout,
    src_devices_per_host: int,
    dst_layout: Layout,
    dst_devices_per_host: int,
) -> TransferPlan:
    """The tile plan of one value between two Ray meshes, as the workers execute it.

    A layout's logical mesh orders devices host-major, as the workers' meshes do, so flat
    device ``d`` of a layout sits on host ``d // devices_per_host`` whatever the logical
    shape; each piece is sent once per destination host (:func:`plan_box_transfers`).
    """
    shape = tuple(int(n) for n in shape)
    ndim = len(shape)
    src = MeshSharding.from_partition_spec(
        src_layout.mesh_shape, src_layout.spec, ndim, src_layout.axis_names
    )
    dst = MeshSharding.from_partition_spec(
        dst_layout.mesh_shape, dst_layout.spec, ndim, dst_layout.axis_names
    )
    src_boxes, dst_boxes = src.device_boxes(shape), dst.device_boxes(shape)
    return TransferPlan(
        shape=shape,
        src_boxes=tuple(src_boxes),
        dst_boxes=tuple(dst_boxes),
        src_devices_per_host=src_devices_per_host,
        dst_devices_per_host=dst_devices_per_host,
        pieces=tuple(plan_box_transfers(src_boxes, dst_boxes, dst_devices_per_host)),
        dtype=np.dtype(dtype).name,
        dst_layout=dst_layout,
    )
