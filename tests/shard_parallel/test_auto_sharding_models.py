"""The conv net (Wide-ResNet) and BERT through the auto-sharding ILP (oracles: docs/design.md).

Each compiled test plans a tiny model with ``ShardParallel`` (the ILP) on the 8 virtual CPU
devices and checks the collectives counted in the compiled HLO against what the chosen
strategy needs, the parameters' output shardings, and the numbers against the serial
``jax.jit(step)`` at 1e-4. Cost parameters are alpha = beta = 1 on both mesh axes.

The rule tests price single convolutions of a forward and backward pass without compiling:
every convolution of a batch-split step has a batch-split strategy that needs no resharding,
and only the kernel gradient (which contracts over the batch) pays an all-reduce.
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import alpa
from alpa.model.bert import BertConfig, get_bert_train_state_and_step
from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step
from alpa.model.mlp import MLPModel, get_mlp_train_state_and_step
from alpa.model.moe import MoEConfig, get_moe_train_state_and_step
from alpa.model.wide_resnet import WResNetConfig, get_wresnet_train_state_and_step
from alpa.shard_parallel.auto_sharding import solve_auto_sharding
from alpa.shard_parallel.strategies.sharding_spec import enumerate_specs
from alpa.shard_parallel.strategies.strategy_graph import build_strategy_graph
from alpa.shard_parallel.strategies.strategy_graph_record import GraphOptions
from alpa.shard_parallel.strategies.strategy_rules import RuleContext, lookup_rule
from alpa.testing import assert_allclose
from alpa.testing import run_auto_sharded as _compile
from alpa.testing import unit_cost_mesh as _mesh
from alpa.tracing.trace import trace_step
from alpa.util import count_communication_primitives


def _counts(executable):
    return count_communication_primitives(executable.get_hlo_text())


def _specs(tree) -> set[P]:
    return {leaf.sharding.spec for leaf in jax.tree_util.tree_leaves(tree)}


def _data_axis(executable, shape) -> str:
    return executable.plan.logical_mesh.axis_names[0 if shape[0] > 1 else 1]


# ----------------------------------------------------------------------------- Wide-ResNet

#: Stem conv3x3 + BN, then one basic block (conv3x3 + BN + relu + conv3x3 + BN) whose input
#: and output widths agree (4 channels, stride 1), so it has no shortcut convolution: three
#: batch norms in a chain. Batch 32 of 8x8 images: every activation (32x8x8x4 floats, 32 KiB)
#: dwarfs every parameter (at most 3x3x4x4 floats), so data parallelism is the cheapest plan.
WRESNET = WResNetConfig((1,), num_filters=4, width_factor=1, num_classes=4, image_size=8)
WRESNET_BATCH_NORMS = 3


@pytest.fixture(scope="module")
def wresnet():
    state, batch, step = get_wresnet_train_state_and_step(WRESNET, 32)
    return state, batch, step, jax.jit(step)(state, batch)


@pytest.mark.parametrize("shape", [(8, 1), (1, 8)])
def test_wresnet_large_batch_is_data_parallel(wresnet, shape):
    state, batch, step, expected = wresnet
    out, executable = _compile(step, state, batch, shape)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    new_state, _ = out
    # Data parallel: parameters, optimizer state and running statistics stay whole; the
    # images are split by batch over the mesh axis that has the devices.
    assert _specs(new_state.params) == {P()}
    assert _specs(new_state.opt_state) == {P()}
    assert _specs(new_state.batch_stats) == {P()}
    assert executable.plan.data_axes == (_data_axis(executable, shape),)
    # With the batch split, batch norm in training mode needs, per layer:
    #  * forward: the batch mean of x and of x^2 (two sums, one tuple all-reduce);
    #  * backward: the batch sums of the cotangent and of cotangent * x, without which the
    #    input's gradient cannot be formed (one tuple all-reduce).
    # XLA's all-reduce combiner packs each parameter gradient into the first of these that
    # follows it; the gradients of what precedes the first batch norm (the stem kernel) are
    # only ready after the last backward one and travel in one final all-reduce. Hence
    # 2 x 3 + 1 = 7 all-reduces, and nothing else (no all-gather, no all-to-all).
    counts = _counts(executable)
    assert counts.all_reduce == 2 * WRESNET_BATCH_NORMS + 1, counts
    assert counts.total == counts.all_reduce, counts


def test_wresnet_plan_is_data_parallel_program(wresnet):
    """The ILP's program has exactly DataParallel's collectives and parameter shardings."""
    state, batch, step, _ = wresnet
    out, executable = _compile(step, state, batch, (8, 1))
    dp_step = alpa.parallelize(step, method=alpa.DataParallel(), donate_argnums=())
    dp_out = dp_step(state, batch)
    assert _counts(executable) == _counts(dp_step.get_last_executable())
    assert _specs(out[0].params) == _specs(dp_out[0].params) == {P()}


# ----------------------------------------------------------------------------- BERT

#: One BERT layer (hidden 8, 2 heads, FFN 32), vocabulary 16, sequence 8, batch 128: every
#: activation (128x8x8 floats) is far larger than every parameter (the 16x8 tied embedding,
#: the 8x32 FFN kernels), so data parallelism is the cheapest plan.
BERT = BertConfig(
    hidden_size=8, num_layers=1, num_heads=2, vocab_size=16, max_position_embeddings=8
)


@pytest.fixture(scope="module")
def bert():
    state, batch, step = get_bert_train_state_and_step(BERT, 128)
    return state, batch, step, jax.jit(step)(state, batch)


@pytest.mark.parametrize("shape", [(8, 1), (1, 8)])
def test_bert_large_batch_is_data_parallel(bert, shape):
    state, batch, step, expected = bert
    # pyproject turns warnings into errors: a primitive without a strategy rule fails here.
    out, executable = _compile(step, state, batch, shape)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    new_state, _ = out
    assert _specs(new_state.params) == {P()}
    assert _specs(new_state.opt_state) == {P()}
    axis = _data_axis(executable, shape)
    assert executable.plan.data_axes == (axis,)
    # The batch arguments are sorted by key: attention_mask, input_ids, label_mask, labels,
    # position_ids, token_type_ids. All are split by batch except label_mask: the loss
    # divides by the number of masked tokens, sum(label_mask), and the ILP reads that
    # argument whole (free) rather than summing a split one (an all-reduce).
    assert executable.plan.in_specs[-6:] == (P(axis), P(axis), P(), P(axis), P(axis), P(axis))
    # Data parallel with the token count computed locally: one all-reduce, the tuple of
    # every parameter gradient together with the loss's partial sum (XLA combines them).
    counts = _counts(executable)
    assert counts.all_reduce == 1, counts
    assert counts.total == 1, counts


# ----------------------------------------------------------------------------- rule coverage


def _graph(step, state, batch, shape=(8, 1)):
    traced = trace_step(step, (state, batch), (), (1,), (), ("state", "batch"))
    return build_strategy_graph(traced.closed_jaxpr, _mesh(shape), GraphOptions())


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize(
    "config",
    [
        WRESNET,
        WResNetConfig(
            (1, 1), num_filters=4, width_factor=1, num_classes=4, image_size=16,
            block="bottleneck", imagenet_stem=True,
        ),
    ],
    ids=["basic", "bottleneck-imagenet-stem"],
)  # fmt: skip
def test_wresnet_step_has_a_rule_for_every_primitive(config, optimizer):
    """Strided and 1x1 convolutions, max pooling and its gradient (select_and_scatter_add),
    batch norm, the global average pool, and every optimizer: no replicated fallback."""
    state, batch, step = get_wresnet_train_state_and_step(
        config, 16, optimizer=optimizer, abstract=True
    )
    assert _graph(step, state, batch).unknown_primitives == ()


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd"])
def test_bert_step_has_a_rule_for_every_primitive(optimizer):
    state, batch, step = get_bert_train_state_and_step(BERT, 16, optimizer=optimizer, abstract=True)
    assert _graph(step, state, batch).unknown_primitives == ()


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize(
    "name, factory",
    [
        ("mlp", lambda opt: get_mlp_train_state_and_step(
            MLPModel(hidden_size=16, num_layers=2, output_dim=4), 16, 8, optimizer=opt,
            abstract=True)),
        ("gpt-tied", lambda opt: get_gpt_train_state_and_step(
            GPTConfig(hidden_size=16, num_layers=1, num_heads=2, seq_len=8, vocab_size=32),
            4, optimizer=opt, abstract=True)),
        ("gpt-untied", lambda opt: get_gpt_train_state_and_step(
            GPTConfig(hidden_size=16, num_layers=1, num_heads=2, seq_len=8, vocab_size=32,
                      tie_word_embeddings=False), 4, optimizer=opt, abstract=True)),
        ("moe", lambda opt: get_moe_train_state_and_step(
            MoEConfig(hidden_size=16, num_layers=2, num_heads=2, num_experts=4, seq_len=8,
                      vocab_size=32, expert_group_size=8), 4, optimizer=opt, abstract=True)),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)  # fmt: skip
def test_model_steps_have_a_rule_for_every_primitive(name, factory, optimizer):
    """The other models of ``alpa.model`` (attention, softmax, GELU, layer norm, top-2
    gating with capacity, the tied and untied LM head) with each optimizer."""
    state, batch, step = factory(optimizer)
    assert _graph(step, state, batch).unknown_primitives == ()


def test_control_flow_matches_serial():
    """``lax.scan`` over stacked layers with ``jax.checkpoint`` inside, and a ``lax.cond``:
    the scan's body is planned (its carry, rows and stacked outputs are nodes; the forward
    and the transposed scan alike), so are the ``cond``'s branches (its result is a node;
    forward and transposed), nothing is opaque, the planner neither crashes nor warns, and
    the step's numbers equal the serial step's."""

    def step(params, batch):
        def loss_fn(p):
            def layer(h, w):
                return jax.checkpoint(lambda h: jnp.tanh(h @ w))(h), None

            h, _ = lax.scan(layer, batch["x"], p["stack"])
            h = lax.cond(jnp.sum(h) > 0, lambda v: v * 2.0, lambda v: v - 1.0, h)
            return jnp.mean((h @ p["out"] - batch["y"]) ** 2)

        loss, grads = alpa.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss

    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "stack": jax.random.normal(k[0], (3, 16, 16)) * 0.3,
        "out": jax.random.normal(k[1], (16, 4)),
    }
    batch = {"x": jax.random.normal(k[2], (32, 16)), "y": jax.random.normal(k[3], (32, 4))}
    out, _ = _compile(step, params, batch, (8, 1))
    assert_allclose(out, jax.jit(step)(params, batch), rtol=1e-4, atol=1e-4)
    traced = trace_step(step, (params, batch), (), (1,), (), ("params", "batch"))
    solution = solve_auto_sharding(traced, _mesh((8, 1)))
    opaque = {row[0].split()[-1] for row in solution.rows() if row[2] == "opaque"}
    assert not opaque, opaque
    kinds = Counter(row[0].rsplit(" of ", 1)[0] for row in solution.rows() if " of eqn" in row[0])
    # Two scans (forward, transposed), one carry each; rows: the stacked weights forward,
    # the weights and the saved carries backward; stacked outputs: the saved carries and
    # the weights' gradient.
    assert kinds["carry"] == 2 and kinds["row"] == 3 and kinds["stacked output"] == 2, kinds
    assert kinds["result"] == 2, kinds  # the cond's one result, forward and transposed


# ----------------------------------------------------------------------------- conv rules


def _conv_eqns(groups: int = 1):
    """The three convolutions of the forward and backward pass of one NHWC conv3x3 with 16
    channels in ``groups`` groups: ``[forward, input gradient, kernel gradient]``, the two
    gradients told apart by their results' shapes."""

    def loss(x, w):
        y = lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=groups,
        )  # fmt: skip
        return jnp.sum(y**2)

    x = jax.ShapeDtypeStruct((32, 8, 8, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, 16 // groups, 16), jnp.float32)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w).jaxpr
    forward, *backward = [e for e in jaxpr.eqns if e.primitive is lax.conv_general_dilated_p]
    input_grad = next(e for e in backward if e.outvars[0].aval.shape == x.shape)
    kernel_grad = next(e for e in backward if e.outvars[0].aval.shape == w.shape)
    return forward, input_grad, kernel_grad


def _conv_strategies(eqn, mesh):
    operand_specs = tuple(
        tuple(enumerate_specs(v.aval.shape, mesh)) for v in eqn.invars
    )  # fmt: skip
    ctx = RuleContext(mesh, False, False, False, operand_specs)
    return lookup_rule(eqn.primitive)(eqn, ctx).strategies


def test_conv_rule_offers_batch_split_for_forward_and_both_gradients():
    """On (8, 1), split the batch dimension N of the activations and of their cotangents:
    the forward and input-gradient convolutions then run locally (no communication), and
    the kernel gradient, which contracts over N, ends in one all-reduce of the 3x3x16x16
    kernel (9216 bytes: alpha + beta * 2 * 7/8 * 9216 = 16129)."""
    mesh = _mesh((8, 1))
    forward, input_grad, kernel_grad = _conv_eqns()
    batch_split = ((0,), (), (), ())
    kernel_whole = ((),) * 4
    by_operands = {}
    for eqn in (forward, input_grad, kernel_grad):
        for s in _conv_strategies(eqn, mesh):
            by_operands[(id(eqn), tuple(s.in_specs))] = s
    # forward: images x kernel -> activations; input gradient: cotangent x flipped kernel.
    for eqn in (forward, input_grad):
        s = by_operands[(id(eqn), (batch_split, kernel_whole))]
        assert s.out_specs == (batch_split,) and s.comm_cost == 0
    # kernel gradient: activations x cotangent, contracted over the batch.
    s = by_operands[(id(kernel_grad), (batch_split, batch_split))]
    assert s.out_specs == (kernel_whole,)
    assert s.comm_cost == pytest.approx(1 + 2 * 7 / 8 * 9216)


def test_conv_rule_splits_output_and_input_features():
    """On (1, 8), the forward convolution also offers Megatron's two splits: output features
    (kernel split on O, result split on C, no communication) and input features (both
    operands split on the contracted C_in, result all-reduced: 32x8x8x16 floats, 131072
    bytes, alpha + beta * 2 * 7/8 * 131072 = 229377)."""
    mesh = _mesh((1, 8))
    forward = _conv_eqns()[0]
    strategies = {tuple(s.in_specs): s for s in _conv_strategies(forward, mesh)}
    whole4 = ((),) * 4
    out_feature = strategies[(whole4, ((), (), (), (1,)))]
    assert out_feature.out_specs == (((), (), (), (1,)),) and out_feature.comm_cost == 0
    in_feature = strategies[(((), (), (), (1,)), ((), (), (1,), ()))]
    assert in_feature.out_specs == (whole4,)
    assert in_feature.comm_cost == pytest.approx(1 + 2 * 7 / 8 * 131072)
    # Heavy ops use every mesh axis: no strategy leaves the convolution replicated.
    assert all(s.in_specs != (whole4, whole4) for s in strategies.values())


def test_depthwise_conv_rule_splits_batch_and_groups():
    """A depthwise convolution (16 groups of one channel). On (8, 1) the batch split runs
    the forward and input gradient (``feature_group_count=16``) locally, and the kernel
    gradient (``batch_group_count=16``) contracts over the batch: an all-reduce of the
    3x3x1x16 kernel (576 bytes: 1 + 2 * 7/8 * 576 = 1009). On (1, 8) every convolution can
    instead keep two whole groups per device: channels split, no communication at all."""
    forward, input_grad, kernel_grad = _conv_eqns(groups=16)
    batch_split = ((0,), (), (), ())
    whole4 = ((),) * 4
    mesh = _mesh((8, 1))
    for eqn in (forward, input_grad):
        strategies = {tuple(s.in_specs): s for s in _conv_strategies(eqn, mesh)}
        s = strategies[(batch_split, whole4)]
        assert s.out_specs == (batch_split,) and s.comm_cost == 0
    strategies = {tuple(s.in_specs): s for s in _conv_strategies(kernel_grad, mesh)}
    s = strategies[(batch_split, batch_split)]
    assert s.out_specs == (whole4,)
    assert s.comm_cost == pytest.approx(1 + 2 * 7 / 8 * 576)
    mesh = _mesh((1, 8))
    channels = ((), (), (), (1,))
    kernel = {
        forward: ((), (), (), (1,)),  # HWIO: O holds the groups
        input_grad: ((), (), (1,), ()),  # the flipped kernel: HWOI
    }
    for eqn, kernel_spec in kernel.items():
        strategies = {tuple(s.in_specs): s for s in _conv_strategies(eqn, mesh)}
        s = strategies[(channels, kernel_spec)]
        assert s.out_specs == (channels,) and s.comm_cost == 0
    strategies = {tuple(s.in_specs): s for s in _conv_strategies(kernel_grad, mesh)}
    s = strategies[(channels, channels)]
    assert s.out_specs == (((), (), (), (1,)),) and s.comm_cost == 0


@pytest.mark.parametrize("shape", [(8, 1), (1, 8)])
def test_depthwise_conv_step_numerics(shape):
    """An SGD step of a depthwise conv3x3 through the ILP equals the serial step."""

    def step(w, x):
        def loss(w):
            y = lax.conv_general_dilated(
                x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                feature_group_count=16,
            )  # fmt: skip
            return jnp.mean(jnp.tanh(y) ** 2)

        return w - 0.1 * jax.grad(loss)(w)

    key_w, key_x = jax.random.split(jax.random.key(0))
    w = jax.random.normal(key_w, (3, 3, 1, 16))
    x = jax.random.normal(key_x, (32, 8, 8, 16))
    method = alpa.ShardParallel(devices=_mesh(shape))
    out = alpa.parallelize(step, method=method, donate_argnums=())(w, x)
    assert_allclose(out, jax.jit(step)(w, x), rtol=1e-4, atol=1e-4)
