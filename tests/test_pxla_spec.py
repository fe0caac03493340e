"""Alpa's jax-0.3 ``ShardingSpec`` (``alpa.pxla_spec``): its blocks per device, its
``PartitionSpec``, ``LogicalDeviceMesh.make_tile_spec`` and ``shard_args_to_arrays``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import alpa
from alpa.device_mesh import LogicalDeviceMesh
from alpa.pxla_spec import (
    Chunked,
    NoSharding,
    Replicated,
    ShardedAxis,
    ShardingSpec,
    to_partition_spec,
)


def _blocks(spec, shape):
    """Per device (row-major), its block as ``((start, stop), ...)`` per dimension."""
    return [
        tuple(
            (s.start or 0, s.stop if s.stop is not None else n)
            for s, n in zip(i, shape, strict=True)
        )
        for i in spec.indices(shape).flat
    ]


def test_indices_follow_the_mesh_mapping():
    # Rows halved over mesh axis 0, replicated over axis 1 (2 x 2 mesh).
    rows = ShardingSpec((Chunked([2]), NoSharding()), (ShardedAxis(0), Replicated(2)))
    assert rows.indices((4, 3)).shape == (2, 2)
    assert _blocks(rows, (4, 3)) == [((0, 2), (0, 3))] * 2 + [((2, 4), (0, 3))] * 2
    # Mesh axis 0 cuts dimension 1 (chunk count 1), axis 1 cuts dimension 0.
    swapped = ShardingSpec((Chunked([2]), Chunked([2])), (ShardedAxis(1), ShardedAxis(0)))
    assert _blocks(swapped, (4, 2)) == [
        ((0, 2), (0, 1)),
        ((2, 4), (0, 1)),
        ((0, 2), (1, 2)),
        ((2, 4), (1, 2)),
    ]
    assert to_partition_spec(swapped) == ((2, 2), ("x", "y"), PartitionSpec("y", "x"))
    # One dimension cut by both axes, major first.
    both = ShardingSpec((Chunked([2, 4]),), (ShardedAxis(0), ShardedAxis(1)))
    assert _blocks(both, (16,)) == [((2 * i, 2 * i + 2),) for i in range(8)]
    assert to_partition_spec(both) == ((2, 4), ("x", "y"), PartitionSpec(("x", "y")))


def test_the_partition_spec_puts_the_same_blocks_on_the_same_devices():
    devices = jax.devices()[:8]
    cases = [
        ShardingSpec((Chunked([2]), Chunked([4])), (ShardedAxis(0), ShardedAxis(1))),
        ShardingSpec((NoSharding(), Chunked([4])), (Replicated(2), ShardedAxis(0))),
        ShardingSpec((Chunked([4]), NoSharding()), (ShardedAxis(0), Replicated(2))),
        ShardingSpec((Chunked([8]), NoSharding()), (ShardedAxis(0),)),
    ]
    for spec in cases:
        mesh_shape, names, partition = to_partition_spec(spec)
        sharding = jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array(devices).reshape(mesh_shape), names), partition
        )
        by_device = sharding.devices_indices_map((8, 8))
        expected = [by_device[d] for d in devices]
        got = list(spec.indices((8, 8)).flat)
        norm = [tuple(s.indices(8) for s in index) for index in expected]
        assert [tuple(s.indices(8) for s in index) for index in got] == norm, spec


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match=r"ShardedAxis\(1\) must name each of the 1 chunk"):
        to_partition_spec(ShardingSpec((Chunked([2]),), (ShardedAxis(1),)))
    with pytest.raises(ValueError, match="1 chunk count\\(s\\) have no mesh axis"):
        to_partition_spec(ShardingSpec((Chunked([2]),), (Replicated(2),)))
    with pytest.raises(ValueError, match=r"describes 1 dimensions, the array has shape \(4, 4\)"):
        ShardingSpec((Chunked([2]),), (ShardedAxis(0),)).indices((4, 4))


def test_make_tile_spec_as_alpa():
    mesh = LogicalDeviceMesh((2, 4))
    array = jnp.zeros((8, 8))
    assert mesh.make_tile_spec(array, [0, 1], [0, 1]) == ShardingSpec(
        (Chunked([2]), Chunked([4])), (ShardedAxis(0), ShardedAxis(1))
    )
    assert mesh.make_tile_spec(array, [0, 1], [0]) == ShardingSpec(
        (Chunked([2]), NoSharding()), (ShardedAxis(0), Replicated(4))
    )
    assert mesh.make_tile_spec(array, [1], [1]) == ShardingSpec(
        (NoSharding(), Chunked([4])), (Replicated(2), ShardedAxis(0))
    )
    with pytest.raises(ValueError, match=r"make_tile_spec: mesh_dims=\[0, 2\] must be distinct"):
        mesh.make_tile_spec(array, [0, 1], [0, 2])
    with pytest.raises(ValueError, match=r"make_tile_spec: tensor_dims=\[2\] must be distinct"):
        mesh.make_tile_spec(array, [2], [0])


def test_shard_args_to_arrays_places_as_the_spec_says():
    alpa.init("local")
    physical = alpa.get_global_physical_mesh()
    logical = physical.get_logical_mesh((2, 4))
    array = jnp.arange(64).reshape(8, 8)
    spec = logical.make_tile_spec(array, [0, 1], [0, 1])
    indices = spec.indices(array.shape).flatten()
    (placed,) = physical.shard_args_to_arrays([array.aval], [indices], [spec], [array])
    np.testing.assert_array_equal(np.asarray(placed), np.asarray(array))
    for device, index in zip(physical.devices, indices, strict=True):
        (shard,) = [s for s in placed.addressable_shards if s.device == device]
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(array)[index])
    other = logical.make_tile_spec(array, [0], [1])
    with pytest.raises(ValueError, match=r"the indices given for ShardingSpec.* are not its"):
        physical.shard_args_to_arrays([array.aval], [indices], [other], [array])
    with pytest.raises(ValueError, match=r"over 4 devices \(mesh \(4,\)\), the mesh has 8"):
        physical.shard_args_to_arrays(
            [array.aval], None, [ShardingSpec((Chunked([4]), NoSharding()), (ShardedAxis(0),))],
            [array],
        )  # fmt: skip
