"""Helpers for writing tests of parallelized code (public API, as in Alpa's ``alpa.testing``).

A test of a parallel plan is an oracle test: run the same train step serially (``jax.jit``)
and parallelized (``alpa.parallelize``) from the same state and batch, and compare the results
leaf by leaf with :func:`assert_allclose`. This module supplies the pieces:

* model factories that return ``(state, batch, train_step)``:
  :func:`get_mlp_train_state_and_step` (an MLP regression) and
  :func:`get_bert_layer_train_state_and_step` (a stack of BERT encoder layers regressed
  onto random targets), and :func:`get_tied_embedding_step` (a language model whose input
  embedding is its output projection). ``train_step(state, batch) -> state`` differentiates with
  ``alpa.grad``, which is ``jax.grad`` plus the markers pipelining needs, so the same step
  runs under ``jax.jit`` (the reference), ``ShardParallel`` and ``PipeshardParallel``;
  with ``add_manual_pipeline_marker=True`` the models mark a pipeline boundary between
  their layers, for ``layer_option="manual"``;
* inference steps ``(state, batch) -> (output, loss)`` for the states of those factories:
  :func:`mlp_inference_step` and :func:`bert_layer_collection_inference_step`;
* :func:`create_train_state` for a model of your own, and
* :class:`PipelineBasicTest`, a ``unittest`` base class whose ``run_mlp`` and
  ``run_n_layer_bert`` compile a pipelined step and compare it with the serial one.

States follow ``alpa.model``'s convention: ``state.params`` holds the ``"params"``
collection of the flax model (not the whole variables dict, as in Alpa), and the steps call
``state.apply_fn({"params": params}, ...)``.

Every factory draws its parameters and batch from ``seed``, which defaults to
``alpa.global_config.seed``: after ``alpa.set_seed(s)``, two calls build identical states.
"""

from __future__ import annotations

import dataclasses
import math
import re
import unittest
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from alpa.global_env import check_seed, global_config

PyTree = Any
#: ``(state, batch, train_step)``, with ``train_step(state, batch) -> state``.
StateBatchStep = tuple[Any, dict[str, jax.Array], Callable[[Any, Any], Any]]


# ----------------------------------------------------------------------------- comparing


def assert_allclose(x: Any, y: Any, rtol: float = 1e-4, atol: float = 1e-4) -> None:
    """Assert two pytrees (dicts, tuples, flax ``TrainState``...) hold the same structure
    of leaves, equal to the tolerances. Static fields (``apply_fn``, ``tx``) are ignored.

    A mismatch names the leaf's path (``leaf ['params']['Dense_0']['kernel']``); two trees
    of different structure are reported with the paths of both.
    """
    x_leaves = jax.tree_util.tree_flatten_with_path(x)[0]
    y_leaves = jax.tree_util.tree_flatten_with_path(y)[0]
    x_paths = [jax.tree_util.keystr(p) for p, _ in x_leaves]
    y_paths = [jax.tree_util.keystr(p) for p, _ in y_leaves]
    if x_paths != y_paths:
        raise AssertionError(f"pytrees differ in structure:\n{x_paths}\nvs\n{y_paths}")
    for path, (_, a), (_, b) in zip(x_paths, x_leaves, y_leaves, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            raise AssertionError(f"leaf {path or '<root>'}: shape {a.shape} != {b.shape}")
        np.testing.assert_allclose(
            a.astype(np.float64) if a.dtype.kind == "V" else a,  # bfloat16 and friends
            b,
            rtol=rtol,
            atol=atol,
            err_msg=f"leaf {path or '<root>'}",
        )


# ----------------------------------------------------------------------------- states and steps


def _seed(seed: int | None, caller: str) -> int:
    """The seed a factory uses: its argument, else the one ``alpa.set_seed`` set."""
    return global_config.seed if seed is None else check_seed(seed, caller)


def _mse(out: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((out.astype(jnp.float32) - target) ** 2)


def create_train_state(
    rngkey: jax.Array | int,
    model: nn.Module,
    inputs: Sequence[Any],
    tx: optax.GradientTransformation | None = None,
) -> Any:
    """Initialize ``model`` on ``inputs`` with ``rngkey`` (a ``jax.random`` key, or an int
    seed) and wrap it in an ``alpa.model`` ``TrainState`` with ``tx`` (default: Adam with
    learning rate 1e-2, Alpa's choice). ``state.params`` is the ``"params"`` collection."""
    from alpa.model.model_util import TrainState, init_key

    if not isinstance(rngkey, jax.Array):
        rngkey = init_key(check_seed(rngkey, "create_train_state"))
    variables = model.init(rngkey, *inputs)
    return TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.adam(1e-2) if tx is None else tx,
        batch_stats=variables.get("batch_stats"),
    )


def regression_train_step(grad: Callable = jax.grad) -> Callable:
    """``train_step(state, batch) -> state``: one step of mean-squared-error regression of
    ``state.apply_fn(state.params, batch["x"])`` onto ``batch["y"]``, differentiated with
    ``grad`` (``alpa.grad`` for a parallelized step, ``jax.grad`` for its serial
    reference; ``jax.jit`` runs either). For a state whose ``apply_fn`` takes the
    parameters themselves (a plain function), not flax's variables dict."""

    def train_step(state, batch):
        def loss_fn(params):
            out = state.apply_fn(params, batch["x"])
            return jax.numpy.mean((out - batch["y"]) ** 2)

        return state.apply_gradients(grads=grad(loss_fn)(state.params))

    return train_step


def get_mlp_train_state_and_step(
    batch_size: int,
    hidden_size: int,
    num_layers: int = 4,
    use_bias: bool = True,
    add_manual_pipeline_marker: bool = False,
    *,
    seed: int | None = None,
) -> StateBatchStep:
    """``(state, batch, train_step)`` of an MLP regression trained with Adam.

    The model is ``alpa.model.mlp.MLPModel``: ``num_layers`` layers of Dense + relu, all
    ``hidden_size`` wide; with ``add_manual_pipeline_marker`` a pipeline boundary between
    every two layers (so ``num_layers`` layers for ``layer_option="manual"``). The batch
    holds ``"x"`` and ``"y"``, both ``[batch_size, hidden_size]``.

    ``train_step(state, batch) -> state`` differentiates with ``alpa.grad``, so it works
    with every parallel method, micro-batches included, and under ``jax.jit``.
    """
    import alpa
    from alpa.model.mlp import MLPModel
    from alpa.model.mlp import get_mlp_train_state_and_step as make

    model = MLPModel(
        hidden_size=hidden_size,
        num_layers=num_layers,
        use_bias=use_bias,
        add_manual_pipeline_markers=add_manual_pipeline_marker,
    )
    state, batch, step = make(
        model,
        batch_size,
        hidden_size,
        optimizer="adam",
        seed=_seed(seed, "get_mlp_train_state_and_step"),
        grad_func=alpa.value_and_grad,
    )

    def train_step(state, batch):
        new_state, _ = step(state, batch)
        return new_state

    return state, batch, train_step


def get_tied_embedding_step(*, seed: int | None = None) -> StateBatchStep:
    """``(params, batch, train_step)`` of a small language model whose token embedding is
    also its output projection, trained by SGD: the table's gradient is the scatter-add of
    the looked-up rows' gradients plus the output matmul's gradient, two sums added
    together. ``params`` holds ``"embedding"`` ``[512, 64]`` and ``"w"`` ``[64, 64]``; the
    batch holds ``"ids"`` and ``"labels"``, ``[16, 8]`` token ids."""
    import alpa

    vocab, hidden = 512, 64
    keys = jax.random.split(jax.random.PRNGKey(_seed(seed, "get_tied_embedding_step")), 4)
    params = {
        "embedding": jax.random.normal(keys[0], (vocab, hidden)) * 0.1,
        "w": jax.random.normal(keys[1], (hidden, hidden)) * 0.1,
    }
    batch = {
        "ids": jax.random.randint(keys[2], (16, 8), 0, vocab),
        "labels": jax.random.randint(keys[3], (16, 8), 0, vocab),
    }

    def train_step(params, batch):
        def loss_fn(p):
            h = jnp.tanh(p["embedding"][batch["ids"]] @ p["w"])
            logits = h @ p["embedding"].T
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

        grads = alpa.grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return params, batch, train_step


def mlp_inference_step(state: Any, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``(output, loss)`` of the MLP of :func:`get_mlp_train_state_and_step` on ``batch``."""
    out = state.apply_fn({"params": state.params}, batch["x"])
    return out, _mse(out, batch["y"])


def get_bert_layer_train_state_and_step(
    batch_size: int,
    seq_len: int,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    clip_by_global_norm: bool = False,
    use_dynamic_scale: bool = False,
    add_manual_pipeline_marker: bool = False,
    *,
    seed: int | None = None,
) -> StateBatchStep:
    """``(state, batch, train_step)`` of ``num_layers`` BERT encoder layers regressed onto
    random targets with Adam (learning rate 1e-2).

    The model is ``alpa.model.bert.FlaxBertLayerCollection`` (MLP width
    ``4 * hidden_size``); with ``add_manual_pipeline_marker`` a pipeline boundary follows
    every layer but the last. The batch holds ``"x"`` and ``"y"``
    (``float32[batch_size, seq_len, hidden_size]``) and ``"attention_mask"`` (all ones,
    ``int32[batch_size, seq_len]``); the loss is the mean squared error of the output. With
    ``clip_by_global_norm`` the gradients are clipped to global norm 0.05 before Adam.

    ``use_dynamic_scale=True`` (Alpa's fp16 loss scaling) is not supported: the model is
    float32, which needs no loss scaling.
    """
    import alpa
    from alpa.model.bert import BertConfig, FlaxBertLayerCollection
    from alpa.model.model_util import check_positive
    from alpa.model.model_util import create_train_state as init_state

    if use_dynamic_scale:
        raise NotImplementedError(
            "get_bert_layer_train_state_and_step: use_dynamic_scale=True (fp16 dynamic loss "
            "scaling) is not supported; the model is float32 and needs no loss scaling"
        )
    seed = _seed(seed, "get_bert_layer_train_state_and_step")
    check_positive(batch_size=batch_size, seq_len=seq_len)
    config = BertConfig(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=4 * hidden_size,
        add_manual_pipeline_markers=add_manual_pipeline_marker,
    )
    rng = np.random.default_rng(seed)
    shape = (batch_size, seq_len, hidden_size)
    batch = {
        "x": jnp.asarray(rng.standard_normal(shape, dtype=np.float32)),
        "y": jnp.asarray(rng.standard_normal(shape, dtype=np.float32)),
        "attention_mask": jnp.ones((batch_size, seq_len), jnp.int32),
    }
    tx = optax.adam(1e-2)
    if clip_by_global_norm:
        tx = optax.chain(optax.clip_by_global_norm(0.05), tx)
    model = FlaxBertLayerCollection(config)
    state = init_state(model, (batch["x"], batch["attention_mask"]), tx, seed, abstract=False)

    def train_step(state, batch):
        def loss_fn(params):
            out = state.apply_fn({"params": params}, batch["x"], batch["attention_mask"])
            return _mse(out, batch["y"])

        return state.apply_gradients(grads=alpa.grad(loss_fn)(state.params))

    return state, batch, train_step


def bert_layer_collection_inference_step(
    state: Any, batch: Mapping[str, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """``(last_hidden_state, loss)`` of the layers of
    :func:`get_bert_layer_train_state_and_step` on ``batch``."""
    out = state.apply_fn({"params": state.params}, batch["x"], batch["attention_mask"])
    return out, _mse(out, batch["y"])


# ----------------------------------------------------------------------------- pipelined vs serial


class PipelineBasicTest(unittest.TestCase):
    """A base class for tests that compare a pipelined train step with the serial one.

    ``setUp`` connects alpa to ``cluster`` (``"local"``: this process's devices; a subclass
    may set ``cluster = "ray"``), ``tearDown`` shuts it down. ``run_mlp`` and
    ``run_n_layer_bert`` compile a step with ``PipeshardParallel`` (4 micro-batches,
    uniform stages by default), check it against ``jax.jit`` of the same step, and return
    the executable's HLO text.
    """

    cluster: str = "local"

    def setUp(self) -> None:
        import alpa

        alpa.init(self.cluster)

    def tearDown(self) -> None:
        import alpa

        alpa.shutdown()

    def run_mlp(
        self,
        manual_pipeline_layer: bool = True,
        use_remat: bool = False,
        stage_option: Any = None,
        as_option: Any = None,
        do_numerical_test: bool = True,
    ) -> str | list[str]:
        """A 4-layer MLP (batch 64, hidden 16): with ``manual_pipeline_layer`` the layers
        are the model's, else ``AutoLayerOption(layer_num=2)`` clusters them; three steps
        compared with the serial step (rtol = atol = 1e-3)."""
        state, batch, step = get_mlp_train_state_and_step(
            batch_size=64,
            hidden_size=16,
            num_layers=4,
            add_manual_pipeline_marker=manual_pipeline_layer,
        )
        method = _pipeshard_method(manual_pipeline_layer, use_remat, 2, stage_option, as_option)
        return _check_against_serial(
            method, step, state, batch, 3 if do_numerical_test else 0, 1e-3, 1e-3
        )

    def run_n_layer_bert(
        self,
        num_layers: int,
        batch_size: int = 16,
        seq_len: int = 256,
        hidden_size: int = 512,
        num_heads: int = 512 // 64,
        use_remat: bool = False,
        clip_by_global_norm: bool = False,
        use_dynamic_scale: bool = False,
        inject_train_step: Callable | None = None,
        manual_pipeline_layer: bool = True,
        stage_option: Any = None,
        as_option: Any = None,
        do_numerical_test: bool = True,
    ) -> str | list[str]:
        """``num_layers`` BERT layers (:func:`get_bert_layer_train_state_and_step`): with
        ``manual_pipeline_layer`` one layer per BERT layer, else ``AutoLayerOption`` with
        ``layer_num=num_layers``; ``inject_train_step`` replaces the step. One step
        compared with the serial step (rtol 1e-3, atol 1.5e-3)."""
        state, batch, step = get_bert_layer_train_state_and_step(
            batch_size=batch_size,
            seq_len=seq_len,
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_heads=num_heads,
            clip_by_global_norm=clip_by_global_norm,
            use_dynamic_scale=use_dynamic_scale,
            add_manual_pipeline_marker=manual_pipeline_layer,
        )
        if inject_train_step is not None:
            if not callable(inject_train_step):
                raise TypeError(
                    f"inject_train_step must be a train step (state, batch) -> state, "
                    f"got {inject_train_step!r}"
                )
            step = inject_train_step
        method = _pipeshard_method(
            manual_pipeline_layer, use_remat, num_layers, stage_option, as_option
        )
        return _check_against_serial(
            method, step, state, batch, 1 if do_numerical_test else 0, 1e-3, 1.5e-3
        )


def _pipeshard_method(
    manual_layers: bool, use_remat: bool, layer_num: int, stage_option: Any, as_option: Any
) -> Any:
    import alpa

    if manual_layers:
        layer_option = alpa.ManualLayerOption(remat_layer=use_remat)
    else:
        remat_mode = "coarse_grained_remat" if use_remat else "none"
        layer_option = alpa.AutoLayerOption(layer_num=layer_num, remat_mode=remat_mode)
    return alpa.PipeshardParallel(
        num_micro_batches=4,
        default_auto_sharding_option=as_option,
        layer_option=layer_option,
        stage_option=stage_option or alpa.UniformStageOption(),
    )


def _check_against_serial(
    method: Any,
    step: Callable,
    state: Any,
    batch: Any,
    num_steps: int,
    rtol: float,
    atol: float,
) -> str | list[str]:
    """Run ``num_steps`` of ``step`` parallelized with ``method`` and under ``jax.jit`` from
    the same state, compare the states after each step, return the HLO text."""
    import alpa

    # Nothing donated: the serial reference reads the same state.
    parallel = alpa.parallelize(step, method=method, donate_argnums=())
    executable = parallel.get_executable(state, batch)
    serial = jax.jit(step)
    expected = actual = state
    for _ in range(num_steps):
        expected = serial(expected, batch)
        actual = parallel(actual, batch)
        assert_allclose(actual.params, expected.params, rtol, atol)
    return executable.get_hlo_text()


# ----------------------------------------------------------------------------- sharding tests


def unit_cost_mesh(shape: tuple[int, int]):
    """The logical mesh ``shape`` over the first ``shape[0] * shape[1]`` local devices, with
    alpha = beta = 1 on both axes and the memory term off (``memory_bandwidth=inf``): the
    cost parameters the closed-form oracles assume, which count collectives and FLOPs but
    not the bytes each intermediate value writes. Contractions are priced at the local
    devices' FLOP rate in these units (``LogicalDeviceMesh.with_alpha_beta``)."""
    import alpa

    devices = jax.devices()[: shape[0] * shape[1]]
    mesh = alpa.LocalPhysicalDeviceMesh(devices).get_logical_mesh(shape, (1.0, 1.0), (1.0, 1.0))
    return dataclasses.replace(mesh, memory_bandwidth=math.inf)


def run_auto_sharded(step: Callable, state: Any, batch: Any, shape: tuple[int, int], **option):
    """Run ``step(state, batch)`` once with ``ShardParallel`` planned by the auto-sharding ILP
    on :func:`unit_cost_mesh` ``(shape)``; ``option`` holds ``AutoShardingOption`` fields.
    Returns ``(outputs, executable)``. Nothing is donated, so the inputs stay usable for the
    serial reference."""
    import alpa

    method = alpa.ShardParallel(
        devices=unit_cost_mesh(shape), auto_sharding_option=alpa.AutoShardingOption(**option)
    )
    p_step = alpa.parallelize(step, method=method, donate_argnums=())
    out = p_step(state, batch)
    return out, p_step.get_last_executable()


_DEBUG_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def program_text(hlo: str | list[str]) -> str | list[str]:
    """The HLO (or each of a list) without its debug information: the source lines the step
    was traced from, which differ between two traces that compile the same program."""
    if isinstance(hlo, list):
        return [program_text(h) for h in hlo]
    blocks = [b for b in hlo.split("\n\n") if not b.startswith(_DEBUG_SECTIONS)]
    return re.sub(r", metadata=\{[^}]*\}", "", "\n\n".join(blocks))


def entry_shapes(hlo: str) -> tuple[list[str], list[str]]:
    """The shapes (``f32[16,4]``) of an HLO module's entry parameters and of its results,
    in order, from its ``entry_computation_layout={(params)->results}``."""
    start = hlo.index("entry_computation_layout={") + len("entry_computation_layout={")
    depth, end = 1, start
    while depth:
        depth += {"{": 1, "}": -1}.get(hlo[end], 0)
        end += 1
    params, results = hlo[start : end - 1].split(")->")
    shape = r"[a-z]+[0-9]*\[[\d,]*\]"
    return re.findall(shape, params), re.findall(shape, results)
