"""``pipeline_schedule="auto"``: each training schedule priced on the plan's stages, the
fastest that fits memory chosen (``schedule_choice``), against closed forms and against
the plans of each schedule named by hand."""

import pytest

import alpa
from alpa.device_mesh import ClusterSpec
from alpa.pipeline_parallel.schedule_choice import CANDIDATES, choose, price_schedules

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


def test_auto_on_a_gpt_plan_is_no_worse_than_any_schedule_and_says_why():
    """4 one-block GPT stages, 8 micro-batches, no device: "auto" takes ZB-H1, whose
    timeline is the shortest of the three on these stages; the plan lists every
    candidate (its table too), and each candidate's time is that of the plan made with
    the schedule named by hand. With a memory budget that ZB-H1 exceeds but 1F1B does
    not, "auto" takes 1F1B."""
    auto = _gpt_plan("auto")
    candidates = {c.name: c for c in auto.schedule_candidates}
    assert list(candidates) == list(CANDIDATES) and all(c.fits for c in candidates.values())
    assert auto.schedule.name == "zb-h1"
    assert candidates["zb-h1"].seconds < candidates["1f1b"].seconds
    assert candidates["zb-h1"].seconds == min(c.seconds for c in candidates.values())
    for name in CANDIDATES:
        by_hand = _gpt_plan(name)
        assert by_hand.stage_plan.stage_layers() == auto.stage_plan.stage_layers()
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
    table = auto.format_table()
    assert "pipeline_schedule='auto' chose zb-h1" in table
    assert all(f"  {c.line()}" in table for c in auto.schedule_candidates)
    summary = auto.summary()
    assert [c["name"] for c in summary["schedule_candidates"]] == list(CANDIDATES)
    # A budget between 1F1B's peak and ZB-H1's.
    peaks = {name: max(c.memory) for name, c in candidates.items()}
    assert peaks["1f1b"] < peaks["zb-h1"]
    tight = _gpt_plan("auto", budget=(peaks["1f1b"] + peaks["zb-h1"]) / 2)
    fits = {c.name: c.fits for c in tight.schedule_candidates}
    assert tight.schedule.name == "1f1b" and fits == {"gpipe": False, "1f1b": True, "zb-h1": False}
    # 1F1B's candidate memory is the plan's own model memory, as plan.cost says.
    one_f_one_b = next(c for c in tight.schedule_candidates if c.name == "1f1b")
    assert one_f_one_b.memory == tuple(tight.cost.memory)
