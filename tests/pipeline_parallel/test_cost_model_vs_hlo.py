"""The stage cost model checked against the programs it prices (``docs/pipeline.md``).

For every stage of a planned pipeshard step on logical (2, 2) submeshes, where the ILP
splits the batch over ``x`` and the model over ``y``:

* **collectives**: the bytes per device ``plan.cost`` says the stage's forward and
  backward move per micro-batch, by kind (``StagePlanCost.collective_bytes``: what ``K``
  prices), equal the bytes of the collectives in their compiled HLO
  (``alpa.util.collective_bytes``, the same convention: the buffer an all-reduce reduces,
  the result an all-gather gathers, ...); the gradient reductions it defers to apply-grad
  (``gradient_sync_bytes``: what ``G`` prices) equal the all-reduces of the stage's
  compiled apply-grad. Apply-grad's all-gathers (its own ILP computes part of the update
  sharded and gathers the parameters back) are not priced by the stage model: they are
  only checked to be all-gathers.
* **memory**: the activations the model keeps per micro-batch in flight
  (``activation_memory``) equal the bytes per device of the batch-dependent values the
  compiled forward hands its backward, as XLA lays them out (the executable's output
  shardings).
* **memory per device**: ``plan.cost.memory`` (state as the plan splits it, the largest
  layer's temporaries, the cotangent sent back, activations per micro-batch in flight)
  against the most a device holds during the step by XLA's memory analysis of each
  program plus the buffers the step holds around it (``get_step_memory_per_mesh``).

Each stage holds one layer: a stage of several layers is priced as the sum of per-layer
ILPs, which do not see a resharding between two layers of the stage (docs/pipeline.md).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import devices_or_skip

import alpa
from alpa.pipeline_parallel.stages.stage_construction import ManualStageOption
from alpa.util import collective_bytes


def _step(model: str):
    if model == "gpt":
        from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step

        config = GPTConfig(
            seq_len=16,
            vocab_size=64,
            hidden_size=32,
            num_layers=2,
            num_heads=2,
            add_manual_pipeline_markers=True,
            tie_word_embeddings=False,
        )
        return get_gpt_train_state_and_step(config, 32, grad_func=alpa.value_and_grad)
    from alpa.model.mlp import MLPModel, get_mlp_train_state_and_step

    mlp = MLPModel(hidden_size=64, num_layers=1, output_dim=16, add_manual_pipeline_markers=True)
    return get_mlp_train_state_and_step(mlp, 32, 16, grad_func=alpa.value_and_grad)


def _compiled_stages(model: str, donate=()):
    """The executable of ``model`` in two one-layer stages on logical (2, 2) submeshes."""
    devices_or_skip(8)
    state, batch, step = _step(model)
    forced = {"force_batch_dim_to_mesh_dim": 0}
    method = alpa.PipeshardParallel(
        num_micro_batches=4,
        stage_option=ManualStageOption(
            [[0], [1]],
            [(1, 4), (1, 4)],
            submesh_logical_shapes=[(2, 2), (2, 2)],
            submesh_autosharding_option_dicts=[forced, forced],
        ),
    )
    return alpa.parallelize(step, method=method, donate_argnums=donate).get_executable(state, batch)


def _nonzero(counts: dict) -> dict:
    return {kind: value for kind, value in counts.items() if value}


def _sum(texts) -> dict:
    total: dict = {}
    for text in texts:
        for kind, value in collective_bytes(text).items():
            total[kind] = total.get(kind, 0) + value
    return total


def _kept_bytes(executable, forward, backward) -> int:
    """Bytes per device of the batch-dependent values ``forward`` hands ``backward``,
    as the compiled forward lays out its outputs."""
    compiled = executable._compiled_computation(executable.program.computations.index(forward))
    read = set(backward.invars)
    total = 0
    for v, sharding in zip(forward.outvars, compiled.output_shardings, strict=True):
        if v in read and v in executable.program.batch_dependent:
            total += int(np.prod(sharding.shard_shape(v.aval.shape))) * v.aval.dtype.itemsize
    return total


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_collective_bytes_and_activations_match_the_compiled_stages(model):
    executable = _compiled_stages(model)
    cost = executable.plan.cost
    by_name = {c.name: c for c in executable.program.computations}
    comps = [by_name[name] for name in executable.get_hlo_names()]
    texts = executable.get_hlo_text()
    for stage in range(executable.plan.num_stages):
        mine = [(c, t) for c, t in zip(comps, texts, strict=True) if c.stage == stage]
        per_micro = _sum(t for c, t in mine if c.name.endswith(("forward", "backward")))
        apply = _sum(t for c, t in mine if "_apply" in c.name)
        predicted = _nonzero(cost.collective_bytes[stage])
        # The last stage's layer is split over y: its backward all-reduces per micro-batch.
        assert predicted or stage == 0, (model, stage)
        assert _nonzero(per_micro).keys() == predicted.keys(), (model, stage, per_micro)
        for kind, nbytes in predicted.items():
            assert per_micro[kind] == pytest.approx(nbytes, rel=0.05), (model, stage, kind)
        synced = cost.gradient_sync_bytes[stage]
        assert synced["all-reduce"] > 0, (model, stage)
        assert apply["all-reduce"] == pytest.approx(synced["all-reduce"], rel=0.05), (
            model,
            stage,
        )
        assert set(_nonzero(apply)) <= {"all-reduce", "all-gather"}, (model, stage, apply)

        forward = next(c for c in comps if c.name == f"stage{stage}_forward")
        backward = next(c for c in comps if c.name == f"stage{stage}_backward")
        kept = _kept_bytes(executable, forward, backward)
        assert cost.activation_memory[stage] == pytest.approx(kept, rel=0.10), (model, stage)


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_predicted_memory_per_device_matches_xla(model):
    """``plan.cost.memory`` (state + temporaries + activations per micro-batch in flight
    under 1F1B) against the most a device of the stage's mesh holds during the step by
    XLA's figures: at each ``RUN``, its program's allocation (``memory_analysis``:
    arguments + outputs + temporaries - aliases) plus the buffers the step holds on the
    mesh around it (``get_step_memory_per_mesh``). The state is donated, as a training
    loop donates it."""
    executable = _compiled_stages(model, donate=(0,))
    predicted = executable.plan.cost.memory
    measured = executable.get_step_memory_per_mesh()
    assert len(measured) == executable.plan.num_stages == 2
    for stage, (p, m) in enumerate(zip(predicted, measured, strict=True)):
        assert p == pytest.approx(m, rel=0.10), (model, stage, p, m)
    # Per program (what the step's figure adds up): one row per compiled program, and no
    # program allocates more than its mesh's peak, which holds it and what is around it.
    rows = executable.get_kernel_memory()
    assert len(rows) == len(executable.instructions.kernels)
    assert {r["kind"] for r in rows} == {"forward", "backward", "apply"}
    for row in rows:
        alone = row["arguments"] + row["outputs"] + row["temporaries"] - row["aliased"]
        assert 0 < alone <= measured[row["stage"]], (model, row)


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_one_device_stages_do_the_serial_steps_work(model):
    """Two one-device stages, 4 micro-batches: the programs of one step (each as often as
    a ``RUN`` calls it) compute XLA's FLOPs of the same step under ``jax.jit``, plus the
    gradient accumulation's (scale each micro-batch's gradient by ``1/k`` and add it to
    the sum: 2 FLOPs per parameter per micro-batch), plus under 1 % for the split (GPT
    with one micro-batch: 96.13 M against 95.62 M, work XLA shares inside one program but
    not across the forward, backward and apply programs). No other work is added: a
    recomputed forward would add a third. (The H200 run's stage programs run slower per
    FLOP than ``jax.jit``'s; this says it is not extra work.)"""
    import jax

    state, batch, step = _step(model)
    device = jax.devices()[0]
    method = alpa.PipeshardParallel(
        devices=[device, device],
        num_micro_batches=4,
        stage_option=ManualStageOption([[0], [1]], [(1, 1), (1, 1)]),
    )
    executable = alpa.parallelize(step, method=method).get_executable(state, batch)
    rows = executable.get_kernel_costs()
    assert {r["kind"] for r in rows} == {"forward", "backward", "apply"}
    assert all(r["runs"] == 4 for r in rows if r["kind"] in ("forward", "backward"))
    assert all(r["runs"] == 1 for r in rows if r["kind"] == "apply")
    pipelined = sum(r["runs"] * r["flops"] for r in rows)
    serial = jax.jit(step).lower(state, batch).compile().cost_analysis()["flops"]
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    assert serial <= pipelined <= 1.01 * serial + 2 * 4 * num_params, (model, pipelined, serial)
