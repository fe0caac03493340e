"""The batch dimensions of every value, read off the jaxpr (``tracing.batch_dims``).

Oracle: a second trace of the step at ``1 / n`` of the batch
(``micro_batches.retraced_batch_dims``), which shows the answer directly: the dimensions
``n`` times smaller there. On the models of ``alpa.model`` (GPT with Adam and remat, a
scanned GPT, BERT, MoE, Wide-ResNet's convolutions and batch norm, an MLP; one with dropout under
``optax.MultiSteps``, a ``cond``), traced as
``alpa.grad`` steps with 2 micro-batches, the two agree on every value something reads.
Units: reshapes that merge and split the rows (the rows as a minor factor too), a value
made from constants tied to the rows it is added to, and where the rules give up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import alpa
from alpa.model.bert import BertConfig, get_bert_train_state_and_step
from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step
from alpa.model.mlp import MLPModel, get_mlp_train_state_and_step
from alpa.model.moe import MoEConfig, get_moe_train_state_and_step
from alpa.model.wide_resnet import WResNetConfig, get_wresnet_train_state_and_step
from alpa.shard_parallel.gradients.micro_batches import retraced_batch_dims
from alpa.tracing import is_var
from alpa.tracing.batch_dims import static_batch_dims
from alpa.tracing.jaxpr_util import planned_bodies

GPT = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "seq_len": 8, "vocab_size": 64}


def _traced(step, *args, micro_batches: int = 2):
    """``step``'s trace as ``parallelize`` makes it (with its retrace), not compiled."""
    f = alpa.parallelize(step, method=alpa.DataParallel(num_micro_batches=micro_batches))
    static, batch, donate = f._resolve_argnums(args)
    _, names = f._flatten(args, static)
    return f._trace(args, static, batch, donate, names, micro_batches)


def _read(jaxpr) -> set:
    read = {v for e in jaxpr.eqns for v in e.invars if is_var(v)}
    return read | {v for v in jaxpr.outvars if is_var(v)}


def _read_in_bodies(jaxpr) -> set:
    """The values that equations inside the bodies of ``jaxpr``'s equations read (a scan's,
    a checkpoint's, a cond's branches', nested)."""
    found = set()
    for eqn in jaxpr.eqns:
        for _, body in planned_bodies(eqn):
            found |= _read(body) | _read_in_bodies(body)
    return found


def _multi_steps_dropout_mlp():
    """An MLP with dropout (``random_bits``) under ``optax.MultiSteps`` (a ``cond``)."""
    tx = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2)
    params = {"w": jnp.ones((16, 32)), "v": jnp.ones((32, 4))}
    batch = {"x": jnp.ones((16, 16)), "y": jnp.ones((16, 4))}

    def step(state, batch):
        params, opt = state

        def loss(p):
            h = jnp.tanh(batch["x"] @ p["w"])
            keep = jax.random.bernoulli(jax.random.key(0), 0.9, h.shape)
            return jnp.mean((jnp.where(keep, h / 0.9, 0.0) @ p["v"] - batch["y"]) ** 2)

        updates, opt = tx.update(alpa.grad(loss)(params), opt, params)
        return optax.apply_updates(params, updates), opt

    return (params, tx.init(params)), batch, step


MODELS = {
    "mlp_multi_steps_dropout": _multi_steps_dropout_mlp,
    "gpt_adam_remat": lambda: get_gpt_train_state_and_step(
        GPTConfig(**GPT, remat_layers=True), 16, optimizer="adam", grad_func=alpa.value_and_grad,
        abstract=True,
    ),
    "gpt_scanned": lambda: get_gpt_train_state_and_step(
        GPTConfig(**GPT, scan_layers=True, remat_layers=True), 16, optimizer="sgd",
        grad_func=alpa.value_and_grad, abstract=True,
    ),
    "bert": lambda: get_bert_train_state_and_step(
        BertConfig(hidden_size=32, num_layers=2, num_heads=4, vocab_size=64,
                   max_position_embeddings=8), 16, grad_func=alpa.value_and_grad, abstract=True,
    ),
    "moe": lambda: get_moe_train_state_and_step(
        MoEConfig(hidden_size=32, num_layers=2, num_heads=4, num_experts=4, seq_len=8,
                  vocab_size=64), 16, grad_func=alpa.value_and_grad, abstract=True,
    ),
    "wresnet": lambda: get_wresnet_train_state_and_step(
        WResNetConfig((1,), num_filters=4, width_factor=1, num_classes=4, image_size=8), 16,
        grad_func=alpa.value_and_grad, abstract=True,
    ),
    "mlp": lambda: get_mlp_train_state_and_step(
        MLPModel(hidden_size=32, num_layers=3), 16, 16, grad_func=alpa.value_and_grad,
        abstract=True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("n", [2, 4])
def test_the_jaxpr_rules_agree_with_a_retrace(name, n):
    state, batch, step = MODELS[name]()
    traced = _traced(step, state, batch)
    static = static_batch_dims(traced.jaxpr, traced.batch_invars, n)
    assert static is not None, f"{name}: the rules did not follow every value"
    retraced = retraced_batch_dims(traced, n)
    assert retraced is not None
    read = _read(traced.jaxpr)
    differ = [(v, static[v], u) for v, u in retraced.items() if v in read and static[v] != u]
    assert not differ, differ[:5]
    rows = sum(1 for v in read if static.get(v))
    assert rows > 10  # the batch reached many values (not a vacuous agreement)
    # Inside bodies too (where row sums are deferred through a scan or a checkpoint).
    inner = _read_in_bodies(traced.jaxpr)
    differ = [
        (v, static.get(v), u) for v, u in retraced.items() if v in inner and static.get(v) != u
    ]
    assert not differ, differ[:5]
    if name in ("gpt_scanned", "gpt_adam_remat"):
        assert sum(1 for v in inner if static.get(v)) > 10


def _dims(fun, *args, batch=(True,), n=2):
    jaxpr = jax.make_jaxpr(fun)(*args).jaxpr
    return jaxpr, static_batch_dims(jaxpr, batch + (False,) * (len(args) - len(batch)), n)


def test_reshapes_keep_the_rows_where_they_are_in_the_flat_index():
    """``[B, S, H] -> [B * S, H] -> [B, S, H]`` keeps the rows in dim 0; ``[S, B]`` (the
    rows as the minor factor) merged to ``[S * B]`` and split back keeps them in dim 1,
    where a rule that always took the major part would put them in dim 0."""
    B, S, H = 8, 3, 4

    def fun(x):
        flat = x.reshape(B * S, H)
        back = flat.reshape(B, S, H)
        minor = back[:, :, 0].T  # [S, B]
        merged = minor.reshape(S * B)
        return back, merged.reshape(S, B)

    jaxpr, dims = _dims(fun, jnp.ones((B, S, H)))
    reshapes = [e for e in jaxpr.eqns if e.primitive.name == "reshape"]
    assert [dims[e.outvars[0]] for e in reshapes] == [(0,), (0,), (0,), (1,)]


def test_a_reshape_that_splits_the_rows_gives_up():
    """``[B] -> [2, B / 2]`` puts some rows in each dimension: no answer (the caller
    retraces)."""
    _, dims = _dims(lambda x: jnp.sum(x.reshape(2, 4, 3), axis=0), jnp.ones((8, 3)))
    assert dims is None


def test_constants_take_the_rows_they_are_combined_with():
    """``zeros_like(x)`` (a broadcast of a constant) and an ``iota`` of the batch's size
    added to the rows hold rows; a value nothing reads needs no answer."""

    def fun(x, w):
        offset = jnp.arange(8.0)[:, None]  # the rows' size, written out
        unused = jnp.zeros((8, 5))  # noqa: F841  (read by nothing)
        h = x @ w
        return jnp.zeros_like(h) + h + offset

    jaxpr, dims = _dims(fun, jnp.ones((8, 3)), jnp.ones((3, 5)))
    by_name = {e.primitive.name: dims[e.outvars[0]] for e in jaxpr.eqns}
    assert by_name["iota"] == (0,) and by_name["dot_general"] == (0,)
    assert dims[jaxpr.outvars[0]] == (0,)
    zeros = [e.outvars[0] for e in jaxpr.eqns if e.primitive.name == "broadcast_in_dim"]
    assert all(dims[v] in ((0,), None) for v in zeros)


def test_row_sums_remove_the_rows_and_unknown_primitives_give_up():
    def row_sum(x, w):
        return jnp.sum(x @ w, axis=0), x.T @ x

    jaxpr, dims = _dims(row_sum, jnp.ones((8, 3)), jnp.ones((3, 5)))
    assert [dims[v] for v in jaxpr.outvars] == [(), ()]
    _, dims = _dims(lambda x: jnp.fft.fft(x).real, jnp.ones((8, 4)))
    assert dims is None
