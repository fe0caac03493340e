"""PipeshardParallel(manual_sharding_option=..., stage_input_shardings=...): the pinned
specs reach the compiled stages (their input shardings), numerics match the serial step,
and bad specs fail with the exact error."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import devices_or_skip
from jax.sharding import PartitionSpec as P

import alpa
from alpa.device_mesh import ClusterSpec
from alpa.parallel_method import PipeshardParallel
from alpa.pipeline_parallel.program.user_shardings import stage_inputs
from alpa.testing import entry_shapes
from alpa.util import count_communication_primitives

HIDDEN, BATCH = 16, 16


def _loss(params, x, y):
    h = jnp.tanh(x @ params["w0"] + params["b0"])
    alpa.mark_pipeline_boundary()
    h = jnp.tanh(h @ params["w1"] + params["b1"])
    return jnp.mean((h - y) ** 2)


def _setup():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w0": jax.random.normal(keys[0], (HIDDEN, HIDDEN)) / 4,
        # A dtype, so that b0 is not weakly typed: the step would compile again on the
        # second call (its output is strongly typed), as jax.jit does.
        "b0": jnp.full((HIDDEN,), 0.1, jnp.float32),
        "w1": jax.random.normal(keys[1], (HIDDEN, HIDDEN)) / 4,
        "b1": jnp.zeros((HIDDEN,)),
    }
    batch = (
        jax.random.normal(keys[2], (BATCH, HIDDEN)),
        jax.random.normal(keys[3], (BATCH, HIDDEN)),
    )
    return params, batch


def _step(grad_fn, tx):
    def step(params, opt_state, batch):
        value, grads = grad_fn(_loss)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def _run(method, steps=2):
    params, batch = _setup()
    tx = optax.sgd(0.1)
    serial = jax.jit(_step(jax.value_and_grad, tx))
    parallel = alpa.parallelize(_step(alpa.value_and_grad, tx), method=method, batch_argnums=(2,))
    ref = out = (params, tx.init(params))
    for _ in range(steps):
        ref = serial(*ref[:2], batch)
        out = parallel(*out[:2], batch)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    return parallel.get_last_executable(), out


def _input_shard_shape(executable, name, stage, kind="forward"):
    """The per-device shape of step input ``name`` as the compiled computation takes it."""
    program = executable.program
    jaxpr = executable.traced.closed_jaxpr.jaxpr
    index = {n: v for v, n in zip(jaxpr.invars, executable.traced.leaf_names, strict=True)}
    var = index.get(name, name)
    comp = program.computation(stage, kind)
    position = list(comp.invars).index(var)
    compiled = executable._compiled[list(program.computations).index(comp)]
    shardings = compiled.input_shardings[0]
    sums = len(shardings) - len(comp.invars)  # a kernel's running sums come first
    return shardings[sums + position].shard_shape(var.aval.shape)


def _megatron(axis):
    return {"w0": P(None, axis), "b0": P(axis), "w1": P(axis, None), "b1": P()}


MEGATRON_IN = _megatron("model")


def test_manual_sharding_option_pins_step_inputs_and_outputs():
    devices_or_skip(8)
    option = alpa.ManualShardingOption(
        ("model",),
        in_axis_resources=(MEGATRON_IN, None, P()),
        out_axis_resources=(MEGATRON_IN, None, P()),
    )
    method = PipeshardParallel(num_micro_batches=2, manual_sharding_option=option)
    executable, (params, _, _) = _run(method)
    # Stage 0 takes w0 split by columns over its 4 devices, stage 1 w1 split by rows.
    assert _input_shard_shape(executable, "argument 0['w0']", 0) == (HIDDEN, HIDDEN // 4)
    assert _input_shard_shape(executable, "argument 0['b0']", 0) == (HIDDEN // 4,)
    assert _input_shard_shape(executable, "argument 0['w1']", 1) == (HIDDEN // 4, HIDDEN)
    # The batch (a replicated spec) is whole on every device of stage 0.
    assert _input_shard_shape(executable, "argument 2[0]", 0) == (BATCH // 2, HIDDEN)
    # The updated parameters come back with the out_axis_resources split.
    assert params["w0"].sharding.shard_shape((HIDDEN, HIDDEN)) == (HIDDEN, HIDDEN // 4)
    assert params["w1"].sharding.shard_shape((HIDDEN, HIDDEN)) == (HIDDEN // 4, HIDDEN)
    assert len(params["w0"].sharding.device_set) == 4


@pytest.mark.parametrize("mesh_axis_names", [("unused",), None], ids=str)
def test_manual_sharding_option_with_axis_names_per_submesh(mesh_axis_names):
    """Alpa's pipelines pass ``mesh_axis_names=None`` when every stage names its axes."""
    devices_or_skip(8)
    option = alpa.ManualShardingOption(
        mesh_axis_names,
        submesh_axis_names=(("data", "model"), ("model",)),
        in_axis_resources=(
            {"w0": P(None, "model"), "b0": P(), "w1": P("model"), "b1": P()},
            None,
            (P("data"), None),  # x (read by stage 0) split over "data"; y replicated
        ),
    )
    stage_option = alpa.ManualStageOption([[0], [1]], [(1, 4), (1, 4)], [(2, 2), (1, 4)])
    method = PipeshardParallel(
        num_micro_batches=2, stage_option=stage_option, manual_sharding_option=option
    )
    executable, _ = _run(method)
    # Stage 0 is a 2x2 mesh: the batch split over "data" (2), w0's columns over "model" (2).
    assert _input_shard_shape(executable, "argument 2[0]", 0) == (BATCH // 4, HIDDEN)
    assert _input_shard_shape(executable, "argument 0['w0']", 0) == (HIDDEN, HIDDEN // 2)
    # Stage 1 names its one axis "model": it spans the 4 devices.
    assert _input_shard_shape(executable, "argument 0['w1']", 1) == (HIDDEN // 4, HIDDEN)


def _model_then_data(batch_specs, **kwargs) -> alpa.ManualShardingOption:
    """Stage 0's submesh names its axes ("dummy", "model") and pins w0 and b0 by columns
    over "model"; stage 1's names them ("dummy", "data"); the batch takes ``batch_specs``."""
    return alpa.ManualShardingOption(
        None,
        submesh_axis_names=(("dummy", "model"), ("dummy", "data")),
        in_axis_resources=(
            {"w0": P(None, "model"), "b0": P("model"), "w1": P(), "b1": P()},
            None,
            batch_specs,
        ),
        **kwargs,
    )


@pytest.mark.parametrize("intermediate_axes", [None, (("data", 1),)], ids=str)
def test_pipeline_intermediate_axes_split_the_values_between_stages(intermediate_axes):
    """Alpa's ``ManualShardingOption(pipeline_intermediate_axes=((axis, dim),))``: the
    activation stage 1 reads from stage 0 is split along ``dim`` over stage 1's axis of
    that name (here its features over "data", 2 devices: 16 -> 8 per device), and so is
    its gradient on the way back; stage 0, whose submesh has no such axis, plans its side
    as without the option. Without it the ILP keeps the activation whole on stage 1.
    Numbers equal serial."""
    devices_or_skip(8)
    option = _model_then_data((None, None), pipeline_intermediate_axes=intermediate_axes)
    stage_option = alpa.ManualStageOption([[0], [1]], [(1, 2), (1, 2)], [(1, 2), (1, 2)])
    method = PipeshardParallel(
        num_micro_batches=2, stage_option=stage_option, manual_sharding_option=option
    )
    executable, _ = _run(method)
    program = executable.program
    (activation,) = [
        v
        for v in stage_inputs(program, 1)
        if v not in set(executable.traced.closed_jaxpr.jaxpr.invars)
    ]
    features = HIDDEN if intermediate_axes is None else HIDDEN // 2
    assert _input_shard_shape(executable, activation, 1) == (BATCH // 2, features)


def test_bad_pipeline_intermediate_axes_fail_when_the_option_is_built():
    with pytest.raises(ValueError, match=r"pipeline_intermediate_axes must be pairs"):
        alpa.ManualShardingOption(None, (("x",),), pipeline_intermediate_axes=(("data",),))
    with pytest.raises(ValueError, match=r"pipeline_intermediate_axes must be pairs"):
        alpa.ManualShardingOption(None, (("x",),), pipeline_intermediate_axes=((0, "data"),))
    with pytest.raises(ValueError, match=r"names an axis twice"):
        alpa.ManualShardingOption(
            None, (("x",),), pipeline_intermediate_axes=(("data", 0), ("data", 1))
        )


def test_stage_input_shardings_pin_the_inputs_of_a_stage():
    devices_or_skip(8)
    plain, _ = _run(PipeshardParallel(num_micro_batches=2), steps=1)
    names = [[n.rsplit(" ", 1)[0] for n in stage] for stage in plain.get_stage_input_names()]
    # Stage 1 reads w1, b1, y and the activation of stage 0 (an internal value v<n>).
    assert {n for n in names[1] if n.startswith("argument")} == {
        "argument 0['w1']",
        "argument 0['b1']",
        "argument 2[1]",
    }
    activation = next(i for i, n in enumerate(names[1]) if not n.startswith("argument"))
    specs = [None] * len(names[1])
    specs[activation] = P(None, ("x", "y"))  # the activation's features, 4 ways
    specs[names[1].index("argument 0['w1']")] = P("y", None)
    method = PipeshardParallel(num_micro_batches=2, stage_input_shardings=[None, specs])
    executable, _ = _run(method)
    act = stage_inputs(executable.program, 1)[activation]
    assert act.aval.shape == (BATCH // 2, HIDDEN)
    assert _input_shard_shape(executable, act, 1) == (BATCH // 2, HIDDEN // 4)
    assert _input_shard_shape(executable, "argument 0['w1']", 1) == (HIDDEN // 4, HIDDEN)
    # Unpinned inputs keep what the stage's plan chose.
    assert executable.get_stage_input_names()[0] == plain.get_stage_input_names()[0]


# ----------------------------------------------------------------------------- bad input


def _compile(method):
    params, batch = _setup()
    tx = optax.sgd(0.1)
    step = alpa.parallelize(_step(alpa.value_and_grad, tx), method=method, batch_argnums=(2,))
    return step.get_executable(params, tx.init(params), batch)


def test_bad_axis_names_fail_when_the_method_is_built():
    with pytest.raises(
        ValueError,
        match=r"stage_input_shardings\[1\]\[0\]: P\('model',\) names "
        r"mesh axes \['model'\] that are not in stage 1's submesh axis names \('x', 'y'\)",
    ):
        PipeshardParallel(stage_input_shardings=[None, [P("model")]])
    option = alpa.ManualShardingOption(("data",), in_axis_resources=(P("model"),))
    with pytest.raises(
        ValueError,
        match=r"manual_sharding_option.in_axis_resources: P\('model',\) names mesh axes "
        r"\['model'\] that are not in the submesh axis names \('data',\)",
    ):
        PipeshardParallel(manual_sharding_option=option)
    with pytest.raises(TypeError, match=r"stage_input_shardings\[0\]\[0\] must be a PartitionSpec"):
        PipeshardParallel(stage_input_shardings=[["x"]])
    with pytest.raises(
        TypeError, match=r"manual_sharding_option must be an alpa.ManualShardingOption"
    ):
        PipeshardParallel(manual_sharding_option={"in_axis_resources": None})
    option = alpa.ManualShardingOption(("m",), submesh_axis_names=(("a",), ("b",), ("c",)))
    with pytest.raises(
        ValueError,
        match=r"stage_input_shardings has 2 stages but "
        r"manual_sharding_option.submesh_axis_names has 3",
    ):
        PipeshardParallel(stage_input_shardings=[None, None], manual_sharding_option=option)


def test_bad_lengths_and_splits_fail_when_the_step_compiles():
    devices_or_skip(8)
    with pytest.raises(
        ValueError, match=r"stage_input_shardings has 3 entries but the pipeline has 2 stages"
    ):
        _compile(PipeshardParallel(stage_input_shardings=[None, None, None]))
    with pytest.raises(
        ValueError,
        match=r"stage_input_shardings\[0\] has 1 specs but stage 0 has 4 inputs: argument "
        r"2\[0\] float32\[16,16\], argument 0\['w0'\] float32\[16,16\], argument 0\['b0'\] "
        r"float32\[16\], v\d+ float32\[16,16\]",
    ):
        _compile(PipeshardParallel(stage_input_shardings=[[P()], None]))
    option = alpa.ManualShardingOption(("m",), in_axis_resources=(_megatron("m"), None))
    with pytest.raises(
        ValueError, match=r"in_axis_resources must have one entry per positional argument \(3\)"
    ):
        _compile(PipeshardParallel(manual_sharding_option=option))
    bad = dict(_megatron("m"), b0=P(None, "m"))
    option = alpa.ManualShardingOption(("m",), in_axis_resources=(bad, None, P()))
    with pytest.raises(
        ValueError,
        match=r"in_axis_resources for argument 0\['b0'\]: P\(None, 'm'\) has 2 "
        r"entries but the value has 1 dimensions",
    ):
        _compile(PipeshardParallel(manual_sharding_option=option))
    option = alpa.ManualShardingOption(("m",), submesh_axis_names=(("m",),))
    with pytest.raises(
        ValueError, match=r"submesh_axis_names has 1 entries but the pipeline has 2 stages"
    ):
        _compile(PipeshardParallel(manual_sharding_option=option))
    stage_option = alpa.ManualStageOption([[0], [1]], [(1, 2), (1, 6)])
    option = alpa.ManualShardingOption(("m",), in_axis_resources=(_megatron("m"), None, P()))
    with pytest.raises(
        ValueError,
        match=r"in_axis_resources for argument 0\['w1'\]: P\('m', None\) splits "
        r"dimension 0 of size 16 into 6 parts on stage 1's submesh, which does not divide it",
    ):
        _compile(PipeshardParallel(stage_option=stage_option, manual_sharding_option=option))


def test_mesh_axis_names_none_needs_a_pipeline():
    with pytest.raises(ValueError, match=r"mesh_axis_names must be a tuple of 1 or 2 axis"):
        alpa.ManualShardingOption(None)
    option = alpa.ManualShardingOption(None, submesh_axis_names=(("a",),))
    w, x = jnp.ones((4, 4)), jnp.ones((8, 4))
    method = alpa.ShardParallel(manual_sharding_option=option)
    with pytest.raises(ValueError, match=r"mesh_axis_names is None, which only a pipeline"):
        alpa.parallelize(lambda w, x: jnp.sum(x @ w), method=method)(w, x)


def test_stage_input_shard_specs_replay_at_another_batch_size():
    """``executable.stage_input_shard_specs`` (Alpa's name) is what
    ``stage_input_shardings`` takes: a step compiled again at another batch size with
    them reads its stage inputs alike."""
    devices_or_skip(8)
    rng = np.random.default_rng(0)
    params = {f"w{i}": rng.standard_normal((16, 16), dtype=np.float32) for i in range(2)}

    def infer(params, x):
        h = jnp.tanh(x @ params["w0"])
        alpa.mark_pipeline_boundary()
        return jnp.tanh(h @ params["w1"])

    def compiled(batch, shardings=None):
        method = PipeshardParallel(
            num_micro_batches=1,
            pipeline_schedule="inference",
            layer_option="manual",
            stage_input_shardings=shardings,
        )
        x = jax.ShapeDtypeStruct((batch, 16), jnp.float32)
        return alpa.parallelize(infer, method=method).get_executable(params, x)

    small = compiled(2)  # 2 rows: the batch cannot be split over 4 devices
    specs = small.stage_input_shard_specs
    assert [len(s) for s in specs] == [len(stage_inputs(small.program, s)) for s in (0, 1)]
    assert all(isinstance(p, P) for stage in specs for p in stage)
    free = compiled(64)
    pinned = compiled(64, specs)
    assert pinned.stage_input_shard_specs == specs
    assert free.stage_input_shard_specs != specs  # 64 rows: the ILP splits them


def _off_method(option=None):
    """Two stages on (1, 2) submeshes with auto-sharding off, as Alpa's manual-sharding
    tests build them."""
    stage_option = alpa.ManualStageOption([[0], [1]], [(1, 2), (1, 2)], [(1, 2), (1, 2)])
    return PipeshardParallel(
        num_micro_batches=2,
        stage_option=stage_option,
        manual_sharding_option=option,
        default_auto_sharding_option=alpa.AutoShardingOption(enable_auto_sharding=False),
    )


def test_auto_sharding_off_leaves_the_stages_to_xla_propagation_from_the_pins():
    """``AutoShardingOption(enable_auto_sharding=False)`` (Alpa's meaning): a stage's values
    take what XLA's propagation derives from the pins, nothing else is split. Stage 0 pins
    Megatron's first layer over "model": the batch stays whole there (a data-parallel stage
    would split it), the hidden activation is split by columns. Stage 1 pins the targets'
    rows over "data": XLA splits its micro-batch and all-reduces the gradients in the
    backward, so none is carried as partial sums, and the accumulated gradients have the
    parameters' shapes. ``get_hlo_text`` lists the programs in Alpa's order (forwards,
    backwards from the last stage, apply-grad), each backward taking its running sums
    first. Numbers equal serial."""
    devices_or_skip(8)
    option = _model_then_data((None, P("data")))
    executable, _ = _run(_off_method(option))
    program = executable.program
    assert program.deferred is None
    half = BATCH // 2  # a micro-batch
    assert _input_shard_shape(executable, "argument 2[0]", 0) == (half, HIDDEN)
    assert _input_shard_shape(executable, "argument 0['w0']", 0) == (HIDDEN, HIDDEN // 2)
    assert _input_shard_shape(executable, "argument 2[1]", 1) == (half // 2, HIDDEN)
    (activation,) = [
        v for v in stage_inputs(program, 1) if v not in set(executable.traced.jaxpr.invars)
    ]
    assert _input_shard_shape(executable, activation, 1) == (half, HIDDEN)  # unpinned: whole
    texts = executable.get_hlo_text()
    names = ["forward", "forward", "backward", "backward", "apply", "apply"]
    stages = [0, 1, 1, 0, 0, 1]
    assert len(texts) == 6
    for text, kind, s in zip(texts, names, stages, strict=True):
        assert f"stage{s}_{kind}" in text.splitlines()[0], text.splitlines()[0]
    params, _ = entry_shapes(texts[2])
    assert params[:2] == ["f32[16,16]", "f32[16]"], params  # w1's and b1's running sums
    assert count_communication_primitives(texts[2]).all_reduce >= 1
    assert count_communication_primitives(texts[3]).all_reduce == 0  # Megatron's backward


def test_auto_sharding_off_without_pins_runs_a_stage_replicated():
    """Nothing pinned and auto-sharding off: every value of every stage is whole on every
    device of its submesh (Alpa's meaning; this used to be data parallel), so no program
    communicates. Numbers equal serial."""
    devices_or_skip(8)
    executable, _ = _run(_off_method())
    assert executable.program.deferred is None
    assert _input_shard_shape(executable, "argument 2[0]", 0) == (BATCH // 2, HIDDEN)
    for text in executable.get_hlo_text():
        assert count_communication_primitives(text).total == 0


def test_auto_sharding_off_needs_the_stages_devices_to_plan():
    """The shardings of a stage left to XLA come from a compile: planning it for a cluster
    that is not here says so, and how to get a plan."""
    cluster = ClusterSpec(2, 16, 1e13, 1 << 34, 1e11, 1e10)
    stage_option = alpa.ManualStageOption([[0], [1]], [(1, 16), (1, 16)], [(1, 16), (1, 16)])
    method = PipeshardParallel(
        devices=cluster,
        num_micro_batches=2,
        stage_option=stage_option,
        default_auto_sharding_option=alpa.AutoShardingOption(enable_auto_sharding=False),
    )
    params, batch = _setup()
    tx = optax.sgd(0.1)
    step = alpa.parallelize(_step(alpa.value_and_grad, tx), method=method, batch_argnums=(2,))
    with pytest.raises(
        ValueError,
        match=r"enable_auto_sharding=False\), so .* on 16 devices; this process has 8",
    ):
        step.plan(params, tx.init(params), batch)
