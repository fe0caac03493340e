"""A model whose blocks are one ``nn.scan`` is cut into pipeline layers between its
iterations (issue 30, item 2, partly).

``AutoLayerOption`` writes out a scan that holds at least one layer's share of the loss
function's FLOPs (``segments.unroll_layer_scans``) before clustering, so the layers are
those of the same model unrolled. Oracles, on 8 virtual CPU devices:

* the 4-block GPT (``nn.scan`` + ``nn.remat``) under ``AutoLayerOption(2)`` on two (1, 4)
  stages: two blocks per layer (the checkpointed blocks' recomputations counted per
  layer), loss and parameters after one step equal ``jax.jit``'s;
* with ``stage_option="auto"`` on a ``ClusterSpec`` of 2 x 8 GPUs, the scanned and the
  unrolled GPT get the same stages, submeshes and logical shapes.

Not yet: the stacked parameters are one array each, and an array lives on one stage's
mesh, so the first stage that reads them holds all of them (the issue asks at most 65 %
per stage), and each stage's program holds its iterations written out, not a scan over
its slice.
"""

from __future__ import annotations

from collections import Counter

import jax

import alpa
from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step
from alpa.testing import assert_allclose


def _gpt(scan_layers: bool, abstract: bool = False, **sizes):
    config = GPTConfig(
        **{"hidden_size": 64, "num_layers": 4, "num_heads": 4, "seq_len": 16, "vocab_size": 256}
        | sizes,
        scan_layers=scan_layers,
        remat_layers=True,
    )
    return get_gpt_train_state_and_step(
        config, 8, optimizer="sgd", grad_func=alpa.value_and_grad, abstract=abstract
    )


def test_a_scanned_gpt_is_cut_between_its_iterations():
    state, batch, step = _gpt(True)
    stages = alpa.ManualStageOption([[0], [1]], [(1, 4)] * 2, [(1, 4)] * 2, [{}, {}])
    method = alpa.PipeshardParallel(
        num_micro_batches=2, layer_option=alpa.AutoLayerOption(2), stage_option=stages
    )
    p_step = alpa.parallelize(step, method=method, donate_argnums=())
    new_state, loss = p_step(state, batch)
    expected_state, expected_loss = jax.jit(step)(state, batch)
    assert_allclose(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert_allclose(new_state.params, expected_state.params, rtol=1e-4, atol=1e-6)

    plan = p_step.get_last_executable().plan
    eqns = plan.traced.jaxpr.eqns
    recomputed = Counter(
        layer
        for eqn, layer in zip(eqns, plan.layers.layers, strict=True)
        if eqn.primitive.name == "remat2"
    )
    assert recomputed == {0: 2, 1: 2}, recomputed  # one checkpointed block per iteration


def test_scanned_and_unrolled_gpt_get_the_same_stages():
    cluster = alpa.ClusterSpec.preset("a100-40gb", num_nodes=2, num_devices_per_node=8)
    plans = []
    for scan_layers in (False, True):
        state, batch, step = _gpt(
            scan_layers, True, hidden_size=1024, num_layers=8, num_heads=16, seq_len=256,
            vocab_size=8192,
        )  # fmt: skip
        method = alpa.PipeshardParallel(
            devices=cluster,
            num_micro_batches=4,
            layer_option=alpa.AutoLayerOption(4),
            stage_option="auto",
        )
        plans.append(alpa.parallelize(step, method=method).plan(state, batch).stage_plan)
    unrolled, scanned = plans
    assert scanned.layer_to_stage == unrolled.layer_to_stage
    assert scanned.device_ranges == unrolled.device_ranges
    assert scanned.logical_shapes == unrolled.logical_shapes
    assert len(scanned.device_ranges) > 1  # a pipeline, not one stage
