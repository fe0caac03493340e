"""Rematerialized layers are planned, not replicated (oracles: docs/design.md).

A layer under ``jax.checkpoint`` / ``nn.remat`` differentiates into plain forward equations
and, in the backward pass, one ``remat2`` equation that recomputes the forward before using
it. Its body is planned like any other code (``strategy_graph``), and the lowering binds the
``remat2`` again around the planned body, so that the recomputation stays in the program.

Oracles, on the 8 virtual CPU devices with alpha = beta = 1:

* a checkpointed layer gets the shardings it gets without the checkpoint (Megatron's
  column/row split when the hidden size dwarfs the batch), and the numbers equal the serial
  ``jax.jit(step)``;
* the program holds the recomputation: the recomputed forward's dots and its all-reduces
  (the partial sums of the row-parallel layers) appear a second time in the backward pass.

XLA's CPU pipeline removes the optimization barriers of a checkpoint early
(``cse_barrier_expander``), and its CSE then merged the recomputed forward into the first
one, so that a checkpoint saved no memory; GPU and TPU keep the barriers until after
scheduling. alpa compiles its programs with that pass off (``alpa.xla_compile``), so the
recomputation is counted in the executable's own program, and a checkpointed step
allocates less than a plain one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import Literal
from jax.sharding import PartitionSpec as P

import alpa
from alpa.jax_internals import is_remat
from alpa.model.bert import BertConfig, FlaxBertLayerCollection
from alpa.model.model_util import create_train_state
from alpa.record.parallel_plan import ParallelPlan
from alpa.shard_parallel.auto_sharding import solve_auto_sharding
from alpa.shard_parallel.lowering.constrained_eval import eval_jaxpr_with_constraints
from alpa.shard_parallel.strategies.strategy_graph import build_strategy_graph
from alpa.shard_parallel.strategies.strategy_graph_record import GraphOptions, live_points
from alpa.testing import assert_allclose, program_text
from alpa.testing import run_auto_sharded as _compile
from alpa.testing import unit_cost_mesh as _mesh
from alpa.tracing import inline_calls
from alpa.tracing.trace import trace_step
from alpa.util import count_communication_primitives


def _num_dots(hlo: str) -> int:
    return hlo.count(" dot(")


def _remat_eqns(jaxpr):
    return [e for e in jaxpr.eqns if is_remat(e)]


def _kernel_specs(params) -> dict[str, P]:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(k): v.sharding.spec for k, v in flat if "kernel" in str(k)}


# ----------------------------------------------------------------------------- MLP

HIDDEN, BATCH, LAYERS = 256, 8, 2


def _mlp_step(remat: bool):
    """``LAYERS`` blocks ``tanh(tanh(h @ w1) @ w2)``, each under ``jax.checkpoint`` if
    ``remat``; MSE loss, SGD. Batch 8, hidden 256: the activations (8 x 256) are far smaller
    than the kernels, so Megatron's column/row split is the cheapest plan."""

    def layer(w1, w2, h):
        return jnp.tanh(jnp.tanh(h @ w1) @ w2)

    block = jax.checkpoint(layer) if remat else layer

    def step(params, batch):
        def loss_fn(p):
            h = batch["x"]
            for w1, w2 in p:
                h = block(w1, w2, h)
            return jnp.mean((h - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss

    return step


def _mlp_args():
    k = jax.random.split(jax.random.key(0), 2 * LAYERS + 2)
    params = [
        (
            jax.random.normal(k[2 * i], (HIDDEN, HIDDEN)) / 16,
            jax.random.normal(k[2 * i + 1], (HIDDEN, HIDDEN)) / 16,
        )
        for i in range(LAYERS)
    ]
    batch = {
        "x": jax.random.normal(k[-2], (BATCH, HIDDEN)),
        "y": jax.random.normal(k[-1], (BATCH, HIDDEN)),
    }
    return params, batch


def _trace(step, params, batch):
    return trace_step(step, (params, batch), (), (1,), (), ("params", "batch"))


def test_checkpointed_mlp_body_is_planned_not_replicated():
    """The backward pass holds one ``remat2`` per block; its body's equations are nodes of
    the graph (labelled ``eqn t/u``), none runs opaque, and the recomputed forward dots are
    split as the original ones: column (``RS1``) then row (``S1R``, with the all-reduce of
    the partial sums)."""
    params, batch = _mlp_args()
    traced = _trace(_mlp_step(True), params, batch)
    remats = _remat_eqns(traced.jaxpr)
    assert len(remats) == LAYERS and all(e.params["differentiated"] for e in remats)
    solution = solve_auto_sharding(traced, _mesh((1, 4)))
    rows = solution.rows()
    assert not [r for r in rows if r[2] == "opaque"], [r for r in rows if r[2] == "opaque"]
    body_rows = [r for r in rows if "/" in r[0].split()[1]]
    assert len(body_rows) == sum(len(e.params["jaxpr"].eqns) for e in remats)
    # The first two dots of each body recompute the block's forward pass.
    for t in range(len(traced.jaxpr.eqns)):
        dots = [r for r in body_rows if r[0].startswith(f"eqn {t}/") and "dot_general" in r[0]]
        if dots:
            assert [d[2] for d in dots[:2]] == ["RR x RS1 = RS1", "RS1 x S1R = RR AR1"], dots
    plan = solution.to_sharding_plan()
    assert plan.in_specs[: 2 * LAYERS] == (P(None, "y"), P("y")) * LAYERS
    # The plan pins values inside the bodies.
    body_vars = {v for e in remats for b in e.params["jaxpr"].eqns for v in b.outvars}
    assert body_vars & set(plan.var_specs)


def test_checkpointed_mlp_keeps_its_recomputation_and_numbers():
    """Both steps compile to Megatron's split (same kernel shardings) and the serial
    numbers. Without the checkpoint: 4 forward dots, 7 backward (no input gradient for the
    first block), and 3 all-reduces (the forward partial sums of the two row-parallel dots,
    and the input gradient of the column-parallel dot of block 2, whose sum block 1 needs).
    With it, each block's forward is computed again in the backward pass: 2 more dots and 1
    more all-reduce per block."""
    params, batch = _mlp_args()
    results = {}
    for remat in (False, True):
        step = _mlp_step(remat)
        out, executable = _compile(step, params, batch, (1, 4))
        assert_allclose(out, jax.jit(step)(params, batch), rtol=1e-4, atol=1e-4)
        specs = [[w.sharding.spec for w in layer] for layer in out[0]]
        assert specs == [[P(None, "y"), P("y")]] * LAYERS
        hlo = executable.get_hlo_text()
        results[remat] = (count_communication_primitives(hlo), _num_dots(hlo))
        results[remat, "objective"] = executable.auto_sharding_objective
    (plain, plain_dots), (remat, remat_dots) = results[False], results[True]
    assert plain_dots == 4 + 7
    assert remat_dots == plain_dots + 2 * LAYERS
    assert plain.all_reduce == 3 and plain.total == 3, plain
    assert remat.all_reduce == plain.all_reduce + LAYERS, remat
    assert remat.total == remat.all_reduce, remat
    # The ILP prices the recomputation.
    assert results[True, "objective"] > results[False, "objective"]


def test_checkpointed_mlp_plan_round_trips_through_a_parallel_plan():
    """The plan names the values and equations inside checkpoint bodies by position
    (``eqn16/eqn3.0``); replayed from its JSON it compiles the same program."""
    params, batch = _mlp_args()
    step = _mlp_step(True)
    _, executable = _compile(step, params, batch, (1, 4))
    record = executable.get_parallel_plan()
    sharding = record.sharding_plan
    assert any("/" in ref for ref in sharding.var_specs), sorted(sharding.var_specs)[:5]
    text = record.to_json()
    method = alpa.plan_to_method(ParallelPlan.from_json(text), devices=_mesh((1, 4)))
    p_step = alpa.parallelize(step, method=method, donate_argnums=())
    replayed = p_step.get_executable(params, batch)
    assert program_text(replayed.get_hlo_text()) == program_text(executable.get_hlo_text())
    assert replayed.get_parallel_plan().to_json() == text
    assert_allclose(p_step(params, batch), jax.jit(step)(params, batch), rtol=1e-4, atol=1e-4)


def test_checkpointed_inference_and_micro_batches_match_serial():
    """A checkpoint that is not differentiated (an inference step) is planned the same way,
    and a checkpointed step accumulates gradients over micro-batches."""
    params, batch = _mlp_args()

    def block(w1, w2, h):
        return jnp.tanh(jnp.tanh(h @ w1) @ w2)

    def inference(checkpoint):
        def infer(params, batch):
            h = batch["x"]
            for w1, w2 in params:
                h = (jax.checkpoint(block) if checkpoint else block)(w1, w2, h)
            return h

        return infer

    plans = []
    for checkpoint in (False, True):
        infer = inference(checkpoint)
        out, executable = _compile(infer, params, batch, (1, 4))
        assert_allclose(out, jax.jit(infer)(params, batch), rtol=1e-4, atol=1e-4)
        assert len(_remat_eqns(executable.traced.jaxpr)) == (LAYERS if checkpoint else 0)
        plans.append((executable.plan.in_specs, executable.auto_sharding_objective))
    assert plans[1] == plans[0]

    def train(params, batch):
        def loss_fn(p):
            h = batch["x"]
            for w1, w2 in p:
                h = jax.checkpoint(lambda w1, w2, h: jnp.tanh(h @ w1) @ w2)(w1, w2, h)
            return jnp.mean((h - batch["y"]) ** 2)

        grads = alpa.grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)

    method = alpa.ShardParallel(devices=_mesh((1, 4)), num_micro_batches=2)
    p_train = alpa.parallelize(train, method=method, donate_argnums=())
    assert_allclose(p_train(params, batch), jax.jit(train)(params, batch), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- graph and trace


def test_a_shared_checkpoint_body_is_copied_per_equation():
    """JAX hands two calls of one checkpointed function the same body object; the trace
    copies it with fresh variables per equation (the plan pins each body's values on their
    own), inlines the calls inside it, and passes their constants as extra operands."""
    const = np.arange(4.0, dtype=np.float32)
    inner = jax.jit(lambda x: jnp.sin(x) + const)
    block = jax.checkpoint(lambda w, x: inner(jnp.tanh(x @ w)))

    def f(w, x):
        return block(w, block(w, x))

    w, x = jnp.ones((4, 4)) / 4, jnp.ones((2, 4))
    closed = jax.make_jaxpr(f)(w, x)
    bodies = [e.params["jaxpr"] for e in _remat_eqns(closed.jaxpr)]
    assert len(bodies) == 2 and bodies[0] is bodies[1]
    inlined = inline_calls(closed)
    remats = _remat_eqns(inlined.jaxpr)
    first, second = (e.params["jaxpr"] for e in remats)
    assert first is not second
    body_vars = [{*b.invars, *(v for e in b.eqns for v in e.outvars)} for b in (first, second)]
    assert not body_vars[0] & body_vars[1]
    for eqn, body in zip(remats, (first, second), strict=True):
        assert not any(e.primitive.name in ("jit", "pjit") for e in body.eqns)
        # The jit's constant enters as one more operand, a constant of the step.
        assert len(eqn.invars) == len(body.invars) == 3
        assert eqn.invars[-1] in inlined.jaxpr.constvars
    got = eval_jaxpr_with_constraints(inlined.jaxpr, inlined.consts, (w, x), {})
    assert_allclose(got[0], f(w, x), rtol=1e-6)


def test_graph_lists_checkpoint_bodies_in_program_order():
    """``StrategyGraph.jaxpr`` lists each checkpoint's body equations before the checkpoint
    itself (which has no node), one entry per ``eqn_sources`` entry; every body value has
    a source and is live at some program point."""
    params, batch = _mlp_args()
    traced = _trace(_mlp_step(True), params, batch)
    graph = build_strategy_graph(traced.closed_jaxpr, _mesh((1, 4)), GraphOptions())
    eqns = graph.jaxpr.eqns
    assert len(eqns) == len(graph.eqn_sources) == graph.num_eqns
    remats = _remat_eqns(traced.jaxpr)
    assert len(eqns) == len(traced.jaxpr.eqns) + sum(len(e.params["jaxpr"].eqns) for e in remats)
    position = {id(e): t for t, e in enumerate(eqns)}
    for remat in remats:
        body = remat.params["jaxpr"]
        t = position[id(remat)]
        assert graph.eqn_sources[t] == ()
        assert [position[id(e)] for e in body.eqns] == list(range(t - len(body.eqns), t))
        for inner, outer in zip(body.invars, remat.invars, strict=True):
            assert isinstance(outer, Literal) or graph.sources[inner] == graph.sources[outer]
        for inner, outer in zip(body.outvars, remat.outvars, strict=True):
            assert graph.sources[outer] == graph.sources[inner]
    for eqn, sources in zip(eqns, graph.eqn_sources, strict=True):
        if sources:
            assert graph.nodes[sources[0][0]].outvars == tuple(eqn.outvars)
    live = set().union(*live_points(graph))
    body_sources = {graph.sources[v] for e in remats for b in e.params["jaxpr"].eqns
                    for v in b.outvars}  # fmt: skip
    assert body_sources <= live


# ----------------------------------------------------------------------------- BERT

BERT_LAYERS = 2


def _bert_stack(gradient_checkpointing: bool, batch_size: int = 2, seq_len: int = 16):
    """``BERT_LAYERS`` BERT encoder layers (hidden 64, 4 heads, FFN 256), sequence 16, batch
    2 by default, regressed onto random targets with SGD: the parameters dwarf the
    activations, so the layers are split as Megatron splits them."""
    config = BertConfig(
        hidden_size=64, num_layers=BERT_LAYERS, num_heads=4,
        gradient_checkpointing=gradient_checkpointing,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    shape = (batch_size, seq_len, 64)
    batch = {
        "x": jnp.asarray(rng.standard_normal(shape, dtype=np.float32)),
        "y": jnp.asarray(rng.standard_normal(shape, dtype=np.float32)),
        "attention_mask": jnp.ones(shape[:2], jnp.int32),
    }
    model = FlaxBertLayerCollection(config)
    init = (batch["x"], batch["attention_mask"])
    state = create_train_state(model, init, optax.sgd(1e-2), 0, abstract=False)

    def step(state, batch):
        def loss_fn(params):
            out = state.apply_fn({"params": params}, batch["x"], batch["attention_mask"])
            return jnp.mean((out - batch["y"]) ** 2)

        loss, grads = alpa.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return state, batch, step


def test_checkpointed_bert_layers_split_as_plain_ones():
    """With ``gradient_checkpointing`` every layer is one ``remat2`` in the backward pass.
    On (1, 4) the kernels get the shardings they get without it: query, key, value and the
    MLP input by columns (by heads), the attention output and MLP output by rows; the
    numbers equal the serial step's. The program has the same model-parallel all-reduces
    (and nothing else) plus those of the recomputed forward: the partial sums of the two
    row-parallel layers, 2 per layer."""
    results = {}
    for remat in (False, True):
        state, batch, step = _bert_stack(remat)
        out, executable = _compile(step, state, batch, (1, 4))
        assert_allclose(out, jax.jit(step)(state, batch), rtol=1e-4, atol=1e-4)
        remats = _remat_eqns(executable.traced.jaxpr)
        assert len(remats) == (BERT_LAYERS if remat else 0)
        specs = _kernel_specs(out[0].params)
        for i in range(BERT_LAYERS):
            for name in ("query", "key", "value"):
                assert specs[f"['{i}']['attention']['{name}']['kernel']"] == P(None, "y")
            assert specs[f"['{i}']['attention']['out']['kernel']"] == P("y")
            assert specs[f"['{i}']['mlp']['wi']['kernel']"] == P(None, "y")
            assert specs[f"['{i}']['mlp']['wo']['kernel']"] == P("y")
        counts = count_communication_primitives(executable.get_hlo_text())
        assert counts.total == counts.all_reduce, counts
        results[remat] = (specs, counts.all_reduce, executable.auto_sharding_objective)
    assert results[True][0] == results[False][0]
    assert results[True][1] == results[False][1] + 2 * BERT_LAYERS, results
    assert results[True][2] > results[False][2]


def test_checkpointed_bert_layers_allocate_less_than_plain_ones():
    """The memory a checkpoint is for: at batch 8 and sequence 64 the activations dwarf the
    parameters, and the checkpointed step allocates a third less than the plain one (XLA's
    memory analysis of the compiled step on (1, 4): 1.93 MB against 2.91 MB a device).
    Compiled with XLA's CPU pipeline as it is, the recomputation was merged into the
    forward pass and the checkpointed step allocated as much as the plain one."""
    sizes = {}
    for remat in (False, True):
        state, batch, step = _bert_stack(remat, batch_size=8, seq_len=64)
        out, executable = _compile(step, state, batch, (1, 4))
        assert_allclose(out, jax.jit(step)(state, batch), rtol=1e-4, atol=1e-4)
        sizes[remat] = executable.get_total_allocation_size()
    assert sizes[True] < 0.75 * sizes[False], sizes
