"""``alpa.xla_compile``: the XLA options alpa compiles its programs with, and the HLO text
it prints.

Oracle: a Megatron MLP of 3 checkpointed blocks (each two column/row pairs) on 4 devices,
pinned with ``jax.jit`` shardings, so that its all-reduces can be counted by hand: 2 in
each block's forward pass, 1 in its recomputation (the first pair's sum, which the second
pair reads), 2 in its backward pass (the input gradients of the two column-parallel dots),
less the input gradient of the first block (the input is not differentiated): 14, each
its own operation. XLA's CPU pipeline as it is drops the checkpoints' barriers and merges
some of them across the passes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from alpa.testing import assert_allclose
from alpa.util import collective_shapes, count_communication_primitives
from alpa.xla_compile import compile_lowered, compiler_options

HIDDEN, BATCH, BLOCKS = 64, 16, 3


def _block(p, x):
    h = jax.nn.relu(x @ p["w1"]) @ p["w2"] + x
    return jax.nn.relu(h @ p["w3"]) @ p["w4"] + h


def _loss(params, x):
    for p in params:
        x = jax.checkpoint(_block)(p, x)
    return jnp.mean(x**2)


def _megatron_gradient():
    """``(lowered, params, x)``: the gradient of :func:`_loss`, lowered on 4 devices."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    col, row = NamedSharding(mesh, P(None, "x")), NamedSharding(mesh, P("x", None))
    rng = np.random.default_rng(0)
    shapes = {"w1": (HIDDEN, 4 * HIDDEN), "w2": (4 * HIDDEN, HIDDEN)}
    shapes.update(w3=shapes["w1"], w4=shapes["w2"])
    params = [
        {k: jnp.asarray(rng.normal(size=s) / 8, jnp.float32) for k, s in shapes.items()}
        for _ in range(BLOCKS)
    ]
    specs = [{"w1": col, "w2": row, "w3": col, "w4": row}] * BLOCKS
    x = jnp.asarray(rng.normal(size=(BATCH, HIDDEN)), jnp.float32)
    jitted = jax.jit(
        jax.grad(_loss), in_shardings=(specs, NamedSharding(mesh, P())), out_shardings=specs
    )
    return jitted.lower(params, x), params, x


def test_checkpoints_keep_their_recomputation_in_the_backward_pass():
    lowered, params, x = _megatron_gradient()
    compiled = compile_lowered(lowered, "cpu")
    hlo = compiled.as_text()
    # As many all-reduce operations as values reduced: none merged with another.
    values = collective_shapes(hlo, "all-reduce")
    assert count_communication_primitives(hlo).all_reduce == len(values) == 5 * BLOCKS - 1
    assert_allclose(compiled(params, x), jax.jit(jax.grad(_loss))(params, x), rtol=1e-4, atol=1e-4)
    # The recomputation no longer lives through the forward pass.
    default = lowered.compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    # (Strictly: were XLA on CPU to keep the barriers itself, the option would be moot.)
    assert temp < default.memory_analysis().temp_size_in_bytes


def test_compiler_options_per_platform(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert compiler_options("cpu") == {"xla_disable_hlo_passes": "cse_barrier_expander"}
    assert compiler_options("gpu") is None  # the GPU pipeline keeps barriers to the end
    assert compiler_options("tpu") is None


def test_compiler_options_keep_the_passes_xla_flags_disable(monkeypatch):
    """A compile option replaces the flag of the same name, so the passes a user disabled
    in ``XLA_FLAGS`` are named again."""
    monkeypatch.setenv(
        "XLA_FLAGS",
        "--xla_force_host_platform_device_count=8 --xla_disable_hlo_passes=algsimp,cse",
    )
    options = compiler_options("cpu")
    assert options == {"xla_disable_hlo_passes": "algsimp,cse,cse_barrier_expander"}
    monkeypatch.setenv("XLA_FLAGS", "--xla_disable_hlo_passes=cse_barrier_expander")
    assert compiler_options("cpu") == {"xla_disable_hlo_passes": "cse_barrier_expander"}


def test_hlo_text_prints_each_operand_with_its_shape():
    """``get_hlo_text()`` prints the optimized HLO as Alpa's XLA printed it: an operand
    with its shape, so that a program reading a shard's shape off an instruction's operands
    (``gather(f32[8,32]``: the batch of 64 over 8 devices) finds it; XLA's printer now
    writes the operand's name alone. The collectives read off it are the same."""
    import alpa

    def step(w, x):
        def loss(w):
            h = (x @ w)[:, jnp.arange(16)]
            return jnp.mean(h**2)

        return w - 0.1 * alpa.grad(loss)(w)

    w, x = jnp.ones((32, 32)) / 32, jnp.arange(64 * 32.0).reshape(64, 32) / 2048
    p_step = alpa.parallelize(step, method=alpa.DataParallel(), batch_argnums=(1,))
    assert_allclose(p_step(w, x), jax.jit(step)(w, x), rtol=1e-5, atol=1e-6)
    executable = p_step.get_last_executable()
    text = executable.get_hlo_text()
    assert "gather(f32[8,32]{1,0} %" in text
    assert "gather(f32[8,32]" not in executable.compiled.as_text()  # XLA's own printer
    assert count_communication_primitives(text) == (1, 1, 0, 0, 0)
    assert collective_shapes(text, "all-reduce") == ["f32[32,32]"]
