"""Clusters and meshes: presets, submesh shapes, alpha-beta collective costs."""

import jax
import pytest

from alpa.device_mesh import (
    ClusterSpec,
    LocalPhysicalDeviceMesh,
    LogicalDeviceMesh,
    VirtualPhysicalMesh,
)


def test_collective_costs_closed_form():
    mesh = LogicalDeviceMesh((2, 4), mesh_alpha=(1.0, 2.0), mesh_beta=(0.5, 0.1))
    b = 1000.0
    assert mesh.all_gather_cost(b, 1) == pytest.approx(2 + 0.1 * 3 / 4 * b)
    assert mesh.all_reduce_cost(b, 1) == pytest.approx(2 + 0.1 * 2 * 3 / 4 * b)
    assert mesh.reduce_scatter_cost(b, 0) == pytest.approx(1 + 0.5 * 1 / 2 * b)
    assert mesh.all_to_all_cost(b, 1) == pytest.approx(2 + 0.1 * 3 / 16 * b * 1.5)
    assert LogicalDeviceMesh((1, 8)).all_reduce_cost(b, 0) == 0.0


def test_flatten_is_alphas_one_dimensional_view():
    """``flatten()`` is Alpa's: ``(n, 1)``, both axes priced with the largest alpha and the
    smallest beta, so that Alpa's closed forms (``mesh.flatten().all_reduce_cost(b, 0)``)
    price an all-reduce over every device. The planner's own view is ``one_axis()``:
    ``(1, n)`` at the slowest link."""
    mesh = LogicalDeviceMesh((2, 4), mesh_alpha=(1.0, 2.0), mesh_beta=(0.5, 0.1))
    flat = mesh.flatten()
    assert flat.shape == (8, 1)
    assert (flat.mesh_alpha, flat.mesh_beta) == ((2.0, 2.0), (0.1, 0.1))
    assert flat.all_reduce_cost(1000.0, 0) == pytest.approx(2 + 0.1 * 2 * 7 / 8 * 1000)
    one = mesh.one_axis()
    assert one.shape == (1, 8)
    assert one.all_reduce_cost(1000.0, 1) == pytest.approx(2 + 0.5 * 2 * 7 / 8 * 1000)


def test_presets_and_virtual_mesh():
    spec = ClusterSpec.preset("A100-80GB", num_nodes=4, num_devices_per_node=8)
    assert spec.num_devices == 32 and spec.device_memory == 80 * 2**30
    for name in ("v100-16gb", "a100-40gb", "h100-80gb", "h200-141gb", "cpu"):
        assert ClusterSpec.preset(name).device_flops > 0
    with pytest.raises(ValueError, match="unknown cluster preset 'tpu'"):
        ClusterSpec.preset("tpu")
    virtual = spec.get_virtual_physical_mesh()
    assert virtual.get_submesh_shapes() == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (3, 8), (4, 8)]
    logical = virtual.get_logical_mesh((4, 8))
    # Axis 1 stays inside a node (NVLink), axis 0 crosses nodes (the NIC).
    assert logical.mesh_beta[1] < logical.mesh_beta[0]
    assert logical.devices is None
    with pytest.raises(ValueError, match="abstract"):
        logical.get_jax_mesh()


def test_local_mesh_and_bad_shapes():
    mesh = LocalPhysicalDeviceMesh()
    assert mesh.shape == (1, 8)
    logical = mesh.get_logical_mesh((2, 4))
    jax_mesh = logical.get_jax_mesh()
    assert dict(jax_mesh.shape) == {"x": 2, "y": 4}
    assert all(t == jax.sharding.AxisType.Auto for t in jax_mesh.axis_types)
    with pytest.raises(ValueError, match=r"mesh_shape \(4, 4\) has 16 devices"):
        mesh.get_logical_mesh((4, 4))
    with pytest.raises(ValueError, match="num_hosts must be a positive int, got 0"):
        VirtualPhysicalMesh(0, 8)
    assert mesh.slice_1d(2, 6).num_devices == 4
