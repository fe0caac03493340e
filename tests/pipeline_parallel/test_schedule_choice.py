"""``pipeline_schedule="auto"``: each training schedule priced on the plan's stages, the
fastest that fits memory chosen (``schedule_choice``), against closed forms and against
the plans of each schedule named by hand."""

import pytest

import alpa
from alpa.device_mesh import ClusterSpec
from alpa.pipeline_parallel.scheduling.schedule_choice import CANDIDATES, choose, price_schedules

S, M, T = 4, 8, 3.0  # stages, micro-batches, seconds per micro-batch on every stage


def _priced(budget: float):
    memory = [100.0 + 10 * s for s in range(S)]  # 1F1B's bytes per device
    activation = [10.0] * S  # bytes per micro-batch in flight
    return {c.name: c for c in price_schedules([T] * S, memory, activation, M, budget)}


def test_candidates_are_the_closed_forms():
    """Uniform stages of latency T (a forward T/3, a backward 2T/3): GPipe and 1F1B take
    (M + S - 1) T, ZB-H1 (3 M + S - 1) T / 3. Memory: 1F1B's, plus the activations of
    the micro-batches the schedule holds beyond 1F1B's min(S - s, M) on stage s: M for
    GPipe, min(S, M) for ZB-H1."""
    priced = _priced(budget=1e9)
    assert list(priced) == list(CANDIDATES)
    assert priced["gpipe"].seconds == pytest.approx((M + S - 1) * T)
    assert priced["1f1b"].seconds == pytest.approx((M + S - 1) * T)
    assert priced["zb-h1"].seconds == pytest.approx((3 * M + S - 1) * T / 3)
    for s in range(S):
        base = 100.0 + 10 * s
        assert priced["1f1b"].memory[s] == base
        assert priced["gpipe"].memory[s] == base + 10 * (M - min(S - s, M))
        assert priced["zb-h1"].memory[s] == base + 10 * (min(S, M) - min(S - s, M))


def test_the_fastest_that_fits_is_chosen():
    priced = _priced(budget=1e9)
    assert choose(list(priced.values())).name == "zb-h1"
    # ZB-H1 holds 30 more bytes on the last stage (160 against 1F1B's 130): a budget of
    # 150 leaves 1F1B, and between the equally fast 1F1B and GPipe the one that holds less.
    priced = _priced(budget=150.0)
    assert [c.name for c in priced.values() if c.fits] == ["1f1b"]
    assert choose(list(priced.values())).name == "1f1b"
    # Nothing fits: the one that holds the least, marked as not fitting.
    priced = _priced(budget=50.0)
    chosen = choose(list(priced.values()))
    assert chosen.name == "1f1b" and not chosen.fits


def _gpt_plan(schedule: str, budget: float | None = None):
    from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step

    config = GPTConfig(
        seq_len=16,
        vocab_size=64,
        hidden_size=32,
        num_layers=S,
        num_heads=2,
        add_manual_pipeline_markers=True,
    )
    state, batch, step = get_gpt_train_state_and_step(
        config, 32, grad_func=alpa.value_and_grad, abstract=True
    )
    option = alpa.AutoShardingOption(memory_budget_per_device=budget) if budget else None
    method = alpa.PipeshardParallel(
        devices=ClusterSpec.preset("cpu"),
        num_micro_batches=M,
        pipeline_schedule=schedule,
        layer_option="manual",
        stage_option=alpa.UniformStageOption(num_stages=S),
        default_auto_sharding_option=option,
    )
    return alpa.parallelize(step, method=method).plan(state, batch)


SHARED = ("dualpipev", "interleaved-1f1b")


def test_auto_on_a_gpt_plan_is_no_worse_than_any_schedule_and_says_why():
    """4 one-block GPT stages on 4 meshes of 2 devices, 8 micro-batches, no device: "auto"
    prices GPipe, 1F1B and ZB-H1 on these stages, and interleaved 1F1B and DualPipeV on 4
    stages on 2 meshes of 4 devices (``candidate_stages``); it takes the fastest that
    fits (DualPipeV here, then ZB-H1, both faster than 1F1B); the plan lists every
    candidate (its table too), and each candidate's time is that of the plan made with
    the schedule (and, for the shared-mesh ones, the stages) named by hand. With a memory
    budget that only 1F1B's peak fits under, "auto" takes 1F1B."""
    auto = _gpt_plan("auto")
    candidates = {c.name: c for c in auto.schedule_candidates}
    assert list(candidates) == list(CANDIDATES) + list(SHARED)
    assert all(c.fits for c in candidates.values())
    fastest = min(candidates.values(), key=lambda c: c.seconds)
    assert auto.schedule.name == fastest.name == "dualpipev"
    assert candidates["zb-h1"].seconds < candidates["1f1b"].seconds
    assert auto.stage_plan.stage_meshes == (0, 1, 1, 0)
    assert [tuple(s) for s in auto.stage_plan.submesh_shapes] == [(1, 4)] * 4
    for name in CANDIDATES:
        by_hand = _gpt_plan(name)
        latencies = by_hand.stage_plan.latencies or by_hand.cost.latencies
        again = price_schedules(
            latencies,
            by_hand.cost.memory,
            by_hand.cost.activation_memory,
            M,
            by_hand.memory_budget(),
            [name],
        )
        assert again[0].seconds == pytest.approx(candidates[name].seconds), name
    for name in SHARED:  # 2 stages per mesh of 4 devices, UniformStageOption's split
        assert candidates[name].note == "4 stages on 2 meshes of 1x4"
        assert _gpt_plan(name).cost.step_seconds == pytest.approx(candidates[name].seconds)
    assert auto.cost.step_seconds == pytest.approx(candidates["dualpipev"].seconds)
    table = auto.format_table()
    assert "pipeline_schedule='auto' chose dualpipev" in table
    title = table.splitlines()[0]  # the chosen schedule's seconds beside its name
    assert title.endswith(f"dualpipev, predicted {auto.predicted_cost * 1e3:.3f} ms/step")
    assert auto.predicted_cost == pytest.approx(candidates["dualpipev"].seconds)
    assert all(f"  {c.line()}" in table for c in auto.schedule_candidates)
    summary = auto.summary()
    assert [c["name"] for c in summary["schedule_candidates"]] == list(CANDIDATES) + list(SHARED)
    # A budget between 1F1B's peak and every other's.
    peaks = {name: max(c.memory) for name, c in candidates.items()}
    others = min(peak for name, peak in peaks.items() if name != "1f1b")
    assert peaks["1f1b"] < others
    tight = _gpt_plan("auto", budget=(peaks["1f1b"] + others) / 2)
    fits = {c.name: c.fits for c in tight.schedule_candidates}
    assert tight.schedule.name == "1f1b"
    assert fits == {name: name == "1f1b" for name in list(CANDIDATES) + list(SHARED)}
    # 1F1B's candidate memory is the plan's own model memory, as plan.cost says.
    one_f_one_b = next(c for c in tight.schedule_candidates if c.name == "1f1b")
    assert one_f_one_b.memory == tuple(tight.cost.memory)


def test_balanced_cuts_are_the_exhaustive_optimum():
    """``candidate_stages.balanced_cuts``: every cut of up to 7 layers into k contiguous
    groups searched; the DP's largest group sum is the least, and its groups are
    contiguous, non-empty and cover the layers in order."""
    import itertools

    from alpa.pipeline_parallel.stages.candidate_stages import balanced_cuts

    flops = [5.0, 1.0, 3.0, 8.0, 2.0, 2.0, 6.0]
    for L in range(1, len(flops) + 1):
        for k in range(1, L + 1):
            groups = balanced_cuts(flops[:L], k)
            assert [i for g in groups for i in g] == list(range(L)) and all(groups)
            best = min(
                max(sum(flops[a:b]) for a, b in zip((0, *cuts), (*cuts, L), strict=True))
                for cuts in itertools.combinations(range(1, L), k - 1)
            )
            assert max(sum(flops[i] for i in g) for g in groups) == best
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 non-empty stages"):
        balanced_cuts([1.0, 1.0], 3)


def test_shared_mesh_schedules_that_do_not_apply_are_reported_not_chosen():
    """Interleaved 1F1B needs M a multiple of the meshes, DualPipeV M >= 2 p: a candidate
    that cannot run says why in its line, and is never chosen, even when nothing fits (its
    memory is unknown, not zero)."""
    from alpa.pipeline_parallel.stages.candidate_stages import _not_applicable, _refusal

    assert _refusal("interleaved-1f1b", 2, 6) == _refusal("dualpipev", 2, 6) == ""
    assert _refusal("interleaved-1f1b", 2, 3) == "3 micro-batches are not a multiple of 2 meshes"
    assert _refusal("dualpipev", 2, 3) == "3 micro-batches are fewer than 2 x 2 meshes"
    refused = _not_applicable("dualpipev", _refusal("dualpipev", 2, 3))
    reason = "3 micro-batches are fewer than 2 x 2 meshes"
    assert refused.line() == f"dualpipev: not applicable: {reason}"
    assert not refused.applicable and not refused.fits
    nothing_fits = price_schedules([T] * S, [1.0] * S, [1.0] * S, M, budget=0.5)
    chosen = choose([*nothing_fits, refused])
    assert chosen.name == "1f1b" and not chosen.fits


def _dp_gpt_plan(schedule: str):
    """An 8-layer GPT (hidden 2048, 1024 tokens, batch 128) for 2 x 8 A100-40GB, 32
    micro-batches, automatic layers and stages: GPipe's 32 micro-batches in flight do not
    fit on the stages the DP picks under 1F1B."""
    from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step

    config = GPTConfig(seq_len=1024, vocab_size=1024, hidden_size=2048, num_layers=8, num_heads=16)
    state, batch, step = get_gpt_train_state_and_step(
        config, 128, grad_func=alpa.value_and_grad, abstract=True
    )
    method = alpa.PipeshardParallel(
        devices=ClusterSpec.preset("a100-40gb", num_nodes=2),
        num_micro_batches=32,
        pipeline_schedule=schedule,
        layer_option=alpa.AutoLayerOption(layer_num=8),
        stage_option="auto",
    )
    return alpa.parallelize(step, method=method).plan(state, batch)


def test_the_stage_dp_prices_each_schedule():
    """The stage DP under GPipe keeps all 32 micro-batches within memory (stage_dp): the
    1F1B stages hold more than 40 GB under GPipe, the DP's own GPipe stages fit, and
    "auto" lists both; a plan made with pipeline_schedule="gpipe" takes the GPipe stages
    and its cost holds 32 micro-batches in flight within the budget. "auto" takes the
    fastest that fits (ZB-H1 here, replayed on the 1F1B stages), and predicts its time."""
    from alpa.pipeline_parallel.stages.stage_search import stages_for_schedule

    auto = _dp_gpt_plan("auto")
    gpipe = [c for c in auto.schedule_candidates if c.name == "gpipe"]
    on_1f1b, own = gpipe
    assert not on_1f1b.fits and own.fits and own.note.startswith("the stage DP's")
    budget = auto.memory_budget()
    assert max(on_1f1b.memory) > budget >= max(own.memory)
    fitting = [c for c in auto.schedule_candidates if c.fits]
    assert auto.schedule.name == min(fitting, key=lambda c: c.seconds).name == "zb-h1"
    assert auto.predicted_cost == min(c.seconds for c in fitting)  # the headline figure
    by_hand = _dp_gpt_plan("gpipe")
    assert f"the stage DP's {by_hand.num_stages} stages under gpipe" == own.note
    assert by_hand.num_stages != auto.num_stages
    assert all(by_hand.cost.fits) and max(by_hand.cost.memory) <= budget
    # Under 1F1B the DP's stages are the plan's own.
    plan_1f1b = _dp_gpt_plan("1f1b")
    assert stages_for_schedule(plan_1f1b.stage_plan, "1f1b") is plan_1f1b.stage_plan
    assert stages_for_schedule(plan_1f1b.stage_plan, "gpipe").stage_layers() == (
        by_hand.stage_plan.stage_layers()
    )
