"""The middle passes of the pipeshard compile (computation split, instruction emission,
buffer lifetimes) read off ``.plan()``, with no device touched, against closed forms.

The step: the 4-layer MLP (Dense(64) x 4, Adam), 4 layers cut by ``AutoLayerOption``,
``UniformStageOption(S)`` on the 8-device CPU ``ClusterSpec``, ``M`` micro-batches."""

import dataclasses
import re

import pytest
from jax.extend.core import Literal

import alpa
from alpa.device_mesh import ClusterSpec
from alpa.model.mlp import MLPModel, get_mlp_train_state_and_step
from alpa.runtime.instructions import Op

WIDTH, LAYERS = 64, 4


def _plan(num_stages: int, num_micro_batches: int, schedule: str = "1f1b", option=None):
    model = MLPModel(hidden_size=WIDTH, num_layers=LAYERS - 1, output_dim=WIDTH)
    state, batch, step = get_mlp_train_state_and_step(
        model, 8 * num_micro_batches, WIDTH, grad_func=alpa.value_and_grad, abstract=True
    )
    method = alpa.PipeshardParallel(
        devices=ClusterSpec.preset("cpu"),
        num_micro_batches=num_micro_batches,
        default_auto_sharding_option=option,
        layer_option=alpa.AutoLayerOption(layer_num=LAYERS),
        stage_option=alpa.UniformStageOption(num_stages=num_stages),
        pipeline_schedule=schedule,
    )
    return alpa.parallelize(step, method=method).plan(state, batch)


CASES = [(2, 4), (4, 4), (4, 8), (2, 1)]


@pytest.mark.parametrize("S, M", CASES)
def test_split_gives_each_stage_its_layers_parameters(S, M):
    plan = _plan(S, M)
    program, traced = plan.program, plan.traced
    kinds = sorted((c.stage, c.kind) for c in program.computations if c.kind != "apply")
    assert kinds == sorted((s, k) for s in range(S) for k in ("forward", "backward"))
    # Dense_l's kernel and bias: read by layer l's stage alone (layers split evenly).
    params = {
        name: v
        for name, v in zip(traced.leaf_names, traced.closed_jaxpr.jaxpr.invars, strict=True)
        if name.startswith("argument 0.params[")
    }
    assert len(params) == 2 * LAYERS
    for name, v in params.items():
        layer = int(re.search(r"Dense_(\d+)", name).group(1))
        assert program.input_stages[v] == (layer * S // LAYERS,), name


@pytest.mark.parametrize("S, M", [(2, 4), (4, 8)])
def test_the_backward_reads_its_weights_from_the_stage_not_from_each_micro_batch(S, M):
    """A layer's start marker passes its parameters along with its activations, and the
    backward reads a layer's weights (a matmul's, for its input's cotangent). It reads
    them as the step's inputs held on the stage, so what the forward hands the backward
    (kept once per micro-batch in flight) is computed from the batch: no per-micro-batch
    buffer holds a weight."""
    plan = _plan(S, M)
    program = plan.program
    inputs = set(program.closed_jaxpr.jaxpr.invars)
    var_of = {name: v for v, name in plan.names.items()}
    for s in range(S):
        forward, backward = program.computation(s, "forward"), program.computation(s, "backward")
        handed = set(forward.outvars) & set(backward.invars)
        assert handed and handed <= program.batch_dependent, s
        weights = {v for v in backward.invars if v in inputs and v.aval.ndim == 2}
        # The first layer computes no cotangent for the batch: it needs no weight.
        assert (weights or s == 0) and not weights & program.batch_dependent, s
    per_micro_batch = {key for key in plan.instructions.buffer_keys() if key[1] is not None}
    assert per_micro_batch
    assert all(var_of[key[0]] in program.batch_dependent for key in per_micro_batch)


@pytest.mark.parametrize("S, M", CASES)
def test_emitted_instructions_per_mesh(S, M):
    plan = _plan(S, M)
    program, instructions = plan.program, plan.instructions
    for mesh in range(S):
        runs = [i for i in instructions.for_mesh(mesh) if i.op is Op.RUN]
        kernels = [instructions.kernels[i.computation] for i in runs]
        kinds = [program.computations[k.computation].kind for k in kernels]
        applies = sum(
            c.kind == "apply" and c.stage == mesh and bool(c.eqns) for c in program.computations
        )
        # M forwards, M backwards, and each apply computation once per step.
        assert kinds.count("forward") == M and kinds.count("backward") == M, mesh
        assert kinds.count("apply") == applies >= 1, mesh
        # Each micro-batch's forward once, in order, before its backward.
        forward = [i.micro_batch for i, k in zip(runs, kinds, strict=True) if k == "forward"]
        backward = [i.micro_batch for i, k in zip(runs, kinds, strict=True) if k == "backward"]
        assert sorted(forward) == list(range(M)) and sorted(backward) == list(range(M))
    # One activation forward and one cotangent back across each of the S - 1 boundaries,
    # per micro-batch; once per step, only Adam's two scalars that stage 0's apply-grad
    # computes from the step count (4 bytes each), sent to every other stage.
    reshards = [i for i in instructions.instructions if i.op is Op.RESHARD]
    per_micro_batch = [i for i in reshards if i.inputs[0][1] is not None]
    per_step = [i for i in reshards if i.inputs[0][1] is None]
    assert len(per_micro_batch) == 2 * (S - 1) * M
    assert len(per_step) == 2 * (S - 1)
    assert all(instructions.nbytes[i.inputs[0]] == 4 for i in per_step)


def _live_micro_batches(instructions, mesh: int) -> int:
    """The most micro-batches that have a buffer computed on ``mesh`` alive at once
    (buffers a ``RUN`` wrote for one micro-batch; the loaded batch is not counted)."""
    alive: dict = {}
    peak = 0
    for ins in instructions.instructions:
        if ins.op is Op.RUN and ins.mesh == mesh:
            for key in ins.outputs:
                if key[1] is not None and key[2] == mesh:
                    alive[key] = key[1]
        peak = max(peak, len(set(alive.values())))
        for key in ins.free:
            alive.pop(key, None)
    return peak


@pytest.mark.parametrize("S, M", CASES)
def test_1f1b_keeps_min_s_minus_i_m_micro_batches_in_flight(S, M):
    instructions = _plan(S, M, "1f1b").instructions
    assert [_live_micro_batches(instructions, i) for i in range(S)] == [
        min(S - i, M) for i in range(S)
    ]


@pytest.mark.parametrize("S, M", [(2, 4), (4, 4), (4, 8)])
def test_zb_h1_splits_the_backward_and_keeps_min_s_m_micro_batches_in_flight(S, M):
    """ZB-H1: every stage that sends a cotangent back runs its backward as B and W, whose
    equations partition the backward's (the first stage, which sends none, keeps it
    whole); B hands W the cotangents W reads, one buffer per micro-batch; the emitted
    instructions keep min(S, M) micro-batches alive on every mesh, the schedule's bound
    (1F1B's is min(S - i, M))."""
    plan = _plan(S, M, "zb-h1")
    whole = _plan(S, M, "1f1b").program
    program = plan.program
    for s in range(S):
        backward, weight = program.computation(s, "backward"), program.computation(s, "weight")
        assert (weight is None) == (s == 0), s
        if weight is None:
            continue
        unsplit = whole.computation(s, "backward")
        split = _eqn_texts(backward.eqns) + _eqn_texts(weight.eqns)
        assert sorted(split) == sorted(_eqn_texts(unsplit.eqns)), s
        handed = set(backward.outvars) & set(weight.invars)
        assert handed and handed <= program.per_micro_batch, s
    instructions = plan.instructions
    assert [_live_micro_batches(instructions, i) for i in range(S)] == [min(S, M)] * S
    assert plan.schedule.max_in_flight() == [min(S, M)] * S
    assert _lifetime_errors(instructions) == []


def _eqn_texts(eqns) -> list[str]:
    """The equations as primitive and operand shapes, markers by operand (ZB-H1's split
    cuts a layer marker into one marker per operand), constants left out (each half
    recomputes those it reads)."""
    texts = []
    for e in eqns:
        if e.primitive.name == "pipeline_marker":
            texts += [f"marker {v.aval.str_short()}" for v in e.invars]
        elif any(not isinstance(v, Literal) for v in e.invars):
            texts.append(f"{e.primitive.name} {[v.aval.str_short() for v in e.invars]}")
    return texts


@pytest.mark.parametrize("S, M", [(2, 4), (4, 8)])
def test_gpipe_keeps_every_micro_batch_in_flight(S, M):
    instructions = _plan(S, M, "gpipe").instructions
    assert [_live_micro_batches(instructions, i) for i in range(S)] == [M] * S


def _lifetime_errors(instructions) -> list[str]:
    """Buffers used after they were freed, freed before their last use, or never freed
    though neither the caller's (persistent) nor a step output."""
    errors = []
    last_use: dict = {}
    freed: dict = {}
    for i, ins in enumerate(instructions.instructions):
        for key in ins.inputs + ins.outputs:
            if key in freed:
                errors.append(f"{key} used at {i} after it was freed at {freed[key]}")
            last_use[key] = i
        for key in ins.free:
            if key in freed or last_use.get(key) != i:
                errors.append(f"{key} freed at {i}, not at its last use {last_use.get(key)}")
            freed[key] = i
    kept = set(last_use) - set(freed)
    allowed = instructions.persistent | instructions.output_keys()
    errors += [f"{key} never freed" for key in sorted(kept - allowed, key=str)]
    return errors


@pytest.mark.parametrize("S, M", CASES)
def test_every_buffer_is_freed_by_its_last_use(S, M):
    instructions = _plan(S, M).instructions
    assert _lifetime_errors(instructions) == []


def test_the_oracles_can_fail():
    # GPipe's in-flight counts are not 1F1B's closed form.
    gpipe = _plan(4, 8, "gpipe").instructions
    assert [_live_micro_batches(gpipe, i) for i in range(4)] != [4, 3, 2, 1]
    # A free dropped, or moved one instruction early, is found.
    instructions = _plan(4, 8).instructions
    i = next(i for i, ins in enumerate(instructions.instructions) if ins.free and i > 0)
    steps = list(instructions.instructions)
    dropped = steps[:i] + [dataclasses.replace(steps[i], free=())] + steps[i + 1 :]
    assert _lifetime_errors(dataclasses.replace(instructions, instructions=tuple(dropped)))
    early = (
        steps[: i - 1]
        + [dataclasses.replace(steps[i - 1], free=steps[i - 1].free + steps[i].free)]
        + [dataclasses.replace(steps[i], free=())]
        + steps[i + 1 :]
    )
    assert _lifetime_errors(dataclasses.replace(instructions, instructions=tuple(early)))


def test_equations_key_sees_structure_literals_and_types_not_names():
    """``stage_sharding.equations_key`` (what lets identical layers and stages share one
    ILP): equal for the same equations on other variables and under other marker names;
    different when a literal's value, or a value's type, differs."""
    from types import SimpleNamespace

    import jax
    import jax.numpy as jnp

    from alpa.pipeline_parallel.program.stage_sharding import equations_key
    from alpa.tracing.primitive_def import mark_pipeline_jaxpreqn

    def layer(name, scale):
        def f(x, w):
            (x,) = mark_pipeline_jaxpreqn([x], name, "start")
            return jnp.tanh(x @ w) * scale

        return f

    def key(fun, dtype=jnp.float32):
        closed = jax.make_jaxpr(fun)(jnp.ones((4, 8), dtype), jnp.ones((8, 8), dtype))
        return equations_key(SimpleNamespace(closed_jaxpr=closed))

    assert key(layer("layer_3", 2.0)) == key(layer("layer_4", 2.0))
    assert key(layer("layer_3", 2.0)) != key(layer("layer_3", 3.0))
    assert key(layer("layer_3", 2.0)) != key(layer("layer_3", 2.0), jnp.bfloat16)


@pytest.mark.parametrize("data_parallel", [False, True], ids=["ilp", "data-parallel"])
def test_every_value_a_stage_reads_or_writes_has_one_spec_filled_once(data_parallel):
    """The end of the chain places every value a stage computation reads or writes, and
    every buffer, on its mesh (``PipeshardPlan.value_specs``): its stage record's spec
    where the record has one (every such value of an ILP-planned stage), a deferred
    gradient's partial spec or data parallel's (dim 0 over the mesh's devices where it
    holds a batch, else replicated) where not (a data-parallel stage's). The stage
    programs read it (``spec_of``) and fill no gap themselves; a value not on a mesh is
    an error, not a guess."""
    from jax.sharding import PartitionSpec

    from alpa.pipeline_parallel.program.stage_sharding import DATA_AXES

    option = alpa.AutoShardingOption(force_data_parallel=True) if data_parallel else None
    plan = _plan(2, 4, option=option)
    program = plan.program
    deferred = program.deferred
    filled = 0
    for comp in program.computations:
        for v in (*comp.invars, *comp.outvars):
            if isinstance(v, Literal):
                continue
            spec = plan.value_specs[(v, comp.stage)]
            assert plan.spec_of(v, comp.stage) == spec
            recorded = plan.stage_pins[comp.stage].var_specs.get(v)
            if recorded is not None:
                assert spec == recorded
            elif deferred is not None and v in deferred.accumulators:
                assert spec == deferred.partial_specs[v]
            else:
                filled += 1
                assert spec in (PartitionSpec(), PartitionSpec(DATA_AXES))
    assert bool(filled) == data_parallel
    for name, _, mesh in plan.instructions.buffer_keys():
        assert plan.buffer_specs[(name, mesh)] == plan.value_specs[(plan_var(plan, name), mesh)]
    stage0_only = next(
        v for v, stages in program.input_stages.items() if stages == (0,) and v.aval.shape
    )
    with pytest.raises(KeyError, match="the plan places no value .* on mesh 1"):
        plan.spec_of(stage0_only, 1)


def plan_var(plan, name):
    return next(v for v, n in plan.names.items() if n == name)


def test_a_stage_is_planned_as_a_step_jaxpr_without_a_call_structure():
    """The intra-op planner takes the stage's computations as a ``StepJaxpr`` (a flat
    jaxpr and each input's role), not a stand-in user step with made-up pytrees."""
    from alpa.pipeline_parallel.program.stage_sharding import merged_step
    from alpa.shard_parallel.auto_sharding import AutoShardingOption, plan_auto_sharding
    from alpa.tracing import StepJaxpr, TracedStep

    plan = _plan(2, 4)
    program = plan.program
    comps = [c for c in program.computations if c.stage == 0 and c.kind != "apply"]
    step, produced = merged_step(plan.traced, program, comps, 4, plan.names, "stage0")
    assert isinstance(step, StepJaxpr) and not isinstance(step, TracedStep)
    assert not hasattr(step, "in_tree") and step.retrace is None
    assert produced == {v for c in comps for e in c.eqns for v in e.outvars}
    # Each input's role: the batch rows, read from the program (dim 0 split four ways).
    assert step.batch_invars == tuple(
        v in program.batch_dependent and bool(v.aval.shape) and v.aval.shape[0] % 4 == 0
        for v in step.jaxpr.invars
    )
    assert any(step.batch_invars) and not all(step.batch_invars)
    sharding = plan_auto_sharding(step, plan.logical_meshes[0], AutoShardingOption())
    assert len(sharding.in_specs) == len(step.jaxpr.invars)
    assert len(sharding.out_specs) == len(step.jaxpr.outvars)
