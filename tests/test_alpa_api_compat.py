"""Parts of Alpa's public API that its scripts use: argument
defaults, executables as callables, avals, the cluster and mesh API, cache clearing and
the small helpers of ``alpa.util``."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import alpa
from alpa.testing import assert_allclose


def _step(w, x):
    return jnp.tanh(x @ w)


def test_default_batch_argnums_follows_the_number_of_arguments():
    w, x = jnp.ones((4, 4)), jnp.ones((16, 4))
    # Two arguments: argument 1 is the batch (Alpa's default (1,)), split over devices.
    two = alpa.parallelize(_step, method=alpa.DataParallel())
    assert_allclose(two(w, x), _step(w, x))
    placement = two.get_last_executable().get_input_placement_specs()
    assert placement[1].sharding_specs[0] != P()
    # One argument: there is no argument 1, so nothing is a batch (no error).
    one = alpa.parallelize(lambda w: jnp.sum(w * 2.0), method=alpa.DataParallel())
    assert_allclose(one(w), jnp.sum(w * 2.0))
    # Alpa's default written out means the same (its programs pass it to one-argument
    # functions); any other out-of-range position stays an error.
    same = alpa.parallelize(lambda w: w * 2.0, method=alpa.DataParallel(), batch_argnums=(1,))
    assert_allclose(same(w), w * 2.0)
    bad = alpa.parallelize(lambda w: w * 2.0, method=alpa.DataParallel(), batch_argnums=(2,))
    with pytest.raises(ValueError, match=r"batch_argnums=\(2,\) is out of range"):
        bad(w)


def test_executable_is_callable_and_takes_avals():
    w, x = jnp.ones((4, 4)), jnp.ones((16, 4))
    f = alpa.parallelize(_step, method=alpa.DataParallel())
    executable = f.get_executable(jax.typeof(w), jax.typeof(x))  # ShapedArray avals
    assert executable is f.get_executable(w, x)  # the same signature: compiled once
    assert_allclose(executable(w, x), _step(w, x))


def test_init_local_with_fewer_devices_and_the_cluster_api():
    alpa.init("local", num_nodes=1, num_devices_per_node=4)
    mesh = alpa.get_global_physical_mesh()
    assert mesh.devices == tuple(jax.devices()[:4])
    assert alpa.get_global_num_devices() == 4
    assert isinstance(mesh, alpa.PhysicalDeviceMesh)
    assert (mesh.num_hosts, mesh.num_devices_per_host, mesh.shape) == (1, 4, (1, 4))
    assert len(mesh.host_info) == 1 and "NodeManagerAddress" in mesh.host_info[0]
    half = mesh.slice_2d([0], [[2, 3]])
    assert half.devices == tuple(jax.devices()[2:4])
    assert mesh.slice_1d(0, 2).devices == tuple(jax.devices()[:2])
    mesh.shutdown()  # a local mesh holds nothing to free
    with pytest.raises(ValueError, match=r"device_indices must be in \[0, 4\), got \[4\]"):
        mesh.slice_2d([0], [[4]])
    alpa.shutdown()
    with pytest.raises(ValueError, match=r"num_devices_per_node=9 but this process has 8"):
        alpa.init("local", num_devices_per_node=9)


def _check_pipeline_runs_on_the_first_four_devices():
    """A 2-stage inference pipeline under a global virtual mesh of the first 4 devices:
    it matches serial and uses exactly those devices."""
    rng = np.random.default_rng(0)
    params = {f"w{i}": rng.standard_normal((8, 8), dtype=np.float32) for i in range(2)}
    x = rng.standard_normal((16, 8), dtype=np.float32)

    def infer(params, x):
        h = jnp.tanh(x @ params["w0"])
        alpa.mark_pipeline_boundary()
        return jnp.tanh(h @ params["w1"])

    method = alpa.PipeshardParallel(num_micro_batches=2, pipeline_schedule="inference")
    f = alpa.parallelize(infer, method=method)
    assert_allclose(f(params, x), infer(params, x))
    used = {d for m in f.get_last_executable().meshes for d in m.devices.flat}
    assert used == set(jax.devices()[:4])


def test_local_cluster_slices_meshes_as_alpa_programs_do():
    alpa.shutdown()
    assert alpa.get_global_cluster() is None  # before init, as Alpa
    alpa.init("local")
    cluster = alpa.get_global_cluster()
    assert (cluster.num_hosts, cluster.num_devices_per_host, cluster.num_devices) == (1, 8, 8)
    assert [h["NodeID"] for h in cluster.host_info] == ["local"]  # Alpa's scripts count hosts
    assert cluster.get_physical_mesh([0], 2).devices == tuple(jax.devices()[:2])
    assert cluster.get_physical_mesh().num_devices == 8
    virtual = cluster.get_virtual_physical_mesh([0], 4)
    assert virtual.shape == (1, 4) and virtual.cluster.num_devices_per_node == 4
    with pytest.raises(ValueError, match=r"host_ids must be \[0\] \(alpa.init\('local'\) has one"):
        cluster.get_virtual_physical_mesh([1], 4)
    with pytest.raises(ValueError, match=r"num_devices_per_host must be in \[1, 8\], got 9"):
        cluster.get_physical_mesh([0], 9)
    # Alpa's test_manual_sharding: a pipeline on the first 4 devices, sliced from the cluster.
    alpa.set_global_virtual_physical_mesh(virtual)
    _check_pipeline_runs_on_the_first_four_devices()
    alpa.shutdown()


def test_auto_stage_option_takes_alpa_layer_profile_mode():
    for mode in ("composite", "individual"):
        assert alpa.AutoStageOption(layer_profile_mode=mode).layer_profile_mode == mode
    with pytest.raises(ValueError, match=r"layer_profile_mode must be 'composite' or "
                       r"'individual', got 'each'"):  # fmt: skip
        alpa.AutoStageOption(layer_profile_mode="each")


def test_global_virtual_mesh_decides_where_pipelines_run():
    alpa.init("local")
    alpa.set_global_virtual_physical_mesh(alpa.VirtualPhysicalMesh(1, 4))
    assert alpa.get_global_virtual_physical_mesh().shape == (1, 4)
    _check_pipeline_runs_on_the_first_four_devices()
    with pytest.raises(TypeError, match="mesh must be a VirtualPhysicalMesh or None"):
        alpa.set_global_virtual_physical_mesh((1, 4))
    alpa.shutdown()
    assert alpa.get_global_virtual_physical_mesh().shape == (1, 8)  # shutdown forgets it


def test_clear_executable_cache_recompiles():
    f = alpa.parallelize(_step, method=alpa.DataParallel())
    w, x = jnp.ones((4, 4)), jnp.ones((16, 4))
    f(w, x)
    first = f.get_last_executable()
    alpa.clear_executable_cache()
    f(w, x)
    assert f.get_last_executable() is not first


def test_util_maps_and_shard_shape():
    tree = {"a": jnp.ones((2, 3)), "b": (np.zeros(4), 1.5)}
    assert alpa.util.map_to_shape(tree) == {"a": (2, 3), "b": ((4,), None)}
    arrays = alpa.util.map_to_nparray(tree)
    assert isinstance(arrays["a"], np.ndarray) and arrays["b"][1] == 1.5
    mesh = alpa.LocalPhysicalDeviceMesh().get_logical_mesh((2, 4)).get_jax_mesh()
    sharding = NamedSharding(mesh, P("x", "y"))
    assert alpa.util.get_shard_shape(jax.ShapeDtypeStruct((8, 12), jnp.float32), sharding) == (
        4,
        3,
    )


def test_clear_errors_for_devices_budgets_and_a_second_init():
    w, x = jnp.ones((4, 4)), jnp.ones((16, 4))
    with pytest.raises(TypeError, match=r"devices='cpu' is a string; pass jax devices"):
        alpa.parallelize(_step, method=alpa.PipeshardParallel(devices="cpu"))(w, x)
    with pytest.raises(TypeError, match=r"devices must be jax devices .*got str 'cpu:0'"):
        alpa.parallelize(_step, method=alpa.ShardParallel(devices=["cpu:0"]))(w, x)
    with pytest.raises(ValueError, match=r"memory_budget_per_device must be None or a positive"):
        alpa.AutoShardingOption(memory_budget_per_device="1GB")
    from alpa.pipeline_parallel.stages.stage_construction import AutoStageOption

    with pytest.raises(ValueError, match=r"AutoStageOption.memory_budget_per_device must be"):
        AutoStageOption(memory_budget_per_device="1GB")
    alpa.init("local")
    alpa.init("local")  # the same arguments: silently nothing to do
    with pytest.warns(UserWarning, match=r"alpa.init\('local', ...\) is ignored: alpa is already"):
        alpa.init("local", num_devices_per_node=2)
    assert alpa.get_global_num_devices() == 8


def test_get_3d_parallel_method():
    from alpa.testing import get_mlp_train_state_and_step

    alpa.init("local")
    method = alpa.get_3d_parallel_method(
        num_micro_batches=2, data_parallel=2, operator_parallel=2, pipeline_parallel=2
    )
    assert isinstance(method, alpa.PipeshardParallel)
    state, batch, step = get_mlp_train_state_and_step(32, 16, num_layers=4)
    expected = jax.jit(step)(state, batch)
    p_step = alpa.parallelize(step, method=method)
    assert_allclose(p_step(state, batch).params, expected.params)
    executable = p_step.get_last_executable()
    assert [m.devices.shape for m in executable.meshes] == [(2, 2), (2, 2)]
    # One stage: ShardParallel on the logical mesh (dp, op) of the global mesh.
    shard = alpa.get_3d_parallel_method(1, 2, 4, 1)
    assert isinstance(shard, alpa.ShardParallel) and shard.devices.shape == (2, 4)
    with pytest.raises(ValueError, match=r"data_parallel \* operator_parallel = 4 but the"):
        alpa.get_3d_parallel_method(1, 2, 2, 1)
    with pytest.raises(ValueError, match="pipeline_parallel must be a positive int, got 0"):
        alpa.get_3d_parallel_method(1, 2, 2, 0)
    # data_parallel=-1: the rest of the 8 devices.
    rest = alpa.get_3d_parallel_method(2, -1, 2, 2)
    assert tuple(rest.stage_option.submesh_logical_shapes) == ((2, 2), (2, 2))
    assert alpa.get_3d_parallel_method(1, -1, 4, 1).devices.shape == (2, 4)
    with pytest.raises(ValueError, match=r"operator_parallel \* pipeline_parallel = 3, but the"):
        alpa.get_3d_parallel_method(1, -1, 3, 1)
    with pytest.raises(ValueError, match="data_parallel must be a positive int, got -2"):
        alpa.get_3d_parallel_method(1, -2, 2, 2)


def test_test_install_runs_and_passes():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "alpa.test_install"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok   ShardParallel" in result.stdout
    assert "ok   PipeshardParallel" in result.stdout
    assert result.stdout.strip().endswith("alpa is installed correctly")


def _opt_state_specs(p_step, state, batch):
    specs = p_step.get_executable(state, batch).get_input_placement_specs()[0]
    return [s.sharding_specs for s in jax.tree.leaves(specs.opt_state, is_leaf=_is_spec)]


def _is_spec(x):
    return isinstance(x, alpa.executables.base.PlacementSpec)


def test_as_option_assignment_takes_effect_and_is_validated():
    from alpa.testing import get_mlp_train_state_and_step

    state, batch, step = get_mlp_train_state_and_step(32, 16, num_layers=2)
    # DataParallel + prefer_reduce_scatter is ZeRO-2: the optimizer state is sharded as
    # Zero2Parallel shards it; plain DataParallel replicates it.
    method = alpa.DataParallel()
    assert method.as_option.force_data_parallel and method.zero_stage == 0
    method.as_option.prefer_reduce_scatter = True
    assert method.zero_stage == 2
    tuned = alpa.parallelize(step, method=method)
    zero2 = alpa.parallelize(step, method=alpa.Zero2Parallel())
    plain = alpa.parallelize(step, method=alpa.DataParallel())
    assert _opt_state_specs(tuned, state, batch) == _opt_state_specs(zero2, state, batch)
    assert _opt_state_specs(tuned, state, batch) != _opt_state_specs(plain, state, batch)
    expected = jax.jit(step)(state, batch)
    assert_allclose(tuned(state, batch), expected)

    # ShardParallel: force_data_parallel set on its as_option gives DataParallel's program.
    shard = alpa.ShardParallel()
    shard.as_option.force_data_parallel = True
    assert shard.auto_sharding_option.force_data_parallel  # the alias sees the change
    forced = alpa.parallelize(step, method=shard)
    for f in (forced, plain):
        f.get_executable(state, batch)
    forced_exe, plain_exe = forced.get_last_executable(), plain.get_last_executable()
    assert forced_exe.plan.in_specs == plain_exe.plan.in_specs
    assert forced_exe.plan.grad_specs == plain_exe.plan.grad_specs
    assert alpa.util.count_communication_primitives(
        forced_exe.get_hlo_text()
    ) == alpa.util.count_communication_primitives(plain_exe.get_hlo_text())

    # A bad value is refused at the assignment, naming the field; the option is unchanged.
    with pytest.raises(
        ValueError, match=r"force_batch_dim_to_mesh_dim must be None \(Alpa's default\), -1 "
    ):
        shard.as_option.force_batch_dim_to_mesh_dim = 2
    with pytest.raises(TypeError, match=r"allow_mixed_mesh_shape must be a bool, got 'yes'"):
        shard.as_option.allow_mixed_mesh_shape = "yes"
    assert shard.as_option.allow_mixed_mesh_shape is False
    with pytest.raises(AttributeError, match="AutoShardingOption has no field 'prefer_rs'"):
        shard.as_option.prefer_rs = True
    # After a compile the cached executables keep their option: say so.
    with pytest.warns(UserWarning, match="executables already compiled keep the old option"):
        shard.as_option.allow_all_to_all = False
    assert forced_exe.auto_sharding_option.allow_all_to_all  # the snapshot it compiled with
    # The whole option can be replaced, with a check of its type.
    shard.as_option = alpa.AutoShardingOption(prefer_reduce_scatter=True)
    assert shard.auto_sharding_option.prefer_reduce_scatter
    with pytest.raises(TypeError, match="auto_sharding_option must be an AutoShardingOption"):
        shard.as_option = {"prefer_reduce_scatter": True}


def test_an_option_is_mutable_checked_per_field_and_snapshotted_at_compile():
    """Alpa's users build an option, assign fields, then pass it (or keep assigning while a
    method holds it): each assignment is checked; a compilation plans with a frozen
    snapshot, so a later assignment acts at the next compilation only."""
    from alpa.testing import get_mlp_train_state_and_step

    option = alpa.AutoShardingOption()
    option.force_data_parallel = True
    option.prefer_reduce_scatter = True
    with pytest.raises(ValueError, match=r"memory_budget_per_device must be None or a positive"):
        option.memory_budget_per_device = -1
    assert option.memory_budget_per_device is None
    with pytest.raises(ValueError, match=r"logical_mesh_shape must be None or two positive ints"):
        option.logical_mesh_shape = (2, 0)
    option.mesh_alpha = [1, 2]
    assert option.mesh_alpha == (1.0, 2.0)
    with pytest.raises(TypeError, match="mutable, hence unhashable"):
        hash(option)

    state, batch, step = get_mlp_train_state_and_step(32, 16, num_layers=2)
    p_step = alpa.parallelize(step, method=alpa.ShardParallel(auto_sharding_option=option))
    executable = p_step.get_executable(state, batch)
    compiled = executable.auto_sharding_option
    assert compiled == option and compiled is not option and compiled.frozen
    assert hash(compiled) == hash(option.snapshot())
    with pytest.raises(dataclasses.FrozenInstanceError, match="frozen snapshot"):
        compiled.prefer_reduce_scatter = False
    zero2 = _opt_state_specs(p_step, state, batch)
    # A later assignment warns and leaves the compiled plan as it was...
    with pytest.warns(UserWarning, match="executables already compiled keep the old option"):
        option.prefer_reduce_scatter = False
    assert compiled.prefer_reduce_scatter and executable.auto_sharding_option is compiled
    assert _opt_state_specs(p_step, state, batch) == zero2
    # ...and a new compilation plans with the new value (plain data parallel).
    again = alpa.parallelize(step, method=alpa.ShardParallel(auto_sharding_option=option))
    assert not again.get_executable(state, batch).auto_sharding_option.prefer_reduce_scatter
    assert _opt_state_specs(again, state, batch) != zero2
    # The two fields that exclude each other are checked when a compilation takes them.
    fresh = alpa.AutoShardingOption(force_data_parallel=True)
    fresh.force_zero_stage_3 = True
    with pytest.raises(ValueError, match="force_data_parallel and force_zero_stage_3 exclude"):
        fresh.snapshot()


def test_timers_record_the_compiler_phases():
    from alpa.timer import Timer

    phases = ("tracing", "planning", "compile")
    before = {name: len(alpa.timers(name).costs) for name in phases}
    f = alpa.parallelize(_step, method=alpa.ShardParallel())
    w, x = jnp.ones((8, 8)), jnp.ones((16, 8))
    f(w, x)
    for name in phases:  # one compilation: one interval per phase
        assert len(alpa.timers(name).costs) == before[name] + 1
        assert alpa.timers(name).elapsed() > 0
    f(w, x)  # a cache hit compiles nothing
    assert all(len(alpa.timers(n).costs) == before[n] + 1 for n in phases)
    assert alpa.timers.log().startswith("tracing: ")

    timer = Timer("mine")
    with pytest.raises(RuntimeError, match="'mine' was stopped without being started"):
        timer.stop()
    timer.costs.extend([1.0, 3.0])
    assert (timer.elapsed(), timer.elapsed("sum"), timer.elapsed("average")) == (3.0, 4.0, 2.0)
    timer.start()
    with pytest.raises(RuntimeError, match="'mine' is already running"):
        timer.start()
    with pytest.raises(ValueError, match="mode must be 'last', 'sum' or 'average'"):
        timer.elapsed("max")


def test_alpas_names_at_alpas_module_paths(tmp_path, capsys):
    import alpa.cluster
    import alpa.device_mesh
    import alpa.parallel_method
    import alpa.pipeline_parallel.stages.stage_construction as stage_construction
    import alpa.runtime.ray_mesh
    import alpa.util
    from alpa.pipeline_parallel.layers.layer_construction import ManualLayerOption

    assert alpa.AutoStageOption is stage_construction.AutoStageOption
    assert alpa.UniformStageOption is stage_construction.UniformStageOption
    for name in (
        "get_global_cluster",
        "get_global_physical_mesh",
        "get_global_virtual_physical_mesh",
    ):
        assert getattr(alpa.device_mesh, name) is getattr(alpa.cluster, name)
    assert alpa.device_mesh.DistributedArray is alpa.runtime.ray_mesh.DistributedArray
    with pytest.raises(AttributeError, match="'alpa.device_mesh' has no attribute 'nope'"):
        alpa.device_mesh.nope  # noqa: B018
    local = alpa.parallel_method.LocalPipelineParallel()
    assert isinstance(local, alpa.PipeshardParallel)
    assert local.layer_option == ManualLayerOption()

    util = alpa.util
    assert util.GB == 2**30
    path = tmp_path / "results.tsv"
    util.write_tsv(["model", "time"], ["gpt", 1.5], path)
    util.write_tsv(["model", "time"], ["bert", 2], path, print_line=False)
    assert path.read_text() == "gpt\t1.5\nbert\t2\n"
    assert capsys.readouterr().out == "model: gpt  time: 1.5\n"
    with pytest.raises(ValueError, match="write_tsv got 2 heads but 1 values"):
        util.write_tsv(["a", "b"], [1], path)
    assert util.to_str_round([1.234567, (2, "x")], 2) == "[1.23, [2, x]]"
    assert util.to_str_round({"times": None}, 2) == "{'times': 'None'}"
    util.print_used_time(None)  # Alpa's scripts restart the timer so, printing nothing
    assert capsys.readouterr().out == ""
    util.print_used_time("phase")
    assert re.fullmatch(r" - phase: \d+\.\d\d s\n", capsys.readouterr().out)
    timer = alpa.timers("compat-test-timer")
    timer.reset()
    for _ in range(4):
        timer.start()
        timer.stop()
    assert len(util.get_execution_time_costs(timer_name="compat-test-timer")) == 2
    assert len(util.get_execution_time_costs(1, "compat-test-timer", return_all_costs=True)) == 4
    with pytest.raises(KeyError, match="no timer named 'absent'"):
        util.get_execution_time_costs(timer_name="absent")


def test_parallelize_a_partial_and_global_config_refuses_unknown_settings():
    import functools

    from alpa.testing import get_mlp_train_state_and_step

    state, batch, step = get_mlp_train_state_and_step(32, 16, num_layers=2)

    def scaled(state, batch, scale):
        return jax.tree.map(lambda x: x * scale, step(state, batch))

    partial = functools.partial(scaled, scale=2.0)
    p_step = alpa.parallelize(partial, method=alpa.DataParallel())
    assert p_step.name == "scaled"
    expected = jax.jit(partial)(state, batch)
    assert_allclose(p_step(state, batch), expected)

    with pytest.raises(AttributeError, match="global_config has no setting 'ncl_mode'"):
        alpa.global_config.ncl_mode = "cupy"
    assert not hasattr(alpa.global_config, "ncl_mode")
