"""The GPU transport of cross-mesh resharding: NCCL send/recv between mesh-host workers.

A :class:`~alpa.runtime.worker_program.TransferPlan` says which box of the array each
source device sends to each destination host, and which devices of that host keep a copy
(``docs/ray.md``, Cross-mesh resharding). Between Ray workers on GPUs (one worker per
(mesh, host)) the boxes travel by NCCL point-to-point calls through ``cupy.cuda.nccl``,
reading and writing jax device buffers in place through DLPack.

**Ranks.** One communicator group serves one (source mesh, destination mesh) pair and is
created once. Each GPU of either mesh is one rank, source mesh first, in flat device order
(device ``(h, d)`` is ``h * devices_per_host + d``)::

    rank(source device s)      = s
    rank(destination device t) = src_num_devices + t
    world_size                 = src_num_devices + dst_num_devices

:class:`RankLayout` computes these. A worker owns the ranks of its host's devices and opens
one ``NcclCommunicator`` per rank, all inside one ``groupStart()/groupEnd()`` (NCCL
requires that of a process that initialises several ranks of one communicator). Two ranks
of one communicator may not share a GPU (NCCL answers "invalid usage"), so the two meshes
of a pair hold disjoint GPUs.

**Matching.** NCCL pairs the sends from rank ``a`` to rank ``b`` with the receives on ``b``
from ``a`` in the order they were issued. Both sides walk ``plan.pieces`` in plan order,
so the ``k``-th send from ``a`` to ``b`` is the ``k``-th receive, and shapes agree without
any message. All calls of one step go into one NCCL group, so that workers which send to
and receive from each other cannot deadlock on the order of their calls.

**Destination copies.** A transfer reaches one device of its destination host (the
receivers of a host take turns, as the plan's senders do) and is then copied with
``jax.device_put`` to the other devices of ``dst_devices``: each byte crosses between hosts
once per host, the local copies run over NVLink or PCIe.

**Wire format.** NCCL knows a few element types; p2p calls do no arithmetic, so only the
byte count matters. A piece travels as a flat array of a *carrier* dtype that cupy and
DLPack understand: its own dtype when NCCL has a type for it, ``uint16`` bits under
``NCCL_BFLOAT16`` for bfloat16 (cupy has no bfloat16), and raw ``uint8`` bytes for every
other dtype (bool, int16, complex, float8, bfloat16 without ``NCCL_BFLOAT16``). The NCCL
``count`` is always the number of carrier elements.

cupy is an optional dependency (the ``gpu`` extra, ``cupy-cuda12x``): it is imported inside
the functions that need it, so this module imports without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from alpa.runtime.worker_program import Box, TransferPlan, local_slices

# numpy dtype name -> name of the cupy.cuda.nccl constant for it. Any other dtype travels as
# raw bytes; so does bfloat16 where cupy's NCCL wrapper lacks NCCL_BFLOAT16.
_NCCL_TYPE_NAMES = {
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32",
    "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64",
    "uint64": "NCCL_UINT64",
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
    "bfloat16": "NCCL_BFLOAT16",
}

# NCCL's unique id: a tuple of 128 ints from cupy < 14, 128 bytes from cupy >= 14.
UniqueId = tuple[int, ...] | bytes
# A send: (single-device array, source rank, destination rank).
Send = tuple[jax.Array, int, int]
# A receive: (shape, dtype, destination rank, source rank).
Recv = tuple[Sequence[int], Any, int, int]


def nccl_available() -> bool:
    """Whether cupy imports, a CUDA device is present and cupy was built with NCCL."""
    try:
        import cupy
        from cupy.cuda import nccl

        return bool(cupy.cuda.is_available() and nccl.available)
    except Exception:  # a cupy that cannot load its CUDA libraries means no NCCL either
        return False


def new_unique_id() -> UniqueId:
    """A fresh NCCL unique id. One worker makes it; the driver passes it unchanged (it
    pickles) to every worker of the group."""
    _, nccl = _import_cupy()
    return nccl.get_unique_id()


@dataclass(frozen=True)
class HostRole:
    """Which host of the source mesh and/or of the destination mesh a worker runs."""

    src_host: int | None = None
    dst_host: int | None = None

    def __post_init__(self):
        for name in ("src_host", "dst_host"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a host index >= 0 or None, got {value!r}")
        if self.src_host is None and self.dst_host is None:
            raise ValueError("a HostRole needs a src_host, a dst_host or both")


@dataclass(frozen=True)
class RankLayout:
    """The NCCL ranks of one mesh pair: source devices first, then destination devices."""

    src_mesh_shape: tuple[int, int]
    dst_mesh_shape: tuple[int, int]

    @classmethod
    def of_plan(cls, plan: TransferPlan) -> RankLayout:
        return cls(plan.src_mesh_shape, plan.dst_mesh_shape)

    @property
    def src_num_devices(self) -> int:
        return self.src_mesh_shape[0] * self.src_mesh_shape[1]

    @property
    def world_size(self) -> int:
        return self.src_num_devices + self.dst_mesh_shape[0] * self.dst_mesh_shape[1]

    def src_rank(self, device: int) -> int:
        return device

    def dst_rank(self, device: int) -> int:
        return self.src_num_devices + device

    def src_devices(self, host: int) -> range:
        per_host = self.src_mesh_shape[1]
        return range(host * per_host, (host + 1) * per_host)

    def dst_devices(self, host: int) -> range:
        per_host = self.dst_mesh_shape[1]
        return range(host * per_host, (host + 1) * per_host)

    def local_ranks(self, role: HostRole) -> dict[int, int]:
        """The ranks of the worker in ``role``, each mapped to its local CUDA device index:
        the worker's GPUs in rank order (source devices first), as Ray lists them."""
        ranks = []
        if role.src_host is not None:
            _check_host("src_host", role.src_host, self.src_mesh_shape)
            ranks += [self.src_rank(s) for s in self.src_devices(role.src_host)]
        if role.dst_host is not None:
            _check_host("dst_host", role.dst_host, self.dst_mesh_shape)
            ranks += [self.dst_rank(t) for t in self.dst_devices(role.dst_host)]
        return {rank: index for index, rank in enumerate(ranks)}


@dataclass(frozen=True)
class _WireFormat:
    carrier: np.dtype  # the dtype cupy and DLPack see
    nccl_type: int


class NcclGroup:
    """The NCCL communicators that one worker holds for one mesh pair.

    Args:
      unique_id: from :func:`new_unique_id`, the same on every worker of the group.
      world_size: ranks in the group, ``RankLayout.world_size`` for a mesh pair.
      local_ranks: each rank this worker owns -> its local CUDA device index
        (``RankLayout.local_ranks``).

    ``bytes_sent`` and ``bytes_received`` count the bytes this worker moved over NCCL.
    """

    def __init__(self, unique_id: UniqueId, world_size: int, local_ranks: Mapping[int, int]):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not local_ranks:
            raise ValueError("local_ranks is empty: a worker of the group owns at least one rank")
        for rank, index in local_ranks.items():
            if not 0 <= rank < world_size:
                raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
            if index < 0:
                raise ValueError(f"rank {rank} has a negative CUDA device index {index}")
        self._cupy, self._nccl = _import_cupy()
        if not self._cupy.cuda.is_available():
            raise RuntimeError("NcclGroup needs a CUDA GPU, and cupy finds none on this host")
        self.world_size = world_size
        self.local_ranks = dict(local_ranks)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._comms: dict[int, Any] = {}
        self._streams: dict[int, Any] = {}
        self._nccl.groupStart()
        for rank, index in self.local_ranks.items():
            with self._cupy.cuda.Device(index):
                self._comms[rank] = self._nccl.NcclCommunicator(world_size, unique_id, rank)
        self._nccl.groupEnd()
        for rank, index in self.local_ranks.items():
            with self._cupy.cuda.Device(index):
                self._streams[rank] = self._cupy.cuda.Stream(non_blocking=True)

    def send_pieces(self, sends: Sequence[Send]) -> None:
        """Send each ``(array, src_rank, dst_rank)``; returns once the data has left."""
        self.exchange(sends, [])

    def recv_pieces(self, recvs: Sequence[Recv]) -> list[jax.Array]:
        """Receive each ``(shape, dtype, dst_rank, src_rank)`` as an array on the device of
        ``dst_rank``."""
        return self.exchange([], recvs)

    def exchange(self, sends: Sequence[Send], recvs: Sequence[Recv]) -> list[jax.Array]:
        """Issue all ``sends`` and ``recvs`` in one NCCL group and wait for them; return the
        received arrays in the order of ``recvs``."""
        self._check_open()
        for array, src, dst in sends:
            self._check_ranks("send", src, dst)
            if len(array.devices()) != 1:
                raise ValueError(f"a sent piece must live on one device, got {array.devices()}")
        for _, _, dst, src in recvs:
            self._check_ranks("recv", dst, src)
        cupy = self._cupy
        outgoing = []  # (rank, peer, format, wire view of the array)
        for array, src, dst in sends:
            fmt = self._wire_format(array.dtype)
            with cupy.cuda.Device(self.local_ranks[src]), self._streams[src]:
                outgoing.append((src, dst, fmt, cupy.from_dlpack(_to_wire(array, fmt))))
        incoming = []  # (rank, peer, format, wire buffer)
        for shape, dtype, dst, src in recvs:
            fmt = self._wire_format(dtype)
            with cupy.cuda.Device(self.local_ranks[dst]):
                buffer = cupy.empty(_wire_count(shape, dtype, fmt), fmt.carrier)
            incoming.append((dst, src, fmt, buffer))
        self._nccl.groupStart()
        for rank, peer, fmt, view in outgoing:
            self._comms[rank].send(
                view.data.ptr, view.size, fmt.nccl_type, peer, self._streams[rank].ptr
            )
        for rank, peer, fmt, buffer in incoming:
            self._comms[rank].recv(
                buffer.data.ptr, buffer.size, fmt.nccl_type, peer, self._streams[rank].ptr
            )
        self._nccl.groupEnd()
        for rank in {rank for rank, *_ in outgoing + incoming}:
            self._streams[rank].synchronize()
        self.bytes_sent += sum(view.nbytes for *_, view in outgoing)
        self.bytes_received += sum(buffer.nbytes for *_, buffer in incoming)
        return [
            _from_wire(jax.dlpack.from_dlpack(buffer), dtype, shape)
            for (*_, buffer), (shape, dtype, _, _) in zip(incoming, recvs, strict=True)
        ]

    def broadcast(
        self, piece: jax.Array | None, shape: Sequence[int], dtype: Any, root: int
    ) -> dict[int, jax.Array]:
        """NCCL broadcast of ``piece`` from rank ``root`` to every other rank of the group.

        A collective: every worker of the group calls it with the same ``shape``, ``dtype``
        and ``root``; the worker owning ``root`` passes the piece (on root's device), the
        others pass ``None``. Suits a group made for one source device and the destination
        devices that all need its piece. Returns, per local rank other than ``root``, the
        received array on that rank's device.
        """
        self._check_open()
        if not 0 <= root < self.world_size:
            raise ValueError(f"root {root} is outside the group of world_size {self.world_size}")
        if (piece is not None) != (root in self.local_ranks):
            raise ValueError(
                f"pass the piece exactly on the worker that owns root rank {root} "
                f"(this worker owns ranks {sorted(self.local_ranks)})"
            )
        if piece is not None and (tuple(piece.shape), piece.dtype) != (tuple(shape), dtype):
            raise ValueError(f"piece is {piece.dtype}{piece.shape}, expected {dtype}{shape}")
        cupy = self._cupy
        fmt = self._wire_format(dtype)
        count = _wire_count(shape, dtype, fmt)
        buffers = {}
        for rank, index in self.local_ranks.items():
            with cupy.cuda.Device(index), self._streams[rank]:
                if rank == root:
                    buffers[rank] = cupy.from_dlpack(_to_wire(piece, fmt))
                else:
                    buffers[rank] = cupy.empty(count, fmt.carrier)
        self._nccl.groupStart()
        for rank, buffer in buffers.items():
            ptr, stream = buffer.data.ptr, self._streams[rank].ptr
            self._comms[rank].broadcast(ptr, ptr, count, fmt.nccl_type, root, stream)
        self._nccl.groupEnd()
        for rank in buffers:
            self._streams[rank].synchronize()
        received = {
            rank: _from_wire(jax.dlpack.from_dlpack(buffer), dtype, shape)
            for rank, buffer in buffers.items()
            if rank != root
        }
        nbytes = count * fmt.carrier.itemsize
        self.bytes_sent += nbytes if root in buffers else 0
        self.bytes_received += nbytes * len(received)
        return received

    def destroy(self) -> None:
        """Free the communicators; the group cannot be used afterwards."""
        for comm in self._comms.values():
            comm.destroy()
        self._comms = {}
        self._streams = {}

    def _check_open(self) -> None:
        if not self._comms:
            raise RuntimeError("this NcclGroup was destroyed")

    def _check_ranks(self, kind: str, rank: int, peer: int) -> None:
        if rank not in self.local_ranks:
            raise ValueError(
                f"{kind} on rank {rank}, which this worker does not own "
                f"(it owns ranks {sorted(self.local_ranks)})"
            )
        if not 0 <= peer < self.world_size:
            raise ValueError(
                f"peer rank {peer} is outside the group of world_size {self.world_size}"
            )

    def _wire_format(self, dtype: Any) -> _WireFormat:
        dtype = np.dtype(dtype)
        name = _NCCL_TYPE_NAMES.get(dtype.name)
        if name is not None and hasattr(self._nccl, name):
            carrier = np.dtype(np.uint16) if dtype.name == "bfloat16" else dtype
            return _WireFormat(carrier, getattr(self._nccl, name))
        return _WireFormat(np.dtype(np.uint8), self._nccl.NCCL_UINT8)


def execute_plan_transfers(
    group: NcclGroup,
    plan: TransferPlan,
    role: HostRole,
    dtype: Any,
    src_shards: Mapping[int, jax.Array] | None = None,
    dst_devices: Mapping[int, jax.Device] | None = None,
) -> dict[int, list[tuple[Box, jax.Array]]]:
    """Run this worker's part of ``plan`` over ``group``.

    Args:
      group: the worker's :class:`NcclGroup` of the plan's mesh pair, ranks laid out by
        :class:`RankLayout`.
      plan: the resharding plan; every worker of the pair runs the same plan.
      role: the source host and/or destination host this worker runs.
      dtype: the array's dtype (a destination worker holds no shard to read it from).
      src_shards: with ``role.src_host``, flat source device id -> that device's tile.
      dst_devices: with ``role.dst_host``, flat destination device id -> its jax device.

    Sends the pieces whose source device is on this worker's source host and receives
    those addressed to its destination host, all in one NCCL group. Returns, per destination
    device of this worker, the ``(box, piece)`` pairs (global coordinates, piece on that
    device) that together cover its tile exactly; ``{}`` for a worker with no destination
    host.
    """
    layout = RankLayout.of_plan(plan)
    if group.world_size != layout.world_size:
        raise ValueError(
            f"group has world_size {group.world_size}, the plan's mesh pair "
            f"{layout.src_mesh_shape} -> {layout.dst_mesh_shape} needs {layout.world_size}"
        )
    missing = sorted(set(layout.local_ranks(role)) - set(group.local_ranks))
    if missing:
        raise ValueError(f"a worker in role {role} must own ranks {missing} of the group")
    dtype = np.dtype(dtype)
    _check_side("src_shards", role.src_host, src_shards, layout.src_devices)
    _check_side("dst_devices", role.dst_host, dst_devices, layout.dst_devices)
    src_boxes = plan.src_boxes
    for device, shard in (src_shards or {}).items():
        want = tuple(hi - lo for lo, hi in src_boxes[device])
        if (tuple(shard.shape), shard.dtype) != (want, dtype):
            raise ValueError(
                f"shard of source device {device} is {shard.dtype}{shard.shape}, "
                f"the plan needs {dtype}{want}"
            )
    return _execute(group, plan, layout, role, dtype, src_shards or {}, src_boxes, dst_devices)


def _execute(
    group: NcclGroup,
    plan: TransferPlan,
    layout: RankLayout,
    role: HostRole,
    dtype: np.dtype,
    src_shards: Mapping[int, jax.Array],
    src_boxes: Sequence[Box],
    dst_devices: Mapping[int, jax.Device] | None,
) -> dict[int, list[tuple[Box, jax.Array]]]:
    sends, recvs, arrivals = [], [], []
    for index, t in enumerate(plan.pieces):
        # The devices of a destination host take turns receiving, to spread NIC load.
        receiver = t.dst_devices[index % len(t.dst_devices)]
        if t.src_device in src_shards:
            piece = src_shards[t.src_device][local_slices(t.box, src_boxes[t.src_device])]
            sends.append((piece, layout.src_rank(t.src_device), layout.dst_rank(receiver)))
        if t.dst_host == role.dst_host:
            shape = tuple(hi - lo for lo, hi in t.box)
            recvs.append((shape, dtype, layout.dst_rank(receiver), layout.src_rank(t.src_device)))
            arrivals.append(t)
    received = group.exchange(sends, recvs)
    pieces: dict[int, list[tuple[Box, jax.Array]]] = {device: [] for device in dst_devices or {}}
    for t, piece in zip(arrivals, received, strict=True):
        for device in t.dst_devices:
            pieces[device].append((t.box, jax.device_put(piece, dst_devices[device])))
    return pieces


def _check_side(
    name: str, host: int | None, given: Mapping | None, devices_of: Callable[[int], range]
) -> None:
    if host is None:
        if given is not None:
            raise ValueError(f"{name} given to a worker whose role has no host on that mesh")
        return
    if given is None:
        raise ValueError(f"a worker with a host on that mesh needs {name}")
    want = list(devices_of(host))
    if sorted(given) != want:
        raise ValueError(
            f"{name} must have exactly the devices {want} of host {host}, got {sorted(given)}"
        )


def _check_host(name: str, host: int, mesh_shape: tuple[int, int]) -> None:
    if host >= mesh_shape[0]:
        raise ValueError(f"{name}={host} but that mesh {mesh_shape} has {mesh_shape[0]} hosts")


def _wire_count(shape: Sequence[int], dtype: Any, fmt: _WireFormat) -> int:
    """Carrier elements, i.e. NCCL's ``count``, of an array of ``shape`` and ``dtype``."""
    return math.prod(shape) * np.dtype(dtype).itemsize // fmt.carrier.itemsize


def _to_wire(array: jax.Array, fmt: _WireFormat) -> jax.Array:
    flat = array.reshape(-1)
    return flat if flat.dtype == fmt.carrier else flat.view(fmt.carrier)


def _from_wire(buffer: jax.Array, dtype: Any, shape: Sequence[int]) -> jax.Array:
    return buffer.view(np.dtype(dtype)).reshape(tuple(shape))


def _import_cupy():
    try:
        import cupy
        from cupy.cuda import nccl  # not an attribute of cupy.cuda until imported (cupy 14)
    except ImportError as error:
        raise RuntimeError(
            "the NCCL transport needs cupy: `pip install alpa[gpu]` (or cupy-cuda12x); "
            "NCCL also needs NVIDIA GPUs"
        ) from error
    return cupy, nccl
