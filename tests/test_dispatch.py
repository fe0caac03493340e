"""Dispatch: what ``import alpa`` exposes, one compile per step, and cache hits that neither
recompile nor copy inputs already in place (``docs/dispatch.md``).

Compiles are counted as XLA backend compiles reported through ``jax.monitoring``; each test
that asserts "no compile" also shows the counter counting (the first call, a new static
value, a new shape), so the assertion can fail.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import devices_or_skip
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding, PartitionSpec

import alpa
from alpa.testing import assert_allclose, regression_train_step

_COMPILES: list[str] = []


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES.append(event)


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def compiles() -> int:
    return len(_COMPILES)


# ----------------------------------------------------------------------------- import alpa


def test_import_alpa_exposes_the_submodules_of_the_tutorial():
    # The first lines of Alpa's tutorial, in a fresh interpreter: nothing imported but alpa.
    script = textwrap.dedent(
        """
        import types
        import alpa
        alpa.util.disable_tqdm_globally()
        assert alpa.global_env.global_config.use_tqdm is False
        for name in ("util", "testing", "device_mesh", "parallel_method",
                     "pipeline_parallel", "shard_parallel", "global_env"):
            assert isinstance(getattr(alpa, name), types.ModuleType), name
        alpa.testing.assert_allclose([1.0], [1.0])
        print("ok")
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# ----------------------------------------------------------------------------- one compile


class _Model:
    """A 2-layer MLP with a pipeline boundary between the layers (ignored by the one-mesh
    methods), as a flax-free apply function."""

    @staticmethod
    def apply(params, x):
        h = jnp.tanh(x @ params["w0"] + params["b0"])
        alpa.mark_pipeline_boundary()
        return jnp.tanh(h @ params["w1"] + params["b1"])


def _train_state(hidden=16, batch_size=32):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w0": jax.random.normal(keys[0], (hidden, hidden)) / 4,
        "b0": jnp.zeros((hidden,)),
        "w1": jax.random.normal(keys[1], (hidden, hidden)) / 4,
        "b1": jnp.zeros((hidden,)),
    }
    batch = {
        "x": jax.random.normal(keys[2], (batch_size, hidden)),
        "y": jax.random.normal(keys[3], (batch_size, hidden)),
    }
    # As users write it: step=0 is a Python int, an int32 array after the first step.
    state = TrainState.create(apply_fn=_Model.apply, params=params, tx=optax.adam(1e-2))
    assert isinstance(state.step, int)
    return state, batch


def _pipeshard(schedule="1f1b", num_micro_batches=4):
    return alpa.PipeshardParallel(
        num_micro_batches=num_micro_batches,
        layer_option="manual",
        stage_option=alpa.ManualStageOption([[0], [1]], [(1, 4), (1, 4)]),
        pipeline_schedule=schedule,
    )


METHODS = {
    "shard_parallel": lambda: alpa.ShardParallel(),
    "shard_parallel_2x4": lambda: alpa.ShardParallel(
        auto_sharding_option=alpa.AutoShardingOption(logical_mesh_shape=(2, 4))
    ),
    "data_parallel": lambda: alpa.DataParallel(),
    "data_parallel_micro_batches": lambda: alpa.DataParallel(num_micro_batches=2),
    "zero2": lambda: alpa.Zero2Parallel(),
    "zero3": lambda: alpa.Zero3Parallel(),
    "pipeshard_1f1b": lambda: _pipeshard("1f1b"),
    "pipeshard_gpipe": lambda: _pipeshard("gpipe"),
}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_train_state_create_step_compiles_once(name):
    devices_or_skip(8)
    state, batch = _train_state()
    parallel = alpa.parallelize(regression_train_step(alpa.grad), method=METHODS[name]())
    serial = jax.jit(regression_train_step(jax.grad))
    ref = state
    for _ in range(4):
        ref = serial(ref, batch)
    before = compiles()
    out = parallel(state, batch)  # donates the state
    assert compiles() > before  # the counter counts: the first call compiles
    for _ in range(3):  # calls 2, 3 and 4
        before = compiles()
        out = parallel(out, batch)
        assert compiles() == before, f"{name}: a cache hit compiled"
    assert_allclose(out.params, ref.params)
    assert int(out.step) == 4
    # Weakly typed, as under jax.jit.
    assert (out.step.dtype, out.step.weak_type) == (ref.step.dtype, ref.step.weak_type)


def test_static_python_float_compiles_once_and_again_when_it_changes():
    state, batch = _train_state()

    def step(state, batch, learning_rate):
        grads = alpa.grad(lambda p: jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2))(
            state.params
        )
        params = jax.tree.map(lambda p, g: p - learning_rate * g, state.params, grads)
        return state.replace(params=params, step=state.step + 1)

    ref = state
    for _ in range(4):
        ref = jax.jit(step, static_argnums=2)(ref, batch, 0.1)
    parallel = alpa.parallelize(step, method=alpa.DataParallel())
    out = parallel(state, batch, 0.1)
    before = compiles()
    for _ in range(3):
        out = parallel(out, batch, 0.1)
    assert compiles() == before
    assert_allclose(out.params, ref.params)
    parallel(out, batch, 0.05)  # a new static value is a new executable
    assert compiles() > before


# ----------------------------------------------------------------------------- cache hits


def test_cache_hit_refuses_other_shapes_and_structures():
    traces = []

    @alpa.parallelize(method=alpa.DataParallel())
    def step(w, batch):
        traces.append(jax.tree.structure(batch))
        return w + jnp.mean(jax.tree.leaves(batch)[0])

    def full(shape, value):  # a dtype, so that the array is not weakly typed
        return jnp.full(shape, value, jnp.float32)

    w = jnp.zeros(())
    assert float(step(w, {"x": full((8, 4), 1.0)})) == 1.0
    assert float(step(w, {"x": full((8, 4), 2.0)})) == 2.0
    assert len(traces) == 1
    # Another batch size: the last executable's dispatch refuses it, it is compiled anew.
    assert float(step(w, {"x": full((16, 4), 3.0)})) == 3.0
    # Same leaves, other structure: not silently run by the last executable.
    assert float(step(w, {"z": full((16, 4), 4.0)})) == 4.0
    assert len(traces) == 3
    # Back to the first shapes: the cached executable, no trace.
    assert float(step(w, {"x": full((8, 4), 5.0)})) == 5.0
    assert len(traces) == 3


def test_python_scalar_where_an_array_was_is_a_static_argument():
    traces = []

    @alpa.parallelize(method=alpa.DataParallel())
    def step(w, batch, scale):
        traces.append(type(scale))
        return w + scale * jnp.sum(batch)

    w, batch = jnp.zeros(()), jnp.ones((8,))
    assert float(step(w, batch, jnp.float32(2.0))) == 16.0
    assert float(step(w, batch, 3.0)) == 24.0  # Python float: static under "auto"
    assert float(step(w, batch, 3.0)) == 24.0
    assert len(traces) == 2


def _replicated_equivalent(x, mesh):
    # P(None, ...) is P(): equivalent, not equal, to the plan's sharding. From a fresh copy:
    # device_put may share a buffer with its source, which a donation would then delete.
    x = jnp.array(x, copy=True)
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec(*[None] * np.ndim(x))))


def test_inputs_in_an_equivalent_sharding_are_not_copied():
    devices = devices_or_skip(8)
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    state, batch = _train_state()
    ref = jax.jit(regression_train_step(jax.grad))(state, batch)
    parallel = alpa.parallelize(regression_train_step(alpa.grad), method=alpa.DataParallel())
    # The state is donated: an input used as it is (not copied) is deleted by the call.
    for _call in range(3):  # the slow path, then cache hits
        placed = jax.tree.map(lambda x: _replicated_equivalent(x, mesh), state)
        kernel = placed.params["w0"]
        specs = parallel.get_executable(placed, batch).get_input_placement_specs()
        planned = NamedSharding(mesh, specs[0].params["w0"].sharding_specs[0])
        assert kernel.sharding != planned and kernel.sharding.is_equivalent_to(planned, 2)
        out = parallel(placed, batch)
        assert kernel.is_deleted(), "an input in an equivalent sharding was copied"
        assert_allclose(out.params, ref.params)
    # Control: split by rows the kernel is not in place, so it is gathered into a new
    # buffer (and the input is not deleted).
    placed = jax.tree.map(lambda x: _replicated_equivalent(x, mesh), state)
    kernel = jax.device_put(state.params["w0"], NamedSharding(mesh, PartitionSpec("d")))
    placed = placed.replace(params={**placed.params, "w0": kernel})
    out = parallel(placed, batch)
    assert not kernel.is_deleted()
    assert_allclose(out.params, ref.params)


def test_inputs_that_keep_arriving_elsewhere_are_placed_without_recompiling():
    devices = devices_or_skip(8)
    state, batch = _train_state()
    parallel = alpa.parallelize(
        regression_train_step(alpa.grad), method=alpa.DataParallel(), donate_argnums=()
    )
    serial = jax.jit(regression_train_step(jax.grad))
    ref = serial(state, batch)
    parallel(state, batch)
    # A committed single-device batch: the dispatch refuses it, the slow path places it; from
    # then on the hit places it first. (jax's device_put from one device to the mesh compiles
    # a small program the first time, so compiles are counted from the second batch on.)
    assert_allclose(parallel(state, jax.device_put(batch, devices[1])).params, ref.params)
    before = compiles()
    for _ in range(3):
        moved = jax.device_put(batch, devices[1])
        assert_allclose(parallel(state, moved).params, ref.params)
    assert compiles() == before


# ----------------------------------------------------------------------------- pipelines

STAGES = 2


def _pipeline_executable(num_micro_batches, schedule="1f1b", **option):
    state, batch = _train_state()
    method = _pipeshard(schedule, num_micro_batches)
    if option:
        method.default_auto_sharding_option = alpa.AutoShardingOption(**option)
    parallel = alpa.parallelize(regression_train_step(alpa.grad), method=method)
    return parallel, parallel.get_executable(state, batch), state, batch


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_instructions_per_micro_batch(schedule):
    """A micro-batch costs exactly its stages' forward and backward RUNs and the two
    RESHARDs per stage boundary (activation forward, cotangent backward): no LOAD, no
    accumulation and no FREE instruction per micro-batch (the micro-batches of an input
    are loaded in one instruction, gradients accumulate inside the backward, buffers are
    freed by the instruction that reads them last)."""
    devices_or_skip(8)
    counts = {}
    for k in (4, 16):
        instructions = _pipeline_executable(k, schedule)[1].instructions
        assert {ins.op for ins in instructions.instructions} == {"LOAD", "RUN", "ALLOC", "RESHARD"}
        for mb in range(k):
            runs = [i for i in instructions.instructions if i.micro_batch == mb]
            assert len(runs) == 2 * STAGES and {i.op for i in runs} == {"RUN"}
        # x is read by stage 0, y by stage 1: one LOAD each, all micro-batches at once.
        assert instructions.count("LOAD") == 2
        counts[k] = len(instructions.instructions)
    per_micro_batch = 2 * STAGES + 2 * (STAGES - 1)
    assert counts[16] - counts[4] == 12 * per_micro_batch
    # The runtime this replaced ran 138 instructions for this step with 4 micro-batches.
    assert counts[4] <= 138 // 3, counts


def test_pipeline_accumulates_gradients_inside_the_backward():
    """Each backward RUN takes the running gradient sums as inputs and returns them updated,
    in place: XLA aliases every sum's input buffer to its output (counted in the HLO), and
    the sums are zeroed once per step (ALLOC), not per micro-batch."""
    devices_or_skip(8)
    executable = _pipeline_executable(4)[1]
    instructions, program = executable.instructions, executable.program
    with_sums = [k for k in instructions.kernels if any(a.reads_sum for a in k.accumulate)]
    backward = {i for i, c in enumerate(program.computations) if c.kind == "backward"}
    assert {k.computation for k in with_sums} >= backward
    # Every gradient alpa.grad marks, and nothing else: the loss it marks too is read by
    # nothing (alpa.grad drops it), so it is not summed.
    accumulated = {a.marker_out for k in with_sums for a in k.accumulate}
    params = executable.traced.closed_jaxpr.jaxpr.invars[1:5]
    assert len(accumulated) == len(params) == len(program.accumulated) - 1
    assert {v.aval.shape for v in accumulated} == {v.aval.shape for v in params}
    assert instructions.count("ALLOC") == len(with_sums)
    hlo = executable.get_hlo_text()
    for kernel in with_sums:
        header = hlo[kernel.computation].splitlines()[0]
        aliases = header.count("may-alias") + header.count("must-alias")
        assert aliases == len(kernel.accumulate), header


@pytest.mark.parametrize("option", [{}, {"force_data_parallel": True}])
def test_pipeline_state_comes_back_where_the_next_step_reads_it(option):
    """The updated state of a step is laid out as the next step wants its inputs (same mesh,
    same spec), so a step starts without resharding the state."""
    devices_or_skip(8)
    parallel, executable, state, batch = _pipeline_executable(2, **option)
    inputs = executable.get_input_placement_specs()[0]
    outputs = executable.get_output_placement_specs()
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(inputs)[0], jax.tree.leaves(outputs), strict=True
    ):
        name = jax.tree_util.keystr(path)
        assert (a.mesh_ids, a.sharding_specs) == (b.mesh_ids, b.sharding_specs), name
    serial = jax.jit(regression_train_step(jax.grad))
    ref = serial(serial(state, batch), batch)
    out = parallel(parallel(state, batch), batch)
    assert_allclose(out.params, ref.params)


def test_pipeline_error_during_a_cache_hit_is_not_retried():
    """A dispatch refuses arguments only before running anything; an error from inside a
    pipeline step surfaces (as a RuntimeError naming the step), and the step is not run a
    second time through the slow path."""
    devices_or_skip(8)
    parallel, executable, state, batch = _pipeline_executable(2)
    state = parallel(state, batch)  # the next call is a cache hit
    runs = []
    original = executable.runtime.run

    def failing_run(*args, **kwargs):
        runs.append(1)
        raise ValueError("injected failure inside the step")

    executable.runtime.run = failing_run
    with pytest.raises(RuntimeError, match="train_step: pipeline step failed: injected failure"):
        parallel(state, batch)
    assert len(runs) == 1
    executable.runtime.run = original
