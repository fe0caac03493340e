"""Micro-batches mean the same for every method: micro-batch j is rows j·B/k .. (j+1)·B/k of
the global batch, the step's batch statistics are over the micro-batch (across devices),
and the outputs of alpa.grad are averaged over the k micro-batches.

Oracles: a serial accumulation over the k contiguous chunks (jax.jit, no alpa), which a
strided or per-device split demonstrably misses; PipeshardParallel with one stage; and the
compiled HLO: one layout change per batch leaf before the loop, one gradient all-reduce
after it.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa
from alpa.pipeline_parallel.stages.stage_construction import UniformStageOption
from alpa.shard_parallel.gradients.micro_batches import layout_change_cost
from alpa.testing import assert_allclose, get_mlp_train_state_and_step
from alpa.util import (
    count_communication_primitives,
    count_micro_batch_communication,
)

BATCH = 64
LR = 0.1
ONE_MESH_METHODS = [alpa.ShardParallel, alpa.DataParallel, alpa.Zero2Parallel, alpa.Zero3Parallel]


def _chunks(batch, k: int, strided: bool = False) -> list:
    """The k micro-batches of ``batch``: contiguous (the semantics) or strided."""
    size = BATCH // k
    if strided:
        return [jax.tree.map(lambda a, j=j: a[j::k], batch) for j in range(k)]
    return [jax.tree.map(lambda a, j=j: a[j * size : (j + 1) * size], batch) for j in range(k)]


def _serial_accumulation(value_and_grad, params, chunks):
    """The mean over ``chunks`` of ``value_and_grad(params, chunk)``, each under jax.jit."""
    outs = [jax.jit(value_and_grad)(params, c) for c in chunks]
    return jax.tree.map(lambda *xs: sum(xs) / len(xs), *outs)


def _pipeshard(k: int):
    return alpa.PipeshardParallel(
        num_micro_batches=k, layer_option="manual", stage_option=UniformStageOption(1)
    )


def _run(step, method, *args):
    p_step = alpa.parallelize(step, method=method, donate_argnums=())
    return p_step(*args), p_step.get_last_executable()


# ----------------------------------------------------------------------------- masked mean


def _masked_loss(w, batch):
    """A mean over the rows the mask keeps, normalised per micro-batch (BERT's MLM loss)."""
    err = jnp.sum((batch["x"] @ w - batch["y"]) ** 2, axis=-1)
    return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])


def _masked_step(w, batch):
    loss, g = alpa.value_and_grad(_masked_loss)(w, batch)
    return w - LR * g, loss


@pytest.fixture(scope="module")
def masked():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
    rows = np.arange(BATCH)
    # Uneven: every other row, plus all of the first 21. Every 2-row chunk (8 devices'
    # shares of 4 micro-batches) keeps a row, so every split has a finite loss.
    mask = ((rows % 2 == 0) | (rows < 21)).astype(np.float32)
    batch = {
        "x": jnp.asarray(rng.standard_normal((BATCH, 8)), jnp.float32),
        "y": jnp.asarray(rng.standard_normal((BATCH, 4)), jnp.float32),
        "mask": jnp.asarray(mask),
    }
    return w, batch


def _masked_reference(w, batch, k: int, **split):
    loss, g = _serial_accumulation(jax.value_and_grad(_masked_loss), w, _chunks(batch, k, **split))
    return w - LR * g, loss


@pytest.mark.parametrize("k", [2, 4])
def test_masked_mean_oracle_depends_on_the_split(masked, k):
    """The oracle can fail: strided micro-batches, or k·8 per-device chunks (the behaviour
    this replaces), give other gradients."""
    w, batch = masked
    expected = _masked_reference(w, batch, k)
    for other in (_masked_reference(w, batch, k, strided=True), _masked_reference(w, batch, 8 * k)):
        assert np.max(np.abs(np.asarray(other[0] - expected[0]))) > 1e-3


@pytest.mark.parametrize("method_cls", ONE_MESH_METHODS)
@pytest.mark.parametrize("k", [2, 4])
def test_masked_mean_is_per_contiguous_micro_batch(masked, method_cls, k):
    w, batch = masked
    got, _ = _run(_masked_step, method_cls(num_micro_batches=k), w, batch)
    assert_allclose(got, _masked_reference(w, batch, k), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [2, 4])
def test_masked_mean_matches_pipeshard(masked, k):
    w, batch = masked
    pipelined, _ = _run(_masked_step, _pipeshard(k), w, batch)
    one_mesh, _ = _run(_masked_step, alpa.DataParallel(num_micro_batches=k), w, batch)
    assert_allclose(pipelined, _masked_reference(w, batch, k), rtol=1e-5, atol=1e-5)
    assert_allclose(one_mesh, pipelined, rtol=1e-5, atol=1e-5)


def _decayed_loss(w, batch):
    """A term that does not depend on the batch joins the row sums before alpa.grad."""
    return _masked_loss(w, batch) + 0.01 * jnp.sum(w**2)


def _decayed_step(w, batch):
    loss, g = alpa.value_and_grad(_decayed_loss)(w, batch)
    return w - LR * g, loss


def test_batch_free_gradient_term_is_counted_once(masked):
    """Weight decay adds the same value on every device; the sum over devices after the
    loop must count it once."""
    w, batch = masked
    k = 2
    got, executable = _run(_decayed_step, alpa.DataParallel(num_micro_batches=k), w, batch)
    loss, g = _serial_accumulation(jax.value_and_grad(_decayed_loss), w, _chunks(batch, k))
    assert_allclose(got, (w - LR * g, loss), rtol=1e-5, atol=1e-5)
    _, per_step, _ = count_micro_batch_communication(executable.get_program_texts())
    assert per_step.all_reduce == 1


# ----------------------------------------------------------------------------- BatchNorm


class _ConvBatchNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9)(x)
        x = nn.relu(x)
        return nn.Dense(2)(jnp.mean(x, axis=(1, 2)))


_MODEL = _ConvBatchNorm()


def _bn_loss(params, stats, batch):
    out, updates = _MODEL.apply(
        {"params": params, "batch_stats": stats}, batch["x"], mutable=["batch_stats"]
    )
    return jnp.mean((out - batch["y"]) ** 2), updates["batch_stats"]


def _bn_step(state, batch):
    (loss, stats), g = alpa.value_and_grad(_bn_loss, has_aux=True)(
        state["params"], state["batch_stats"], batch
    )
    params = jax.tree.map(lambda p, d: p - LR * d, state["params"], g)
    return {"params": params, "batch_stats": stats}, loss


@pytest.fixture(scope="module")
def conv_bn():
    rng = np.random.default_rng(1)
    batch = {
        "x": jnp.asarray(rng.standard_normal((BATCH, 6, 6, 3)), jnp.float32),
        "y": jnp.asarray(rng.standard_normal((BATCH, 2)), jnp.float32),
    }
    # Rows of the second half differ in scale: BatchNorm statistics depend on the split.
    batch["x"] = batch["x"].at[BATCH // 2 :].multiply(3.0)
    variables = _MODEL.init(jax.random.PRNGKey(0), batch["x"][:2])
    return {"params": variables["params"], "batch_stats": variables["batch_stats"]}, batch


def _bn_reference(state, batch, k: int, **split):
    def value_and_grad(params, chunk):
        return jax.value_and_grad(_bn_loss, has_aux=True)(params, state["batch_stats"], chunk)

    (loss, stats), g = _serial_accumulation(
        value_and_grad, state["params"], _chunks(batch, k, **split)
    )
    params = jax.tree.map(lambda p, d: p - LR * d, state["params"], g)
    return {"params": params, "batch_stats": stats}, loss


@pytest.mark.parametrize("k", [2, 4])
def test_batch_norm_oracle_depends_on_the_split(conv_bn, k):
    state, batch = conv_bn
    expected = _bn_reference(state, batch, k)
    for other in (_bn_reference(state, batch, k, strided=True), _bn_reference(state, batch, 8 * k)):
        diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), other, expected)
        assert max(jax.tree.leaves(diffs)) > 1e-3


@pytest.mark.parametrize("method_cls", ONE_MESH_METHODS)
@pytest.mark.parametrize("k", [2, 4])
def test_batch_norm_is_per_contiguous_micro_batch(conv_bn, method_cls, k):
    state, batch = conv_bn
    got, _ = _run(_bn_step, method_cls(num_micro_batches=k), state, batch)
    assert_allclose(got, _bn_reference(state, batch, k), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [2, 4])
def test_batch_norm_matches_pipeshard(conv_bn, k):
    state, batch = conv_bn
    pipelined, _ = _run(_bn_step, _pipeshard(k), state, batch)
    one_mesh, executable = _run(_bn_step, alpa.DataParallel(num_micro_batches=k), state, batch)
    assert_allclose(pipelined, _bn_reference(state, batch, k), rtol=1e-4, atol=1e-4)
    assert_allclose(one_mesh, pipelined, rtol=1e-4, atol=1e-4)
    # BatchNorm's statistics and their gradients are all-reduced in each micro-batch; the
    # parameters' gradients (convolution kernel, biases, dense kernel) once per step.
    texts = executable.get_program_texts()
    per_micro_batch, per_step, layout = count_micro_batch_communication(texts)
    assert per_micro_batch.total == per_micro_batch.all_reduce > 0
    assert per_step.total == per_step.all_reduce == 1
    assert layout.all_to_all == len(batch)


# ----------------------------------------------------------------------------- compiled HLO


def _count(pattern: str, hlo: str) -> int:
    return len(re.findall(pattern, hlo))


@pytest.mark.parametrize("k", [2, 4])
def test_layout_change_once_per_step_and_one_gradient_all_reduce(k):
    """An MLP with a plain mean loss under DataParallel: per batch leaf one all-to-all
    (XLA adds a collective-permute of the device order) in the program that cuts the
    batch into micro-batches, none per micro-batch; nothing communicates in the
    micro-batches' accumulate program; the gradients are reduced once per step, in one
    (tuple) all-reduce."""
    state, batch, train_step = get_mlp_train_state_and_step(64, 32, 2)
    _, executable = _run(train_step, alpa.DataParallel(num_micro_batches=k), state, batch)
    texts = executable.get_program_texts()
    assert sorted(texts) == ["accumulate", "accumulate_last", "apply", "prepare"]
    num_batch_leaves = len(jax.tree.leaves(batch))
    per_micro_batch, per_step, layout = count_micro_batch_communication(texts)
    assert layout == (num_batch_leaves, 0, 0, 0, num_batch_leaves)
    assert _count(r"collective-permute\(", texts["prepare"]) == num_batch_leaves
    assert per_micro_batch.total == 0
    assert per_step == (1, 1, 0, 0, 0)


def test_hlo_text_is_alpas_accumulate_and_apply_modules():
    """Alpa's ``get_hlo_text()`` of a micro-batched step, which its tests split at
    ``"HloModule"``: two modules, accumulate-grad (the parameters, one micro-batch and the
    accumulated gradients in; the gradients' one all-reduce, which
    ``grad_sync_channel_ids`` names, inside) and apply-grad (no collective)."""
    state, batch, train_step = get_mlp_train_state_and_step(64, 16, 2)
    _, executable = _run(train_step, alpa.DataParallel(num_micro_batches=2), state, batch)
    hlo = executable.get_hlo_text()
    empty, accumulate, apply = hlo.split("HloModule")
    assert empty == ""
    assert accumulate.startswith(" jit_accumulate_last,") and apply.startswith(" jit_apply,")
    assert count_communication_primitives(accumulate) == (1, 1, 0, 0, 0)
    assert count_communication_primitives(apply).total == 0
    (channel,) = re.findall(r" all-reduce\(.*channel_id=(\d+),", accumulate)
    assert executable.grad_sync_channel_ids == f".{channel}."
    # One micro-batch of 64 / 2 rows over 8 devices, not the whole batch, goes in.
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", accumulate).group(1)
    assert "f32[4,16]" in layout and "f32[8,16]" not in layout
    # The step's peak holds at least the state in and out (apply, nothing donated) beside
    # each device's share of the caller's batch.
    nbytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(state))
    batch_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(batch))
    assert executable.get_total_allocation_size() >= 2 * nbytes + batch_bytes // 8


def test_batch_statistic_is_reduced_per_micro_batch_and_gradient_once(masked):
    """The masked mean's normaliser (a scalar) is all-reduced in each micro-batch, as the
    serial program needs it; the gradient and the loss are all-reduced once, after it."""
    w, batch = masked
    _, executable = _run(_masked_step, alpa.DataParallel(num_micro_batches=2), w, batch)
    texts = executable.get_program_texts()
    per_micro_batch, per_step, layout = count_micro_batch_communication(texts)
    assert per_micro_batch.total == per_micro_batch.all_reduce == 1
    assert per_step.total == per_step.all_reduce == 1
    last = count_communication_primitives(texts["accumulate_last"], ignore_scalar_all_reduce=True)
    assert last.all_reduce == 1
    assert layout.all_to_all == len(batch)


def test_objective_prices_the_layout_change(masked):
    """auto_sharding_objective adds, per batch leaf split over the data axis, one
    all-to-all of each device's share of the whole leaf (alpha-beta closed form, Alpa's
    convention: priced on the tensor the axis's devices exchange, the whole leaf here)."""
    w, batch = masked
    k, n = 4, 8
    _, executable = _run(_masked_step, alpa.DataParallel(num_micro_batches=k), w, batch)
    mesh = executable.plan.logical_mesh
    alpha, beta = mesh.mesh_alpha[0], mesh.mesh_beta[0]
    expected = sum(alpha + beta * (n - 1) / n / n * x.nbytes * 1.5 for x in batch.values())
    cost = layout_change_cost(executable.traced, executable.plan, k)
    assert cost == pytest.approx(expected)
    assert layout_change_cost(executable.traced, executable.plan, 1) == 0.0
    assert executable.auto_sharding_objective > cost > 0


def test_batch_dims_are_read_off_the_jaxpr_without_a_retrace():
    """``batch_dims`` of a step whose every value the jaxpr rules follow: no retrace, and
    the dimensions equal those a trace at each per-device size shows."""
    from alpa.shard_parallel.gradients.micro_batches import batch_dims_for, retraced_batch_dims

    traced_shapes = []

    def step(w, x):
        traced_shapes.append(x.shape)

        def loss(w):
            h = jnp.tanh(x @ w)  # [rows, 8]
            return jnp.mean(h.reshape(-1, 2, 4) ** 2)  # rows x 2 groups of 4

        return w - LR * alpa.grad(loss)(w)

    w, x = jnp.ones((4, 8)), jnp.ones((16, 4))
    traced = alpa.parallelize(step, method=alpa.ShardParallel()).get_executable(w, x).traced
    traced_shapes.clear()
    together = batch_dims_for(traced, [2, 4, 1])
    assert traced_shapes == []
    assert set(together) == {2, 4}
    for n in (2, 4):
        assert together[n] == retraced_batch_dims(traced, n)
    dims = together[2]
    x_var, w_var = traced.jaxpr.invars[1], traced.jaxpr.invars[0]
    assert dims[x_var] == (0,) and dims[w_var] == ()
    reshaped = [e for e in traced.jaxpr.eqns if e.primitive.name == "reshape"]
    assert reshaped and all(dims[e.outvars[0]] == (0,) for e in reshaped)


@pytest.mark.filterwarnings("ignore:auto-sharding has no strategy rule for complex, fft")
def test_batch_dims_of_several_counts_come_from_one_retrace():
    """Where the jaxpr rules cannot follow the rows (here an ``fft``, which has none),
    ``batch_dims_for`` reads the dimensions of every data-parallel count off one retrace
    at their least common multiple; they equal each count's own, and a second request
    for a divisor reuses its trace."""
    from alpa.shard_parallel.gradients.micro_batches import batch_dims, batch_dims_for
    from alpa.tracing.batch_dims import static_batch_dims

    traced_shapes = []

    def step(w, x):
        traced_shapes.append(x.shape)

        def loss(w):
            h = jnp.fft.fft(jnp.tanh(x @ w)).real  # [rows, 8]
            return jnp.mean(h.reshape(-1, 2, 4) ** 2)  # rows x 2 groups of 4

        return w - LR * alpa.grad(loss)(w)

    w, x = jnp.ones((4, 8)), jnp.ones((16, 4))
    traced = alpa.parallelize(step, method=alpa.ShardParallel()).get_executable(w, x).traced
    assert static_batch_dims(traced.jaxpr, traced.batch_invars, 2) is None
    traced_shapes.clear()
    together = batch_dims_for(traced, [2, 4, 1])
    assert traced_shapes == [(4, 4)]  # one retrace, at lcm(2, 4) = 4
    assert set(together) == {2, 4}
    assert together[2] == together[4] == batch_dims(traced, 4)
    assert traced_shapes == [(4, 4)]  # the retrace at 4 was kept
    assert batch_dims(traced, 2) == together[2]  # counted alone: the same dimensions
    assert traced_shapes == [(4, 4), (8, 4)]
    dims = together[2]
    x_var, w_var = traced.jaxpr.invars[1], traced.jaxpr.invars[0]
    assert dims[x_var] == (0,) and dims[w_var] == ()
    reshaped = [e for e in traced.jaxpr.eqns if e.primitive.name == "reshape"]
    assert reshaped and all(dims[e.outvars[0]] == (0,) for e in reshaped)
    # Down to one row per device: still one retrace, at 16.
    traced_shapes.clear()
    assert batch_dims_for(traced, [8, 16]) == {8: together[2], 16: together[2]}
    assert traced_shapes == [(1, 4)]


def test_a_step_written_for_one_batch_size_still_runs_with_micro_batches():
    """A step whose shapes assume its (micro-)batch size cannot be traced at the
    per-device size (``retraced_batch_dims`` is ``None``); the jaxpr rules tie its
    fixed-size offset to the rows it is added to, so its row sums are deferred all the
    same, and the step matches the serial accumulation."""
    from alpa.shard_parallel.gradients.micro_batches import batch_dims, retraced_batch_dims

    k = 2
    rows = BATCH // k

    def step(w, x):
        def loss(w):
            offset = jnp.arange(rows, dtype=jnp.float32).reshape(rows, 1)  # fixed size
            return jnp.mean((x @ w + offset) ** 2)

        return w - LR * alpa.grad(loss)(w)

    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((BATCH, 8)), jnp.float32)
    f = alpa.parallelize(step, method=alpa.DataParallel(num_micro_batches=k))
    out = f(w, x)
    traced = f.get_last_executable().traced
    assert retraced_batch_dims(traced, 8) is None
    dims = batch_dims(traced, 8)
    offset = next(e for e in traced.jaxpr.eqns if e.primitive.name == "iota").outvars[0]
    assert dims[offset] == (0,)

    def serial_grad(w, chunk):
        offset = jnp.arange(rows, dtype=jnp.float32).reshape(rows, 1)
        return jax.grad(lambda w: jnp.mean((chunk @ w + offset) ** 2))(w)

    grads = [jax.jit(serial_grad)(w, x[j * rows : (j + 1) * rows]) for j in range(k)]
    np.testing.assert_allclose(out, w - LR * sum(grads) / k, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- a key in the batch


def _keyed_loss(w, batch):
    """An MLP's loss with noise drawn from a PRNG key carried in the batch dict."""
    noise = jax.random.normal(jax.random.wrap_key_data(batch["key"]), w.shape)
    return jnp.mean((jnp.tanh(batch["x"] @ (w + 0.01 * noise)) - batch["y"]) ** 2)


def _keyed_step(w, batch):
    loss, grad = alpa.value_and_grad(_keyed_loss)(w, batch)
    return w - LR * grad, loss


@pytest.mark.parametrize("method_cls", [alpa.DataParallel, alpa.ShardParallel])
def test_a_key_in_the_batch_is_read_whole_by_every_micro_batch(method_cls):
    """The key's data (``uint32[2]``: not a row per example, ``api.leaves_with_rows``) is
    not cut into micro-batches: each of the 2 reads it whole, as the serial accumulation
    over the 2 chunks of the other leaves does. Before, the key was cut into two halves
    of one word, and the trace failed inside JAX. Under DataParallel the loop still has
    no collective and the gradients one all-reduce after it."""
    k = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(k[0], (16, 8)) * 0.1
    rows = {"x": jax.random.normal(k[1], (BATCH, 16)), "y": jax.random.normal(k[2], (BATCH, 8))}
    key = jax.random.key_data(jax.random.key(7))
    (got_w, got_loss), executable = _run(
        _keyed_step, method_cls(num_micro_batches=2), w, {**rows, "key": key}
    )

    def value_and_grad(w, chunk):
        return jax.value_and_grad(_keyed_loss)(w, {**chunk, "key": key})

    loss, grad = _serial_accumulation(value_and_grad, w, _chunks(rows, 2))
    assert_allclose(got_loss, loss, rtol=1e-5, atol=1e-6)
    assert_allclose(got_w, w - LR * grad, rtol=1e-5, atol=1e-6)
    if method_cls is alpa.DataParallel:
        texts = executable.get_program_texts()
        per_micro_batch, _, _ = count_micro_batch_communication(texts)
        assert per_micro_batch.total == 0
        last = texts["accumulate_last"]
        assert count_communication_primitives(last, ignore_scalar_all_reduce=True).all_reduce == 1
