"""``alpa.mesh_profiling``: a profile measured on the 8 CPU devices, written and read back,
and read by the planner. Tiny settings: the machinery, never the figures (timing lives in
``benchmark/cost_model``)."""

from __future__ import annotations

import json

import pytest
from conftest import devices_or_skip

import alpa
from alpa import mesh_profiling
from alpa.cost_profile import GroupLayout
from alpa.device_mesh import ClusterSpec

TINY = dict(
    dot_range=(8, 32),
    dtypes=("float32",),
    min_comm_size=10,
    max_comm_size_intra_node=12,
)


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory):
    devices_or_skip(8)
    path = str(tmp_path_factory.mktemp("profile") / "cluster.json")
    alpa.util.disable_tqdm_globally()
    try:
        mesh_profiling.profile_all(cache_filename=path, instruction_cost=True, **TINY)
    finally:
        alpa.global_config.use_tqdm = True
    return path


def test_a_profile_of_the_cpu_devices_is_written_and_read_back(profile_file):
    database = mesh_profiling.ProfilingResultDatabase()
    database.load(profile_file)
    profile = database.query("cpu")
    assert profile.key == "cpu/1x8" and database.query("cpu", (1, 8)) is profile
    assert set(profile.dot) == {"float32"} and profile.dot["float32"].sizes == (8, 32)
    assert profile.concurrency[1] == 1.0 and set(profile.concurrency) == {1, 2, 4, 8}
    # Every collective over every group layout of the host's power-of-two submeshes.
    layouts = {"2x1", "2x2", "2x4", "4x1", "4x2", "8x1"}
    for kind in mesh_profiling.COLLECTIVES:
        assert set(profile.collectives[kind]) == layouts, kind
        for curve in profile.collectives[kind].values():
            assert list(curve.seconds) == sorted(curve.seconds) and curve.seconds[0] > 0
    assert profile.cross_mesh is not None and profile.memory.seconds[-1] > 0
    assert profile.instruction_seconds > 0 and profile.launch_seconds > 0
    assert profile.meta["jax"] and profile.meta["seconds"] > 0
    assert GroupLayout.from_key("4x2") == GroupLayout(4, 2)
    with open(profile_file) as f:
        assert json.load(f)["format"] == 1


def test_the_planner_reads_the_profile(profile_file):
    spec = ClusterSpec.from_profile(profile_file)
    database = mesh_profiling.ProfilingResultDatabase()
    database.load(profile_file)
    assert spec.profile == database.only() and spec.num_devices_per_node == 8
    mesh = spec.get_virtual_physical_mesh().get_logical_mesh((2, 4))
    curve = spec.profile.collectives["all-reduce"]["4x2"]
    assert mesh.all_reduce_cost(2048, 1) == pytest.approx(curve(2048))
    # Alpa's way to ask for it: the stage search prices with the file's profile.
    method = _priced_by_file(profile_file)
    assert method._priced(ClusterSpec.preset("cpu", 1, 8), None).profile == spec.profile


def _priced_by_file(path: str) -> alpa.PipeshardParallel:
    """A stage search asking, as Alpa's scripts do, for the rates of the profile file
    ``path``, planned for 8 CPU devices that need not be here."""
    option = alpa.AutoStageOption(use_hlo_cost_model=True, profiling_database_filename=path)
    return alpa.PipeshardParallel(
        devices=ClusterSpec.preset("cpu", 1, 8),
        num_micro_batches=2,
        layer_option=alpa.AutoLayerOption(layer_num=2),
        stage_option=option,
    )


def test_another_profile_is_added_beside_the_first(profile_file, tmp_path):
    path = str(tmp_path / "two.json")
    with open(profile_file) as f, open(path, "w") as g:
        g.write(f.read())
    mesh_profiling.profile_all(
        cache_filename=path, cluster_key="cpu-other", instruction_cost=False, **TINY
    )
    database = mesh_profiling.ProfilingResultDatabase()
    database.load(path)
    assert sorted(database.data) == ["cpu-other/1x8", "cpu/1x8"]
    with pytest.raises(ValueError, match="holds 2 profiles"):
        ClusterSpec.from_profile(path)
    assert ClusterSpec.from_profile(path, device_kind="cpu-other").profile.device_kind == (
        "cpu-other"
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_comm_size_intra_node": 99}, r"max_comm_size_intra_node must be an int in \[0, 40\]"),
        ({"min_comm_size": 20, "max_comm_size_intra_node": 12}, "min_comm_size=20 exceeds"),
        ({"dot_range": (8,)}, "dot_range needs two or more positive int sizes"),
        ({"dtypes": ("int8",)}, "dtypes must name float dtypes"),
    ],
)
def test_bad_profiling_arguments_are_named(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        mesh_profiling.profile_all(cache_filename=str(tmp_path / "x.json"), **kwargs)


def test_a_named_profile_that_does_not_exist_plans_with_the_preset_and_says_so(tmp_path):
    """Alpa's benchmark suites name ``prof_database.pkl``, which Alpa's
    gen_prof_database.py made first: the step is planned with the preset's figures, and
    the warning names the file and how to make it."""
    method = _priced_by_file(str(tmp_path / "prof_database.pkl"))
    preset = ClusterSpec.preset("cpu", 1, 8)
    with pytest.warns(
        UserWarning,
        match=r"prof_database\.pkl' does not exist: planning with .*\.profile_all\(cache_filename=",
    ):
        priced = method._priced(preset, None)
    assert priced == preset and priced.profile is None


def test_the_missing_profile_warning_points_at_the_users_line(tmp_path):
    """Planned through ``parallelize(...).plan()``, however deep in alpa the warning is
    raised, it names the line of the caller's script that asked for the plan."""
    import inspect
    import warnings

    from alpa.model.mlp import MLPModel, get_mlp_train_state_and_step

    model = MLPModel(hidden_size=16, num_layers=1, output_dim=16)
    state, batch, step = get_mlp_train_state_and_step(
        model, 8, 16, grad_func=alpa.value_and_grad, abstract=True
    )
    method = _priced_by_file(str(tmp_path / "prof_database.pkl"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        alpa.parallelize(step, method=method).plan(state, batch)
    (warning,) = [w for w in caught if "does not exist: planning with" in str(w.message)]
    assert (warning.filename, warning.lineno) == (__file__, line)
