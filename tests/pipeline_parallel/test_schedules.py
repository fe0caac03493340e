"""Schedule invariants: every task once, dependency order, 1F1B memory bound, tick counts."""

import itertools

import pytest

from alpa.pipeline_parallel.scheduling.plan_view import timeline
from alpa.pipeline_parallel.scheduling.schedule_record import Task
from alpa.pipeline_parallel.scheduling.schedules import (
    make_schedule,
    schedules,
    task_dependencies,
)

SIZES = list(itertools.product([1, 2, 3, 4], [1, 2, 3, 8]))


def _tick_of(schedule):
    tick_of = {}
    for t, tick in enumerate(schedule.ticks):
        stages = [task.stage for task in tick]
        assert len(stages) == len(set(stages)), f"two tasks of one stage in tick {t}"
        meshes = [schedule.mesh_of(task.stage) for task in tick if task.kind != "apply"]
        assert len(meshes) == len(set(meshes)), f"two tasks of one mesh in tick {t}"
        for task in tick:
            assert task not in tick_of, f"{task} runs twice"
            tick_of[task] = t
    return tick_of


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S,M", SIZES)
def test_training_schedule_runs_each_task_once_in_order(name, S, M):
    schedule = make_schedule(name, S, M)
    tick_of = _tick_of(schedule)
    expected = {
        Task(s, m, k) for s in range(S) for m in range(M) for k in ("forward", "backward")
    } | {Task(s, None, "apply") for s in range(S)}
    assert set(tick_of) == expected
    for task, tick in tick_of.items():
        for dep in task_dependencies(task, S):
            assert tick_of[dep] < tick, f"{task} at tick {tick} before its input {dep}"
        if task.kind == "apply":
            assert tick == schedule.num_ticks - 1
    # The known tick counts: 2 (M + S - 1) compute ticks plus one apply tick.
    assert schedule.num_ticks == 2 * (M + S - 1) + 1


@pytest.mark.parametrize("S,M", SIZES)
def test_1f1b_holds_at_most_s_minus_i_micro_batches(S, M):
    peaks = make_schedule("1f1b", S, M).max_in_flight()
    for i, peak in enumerate(peaks):
        assert peak <= S - i
        assert peak == min(S - i, M)
    assert make_schedule("gpipe", S, M).max_in_flight() == [M] * S


@pytest.mark.parametrize("S,M", SIZES)
def test_inference_schedule(S, M):
    schedule = make_schedule("inference", S, M)
    tick_of = _tick_of(schedule)
    assert set(tick_of) == {Task(s, m, "forward") for s in range(S) for m in range(M)}
    for task, tick in tick_of.items():
        assert tick == task.stage + task.micro_batch
    assert schedule.num_ticks == M + S - 1


def test_grid_prints_every_task():
    schedule = make_schedule("1f1b", 2, 3)
    text = str(schedule)
    assert text.splitlines()[0] == "1f1b: 2 stages x 3 micro-batches"
    rows = text.splitlines()[2:]
    assert [r.split("|")[1].split() for r in rows] == [
        ["F0", "F1", ".", "B0", "F2", "B1", ".", "B2", "A"],
        [".", "F0", "B0", "F1", "B1", "F2", "B2", ".", "A"],
    ]


@pytest.mark.parametrize("S,M", SIZES)
def test_zb_h1_runs_f_b_w_of_each_micro_batch_once_in_order(S, M):
    schedule = make_schedule("zb-h1", S, M)
    tick_of = _tick_of(schedule)
    kinds = ("forward", "backward", "weight")
    expected = {Task(s, m, k) for s in range(S) for m in range(M) for k in kinds}
    assert set(tick_of) == expected | {Task(s, None, "apply") for s in range(S)}
    for task, tick in tick_of.items():
        for dep in task_dependencies(task, S):
            assert tick_of[dep] < tick, f"{task} at tick {tick} before its input {dep}"
    # Stage s runs the W of micro-batch m only after the B of micro-batch m + s.
    for s, m in itertools.product(range(S), range(M)):
        later = Task(s, min(m + s, M - 1), "backward")
        assert tick_of[Task(s, m, "weight")] > tick_of[later]


@pytest.mark.parametrize("S", [2, 4])
@pytest.mark.parametrize("M", [4, 8, 16])
def test_zb_h1_bubble_and_memory_are_the_closed_forms(S, M):
    """The docstring's closed forms (every task one tick): 3 M + S - 1 compute ticks, a
    bubble fraction of (S - 1) / (3 M + S - 1) counted on the grid, and min(S, M)
    micro-batches in flight on every stage; in time units (a forward 1, a backward 2),
    3 M + S - 1 against 1F1B's 3 M + 3 (S - 1)."""
    schedule = make_schedule("zb-h1", S, M)
    ticks = schedule.num_ticks - 1  # less the apply tick
    assert ticks == 3 * M + S - 1
    busy = sum(1 for tick in schedule.ticks[:-1] for _ in tick)
    assert busy == 3 * M * S
    assert (ticks * S - busy) / (ticks * S) == pytest.approx((S - 1) / (3 * M + S - 1))
    assert schedule.max_in_flight() == [min(S, M)] * S
    # The same in time, with a backward twice a forward (plan_view's timeline): ZB-H1's
    # B and W one unit each, 1F1B's backward one task of two units.
    for name, expected in (("zb-h1", 3 * M + S - 1), ("1f1b", 3 * M + 3 * (S - 1))):
        blocks = timeline(make_schedule(name, S, M), [3.0] * S, forward_share=1 / 3)
        makespan = max(b.end for b in blocks if b.kind != "apply")
        assert makespan == pytest.approx(expected), name


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("M", [4, 8, 16])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_1f1b_bubble_and_memory_are_the_closed_forms(p, M, v):
    """Interleaved 1F1B, v p stages on p meshes (stage i on mesh i mod p), every chunk task
    one tick: each task once, after its inputs, one task per mesh per tick;
    2 v M + 2 (p - 1) compute ticks, a bubble fraction of (p - 1) / (v M + p - 1) counted
    on the grid; mesh d holds min(2 (p - d - 1) + (v - 1) p + 1, v M) chunks in flight.
    In time (a chunk 1/v of a 1F1B stage, a backward twice a forward): 3 M + 3 (p - 1) / v
    against 1F1B's 3 M + 3 (p - 1) on p stages."""
    S = v * p
    schedule = make_schedule("interleaved-1f1b", S, M, num_meshes=p)
    assert schedule.num_meshes == p
    assert [schedule.mesh_of(s) for s in range(S)] == [s % p for s in range(S)]
    tick_of = _tick_of(schedule)
    expected = {Task(s, m, k) for s in range(S) for m in range(M) for k in ("forward", "backward")}
    assert set(tick_of) == expected | {Task(s, None, "apply") for s in range(S)}
    for task, tick in tick_of.items():
        for dep in task_dependencies(task, S):
            assert tick_of[dep] < tick, f"{task} at tick {tick} before its input {dep}"
    ticks = schedule.num_ticks - 1
    assert ticks == 2 * v * M + 2 * (p - 1)
    busy = sum(1 for tick in schedule.ticks[:-1] for _ in tick)
    assert busy == 2 * v * M * p
    assert (ticks * p - busy) / (ticks * p) == pytest.approx((p - 1) / (v * M + p - 1))
    bound = [min(2 * (p - d - 1) + (v - 1) * p + 1, v * M) for d in range(p)]
    assert schedule.max_in_flight_per_mesh() == bound
    blocks = timeline(schedule, [3.0 / v] * S, forward_share=1 / 3)
    assert {b.mesh for b in blocks} == set(range(p))
    makespan = max(b.end for b in blocks if b.kind != "apply")
    assert makespan == pytest.approx(3 * M + 3 * (p - 1) / v)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("M", [4, 8, 16])
def test_dualpipev_bubble_and_memory_are_the_closed_forms(p, M):
    """DualPipeV, 2 p stages on p meshes in a V (stage i on mesh min(i, 2 p - 1 - i)),
    every task one tick: each F, B and W once (stage 0 keeps its backward whole), after its
    inputs, one task per mesh per tick; 6 M + p - 1 compute ticks, each mesh but mesh 0
    busy 6 M of them (bubble (p - 1) / (6 M + p - 1)); stage i holds 2 p - i micro-batches
    at its peak, each mesh 2 p + 1; in time 3 M + (p - 1) / 2 units, ZB-H1 on p stages
    3 M + (p - 1). M < 2 p is refused."""
    S = 2 * p
    if M < S:
        with pytest.raises(ValueError, match=f"must be at least {S}"):
            make_schedule("dualpipev", S, M)
        return
    schedule = make_schedule("dualpipev", S, M, num_meshes=p)
    assert [schedule.mesh_of(s) for s in range(S)] == [min(s, S - 1 - s) for s in range(S)]
    tick_of = _tick_of(schedule)
    expected = {Task(s, m, k) for s in range(S) for m in range(M) for k in ("forward", "backward")}
    expected |= {Task(s, m, "weight") for s in range(1, S) for m in range(M)}
    assert set(tick_of) == expected | {Task(s, None, "apply") for s in range(S)}
    for task, tick in tick_of.items():
        for dep in task_dependencies(task, S):
            assert tick_of[dep] < tick, f"{task} at tick {tick} before its input {dep}"
    ticks = schedule.num_ticks - 1
    assert ticks == 6 * M + p - 1
    busy = [0] * p
    for tick in schedule.ticks[:-1]:
        for task in tick:
            busy[schedule.mesh_of(task.stage)] += 1
    assert busy == [5 * M] + [6 * M] * (p - 1)
    assert (ticks - busy[1]) / ticks == pytest.approx((p - 1) / (6 * M + p - 1))
    assert schedule.max_in_flight() == [S - i for i in range(S)]
    assert schedule.max_in_flight_per_mesh() == [2 * p + 1] * p
    blocks = timeline(schedule, [1.5] * S, forward_share=1 / 3)
    assert max(b.end for b in blocks if b.kind != "apply") == pytest.approx(3 * M + (p - 1) / 2)
    zb = timeline(make_schedule("zb-h1", p, M), [3.0] * p, forward_share=1 / 3)
    assert max(b.end for b in zb if b.kind != "apply") == pytest.approx(3 * M + p - 1)


def test_interleaved_grid_and_bad_sizes():
    schedule = make_schedule("interleaved-1f1b", 4, 2, num_meshes=2)
    lines = str(schedule).splitlines()
    assert lines[0] == "interleaved-1f1b: 4 stages x 2 micro-batches on 2 meshes"
    assert lines[2].split("|")[1].split()[:4] == ["F0:0", "F1:0", "F0:2", "F1:2"]
    assert make_schedule("interleaved-1f1b", 4, 2).num_meshes == 2  # v = 2 by default
    with pytest.raises(ValueError, match=r"num_micro_batches \(6\) must be a multiple of the "):
        make_schedule("interleaved-1f1b", 8, 6, num_meshes=4)
    with pytest.raises(ValueError, match=r"num_stages \(6\) must be a multiple of num_meshes"):
        make_schedule("interleaved-1f1b", 6, 4, num_meshes=4)
    with pytest.raises(ValueError, match="'1f1b' runs one stage per mesh, but 4 stages were"):
        make_schedule("1f1b", 4, 4, num_meshes=2)
    with pytest.raises(ValueError, match=r"num_stages \(6\) must be twice num_meshes"):
        make_schedule("dualpipev", 6, 8, num_meshes=2)


def test_registry_and_bad_names():
    assert set(schedules) == {
        "gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "dualpipev", "inference"
    }  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"unknown pipeline_schedule 'zero_bubble'; "
        r"expected one of \['1f1b', 'dualpipev', 'gpipe', 'inference', 'interleaved-1f1b', "
        r"'zb-h1'\] or 'auto'",
    ):
        make_schedule("zero_bubble", 2, 2)
    with pytest.raises(ValueError, match="num_micro_batches must be a positive int, got 0"):
        make_schedule("gpipe", 2, 0)


def test_alpas_schedule_classes_read_the_same_schedules():
    from alpa.pipeline_parallel.scheduling.schedules import (
        GpipeSchedule,
        PipeDreamFlush,
        gen_linear_pipeline_dependency,
    )

    deps = gen_linear_pipeline_dependency(6)  # 3 meshes: forward 0-2, backward 3-5
    assert deps[1, 0] == deps[5, 0] == deps[4, 1] == 1 and deps[0].sum() == 0
    apply = {6: 0, 7: 1, 8: 2}
    gpipe = GpipeSchedule(
        dependency=deps, meshes=[None] * 3, apply_grad_placement=apply, num_batch=4
    )
    assert gpipe.num_clock == 2 * (3 + 4 - 1) + 1
    assert gpipe.schedules[0] == [(0, 0), None, None]
    assert gpipe.schedules[-1] == [(0, 6), (0, 7), (0, 8)]
    assert gpipe.stage_placement(4) == {1} and gpipe.mesh_placement(2) == {2, 3, 8}
    flush = PipeDreamFlush(
        dependency=deps, meshes=[None] * 3, apply_grad_placement=apply, num_batch=4
    )
    assert flush.num_clock == gpipe.num_clock
    # 1F1B: mesh i never holds more than 3 - i micro-batches of activations.
    in_flight, peak = [0, 0, 0], [0, 0, 0]
    for clock in flush.schedules:
        for mesh, task in enumerate(clock):
            if task is not None and task[1] < 6:
                in_flight[mesh] += 1 if task[1] < 3 else -1
                peak[mesh] = max(peak[mesh], in_flight[mesh])
    assert peak == [3, 2, 1]
    with pytest.raises(ValueError, match="the dependency has 6 stages but there are 2 meshes"):
        GpipeSchedule(dependency=deps, meshes=[None] * 2, apply_grad_placement={}, num_batch=1)
