"""PipeshardParallel on 8 virtual CPU devices: numerics against the serial step, memory,
executable helpers and bad input."""

import dataclasses
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import devices_or_skip
from jax.extend.core import Literal

import alpa
from alpa.parallel_method import PipeshardParallel
from alpa.pipeline_parallel.stages.stage_construction import ManualStageOption, UniformStageOption
from alpa.runtime.instructions import Op
from alpa.testing import entry_shapes

BATCH = 16


def _mlp_loss(num_layers):
    def loss(params, x, y):
        h = x
        for i in range(num_layers):
            h = jnp.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
            if i < num_layers - 1:
                alpa.mark_pipeline_boundary()
        return jnp.mean((h - y) ** 2)

    return loss


def _mlp(num_layers, hidden=8):
    keys = jax.random.split(jax.random.PRNGKey(0), num_layers + 2)
    params = {}
    for i in range(num_layers):
        params[f"w{i}"] = jax.random.normal(keys[i], (hidden, hidden)) / np.sqrt(hidden)
        params[f"b{i}"] = jnp.full((hidden,), 0.1 * i)
    x = jax.random.normal(keys[-2], (BATCH, hidden))
    y = jax.random.normal(keys[-1], (BATCH, hidden))
    return params, (x, y)


def _train_step(loss, tx, grad_fn):
    def step(params, opt_state, batch):
        value, grads = grad_fn(loss)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def _check_against_serial(loss, params, batch, method, tx=None, steps=2):
    tx = tx or optax.chain(optax.clip_by_global_norm(0.3), optax.adam(1e-2))
    opt_state = tx.init(params)
    serial = jax.jit(_train_step(loss, tx, jax.value_and_grad))
    parallel = alpa.parallelize(
        _train_step(loss, tx, alpa.value_and_grad), method=method, batch_argnums=(2,)
    )
    ref_state, state = (params, opt_state), (params, opt_state)
    for _ in range(steps):
        ref = serial(*ref_state, batch)
        out = parallel(*state, batch)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
        ref_state, state = ref[:2], out[:2]
    return parallel.get_last_executable()


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1", "auto"])
@pytest.mark.parametrize("num_micro_batches", [1, 2, 8])
def test_mlp_two_stages(schedule, num_micro_batches):
    devices_or_skip(8)
    params, batch = _mlp(2)
    method = PipeshardParallel(
        num_micro_batches=num_micro_batches, pipeline_schedule=schedule, stage_option="uniform"
    )
    executable = _check_against_serial(_mlp_loss(2), params, batch, method)
    assert executable.live_buffers_after_step() == []
    assert [m.devices.size for m in executable.meshes] == [4, 4]


def test_two_stages_share_one_device_when_it_is_listed_twice():
    """``devices=[d, d]``: each stage takes one slot, so both run on ``d`` (a pipeline
    tried on one accelerator), with numerics equal to serial over two steps; one stage's
    mesh cannot take ``d`` twice, and the error says why."""
    device = jax.devices()[0]
    params, batch = _mlp(2)
    method = PipeshardParallel(
        devices=[device, device],
        num_micro_batches=2,
        stage_option=ManualStageOption([[0], [1]], [(1, 1), (1, 1)]),
    )
    executable = _check_against_serial(_mlp_loss(2), params, batch, method)
    assert [list(m.devices.flat) for m in executable.meshes] == [[device], [device]]
    assert executable.live_buffers_after_step() == []
    one_mesh = PipeshardParallel(
        devices=[device, device],
        num_micro_batches=2,
        stage_option=ManualStageOption([[0, 1]], [(1, 2)]),
    )
    with pytest.raises(ValueError, match="cannot hold a device twice"):
        _check_against_serial(_mlp_loss(2), params, batch, one_mesh, steps=1)


def test_mlp_four_stages_uniform_option():
    devices_or_skip(8)
    params, batch = _mlp(4)
    method = PipeshardParallel(num_micro_batches=4, stage_option=UniformStageOption(4))
    executable = _check_against_serial(_mlp_loss(4), params, batch, method)
    assert executable.stage_plan.num_stages == 4
    assert executable.live_buffers_after_step() == []


def test_uneven_submeshes_and_layers_per_stage():
    devices_or_skip(8)
    params, batch = _mlp(3)
    stage_option = ManualStageOption([[0, 1], [2]], [(1, 2), (1, 6)])
    method = PipeshardParallel(num_micro_batches=2, stage_option=stage_option)
    executable = _check_against_serial(_mlp_loss(3), params, batch, method)
    assert [m.devices.size for m in executable.meshes] == [2, 6]
    # Each parameter and its optimizer state live on the mesh of the stage that uses it.
    specs = executable.get_input_placement_specs()
    assert specs[0]["w0"].mesh_ids == (0,) and specs[0]["w2"].mesh_ids == (1,)
    adam_state = specs[1][1][0]
    assert adam_state.mu["w1"].mesh_ids == (0,) and adam_state.mu["w2"].mesh_ids == (1,)


def _tied_loss(params, tokens, labels):
    embedding = params["embedding"]  # used by the first and the last stage
    h = embedding[tokens]
    h = jnp.tanh(h @ params["w0"])
    alpa.mark_pipeline_boundary()
    h = jnp.tanh(h @ params["w1"])
    logits = h @ embedding.T
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def test_tied_embedding_across_stages():
    devices_or_skip(8)
    vocab, dim = 16, 8
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    params = {
        "embedding": jax.random.normal(keys[0], (vocab, dim)),
        "w0": jax.random.normal(keys[1], (dim, dim)) / 3,
        "w1": jax.random.normal(keys[2], (dim, dim)) / 3,
    }
    tokens = jax.random.randint(keys[3], (BATCH, 4), 0, vocab)
    labels = (tokens + 1) % vocab
    method = PipeshardParallel(num_micro_batches=4, pipeline_schedule="gpipe")
    executable = _check_against_serial(_tied_loss, params, (tokens, labels), method)
    assert executable.get_input_placement_specs()[0]["embedding"].mesh_ids == (0, 1)


@pytest.mark.parametrize("schedule", ["inference", "auto"])
def test_inference_schedule(schedule):
    """An inference step under "inference", or "auto", which takes it."""
    devices_or_skip(8)
    params, (x, _) = _mlp(2)

    def infer(params, x):
        h = jnp.tanh(x @ params["w0"] + params["b0"])
        alpa.mark_pipeline_boundary()
        return jnp.tanh(h @ params["w1"] + params["b1"]), jnp.sum(params["b1"])

    method = PipeshardParallel(num_micro_batches=4, pipeline_schedule=schedule)
    p_infer = alpa.parallelize(infer, method=method, batch_argnums=(1,))
    out = p_infer(params, x)
    assert p_infer.get_last_executable().plan.schedule.name == "inference"
    ref = infer(params, x)
    for a, b in zip(out, ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_inference_outputs_may_be_constants():
    """An output that is a constant of the program (a literal in its jaxpr, as a Python
    number returned as it is) comes back as that constant (Alpa's inference tests return
    such values; it failed with ``unhashable type: 'Literal'``)."""
    devices_or_skip(8)
    params, (x, _) = _mlp(2)

    def infer(params, x):
        h = jnp.tanh(x @ params["w0"] + params["b0"])
        alpa.mark_pipeline_boundary()
        return jnp.tanh(h @ params["w1"] + params["b1"]), 1.5, jnp.int32(3)

    method = PipeshardParallel(num_micro_batches=4, pipeline_schedule="inference")
    f = alpa.parallelize(infer, method=method, batch_argnums=(1,))
    assert any(isinstance(v, Literal) for v in f.get_executable(params, x).traced.jaxpr.outvars)
    out, constant, count = f(params, x)
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(infer(params, x)[0]), rtol=1e-4, atol=1e-4
    )
    assert float(constant) == 1.5 and int(count) == 3


@pytest.mark.parametrize("stage_option", ["uniform", "auto"])
def test_a_step_returning_jax_grad_gradients_is_pipelined(stage_option):
    """Alpa's pipeline tests return ``jax.grad``'s gradients (no ``alpa.grad``): with one
    micro-batch the whole step is the compute part, cut at the model's markers."""
    devices_or_skip(8)
    from alpa.model.mlp import MLPModel

    model = MLPModel(hidden_size=32, num_layers=4, add_manual_pipeline_markers=True)
    x = jax.random.normal(jax.random.key(0), (BATCH, 32))
    y = jax.random.normal(jax.random.key(1), (BATCH, 32))
    params = model.init(jax.random.key(2), x)

    def grads_step(params, batch):
        def loss(p):
            rows = batch["x"].shape[0]
            out = model.apply(p, batch["x"]) + jnp.arange(rows).reshape(-1, 1)  # a constant
            return jnp.mean((out - batch["y"]) ** 2)

        return jax.value_and_grad(loss)(params)

    method = PipeshardParallel(layer_option="manual", stage_option=stage_option)
    f = alpa.parallelize(grads_step, method=method, donate_argnums=())
    loss, grads = f(params, {"x": x, "y": y})
    ref_loss, ref_grads = jax.jit(grads_step)(params, {"x": x, "y": y})
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    executable = f.get_last_executable()
    assert executable.plan.program.is_training
    if stage_option == "uniform":  # one stage per marked layer
        assert executable.stage_plan.num_stages == 4
    kinds = {(c.stage, c.kind) for c in executable.program.computations if c.eqns}
    assert (0, "backward") in kinds and not any(k == "apply" for _, k in kinds)
    # A retrace (the deferred sums' batch dimensions) is marked once, like the trace.
    traced = executable.traced
    retraced = traced.retrace(2)
    assert retraced.grad_marker() is not None
    assert [e.primitive for e in retraced.jaxpr.eqns] == [e.primitive for e in traced.jaxpr.eqns]


def _executable(schedule, num_micro_batches, num_layers=2):
    params, batch = _mlp(num_layers)
    tx = optax.sgd(0.1)
    method = PipeshardParallel(num_micro_batches=num_micro_batches, pipeline_schedule=schedule)
    step = alpa.parallelize(
        _train_step(_mlp_loss(num_layers), tx, alpa.value_and_grad),
        method=method,
        batch_argnums=(2,),
    )
    return step.get_executable(params, tx.init(params), batch)


def test_1f1b_peak_activation_memory_below_gpipe():
    devices_or_skip(8)
    gpipe = _executable("gpipe", 8).get_peak_live_bytes()
    one_f_one_b = _executable("1f1b", 8).get_peak_live_bytes()
    assert one_f_one_b[0] < gpipe[0]
    assert all(a <= b for a, b in zip(one_f_one_b, gpipe, strict=True))


def test_executable_helpers(tmp_path):
    devices_or_skip(8)
    params, batch = _mlp(2)
    tx = optax.sgd(0.1)
    method = PipeshardParallel(num_micro_batches=2)
    step = alpa.parallelize(
        _train_step(_mlp_loss(2), tx, alpa.value_and_grad), method=method, batch_argnums=(2,)
    )
    step(params, tx.init(params), batch)
    executable = step.get_last_executable()
    assert all(e.returned is None for e in executable.runtime.events)
    executable.collect_trace = True  # each instruction waited for: also when its call returned
    step(params, tx.init(params), batch)
    assert step.get_last_executable() is executable
    assert all(e.start <= e.returned <= e.end for e in executable.runtime.events)
    names = [c.name for c in executable.program.computations]
    assert names[:4] == ["stage0_forward", "stage1_forward", "stage0_backward", "stage1_backward"]
    assert all(n.startswith(("stage0_apply", "stage1_apply")) for n in names[4:])
    hlo = executable.get_hlo_text()
    assert isinstance(hlo, list) and len(hlo) == len(names) and "HloModule" in hlo[0]
    # Alpa's order: the forwards, the backwards from the last stage, apply-grad; each
    # program as a RUN calls it, a backward taking its gradients' running sums first.
    hlo_names = executable.get_hlo_names()
    assert hlo_names[:4] == [
        "stage0_forward",
        "stage1_forward",
        "stage1_backward",
        "stage0_backward",
    ]
    assert sorted(hlo_names) == sorted(names)
    texts = dict(zip(hlo_names, hlo, strict=True))
    programs = executable.stage_programs
    for kernel in executable.instructions.kernels:
        comp = executable.program.computations[kernel.computation]
        sums = [a.marker_out for a in kernel.accumulate if a.reads_sum]
        assert sums or comp.kind != "backward", comp.name
        per_device = [programs.sharding(v, comp.stage).shard_shape(v.aval.shape) for v in sums]
        shapes = [f"f32[{','.join(map(str, shape))}]" for shape in per_device]
        assert entry_shapes(texts[comp.name])[0][: len(sums)] == shapes, comp.name
    # Each computation allocates at least its arguments, each as its stage holds it.
    programs = executable.stage_programs
    for comp, size in zip(
        executable.program.computations, executable.get_stage_allocation_size(), strict=True
    ):
        arguments = sum(
            math.prod(programs.sharding(v, comp.stage).shard_shape(v.aval.shape))
            * v.aval.dtype.itemsize
            for v in comp.invars
        )
        assert size >= arguments > 0, comp.name
    path = tmp_path / "trace.json"
    executable.dump_stage_execution_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    runs = [e for e in events if e["ph"] == "X" and "stage0_forward" in e["name"]]
    assert len(runs) == 2 and {e["tid"] for e in events} == {0, 1}
    out_specs = executable.get_output_placement_specs()
    assert out_specs[0]["w1"].mesh_ids == (1,)
    executable.dump_debug_info(str(tmp_path / "debug"))
    assert "F0" in (tmp_path / "debug" / "schedule.txt").read_text()
    # Each program's file holds that program's HLO (names and texts in one order).
    for name, text in zip(executable.get_hlo_names(), executable.get_hlo_text(), strict=True):
        assert (tmp_path / "debug" / f"{name}.hlo").read_text() == text

    # Alpa's stage execution info: per computation, every traced run (the untraced first
    # step is not there), on its stage's devices, in order, each waited for.
    info = executable.get_stage_execution_info()
    assert len(info) == len(names) and len(info[0]) == 2
    runs = executable.instructions.instructions
    counts = {}
    for ins in runs:
        if ins.op is Op.RUN:
            c = executable.instructions.kernels[ins.computation].computation
            counts[c] = counts.get(c, 0) + 1
    assert [len(r) for r in info] == [counts.get(c, 0) for c in range(len(names))]
    for comp, comp_runs in zip(executable.program.computations, info, strict=True):
        for start, stop, hosts, devices in comp_runs:
            assert start <= stop and hosts == (0,)
            assert devices == tuple(executable.meshes[comp.stage].devices.flat)
    # global_config.collect_trace traces every pipelined step, accumulating.
    executable.collect_trace = False
    alpa.global_config.collect_trace = True
    try:
        before = time.time()
        step(params, tx.init(params), batch)
        after = time.time()
    finally:
        alpa.global_config.collect_trace = False
    info = executable.get_stage_execution_info()
    assert len(info[0]) == 4
    assert all(before <= start <= stop <= after for start, stop, _, _ in info[0][2:])
    step(params, tx.init(params), batch)  # not traced
    assert len(executable.get_stage_execution_info()[0]) == 4


# ----------------------------------------------------------------------------- bad input


def _compile_two_layers(**method_kwargs):
    params, batch = _mlp(2)
    tx = optax.sgd(0.1)
    step = alpa.parallelize(
        _train_step(_mlp_loss(2), tx, alpa.value_and_grad),
        method=PipeshardParallel(**method_kwargs),
        batch_argnums=(2,),
    )
    return step.get_executable(params, tx.init(params), batch)


def test_layer_ids_that_skip_or_repeat():
    with pytest.raises(
        ValueError,
        match=r"forward_stage_layer_ids \[\[0\], \[2\]\] must list "
        r"layers 0..1 in order, each exactly once",
    ):
        ManualStageOption([[0], [2]], [(1, 4), (1, 4)])
    with pytest.raises(ValueError, match=r"\[\[0, 1\], \[1\]\] must list layers 0..2"):
        ManualStageOption([[0, 1], [1]], [(1, 4), (1, 4)])


def test_submeshes_that_need_too_many_devices():
    devices_or_skip(8)
    option = ManualStageOption([[0], [1]], [(1, 4), (1, 6)])
    with pytest.raises(
        ValueError,
        match=r"submesh_physical_shapes \[\[1, 4\], \[1, 6\]\] "
        r"need 10 devices but only 8 exist",
    ):
        _compile_two_layers(stage_option=option)


def test_boundary_count_must_match_stage_assignment():
    devices_or_skip(8)
    option = ManualStageOption([[0], [1], [2]], [(1, 2), (1, 2), (1, 2)])
    with pytest.raises(
        ValueError,
        match=r"the step has 2 layers \(1 mark_pipeline_boundary "
        r"calls\) but forward_stage_layer_ids assigns 3 layers",
    ):
        _compile_two_layers(stage_option=option)


def test_num_micro_batches_must_divide_batch():
    devices_or_skip(8)
    with pytest.raises(ValueError, match=r"num_micro_batches=3 does not divide batch size 16"):
        _compile_two_layers(num_micro_batches=3)


def test_unknown_schedule():
    with pytest.raises(
        ValueError,
        match=r"unknown pipeline_schedule 'interleaved'; expected "
        r"one of \['1f1b', 'dualpipev', 'gpipe', 'inference', 'interleaved-1f1b', 'zb-h1'\] "
        r"or 'auto'",
    ):
        PipeshardParallel(pipeline_schedule="interleaved")
    devices_or_skip(8)
    with pytest.raises(
        ValueError,
        match=r"pipeline_schedule='inference' cannot run a "
        r"training step",
    ):
        _compile_two_layers(pipeline_schedule="inference")


def test_gradients_stay_on_their_stage_and_buffers_die_after_last_use():
    devices_or_skip(8)
    executable = _executable("1f1b", 4, num_layers=4)
    program, instructions = executable.program, executable.instructions
    # Every accumulated gradient is produced (and accumulated) on the stage that owns the
    # parameter, so no gradient crosses meshes.
    names = executable._names
    accumulated = {names[out] for out in program.accumulated}
    for ins in instructions.instructions:
        if ins.op == "RESHARD":
            (src,), (dst,) = ins.inputs, ins.outputs
            assert src[2] != dst[2] and src[0] == dst[0]
            assert src[0] not in accumulated
    # The backward of stage s runs on mesh s and stage s's parameters only live there.
    specs = executable.get_input_placement_specs()[0]
    assert [specs[f"w{i}"].mesh_ids for i in range(4)] == [(0,), (1,), (2,), (3,)]
    # Each buffer that is not an input or an output is freed by the instruction that uses
    # it last, and never used after that.
    assert {ins.op for ins in instructions.instructions} <= {"LOAD", "RUN", "ALLOC", "RESHARD"}
    last_use, freed = {}, set()
    for i, ins in enumerate(instructions.instructions):
        for key in ins.inputs + ins.outputs:
            assert key not in freed, f"{key} used after it was freed"
            last_use[key] = i
        for key in ins.free:
            assert key not in freed and last_use[key] == i
            freed.add(key)
    output_keys = instructions.output_keys()
    assert set(last_use) - freed == (set(last_use) & (instructions.persistent | output_keys))


def _sharded_weights(executable, stage):
    """Step inputs on ``stage``'s mesh that are not batch leaves but are split."""
    program = executable.program
    jaxpr = executable.traced.closed_jaxpr.jaxpr
    split = []
    for v, is_batch in zip(jaxpr.invars, executable.traced.batch_invars, strict=True):
        if is_batch or stage not in program.input_stages[v]:
            continue
        if any(entry is not None for entry in executable._sharding(v, stage).spec):
            split.append(v)
    return split


def test_stages_use_the_ilp_and_honour_per_stage_options():
    # Batch 4, hidden 64: splitting the weights (model parallel) beats data parallel.
    devices = devices_or_skip(8)
    loss = _mlp_loss(2)
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    hidden = 64
    params = {
        f"w{i}": jax.random.normal(keys[i], (hidden, hidden)) / np.sqrt(hidden) for i in range(2)
    }
    params.update({f"b{i}": jnp.zeros((hidden,)) for i in range(2)})
    batch = (jax.random.normal(keys[2], (4, hidden)), jax.random.normal(keys[3], (4, hidden)))
    stage_option = ManualStageOption(
        [[0], [1]],
        [(1, 4), (1, 4)],
        submesh_logical_shapes=[(1, 4), (1, 4)],
        submesh_autosharding_option_dicts=[{"force_data_parallel": True}, {}],
    )
    method = PipeshardParallel(devices, num_micro_batches=2, stage_option=stage_option)
    executable = _check_against_serial(loss, params, batch, method, tx=optax.sgd(0.1))
    assert executable.options[0].force_data_parallel
    assert not executable.options[1].force_data_parallel
    # Stage 0 is data parallel: every parameter replicated, no ILP.
    assert _sharded_weights(executable, 0) == []
    assert 0 not in executable.stage_objectives
    # Stage 1 comes from the ILP, which splits its weight over the 4 devices.
    assert 1 in executable.stage_objectives
    split = _sharded_weights(executable, 1)
    assert any(v.aval.shape == (hidden, hidden) for v in split), split


def test_default_auto_sharding_option_force_data_parallel_applies_to_every_stage():
    devices = devices_or_skip(8)
    params, batch = _mlp(2, hidden=64)
    option = alpa.AutoShardingOption(force_data_parallel=True)
    method = PipeshardParallel(devices, num_micro_batches=2, default_auto_sharding_option=option)
    executable = _check_against_serial(_mlp_loss(2), params, batch, method, steps=1)
    assert executable.stage_objectives == {}
    assert _sharded_weights(executable, 0) == [] and _sharded_weights(executable, 1) == []


def test_remat_layer_matches_serial_and_keeps_fewer_activations():
    from alpa.pipeline_parallel.layers.layer_construction import ManualLayerOption

    devices = devices_or_skip(4)
    params, batch = _mlp(4, hidden=32)
    executables = {}
    for remat in (False, True):
        method = PipeshardParallel(
            devices,
            num_micro_batches=8,
            pipeline_schedule="gpipe",
            layer_option=ManualLayerOption(remat_layer=remat),
            stage_option=UniformStageOption(num_stages=2, submesh_physical_shape=(1, 1)),
        )
        executables[remat] = _check_against_serial(_mlp_loss(4), params, batch, method)
    plain, remat = executables[False], executables[True]
    for stage in range(2):
        fwd_plain = plain.program.computation(stage, "forward")
        fwd_remat = remat.program.computation(stage, "forward")
        assert len(fwd_remat.outvars) < len(fwd_plain.outvars)
        # The backward recomputes instead: it reads no value of its own forward.
        bwd = remat.program.computation(stage, "backward")
        own = {v for e in fwd_remat.eqns for v in e.outvars}
        assert not own & set(bwd.invars)


def _hlo_by_computation(executable) -> dict[str, str]:
    return dict(zip(executable.get_hlo_names(), executable.get_hlo_text(), strict=True))


def _data_parallel_two_stages():
    """A 2-stage MLP (hidden 16), force_data_parallel, 2 micro-batches, sgd, checked
    against serial; its executable and the HLO of each stage computation."""
    devices_or_skip(8)
    params, batch = _mlp(2, hidden=16)
    option = alpa.AutoShardingOption(force_data_parallel=True)
    method = PipeshardParallel(num_micro_batches=2, default_auto_sharding_option=option)
    executable = _check_against_serial(
        _mlp_loss(2), params, batch, method, tx=optax.sgd(0.1), steps=1
    )
    return executable, _hlo_by_computation(executable)


def test_data_parallel_stage_reads_parameters_replicated():
    """A layer's start marker passes its parameters along with the activation; they stay
    parameters (replicated in a data-parallel stage), so no stage computation gathers a
    weight, and the accumulated gradients are replicated."""
    from alpa.util import count_communication_primitives

    executable, hlo = _data_parallel_two_stages()
    for name, text in hlo.items():
        assert count_communication_primitives(text, True).all_gather == 0, name
    program = executable.program
    for out in program.accumulated:
        assert executable.stage_programs.sharding(out, program.home[out]).is_fully_replicated


def test_data_parallel_stage_reduces_gradients_once_per_step():
    """force_data_parallel, 2 micro-batches: each stage's backward (run per micro-batch)
    neither all-reduces nor reduce-scatters a gradient; its apply-grad (once per step)
    all-reduces them (deferred_sums)."""
    from alpa.util import count_communication_primitives

    _, hlo = _data_parallel_two_stages()
    for stage in range(2):
        backward = count_communication_primitives(hlo[f"stage{stage}_backward"], True)
        apply = count_communication_primitives(hlo[f"stage{stage}_apply_0"])
        assert backward.all_reduce == 0 and backward.reduce_scatter == 0, backward
        assert apply.all_reduce >= 1, apply


@pytest.mark.parametrize("clip", [False, True])
def test_zero2_stage_gathers_parameters_once_per_step(clip):
    """force_data_parallel + prefer_reduce_scatter: two stages on (1, 4), 2 micro-batches of
    8 rows, adam (after a global-norm clip, which reads each gradient at two apply levels),
    parameters and optimizer state donated. Per stage (w [16, 16], b [16]): the backward,
    run once per micro-batch, has no collective at all; apply-grad, once per step,
    reduce-scatters the 2 gradients in one packed reduce-scatter (each device's rows of
    both, 4 x 16 + 4 elements) and all-gathers the 2 updated parameters, computed on
    those rows, in one packed all-gather (the clip's
    norm adds only all-reduces of scalars); adam's moments stay split 4 ways, the
    parameters replicated; numerics equal serial."""
    from alpa.util import collective_shapes, count_communication_primitives

    devices_or_skip(8)
    params, batch = _mlp(2, hidden=16)
    adam = optax.adam(1e-2)
    tx = optax.chain(optax.clip_by_global_norm(0.3), adam) if clip else adam
    option = alpa.AutoShardingOption(force_data_parallel=True, prefer_reduce_scatter=True)
    method = PipeshardParallel(num_micro_batches=2, default_auto_sharding_option=option)
    step = alpa.parallelize(
        _train_step(_mlp_loss(2), tx, alpa.value_and_grad),
        method=method,
        batch_argnums=(2,),
        donate_argnums=(0, 1),
    )
    serial = jax.jit(_train_step(_mlp_loss(2), tx, jax.value_and_grad))
    ref_state = (params, tx.init(params))
    state = jax.tree.map(jnp.copy, ref_state)
    for _ in range(2):
        ref = serial(*ref_state, batch)
        out = step(*state, batch)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
        ref_state, state = ref[:2], out[:2]
    new_params, opt_state, _ = out
    assert all(p.sharding.is_fully_replicated for p in jax.tree.leaves(new_params))
    moments = [x for x in jax.tree.leaves(opt_state) if x.ndim]
    assert len(moments) == 8
    assert all(x.sharding.shard_shape(x.shape)[0] == x.shape[0] // 4 for x in moments)

    executable = step.get_last_executable()
    assert len(executable.plan.summary()["gradients_reduced_once_per_step"]) == 4
    hlo = _hlo_by_computation(executable)
    for stage in range(2):
        backward = count_communication_primitives(hlo[f"stage{stage}_backward"], True)
        assert backward.total == 0, backward
        applies = [h for n, h in hlo.items() if n.startswith(f"stage{stage}_apply")]
        scattered = sorted(s for h in applies for s in collective_shapes(h, "reduce-scatter"))
        gathered = sorted(s for h in applies for s in collective_shapes(h, "all-gather"))
        reduced = [s for h in applies for s in collective_shapes(h, "all-reduce")]
        assert scattered == [f"f32[1,{4 * 16 + 4}]"], scattered
        assert gathered == [f"f32[4,{4 * 16 + 4}]"], gathered
        assert all(s == "f32[]" for s in reduced) and (not reduced or clip), reduced


@pytest.mark.parametrize("replicate_activation", [False, True])
def test_resharded_bytes_follow_the_tile_plan(replicate_activation):
    """Two data-parallel stages on (1, 4) and (1, 4), 2 micro-batches of [8, 8] float32: per
    micro-batch the activation crosses forward and its cotangent backward, each element
    once: 2 x 2 x 8 x 8 x 4 = 1024 bytes per step. Replicating the activation on stage 1
    (its first input) does not change the count: the tile plan sends each piece once to the
    destination host, which copies it to its 4 devices (not 4 x 256 bytes)."""
    devices_or_skip(8)
    params, batch = _mlp(2)
    pins = None
    if replicate_activation:
        pins = [None, [jax.sharding.PartitionSpec(), None, None, None]]
    method = PipeshardParallel(
        num_micro_batches=2,
        stage_option="uniform",
        default_auto_sharding_option=alpa.AutoShardingOption(force_data_parallel=True),
        stage_input_shardings=pins,
    )
    executable = _check_against_serial(
        _mlp_loss(2), params, batch, method, tx=optax.sgd(0.1), steps=1
    )
    names = executable.get_stage_input_names()[1]
    assert names[0].endswith("float32[8,8]") and "argument" not in names[0], names
    assert executable.get_resharded_bytes() == 2 * 2 * 8 * 8 * 4
    sent = [e.args["bytes"] for e in executable.runtime.events if e.name.startswith("reshard")]
    assert sent == [256] * 4, sent
    runtime = executable.runtime
    specs = [
        runtime.sharding_of(ins.outputs[0]).spec
        for ins in runtime.program.instructions
        if ins.op == "RESHARD"
    ]
    P = jax.sharding.PartitionSpec
    forward = P() if replicate_activation else P(("x", "y"))
    assert specs == [forward, P(("x", "y"))] * 2, specs


def _tiles(sharding, shape) -> list:
    """Per device of the sharding's mesh (flat, host-major), the box JAX gives it."""
    indices = sharding.devices_indices_map(shape)
    return [
        tuple(s.indices(n)[:2] for s, n in zip(indices[d], shape, strict=True))
        for d in sharding.mesh.devices.flat
    ]


@pytest.mark.parametrize("submeshes", [[(1, 4), (1, 4)], [(1, 2), (1, 6)]])
def test_every_reshard_has_its_tile_plan_in_the_plan(submeshes):
    """The plan records every RESHARD's tile plan (``PipeshardPlan.reshards``). Checked
    against JAX itself: the source and destination tiles of each plan are the ones JAX
    lays out for the shardings the compiled stages use; executed on numpy, the pieces
    rebuild every destination tile exactly, each element written once, and each element
    crosses once per destination host. The executable counts the plan's bytes before its
    first call, and the same step planned again gives the same tile plans."""
    devices_or_skip(8)
    params, batch = _mlp(2, hidden=12)
    stage_option = ManualStageOption([[0], [1]], submeshes)
    method = PipeshardParallel(num_micro_batches=2, stage_option=stage_option)
    tx = optax.sgd(0.1)
    step = alpa.parallelize(
        _train_step(_mlp_loss(2), tx, alpa.value_and_grad), method=method, batch_argnums=(2,)
    )
    args = (params, tx.init(params), batch)
    executable = step.get_executable(*args)
    plan = executable.plan
    instructions = plan.instructions.instructions
    reshards = [i for i, ins in enumerate(instructions) if ins.op == "RESHARD"]
    assert len(reshards) == 4 and sorted(plan.reshards) == reshards
    assert executable.get_resharded_bytes() == plan.resharded_bytes() > 0
    var_of = {name: v for v, name in plan.names.items()}
    rng = np.random.default_rng(0)
    for i in reshards:
        (src,), (dst,) = instructions[i].inputs, instructions[i].outputs
        transfer, aval = plan.reshards[i], var_of[src[0]].aval
        assert transfer.shape == aval.shape and transfer.dtype == np.dtype(aval.dtype).name
        src_sharding = executable.runtime.sharding_of(src)
        dst_sharding = executable.runtime.sharding_of(dst)
        assert transfer.dst_layout == plan.buffer_layout(dst)
        assert dst_sharding.spec == transfer.dst_layout.spec
        assert src_sharding.spec == plan.buffer_layout(src).spec
        assert list(transfer.src_boxes) == _tiles(src_sharding, aval.shape)
        assert list(transfer.dst_boxes) == _tiles(dst_sharding, aval.shape)
        x = rng.standard_normal(aval.shape)
        out = [np.full([b - a for a, b in box], np.nan) for box in transfer.dst_boxes]
        written = [np.zeros(o.shape, int) for o in out]
        per_host = submeshes[dst[2]][1]
        for piece in transfer.pieces:
            inside = zip(piece.box, transfer.src_boxes[piece.src_device], strict=True)
            assert all(s0 <= lo < hi <= s1 for (lo, hi), (s0, s1) in inside)
            for d in piece.dst_devices:
                assert d // per_host == piece.dst_host
                local = tuple(
                    slice(lo - t0, hi - t0)
                    for (lo, hi), (t0, _) in zip(piece.box, transfer.dst_boxes[d], strict=True)
                )
                out[d][local] = x[tuple(slice(lo, hi) for lo, hi in piece.box)]
                written[d][local] += 1
        for d, box in enumerate(transfer.dst_boxes):
            np.testing.assert_array_equal(out[d], x[tuple(slice(a, b) for a, b in box)])
            assert (written[d] == 1).all()
        hosts = {d // per_host for d in range(len(transfer.dst_boxes))}
        once_per_host = sum(
            np.prod([b - a for a, b in box])
            for h in hosts
            for box in {transfer.dst_boxes[d] for d in range(len(out)) if d // per_host == h}
        )
        assert transfer.nbytes() == once_per_host * aval.dtype.itemsize
    again = step.plan(*args)
    assert again.summary()["reshards"] == plan.summary()["reshards"]
    assert json.loads(plan.to_json())["reshards"] == plan.summary()["reshards"]
    step(*args)
    sent = [e.args["bytes"] for e in executable.runtime.events if e.name.startswith("reshard")]
    assert sum(sent) == plan.resharded_bytes()


def test_inference_scalar_loss_is_the_mean_over_micro_batches():
    """A scalar computed from the batch (a mean loss) comes back as the mean over the
    micro-batches, the full batch's value; an integer scalar is the last micro-batch's
    (Alpa's test_inference_only reports the loss this way)."""
    devices_or_skip(8)
    params, (x, y) = _mlp(2)

    def evaluate(params, x, y):
        h = jnp.tanh(x @ params["w0"] + params["b0"])
        alpa.mark_pipeline_boundary()
        out = jnp.tanh(h @ params["w1"] + params["b1"])
        return jnp.mean((out - y) ** 2), out, jnp.argmax(out[0])

    method = PipeshardParallel(num_micro_batches=4, pipeline_schedule="inference")
    f = alpa.parallelize(evaluate, method=method, batch_argnums=(1, 2))
    loss, out, last = f(params, x, y)
    ref_loss, ref_out, _ = evaluate(params, x, y)
    assert loss.shape == ()
    np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-4, atol=1e-4)
    size = x.shape[0] // 4
    assert int(last) == int(evaluate(params, x[-size:], y[-size:])[2])


def _transformer(name, num_layers=2):
    from alpa.model.bert import BertConfig, get_bert_train_state_and_step
    from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step
    from alpa.model.moe import MoEConfig, get_moe_train_state_and_step

    small = dict(
        hidden_size=32, num_layers=num_layers, num_heads=2, add_manual_pipeline_markers=True
    )
    if name == "gpt":
        config = GPTConfig(seq_len=16, vocab_size=64, **small)
        return lambda grad: get_gpt_train_state_and_step(config, 8, grad_func=grad)
    if name == "moe":
        config = MoEConfig(num_experts=2, seq_len=16, vocab_size=64, **small)
        return lambda grad: get_moe_train_state_and_step(config, 8, grad_func=grad)
    config = BertConfig(vocab_size=64, max_position_embeddings=16, **small)
    return lambda grad: get_bert_train_state_and_step(config, 8, seq_len=16, grad_func=grad)


@pytest.mark.parametrize(
    "model, num_stages, remat",
    [("gpt", 2, False), ("gpt", 4, False), ("moe", 2, False), ("gpt", 2, True)],
)
def test_zero_bubble_on_attention_stacks(model, num_stages, remat):
    """ZB-H1 (the backward of every stage but the first split into B and W) on GPT stacks
    of 2 and 4 stages, with layer rematerialization too, and on MoE: parameters and the
    loss equal serial. (BERT's masked loss over 4 micro-batches differs from serial's
    under every schedule: its mean is normalised per micro-batch.)"""
    devices_or_skip(8)
    make = _transformer(model, num_layers=num_stages)
    state, batch, step = make(alpa.value_and_grad)
    ref_state, _, ref_step = make(jax.value_and_grad)
    expected = jax.jit(ref_step)(ref_state, batch)
    method = PipeshardParallel(
        num_micro_batches=4,
        pipeline_schedule="zb-h1",
        layer_option=alpa.ManualLayerOption(remat_layer=remat),
        stage_option="uniform",
    )
    p_step = alpa.parallelize(step, method=method, donate_argnums=())
    out = p_step(state, batch)
    alpa.testing.assert_allclose(out[0].params, expected[0].params)
    alpa.testing.assert_allclose(out[1], expected[1])
    program = p_step.get_last_executable().program
    weights = [c.stage for c in program.computations if c.kind == "weight"]
    assert weights == list(range(1, num_stages)), weights


@pytest.mark.parametrize("model", ["gpt", "moe", "bert"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_remat_layer_on_attention_stacks(model, schedule):
    """remat_layer=True on 2-stage GPT, MoE and BERT steps (Alpa's own cases): the
    recomputed forward may read a value the split also copied into the backward (the
    attention mask), which failed with a KeyError."""
    devices_or_skip(8)
    make = _transformer(model)
    state, batch, step = make(alpa.value_and_grad)
    ref_state, _, ref_step = make(jax.value_and_grad)
    expected = jax.jit(ref_step)(ref_state, batch)
    method = PipeshardParallel(
        num_micro_batches=2,
        pipeline_schedule=schedule,
        layer_option=alpa.ManualLayerOption(remat_layer=True),
        stage_option="uniform",
    )
    out = alpa.parallelize(step, method=method, donate_argnums=())(state, batch)
    alpa.testing.assert_allclose(out[0].params, expected[0].params)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
def test_the_runtime_holds_the_schedules_micro_batches_in_flight(schedule):
    """Four one-layer stages, 8 micro-batches: the most micro-batches whose activations a
    mesh held at once during the step, counted by the local runtime as it ran the
    instructions, is the schedule's bound: min(S - i, M) on stage i under 1F1B, min(S, M)
    on every stage under ZB-H1, M under GPipe; numerics equal serial."""
    devices_or_skip(8)
    S, M = 4, 8
    params, batch = _mlp(S)  # 16 rows: 2 per micro-batch, 1 per device of a stage
    method = PipeshardParallel(
        num_micro_batches=M,
        pipeline_schedule=schedule,
        stage_option=ManualStageOption([[i] for i in range(S)], [(1, 2)] * S),
    )
    executable = _check_against_serial(_mlp_loss(S), params, batch, method, steps=1)
    bound = {
        "1f1b": [min(S - i, M) for i in range(S)],
        "zb-h1": [min(S, M)] * S,
        "gpipe": [M] * S,
    }[schedule]
    assert executable.peak_live_micro_batches() == bound
    assert executable.plan.schedule.max_in_flight() == bound


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "dualpipev"])
@pytest.mark.parametrize("num_meshes", [2, 4])
def test_stages_share_meshes(schedule, num_meshes):
    """Interleaved 1F1B and DualPipeV: 2 p one-layer stages on p meshes of 8 / p devices
    (UniformStageOption splits the devices among the meshes), stage i on mesh i mod p, or
    min(i, 2 p - 1 - i) in DualPipeV's V, 2 p micro-batches: numerics equal serial over two
    steps (global-norm clipping reads every stage); the runtime held the schedule's
    activations in flight per mesh, min(2 (p - d - 1) + p + 1, 4 p) interleaved, 2 p + 1
    in the V; nothing stays alive; only the reshards between meshes have tile plans and
    move bytes."""
    devices_or_skip(8)
    p = num_meshes
    M = 2 * p
    params, batch = _mlp(2 * p)
    method = PipeshardParallel(
        num_micro_batches=M, pipeline_schedule=schedule, stage_option=UniformStageOption(2 * p)
    )
    executable = _check_against_serial(_mlp_loss(2 * p), params, batch, method)
    plan = executable.stage_plan
    if schedule == "dualpipev":
        assert plan.stage_meshes == tuple(min(s, 2 * p - 1 - s) for s in range(2 * p))
        bound = [2 * p + 1] * p
    else:
        assert plan.stage_meshes == tuple(s % p for s in range(2 * p))
        bound = [min(2 * (p - d - 1) + p + 1, 2 * M) for d in range(p)]
    assert len(set(plan.device_ranges)) == p
    assert [b - a for a, b in plan.device_ranges] == [8 // p] * (2 * p)
    assert executable.schedule.max_in_flight_per_mesh() == bound
    assert executable.peak_live_micro_batches() == bound
    assert executable.live_buffers_after_step() == []
    reshards = [
        (i, ins)
        for i, ins in enumerate(executable.instructions.instructions)
        if ins.op.name == "RESHARD"
    ]
    meshes = plan.stage_meshes
    crossing = [i for i, ins in reshards if meshes[ins.inputs[0][2]] != meshes[ins.mesh]]
    assert len(crossing) < len(reshards)  # between stages of a mesh: the global norm's sums
    assert sorted(executable.plan.reshards) == crossing
    assert executable.get_resharded_bytes() == executable.plan.resharded_bytes() > 0


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "dualpipev"])
def test_shared_meshes_gpt_stack(schedule):
    """Interleaved 1F1B and DualPipeV on a 4-block GPT, one block per stage, two stages
    per mesh of 4 devices: parameters and the loss equal serial."""
    devices_or_skip(8)
    make = _transformer("gpt", num_layers=4)
    state, batch, step = make(alpa.value_and_grad)
    ref_state, _, ref_step = make(jax.value_and_grad)
    expected = jax.jit(ref_step)(ref_state, batch)
    method = PipeshardParallel(
        num_micro_batches=4,
        pipeline_schedule=schedule,
        layer_option=alpa.ManualLayerOption(),
        stage_option=ManualStageOption([[0], [1], [2], [3]], [(1, 4)] * 4),
    )
    p_step = alpa.parallelize(step, method=method, donate_argnums=())
    out = p_step(state, batch)
    alpa.testing.assert_allclose(out[0].params, expected[0].params)
    alpa.testing.assert_allclose(out[1], expected[1])
    placed = {"interleaved-1f1b": (0, 1, 0, 1), "dualpipev": (0, 1, 1, 0)}[schedule]
    assert p_step.get_last_executable().stage_plan.stage_meshes == placed


def test_interleaved_stage_options_that_cannot_share_meshes():
    """Stage i runs on mesh i mod p: its submesh must be that mesh's; the stage DP places
    one stage per mesh; each error says what to change."""
    params, batch = _mlp(4)

    def plan(stage_option):
        method = PipeshardParallel(
            num_micro_batches=2, pipeline_schedule="interleaved-1f1b", stage_option=stage_option
        )
        _check_against_serial(_mlp_loss(4), params, batch, method, steps=1)

    with pytest.raises(ValueError, match=r"stage 3 runs on mesh 1 with stage 1 .* physical"):
        plan(ManualStageOption([[0], [1], [2], [3]], [(1, 2), (1, 2), (1, 2), (1, 4)]))
    with pytest.raises(ValueError, match=r"places 2 stages on each mesh, but there are 3 st"):
        plan(ManualStageOption([[0], [1], [2, 3]], [(1, 2)] * 3))
    with pytest.raises(ValueError, match="stage_option='auto' places one stage per mesh"):
        plan(alpa.AutoStageOption())
    # Interleaved stages (0, 1, 0, 1) replayed under DualPipeV, which places them in a V.
    method = PipeshardParallel(
        num_micro_batches=4, pipeline_schedule="interleaved-1f1b", stage_option="uniform"
    )
    step = alpa.parallelize(
        _train_step(_mlp_loss(4), optax.adam(1e-2), alpa.value_and_grad),
        method=method,
        batch_argnums=(2,),
    )
    args = (params, optax.adam(1e-2).init(params), batch)
    recorded = step.get_executable(*args).get_parallel_plan()
    other = dataclasses.replace(
        recorded,
        pipeline_plan=dataclasses.replace(recorded.pipeline_plan, pipeline_schedule="dualpipev"),
    )
    replay = alpa.parallelize(step.fun, method=alpa.plan_to_method(other), batch_argnums=(2,))
    with pytest.raises(ValueError, match=r"the stages were placed on meshes \[0, 1, 0, 1\]"):
        replay.get_executable(*args)
