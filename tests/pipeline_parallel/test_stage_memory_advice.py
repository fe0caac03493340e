"""A step with no pipeline plan within memory says by how much and what would help
(``stage_memory_advice``); the least memory it names is what a plan needs: with that much,
the search finds one. No device is used."""

from __future__ import annotations

import re

import pytest
from test_auto_stages import make_train_step, mlp_state

import alpa
from alpa.device_mesh import ClusterSpec

MIB = float(1 << 20)


def _plan(budget: float, remat: str = "none", k: int = 4):
    state, batch = mlp_state((256,) * 6, 64 * k, abstract=True)
    method = alpa.PipeshardParallel(
        devices=ClusterSpec.preset("a100-40gb", 1, 4),
        num_micro_batches=k,
        layer_option=alpa.AutoLayerOption(layer_num=4, remat_mode=remat),
        stage_option=alpa.AutoStageOption(memory_budget_per_device=budget),
    )
    return alpa.parallelize(make_train_step(alpa.value_and_grad), method=method).plan(state, batch)


def _least(message: str) -> float:
    value, unit = re.search(
        r"the plan that needs the least needs ([\d.e+]+) (MiB|GiB)", message
    ).groups()
    return float(value) * (MIB if unit == "MiB" else 1024 * MIB)


def test_no_plan_within_memory_names_the_least_it_needs_and_what_would_help():
    budget = 0.5 * MIB
    with pytest.raises(ValueError) as error:
        _plan(budget)
    message = str(error.value)
    assert "no pipeline plan of the step fits memory_budget_per_device=0.5 MiB" in message
    least = _least(message)
    assert least > budget
    assert re.search(r"its fullest stage, \d+ of \d+: layers \d+-\d+ on 1x\d devices", message)
    assert "AutoLayerOption(remat_mode='coarse_grained_remat')" in message
    assert "num_micro_batches=8" in message
    assert "more devices (the step's state, parameters, gradients and optimizer state" in message
    # The least memory it names is enough: the search then finds a plan that fits it.
    plan = _plan(least * 1.001)
    assert max(plan.stage_plan.memory) <= least * 1.001
    assert all(plan.cost.fits)


def test_remat_is_not_advised_when_it_is_on():
    with pytest.raises(ValueError) as error:
        _plan(0.5 * MIB, remat="coarse_grained_remat")
    message = str(error.value)
    assert "remat_mode" not in message and "more devices" in message
    assert "smaller layers (AutoLayerOption(layer_num=8))" in message
