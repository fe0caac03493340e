"""Random numbers in a parallelized step: drawn sharded, and per micro-batch as the full batch.

Oracles: the dropout mask's ``random_bits`` is planned split over every device and the
compiled program hashes only one shard per device (the counter shapes in the per-device
HLO) without gathering the mask; a micro-batched dropout step (every one-mesh method, 2 and
4 micro-batches) equals the serial full-batch ``jax.jit`` step, where before each
micro-batch reused the same mask and the gradients differed from serial by more than 100 %;
the row-wise draws equal rows of ``jax.random.bits`` / ``jax.random.split`` bit for bit.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa
from alpa.shard_parallel.lowering.constrained_eval import eval_jaxpr_with_constraints
from alpa.testing import assert_allclose, run_auto_sharded
from alpa.tracing import trace_step
from alpa.tracing.batch_draws import BatchDraw, draw_rows, find_batch_draws, with_row_ids
from alpa.util import count_communication_primitives


def _dropout_mlp(batch_size: int, hidden: int):
    """``(params, batch, key, step)``: two dense layers with dropout (rate 0.5) between
    them, mean squared error; ``step`` returns the loss and the gradients."""
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.standard_normal((hidden, hidden), np.float32) / 4),
        "w2": jnp.asarray(rng.standard_normal((hidden, hidden), np.float32) / 4),
    }
    batch = {
        "x": jnp.asarray(rng.standard_normal((batch_size, hidden), np.float32)),
        "y": jnp.asarray(rng.standard_normal((batch_size, hidden), np.float32)),
    }

    def step(params, batch, key):
        def loss(p):
            h = jax.nn.relu(batch["x"] @ p["w1"])
            keep = jax.random.bernoulli(key, 0.5, h.shape)
            h = jnp.where(keep, h / 0.5, 0.0)
            return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

        return alpa.value_and_grad(loss)(params)

    return params, batch, jax.random.key(7), step


def _counter_elements(hlo: str) -> int:
    """The most elements of any array the RNG's counters and hashing make on one device
    (JAX's own draw, or a micro-batch's rows: ``batch_draws.draw_rows``)."""
    sizes = [0]
    for line in hlo.splitlines():
        if any(name in line for name in ("iota_2x32_shape", "threefry2x32", "draw_rows")):
            for dims in re.findall(r"[us](?:32|64)\[([\d,]*)\]", line):
                sizes.append(math.prod(int(d) for d in dims.split(",") if d))
    return max(sizes)


def test_threefry_is_partitionable_by_default():
    """The premise of the random rules: element values do not depend on the sharding."""
    assert jax.config.jax_threefry_partitionable is True


# ----------------------------------------------------------------------------- sharded draws


@pytest.mark.parametrize("shape", [(8, 1), (2, 4)])
def test_dropout_mask_is_drawn_split(shape):
    batch_size, hidden = 256, 16
    params, batch, key, step = _dropout_mlp(batch_size, hidden)
    method = alpa.ShardParallel(devices=alpa.testing.unit_cost_mesh(shape))
    p_step = alpa.parallelize(step, method=method, batch_argnums=(1,), donate_argnums=())
    out = p_step(params, batch, key)
    executable = p_step.get_last_executable()
    assert_allclose(out, jax.jit(step)(params, batch, key), rtol=1e-5, atol=1e-6)

    # The plan splits the mask's batch dimension and uses all 8 devices.
    plan = executable.plan
    (draw,) = [e for e in executable.traced.jaxpr.eqns if e.primitive.name == "random_bits"]
    spec = plan.var_specs[draw.outvars[0]]
    assert spec[0] is not None, spec
    sizes = dict(zip(plan.logical_mesh.axis_names, plan.logical_mesh.shape, strict=True))
    used = [a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
    assert math.prod(sizes[a] for a in used) == 8, spec

    # Each device hashes only its shard's counters, and nothing gathers the mask.
    hlo = executable.get_hlo_text()
    assert _counter_elements(hlo) == batch_size * hidden // 8
    assert count_communication_primitives(hlo).all_gather == 0


def test_replicated_draw_before_hashed_full_batch():
    """The oracle of the test above can fail: ``jax.jit`` on one device hashes the whole
    mask."""
    batch_size, hidden = 256, 16
    params, batch, key, step = _dropout_mlp(batch_size, hidden)
    hlo = jax.jit(step).lower(params, batch, key).compile().as_text()
    assert _counter_elements(hlo) == batch_size * hidden


def test_key_operations_follow_their_keys():
    """Legacy ``uint32[2]`` keys (``random_wrap``), ``fold_in``, ``split`` and per-example
    keys drawn with ``vmap``: the plan compiles, splits the draws, equals serial."""
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.standard_normal((16, 16), np.float32))}
    batch = {"x": jnp.asarray(rng.standard_normal((64, 16), np.float32))}

    def step(params, batch, key):
        def loss(p):
            h = batch["x"] @ p["w"]
            k1, k2 = jax.random.split(jax.random.fold_in(key, 3))
            keep = jax.random.bernoulli(k1, 0.5, h.shape)
            rows = jax.random.split(k2, h.shape[0])
            noise = jax.vmap(lambda k: jax.random.normal(k, h.shape[1:]))(rows)
            return jnp.mean(jnp.where(keep, h, 0.0) * noise)

        return alpa.value_and_grad(loss)(params)

    key = jax.random.PRNGKey(3)
    out, executable = run_auto_sharded(lambda s, b: step(s, b, key), params, batch, (2, 4))
    assert_allclose(out, jax.jit(step)(params, batch, key), rtol=1e-5, atol=1e-6)
    draws = [e for e in executable.traced.jaxpr.eqns if e.primitive.name == "random_bits"]
    assert len(draws) == 2
    for eqn in draws:
        assert executable.plan.var_specs[eqn.outvars[0]] != jax.sharding.PartitionSpec()


# ----------------------------------------------------------------------------- micro-batches

METHODS = {
    "ShardParallel": lambda k: alpa.ShardParallel(
        devices=alpa.testing.unit_cost_mesh((2, 4)), num_micro_batches=k
    ),
    "DataParallel": lambda k: alpa.DataParallel(num_micro_batches=k),
    "Zero2Parallel": lambda k: alpa.Zero2Parallel(num_micro_batches=k),
    "Zero3Parallel": lambda k: alpa.Zero3Parallel(num_micro_batches=k),
}


@pytest.fixture(scope="module")
def dropout_mlp():
    params, batch, key, step = _dropout_mlp(32, 16)
    return params, batch, key, step, jax.jit(step)(params, batch, key)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_micro_batches_draw_the_full_batch_numbers(dropout_mlp, method, k):
    params, batch, key, step, expected = dropout_mlp
    p_step = alpa.parallelize(
        step, method=METHODS[method](k), batch_argnums=(1,), donate_argnums=()
    )
    assert_allclose(p_step(params, batch, key), expected, rtol=1e-5, atol=1e-6)


def test_flax_dropout_under_micro_batches_equals_serial():
    """``flax.linen.Dropout`` (its key folded from the module path) in two layers."""
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dropout(0.3, deterministic=False)(nn.relu(nn.Dense(16)(x)))
            return nn.Dropout(0.1, deterministic=False)(nn.Dense(16)(x))

    model = Model()
    batch = {"x": jnp.asarray(np.random.default_rng(2).standard_normal((32, 16), np.float32))}
    params = model.init(jax.random.key(0), batch["x"])["params"]

    def step(params, batch, key):
        def loss(p):
            out = model.apply({"params": p}, batch["x"], rngs={"dropout": key})
            return jnp.mean((out - batch["x"]) ** 2)

        return alpa.value_and_grad(loss)(params)

    key = jax.random.key(1)
    method = alpa.DataParallel(num_micro_batches=4)
    p_step = alpa.parallelize(step, method=method, batch_argnums=(1,), donate_argnums=())
    assert_allclose(p_step(params, batch, key), jax.jit(step)(params, batch, key), 1e-5, 1e-6)


def test_micro_batches_with_one_mask_differ_from_serial(dropout_mlp):
    """What the test above guards against: micro-batches that each draw the mask of their
    own shape with the step's key (the same mask every time) average to other gradients."""
    params, batch, key, step, expected = dropout_mlp
    k = 2
    parts = [
        jax.jit(step)(params, jax.tree.map(lambda x, j=j: x[j * 16 : (j + 1) * 16], batch), key)
        for j in range(k)
    ]
    naive = jax.tree.map(lambda *xs: sum(xs) / k, *parts)
    grad, naive_grad = expected[1]["w1"], naive[1]["w1"]
    assert float(jnp.abs(naive_grad - grad).max() / jnp.abs(grad).max()) > 0.5


def test_data_parallel_micro_batch_hashes_its_rows_only(dropout_mlp):
    """DataParallel, 2 micro-batches of 16 rows on 8 devices: 2 rows x 16 per device."""
    params, batch, key, step, _ = dropout_mlp
    p_step = alpa.parallelize(
        step, method=alpa.DataParallel(num_micro_batches=2), batch_argnums=(1,), donate_argnums=()
    )
    p_step(params, batch, key)
    hlo = p_step.get_last_executable().get_hlo_text()
    assert _counter_elements(hlo) == 2 * 16


# ----------------------------------------------------------------------------- the passes


def _trace(fun, batch_shape):
    args = [jax.random.key(0), jax.ShapeDtypeStruct(batch_shape, jnp.float32)]
    return trace_step(fun, args, (), (1,), (), ["key", "x"])


@pytest.mark.parametrize(
    "draw, expected",
    [
        (lambda key, x: jax.random.bits(key, x.shape), BatchDraw(0, 1)),
        (lambda key, x: jax.random.bits(key, (x.shape[0] * 3, 2)), BatchDraw(0, 3)),
        (lambda key, x: jax.random.bits(key, (5, x.shape[0], 2)), BatchDraw(1, 1)),
        (lambda key, x: jax.random.split(key, x.shape[0]), BatchDraw(0, 1)),
        (lambda key, x: jax.random.bits(key, (5, 2)), None),
    ],
)
def test_find_batch_draws(draw, expected):
    small, large = _trace(draw, (4, 2)), _trace(draw, (8, 2))
    found = find_batch_draws(small, large)
    assert list(found.values()) == ([] if expected is None else [expected])


def test_find_batch_draws_refuses_a_draw_quadratic_in_the_batch():
    def pairwise(key, x):
        return jax.random.bits(key, (x.shape[0], x.shape[0]))

    with pytest.raises(ValueError, match=r"shape \(4, 4\) at batch size 4 and \(8, 8\) at 8"):
        find_batch_draws(_trace(pairwise, (4, 2)), _trace(pairwise, (8, 2)))


def test_rewritten_draw_gives_each_micro_batch_its_rows():
    def masks(key, x):
        return jax.random.bits(key, x.shape)

    small, large = _trace(masks, (4, 3)), _trace(masks, (8, 3))
    rewritten = with_row_ids(small.jaxpr, find_batch_draws(small, large), batch_size=8)
    key, x = jax.random.key(0), jnp.zeros((4, 3))
    full = jax.random.bits(key, (8, 3))
    before, after = [], []
    for j in range(2):
        rows = jnp.arange(4 * j, 4 * j + 4, dtype=jnp.int32)
        (out,) = eval_jaxpr_with_constraints(
            rewritten, small.closed_jaxpr.consts, [key, x, rows], {}
        )
        after.append(out)
        before += eval_jaxpr_with_constraints(small.jaxpr, small.closed_jaxpr.consts, [key, x], {})
    np.testing.assert_array_equal(jnp.concatenate(after), full)
    assert (before[0] == before[1]).all()  # the same mask for every micro-batch
    assert not (after[0] == after[1]).all()


@pytest.mark.parametrize(
    "full_shape, dim, per_row", [((16, 5), 0, 1), ((4, 6, 3), 1, 2), ((12, 7, 2), 0, 3)]
)
@pytest.mark.parametrize("bit_width", [8, 16, 32])
def test_draw_rows_is_bit_exact(full_shape, dim, per_row, bit_width):
    key = jax.random.key(42)
    rows = full_shape[dim] // per_row
    row_ids = jnp.asarray([rows - 1, 0, 1], jnp.int32)
    dtype = np.dtype(f"uint{bit_width}")
    params = {"bit_width": bit_width, "shape": full_shape}
    got = draw_rows(
        key, row_ids, primitive=_primitive("random_bits"), params=params,
        full_shape=full_shape, dim=dim, per_row=per_row,
    )  # fmt: skip
    index = (np.asarray(row_ids)[:, None] * per_row + np.arange(per_row)).reshape(-1)
    expected = np.take(np.asarray(jax.random.bits(key, full_shape, dtype)), index, axis=dim)
    np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize(
    "key",
    [jax.random.key(3), jax.random.key(3, impl="rbg")],
    ids=["threefry", "rbg (full draw, then rows)"],
)
def test_split_rows_are_bit_exact(key):
    row_ids = jnp.asarray([5, 2], jnp.int32)
    got = draw_rows(
        key, row_ids, primitive=_primitive("random_split"), params={"shape": (8,)},
        full_shape=(8,), dim=0, per_row=1,
    )  # fmt: skip
    expected = jax.random.key_data(jax.random.split(key, 8))[np.asarray(row_ids)]
    np.testing.assert_array_equal(jax.random.key_data(got), expected)


def test_draw_rows_without_partitionable_threefry_takes_rows_of_the_full_draw():
    key, row_ids = jax.random.key(9), jnp.asarray([3, 1], jnp.int32)
    with jax.threefry_partitionable(False):
        expected = np.asarray(jax.random.bits(key, (4, 5)))[[3, 1]]
        got = draw_rows(
            key, row_ids, primitive=_primitive("random_bits"),
            params={"bit_width": 32, "shape": (4, 5)}, full_shape=(4, 5), dim=0, per_row=1,
        )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got), expected)


def _primitive(name: str):
    """The primitive ``name`` as a traced draw binds it."""
    jaxpr = jax.make_jaxpr(lambda k: (jax.random.bits(k, (2,)), jax.random.split(k, 2)))(
        jax.random.key(0)
    )
    return next(e.primitive for e in jaxpr.eqns if e.primitive.name == name)
