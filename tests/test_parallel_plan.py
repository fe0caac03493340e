"""ParallelPlan: a compile's decisions recorded, saved, and replayed without searching.

Every case is compiled once here (the ``recorded`` fixture). Its plan goes through JSON to
a fresh Python process, which compiles the same step with ``alpa.plan_to_method(plan)``;
the oracle is the compiled HLO, equal to the original's (per stage for a pipeline) once
debug locations are removed. In this process the replay runs with the ILP, the stage DP
and layer construction patched to fail, and its results equal the serial step's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import pytest

import alpa
from alpa.device_mesh import ClusterSpec
from alpa.model.mlp import MLPModel
from alpa.model.mlp import get_mlp_train_state_and_step as get_mlp_model_step
from alpa.pipeline_parallel.pipeshard_plan import SUMMARY_FORMAT, PipeshardPlan
from alpa.pipeline_parallel.stages.stage_construction import AutoStageOption
from alpa.plan_view import draw_saved_plan
from alpa.record.parallel_plan import PLAN_FORMAT, ParallelPlan
from alpa.saved_format import NewerFormatError
from alpa.testing import (
    assert_allclose,
    get_mlp_train_state_and_step,
    get_tied_embedding_step,
    program_text,
    unit_cost_mesh,
)

# The module-scoped ``recorded`` fixture compiles every case and replays it in a fresh
# process (about 40 s); one xdist worker runs the module, so that happens once.
pytestmark = pytest.mark.xdist_group("parallel_plan")

NUM_DEVICES = 8
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------- cases


def _chain(params, x):
    """A step whose ILP plan reshards operands (a value read transposed by its users)."""
    h = x @ params["w"]
    g = h.T @ h
    return g @ h.T


def _chain_args():
    params = {"w": jax.random.normal(jax.random.PRNGKey(0), (16, 64)) / 4}
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 16))
    return params, x


def _pipeshard(stage_option, schedule="1f1b"):
    return alpa.PipeshardParallel(
        num_micro_batches=2,
        layer_option=alpa.AutoLayerOption(layer_num=2),
        stage_option=stage_option,
        pipeline_schedule=schedule,
    )


def make_case(name: str):
    """``(step, args, method)`` of case ``name``: the method is the original's, which
    searches (the subprocess replaying a plan builds the step and arguments from here)."""
    if name == "ilp_2d":
        return _chain, _chain_args(), alpa.ShardParallel(devices=unit_cost_mesh((2, 4)))
    if name == "partial_sums":  # the tied table's gradient is reduced once
        params, batch, step = get_tied_embedding_step()
        option = alpa.AutoShardingOption(force_batch_dim_to_mesh_dim=0, prefer_reduce_scatter=True)
        mesh = alpa.get_global_physical_mesh().get_logical_mesh((4, 2))
        return step, (params, batch), alpa.ShardParallel(devices=mesh, auto_sharding_option=option)
    if name == "scattered_2d":  # Alpa's prefer_reduce_scatter rewrite of a 2-D plan
        state, batch, step = get_mlp_train_state_and_step(64, 32, num_layers=4)
        mesh = alpa.get_global_physical_mesh().get_logical_mesh((4, 2), [1, 1], [1, 0.1])
        option = alpa.AutoShardingOption(prefer_reduce_scatter=True)
        return step, (state, batch), alpa.ShardParallel(devices=mesh, auto_sharding_option=option)
    state, batch, step = get_mlp_train_state_and_step(32, 16, num_layers=2)
    methods = {
        "data_parallel": alpa.DataParallel,
        "zero3": alpa.Zero3Parallel,
        "micro_batches": lambda: alpa.ShardParallel(num_micro_batches=2),
        "pipeshard_uniform": lambda: _pipeshard("uniform"),
        # Two stages on one mesh of 8 devices, the V's turn between them.
        "pipeshard_dualpipev": lambda: _pipeshard("uniform", "dualpipev"),
        # Only (1, 4) submeshes: the DP must pick two stages.
        "pipeshard_auto": lambda: _pipeshard(
            AutoStageOption(
                submesh_physical_shape_space="manual", manually_specified_submeshes=[(1, 4)]
            )
        ),
    }
    return step, (state, batch), methods[name]()


CASES = (
    "ilp_2d",
    "partial_sums",
    "scattered_2d",
    "data_parallel",
    "zero3",
    "micro_batches",
    "pipeshard_uniform",
    "pipeshard_dualpipev",
    "pipeshard_auto",
)


def replay_hlo(name: str, plan_path: str):
    """Compile case ``name`` from the plan saved at ``plan_path``; its program text."""
    step, args, _ = make_case(name)
    method = alpa.plan_to_method(ParallelPlan.load(plan_path))
    return program_text(alpa.parallelize(step, method=method).get_executable(*args).get_hlo_text())


_REPLAY_SCRIPT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("plan_cases", sys.argv[1])
cases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cases)
jobs = json.loads(sys.argv[2])
with open(sys.argv[3], "w") as f:
    json.dump({name: cases.replay_hlo(name, path) for name, path in jobs.items()}, f)
"""


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Per case: the original executable's program text, its plan saved as JSON, and the
    program text a fresh process compiled from that JSON."""
    if len(jax.devices()) < NUM_DEVICES:
        pytest.skip(f"needs {NUM_DEVICES} devices, have {len(jax.devices())}")
    folder = tmp_path_factory.mktemp("plans")
    originals, paths = {}, {}
    for name in CASES:
        step, args, method = make_case(name)
        executable = alpa.parallelize(step, method=method).get_executable(*args)
        originals[name] = program_text(executable.get_hlo_text())
        paths[name] = str(folder / f"{name}.json")
        executable.get_parallel_plan().save(paths[name])
    out = folder / "replayed.json"
    # The replay inherits the suite's XLA_FLAGS (tests/conftest.py: the device count and the
    # code generation the original was compiled with), so that the two HLO texts compare.
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    subprocess.run(
        [sys.executable, "-c", _REPLAY_SCRIPT, __file__, json.dumps(paths), str(out)],
        env=env,
        cwd=REPO,
        check=True,
        timeout=600,
    )
    replayed = json.loads(out.read_text())
    return {name: (originals[name], paths[name], replayed[name]) for name in CASES}


@pytest.fixture
def no_search(monkeypatch):
    """Make every search fail: the ILP, the stage DP, layer construction and the
    per-stage sharding pass."""

    def searched(*args, **kwargs):
        raise AssertionError("searched during a replay")

    from alpa.pipeline_parallel import pipeshard_passes
    from alpa.pipeline_parallel.stages import stage_search
    from alpa.shard_parallel.ilp import ilp_solver

    monkeypatch.setattr(ilp_solver, "solve", searched)
    monkeypatch.setattr(stage_search, "training_dp", searched)
    monkeypatch.setattr(pipeshard_passes, "construct_layers", searched)
    monkeypatch.setattr(pipeshard_passes, "plan_stage_shardings", searched)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", CASES)
def test_plan_from_json_in_a_fresh_process_compiles_the_same_hlo(recorded, name):
    original, _, replayed = recorded[name]
    if isinstance(original, list):
        assert len(original) > 1
    assert replayed == original


@pytest.mark.parametrize("name", CASES)
def test_replay_does_not_search_and_matches_serial(recorded, no_search, name):
    original, path, _ = recorded[name]
    step, args, method = make_case(name)
    searching = ("ilp_2d", "partial_sums", "scattered_2d", "micro_batches")
    if name in searching or name.startswith("pipeshard"):
        with pytest.raises(AssertionError, match="searched during a replay"):
            alpa.parallelize(step, method=method).plan(*args)  # the patches do bite
    expected = jax.jit(step)(*args)
    p_step = alpa.parallelize(step, method=alpa.plan_to_method(ParallelPlan.load(path)))
    executable = p_step.get_executable(*args)
    assert program_text(executable.get_hlo_text()) == original
    # The replay made the recorded decisions, so it records the same plan.
    with open(path) as f:
        assert executable.get_parallel_plan().to_json() == f.read()
    assert_allclose(p_step(*args), expected, rtol=1e-4, atol=1e-4)


def test_ilp_plan_records_pinned_values_and_resharded_operands(recorded):
    plan = ParallelPlan.load(recorded["ilp_2d"][1])
    sharding = plan.sharding_plan
    assert plan.method == "auto-sharding ILP"
    assert sharding.logical_mesh.shape == (2, 4)
    assert sharding.logical_mesh.axis_names == ("x", "y")
    assert sharding.logical_mesh.devices is None
    assert sharding.var_specs and all(r.startswith("eqn") for r in sharding.var_specs)
    assert sharding.operand_specs
    assert plan.input_names == ("argument 0['w']", "argument 1")
    assert plan.input_avals == ("float32[16, 64]", "float32[32, 16]")
    assert [p.sharding_specs for p in plan.input_placement_specs] == [
        (s,) for s in sharding.in_specs
    ]


def test_ilp_plan_records_partial_sums(recorded):
    sharding = ParallelPlan.load(recorded["partial_sums"][1]).sharding_plan
    ((ref, partial_sum),) = sharding.partial_sums.items()
    assert ref.startswith("eqn") and partial_sum.reduce_axes == ("x",)
    assert [len(specs) for specs in partial_sum.operand_specs] in ([2, 3], [3, 2])


def test_a_rewritten_2d_plan_records_its_gradient_sync(recorded):
    """The rewrite of a 2-D plan is recorded: a replay reduce-scatters the gradients at
    the marker (the same program, checked above), with no search."""
    plan = ParallelPlan.load(recorded["scattered_2d"][1]).sharding_plan
    assert plan.sync_at_marker and plan.data_axes == ("x",)
    assert any("x" in str(s) and "y" in str(s) for s in plan.grad_specs)


def test_plan_json_round_trips(recorded):
    for name in CASES:
        with open(recorded[name][1]) as f:
            text = f.read()
        assert ParallelPlan.from_json(text).to_json() == text


def test_damaged_plan_files_name_the_file(recorded, tmp_path):
    with open(recorded["pipeshard_auto"][1]) as f:
        text = f.read()
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index(",\n", len(text) // 2) + 1])  # at a line's end
    with pytest.raises(
        ValueError,
        match=r"'.*cut\.json' is not a ParallelPlan: its JSON is "
        r"invalid at line \d+ column \d+ \(.*\) \(it ends there: a truncated",
    ):
        ParallelPlan.load(cut)
    cut.write_text(text[: text.index('"', len(text) // 2) + 2])  # inside a string
    with pytest.raises(ValueError, match=r"cut\.json' is not a ParallelPlan: .*a truncated"):
        ParallelPlan.load(cut)
    garbled = tmp_path / "garbled.json"
    garbled.write_text(text.replace(":", ";", 1))
    with pytest.raises(
        ValueError,
        match=r"'.*garbled\.json' is not a ParallelPlan: its JSON is "
        r"invalid at line 2",
    ):
        ParallelPlan.load(garbled)
    partial = tmp_path / "partial.json"
    data = json.loads(text)
    del data["pipeline_plan"]
    partial.write_text(json.dumps(data))
    with pytest.raises(
        ValueError,
        match=r"partial\.json' is not a whole ParallelPlan: it has "
        r"no field 'pipeline_plan'",
    ):
        ParallelPlan.load(partial)
    with pytest.raises(ValueError, match=r"the text is not a ParallelPlan: it holds a list"):
        ParallelPlan.from_json("[1, 2]")


def _edited(text: str, edit) -> str:
    data = json.loads(text)
    edit(data["pipeline_plan"], data["pipeline_plan"]["stage_plan"])
    return json.dumps(data)


def _one_stage(pipeline, stages):
    """The two-stage plan edited into one stage of all eight devices."""
    stages.update(
        layer_to_stage=[0, 0], device_ranges=[[0, 8]], submesh_shapes=[[1, 8]],
        logical_shapes=[[1, 8]], autosharding_option_dicts=[None],
    )  # fmt: skip
    pipeline["options"] = pipeline["options"][:1]
    pipeline["logical_meshes"] = pipeline["logical_meshes"][:1]
    pipeline["logical_meshes"][0]["shape"] = [1, 8]
    pipeline["objectives"] = pipeline["objectives"][:1]
    pipeline["stage_pins"] = pipeline["stage_pins"][:1]


def test_an_edited_pipeline_plan_names_the_field_it_contradicts(recorded, tmp_path):
    """A plan file whose stages disagree between its fields is refused when loaded, with
    the field, its value and what was expected (it was an ``IndexError`` in
    ``deferred_sums``, an ``AssertionError`` of the runtime emitter, or a stage's
    specs dropped without a word); edited consistently, it replays."""
    from conftest import plan_in_older_layout  # the replay subprocess runs this module

    with open(recorded["pipeshard_uniform"][1]) as f:
        text = f.read()
    path = tmp_path / "edited.json"
    where = r"'.*edited\.json': the pipeline_plan's "
    two = r"expected a stage in 0\.\.1 \(stage_plan\.device_ranges has 2 stages\)"

    def cut_device_ranges(_, stages):
        stages["device_ranges"] = stages["device_ranges"][:1]

    def pins_of_a_third_stage(pipeline, _):
        pipeline["stage_pins"].append(pipeline["stage_pins"][0])

    cases = {
        r"stage_plan\.layer_to_stage=\[0, 2\] puts layer 1 on stage 2: " + two: (
            lambda _, stages: stages.update(layer_to_stage=[0, 2])
        ),
        r"stage_plan\.logical_shapes has 2 entries but stage_plan\.device_ranges has 1 "
        r"\(one per stage\): expected 1": cut_device_ranges,
        r"stage_plan\.layer_to_stage=\[1, 0\] is not in order": (
            lambda _, stages: stages.update(layer_to_stage=[1, 0])
        ),
        r"stage_pins has 3 entries but stage_plan\.device_ranges has 2 \(one per stage\): "
        r"expected 2": pins_of_a_third_stage,
        r"stage 0 has stage_plan\.device_ranges\[0\]=\[0, 8\] \(8 devices\), "
        r"stage_plan\.submesh_shapes\[0\]=\[1, 4\] \(4 devices\), .*expected one number "
        r"of devices": lambda pipeline, stages: (
            _one_stage(pipeline, stages),
            stages.update(submesh_shapes=[[1, 4]]),
        ),
    }
    for message, edit in cases.items():
        path.write_text(_edited(text, edit))
        with pytest.raises(ValueError, match=where + message):
            ParallelPlan.load(path)
    # A plan in format 2's layout (its values' specs in a (ref, stage) table) naming a
    # stage the plan lacks is refused by name, as is one cut to one stage whose table
    # kept the second stage's rows.
    for stage in (5, 1):
        old = plan_in_older_layout(json.loads(text), 2)
        pipeline = old["pipeline_plan"]
        ref, _, spec = next(row for row in pipeline["stage_specs"] if row[1] == stage % 2)
        if stage == 5:
            pipeline["stage_specs"].append([ref, 5, spec])
            expected = two
        else:
            _one_stage(pipeline, pipeline["stage_plan"])
            expected = r"expected a stage in 0\.\.0 \(stage_plan\.device_ranges has 1 stage\)"
        path.write_text(json.dumps(old))
        with pytest.raises(ValueError, match=where + rf"stage_specs has an entry for "
                           rf"'{re.escape(ref)}' on stage {stage}: " + expected):  # fmt: skip
            ParallelPlan.load(path)
    # One in format 1's (the stages' records in three (ref, stage) tables too) likewise.
    old = plan_in_older_layout(json.loads(text), 1)
    partial_sum = {"operand_specs": [[None], [None]], "reduce_axes": ["y"]}
    old["pipeline_plan"]["partial_sums"].append(["an add", 5, partial_sum])
    path.write_text(json.dumps(old))
    with pytest.raises(ValueError, match=where + r"partial_sums has an entry for 'an add' on "
                       r"stage 5: " + two):  # fmt: skip
        ParallelPlan.load(path)
    # The same stages, consistently edited into one: replayed, as serial computes.
    path.write_text(_edited(text, _one_stage))
    state, batch, step = get_mlp_train_state_and_step(32, 16, num_layers=2)
    expected = jax.jit(step)(state, batch)
    method = alpa.plan_to_method(ParallelPlan.load(path))
    replayed = alpa.parallelize(step, method=method)
    assert_allclose(replayed(state, batch).params, expected.params, rtol=1e-5, atol=1e-6)
    assert replayed.get_last_executable().plan.stage_plan.device_ranges == ((0, 8),)


def test_pipeshard_plan_records_stages(recorded):
    plan = ParallelPlan.load(recorded["pipeshard_auto"][1])
    pipeline = plan.pipeline_plan
    assert plan.num_micro_batches == 2
    assert pipeline.pipeline_schedule == "1f1b"
    assert pipeline.layer_option == alpa.AutoLayerOption(layer_num=2)
    stages = pipeline.decisions.stage_plan
    assert stages.stage_layers() == [[0], [1]]
    assert stages.device_ranges == ((0, 4), (4, 8))
    assert len(pipeline.decisions.stage_pins) == 2
    assert all(pins.var_specs for pins in pipeline.decisions.stage_pins)
    # Stage 1's logical shapes (4, 1) and (1, 4) tie or nearly tie (its layer is one
    # matmul and the loss): the table must print whichever the plan recorded.
    assert stages.logical_shapes[0] == (4, 1)
    assert stages.logical_shapes[1] in ((4, 1), (1, 4))
    assert str(plan).splitlines()[2:] == [
        "stage  layers  devices  logical mesh",
        "0      [0]     0..3     (4, 1)",
        f"1      [1]     4..7     {stages.logical_shapes[1]}",
    ]


def test_a_plan_with_two_stages_on_one_mesh_keeps_them_there(recorded):
    """DualPipeV's two stages on one mesh: the plan records both on the same devices and
    the schedule, and the replay (the HLO test above, and here) places them alike."""
    plan = ParallelPlan.load(recorded["pipeshard_dualpipev"][1])
    assert plan.pipeline_plan.pipeline_schedule == "dualpipev"
    stages = plan.pipeline_plan.decisions.stage_plan
    assert stages.device_ranges == ((0, 8), (0, 8)) and stages.stage_meshes == (0, 0)
    step, args, _ = make_case("pipeshard_dualpipev")
    executable = alpa.parallelize(step, method=alpa.plan_to_method(plan)).get_executable(*args)
    assert executable.schedule.name == "dualpipev"
    assert executable.instructions.num_physical_meshes == 1


def test_plan_for_other_shapes_is_refused(recorded):
    state, batch, step = get_mlp_train_state_and_step(64, 16, num_layers=2)
    for name in ("data_parallel", "pipeshard_uniform"):
        method = alpa.plan_to_method(ParallelPlan.load(recorded[name][1]))
        with pytest.raises(
            ValueError,
            match=re.escape(
                "this ParallelPlan was made for another step (train_step): argument 1['x'] "
                "was float32[32, 16] there and is float32[64, 16] here. A plan replays only "
                "the step and input shapes it was recorded for; plan this step with a "
                "parallel method instead"
            ),
        ):
            alpa.parallelize(step, method=method).get_executable(state, batch)


def test_plan_for_another_function_is_refused(recorded):
    state, batch, step = get_mlp_train_state_and_step(32, 16, num_layers=2)

    def other_step(state, batch):  # same inputs, one more operation
        new_state = step(state, batch)
        return new_state.replace(params=jax.tree.map(lambda p: p * 2, new_state.params))

    method = alpa.plan_to_method(ParallelPlan.load(recorded["zero3"][1]))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "this ParallelPlan was made for another step (train_step): other_step has the "
            "same inputs but computes something else (its traced jaxpr differs)"
        ),
    ):
        alpa.parallelize(other_step, method=method).get_executable(state, batch)
    params, x = _chain_args()
    method = alpa.plan_to_method(ParallelPlan.load(recorded["ilp_2d"][1]))
    with pytest.raises(
        ValueError, match=re.escape("it has 2 input leaves, train_step is called with 16")
    ):
        alpa.parallelize(step, method=method).get_executable(state, batch)


def test_plan_for_other_donations_or_batch_says_which(recorded):
    state, batch, step = get_mlp_train_state_and_step(32, 16, num_layers=2)
    method = alpa.plan_to_method(ParallelPlan.load(recorded["zero3"][1]))
    with pytest.raises(
        ValueError,
        match=r"\(train_step\): train_step has the same inputs, but argument 0\S* is not "
        r"donated here and was donated when the plan was made \(donate_argnums differ\)",
    ):
        alpa.parallelize(step, method=method, donate_argnums=()).get_executable(state, batch)
    with pytest.raises(
        ValueError,
        match=r"argument 1\['x'\] is not split as the batch here and was split as the batch "
        r"when the plan was made \(batch_argnums differ\)",
    ):
        alpa.parallelize(step, method=method, batch_argnums=()).get_executable(state, batch)


def test_plan_on_other_devices_is_refused(recorded):
    step, args, _ = make_case("ilp_2d")
    method = alpa.plan_to_method(
        ParallelPlan.load(recorded["ilp_2d"][1]), devices=jax.devices()[:4]
    )
    with pytest.raises(
        ValueError,
        match=re.escape("the ParallelPlan of _chain was made for 8 devices but devices has 4"),
    ):
        alpa.parallelize(step, method=method).get_executable(*args)
    step, args, _ = make_case("pipeshard_uniform")
    method = alpa.plan_to_method(
        ParallelPlan.load(recorded["pipeshard_uniform"][1]), devices=jax.devices()[:4]
    )
    with pytest.raises(
        ValueError,
        match=re.escape(
            "the ParallelPlan of train_step was made for a cluster of 1 x 8 devices but "
            "devices is 1 x 4"
        ),
    ):
        alpa.parallelize(step, method=method).get_executable(*args)


def test_bad_plans_are_refused():
    with pytest.raises(TypeError, match=r"plan_to_method expects a ParallelPlan .*got str"):
        alpa.plan_to_method("plan.json")
    with pytest.raises(
        NewerFormatError, match=r"^the text is a ParallelPlan of format 7, newer than"
    ):
        ParallelPlan.from_json('{"format": 7}')
    for bad in ('"1"', "0", "true", "1.0"):
        with pytest.raises(
            ValueError,
            match=r"^the text is not a ParallelPlan this alpa reads: its 'format' is "
            rf".*, where a format version \(an int from 1 to {PLAN_FORMAT}\) was expected",
        ):
            ParallelPlan.from_json(f'{{"format": {bad}}}')
    with pytest.raises(ValueError, match=r"^the plan is not a ParallelPlan .*: it is a list"):
        ParallelPlan.from_dict([])


# ----------------------------------------------------------------------------- format versions


@pytest.mark.parametrize("name", ["ilp_2d", "pipeshard_auto"])
def test_a_plan_saved_without_its_format_field_still_loads(recorded, tmp_path, name):
    from conftest import plan_in_older_layout

    # A plan written before plans carried a format version: this code's plan, the field
    # removed. It reads as format 1 and is the same plan, ready to replay.
    with open(recorded[name][1]) as f:
        text = f.read()
    # Those plans have format 1's layout: a pipeline's stage pins in (ref, stage) tables.
    data = plan_in_older_layout(json.loads(text), 1)
    assert json.loads(text)["format"] == PLAN_FORMAT == 3
    del data["format"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data, indent=1))
    loaded = ParallelPlan.load(old)
    assert loaded.to_json() == text  # saved again, it carries the field
    assert loaded.fingerprint == ParallelPlan.from_json(text).fingerprint
    assert alpa.plan_to_method(loaded).parallel_plan is loaded


def test_a_plan_of_a_newer_format_is_refused_by_name(recorded, tmp_path):
    with open(recorded["pipeshard_uniform"][1]) as f:
        data = json.loads(f.read())
    data["format"] = PLAN_FORMAT + 1
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps(data))
    expected = re.escape(
        f"{str(newer)!r} is a ParallelPlan of format {PLAN_FORMAT + 1}, newer than this alpa "
        f"reads (format {PLAN_FORMAT} and older): it was saved by a newer alpa"
    )
    with pytest.raises(NewerFormatError, match=expected):
        ParallelPlan.load(newer)
    # The picture of a saved plan refuses it too, by the file's name.
    with pytest.raises(NewerFormatError, match=expected):
        draw_saved_plan(str(newer), str(tmp_path / "newer.png"))
    with pytest.raises(
        NewerFormatError, match=rf"^the text is a ParallelPlan of format {PLAN_FORMAT + 1}"
    ):
        ParallelPlan.from_json(json.dumps(data))
    # The control: the same file at this format loads.
    data["format"] = PLAN_FORMAT
    newer.write_text(json.dumps(data))
    assert ParallelPlan.load(newer).pipeline_plan is not None


def test_a_pipeline_plan_summary_carries_its_format():
    # PipeshardPlan.to_json, planned for the cpu preset from abstract arguments (no compile).
    model = MLPModel(hidden_size=32, num_layers=2, output_dim=32)
    state, batch, step = get_mlp_model_step(
        model, 16, 32, grad_func=alpa.value_and_grad, abstract=True
    )
    method = alpa.PipeshardParallel(
        devices=ClusterSpec.preset("cpu"),
        num_micro_batches=2,
        layer_option=alpa.AutoLayerOption(layer_num=2),
        stage_option="uniform",
    )
    plan = alpa.parallelize(step, method=method).plan(state, batch)
    text = plan.to_json()
    data = PipeshardPlan.from_json(text)
    assert data["format"] == SUMMARY_FORMAT == 1 and data == plan.summary()
    del data["format"]  # a summary written before the field existed
    assert PipeshardPlan.from_json(json.dumps(data))["stages"] == plan.summary()["stages"]
    data["format"] = SUMMARY_FORMAT + 1
    with pytest.raises(
        NewerFormatError,
        match=re.escape(
            "'summary.json' is a PipeshardPlan summary of format 2, newer than this alpa "
            "reads (format 1 and older)"
        ),
    ):
        PipeshardPlan.from_json(json.dumps(data), source="'summary.json'")


def test_a_plan_pickles_as_alpas_scripts_save_it():
    """Alpa's scripts pickle ``executable.get_parallel_plan()`` and replay it with
    ``plan_to_method``: the plan holds no device or mesh handle."""
    import pickle

    from alpa.testing import get_mlp_train_state_and_step

    alpa.init("local")
    state, batch, step = get_mlp_train_state_and_step(16, 8, num_layers=2)
    option = alpa.AutoShardingOption(force_data_parallel=True)
    executable = alpa.parallelize(
        step, method=alpa.ShardParallel(auto_sharding_option=option)
    ).get_executable(state, batch)
    plan = pickle.loads(pickle.dumps(executable.get_parallel_plan()))
    assert plan.sharding_plan.logical_mesh.physical_mesh is None
    replayed = alpa.parallelize(step, method=alpa.plan_to_method(plan))
    specs = replayed.get_executable(state, batch).get_input_placement_specs()
    assert specs == executable.get_input_placement_specs()
