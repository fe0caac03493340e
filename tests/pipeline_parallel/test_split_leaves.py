"""What a pipelined step returns for a stacked parameter it split between its stages,
used as an array in the caller's own code (``runtime.stage_rows``,
``runtime.stacked_array``).

A stacked ``w`` (``[4, 16, 16]``, one row per layer of a small network) under two
stages of 4 devices, two rows on each:

* stages of one mesh shape, sharding their rows alike: ``w`` comes back as one
  ``jax.Array`` whose mesh is the two stages' (``("stages", "x", "y")``, its leading axis
  split by stage), which a second step reads where it is;
* stages of two logical shapes ((1, 4) and (2, 2)): no sharding says where its rows are,
  and ``w`` is an ``alpa.StackedRows``.

Either way, each use of the issue works on it and gives numpy's numbers: ``jax.jit``,
eager ``jnp``, ``jax.tree.map`` arithmetic (an EMA), optax outside alpa, flax
serialization, orbax, and ``alpa.save_checkpoint`` / ``restore_checkpoint`` (bit-equal,
restored where the step reads it). Numbers of both equal ``jax.jit``'s.
"""

from __future__ import annotations

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import alpa
from alpa.testing import assert_allclose

LAYERS, H = 4, 16


def _params_and_batch():
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(LAYERS, H, H)) / 4, jnp.float32),
        "b": jnp.asarray(rng.normal(size=(H,)) / 4, jnp.float32),
    }
    return params, {"x": jnp.asarray(rng.normal(size=(8, H)), jnp.float32)}


def _loss(params, x):
    h = x + params["b"]
    for i in range(LAYERS):  # each layer reads its row of w
        h = jnp.tanh(h @ params["w"][i])
    return jnp.mean(h**2)


def _step(params, batch):
    grads = alpa.grad(_loss)(params, batch["x"])
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def _method(logical_shapes):
    stages = alpa.ManualStageOption([[0], [1]], [(1, 4)] * 2, logical_shapes, [{}, {}])
    return alpa.PipeshardParallel(
        num_micro_batches=2, layer_option=alpa.AutoLayerOption(2), stage_option=stages
    )


@pytest.fixture(scope="module", params=["one mesh shape", "two mesh shapes"])
def trained(request):
    """Two steps of the pipeline and of ``jax.jit``: ``(kind, executable, first, got,
    expected)`` (the executable itself: each test starts with alpa shut down, after which
    the parallelized function would compile again)."""
    logical = [(1, 4)] * 2 if request.param == "one mesh shape" else [(1, 4), (2, 2)]
    params, batch = _params_and_batch()
    p_step = alpa.parallelize(_step, method=_method(logical), donate_argnums=())
    first = p_step(params, batch)
    got = p_step(first, batch)
    expected = jax.jit(_step)(jax.jit(_step)(params, batch), batch)
    return request.param, p_step.get_last_executable(), first, got, expected


def test_the_split_leaf_is_one_array_where_a_sharding_says_so(trained):
    kind, executable, first, got, expected = trained
    assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    w = got["w"]
    assert w.shape == (LAYERS, H, H) and w.dtype == jnp.float32
    if kind == "two mesh shapes":
        assert isinstance(w, alpa.StackedRows) and w.sizes == (1, 1, 1, 1)
        return
    assert isinstance(w, jax.Array)
    mesh = w.sharding.mesh
    assert mesh.axis_names == ("stages", "x", "y") and mesh.devices.shape == (2, 1, 4)
    assert tuple(w.sharding.spec)[0] == "stages"
    # Each stage's devices hold its two rows.
    rows = {s.device.id: (s.index[0].start, s.index[0].stop) for s in w.addressable_shards}
    assert rows == {d: (0, 2) if d < 4 else (2, 4) for d in range(8)}
    # The step's input placement specs say the same: restored or placed, ``w`` is
    # that array.
    spec = executable.get_input_placement_specs()[0]["w"]
    assert spec.rows_layout.joined == w.sharding


def _check_used_as_array(w, reference: np.ndarray) -> None:
    """Every use of the issue on ``w``, each against numpy on ``reference``."""
    ref = reference.astype(np.float64)
    # jax.jit, alone and with an uncommitted array
    got = jax.jit(lambda a, v: jnp.einsum("lij,j->li", a, v))(w, np.ones(H, np.float32))
    np.testing.assert_allclose(np.asarray(got), ref.sum(-1), rtol=1e-5, atol=1e-6)
    # eager jnp and Python arithmetic
    np.testing.assert_allclose(np.asarray(jnp.tanh(w)), np.tanh(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(w * 2 - 1), ref * 2 - 1, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(w.sum(axis=0)), ref.sum(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(w[1]), ref[1])
    assert np.asarray(w.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_each_use_of_the_leaf_gives_numpys_numbers(trained, tmp_path):
    kind, _, first, got, expected = trained
    w, w0 = got["w"], first["w"]
    reference, reference0 = np.asarray(w), np.asarray(w0)
    np.testing.assert_allclose(reference, np.asarray(expected["w"]), rtol=1e-5, atol=1e-6)
    _check_used_as_array(w, reference)

    # jax.tree.map arithmetic: an EMA of the parameters (part by part for StackedRows,
    # each part staying on its stage's mesh).
    ema = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, got, first)
    np.testing.assert_allclose(np.asarray(ema["w"]), 0.9 * reference + 0.1 * reference0, rtol=1e-6)
    if kind == "two mesh shapes":
        assert isinstance(ema["w"], alpa.StackedRows)
        devices = [r.sharding.device_set for r in ema["w"].rows]
        assert devices == [r.sharding.device_set for r in w.rows]

    # optax outside alpa: Adam's update of the leaf by a "gradient". (Its jitted
    # functions read a whole tree at once: leaves of other stages' meshes, ``b`` here,
    # need one set of devices first, as for any arrays of a pipeline's meshes.)
    tx = optax.adam(1e-2)
    opt_state = tx.init({"w": w})
    for _ in range(2):
        updates, opt_state = tx.update({"w": w0}, opt_state, {"w": w})
    new = optax.apply_updates({"w": w}, updates)
    host_state = tx.init({"w": reference})
    for _ in range(2):
        want, host_state = tx.update({"w": reference0}, host_state, {"w": reference})
    assert_allclose(new, optax.apply_updates({"w": reference}, want), rtol=1e-5, atol=1e-6)

    # flax serialization: bytes and back, into the same kind of value.
    restored = flax.serialization.from_bytes(got, flax.serialization.to_bytes(got))
    assert np.array_equal(np.asarray(restored["w"]), reference)
    if kind == "two mesh shapes":  # each part put back where the target's part is
        assert isinstance(restored["w"], alpa.StackedRows)
        devices = [r.sharding.device_set for r in restored["w"].rows]
        assert devices == [r.sharding.device_set for r in w.rows]

    # orbax's own checkpointer.
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax", got)
        checkpointer.wait_until_finished()
        back = checkpointer.restore(tmp_path / "orbax")
    assert np.array_equal(np.asarray(back["w"]), reference)


def test_a_checkpoint_of_the_split_leaf_restores_bit_equal(trained, tmp_path):
    kind, executable, _, got, _ = trained
    _, batch = _params_and_batch()
    alpa.save_checkpoint(tmp_path, got, 2)
    specs = executable.get_input_placement_specs()[0]
    restored = alpa.restore_checkpoint(tmp_path, 2, specs)
    for name in ("w", "b"):
        assert np.array_equal(np.asarray(restored[name]), np.asarray(got[name])), name
    # Restored where the step reads it: the same value as the step returns.
    if kind == "one mesh shape":
        assert restored["w"].sharding == got["w"].sharding
    else:
        assert isinstance(restored["w"], alpa.StackedRows)
        assert [r.sharding for r in restored["w"].rows] == [r.sharding for r in got["w"].rows]
    # and the step continues from it as from what it returned
    assert_allclose(executable(restored, batch), executable(got, batch), rtol=0, atol=0)


def test_stacked_rows_of_mismatched_parts_are_refused():
    a, b = np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32)
    with pytest.raises(
        ValueError,
        match=r"StackedRows: part 1 has rows of shape \(4,\) \(part shape \(2, 4\), "
        r"sizes\[1\]=2\), but part 0 has rows of shape \(3,\): every part must hold rows of "
        r"one shape",
    ):
        alpa.StackedRows([a, b], sizes=(2, 2))
    with pytest.raises(
        ValueError,
        match=r"StackedRows: part 0 has shape \(2, 3\) but sizes\[0\]=3: a part of n > 1 rows "
        r"is a block with a leading axis of n",
    ):
        alpa.StackedRows([a, a], sizes=(3, 2))
    with pytest.raises(
        ValueError,
        match=r"StackedRows: sizes=\(2,\) must give each of the 2 parts a number of rows >= 1",
    ):
        alpa.StackedRows([a, a], sizes=(2,))
    with pytest.raises(ValueError, match=r"part 1 has dtype int32, part 0 has float32"):
        alpa.StackedRows([a, a.astype(np.int32)], sizes=(2, 2))
