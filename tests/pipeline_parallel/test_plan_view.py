"""Pictures of a plan (``plan_view``): the timeline against closed forms, and the
rendered image checked by its size and the blocks drawn, counted from the plan."""

import struct
import subprocess
import sys

import pytest

import alpa
from alpa.device_mesh import ClusterSpec
from alpa.model.mlp import MLPModel, get_mlp_train_state_and_step
from alpa.pipeline_parallel.scheduling.plan_view import APPLY_WIDTH, timeline
from alpa.pipeline_parallel.scheduling.schedules import make_schedule
from alpa.plan_view import draw_saved_plan
from alpa.record.parallel_plan import ParallelPlan

matplotlib = pytest.importorskip("matplotlib")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S, M", [(2, 4), (4, 4), (4, 8), (4, 16)])
def test_equal_stages_take_m_plus_s_minus_1_latencies(name, S, M):
    # Forward L/3, backward 2L/3 on every stage: both schedules finish their last
    # backward after (M + S - 1) L (GPipe's and 1F1B's bubble is (S - 1) L), then apply.
    L = 3.0
    blocks = timeline(make_schedule(name, S, M), [L] * S)
    compute = [b for b in blocks if b.kind != "apply"]
    assert max(b.end for b in compute) == pytest.approx((M + S - 1) * L)
    assert max(b.end for b in blocks) == pytest.approx((M + S - 1 + APPLY_WIDTH) * L)
    # No stage runs two blocks at once, and each reads what it depends on after it ends.
    for s in range(S):
        mine = sorted((b.start, b.end) for b in blocks if b.stage == s)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(mine, mine[1:], strict=False))
    ends = {(b.stage, b.kind, b.micro_batch): b.end for b in blocks}
    for b in compute:
        if b.kind == "forward" and b.stage > 0:
            assert b.start >= ends[(b.stage - 1, "forward", b.micro_batch)] - 1e-12
        if b.kind == "backward" and b.stage < S - 1:
            assert b.start >= ends[(b.stage + 1, "backward", b.micro_batch)] - 1e-12


def test_the_slowest_stage_sets_the_pace():
    # Stage 2 twice as slow (F = L/3, B = 2L/3: F = 1, 1, 2, 1 and B = 2, 2, 4, 2) under
    # GPipe: the fill to it (F0 + F1 = 2), its M forwards and M backwards (M * 6), the wait
    # for stage 3's last forward and first backward (1 + 2), the drain (B1 + B0 = 4).
    S, M = 4, 8
    latencies = [3.0, 3.0, 6.0, 3.0]
    blocks = timeline(make_schedule("gpipe", S, M), latencies)
    end = max(b.end for b in blocks if b.kind != "apply")
    assert end == pytest.approx(2 + M * 6.0 + 3 + 4)
    with pytest.raises(ValueError, match="latencies has 3 entries but the schedule has 4"):
        timeline(make_schedule("gpipe", S, M), latencies[:3])


def _plan(S=4, M=4, schedule="1f1b"):
    model = MLPModel(hidden_size=64, num_layers=3, output_dim=64)
    state, batch, step = get_mlp_train_state_and_step(
        model, 8 * M, 64, grad_func=alpa.value_and_grad, abstract=True
    )
    shared = schedule in ("interleaved-1f1b", "dualpipev")
    method = alpa.PipeshardParallel(
        devices=ClusterSpec.preset("cpu"),
        num_micro_batches=M,
        layer_option=alpa.AutoLayerOption(layer_num=4),
        stage_option=alpa.UniformStageOption(S) if shared else "auto",
        pipeline_schedule=schedule,
    )
    return alpa.parallelize(step, method=method).plan(state, batch)


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_a_plan_draws_its_devices_and_every_task(tmp_path):
    plan = _plan()
    path = tmp_path / "plan.png"
    drawing = plan.draw(str(path), dpi=50)
    S, M = plan.stage_plan.num_stages, plan.num_micro_batches
    assert _png_size(path) == (drawing.width_px, drawing.height_px) == (600, drawing.height_px)
    assert drawing.height_px == int(round((1.2 + 0.5 * max(S, 1)) * 50))
    assert drawing.blocks == {"forward": S * M, "backward": S * M, "apply": S}
    assert drawing.devices == sum(b - a for a, b in plan.stage_plan.device_ranges)
    # The timeline is the predicted latencies run through the schedule.
    blocks = timeline(plan.schedule, plan.stage_plan.latencies)
    assert drawing.makespan == pytest.approx(max(b.end for b in blocks))


def test_stages_that_share_meshes_draw_one_row_per_mesh(tmp_path):
    """DualPipeV's 4 stages on 2 meshes of 4 devices, saved and drawn from the command
    line: one timeline row per mesh (the picture's height), every F, B, W (stages 1-3)
    and apply block, each of the 8 devices once."""
    S, M, p = 4, 4, 2
    plan = _plan(S=S, M=M, schedule="dualpipev")
    drawing = plan.draw(str(tmp_path / "v.png"), dpi=50)
    assert drawing.height_px == int(round((1.2 + 0.5 * p) * 50))
    assert drawing.blocks == {"forward": S * M, "backward": S * M, "weight": (S - 1) * M,
                              "apply": S}  # fmt: skip
    assert drawing.devices == 8
    blocks = timeline(plan.schedule, plan.cost.latencies)
    assert {b.row for b in blocks} == {0, 1}
    assert drawing.makespan == pytest.approx(max(b.end for b in blocks))
    saved = tmp_path / "v.json"
    ParallelPlan.from_pipeshard_plan(plan).save(str(saved))
    again = draw_saved_plan(str(saved), str(tmp_path / "v.svg"))
    assert again.blocks == drawing.blocks and again.height_px == 2 * drawing.height_px


def test_a_saved_plan_draws_from_the_command_line(tmp_path):
    plan = _plan(S=4, M=8)
    saved = tmp_path / "plan.json"
    ParallelPlan.from_pipeshard_plan(plan).save(str(saved))
    out = tmp_path / "plan.svg"
    result = subprocess.run(
        [sys.executable, "-m", "alpa.plan_view", str(saved), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    svg = out.read_text()
    S, M = plan.stage_plan.num_stages, 8
    assert svg.count('id="task-forward') == S * M
    assert svg.count('id="task-backward') == S * M
    assert svg.count('id="task-apply') == S
    assert "wrote" in result.stdout
    # A one-mesh plan is refused, naming the file.
    one_mesh = tmp_path / "one.json"
    one = ParallelPlan.from_pipeshard_plan(plan).to_json()
    one_mesh.write_text(one.replace('"pipeline_plan"', '"pipeline_plan_"'))
    bad = subprocess.run(
        [sys.executable, "-m", "alpa.plan_view", str(one_mesh), str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "plan_view:" in bad.stderr


def test_the_last_step_draws_as_it_ran_next_to_the_plan(tmp_path):
    # A real run on the 8 CPU devices: each instruction of the step one block on its mesh,
    # in the order the local runtime ran them (each waited for, so none overlaps the next).
    import jax

    S, M = 2, 4
    model = MLPModel(hidden_size=64, num_layers=3, output_dim=64)
    state, batch, step = get_mlp_train_state_and_step(
        model, 8 * M, 64, grad_func=alpa.value_and_grad
    )
    method = alpa.PipeshardParallel(
        num_micro_batches=M,
        layer_option=alpa.AutoLayerOption(layer_num=4),
        stage_option=alpa.UniformStageOption(num_stages=S),
    )
    parallel = alpa.parallelize(step, method=method)
    executable = parallel.get_executable(state, batch)
    with pytest.raises(RuntimeError, match="no step has run yet"):
        executable.draw_last_step(str(tmp_path / "none.png"))
    state, _ = jax.block_until_ready(parallel(state, batch))  # it donates the state
    assert parallel.get_last_executable() is executable
    executable.collect_trace = True
    jax.block_until_ready(parallel(state, batch))
    planned = executable.plan.draw(str(tmp_path / "planned.png"), dpi=50)
    ran = executable.draw_last_step(str(tmp_path / "ran.png"), dpi=50)
    assert _png_size(tmp_path / "ran.png") == (ran.width_px, ran.height_px)
    instructions = executable.instructions.instructions
    runs = [i for i in instructions if i.op == "RUN"]
    kinds = [
        executable.program.computations[
            executable.instructions.kernels[i.computation].computation
        ].kind
        for i in runs
    ]
    assert ran.blocks == {
        "forward": kinds.count("forward"),
        "backward": kinds.count("backward"),
        "apply": kinds.count("apply"),
        "transfer": len(instructions) - len(runs),
    }
    assert ran.blocks["forward"] == ran.blocks["backward"] == S * M == planned.blocks["forward"]
    events = executable.runtime.events
    assert ran.makespan == pytest.approx(max(e.end for e in events) - events[0].start)
    assert all(a.end <= b.start for a, b in zip(events, events[1:], strict=False))
