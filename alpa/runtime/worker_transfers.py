"""Moving values between meshes, a Ray mesh worker's side (``SEND`` and ``RECV``).

A ``SEND`` slices the pieces of a :class:`~alpa.runtime.worker_program.TransferPlan` from
the worker's own shards and hands them straight to the destination workers, never
through the driver: on CPU through Ray's object store (:meth:`MeshTransfers.deliver`,
called on the receiving worker), on GPUs device to device over the NCCL group of the mesh
pair (``nccl_transport``). A ``RECV`` waits for its pieces (or an :meth:`abort` from the
driver, when another worker failed) and assembles its devices' tiles. Each piece crosses
once per destination host; a tile several devices of the host keep is copied to them
locally. The worker counts the bytes it sends and receives.

:class:`MeshTransfers` is a mixin of :class:`~alpa.runtime.ray_worker.MeshHostWorker`: it
keeps its own state (:meth:`MeshTransfers._init_transfers`; the worker adds to ``_peers``
the workers a loaded program sends to, and ends each step with :meth:`_end_step`) and
reads the worker's ``mesh_id``, ``host``, buffers (``_buffers``, ``_get``) and layouts
(``_devices``, ``_sharding``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from alpa.runtime.nccl_transport import HostRole, NcclGroup, RankLayout, new_unique_id
from alpa.runtime.worker_program import TransferPlan, local_slices

#: How long a ``RECV`` waits, in total, before it gives up (the driver aborts much
#: sooner when a peer dies; this only bounds a hang nobody reports).
RECV_TIMEOUT_S = 600.0


class StepAborted(RuntimeError):
    """A step stopped because the driver aborted it (another worker failed)."""


class MeshTransfers:
    """See the module docstring."""

    def _init_transfers(self) -> None:
        self._peers: dict[tuple[int, int], Any] = {}  # (mesh id, host) -> worker handle
        self._mailbox: dict[tuple, dict[int, np.ndarray]] = {}
        self._cond = threading.Condition()
        self._aborted: dict[int, str] = {}
        self._nccl_groups: dict[tuple[int, int], Any] = {}  # (src mesh, dst mesh) -> group
        self.bytes_sent = 0
        self.bytes_received = 0

    def _end_step(self, step_id: int) -> None:
        """Forget step ``step_id``'s abort and the pieces of it still in the mailbox."""
        self._aborted.pop(step_id, None)
        with self._cond:
            for key in [k for k in self._mailbox if k[0] == step_id]:
                del self._mailbox[key]

    # -- NCCL (GPU meshes)

    def nccl_unique_id(self):
        return new_unique_id()

    def init_nccl_group(
        self,
        src_mesh: int,
        dst_mesh: int,
        unique_id,
        src_mesh_shape: tuple[int, int],
        dst_mesh_shape: tuple[int, int],
        src_host: int | None,
        dst_host: int | None,
    ) -> None:
        """Open this worker's ranks of the NCCL group of a mesh pair (a collective: every
        worker of both meshes calls it at once). Ranks: the source mesh's devices, then
        the destination mesh's (``nccl_transport.RankLayout``)."""
        layout = RankLayout(tuple(src_mesh_shape), tuple(dst_mesh_shape))
        ranks = layout.local_ranks(HostRole(src_host, dst_host))
        self._nccl_groups[(src_mesh, dst_mesh)] = NcclGroup(unique_id, layout.world_size, ranks)

    def abort(self, step_id: int, reason: str) -> None:
        """Make the step's waiting ``RECV`` (if any) raise: another worker failed."""
        with self._cond:
            self._aborted[step_id] = reason
            self._cond.notify_all()

    def deliver(self, tag: tuple, pieces: dict[int, np.ndarray]) -> None:
        """Pieces of a transfer from another mesh's worker (called by that worker)."""
        with self._cond:
            self._mailbox.setdefault(tag, {}).update(pieces)
            self.bytes_received += sum(p.nbytes for p in pieces.values())
            self._cond.notify_all()

    def _send(self, value, plan: TransferPlan, tag: tuple, dst_mesh: int) -> None:
        """Push this host's pieces of ``plan`` to the destination workers."""
        shards = {}
        devices = self._devices()
        index_of = {d: i for i, d in enumerate(devices)}
        for shard in value.addressable_shards:
            shards[index_of[shard.device]] = shard
        group = self._nccl_groups.get((self.mesh_id, dst_mesh))
        if group is not None:  # GPUs: device buffers straight to the receiving devices
            src_num_devices = len(plan.src_boxes)
            sends = []
            for i, piece in plan.pieces_from(self.host):
                local = local_slices(piece.box, plan.src_boxes[piece.src_device])
                receiver = piece.dst_devices[i % len(piece.dst_devices)]
                data = shards[piece.src_device].data[local]
                sends.append((data, piece.src_device, src_num_devices + receiver))
            group.send_pieces(sends)
            self.bytes_sent += sum(int(data.nbytes) for data, _, _ in sends)
            return
        by_host: dict[int, dict[int, np.ndarray]] = {}
        for i, piece in plan.pieces_from(self.host):
            local = local_slices(piece.box, plan.src_boxes[piece.src_device])
            data = np.array(np.asarray(shards[piece.src_device].data)[local], order="C")
            by_host.setdefault(piece.dst_host, {})[i] = data
        for host, pieces in by_host.items():
            self._peers[(dst_mesh, host)].deliver.remote(tag, pieces)
            self.bytes_sent += sum(p.nbytes for p in pieces.values())

    def _receive(self, plan: TransferPlan, tag: tuple, step_id: int | None, src_mesh: int):
        """Wait for this host's pieces of ``plan``; assemble the destination array."""
        group = self._nccl_groups.get((src_mesh, self.mesh_id))
        if group is not None:
            src_num_devices = len(plan.src_boxes)
            mine = plan.pieces_to(self.host)
            recvs = [
                (
                    tuple(hi - lo for lo, hi in piece.box),
                    plan.dtype,
                    src_num_devices + piece.dst_devices[i % len(piece.dst_devices)],
                    piece.src_device,
                )
                for i, piece in mine
            ]
            arrived = group.recv_pieces(recvs)
            self.bytes_received += sum(int(x.nbytes) for x in arrived)
            return self._assemble(plan, {i: x for (i, _), x in zip(mine, arrived, strict=True)})
        expected = {i for i, _ in plan.pieces_to(self.host)}
        deadline = time.monotonic() + RECV_TIMEOUT_S
        with self._cond:
            while not expected <= self._mailbox.get(tag, {}).keys():
                if step_id is not None and step_id in self._aborted:
                    raise StepAborted(self._aborted[step_id])
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"mesh {self.mesh_id} host {self.host}: pieces of {tag} did not "
                        f"arrive within {RECV_TIMEOUT_S} s"
                    )
                self._cond.wait(timeout=0.5)
            received = self._mailbox.pop(tag)
        return self._assemble(plan, received)

    def _assemble(self, plan: TransferPlan, received: dict[int, Any]):
        """This host's part of the destination array from its pieces (host or device
        arrays, by piece index)."""
        import jax

        sharding = self._sharding(plan.dst_layout)
        devices = list(sharding.mesh.devices.flat)
        # One buffer per distinct tile: the devices of a piece share its tile, so a
        # replicated destination assembles the value once and copies it to each device.
        # A piece that is a whole tile is used as it arrived (on GPUs, on its device).
        tiles: dict = {}
        for i, piece in plan.pieces_to(self.host):
            tile_box = plan.dst_boxes[piece.dst_devices[0]]
            if piece.box == tile_box:
                tiles[tile_box] = received[i]
                continue
            if tile_box not in tiles:
                tiles[tile_box] = np.empty([hi - lo for lo, hi in tile_box], plan.dtype)
            tiles[tile_box][local_slices(piece.box, tile_box)] = np.asarray(received[i])
        # Each tile goes to the first device that keeps it, then device to device to the
        # others (separate buffers: on CPU, device_put may alias the host array).
        placed: dict = {}
        arrays = []
        for d, device in enumerate(devices):
            if device.process_index != jax.process_index():
                continue
            tile_box = plan.dst_boxes[d]
            source = placed.get(tile_box, tiles[tile_box])
            if isinstance(source, np.ndarray) and tile_box not in placed:
                source = np.array(source)  # the tile may be a piece Ray's object store owns
            arrays.append(jax.device_put(source, device))
            placed.setdefault(tile_box, arrays[-1])
        return jax.make_array_from_single_device_arrays(plan.shape, sharding, arrays)

    def send_buffer(
        self, name: str, plan: TransferPlan, tag: tuple, dst_mesh: int, dst_workers: list
    ) -> None:
        """Outside a step: send buffer ``name`` to the workers of another mesh (the
        driver moves an argument that lives on the wrong mesh this way)."""
        self._peers.update({(dst_mesh, h): w for h, w in enumerate(dst_workers)})
        self._send(self._get(name), plan, tag, dst_mesh)

    def recv_buffer(self, name: str, plan: TransferPlan, tag: tuple, src_mesh: int) -> None:
        self._buffers[name] = self._receive(plan, tag, None, src_mesh)
