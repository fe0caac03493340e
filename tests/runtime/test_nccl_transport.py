"""The NCCL transport of cross-mesh resharding, on a fake ``cupy`` (no GPU here).

The fake replaces only the lowest layer, ``cupy`` and ``cupy.cuda.nccl``: device buffers are
numpy arrays tagged with the CUDA device index they were made under, and every
``NcclCommunicator`` of one unique id shares in-memory FIFOs of bytes, one per (source
rank, destination rank). Like NCCL, the fake reads a buffer through its pointer with the
``count`` and datatype it is given, matches sends and receives at ``groupEnd`` (a receive
with no send would hang: it fails), and writes received bytes only when the stream is
synchronized. Each (mesh, host) worker runs as its own :class:`NcclGroup` in this process;
the CUDA device index of rank ``r`` is CPU device ``r``.
"""

from __future__ import annotations

import collections
import itertools
import math
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa.runtime.nccl_transport import (
    HostRole,
    NcclGroup,
    RankLayout,
    execute_plan_transfers,
    nccl_available,
    new_unique_id,
)
from alpa.runtime.resharding import MeshSharding, plan_resharding

SHAPE = (8, 12)
MESHES = [(1, 2), (2, 1), (1, 4), (2, 2)]
LAYOUTS = {
    "replicated": ((), ()),
    "row": ((0, 1), ()),
    "column": ((), (0, 1)),
    "2d": ((0,), (1,)),
}

NCCL_TYPES = {
    "NCCL_INT8": 0,
    "NCCL_UINT8": 1,
    "NCCL_INT32": 2,
    "NCCL_UINT32": 3,
    "NCCL_INT64": 4,
    "NCCL_UINT64": 5,
    "NCCL_FLOAT16": 6,
    "NCCL_FLOAT32": 7,
    "NCCL_FLOAT64": 8,
    "NCCL_BFLOAT16": 9,
}
NCCL_SIZES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}
UNSET = 0xAB  # fresh fake device memory holds this byte until something writes it


# --- the fake cupy ----------------------------------------------------------------------


class _DeviceArray(np.ndarray):
    """A fake cupy array: numpy memory on a CUDA device index, with cupy's ``data.ptr``."""

    device_index: int

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


class FakeNccl:
    """The state behind one fake ``cupy``: devices, buffers, communicators, wires."""

    def __init__(self):
        self.device_stack = [0]
        self.buffers: dict[int, _DeviceArray] = {}  # pointer -> buffer
        self.comms: list[_FakeComm] = []
        self.wires = collections.defaultdict(collections.deque)  # (uid, src, dst) -> data
        self.group_depth = 0
        self.pending: list[tuple] = []
        self.op_groups: list[list[tuple]] = []  # per groupEnd: (op, rank, peer, type, count)
        self.next_uid = 0
        self.streams: dict[int, _FakeStream] = {}  # pointer -> stream

    def module(self, with_bfloat16: bool = True) -> types.ModuleType:
        cupy = types.ModuleType("cupy")
        cupy.cuda = types.ModuleType("cupy.cuda")
        nccl = cupy.cuda.nccl = types.ModuleType("cupy.cuda.nccl")
        for name, value in NCCL_TYPES.items():
            if with_bfloat16 or name != "NCCL_BFLOAT16":
                setattr(nccl, name, value)
        nccl.available = True
        nccl.get_unique_id = self.get_unique_id
        nccl.groupStart = self.group_start
        nccl.groupEnd = self.group_end
        nccl.NcclCommunicator = lambda world, uid, rank: _FakeComm(self, world, uid, rank)
        cupy.cuda.is_available = lambda: True
        cupy.cuda.Device = self.device
        cupy.cuda.Stream = self.stream
        cupy.from_dlpack = self.from_dlpack
        cupy.empty = self.empty
        return cupy

    @property
    def current_device(self) -> int:
        return self.device_stack[-1]

    def get_unique_id(self) -> tuple[int, ...]:
        self.next_uid += 1
        return (self.next_uid,) + (0,) * 127

    def device(self, index: int):
        fake = self

        class _Device:
            def __enter__(self):
                fake.device_stack.append(index)

            def __exit__(self, *exc):
                fake.device_stack.pop()

        return _Device()

    def _register(self, array: np.ndarray, device_index: int) -> _DeviceArray:
        buffer = array.view(_DeviceArray)
        buffer.device_index = device_index
        self.buffers[buffer.data.ptr] = buffer
        return buffer

    def from_dlpack(self, array: jax.Array) -> _DeviceArray:
        (device,) = array.devices()
        return self._register(np.from_dlpack(array), device.id)

    def empty(self, shape, dtype) -> _DeviceArray:
        array = np.empty(shape, dtype)
        array.view(np.uint8)[...] = UNSET
        return self._register(array, self.current_device)

    def stream(self, non_blocking: bool = False) -> _FakeStream:
        stream = _FakeStream()
        self.streams[stream.ptr] = stream
        return stream

    def group_start(self):
        self.group_depth += 1

    def group_end(self):
        self.group_depth -= 1
        if self.group_depth or not self.pending:
            return
        ops, self.pending = self.pending, []
        self.op_groups.append([(op, comm.rank, peer, t, n) for op, comm, peer, t, n, *_ in ops])
        # Sends first: NCCL does not care in which order a group lists its calls.
        for op, comm, peer, _, _, data, _ in sorted(ops, key=lambda op: op[0] == "recv"):
            if op == "send":
                self.wires[comm.uid, comm.rank, peer].append(data)
            elif op == "bcast" and comm.rank == peer:
                for rank in range(comm.world_size):
                    if rank != peer:
                        self.wires[comm.uid, peer, rank, "bcast"].append(data)
        for op, comm, peer, _, _, nbytes, stream_and_buffer in ops:
            if op == "send" or (op == "bcast" and comm.rank == peer):
                continue
            key = (comm.uid, peer, comm.rank) + (("bcast",) if op == "bcast" else ())
            assert self.wires[key], f"{op} on rank {comm.rank} from {peer}: no send, would hang"
            data = self.wires[key].popleft()
            assert len(data) == nbytes, f"rank {comm.rank} expects {nbytes} bytes, got {len(data)}"
            stream, buffer = stream_and_buffer
            stream.unsynchronized.append((buffer, data))

    def enqueue(self, op: str, comm, ptr: int, count: int, nccl_type: int, peer: int, stream):
        assert self.group_depth > 0, f"{op} outside groupStart/groupEnd"
        buffer = self.buffers[ptr]
        assert buffer.device_index == comm.device, "buffer and communicator on other devices"
        nbytes = count * NCCL_SIZES[nccl_type]
        assert nbytes == buffer.nbytes, f"count {count} of type {nccl_type} != {buffer.nbytes} B"
        stream = self.streams[stream]
        # A send's bytes are read when its group runs; a receive's are written at sync.
        if op == "send" or (op == "bcast" and comm.rank == peer):
            self.pending.append((op, comm, peer, nccl_type, count, buffer.tobytes(), None))
        else:
            self.pending.append((op, comm, peer, nccl_type, count, nbytes, (stream, buffer)))


class _FakeComm:
    def __init__(self, fake: FakeNccl, world_size: int, uid: tuple, rank: int):
        assert fake.group_depth > 0, "communicators must be initialised inside a group"
        assert len(uid) == 128 and 0 <= rank < world_size
        assert all((c.uid, c.rank) != (uid, rank) for c in fake.comms), f"rank {rank} twice"
        self.fake, self.world_size, self.uid, self.rank = fake, world_size, uid, rank
        self.device = fake.current_device
        self.destroyed = False
        fake.comms.append(self)

    def send(self, ptr, count, nccl_type, peer, stream):
        self.fake.enqueue("send", self, ptr, count, nccl_type, peer, stream)

    def recv(self, ptr, count, nccl_type, peer, stream):
        self.fake.enqueue("recv", self, ptr, count, nccl_type, peer, stream)

    def broadcast(self, send_ptr, recv_ptr, count, nccl_type, root, stream):
        assert send_ptr == recv_ptr, "the transport broadcasts in place"
        self.fake.enqueue("bcast", self, recv_ptr, count, nccl_type, root, stream)

    def destroy(self):
        self.destroyed = True


class _FakeStream:
    def __init__(self):
        self.ptr = id(self)
        self.unsynchronized: list[tuple[_DeviceArray, bytes]] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def synchronize(self):
        for buffer, data in self.unsynchronized:
            buffer[...] = np.frombuffer(data, buffer.dtype).reshape(buffer.shape)
        self.unsynchronized = []


@pytest.fixture
def fake(monkeypatch) -> FakeNccl:
    """A fake cupy in ``sys.modules``; DLPack imports land on CPU device ``device_index``."""
    state = FakeNccl()
    _install(monkeypatch, state.module())
    monkeypatch.setattr(
        jax.dlpack,
        "from_dlpack",
        lambda buffer: jax.device_put(np.array(buffer), jax.devices()[buffer.device_index]),
    )
    return state


def _install(monkeypatch, cupy: types.ModuleType) -> None:
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", cupy.cuda.nccl)


# --- running a plan on one group per worker ---------------------------------------------


def _group(uid, layout: RankLayout, role: HostRole) -> NcclGroup:
    # The CUDA device index of rank r is CPU device r (at most 8 ranks here).
    return NcclGroup(uid, layout.world_size, {rank: rank for rank in layout.local_ranks(role)})


def _run(plan, array: np.ndarray):
    """Every source worker, then every destination worker, runs its part of ``plan``."""
    layout = RankLayout.of_plan(plan)
    devices = jax.devices()
    uid = new_unique_id()
    tiles = _tiles(array, plan.src_boxes)
    src_groups, dst_groups, pieces = [], [], {}
    for host in range(plan.src_mesh_shape[0]):
        role = HostRole(src_host=host)
        group = _group(uid, layout, role)
        shards = {s: jax.device_put(tiles[s], devices[s]) for s in layout.src_devices(host)}
        assert execute_plan_transfers(group, plan, role, array.dtype, src_shards=shards) == {}
        src_groups.append(group)
    for host in range(plan.dst_mesh_shape[0]):
        role = HostRole(dst_host=host)
        group = _group(uid, layout, role)
        targets = {t: devices[layout.dst_rank(t)] for t in layout.dst_devices(host)}
        pieces |= execute_plan_transfers(group, plan, role, array.dtype, dst_devices=targets)
        dst_groups.append(group)
    return src_groups, dst_groups, pieces


def _tiles(array: np.ndarray, boxes) -> list[np.ndarray]:
    """Per device, its tile (box) of ``array``."""
    return [array[tuple(slice(lo, hi) for lo, hi in box)] for box in boxes]


def _check_reproduced(plan, array: np.ndarray, pieces) -> None:
    """Each destination device's pieces lie on it and tile its box exactly once, with the
    array's values."""
    layout = RankLayout.of_plan(plan)
    dst_boxes = plan.dst_boxes
    assert sorted(pieces) == list(range(len(dst_boxes)))
    for device, want in enumerate(_tiles(array, dst_boxes)):
        got = np.zeros_like(want)
        covered = np.zeros(want.shape, int)
        for box, piece in pieces[device]:
            assert piece.devices() == {jax.devices()[layout.dst_rank(device)]}
            assert piece.dtype == array.dtype
            local = tuple(
                slice(lo - t0, hi - t0)
                for (lo, hi), (t0, _) in zip(box, dst_boxes[device], strict=True)
            )
            got[local] = np.asarray(piece)
            covered[local] += 1
        np.testing.assert_array_equal(covered, 1)
        np.testing.assert_array_equal(got, want)


def _check_wires_drained(fake: FakeNccl) -> None:
    assert all(not wire for wire in fake.wires.values()), "a send was never received"
    assert all(not stream.unsynchronized for stream in fake.streams.values())


# --- tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("src_mesh,dst_mesh", list(itertools.product(MESHES, MESHES)))
def test_plans_reproduce_the_array_through_nccl(fake, src_mesh, dst_mesh):
    array = np.arange(math.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    for src_layout, dst_layout in itertools.product(LAYOUTS.values(), LAYOUTS.values()):
        plan = plan_resharding(
            SHAPE, MeshSharding(src_mesh, src_layout), MeshSharding(dst_mesh, dst_layout)
        )
        fake.op_groups.clear()
        src_groups, dst_groups, pieces = _run(plan, array)
        _check_reproduced(plan, array, pieces)
        _check_wires_drained(fake)
        # Bytes: the plan's, per source worker and in all.
        itemsize = array.dtype.itemsize
        assert sum(g.bytes_sent for g in src_groups) == plan.num_elements_sent() * itemsize
        assert sum(g.bytes_received for g in dst_groups) == plan.num_elements_sent() * itemsize
        assert all(g.bytes_received == 0 for g in src_groups)
        assert all(g.bytes_sent == 0 for g in dst_groups)
        for host, group in enumerate(src_groups):
            mine = [t for _, t in plan.pieces_from(host)]
            elements = sum(math.prod(b - a for a, b in t.box) for t in mine)
            assert group.bytes_sent == elements * itemsize
        # One NCCL group per worker that moves anything, one call per piece and side.
        assert sum(len(ops) for ops in fake.op_groups) == 2 * len(plan.pieces)
        assert len(fake.op_groups) <= len(src_groups) + len(dst_groups)
        for ops in fake.op_groups:
            assert len({op for op, *_ in ops}) == 1, "a worker here only sends or only receives"


def test_replicated_destination_host_receives_once_then_copies(fake):
    src = MeshSharding((1, 2), LAYOUTS["row"])
    dst = MeshSharding((2, 2), LAYOUTS["replicated"])
    plan = plan_resharding(SHAPE, src, dst)
    array = np.arange(math.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    _, dst_groups, pieces = _run(plan, array)
    _check_reproduced(plan, array, pieces)
    # Two halves to each of two hosts; each host's devices take turns receiving.
    assert [g.bytes_received for g in dst_groups] == [array.nbytes, array.nbytes]
    receivers = sorted(rank for ops in fake.op_groups for op, rank, *_ in ops if op == "recv")
    assert receivers == [2, 3, 4, 5]


# dtype -> (NCCL type seen on the wire, NCCL elements per array element)
DTYPES = {
    "float32": (NCCL_TYPES["NCCL_FLOAT32"], 1),
    "float16": (NCCL_TYPES["NCCL_FLOAT16"], 1),
    "bfloat16": (NCCL_TYPES["NCCL_BFLOAT16"], 1),
    "int32": (NCCL_TYPES["NCCL_INT32"], 1),
    "bool": (NCCL_TYPES["NCCL_UINT8"], 1),
    "int16": (NCCL_TYPES["NCCL_UINT8"], 2),  # no NCCL type: raw bytes
    "complex64": (NCCL_TYPES["NCCL_UINT8"], 8),
}


def _values(dtype) -> np.ndarray:
    x = np.arange(math.prod(SHAPE)).reshape(SHAPE)
    if dtype == jnp.bool_:
        return x % 3 == 0
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return ((x - 7) / 4 + 1j * x).astype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return ((x - 7) / 4).astype(dtype)  # quarter steps: exact in 16-bit floats too
    return (x - 7).astype(dtype)


@pytest.mark.parametrize("name", list(DTYPES))
def test_dtypes_travel_exactly_with_their_nccl_type(fake, name):
    dtype = jnp.dtype(name)
    array = _values(dtype)
    plan = plan_resharding(
        SHAPE, MeshSharding((1, 4), LAYOUTS["row"]), MeshSharding((2, 2), LAYOUTS["2d"])
    )
    src_groups, _, pieces = _run(plan, array)
    _check_reproduced(plan, array, pieces)
    assert sum(g.bytes_sent for g in src_groups) == plan.num_elements_sent() * dtype.itemsize
    nccl_type, per_element = DTYPES[name]
    box_sizes = sorted(math.prod(b - a for a, b in t.box) for t in plan.pieces)
    for op in ("send", "recv"):
        calls = [(t, n) for ops in fake.op_groups for o, _, _, t, n in ops if o == op]
        assert {t for t, _ in calls} == {nccl_type}
        assert sorted(n for _, n in calls) == [size * per_element for size in box_sizes]


def test_bfloat16_travels_as_bytes_without_nccl_bfloat16(monkeypatch):
    state = FakeNccl()
    _install(monkeypatch, state.module(with_bfloat16=False))
    monkeypatch.setattr(
        jax.dlpack,
        "from_dlpack",
        lambda buffer: jax.device_put(np.array(buffer), jax.devices()[buffer.device_index]),
    )
    array = _values(jnp.bfloat16)
    plan = plan_resharding(
        SHAPE, MeshSharding((2, 1), LAYOUTS["row"]), MeshSharding((1, 2), LAYOUTS["column"])
    )
    _, dst_groups, pieces = _run(plan, array)
    _check_reproduced(plan, array, pieces)
    calls = [(t, n) for ops in state.op_groups for _, _, _, t, n in ops]
    assert {t for t, _ in calls} == {NCCL_TYPES["NCCL_UINT8"]}
    assert sum(n for _, n in calls) == 2 * 2 * plan.num_elements_sent()  # 2 B, 2 sides
    assert sum(g.bytes_received for g in dst_groups) == 2 * plan.num_elements_sent()


def test_broadcast_reaches_every_other_rank(fake):
    uid = new_unique_id()
    devices = jax.devices()
    source = NcclGroup(uid, 3, {0: 0})
    destination = NcclGroup(uid, 3, {1: 1, 2: 2})
    piece = jax.device_put(_values(jnp.bfloat16), devices[0])
    assert source.broadcast(piece, SHAPE, jnp.bfloat16, root=0) == {}
    got = destination.broadcast(None, SHAPE, jnp.bfloat16, root=0)
    assert sorted(got) == [1, 2]
    for rank, array in got.items():
        assert array.devices() == {devices[rank]}
        np.testing.assert_array_equal(np.asarray(array), np.asarray(piece))
    assert (source.bytes_sent, source.bytes_received) == (piece.nbytes, 0)
    assert (destination.bytes_sent, destination.bytes_received) == (0, 2 * piece.nbytes)
    assert [len(ops) for ops in fake.op_groups] == [1, 2]  # one group call per worker
    _check_wires_drained(fake)
    with pytest.raises(ValueError, match="pass the piece exactly on the worker that owns root"):
        destination.broadcast(piece, SHAPE, jnp.bfloat16, root=0)


def test_communicators_open_per_rank_on_its_device_and_close(fake):
    group = NcclGroup(new_unique_id(), 8, {4: 0, 5: 1, 6: 2, 7: 3})
    assert {c.rank: c.device for c in fake.comms} == {4: 0, 5: 1, 6: 2, 7: 3}
    group.destroy()
    assert all(c.destroyed for c in fake.comms)
    with pytest.raises(RuntimeError, match="this NcclGroup was destroyed"):
        group.recv_pieces([((2,), jnp.float32, 4, 0)])


def test_send_and_recv_pieces_pair_in_issue_order(fake):
    uid = new_unique_id()
    devices = jax.devices()
    sender = NcclGroup(uid, 2, {0: 0})
    receiver = NcclGroup(uid, 2, {1: 1})
    first = jax.device_put(jnp.arange(6, dtype=jnp.int32).reshape(2, 3), devices[0])
    second = jax.device_put(jnp.arange(4, dtype=jnp.float32), devices[0])
    sender.send_pieces([(first, 0, 1), (second, 0, 1)])
    got = receiver.recv_pieces([((2, 3), jnp.int32, 1, 0), ((4,), jnp.float32, 1, 0)])
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(first))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(second))
    assert [a.devices() for a in got] == [{devices[1]}, {devices[1]}]
    assert sender.bytes_sent == receiver.bytes_received == 24 + 16
    with pytest.raises(ValueError, match=r"send on rank 1, which this worker does not own"):
        sender.send_pieces([(first, 1, 0)])


def test_rank_layout():
    layout = RankLayout((2, 2), (1, 4))
    assert layout.world_size == 8
    assert layout.local_ranks(HostRole(src_host=1)) == {2: 0, 3: 1}
    assert layout.local_ranks(HostRole(dst_host=0)) == {4: 0, 5: 1, 6: 2, 7: 3}
    both = RankLayout((2, 1), (2, 1)).local_ranks(HostRole(src_host=1, dst_host=0))
    assert both == {1: 0, 2: 1}
    with pytest.raises(ValueError, match=r"dst_host=1 but that mesh \(1, 4\) has 1 hosts"):
        layout.local_ranks(HostRole(dst_host=1))
    with pytest.raises(ValueError, match="needs a src_host, a dst_host or both"):
        HostRole()


def test_bad_worker_inputs_name_the_mistake(fake):
    plan = plan_resharding(
        SHAPE, MeshSharding((1, 2), LAYOUTS["row"]), MeshSharding((1, 2), LAYOUTS["column"])
    )
    layout = RankLayout.of_plan(plan)
    role = HostRole(src_host=0)
    group = _group(new_unique_id(), layout, role)
    shard = jax.device_put(np.zeros((4, 12), np.float32), jax.devices()[0])
    wrong = jax.device_put(np.zeros((8, 12), np.float32), jax.devices()[1])
    with pytest.raises(ValueError, match=r"src_shards must have exactly the devices \[0, 1\]"):
        execute_plan_transfers(group, plan, role, np.float32, src_shards={0: shard})
    with pytest.raises(ValueError, match=r"shard of source device 1 is float32\(8, 12\)"):
        execute_plan_transfers(group, plan, role, np.float32, src_shards={0: shard, 1: wrong})
    with pytest.raises(ValueError, match=r"must own ranks \[2, 3\]"):
        execute_plan_transfers(group, plan, HostRole(dst_host=0), np.float32, dst_devices={})
    with pytest.raises(ValueError, match="rank 5 is outside the group of world_size 4"):
        NcclGroup(new_unique_id(), 4, {5: 0})


def test_without_cupy_nccl_is_unavailable_and_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    assert nccl_available() is False
    with pytest.raises(RuntimeError, match=r"pip install alpa\[gpu\].*cupy-cuda12x.*GPUs"):
        NcclGroup((0,) * 128, 2, {0: 0})
    with pytest.raises(RuntimeError, match=r"pip install alpa\[gpu\]"):
        new_unique_id()


def test_nccl_available_needs_a_gpu_and_nccl(monkeypatch):
    state = FakeNccl()
    cupy = state.module()
    _install(monkeypatch, cupy)
    assert nccl_available() is True
    cupy.cuda.nccl.available = False
    assert nccl_available() is False
    cupy.cuda.nccl.available = True
    cupy.cuda.is_available = lambda: False
    assert nccl_available() is False
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        NcclGroup((0,) * 128, 2, {0: 0})


# --- the mesh workers' GPU path, through this transport ---------------------------------


def _worker_layouts(n: int) -> dict:
    from jax.sharding import PartitionSpec as P

    from alpa.runtime.worker_program import Layout

    return {
        "replicated": Layout((1, n), ("x", "y"), P()),
        "row": Layout((1, n), ("x", "y"), P("y")),
        "column": Layout((1, n), ("x", "y"), P(None, "y")),
        "2-D": Layout((2, n // 2), ("x", "y"), P("x", "y")),
    }


@pytest.mark.parametrize("src_n, dst_n", [(2, 4), (4, 2)])
def test_mesh_workers_move_values_over_nccl(fake, src_n, dst_n):
    """Two MeshHostWorkers (in this process, on CPU devices standing in for GPUs) with an
    open NCCL group move every (replicated, row, column, 2-D) pair through NcclGroup: the
    value arrives exactly on every device, and the bytes each side counts are the plan's."""
    from alpa.runtime.ray_worker import MeshHostWorker
    from alpa.runtime.resharding import worker_transfer_plan

    devices = jax.devices()
    src = MeshHostWorker(0, 0, 1, src_n, devices=devices[:src_n])
    dst = MeshHostWorker(1, 0, 1, dst_n, devices=devices[src_n : src_n + dst_n])
    uid = new_unique_id()
    src.init_nccl_group(0, 1, uid, (1, src_n), (1, dst_n), 0, None)
    dst.init_nccl_group(0, 1, uid, (1, src_n), (1, dst_n), None, 0)
    value = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    tag = 0
    for src_name, src_layout in _worker_layouts(src_n).items():
        src.put(["x"], [value], [src_layout])
        for dst_name, dst_layout in _worker_layouts(dst_n).items():
            plan = worker_transfer_plan(
                value.shape, value.dtype, src_layout, src_n, dst_layout, dst_n
            )
            sent, received = src.bytes_sent, dst.bytes_received
            tag += 1
            src.send_buffer("x", plan, ("move", tag), 1, [])
            dst.recv_buffer("y", plan, ("move", tag), 0)
            where = f"{src_name} on {src_n} -> {dst_name} on {dst_n}"
            assert src.bytes_sent - sent == dst.bytes_received - received == plan.nbytes(), where
            y = dst._buffers["y"]
            assert y.sharding.spec == dst_layout.spec, where
            for shard in y.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index], where)
    _check_wires_drained(fake)
