"""DataLoader and MeshDriverDataLoader: placement, prefetching, errors, which rows are read."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import alpa
from alpa.device_mesh import make_jax_mesh
from alpa.pxla_spec import Chunked, ShardedAxis, ShardingSpec
from alpa.runtime.placement import PlacementSpec, is_placed
from alpa.runtime.worker_program import Layout
from alpa.testing import assert_allclose, get_mlp_train_state_and_step

BATCH, HIDDEN = 32, 16

METHODS = {
    "shard": lambda: alpa.ShardParallel(),
    "data": lambda: alpa.DataParallel(),
    "pipeshard": lambda: alpa.PipeshardParallel(
        num_micro_batches=2, layer_option="manual", stage_option="uniform"
    ),
}


def _batches(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.standard_normal((BATCH, HIDDEN), dtype=np.float32),
            "y": rng.standard_normal((BATCH, HIDDEN), dtype=np.float32),
        }
        for _ in range(n)
    ]


def _compiled(method: str):
    """``(state, step, p_step, batch placement specs)`` of a 2-layer MLP (2 stages for
    pipeshard)."""
    state, batch, step = get_mlp_train_state_and_step(
        BATCH, HIDDEN, num_layers=2, add_manual_pipeline_marker=True
    )
    p_step = alpa.parallelize(step, method=METHODS[method]())
    specs = p_step.get_executable(state, batch).get_input_placement_specs()[1]
    return state, step, p_step, specs


def _serial_loop(state, step, batches):
    jitted = jax.jit(step)
    for batch in batches:
        state = jitted(state, batch)
    return state


def _assert_placed(batch, specs):
    for name in ("x", "y"):
        leaf, target = batch[name], specs[name].placements[0]
        assert leaf.sharding.is_equivalent_to(target, leaf.ndim), (name, leaf.sharding, target)
        assert is_placed(leaf, target)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_data_loader_batches_are_placed_and_train_like_serial(method):
    state, step, p_step, specs = _compiled(method)
    batches = _batches(4)
    expected = _serial_loop(state, step, batches)

    loader = alpa.DataLoader(iter(batches), specs, prefetch_size=2)
    for batch, host_batch in zip(loader, batches, strict=True):
        _assert_placed(batch, specs)
        assert_allclose(batch, host_batch, rtol=0, atol=0)
        state = p_step(state, batch)
    assert_allclose(state.params, expected.params)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_mesh_driver_data_loader_batches_are_placed_and_train_like_serial(method):
    state, step, p_step, specs = _compiled(method)
    num_samples = 3 * BATCH + 5  # the partial last batch is dropped
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((num_samples, HIDDEN), dtype=np.float32)
    ys = rng.standard_normal((num_samples, HIDDEN), dtype=np.float32)
    calls = []

    def input_iter_func(start, end, batch_size):
        calls.append((start, end, batch_size))
        for i in range(start, end, batch_size):
            yield {"x": xs[i : i + batch_size], "y": ys[i : i + batch_size]}

    batches = [{"x": xs[i : i + BATCH], "y": ys[i : i + BATCH]} for i in range(0, 3 * BATCH, BATCH)]
    expected = _serial_loop(state, step, batches)

    loader = alpa.MeshDriverDataLoader(BATCH, num_samples, input_iter_func, specs)
    assert loader.num_batches == 3
    got = list(loader)
    assert calls == [(0, 3 * BATCH, BATCH)]  # one host: one read of every row, once
    assert len(got) == 3
    for leaves, host_batch in zip(got, batches, strict=True):
        # Alpa's: a list of the batch's leaves, in the order of the specs' leaves.
        assert isinstance(leaves, list) and len(leaves) == len(jax.tree.leaves(specs))
        batch = jax.tree.unflatten(jax.tree.structure(specs), leaves)
        _assert_placed(batch, specs)
        assert_allclose(batch, host_batch, rtol=0, atol=0)
        state = p_step(state, batch)
    assert_allclose(state.params, expected.params)


# ----------------------------------------------------------------------------- semantics
# Specs built by hand (no compile): x sharded by rows over 8 devices, y replicated.


def _specs(rows: int = BATCH):
    mesh = make_jax_mesh(jax.devices()[:8], (8, 1), ("x", "y"))
    aval = jax.ShapeDtypeStruct((rows, 4), np.float32)

    def spec(partition):
        sharding = NamedSharding(mesh, partition)
        return PlacementSpec(aval, (0,), (partition,), (sharding,))

    return {"x": spec(PartitionSpec("x")), "y": spec(PartitionSpec())}


def _numbered(i: int, rows: int = BATCH) -> dict[str, np.ndarray]:
    """Batch ``i``: every value is ``i`` (so a yielded batch says which one it is)."""
    return {"x": np.full((rows, 4), i, np.float32), "y": np.full((rows, 4), i, np.float32)}


class _Counting:
    """An iterator over ``_numbered`` batches that counts what was pulled and raises
    ``error`` in place of batch ``fail_at``."""

    def __init__(self, n: int, fail_at: int | None = None, error: Exception | None = None):
        self.n, self.fail_at, self.error, self.pulled = n, fail_at, error, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.pulled == self.n:
            raise StopIteration
        self.pulled += 1
        if self.pulled - 1 == self.fail_at:
            raise self.error
        return _numbered(self.pulled - 1)


@pytest.mark.parametrize("prefetch_size", [0, 1, 3])
def test_data_loader_pulls_at_most_prefetch_size_ahead(prefetch_size):
    source = _Counting(8)
    loader = alpa.DataLoader(source, _specs(), prefetch_size=prefetch_size)
    assert source.pulled == 0  # nothing is read before the first `next`
    for k in range(8):
        batch = next(loader)
        assert float(batch["x"][0, 0]) == k
        assert source.pulled == min(8, k + 1 + prefetch_size)
    with pytest.raises(StopIteration):
        next(loader)


def test_data_loader_ends_with_its_input():
    loader = alpa.DataLoader([_numbered(0), _numbered(1)], _specs(), prefetch_size=5)
    assert [float(b["y"][0, 0]) for b in loader] == [0.0, 1.0]
    assert list(loader) == []


def test_data_loader_raises_an_input_error_at_its_batch():
    source = _Counting(6, fail_at=2, error=OSError("disk gone"))
    loader = alpa.DataLoader(source, _specs(), prefetch_size=3)
    assert float(next(loader)["x"][0, 0]) == 0  # batch 2 already failed, behind batch 0
    assert source.pulled == 3
    assert float(next(loader)["x"][0, 0]) == 1
    with pytest.raises(OSError, match="disk gone"):
        next(loader)
    assert source.pulled == 3  # nothing is read after the failure
    with pytest.raises(StopIteration):
        next(loader)


def test_data_loader_raises_a_bad_batch_at_its_position():
    bad = {"x": np.zeros((BATCH, 3), np.float32), "y": np.zeros((BATCH, 4), np.float32)}
    loader = alpa.DataLoader(iter([_numbered(0), bad, _numbered(2)]), _specs(), prefetch_size=2)
    next(loader)
    with pytest.raises(
        ValueError,
        match=r"batch 1 of input_iter leaf \['x'\] has shape \(32, 3\), expected \(32, 4\)",
    ):
        next(loader)


def test_data_loader_accepts_a_list_of_leaves_and_checks_structure():
    loader = alpa.DataLoader(iter([[np.ones((BATCH, 4), np.float32)] * 2]), _specs())
    x, y = next(loader)
    assert is_placed(x, _specs()["x"].placements[0])
    loader = alpa.DataLoader(iter([{"x": np.ones((BATCH, 4), np.float32)}]), _specs())
    with pytest.raises(ValueError, match="batch 0 of input_iter has structure"):
        next(loader)


def test_data_loader_close_drops_prefetched_batches():
    source = _Counting(8)
    loader = alpa.DataLoader(source, _specs(), prefetch_size=2)
    next(loader)
    loader.close()
    with pytest.raises(StopIteration):
        next(loader)
    assert source.pulled == 3


def test_data_loader_bad_arguments():
    with pytest.raises(ValueError, match="prefetch_size must be an int >= 0, got -1"):
        alpa.DataLoader(iter([]), _specs(), prefetch_size=-1)
    with pytest.raises(TypeError, match="input_iter must be an iterator of batches, got int"):
        alpa.DataLoader(5, _specs())
    with pytest.raises(TypeError, match=r"placement_specs leaf \['x'\] is a ndarray"):
        alpa.DataLoader(iter([]), {"x": np.zeros(3)})
    with pytest.raises(ValueError, match="placement_specs holds no PlacementSpec"):
        alpa.DataLoader(iter([]), {})


# ----------------------------------------------------------------------------- MeshDriverDataLoader


def _dataset(n: int):
    """Sample ``i`` is the row of value ``i``; ``calls`` records what was read."""
    xs = np.repeat(np.arange(n, dtype=np.float32)[:, None], 4, axis=1)
    calls = []

    def input_iter_func(start, end, batch_size):
        calls.append((start, end, batch_size))
        for i in range(start, end, batch_size):
            yield {"x": xs[i : i + batch_size], "y": xs[i : i + batch_size]}

    return xs, calls, input_iter_func


def test_mesh_driver_data_loader_sends_each_device_only_its_rows(monkeypatch):
    xs, calls, input_iter_func = _dataset(2 * BATCH)
    puts = []
    device_put = jax.device_put

    def recording_put(x, device=None, **kwargs):
        puts.append(np.shape(x))
        return device_put(x, device, **kwargs)

    loader = alpa.MeshDriverDataLoader(BATCH, 2 * BATCH, input_iter_func, _specs(), prefetch_size=0)
    monkeypatch.setattr(jax, "device_put", recording_put)
    batch = next(iter(loader))
    # x: 8 devices of 4 rows each; y (replicated): every device holds the whole batch.
    assert puts == [(BATCH // 8, 4)] * 8 + [(BATCH, 4)] * 8
    x, y = batch
    for shard in x.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), xs[shard.index])
    np.testing.assert_array_equal(np.asarray(y), xs[:BATCH])


def test_mesh_driver_data_loader_epochs_and_repeat():
    xs, calls, input_iter_func = _dataset(3 * BATCH)
    loader = alpa.MeshDriverDataLoader(BATCH, 3 * BATCH, input_iter_func, _specs())
    for _ in range(2):  # each `iter` is one epoch, read again
        firsts = [float(b[0][0, 0]) for b in loader]
        assert firsts == [0.0, BATCH, 2 * BATCH]
    assert calls == [(0, 3 * BATCH, BATCH)] * 2

    calls.clear()
    loader = alpa.MeshDriverDataLoader(BATCH, 3 * BATCH, input_iter_func, _specs(), repeat=True)
    it = iter(loader)
    firsts = [float(next(it)[0][0, 0]) for _ in range(7)]
    assert firsts == [0.0, BATCH, 2 * BATCH] * 2 + [0.0]
    assert calls == [(0, 3 * BATCH, BATCH)] * 3


def test_mesh_driver_data_loader_prefetch_and_errors_at_their_batch():
    pulled = []

    def input_iter_func(start, end, batch_size):
        for k in range((end - start) // batch_size):
            pulled.append(k)
            if k == 2:
                raise OSError("shard 2 unreadable")
            yield _numbered(k)

    loader = alpa.MeshDriverDataLoader(BATCH, 5 * BATCH, input_iter_func, _specs(), prefetch_size=1)
    it = iter(loader)
    assert pulled == []
    assert float(next(it)[0][0, 0]) == 0
    assert pulled == [0, 1]
    assert float(next(it)[0][0, 0]) == 1
    with pytest.raises(OSError, match="shard 2 unreadable"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_mesh_driver_data_loader_short_input_is_an_error_at_its_batch():
    def input_iter_func(start, end, batch_size):
        yield _numbered(0)

    it = iter(alpa.MeshDriverDataLoader(BATCH, 2 * BATCH, input_iter_func, _specs()))
    next(it)
    with pytest.raises(
        ValueError,
        match=r"input_iter_func\(0, 64, 32\) stopped after 1 batches; an epoch is "
        r"num_samples // batch_size = 2 batches",
    ):
        next(it)


def test_mesh_driver_data_loader_bad_arguments():
    _, _, f = _dataset(BATCH)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        alpa.MeshDriverDataLoader(0, 64, f, _specs())
    with pytest.raises(ValueError, match="num_samples=16 is less than batch_size=32"):
        alpa.MeshDriverDataLoader(BATCH, 16, f, _specs())
    with pytest.raises(TypeError, match="input_iter_func must be a function"):
        alpa.MeshDriverDataLoader(BATCH, 64, [1, 2], _specs())
    scalar = PlacementSpec(
        jax.ShapeDtypeStruct((), np.float32),
        (0,),
        (PartitionSpec(),),
        (_specs()["y"].placements[0],),
    )
    with pytest.raises(ValueError, match=r"leaf \['s'\] is a scalar"):
        alpa.MeshDriverDataLoader(BATCH, 64, f, {"s": scalar})
    with pytest.raises(
        ValueError, match=r"batch_size=48 is not a multiple of 32, the rows of leaf"
    ):
        alpa.MeshDriverDataLoader(48, 96, f, _specs())
    with pytest.raises(
        ValueError, match=r"batch_size=12 does not split evenly over the devices that leaf \['x'\]"
    ):
        alpa.MeshDriverDataLoader(12, 96, f, _specs(rows=12))


def test_mesh_driver_data_loader_takes_alpas_placement_specs():
    """``PlacementSpec(aval, (mesh_id,), (sharding_spec,))`` as Alpa's programs write
    them: jax-0.3 ``ShardingSpec`` s (from ``make_tile_spec``, or written out) on the mesh
    of ``alpa.init``, batches read as tuples of leaves."""
    alpa.init("local")
    mesh = alpa.get_global_physical_mesh()
    xs = np.arange(2 * BATCH * 4, dtype=np.float32).reshape(2 * BATCH, 4)

    def input_iter_func(start, end, batch_size):
        for i in range(start, end, batch_size):
            yield xs[i : i + batch_size], xs[i : i + batch_size, 0].astype(np.int32)

    aval = jax.core.ShapedArray((BATCH, 4), np.float32)
    rows = ShardingSpec((Chunked([8]),), (ShardedAxis(0),))
    specs = [
        PlacementSpec(
            aval,
            (mesh.mesh_id,),
            (mesh.get_logical_mesh((2, 4)).make_tile_spec(aval, [0, 1], [0, 1]),),
        ),  # fmt: skip
        PlacementSpec(jax.core.ShapedArray((BATCH,), np.int32), (mesh.mesh_id,), (rows,)),
    ]
    batches = list(alpa.MeshDriverDataLoader(BATCH, 2 * BATCH, input_iter_func, specs))
    assert len(batches) == 2
    for k, (x, y) in enumerate(batches):
        np.testing.assert_array_equal(np.asarray(x), xs[k * BATCH : (k + 1) * BATCH])
        np.testing.assert_array_equal(np.asarray(y), xs[k * BATCH : (k + 1) * BATCH, 0])
        assert x.sharding.spec == PartitionSpec("x", "y") and x.sharding.mesh.shape == {
            "x": 2,
            "y": 4,
        }
        assert x.addressable_shards[0].data.shape == (BATCH // 2, 1)
        assert y.addressable_shards[0].data.shape == (BATCH // 8,)
    with pytest.raises(
        ValueError, match=r"no mesh has id 3; the meshes of alpa.init have ids \[0\]"
    ):
        alpa.MeshDriverDataLoader(BATCH, 64, input_iter_func, [PlacementSpec(aval, (3,), (rows,))])
    with pytest.raises(TypeError, match=r"sharding_specs holds 'rows' \(str\); a PlacementSpec"):
        alpa.MeshDriverDataLoader(
            BATCH, 64, input_iter_func, [PlacementSpec(aval, (0,), ("rows",))]
        )
    with pytest.raises(ValueError, match=r"held by no mesh \(mesh_ids=\(\)\)"):
        alpa.MeshDriverDataLoader(BATCH, 64, input_iter_func, [PlacementSpec(aval, (), ())])


# ----------------------------------------------------------------------------- hosts (Ray layouts)
# A Ray placement is (mesh, Layout); a stand-in mesh with 2 hosts of 4 devices checks which
# rows each host reads, with no cluster (the reads themselves run on the mesh workers:
# tests/runtime/test_ray_runtime.py).


class _TwoHostMesh:
    num_hosts = 2
    num_devices_per_host = 4


def _ray_specs(partition: PartitionSpec):
    layout = Layout((2, 4), ("x", "y"), partition)
    aval = jax.ShapeDtypeStruct((BATCH, 4), np.float32)
    spec = PlacementSpec(aval, (0,), (partition,), ((_TwoHostMesh(), layout),))
    return {"x": spec, "y": spec}


@pytest.mark.parametrize(
    "partition, reads, host_rows",
    [
        # rows split over hosts: each host reads its own contiguous half of the samples
        (PartitionSpec("x"), [(0, 64, 16), (64, 128, 16)], [(0, 16), (16, 32)]),
        (PartitionSpec(("x", "y")), [(0, 64, 16), (64, 128, 16)], [(0, 16), (16, 32)]),
        # rows split inside each host, or not at all: every host needs every row
        (PartitionSpec("y"), [(0, 128, 32)], [(0, 32), (0, 32)]),
        (PartitionSpec(None, "y"), [(0, 128, 32)], [(0, 32), (0, 32)]),
        # host 0 holds row blocks 0,2,4,6, host 1 blocks 1,3,5,7: they read the union
        (PartitionSpec(("y", "x")), [(0, 128, 32)], [(0, 32), (0, 32)]),
    ],
)
def test_mesh_driver_data_loader_host_reads(partition, reads, host_rows):
    _, _, input_iter_func = _dataset(4 * BATCH)
    specs = _ray_specs(partition)
    loader = alpa.MeshDriverDataLoader(BATCH, 4 * BATCH, input_iter_func, specs)
    assert loader.read_ranges == reads
    # Per mesh, the rows each host's devices hold: what each worker reads.
    ((mesh, leaves, hosts),) = loader._mesh_reads
    assert isinstance(mesh, _TwoHostMesh) and leaves == [0, 1]
    assert hosts == host_rows
