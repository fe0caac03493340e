"""The pieces of Alpa's weight loading that need no Ray: each device's slice of a layout
(``Layout.shard_indices``) and the layout a handle's sharding spec and indices describe.
Loading on Ray workers: ``tests/runtime/test_ray_runtime.py``."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from alpa.device_mesh import make_jax_mesh
from alpa.pxla_spec import Chunked, NoSharding, Replicated, ShardedAxis, ShardingSpec
from alpa.runtime.remote_arrays import ReplicatedDistributedArray, layout_of
from alpa.runtime.worker_program import Layout

SPECS = [P(), P("x"), P("y"), P(None, "x"), P("x", "y"), P(("x", "y")), P(("y", "x")), P("y", "x")]


def _norm(indices, shape):
    return [tuple(s.indices(n)[:2] for s, n in zip(i, shape, strict=True)) for i in indices]


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2), (1, 8), (8, 1)])
def test_shard_indices_are_what_jax_places_on_each_device(mesh_shape):
    devices = sorted(jax.devices(), key=lambda d: d.id)
    mesh = make_jax_mesh(devices, mesh_shape, ("x", "y"))
    shape = (16, 8)
    for spec in SPECS:
        expected = NamedSharding(mesh, spec).devices_indices_map(shape)
        ours = Layout(mesh_shape, ("x", "y"), spec).shard_indices(shape)
        assert _norm([expected[d] for d in mesh.devices.flat], shape) == _norm(ours, shape), spec


def test_the_layout_of_a_handle_is_the_view_its_indices_describe():
    shape = (8, 4)
    for view in [(1, 8), (2, 4), (4, 2)]:
        layout = Layout(view, ("x", "y"), P("y"))
        found = layout_of(8, P("y"), shape, layout.shard_indices(shape))
        assert found.shard_indices(shape) == layout.shard_indices(shape)
    assert layout_of(8, layout, shape, None) is layout
    # jax 0.3's ShardingSpec: rows halved over a (2, 4) mesh's first axis.
    spec = ShardingSpec((Chunked([2]), NoSharding()), (ShardedAxis(0), Replicated(4)))
    found = layout_of(8, spec, shape, None)
    assert (found.mesh_shape, found.spec) == ((2, 4), P("x", None))
    with pytest.raises(ValueError, match=r"puts no logical view of the 8 devices"):
        layout_of(8, P("x"), shape, [(slice(0, 1), slice(0, 4))] * 8)


def test_a_replicated_array_needs_one_array_per_mesh():
    with pytest.raises(ValueError, match="needs one array per mesh, got 2 meshes and 1 arrays"):
        ReplicatedDistributedArray([object(), object()], [np.zeros(2)])
