"""Public helpers of alpa.util and alpa.testing."""

import threading

import jax.numpy as jnp
import numpy as np
import pytest

from alpa.testing import assert_allclose
from alpa.util import (
    benchmark_func,
    collective_bytes,
    compute_gpt_tflops,
    compute_param_number,
    count_communication_primitives,
    map_on_threads,
)

HLO = """
ENTRY %main {
  %p0 = f32[8,8]{1,0} parameter(0)
  %all-reduce = (f32[8]{0}, f32[8,8]{1,0}) all-reduce(%a, %b), replica_groups={{0,1}}, to_apply=%add
  %all-reduce.1 = f32[] all-reduce(%c), replica_groups={{0,1}}, to_apply=%add
  %ags = (f32[4]{0}, f32[8]{0}) all-gather-start(%d), dimensions={0}
  %agd = f32[8]{0} all-gather-done(%ags)
  %rs = f32[4]{0} reduce-scatter(%e), dimensions={0}, to_apply=%add
  %a2a = f32[8,8]{1,0} all-to-all(%f), dimensions={0}
  ROOT %t = (f32[8]{0}) tuple(%agd)
}
"""


def test_count_communication_primitives():
    # The tuple all-reduce counts once, the async all-gather pair once.
    assert count_communication_primitives(HLO) == (5, 2, 1, 1, 1)
    assert count_communication_primitives(HLO, ignore_scalar_all_reduce=True) == (4, 1, 1, 1, 1)
    assert count_communication_primitives("") == (0, 0, 0, 0, 0)


def test_collective_bytes_in_the_cost_models_convention():
    hlo = """HloModule m, num_partitions=4
  %ar = (f32[8]{0}, f32[8,8]{1,0}) all-reduce(%a, %b), replica_groups={{0,1},{2,3}}, to_apply=%add
  %ar.1 = f32[] all-reduce(%c), replica_groups=[2,2]<=[4], to_apply=%add
  %ar.2 = f32[64]{0} all-reduce(%c), replica_groups={{0},{1},{2},{3}}, to_apply=%add
  %ags = (f32[4]{0}, f32[8]{0}) all-gather-start(%d), replica_groups={{0,1},{2,3}}, dimensions={0}
  %agd = f32[8]{0} all-gather-done(%ags)
  %rs = bf16[4]{0} reduce-scatter(%e), replica_groups={}, dimensions={0}, to_apply=%add
  %a2a = f32[8,8]{1,0} all-to-all(%f), replica_groups={{0,1},{2,3}}, dimensions={0}
  %cp = s8[16]{0} collective-permute(%g), source_target_pairs={{0,1},{1,0}}
"""
    # All-reduce: the buffers (a group of one device moves nothing); all-gather: the
    # gathered result; reduce-scatter: the operand (result x group: all 4 devices);
    # all-to-all: the tensor the group exchanges (buffer x group).
    assert collective_bytes(hlo) == {
        "all-reduce": 8 * 4 + 64 * 4 + 4,
        "all-gather": 8 * 4,
        "reduce-scatter": 4 * 2 * 4,
        "all-to-all": 64 * 4 * 2,
        "collective-permute": 16,
    }
    with pytest.raises(ValueError, match="unknown group size"):
        collective_bytes("%rs = f32[4]{0} reduce-scatter(%e), dimensions={0}")


def test_compute_gpt_tflops_closed_form():
    # B=1, s=1, h=1, L=1, V=0: forward 24*(1+1/6) = 28 FLOPs, with backward 3x.
    assert compute_gpt_tflops(1, 1, 1, 1, 0, 1, 1e-12) == pytest.approx(84.0)
    assert compute_gpt_tflops(1, 1, 1, 1, 0, 1, 1e-12, backward=False) == pytest.approx(28.0)
    assert compute_gpt_tflops(1, 1, 1, 1, 0, 2, 1e-12, checkpoint_activations=True) == (
        pytest.approx(56.0)
    )


def test_compute_param_number():
    assert compute_param_number({"a": jnp.ones((3, 4)), "b": [np.ones(5)]}) == 17


def test_benchmark_func_counts_calls():
    calls = []
    costs = benchmark_func(lambda: calls.append(1), warmup=2, repeat=3, number=4)
    assert costs.shape == (3,) and len(calls) == 2 + 12


def test_assert_allclose_checks_structure_and_values():
    assert_allclose({"a": np.ones(3)}, {"a": np.ones(3) + 1e-6})
    with pytest.raises(AssertionError, match="structure"):
        assert_allclose({"a": np.ones(3)}, {"b": np.ones(3)})
    with pytest.raises(AssertionError, match=r"leaf \['a'\]"):
        assert_allclose({"a": np.ones(3)}, {"a": np.zeros(3)})


def test_map_on_threads_keeps_order_and_runs_inline_with_one_worker():
    assert map_on_threads(lambda x: x * x, range(20), workers=4) == [x * x for x in range(20)]
    names = map_on_threads(lambda _: threading.current_thread().name, range(8), 1, "t")
    assert set(names) == {threading.current_thread().name}
    names = map_on_threads(lambda _: threading.current_thread().name, range(8), 2, "pool")
    assert all(n.startswith("pool") for n in names)
    assert map_on_threads(lambda x: x, [], workers=3) == []


def test_get_num_hosts_and_num_devices_reads_the_command_line_or_the_devices():
    import argparse

    import jax

    from alpa.util import get_num_hosts_and_num_devices

    given = argparse.Namespace(num_hosts=2, num_devices_per_host=4, local=False)
    assert get_num_hosts_and_num_devices(given) == (2, 4)
    local = argparse.Namespace(num_hosts=None, num_devices_per_host=None, local=True)
    assert get_num_hosts_and_num_devices(local) == (1, len(jax.local_devices())) == (1, 8)
    half = argparse.Namespace(num_hosts=2, num_devices_per_host=None, local=True)
    with pytest.raises(ValueError, match=r"num_hosts=2 and num_devices_per_host=None: give both"):
        get_num_hosts_and_num_devices(half)


def test_get_metrics_stacks_the_steps_leaf_by_leaf():
    from alpa.util import get_metrics

    steps = [{"loss": jnp.float32(i), "acc": np.full(2, i / 10)} for i in range(3)]
    stacked = get_metrics(steps)
    assert isinstance(stacked["loss"], np.ndarray)
    assert_allclose(stacked["loss"], np.array([0.0, 1.0, 2.0]))
    assert stacked["acc"].shape == (3, 2)
    assert_allclose(stacked["acc"][:, 1], np.array([0.0, 0.1, 0.2]))
    with pytest.raises(ValueError, match="device_metrics is empty"):
        get_metrics([])
