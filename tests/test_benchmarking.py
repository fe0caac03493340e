"""What Alpa's benchmark driver reads of a step on the local runtime: a step run on dummy
values (``use_dummy_value_for_benchmarking``), the executables' step timers
(``get_execution_time_costs``), the meshes' memory statistics and ``sync_workers``, and a
pipeline's ``mesh_group``. The same on Ray: ``tests/runtime/test_ray_runtime.py``."""

import time

import jax
import numpy as np
import pytest

import alpa
from alpa.global_env import global_config
from alpa.testing import assert_allclose, get_mlp_train_state_and_step

DUMMY = np.float32(1e-8)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)


def _dummy(tree):
    return jax.tree.map(lambda x: np.full(np.shape(x), 1e-8, np.asarray(x).dtype), tree)


@pytest.fixture
def settings():
    """The benchmark settings, restored after the test."""
    names = (
        "use_dummy_value_for_benchmarking",
        "shard_parallel_sync_for_timer",
        "pipeline_sync_for_timer",
    )
    saved = {n: getattr(global_config, n) for n in names}
    yield global_config
    for n, value in saved.items():
        setattr(global_config, n, value)


def test_a_step_on_abstract_arguments_runs_on_dummy_values_or_names_the_argument(settings):
    state, batch, step = get_mlp_train_state_and_step(16, 8, num_layers=2)
    mesh = alpa.LocalPhysicalDeviceMesh(jax.devices()[:4])
    method = alpa.ShardParallel(devices=mesh.get_logical_mesh((2, 2)))  # Alpa's benchmark way
    p_step = alpa.parallelize(step, method=method)
    abstract = _abstract(state)
    with pytest.raises(
        ValueError,
        match=r"argument 0\.step of train_step is abstract \(ShapeDtypeStruct\(shape=\(\), "
        r"dtype=int32\)\), without data: a step runs on arrays",
    ):
        p_step(abstract, batch)
    settings.use_dummy_value_for_benchmarking = True
    out = p_step(abstract, batch)
    expected = jax.jit(step)(_dummy(state), batch)
    assert_allclose(out.params, expected.params)
    executable = p_step.get_last_executable()
    assert executable.plan.logical_mesh.shape == (2, 2)
    assert {d for s in jax.tree.leaves(out.params) for d in s.devices()} == set(mesh.devices)
    # A real argument still runs on its own values.
    expected = jax.jit(step)(state, batch)
    assert_allclose(p_step(state, batch).params, expected.params)


def test_one_mesh_steps_are_timed_while_sync_for_timer_is_set(settings):
    state, batch, step = get_mlp_train_state_and_step(16, 8, num_layers=2)
    p_step = alpa.parallelize(step, method=alpa.DataParallel())
    state = p_step(state, batch)
    executable = p_step.get_last_executable()
    assert executable.get_execution_time_costs() == []  # asynchronous dispatches: untimed
    settings.shard_parallel_sync_for_timer = True
    walls = []
    for _ in range(3):  # a slow-path call, then cache hits
        tic = time.perf_counter()
        state = p_step(state, batch)
        walls.append(time.perf_counter() - tic)
    costs = executable.get_execution_time_costs()
    assert len(costs) == 3 and all(0 < c <= w for c, w in zip(costs, walls, strict=True))
    assert executable.get_execution_time_costs(return_all_costs=True) == [costs]
    assert executable.get_execution_time_costs("overall") == costs
    with pytest.raises(ValueError, match="timer_name='compute': an executable times whole steps"):
        executable.get_execution_time_costs("compute")


def test_local_mesh_memory_statistics_count_the_bytes_its_devices_hold():
    mesh = alpa.LocalPhysicalDeviceMesh(jax.devices()[4:6])
    jax_mesh = jax.sharding.Mesh(np.array(mesh.devices), ("x",))
    sharding = jax.sharding.NamedSharding(jax_mesh, jax.sharding.PartitionSpec("x"))
    mesh.reset_memory_stats()
    before = mesh.get_memory_allocated()
    assert mesh.get_max_memory_allocated() == before
    x = jax.device_put(np.ones((256, 64), np.float32), sharding)  # 32 KiB per device
    mesh.sync_workers()  # waits for it, and sees it
    assert mesh.get_memory_allocated() == before + 128 * 64 * 4
    del x
    assert mesh.get_memory_allocated() == before
    assert mesh.get_max_memory_allocated() == before + 128 * 64 * 4  # since the reset
    mesh.reset_memory_stats()
    assert mesh.get_max_memory_allocated() == before


def test_a_pipelines_mesh_group_places_dummies_and_times_its_steps(settings):
    state, batch, step = get_mlp_train_state_and_step(
        16, 8, num_layers=2, add_manual_pipeline_marker=True
    )
    method = alpa.PipeshardParallel(
        devices=jax.devices()[:4],
        num_micro_batches=2,
        layer_option="manual",
        stage_option=alpa.UniformStageOption(num_stages=2),
    )
    p_step = alpa.parallelize(step, method=method)
    executable = p_step.get_executable(state, batch)
    group = executable.mesh_group
    assert len(group) == 2 and [m.num_devices for m in group] == [2, 2]
    state_specs, _ = executable.get_input_placement_specs()
    flat_specs = jax.tree.leaves(state_specs, is_leaf=lambda x: hasattr(x, "mesh_ids"))
    settings.use_dummy_value_for_benchmarking = True
    placed = group.shard_args_to_arrays(flat_specs, jax.tree.leaves(_abstract(state)))
    for spec, x in zip(flat_specs, placed, strict=True):
        assert x.sharding == spec.placements[0]
        assert set(group[spec.mesh_ids[0]].devices) == x.sharding.device_set
        assert np.all(np.asarray(x) == np.asarray(DUMMY, x.dtype))
    settings.pipeline_sync_for_timer = True
    out = p_step(_abstract(state), batch)  # dummy values made where the stages read them
    out = p_step(out, batch)
    assert_allclose(out.params, jax.jit(step)(jax.jit(step)(_dummy(state), batch), batch).params)
    costs = executable.get_execution_time_costs()
    assert len(costs) == 2 and min(costs) > 0
    group.sync_workers()
    assert group.get_max_memory_allocated() == max(group.get_max_memory_allocated_per_mesh()) > 0
    with pytest.raises(KeyError, match=r"no mesh 7 in this mesh group; its mesh ids are \[0, 1\]"):
        group[7]
