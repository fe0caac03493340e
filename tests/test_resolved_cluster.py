"""``resolve_cluster``: every form of a method's ``devices=`` as one ``ResolvedCluster``
(the planned shape is the spec's counts; the devices when they are here)."""

import importlib
import re

import jax
import pytest

import alpa
from alpa.device_mesh import (
    ClusterSpec,
    LocalPhysicalDeviceMesh,
    LogicalDeviceMesh,
    VirtualPhysicalMesh,
)
from alpa.model.mlp import MLPModel, get_mlp_train_state_and_step
from alpa.resolved_cluster import resolve_cluster
from alpa.runtime.ray_mesh import DeviceCluster

A100 = ClusterSpec.preset("a100-40gb", num_nodes=2, num_devices_per_node=8)


def _fake_ray_cluster(num_hosts: int, per_host: int) -> DeviceCluster:
    """A ``DeviceCluster``'s record without Ray: what resolution reads of it (its spec
    and shape); no mesh of it is made here (the Ray runtime's tests make them)."""
    cluster = DeviceCluster.__new__(DeviceCluster)
    cluster.platform = "cpu"
    cluster.host_info = [{"NodeID": f"n{i}"} for i in range(num_hosts)]
    cluster.num_devices_per_host = per_host
    cluster._spec = ClusterSpec.preset("cpu", num_hosts, per_host)
    return cluster


def _given(kind: str):
    """The ``devices=`` value of each case (made inside the test: some need the global
    cluster of ``alpa.init``)."""
    devices = jax.devices()
    if kind == "none":
        return None
    if kind == "list":
        return list(devices[:4])
    if kind == "tuple":
        return tuple(devices[2:4])
    if kind == "local mesh":
        return LocalPhysicalDeviceMesh(devices[:2])
    if kind == "local mesh, spec of another shape":
        return LocalPhysicalDeviceMesh(devices[:4], cluster=A100)
    if kind == "global cluster (local)":
        alpa.init("local")
        return alpa.get_global_cluster()
    if kind == "view of a physical mesh":
        return LocalPhysicalDeviceMesh(devices[:8]).get_logical_mesh((2, 4))
    if kind == "view of devices":
        return LogicalDeviceMesh((2, 2), devices=devices[:4])
    if kind == "view without devices":
        return LogicalDeviceMesh((2, 4), device_flops=500.0)
    if kind == "virtual mesh":
        return VirtualPhysicalMesh(2, 4)
    if kind == "virtual mesh, spec of another shape":
        return VirtualPhysicalMesh(4, 2, cluster=A100)
    if kind == "cluster spec":
        return ClusterSpec.preset("h100-80gb", num_nodes=4, num_devices_per_node=8)
    if kind == "ray cluster":
        return _fake_ray_cluster(3, 2)
    raise AssertionError(kind)


# kind -> (planned shape, device kind of the spec, indices of the devices or None, here, view)
CASES = {
    "none": ((1, 8), "cpu", range(8), True, False),
    "list": ((1, 4), "cpu", range(4), True, False),
    "tuple": ((1, 2), "cpu", range(2, 4), True, False),
    "local mesh": ((1, 2), "cpu", range(2), True, False),
    "local mesh, spec of another shape": ((1, 4), "a100-40gb", range(4), True, False),
    "global cluster (local)": ((1, 8), "cpu", range(8), True, False),
    "view of a physical mesh": ((1, 8), "cpu", range(8), True, True),
    "view of devices": ((1, 4), "cpu", range(4), True, True),
    "view without devices": ((1, 8), "cpu", None, False, True),
    "virtual mesh": ((2, 4), "cpu", None, False, False),
    "virtual mesh, spec of another shape": ((4, 2), "a100-40gb", None, False, False),
    "cluster spec": ((4, 8), "h100-80gb", None, False, False),
    "ray cluster": ((3, 2), "cpu", None, True, False),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_every_form_of_devices_resolves_to_the_planned_shape_and_its_devices(kind):
    shape, name, indices, here, has_view = CASES[kind]
    given = _given(kind)
    cluster = resolve_cluster(given)
    assert (cluster.spec.num_nodes, cluster.spec.num_devices_per_node) == shape
    assert cluster.spec.name == name
    expected = None if indices is None else tuple(jax.devices()[i] for i in indices)
    assert cluster.devices == expected
    assert cluster.is_here is here
    assert cluster.view is (given if has_view else None)
    if not here:
        with pytest.raises(ValueError, match=re.escape("planned for with parallelize(...)")):
            cluster.check_here()
        with pytest.raises(ValueError, match=type(given).__name__):
            cluster.logical_mesh()
    if kind != "ray cluster":  # its logical mesh is its workers' (tests/runtime)
        logical = cluster.logical_mesh(require_devices=False)
        assert logical.num_devices == cluster.spec.num_devices
        assert logical is given if has_view else logical.shape == shape


def test_a_view_without_devices_is_priced_at_its_own_rates():
    view = LogicalDeviceMesh((2, 4), device_flops=500.0, memory_bandwidth=3.0)
    spec = resolve_cluster(view).spec
    assert (spec.device_flops, spec.memory_bandwidth) == (500.0, 3.0)


def test_another_logical_shape_views_the_same_devices():
    cluster = resolve_cluster(LocalPhysicalDeviceMesh(jax.devices()).get_logical_mesh((2, 4)))
    other = cluster.logical_mesh((4, 2))
    assert other.shape == (4, 2) and other.devices == tuple(jax.devices())
    virtual = resolve_cluster(VirtualPhysicalMesh(2, 4))
    assert virtual.logical_mesh((8, 1), require_devices=False).shape == (8, 1)


def test_the_global_virtual_mesh_is_what_a_pipeline_plans_on():
    alpa.init("local")
    alpa.set_global_virtual_physical_mesh(VirtualPhysicalMesh(1, 4))
    pipeline = resolve_cluster(None, use_global_virtual_mesh=True)
    assert (pipeline.spec.num_nodes, pipeline.spec.num_devices_per_node) == (1, 4)
    assert pipeline.devices == tuple(jax.devices()[:4])
    whole = resolve_cluster(None)  # a one-mesh method runs on all of it (as Alpa's)
    assert whole.spec.num_devices_per_node == 8 and len(whole.devices) == 8
    alpa.set_global_virtual_physical_mesh(VirtualPhysicalMesh(2, 4))
    with pytest.raises(
        ValueError,
        match=re.escape("the global virtual mesh (2, 4) does not fit the 8 local devices"),
    ):
        resolve_cluster(None, use_global_virtual_mesh=True)


@pytest.mark.parametrize(
    "bad, error, message",
    [
        ("cpu", TypeError, "devices='cpu' is a string; pass jax devices (jax.devices('cpu'))"),
        (["cpu:0"], TypeError, "devices must be jax devices (from jax.devices()), got str"),
        (
            3,
            TypeError,
            "devices must be None, a list of jax devices, a LocalPhysicalDeviceMesh, a "
            "DistributedPhysicalDeviceMesh, a DeviceCluster (alpa.get_global_cluster()), a "
            "LogicalDeviceMesh, a VirtualPhysicalMesh or a ClusterSpec, got int 3",
        ),
        ([], ValueError, "LocalPhysicalDeviceMesh needs at least one device"),
    ],
)
def test_a_bad_devices_names_the_value_and_what_is_expected(bad, error, message):
    with pytest.raises(error, match=re.escape(message)):
        resolve_cluster(bad)
    # The methods say the same, when they plan.
    with pytest.raises(error, match=re.escape(message)):
        alpa.parallelize(lambda x: x * 2, method=alpa.ShardParallel(devices=bad))(jax.numpy.ones(8))


def test_on_ray_a_pipeline_plans_on_the_chosen_hosts_and_a_mesh_on_all(monkeypatch):
    ray_cluster = _fake_ray_cluster(2, 4)
    monkeypatch.setattr(importlib.import_module("alpa.cluster"), "_global_cluster", ray_cluster)
    alpa.set_global_virtual_physical_mesh(VirtualPhysicalMesh(1, 2))
    pipeline = resolve_cluster(None, use_global_virtual_mesh=True)
    assert (pipeline.spec.num_nodes, pipeline.spec.num_devices_per_node) == (1, 2)
    assert pipeline.ray_cluster is ray_cluster and pipeline.devices is None and pipeline.is_here
    whole = resolve_cluster(None)
    assert (whole.spec.num_nodes, whole.spec.num_devices_per_node) == (2, 4)
    alpa.set_global_virtual_physical_mesh(VirtualPhysicalMesh(3, 4))
    with pytest.raises(
        ValueError,
        match=re.escape("the global virtual mesh (3, 4) does not fit the Ray cluster of 2 x 4"),
    ):
        resolve_cluster(None, use_global_virtual_mesh=True)


def test_both_methods_plan_on_the_shape_of_a_virtual_mesh_not_its_specs_counts():
    """A ``VirtualPhysicalMesh`` of 2 x 2 devices whose ``cluster`` says 2 x 8: the pipeline
    and the one-mesh method both plan for 4 devices, on the spec's hardware."""
    model = MLPModel(hidden_size=16, num_layers=3, output_dim=16)
    state, batch, step = get_mlp_train_state_and_step(
        model, 8, 16, grad_func=alpa.value_and_grad, abstract=True
    )
    virtual = VirtualPhysicalMesh(2, 2, cluster=A100)
    pipeline = alpa.PipeshardParallel(
        devices=virtual,
        num_micro_batches=2,
        layer_option=alpa.AutoLayerOption(layer_num=2),
        stage_option="uniform",
    )
    plan = alpa.parallelize(step, method=pipeline).plan(state, batch)
    assert (plan.cluster.num_nodes, plan.cluster.num_devices_per_node) == (2, 2)
    assert (plan.num_hosts, plan.num_devices_per_host) == (2, 2)
    assert plan.cluster.name == "a100-40gb"
    assert max(stop for _, stop in plan.stage_plan.device_ranges) == 4
    sharding = alpa.parallelize(step, method=alpa.ShardParallel(devices=virtual)).plan(state, batch)
    assert sharding.logical_mesh.num_devices == 4
    assert sharding.logical_mesh.device_flops == A100.device_flops
