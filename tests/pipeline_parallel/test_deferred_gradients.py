"""Stages planned by the ILP reduce their gradients over the data axis once per step.

Oracle: the replica groups of every collective in each compiled stage computation. On a
logical (2, 2) submesh whose ILP splits the batch over ``x``, a gradient reduction is a
collective over the ``x`` groups ({0, 2}, {1, 3}); the backward (run once per micro-batch)
must have none, apply-grad (once per step) one combined all-reduce. Collectives over ``y``
(the model axis: tensor-parallel activations) stay per micro-batch, as the ILP priced them.
Numerics equal the serial step.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import devices_or_skip

import alpa
from alpa.pipeline_parallel.stages.stage_construction import ManualStageOption
from alpa.util import replica_groups

_COLLECTIVE = re.compile(r"= .*? (all-reduce|all-gather|reduce-scatter)(?:-start)?\(")


def collectives(hlo: str) -> list[tuple[str, frozenset]]:
    """(kind, replica groups) of every collective of a compiled computation."""
    out = []
    for line in hlo.splitlines():
        match = _COLLECTIVE.search(line)
        if match and "replica_groups" in line:
            out.append((match.group(1), replica_groups(line)))
    return out


# A (2, 2) logical mesh over 4 devices, row-major: x pairs devices 2 apart, y neighbours.
X_GROUPS = frozenset({frozenset({0, 2}), frozenset({1, 3})})
Y_GROUPS = frozenset({frozenset({0, 1}), frozenset({2, 3})})


def test_replica_group_spellings():
    assert replica_groups("x, replica_groups={{0,2},{1,3}}, y") == X_GROUPS
    assert replica_groups("replica_groups=[2,2]<=[4], use") == Y_GROUPS
    assert replica_groups("replica_groups=[2,2]<=[2,2]T(1,0), use") == X_GROUPS
    assert replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}, u") == X_GROUPS
    assert replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}, u") == Y_GROUPS
    # Devices permuted: position (i, j) holds device 2j + i, so axis_1 pairs {0, 2}.
    permuted = "replica_groups=mesh['a'=2,'b'=2], device_ids=([2,2]T(1,0)) {'b'}, d"
    assert replica_groups(permuted) == X_GROUPS


def _model(name: str, grad):
    from alpa.model.bert import BertConfig, get_bert_train_state_and_step
    from alpa.model.gpt import GPTConfig, get_gpt_train_state_and_step

    # Untied heads: the head's part of a tied embedding's gradient is sent to the stage of
    # the embedding, so it is reduced where it is computed (a gradient another stage
    # reads is not deferred; deferred_sums).
    small = dict(
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        add_manual_pipeline_markers=True,
        tie_word_embeddings=False,
    )
    if name in ("gpt", "gpt_remat"):
        # Under remat each block's backward recomputes it inside a checkpoint, whose body
        # makes the block's weight gradients: they are deferred through it.
        config = GPTConfig(seq_len=16, vocab_size=64, remat_layers=name == "gpt_remat", **small)
        return get_gpt_train_state_and_step(config, 32, grad_func=grad)
    config = BertConfig(vocab_size=64, max_position_embeddings=16, **small)
    state, batch, step = get_bert_train_state_and_step(config, 32, seq_len=16, grad_func=grad)
    # A masked mean is per micro-batch (docs/shard_parallel.md); a full mask makes it the
    # serial step's mean, so the numerics can be compared.
    batch = dict(batch, label_mask=jnp.ones_like(batch["label_mask"]))
    return state, batch, step


def _two_stages(logical_shape, option: dict) -> alpa.PipeshardParallel:
    """Two one-layer stages of 4 devices each, on ``logical_shape`` with ``option``, and
    4 micro-batches."""
    return alpa.PipeshardParallel(
        num_micro_batches=4,
        stage_option=ManualStageOption(
            [[0], [1]],
            [(1, 4), (1, 4)],
            submesh_logical_shapes=[logical_shape, logical_shape],
            submesh_autosharding_option_dicts=[option, option],
        ),
    )


@pytest.mark.parametrize("model", ["gpt", "gpt_remat", "bert"])
def test_ilp_stages_reduce_gradients_once_per_step(model):
    devices_or_skip(8)
    state, batch, step = _model(model, alpa.value_and_grad)
    ref_state, _, ref_step = _model(model, jax.value_and_grad)
    expected = jax.jit(ref_step)(ref_state, batch)
    method = _two_stages((2, 2), {"force_batch_dim_to_mesh_dim": 0})
    parallel = alpa.parallelize(step, method=method, donate_argnums=())
    out = parallel(state, batch)
    alpa.testing.assert_allclose(out[0].params, expected[0].params)
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(expected[1]), rtol=1e-5)

    executable = parallel.get_last_executable()
    deferred = executable.program.deferred
    assert deferred is not None and deferred.stage_axes == {0: ("x",), 1: ("x",)}
    # Every parameter gradient but none is carried as partial sums.
    assert len(deferred.partials) >= len(executable.program.accumulated) - 1
    hlo = dict(zip(executable.get_hlo_names(), executable.get_hlo_text(), strict=True))
    for stage in range(2):
        backward = collectives(hlo[f"stage{stage}_backward"])
        assert not [c for c in backward if c[1] == X_GROUPS], (stage, backward)
        applies = [collectives(text) for name, text in hlo.items() if f"stage{stage}_apply" in name]
        reductions = [c for cs in applies for c in cs if c == ("all-reduce", X_GROUPS)]
        assert len(reductions) == 1, (stage, applies)


@pytest.mark.parametrize("model", ["gpt", "bert"])
@pytest.mark.parametrize("option", [{"force_batch_dim_to_mesh_dim": 0}, {}])
def test_a_stages_data_axes_are_its_plans(model, option, monkeypatch):
    """The data axes a stage's gradients are reduced over (``deferred_sums``) are its
    forward-and-backward ILP plan's ``data_axes``, read off the stage's record; that plan's
    other gradient fields say nothing for a stage (``grad_specs`` ``None``, no
    ``sync_groups``): the ``alpa.grad`` marker lies between its backward and apply-grad
    programs, outside every jaxpr its ILPs plan, so the stage's deferral is decided here,
    not by them. Left free, the ILP splits BERT's batch over ``y``, and the deferral follows."""
    devices_or_skip(8)
    from alpa.pipeline_parallel.program import stage_sharding

    first: dict = {}
    plan_auto_sharding = stage_sharding.plan_auto_sharding

    def recording(step, *args, **kwargs):
        plan = plan_auto_sharding(step, *args, **kwargs)
        assert step.grad_marker() is None
        assert plan.grad_specs is None and plan.sync_groups == ()
        first.setdefault(step.name, plan)  # a stage's first plan: its forward and backward
        return plan

    monkeypatch.setattr(stage_sharding, "plan_auto_sharding", recording)
    state, batch, step = _model(model, alpa.value_and_grad)
    plan = alpa.parallelize(step, method=_two_stages((2, 2), option)).plan(state, batch)
    deferred = plan.program.deferred
    assert deferred is not None and sorted(first) == ["stage0", "stage1"]
    axes = {s: first[f"stage{s}"].data_axes for s in range(2)}
    assert deferred.stage_axes == axes and all(axes.values())
    if option:
        assert axes == {0: ("x",), 1: ("x",)}
    elif model == "bert":  # the free ILP splits BERT's batch over y: the deferral follows
        assert axes == {0: ("y",), 1: ("y",)}


def test_a_gradient_split_over_the_data_axis_is_reduced_per_micro_batch_into_its_split():
    """ZeRO-3-like stages: logical (4, 1), the batch split over ``x`` and no parameter
    replicated, so the ILP splits the weights over ``x`` too. A gradient the plan splits
    over ``x`` is not carried as ``[4, ...]`` partial sums (each device would hold the
    whole gradient, 4 times its share): the backward reduces it per micro-batch and the
    accumulator holds the gradient's own split, so a stage's gradient sums take as many
    bytes per device as its parameters. The stage cost model prices that reduction per
    micro-batch: its bytes equal the compiled forward and backward's, and its once-per-step
    bytes the apply-grad all-reduces. Numerics equal the serial step."""
    devices_or_skip(8)
    from alpa.model.mlp import MLPModel, get_mlp_train_state_and_step
    from alpa.pipeline_parallel.stages.layer_facts import per_device_bytes
    from alpa.runtime.instructions import Op
    from alpa.util import collective_bytes

    mlp = MLPModel(hidden_size=64, num_layers=1, output_dim=16, add_manual_pipeline_markers=True)
    state, batch, step = get_mlp_train_state_and_step(mlp, 32, 16, grad_func=alpa.value_and_grad)
    _, _, ref_step = get_mlp_train_state_and_step(mlp, 32, 16, grad_func=jax.value_and_grad)
    expected = jax.jit(ref_step)(state, batch)
    option = {"force_batch_dim_to_mesh_dim": 0, "allow_replicated_parameters": False}
    method = _two_stages((4, 1), option)
    parallel = alpa.parallelize(step, method=method, donate_argnums=())
    out = parallel(state, batch)
    alpa.testing.assert_allclose(out[0].params, expected[0].params)

    executable = parallel.get_last_executable()
    plan, program = executable.plan, executable.program
    partials = program.deferred.partials if program.deferred else {}
    split = [
        out
        for out in program.accumulated
        if program.home[out] == 1 and "x" in str(plan.stage_pins[1].var_specs[out])
    ]
    assert split, "the ILP split no gradient of stage 1 over x"
    assert not set(split) & set(partials)
    # Gradient sums: as many bytes per device as the parameters.
    var_of = {name: v for v, name in plan.names.items()}
    mesh = plan.logical_meshes[1]
    sums = sum(
        per_device_bytes(
            var_of[k[0]].aval, plan.buffer_specs[(k[0], 1)], mesh.shape, mesh.axis_names
        )
        for ins in plan.instructions.instructions
        if ins.op is Op.ALLOC
        for k in ins.outputs
        if k[2] == 1
    )
    assert sums == pytest.approx(plan.cost.parameter_memory[1], rel=0.01)
    # The model's collectives against the compiled stage 1.
    texts = dict(zip(executable.get_hlo_names(), executable.get_hlo_text(), strict=True))
    per_micro: dict = {}
    for name in ("stage1_forward", "stage1_backward"):
        for kind, nbytes in collective_bytes(texts[name]).items():
            per_micro[kind] = per_micro.get(kind, 0) + nbytes
    predicted = {k: v for k, v in plan.cost.collective_bytes[1].items() if v}
    assert predicted["all-reduce"] > 0
    assert predicted == pytest.approx({k: v for k, v in per_micro.items() if v}, rel=0.05)
    applied = sum(
        collective_bytes(t)["all-reduce"] for n, t in texts.items() if "stage1_apply" in n
    )
    assert plan.cost.gradient_sync_bytes[1]["all-reduce"] == pytest.approx(applied, abs=1)


def test_a_key_in_the_batch_does_not_stop_the_deferral():
    """A PRNG key carried in the batch (``uint32[2]``: no row per example) is not a batch
    leaf with rows (``micro_batches.leaves_with_rows``): two data-parallel stages of 4
    devices each still carry their gradients as partial sums, and their backwards have no
    collective. Before, the key's 2 "rows" did not split over 4 devices, and nothing was
    deferred."""
    devices_or_skip(8)
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (16, 32)), "w2": jax.random.normal(k[1], (32, 8))}
    batch = {
        "x": jax.random.normal(k[2], (32, 16)),
        "y": jax.random.normal(k[3], (32, 8)),
        "key": jax.random.key_data(jax.random.key(5)),
    }

    def step(params, batch):
        def loss_fn(p):
            noise = jax.random.normal(jax.random.wrap_key_data(batch["key"]), p["w1"].shape)
            h = jnp.tanh(batch["x"] @ (p["w1"] + 0.01 * noise))
            alpa.mark_pipeline_boundary()
            return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

        grads = alpa.grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)

    # Two micro-batches: each reads the key whole (api.leaves_with_rows).
    method = alpa.PipeshardParallel(
        num_micro_batches=2,
        layer_option=alpa.ManualLayerOption(),
        stage_option=ManualStageOption(
            [[0], [1]],
            [(1, 4), (1, 4)],
            submesh_logical_shapes=[(4, 1), (4, 1)],
            submesh_autosharding_option_dicts=[{"force_data_parallel": True}] * 2,
        ),
    )
    parallel = alpa.parallelize(step, method=method, donate_argnums=())
    alpa.testing.assert_allclose(parallel(params, batch), jax.jit(step)(params, batch))
    executable = parallel.get_last_executable()
    deferred = executable.program.deferred
    assert deferred is not None and set(deferred.stage_axes) == {0, 1}
    assert len(deferred.partials) == 2  # w1's and w2's gradients
    hlo = dict(zip(executable.get_hlo_names(), executable.get_hlo_text(), strict=True))
    for stage in range(2):
        assert collectives(hlo[f"stage{stage}_backward"]) == [], stage
