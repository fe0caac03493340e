"""The models the cost-model benchmarks price and run, written here, apart from
``alpa/model``: an MLP, a GPT (its blocks written out, or one ``nn.scan`` over them) with
an explicit causal mask, and each one's train step with Adam.

``train_setup(name, ...)`` returns ``(state, batch, step)``; ``abstract=True`` gives
``jax.ShapeDtypeStruct`` s (no weights allocated), for planning clusters that are not here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import alpa


@dataclasses.dataclass(frozen=True)
class GPTSize:
    blocks: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    dtype: Any = jnp.float32
    scan: bool = False


#: The GPT of the issue's CPU trial, and GPT-39B (Alpa's paper's largest weak-scaling GPT).
GPT_SMALL = GPTSize(blocks=4, hidden=256, heads=4, seq=128, vocab=2048)
GPT_39B = GPTSize(blocks=48, hidden=8192, heads=64, seq=1024, vocab=51200)


class Block(nn.Module):
    size: GPTSize

    @nn.compact
    def __call__(self, x):
        s = self.size
        head = s.hidden // s.heads
        y = nn.LayerNorm(dtype=s.dtype)(x)
        qkv = nn.Dense(3 * s.hidden, dtype=s.dtype)(y)
        q, k, v = jnp.split(qkv.reshape(*x.shape[:2], 3 * s.heads, head), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head)
        mask = jnp.tril(jnp.ones((s.seq, s.seq), dtype=bool))
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        attention = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", attention, v).reshape(x.shape)
        x = x + nn.Dense(s.hidden, dtype=s.dtype)(out)
        y = nn.LayerNorm(dtype=s.dtype)(x)
        y = nn.Dense(4 * s.hidden, dtype=s.dtype)(y)
        y = nn.Dense(s.hidden, dtype=s.dtype)(jax.nn.gelu(y))
        return x + y


class ScannedBlock(nn.Module):
    size: GPTSize

    @nn.compact
    def __call__(self, x, _):
        return Block(self.size)(x), None


class GPT(nn.Module):
    size: GPTSize

    @nn.compact
    def __call__(self, tokens):
        s = self.size
        embed = nn.Embed(s.vocab, s.hidden, dtype=s.dtype)
        x = embed(tokens) + self.param(
            "positions", nn.initializers.normal(0.02), (s.seq, s.hidden)
        ).astype(s.dtype)
        if s.scan:
            blocks = nn.scan(
                ScannedBlock,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=s.blocks,
            )
            x, _ = blocks(s)(x, None)
        else:
            for _ in range(s.blocks):
                x = Block(s)(x)
        x = nn.LayerNorm(dtype=s.dtype)(x)
        return embed.attend(x)


class MLP(nn.Module):
    width: int
    depth: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(x.shape[-1])(x)


def _state(model, example, abstract: bool) -> TrainState:
    def create():
        params = model.init(jax.random.PRNGKey(0), example)["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-4))

    return jax.eval_shape(create) if abstract else create()


def gpt_setup(size: GPTSize, batch_size: int, abstract: bool = False):
    """``(state, batch, step)`` of next-token prediction with ``size``'s GPT."""
    model = GPT(size)
    shape = (batch_size, size.seq)
    if abstract:
        batch = {
            "tokens": jax.ShapeDtypeStruct(shape, jnp.int32),
            "labels": jax.ShapeDtypeStruct(shape, jnp.int32),
        }
    else:
        rng = np.random.default_rng(0)
        batch = {
            "tokens": jnp.asarray(rng.integers(0, size.vocab, shape, dtype=np.int32)),
            "labels": jnp.asarray(rng.integers(0, size.vocab, shape, dtype=np.int32)),
        }
    state = _state(model, jnp.zeros((1, size.seq), jnp.int32), abstract)

    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["tokens"]).astype(jnp.float32)
            labels = jax.nn.one_hot(batch["labels"], size.vocab)
            return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))

        loss, grads = alpa.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return state, batch, step


def mlp_setup(width: int, depth: int, batch_size: int):
    """``(state, batch, step)`` of a regression MLP."""
    model = MLP(width, depth)
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.standard_normal((batch_size, width), dtype=np.float32)),
        "y": jnp.asarray(rng.standard_normal((batch_size, width), dtype=np.float32)),
    }
    state = _state(model, batch["x"][:1], False)

    def step(state, batch):
        def loss_fn(params):
            out = state.apply_fn({"params": params}, batch["x"])
            return jnp.mean((out - batch["y"]) ** 2)

        loss, grads = alpa.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return state, batch, step
