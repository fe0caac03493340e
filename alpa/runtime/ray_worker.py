"""MeshHostWorker: the Ray actor that owns one host's devices of one mesh.

One worker per (mesh, host) (DESIGN §6). It is started with its devices already decided:
on GPUs through Ray's ``num_gpus``; on CPU through ``XLA_FLAGS`` in its ``runtime_env``
(``--xla_force_host_platform_device_count``, after the driver's own flags), set before this
process imports jax. A mesh that spans several hosts is one multi-controller JAX program
over its workers (:meth:`MeshHostWorker.init_distributed`: ``jax.distributed.initialize``,
gloo collectives on CPU): every worker of the mesh runs the same instructions and holds
the shards of its own devices.

What a worker holds:

* **buffers**, by name: the values ``DistributedArray`` handles on the driver point to
  (parameters, optimizer state, outputs). Nothing else outlives a step.
* **programs** (:class:`~alpa.runtime.worker_program.WorkerProgram`), shipped once at
  compile time; each :class:`ExportedFn` is deserialized and compiled here, on this
  worker's devices.

A step is one call of :meth:`run_step`: it walks the program with a handler per opcode.
Values bound for another mesh leave through ``SEND``: the worker slices the pieces of the
tile plan from its own shards and hands them straight to the destination workers
(:meth:`deliver`, through Ray's object store), never through the driver; a ``RECV`` waits
for its pieces (or an :meth:`abort` from the driver, when another worker failed) and
assembles its devices' tiles. Each piece crosses once per destination host; a tile several
devices of the host keep is copied to them locally. The worker counts the bytes it sends
and receives.

The class is plain Python; ``ray_mesh`` wraps it with ``ray.remote`` (threaded, so that
``deliver`` and ``abort`` run while a step waits in a ``RECV``).
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from alpa.runtime.instructions import InFlight
from alpa.runtime.memory import allocation_bytes, device_peak_bytes
from alpa.runtime.nccl_transport import (
    HostRole,
    NcclGroup,
    RankLayout,
    nccl_available,
    new_unique_id,
)
from alpa.runtime.worker_program import (
    ExportedFn,
    Layout,
    TransferPlan,
    WorkerInstruction,
    WorkerOp,
    WorkerProgram,
    local_slices,
)
from alpa.xla_compile import compile_lowered, hlo_text

#: How long a ``RECV`` waits, in total, before it gives up (the driver aborts much
#: sooner when a peer dies; this only bounds a hang nobody reports).
RECV_TIMEOUT_S = 600.0


class StepAborted(RuntimeError):
    """A step stopped because the driver aborted it (another worker failed)."""


class MeshHostWorker:
    """See the module docstring."""

    def __init__(
        self,
        mesh_id: int,
        host: int,
        num_hosts: int,
        num_devices_per_host: int,
        devices: Sequence[Any] | None = None,
    ):
        """``devices``: the devices this worker owns, for a worker built inside another
        process (tests); an actor owns every device its process sees."""
        self.mesh_id = mesh_id
        self.host = host
        self.num_hosts = num_hosts
        self.num_devices_per_host = num_devices_per_host
        self._buffers: dict[str, Any] = {}
        self._programs: dict[int, _LoadedProgram] = {}
        self._peers: dict[tuple[int, int], Any] = {}
        self._mailbox: dict[tuple, dict[int, np.ndarray]] = {}
        self._cond = threading.Condition()
        self._aborted: dict[int, str] = {}
        self._meshes: dict[tuple, Any] = {}
        self._own_devices = None if devices is None else list(devices)
        self._nccl_groups: dict[tuple[int, int], Any] = {}  # (src mesh, dst mesh) -> group
        self._readers: dict[str, list] = {}  # data loaders: [iterator, batches read, call]
        self.bytes_sent = 0
        self.bytes_received = 0
        self._peak_in_flight: dict[int, int] = {}  # program id -> last step's peak

    # -- setup

    def free_port(self) -> tuple[str, int]:
        """An address on this node for the coordinator of ``jax.distributed``."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_distributed(self, coordinator: str, num_processes: int, process_id: int) -> None:
        """Join the mesh's multi-controller JAX program (before jax touches a device)."""
        import jax

        if os.environ.get("JAX_PLATFORMS", "") == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes, process_id)

    def describe(self) -> dict:
        """Node, platform and devices this worker owns (what the driver checks)."""
        import jax
        import ray

        local = jax.local_devices()
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "platform": local[0].platform,
            "device_kind": local[0].device_kind,
            "num_local_devices": len(local),
            "num_devices": len(jax.devices()),
            "pid": os.getpid(),
            "nccl": nccl_available(),
        }

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

    # -- devices and layouts

    def _devices(self) -> list:
        import jax

        if self._own_devices is not None:
            return self._own_devices
        return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))

    def _sharding(self, layout: Layout):
        from jax.sharding import NamedSharding

        key = (layout.mesh_shape, layout.axis_names)
        if key not in self._meshes:
            from alpa.device_mesh import make_jax_mesh

            self._meshes[key] = make_jax_mesh(self._devices(), layout.mesh_shape, key[1])
        return NamedSharding(self._meshes[key], layout.spec)

    def _place(self, value: Any, layout: Layout):
        """A host array or a buffer of this worker, laid out as ``layout``."""
        import jax

        sharding = self._sharding(layout)
        if isinstance(value, jax.Array):
            if value.sharding == sharding or value.sharding.is_equivalent_to(sharding, value.ndim):
                return value
            return jax.device_put(value, sharding)
        data = np.asarray(value)
        if sharding.is_fully_addressable:
            return jax.device_put(data, sharding)
        return jax.make_array_from_callback(data.shape, sharding, lambda index: data[index])

    # -- buffers

    def put(self, names: Sequence[str], values: Sequence[Any], layouts: Sequence[Layout]):
        """Place host arrays as named buffers (returns once they are on the devices)."""
        import jax

        for name, value, layout in zip(names, values, layouts, strict=True):
            self._buffers[name] = self._place(value, layout)
        jax.block_until_ready([self._buffers[name] for name in names])

    def fetch(self, names: Sequence[str]) -> list[Any]:
        """Per name, the whole array (a mesh on one host) or this host's distinct shards
        as ``[(index, data), ...]``."""
        out = []
        for name in names:
            x = self._get(name)
            if x.is_fully_addressable:
                out.append(np.asarray(x))
            else:
                seen, shards = set(), []
                for shard in x.addressable_shards:
                    key = tuple((s.start, s.stop) for s in shard.index)
                    if key not in seen:
                        seen.add(key)
                        shards.append((shard.index, np.asarray(shard.data)))
                out.append(shards)
        return out

    def fetch_shards(self, name: str) -> list[tuple[tuple[slice, ...], np.ndarray]]:
        """Every device's shard of buffer ``name`` on this host (replicas included)."""
        return [(s.index, np.asarray(s.data)) for s in self._get(name).addressable_shards]

    # -- data loading (alpa.MeshDriverDataLoader)

    def open_rows(self, reader: str, read: Callable, start: int, end: int, rows: int) -> None:
        """Start reading this host's rows: ``read(start, end, rows)`` iterates over host
        batches (lists of arrays, ``rows`` rows each) of samples ``[start, end)``."""
        self._readers[reader] = [iter(read(start, end, rows)), 0, (start, end, rows)]

    def next_rows(
        self,
        reader: str,
        names: Sequence[str],
        leaves: Sequence[int],
        layouts: Sequence[Layout],
        shapes: Sequence[tuple[int, ...]],
        row_start: int,
    ) -> None:
        """Read the next host batch and make buffers ``names`` of it: leaf ``leaves[i]``
        of the host batch holds rows ``row_start ..`` of a global array of ``shapes[i]``,
        laid out as ``layouts[i]``; each device of this host gets its slice."""
        import jax

        state = self._readers[reader]
        try:
            host_batch = next(state[0])
        except StopIteration:
            start, end, rows = state[2]
            raise ValueError(
                f"input_iter_func({start}, {end}, {rows}) stopped after {state[1]} batches"
            ) from None
        state[1] += 1
        for name, leaf, layout, shape in zip(names, leaves, layouts, shapes, strict=True):
            host_rows = np.asarray(host_batch[leaf])

            def piece(index, host_rows=host_rows, num_rows=shape[0]):
                first = index[0].indices(num_rows) if index else (0, num_rows, 1)
                local = slice(first[0] - row_start, first[1] - row_start)
                return host_rows[(local, *index[1:])]

            self._buffers[name] = jax.make_array_from_callback(
                tuple(shape), self._sharding(layout), piece
            )
        jax.block_until_ready([self._buffers[name] for name in names])

    def close_rows(self, reader: str) -> None:
        self._readers.pop(reader, None)

    # -- checkpoints (alpa.runtime.checkpoint_parts)

    def save_checkpoint_part(
        self, directory: str, names: Sequence[str], paths: Sequence[str]
    ) -> None:
        """Write buffers ``names`` under ``paths`` as the checkpoint part at ``directory``.
        Every worker of the mesh calls it; each writes the shards its devices hold."""
        from alpa.runtime.checkpoint_parts import write_part

        write_part(directory, {p: self._get(n) for n, p in zip(names, paths, strict=True)})

    def restore_checkpoint_part(
        self,
        directory: str,
        names: Sequence[str],
        paths: Sequence[str],
        layouts: Sequence[Layout],
        dtypes: Sequence[Any],
    ) -> None:
        """Read leaves ``paths`` of the part at ``directory`` into buffers ``names``, laid
        out as ``layouts``: each device reads only its slice."""
        from alpa.runtime.checkpoint_parts import block, read_part

        wanted = {
            p: (self._sharding(layout), dtype)
            for p, layout, dtype in zip(paths, layouts, dtypes, strict=True)
        }
        values = read_part(directory, wanted)
        block(values)
        for name, path in zip(names, paths, strict=True):
            self._buffers[name] = values[path]

    def delete(self, names: Sequence[str]) -> None:
        for name in names:
            self._buffers.pop(name, None)

    def _get(self, name: str):
        try:
            return self._buffers[name]
        except KeyError:
            raise KeyError(
                f"mesh {self.mesh_id} host {self.host} holds no buffer {name!r} (deleted, "
                "donated to a step, or never placed here)"
            ) from None

    def live_buffers(self) -> dict:
        """The buffer names this worker holds and the device memory held by arrays that
        are none of them: ``unnamed_buffers`` / ``unnamed_bytes`` count distinct device
        buffers (after a garbage collection) that no named buffer shares. Jax keeps views
        of a named buffer's shards (after a fetch, for instance); those share its memory
        and do not count."""
        import gc

        import jax

        gc.collect()

        def buffers(arrays):
            found = {}
            for x in arrays:
                if x.is_deleted():
                    continue
                for shard in x.addressable_shards:
                    data = shard.data
                    found[(data.device.id, data.unsafe_buffer_pointer())] = data.nbytes
            return found

        named = buffers(self._buffers.values())
        unnamed = {k: n for k, n in buffers(jax.live_arrays()).items() if k not in named}
        return {
            "names": sorted(self._buffers),
            "unnamed_buffers": len(unnamed),
            "unnamed_bytes": sum(unnamed.values()),
        }

    def counters(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received}

    def reset_counters(self) -> None:
        self.bytes_sent = self.bytes_received = 0

    # -- programs

    def load_program(
        self, program_id: int, program: WorkerProgram, peers: dict[tuple[int, int], Any]
    ) -> list[list[Any]]:
        """Compile the program's functions on this worker's devices; per function, the
        ``Layout`` of each output as compiled. ``peers``: the handles of the
        workers it sends to, by ``(mesh id, host)``."""
        import jax

        self._peers.update(peers)
        fns = [self._compile(fn) for fn in program.fns]
        self._programs[program_id] = _LoadedProgram(program, fns)
        return [
            [
                Layout(tuple(s.mesh.devices.shape), tuple(s.mesh.axis_names), s.spec)
                for s in jax.tree.leaves(f.output_shardings)
            ]
            for f in fns
        ]

    def _compile(self, fn: ExportedFn) -> Callable:
        import jax

        exported = jax.export.deserialize(bytearray(fn.serialized))
        in_shardings = tuple(self._sharding(layout) for layout in fn.in_layouts)
        # An output without a layout is left to XLA (None), as the driver exported it.
        out_shardings = jax.tree.unflatten(
            exported.out_tree,
            [None if layout is None else self._sharding(layout) for layout in fn.out_layouts],
        )
        jitted = jax.jit(
            exported.call,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            donate_argnums=fn.donate_argnums,
        )
        structs = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
            for a, s in zip(exported.in_avals, in_shardings, strict=True)
        ]
        return compile_lowered(jitted.lower(*structs), self._devices()[0].platform)

    def hlo_text(self, program_id: int, fn: int) -> str:
        return hlo_text(self._programs[program_id].fns[fn])

    def peak_memory(self) -> int:
        """Peak bytes a device of this worker allocated: the allocator's figure where the
        platform keeps one (GPU), else XLA's estimate for the largest loaded program
        (arguments + outputs + temporaries, per device)."""
        import jax

        measured = device_peak_bytes(jax.local_devices())
        if measured is not None:
            return measured
        # No allocator statistics (CPU): XLA's estimate for the largest loaded program.
        return max(
            (allocation_bytes(c) for loaded in self._programs.values() for c in loaded.fns),
            default=0,
        )

    def unload_program(self, program_id: int) -> None:
        self._programs.pop(program_id, None)

    def run_step(
        self,
        program_id: int,
        step_id: int,
        output_names: Sequence[str],
        consumed: Sequence[str],
        *args: Any,
    ) -> float:
        """Run one step of program ``program_id``. ``args[i]`` is a host array or the name
        of a buffer held here; the program's outputs are kept under ``output_names``;
        buffers ``consumed`` (donated inputs) are dropped. Returns the seconds it took."""
        import jax

        tic = time.perf_counter()
        loaded = self._programs[program_id]
        program = loaded.program
        env: list[Any] = [None] * program.num_slots
        resolved = [self._get(a) if isinstance(a, str) else a for a in args]
        for name in consumed:
            self._buffers.pop(name, None)
        in_flight = InFlight(1)
        try:
            for ins, born, dead in zip(program.instructions, loaded.born, loaded.dead, strict=True):
                _HANDLERS[ins.op](self, loaded, ins, env, resolved, step_id)
                for micro_batch in born:
                    in_flight.written(0, micro_batch)
                for slot in ins.free:
                    env[slot] = None
                for micro_batch in dead:
                    in_flight.freed(0, micro_batch)
            self._peak_in_flight[program_id] = in_flight.peak[0]
        finally:
            self._aborted.pop(step_id, None)
            with self._cond:
                for key in [k for k in self._mailbox if k[0] == step_id]:
                    del self._mailbox[key]
        outputs = [env[slot] for slot in program.outputs]
        # Finish the step before answering: the driver's wait then covers the computation
        # (and its errors), and every output is ready when the step returns.
        jax.block_until_ready(outputs)
        for name, value in zip(output_names, outputs, strict=True):
            self._buffers[name] = value
        return time.perf_counter() - tic

    def peak_live_micro_batches(self, program_id: int) -> int:
        """The most micro-batches whose buffers (written by a ``RUN``) this worker held at
        once during the last step of program ``program_id``."""
        return self._peak_in_flight.get(program_id, 0)

    def abort(self, step_id: int, reason: str) -> None:
        """Make the step's waiting ``RECV`` (if any) raise: another worker failed."""
        with self._cond:
            self._aborted[step_id] = reason
            self._cond.notify_all()

    # -- moves between meshes

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


class _LoadedProgram:
    def __init__(self, program: WorkerProgram, fns: list[Callable]):
        self.program = program
        self.fns = fns
        self.unstack: dict[tuple, Callable] = {}  # per LOAD: the compiled split
        # Per instruction, the micro-batches of the buffers it writes (a RUN) and frees
        # that the in-flight count is about (WorkerProgram.micro_batch_of).
        tag = program.micro_batch_of or (None,) * program.num_slots
        self.born = [
            tuple(tag[s] for s in ins.out_slots if tag[s] is not None)
            if ins.op is WorkerOp.RUN
            else ()
            for ins in program.instructions
        ]
        self.dead = [
            tuple(tag[s] for s in ins.free if tag[s] is not None) for ins in program.instructions
        ]


# ----------------------------------------------------------------------------- handlers


def _input(w: MeshHostWorker, lp: _LoadedProgram, ins: WorkerInstruction, env, args, step):
    env[ins.out_slots[0]] = w._place(args[ins.arg], ins.layout)


def _load(w: MeshHostWorker, lp: _LoadedProgram, ins: WorkerInstruction, env, args, step):
    """The ``k`` micro-batches of a batch argument: one placement of the whole batch as
    ``[k, size, ...]`` (each micro-batch laid out as the mesh wants it), then one compiled
    split on the devices."""
    import jax
    from jax.sharding import PartitionSpec

    k = len(ins.out_slots)
    value = args[ins.arg]
    if k == 1:
        env[ins.out_slots[0]] = w._place(value, ins.layout)
        return
    sharding = w._sharding(ins.layout)
    data = np.asarray(value)
    data = data.reshape((k, ins.micro_batch_size) + data.shape[1:])
    stacked_layout = Layout(
        ins.layout.mesh_shape, ins.layout.axis_names, PartitionSpec(None, *ins.layout.spec)
    )
    stacked = w._place(data, stacked_layout)
    key = (ins.arg, k, ins.layout)
    if key not in lp.unstack:
        lp.unstack[key] = jax.jit(lambda s: [s[m] for m in range(k)], out_shardings=[sharding] * k)
    for slot, part in zip(ins.out_slots, lp.unstack[key](stacked), strict=True):
        env[slot] = part


def _run(w: MeshHostWorker, lp: _LoadedProgram, ins: WorkerInstruction, env, args, step):
    outs = lp.fns[ins.fn](*[env[i] for i in ins.in_slots])
    for slot, value in zip(ins.out_slots, outs, strict=True):
        env[slot] = value


def _zeros(w: MeshHostWorker, lp: _LoadedProgram, ins: WorkerInstruction, env, args, step):
    for slot, value in zip(ins.out_slots, lp.fns[ins.fn](), strict=True):
        env[slot] = value


def _send(w: MeshHostWorker, lp: _LoadedProgram, ins: WorkerInstruction, env, args, step):
    w._send(env[ins.in_slots[0]], ins.transfer, (step, ins.tag), ins.peer_mesh)


def _recv(w: MeshHostWorker, lp: _LoadedProgram, ins: WorkerInstruction, env, args, step):
    env[ins.out_slots[0]] = w._receive(ins.transfer, (step, ins.tag), step, ins.peer_mesh)


def _concat(w: MeshHostWorker, lp: _LoadedProgram, ins: WorkerInstruction, env, args, step):
    env[ins.out_slots[0]] = jitted_concat()(*[env[i] for i in ins.in_slots])


def _mean(w: MeshHostWorker, lp: _LoadedProgram, ins: WorkerInstruction, env, args, step):
    env[ins.out_slots[0]] = jitted_mean()(*[env[i] for i in ins.in_slots])


@functools.cache
def jitted_concat() -> Callable:
    """``CONCAT``, compiled: per-micro-batch values joined along axis 0 (made on first use,
    after this process has set up jax; the local runtime uses it too)."""
    import jax

    return jax.jit(lambda *xs: jax.numpy.concatenate(xs, axis=0))


@functools.cache
def jitted_mean() -> Callable:
    """``MEAN``, compiled: the mean of per-micro-batch values (a scalar loss)."""
    import jax

    return jax.jit(lambda *xs: sum(xs[1:], xs[0]) / len(xs))


_HANDLERS: dict[WorkerOp, Callable] = {
    WorkerOp.INPUT: _input,
    WorkerOp.LOAD: _load,
    WorkerOp.RUN: _run,
    WorkerOp.ZEROS: _zeros,
    WorkerOp.SEND: _send,
    WorkerOp.RECV: _recv,
    WorkerOp.CONCAT: _concat,
    WorkerOp.MEAN: _mean,
}
