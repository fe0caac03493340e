"""MeshHostWorker: the Ray actor that owns one host's devices of one mesh.

One worker per (mesh, host) (``docs/ray.md``, What runs where). It is started with its
devices already decided: on GPUs through Ray's ``num_gpus``; on CPU through ``XLA_FLAGS`` in
its ``runtime_env`` (``--xla_force_host_platform_device_count``, after the driver's own
flags), set before this process imports jax. A mesh that spans several hosts is one
multi-controller JAX program over its workers (:meth:`MeshHostWorker.init_distributed`:
``jax.distributed.initialize``, gloo collectives on CPU): every worker of the mesh runs the
same instructions and holds the shards of its own devices.

What a worker holds:

* **buffers**, by name: the values ``DistributedArray`` handles on the driver point to
  (parameters, optimizer state, outputs). Nothing else outlives a step.
* **programs** (:class:`~alpa.runtime.worker_program.WorkerProgram`), shipped once at
  compile time; each :class:`ExportedFn` is deserialized and compiled here, on this
  worker's devices.

A step is one call of :meth:`run_step`: it walks the program with a handler per opcode
(``worker_ops``). Values bound for another mesh leave through ``SEND`` and arrive through
``RECV``, worker to worker, never through the driver (``worker_transfers``, the
:class:`~alpa.runtime.worker_transfers.MeshTransfers` half of this class).

The class is plain Python; ``ray_mesh`` wraps it with ``ray.remote`` (threaded, so that
``deliver`` and ``abort`` run while a step waits in a ``RECV``).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray

from alpa.device_memory import MemoryStats
from alpa.runtime.instructions import InFlight
from alpa.runtime.memory import allocation_bytes, device_peak_bytes
from alpa.runtime.nccl_transport import nccl_available
from alpa.runtime.worker_ops import HANDLERS, LoadedProgram
from alpa.runtime.worker_program import DummyValue, ExportedFn, Layout, WorkerOp, WorkerProgram
from alpa.runtime.worker_transfers import MeshTransfers
from alpa.xla_compile import compile_lowered, hlo_text

#: The concurrency group (one thread) of the calls that must run in the order the driver
#: sent them: freeing buffers, and listing those left.
BOOKKEEPING = "bookkeeping"


class MeshHostWorker(MeshTransfers):
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
        self._programs: dict[int, LoadedProgram] = {}
        self._meshes: dict[tuple, Any] = {}
        self._own_devices = None if devices is None else list(devices)
        self._readers: dict[str, list] = {}  # data loaders: [iterator, batches read, call]
        self._peak_in_flight: dict[int, int] = {}  # program id -> last step's peak
        self._memory = MemoryStats(self._local_devices)
        self._program_bytes: dict[int, int] = {}  # program id -> XLA's largest allocation
        self._remote_shards: dict[str, list] = {}  # put_buffers' shards awaiting a layout
        self._remote_expected: dict[str, list] = {}  # layouts awaiting put_buffers
        self._remote_lock = threading.Lock()
        self._traced: set[int] = set()  # programs whose RUNs are waited for and timed
        self._run_times: dict[int, list] = {}  # program id -> last step's (op, start, stop)
        self._init_transfers()

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

    def profile_devices(self, request: dict) -> dict:
        """This host's measurements for a cluster profile
        (``device_profiling.profile_host``: matmuls, elementwise work, concurrency, the
        collectives of its devices), as JSON-able data."""
        import jax

        from alpa.runtime.device_profiling import profile_host

        own = [d for d in self._devices() if d.process_index == jax.process_index()]
        return profile_host(own, request)

    # -- devices and layouts

    def _devices(self) -> list:
        import jax

        if self._own_devices is not None:
            return self._own_devices
        return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))

    def _local_devices(self) -> list:
        import jax

        return [d for d in self._devices() if d.process_index == jax.process_index()]

    def _sharding(self, layout: Layout):
        from jax.sharding import NamedSharding

        key = (layout.mesh_shape, layout.axis_names)
        if key not in self._meshes:
            from alpa.device_mesh import make_jax_mesh

            self._meshes[key] = make_jax_mesh(self._devices(), layout.mesh_shape, key[1])
        return NamedSharding(self._meshes[key], layout.spec)

    def _place(self, value: Any, layout: Layout):
        """A host array, a buffer of this worker or a ``DummyValue``, laid out as
        ``layout``."""
        import jax

        sharding = self._sharding(layout)
        if isinstance(value, DummyValue):
            from alpa.runtime.placement import dummy_array

            return dummy_array(value.shape, value.dtype, sharding)
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

    # -- buffers a program's own function fills (Alpa's weight loading: remote_arrays)

    @property
    def host_id(self) -> int:
        """Alpa's name of this worker's host index in its mesh."""
        return self.host

    @property
    def local_devices(self) -> list:
        """This worker's devices, in the order of their shards in ``put_buffers`` (and of
        ``Layout.shard_indices``, host by host)."""
        return self._local_devices()

    def put_buffers(
        self, uuids: Any, datas: Sequence[Any], num_batch: int = 1, batch_dim: int = 0
    ) -> None:
        """Alpa's: ``datas[k]`` is local device ``k``'s shard of buffer ``uuids`` (with
        ``num_batch`` > 1, of the ``num_batch`` buffers ``uuids``, each shard split along
        ``batch_dim``). The buffer becomes an array once its driver handle says its layout
        (``expect_buffers``)."""
        uuids = list(uuids) if isinstance(uuids, list | tuple | np.ndarray) else [uuids]
        if len(datas) != len(self.local_devices) or len(uuids) != num_batch:
            raise ValueError(
                f"put_buffers: {len(datas)} shards for {len(self.local_devices)} local devices "
                f"and {len(uuids)} buffer ids for num_batch={num_batch}"
            )
        parts = [np.split(np.asarray(d), num_batch, batch_dim) for d in datas]
        with self._remote_lock:
            for b, uuid in enumerate(uuids):
                self._remote_shards[str(uuid)] = [p[b] for p in parts]
                self._adopt_remote(str(uuid))

    def expect_buffers(self, names, layouts, shapes, dtypes) -> None:
        """The layout, shape and dtype of buffers ``put_buffers`` fills (in either order)."""
        with self._remote_lock:
            for name, *expected in zip(names, layouts, shapes, dtypes, strict=True):
                self._remote_expected[name] = expected
                self._adopt_remote(name)

    def _adopt_remote(self, name: str) -> None:
        if name not in self._remote_shards or name not in self._remote_expected:
            return
        import jax

        layout, shape, dtype = self._remote_expected.pop(name)
        shards = self._remote_shards.pop(name)
        sharding = self._sharding(layout)
        arrays = [
            jax.device_put(np.asarray(data, dtype), device)
            for data, device in zip(shards, self.local_devices, strict=True)
        ]
        self._buffers[name] = jax.make_array_from_single_device_arrays(shape, sharding, arrays)

    @ray.method(concurrency_group=BOOKKEEPING)
    def delete(self, names: Sequence[str]) -> None:
        for name in names:
            self._buffers.pop(name, None)

    @ray.method(concurrency_group=BOOKKEEPING)
    def get_live_buffer_uuids(self) -> list[str]:
        """Alpa's: the names of the buffers this worker holds, after every ``delete`` the
        driver sent before this call (both run in order, in one thread)."""
        return sorted(self._buffers)

    def device_buffers(self, name: str) -> list[np.ndarray]:
        """Every device's block of buffer ``name`` on this host, in the order of its mesh's
        devices (Alpa's ``get_buffers``; replicas included)."""
        x = self._get(name)
        position = {d: i for i, d in enumerate(x.sharding.mesh.devices.flat)}
        shards = sorted(x.addressable_shards, key=lambda s: position[s.device])
        return [np.asarray(s.data) for s in shards]

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

    # -- Alpa's memory statistics (alpa.device_memory) and synchronization

    def sync(self) -> None:
        """Wait until every buffer this worker holds is computed."""
        import jax

        jax.block_until_ready(list(self._buffers.values()))
        self._memory.observe()

    def memory_allocated(self) -> int:
        return self._memory.allocated()

    def max_memory_allocated(self) -> int:
        return self._memory.max_allocated()

    def reset_memory_stats(self) -> None:
        self._memory.reset()

    def allocation_size(self, program_id: int) -> int:
        """XLA's bytes per device for the largest function of program ``program_id``."""
        return self._program_bytes[program_id]

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
        self._programs[program_id] = LoadedProgram(program, fns)
        self._program_bytes[program_id] = max((allocation_bytes(f) for f in fns), default=0)
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
        self._program_bytes.pop(program_id, None)
        self._run_times.pop(program_id, None)
        self._traced.discard(program_id)

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
        traced = program_id in self._traced
        times = self._run_times[program_id] = []
        try:
            for i, (ins, born, dead) in enumerate(
                zip(program.instructions, loaded.born, loaded.dead, strict=True)
            ):
                start = time.time()
                HANDLERS[ins.op](self, loaded, ins, env, resolved, step_id)
                if traced and ins.op is WorkerOp.RUN:
                    jax.block_until_ready([env[slot] for slot in ins.out_slots])
                    times.append((i, start, time.time()))
                for micro_batch in born:
                    in_flight.written(0, micro_batch)
                for slot in ins.free:
                    env[slot] = None
                for micro_batch in dead:
                    in_flight.freed(0, micro_batch)
            self._peak_in_flight[program_id] = in_flight.peak[0]
        finally:
            self._end_step(step_id)
        outputs = [env[slot] for slot in program.outputs]
        # Finish the step before answering: the driver's wait then covers the computation
        # (and its errors), and every output is ready when the step returns.
        jax.block_until_ready(outputs)
        for name, value in zip(output_names, outputs, strict=True):
            self._buffers[name] = value
        seconds = time.perf_counter() - tic
        self._memory.observe(self._program_bytes[program_id])
        return seconds

    def trace_runs(self, program_id: int, on: bool) -> None:
        """From the next step of program ``program_id`` on, wait for each ``RUN`` and
        record when it started and stopped (``collect_trace``), or stop doing so."""
        if on:
            self._traced.add(program_id)
        else:
            self._traced.discard(program_id)

    def run_times(self, program_id: int) -> list[tuple[int, float, float]]:
        """The last traced step's ``RUN`` s: (instruction index, start, stop), wall clock."""
        return list(self._run_times.get(program_id, ()))

    def peak_live_micro_batches(self, program_id: int) -> int:
        """The most micro-batches whose buffers (written by a ``RUN``) this worker held at
        once during the last step of program ``program_id``."""
        return self._peak_in_flight.get(program_id, 0)
