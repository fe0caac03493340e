"""DataParallel, ZeRO-2, ZeRO-3 and gradient accumulation, judged by numerics against the
serial step, by collectives counted in the compiled HLO and by per-device memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import alpa
from alpa.testing import assert_allclose, get_mlp_train_state_and_step, get_tied_embedding_step
from alpa.util import (
    collective_shapes,
    count_communication_primitives,
    count_micro_batch_communication,
)

N = 8
BATCH, HIDDEN, LAYERS = 64, 32, 2
NUM_PARAM_TENSORS = 2 * LAYERS  # kernel and bias per layer


@pytest.fixture(scope="module")
def mlp():
    state, batch, train_step = get_mlp_train_state_and_step(BATCH, HIDDEN, LAYERS)
    expected = jax.jit(train_step)(state, batch)
    return state, batch, train_step, expected


def _run(mlp, method):
    state, batch, train_step, expected = mlp
    p_step = alpa.parallelize(train_step, method=method, donate_argnums=())
    return p_step(state, batch), p_step.get_last_executable(), expected


def _local_bytes(tree) -> int:
    """Bytes that device 0 holds of the arrays in ``tree``."""
    return sum(
        shard.data.nbytes
        for x in jax.tree.leaves(tree)
        for shard in x.addressable_shards
        if shard.device == jax.devices()[0]
    )


@pytest.mark.parametrize(
    "method_cls", [alpa.DataParallel, alpa.Zero2Parallel, alpa.Zero3Parallel, alpa.ShardParallel]
)
def test_matches_serial(mlp, method_cls):
    out, _, expected = _run(mlp, method_cls())
    assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method_cls", [alpa.DataParallel, alpa.Zero2Parallel, alpa.Zero3Parallel])
@pytest.mark.parametrize("num_micro_batches", [2, 4])
def test_micro_batches_match_full_batch(mlp, method_cls, num_micro_batches):
    out, executable, expected = _run(mlp, method_cls(num_micro_batches=num_micro_batches))
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    # Gradients are reduced once per step, none per micro-batch: a single (tuple)
    # all-reduce, or with ZeRO one reduce-scatter of all gradient tensors packed
    # (gradient_sync.py) and no all-reduce; ZeRO-2 gathers its updated parameters once per
    # step, ZeRO-3 its parameters in each micro-batch (each in one all-gather).
    per_micro_batch, per_step, _ = count_micro_batch_communication(executable.get_program_texts())
    gathers = 1 if method_cls is alpa.Zero3Parallel else 0
    assert per_micro_batch == (gathers, 0, gathers, 0, 0), per_micro_batch
    if method_cls is alpa.DataParallel:
        assert per_step == (1, 1, 0, 0, 0), per_step
    else:
        assert per_step == (2 - gathers, 0, 1 - gathers, 1, 0), per_step


def test_data_parallel_has_one_all_reduce_and_replicated_params(mlp):
    out, executable, _ = _run(mlp, alpa.DataParallel())
    # XLA merges the gradients of all 4 parameter tensors into one tuple all-reduce.
    counts = count_communication_primitives(executable.get_hlo_text())
    assert counts == (1, 1, 0, 0, 0)
    for leaf in jax.tree.leaves(out.params):
        assert leaf.sharding.is_fully_replicated


def test_zero2_shards_optimizer_state(mlp):
    state = mlp[0]
    dp_out, dp_exec, _ = _run(mlp, alpa.DataParallel())
    out, executable, _ = _run(mlp, alpa.Zero2Parallel())
    # Adam's mu and nu: every tensor has a dim divisible by 8, so each device holds 1/8.
    serial_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(state.opt_state) if np.ndim(x))
    moments = [x for x in jax.tree.leaves(out.opt_state) if x.ndim]
    assert _local_bytes(moments) * N == serial_bytes
    for leaf in moments:
        assert leaf.sharding.spec == P("x")
    for leaf in jax.tree.leaves(out.params):
        assert leaf.sharding.is_fully_replicated
    # XLA's memory analysis agrees: the step allocates less per device than DP.
    saved = dp_exec.get_total_allocation_size() - executable.get_total_allocation_size()
    assert saved >= serial_bytes * (N - 1) // N
    # Gradients reach each device as shards, by one real reduce-scatter of all of them
    # packed (psum_scatter: XLA on CPU would compile a constrained all-reduce to
    # all-reduce + slice, and merges no reduce-scatters: docs/design.md); then the updated
    # parameters are all-gathered, packed in one all-gather too. Nothing else.
    hlo = executable.get_hlo_text()
    assert count_communication_primitives(hlo) == (2, 0, 1, 1, 0)
    shard = sum(x.size for x in jax.tree.leaves(state.params)) // N
    assert collective_shapes(hlo, "reduce-scatter") == [f"f32[1,{shard}]"]
    assert collective_shapes(hlo, "all-gather") == [f"f32[{N},{shard}]"]


def test_zero2_all_reduces_a_gradient_whose_dim_0_does_not_split():
    """As Alpa's reduce-scatter rewrite: ZeRO-2 scatters each gradient over its dimension
    0; a ``[2, 16]`` table (a token-type embedding) does not split over 8 devices there, so
    its gradient is all-reduced and its optimizer state kept whole, while the kernel's
    gradient rides in the packed reduce-scatter."""
    import optax
    from flax.training.train_state import TrainState

    params = {"table": jnp.ones((2, 16)) * 0.1, "kernel": jnp.ones((16, 16)) * 0.01}
    state = TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
    batch = {"x": jnp.arange(64 * 16.0).reshape(64, 16) / 1000, "y": jnp.ones((64, 16))}

    def step(state, batch):
        def loss(p):
            out = batch["x"] @ p["kernel"] + p["table"][0] + p["table"][1] * 2
            return jnp.mean((out - batch["y"]) ** 2)

        return state.apply_gradients(grads=alpa.grad(loss)(state.params))

    expected = jax.jit(step)(state, batch)
    p_step = alpa.parallelize(step, method=alpa.Zero2Parallel(), donate_argnums=())
    out = p_step(state, batch)
    assert_allclose(out.params, expected.params, rtol=1e-5, atol=1e-6)
    hlo = p_step.get_last_executable().get_hlo_text()
    assert collective_shapes(hlo, "all-reduce") == ["f32[2,16]"]
    assert collective_shapes(hlo, "reduce-scatter") == ["f32[1,32]"]  # the kernel, 256 / 8
    mu = out.opt_state[0].mu
    assert mu["table"].sharding.is_fully_replicated
    assert mu["kernel"].sharding.spec == P("x")


def test_zero2_keeps_a_factored_gradient_and_its_state_whole():
    """Adafactor factors a matrix's second moment into row and column statistics. ZeRO-2
    all-reduces such a gradient (packed with the others) and keeps its small state and its
    update whole: an update from a slice of the rows would need every device's column
    statistics, one all-reduce and one all-gather per matrix, chained behind each other
    (14 collectives here before). The biases' unfactored state is still split and their
    gradients reduce-scattered, packed."""
    import optax
    from flax.training.train_state import TrainState

    from alpa.model.mlp import MLPModel

    model = MLPModel(hidden_size=HIDDEN, num_layers=LAYERS)
    x = jnp.arange(BATCH * HIDDEN, dtype=jnp.float32).reshape(BATCH, HIDDEN) / 1000
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=4)
    state = TrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), x), tx=tx
    )
    batch = {"x": x, "y": jnp.ones_like(x)}

    def step(state, batch):
        def loss(p):
            return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)

        return state.apply_gradients(grads=alpa.grad(loss)(state.params))

    expected = jax.jit(step)(state, batch)
    p_step = alpa.parallelize(step, method=alpa.Zero2Parallel(), donate_argnums=())
    out = p_step(state, batch)
    assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    hlo = p_step.get_last_executable().get_hlo_text()
    # One all-reduce (the kernels' gradients, with the scalars of the biases' updates),
    # one reduce-scatter and one all-gather (the biases, 2 x 32 / 8 each), nothing else.
    counts = count_communication_primitives(hlo, ignore_scalar_all_reduce=True)
    assert counts == (3, 1, 1, 1, 0), counts
    assert collective_shapes(hlo, "reduce-scatter") == [f"f32[1,{LAYERS * HIDDEN // N}]"]
    assert collective_shapes(hlo, "all-reduce").count(f"f32[{HIDDEN},{HIDDEN}]") == LAYERS
    factored = out.opt_state[0]
    for layer in out.params["params"]:
        assert factored.v_row["params"][layer]["kernel"].sharding.is_fully_replicated
        assert factored.v_col["params"][layer]["kernel"].sharding.is_fully_replicated
        assert factored.v["params"][layer]["bias"].sharding.spec == P("x")
    for leaf in jax.tree.leaves(out.params):
        assert leaf.sharding.is_fully_replicated


def test_zero3_shards_and_gathers_parameters(mlp):
    out, executable, _ = _run(mlp, alpa.Zero3Parallel())
    for leaf in jax.tree.leaves(out.params):
        assert leaf.sharding.spec == P("x")
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(out.params))
    assert _local_bytes(out.params) * N == param_bytes
    in_specs = executable.get_input_placement_specs()[0]
    assert all(s.sharding_specs[0] == P("x") for s in jax.tree.leaves(in_specs.params))
    # Every parameter tensor is gathered before its use in the forward pass, all in one
    # packed all-gather, and the kernel the backward pass reads again (Dense_1's, for its
    # input's gradient; Dense_0's input has none) is gathered again there rather than
    # kept whole between the passes (param_gathers.py; with one element more per device,
    # so that XLA's CSE cannot merge it with a forward gather); the gradients are
    # reduce-scattered in one, and the optimizer state is never gathered.
    hlo = executable.get_hlo_text()
    assert count_communication_primitives(hlo) == (3, 0, 2, 1, 0)
    shard = param_bytes // 4 // N
    again = out.params["Dense_1"]["kernel"].size // N + 1
    assert sorted(collective_shapes(hlo, "all-gather")) == sorted(
        [f"f32[{N},{shard}]", f"f32[{N},{again}]"]
    )


@pytest.mark.parametrize("bound, forward", [(1, 4), ((HIDDEN * HIDDEN + HIDDEN) * 4, 2)])
def test_zero3_gathers_are_packed_up_to_the_threshold(mlp, bound, forward):
    """``force_zero_stage_3_all_gather_threshold`` bounds each packed all-gather, as Alpa's
    combiner was bounded: in the order of first use, each pack at most ``bound`` bytes of
    whole tensors (one byte: a tensor per pack, 4 in the forward pass; one layer's kernel
    and bias: a pack per layer). The backward pass gathers Dense_1's kernel again, in a
    pack of its own (one element more per device: not merged with the forward's one-tensor
    pack). Numerics equal serial."""
    method = alpa.Zero3Parallel()
    method.as_option.force_zero_stage_3_all_gather_threshold = bound
    out, executable, expected = _run(mlp, method)
    assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    hlo = executable.get_hlo_text()
    assert count_communication_primitives(hlo) == (forward + 2, 0, forward + 1, 1, 0)
    kernel, bias = HIDDEN * HIDDEN // N, HIDDEN // N
    layer = [f"f32[{N},{kernel + bias}]"] * 2
    shapes = [f"f32[{N},{s}]" for s in [kernel, bias] * 2] if forward == 4 else layer
    again = f"f32[{N},{kernel + 1}]"
    assert sorted(collective_shapes(hlo, "all-gather")) == sorted([*shapes, again])


def test_batch_norm_like_state_and_aux_with_micro_batches():
    """has_aux values pass through alpa.value_and_grad and are averaged too."""

    def step(w, batch):
        def loss(w):
            pred = batch["x"] @ w
            return jnp.mean((pred - batch["y"]) ** 2), jnp.mean(pred)

        (loss_value, mean_pred), g = alpa.value_and_grad(loss, has_aux=True)(w)
        return w - 0.1 * g, loss_value, mean_pred

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
    batch = {
        "x": jnp.asarray(rng.standard_normal((32, 8)), jnp.float32),
        "y": jnp.asarray(rng.standard_normal((32, 4)), jnp.float32),
    }
    expected = jax.jit(step)(w, batch)
    got = alpa.parallelize(step, method=alpa.DataParallel(num_micro_batches=2))(w, batch)
    assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_batch_dependent_value_outside_grad_is_an_error():
    def step(w, batch):
        g = alpa.grad(lambda w: jnp.mean(batch @ w))(w)
        return w - g, jnp.sum(batch)  # the sum escapes alpa.grad

    f = alpa.parallelize(step, method=alpa.DataParallel(num_micro_batches=2))
    with pytest.raises(
        ValueError, match="depends on the batch but does not pass through alpa.grad"
    ):
        f(jnp.ones((4,)), jnp.ones((16, 4)))


@pytest.mark.parametrize("num_micro_batches", [None, 2])
def test_tied_embedding_gradient_is_reduced_once(num_micro_batches):
    """The tied table's two partial sums are added on each device and reduced once: the
    data-parallel step's one (tuple) all-reduce holds the 512 x 64 table once, not twice
    (as XLA compiles the two constrained sums), and ZeRO-2's one packed reduce-scatter
    holds each device's 64 x 64 block of it once, with its block of w (64 x 64 / 8)."""
    params, batch, step = get_tied_embedding_step()
    expected = jax.jit(step)(params, batch)
    p_step = alpa.parallelize(
        step, method=alpa.DataParallel(num_micro_batches=num_micro_batches), donate_argnums=()
    )
    assert_allclose(p_step(params, batch), expected, rtol=1e-5, atol=1e-5)
    shapes = collective_shapes(p_step.get_last_executable().get_hlo_text(), "all-reduce")
    # (and the loss, a scalar, which XLA may pack with them)
    assert sorted(s for s in shapes if s != "f32[]") == ["f32[512,64]", "f32[64,64]"], shapes
    p_step = alpa.parallelize(
        step, method=alpa.Zero2Parallel(num_micro_batches=num_micro_batches), donate_argnums=()
    )
    assert_allclose(p_step(params, batch), expected, rtol=1e-5, atol=1e-5)
    shapes = collective_shapes(p_step.get_last_executable().get_hlo_text(), "reduce-scatter")
    assert shapes == [f"f32[1,{(512 * 64 + 64 * 64) // N}]"], shapes


def _dropout_step(width: int):
    """``(params, batch, step)``: a ``width``-wide tanh layer with dropout drawn from the
    PRNG key the batch holds (as Alpa's BERT tests pass it), 16 rows, SGD."""

    def loss(params, batch):
        h = jnp.tanh(batch["x"] @ params["w"])
        keep = jax.random.bernoulli(batch["rng"], 0.5, h.shape)
        return jnp.mean(jnp.where(keep, h, 0.0) ** 2)

    def step(params, batch):
        grads = alpa.grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    params = {"w": jax.random.normal(jax.random.PRNGKey(0), (width, width))}
    batch = {"x": jnp.ones((16, width)), "rng": jax.random.PRNGKey(1)}
    return params, batch, step


@pytest.mark.parametrize("method_cls", [alpa.DataParallel, alpa.Zero2Parallel, alpa.Zero3Parallel])
def test_a_key_in_the_batch_is_replicated(method_cls):
    """A PRNG key among the batch's arrays (Alpa's BERT tests pass the dropout key so) has
    no row per example: the fixed plans replicate it and split the rest, and the step
    (dropout drawn from the key) equals the serial one. A batch whose rows do not split
    over the devices is still an error."""

    params, batch, step = _dropout_step(8)
    p_step = alpa.parallelize(step, method=method_cls(), donate_argnums=())
    assert_allclose(p_step(params, batch), jax.jit(step)(params, batch), rtol=1e-5, atol=1e-5)
    specs = dict(zip(["rng", "x"], p_step.get_last_executable().plan.in_specs[-2:], strict=True))
    assert specs == {"rng": P(), "x": P("x")}, specs
    with pytest.raises(ValueError, match=r"batch size 6, which does not split over the 8"):
        p_step(params, {"x": jnp.ones((6, 8)), "rng": jax.random.PRNGKey(1)})


def test_a_key_in_the_batch_keeps_the_gradients_reduced_once():
    """A PRNG key in the batch has no batch dimension, so it does not stop the row sums
    from being found (``micro_batches.batch_dims``): ZeRO-2's gradient is reduce-scattered
    once at the marker, in one packed collective, as without the key. Before, the key
    made the rows untraceable, and XLA's all-reduce and slice stood in for the
    reduce-scatter."""

    params, batch, step = _dropout_step(64)
    p_step = alpa.parallelize(step, method=alpa.Zero2Parallel(), donate_argnums=())
    assert_allclose(p_step(params, batch), jax.jit(step)(params, batch), rtol=1e-5, atol=1e-5)
    hlo = p_step.get_last_executable().get_hlo_text()
    assert collective_shapes(hlo, "reduce-scatter") == [f"f32[1,{64 * 64 // N}]"]
    assert collective_shapes(hlo, "all-reduce") == []


@pytest.mark.parametrize("num_micro_batches", [None, 2])
def test_grad_sync_channel_ids_name_the_gradient_reduction(num_micro_batches):
    """Alpa's ``executable.grad_sync_channel_ids``: the channel of the one all-reduce that
    reduces the gradients once per step. Oracle: the HLO instruction with that channel is
    an all-reduce in the entry computation (after the micro-batch loop, not in its body)
    whose operands are the gradients: one per parameter, of the parameters' shapes. A
    Megatron plan reduces no gradient: no channel."""
    import re

    state, batch, step = get_mlp_train_state_and_step(64, 16, num_layers=2)
    method = alpa.DataParallel(num_micro_batches=num_micro_batches)
    p_step = alpa.parallelize(step, method=method, donate_argnums=())
    p_step(state, batch)
    executable = p_step.get_last_executable()
    ids = executable.grad_sync_channel_ids
    assert re.fullmatch(r"\.\d+\.", ids), ids
    hlo = executable.get_hlo_text()
    entry = hlo[hlo.index("\nENTRY ") :]
    (line,) = [
        x for x in entry.splitlines() if " all-reduce(" in x and f"channel_id={ids[1:-1]}," in x
    ]
    shapes = re.findall(r"f32\[([\d,]+)\]", line.split(" all-reduce(")[0])  # (not the loss)
    expected = sorted(",".join(map(str, x.shape)) for x in jax.tree.leaves(state.params))
    assert sorted(shapes) == expected, line

    state, batch, step = get_mlp_train_state_and_step(8, 256, num_layers=2)
    mesh = alpa.get_global_physical_mesh().get_logical_mesh((1, N))
    p_step = alpa.parallelize(step, method=alpa.ShardParallel(devices=mesh), donate_argnums=())
    p_step(state, batch)
    assert p_step.get_last_executable().grad_sync_channel_ids == ""
