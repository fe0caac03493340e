"""``python -m alpa.test_install``: a quick self-check of an installation.

It trains a small MLP for two steps with ``ShardParallel`` (the auto-sharding ILP) and with
a two-stage ``PipeshardParallel``, on the local devices (8 virtual CPU devices when there is
no GPU), and compares each against ``jax.jit`` of the same step. It prints what it ran and
whether it passed, and exits with status 1 on a failure.
"""

from __future__ import annotations

import os
import sys
import time


def _checks():
    import jax

    import alpa
    from alpa.testing import assert_allclose, get_mlp_train_state_and_step

    def run(name, method, markers):
        state, batch, step = get_mlp_train_state_and_step(
            32, 32, num_layers=4, add_manual_pipeline_marker=markers
        )
        expected = jax.jit(step)(jax.jit(step)(state, batch), batch)
        p_step = alpa.parallelize(step, method=method)
        tic = time.perf_counter()
        state = p_step(p_step(state, batch), batch)
        assert_allclose(state.params, expected.params)
        return f"{name}: matches jax.jit ({time.perf_counter() - tic:.1f} s with compilation)"

    yield lambda: run("ShardParallel (auto-sharding ILP)", alpa.ShardParallel(), False)
    if len(jax.devices()) >= 2:
        method = alpa.PipeshardParallel(
            num_micro_batches=2, layer_option="manual", stage_option="uniform"
        )
        yield lambda: run("PipeshardParallel (2 micro-batches)", method, True)


def main() -> int:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:  # CPU only; GPUs are unaffected
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8"
    import jax

    import alpa

    devices = jax.devices()
    print(f"alpa {alpa.__version__}, jax {jax.__version__}: {len(devices)} {devices[0].platform}")
    alpa.init("local")
    failed = 0
    for check in _checks():
        try:
            print("  ok  ", check())
        except Exception as e:  # a self-check reports every failure, then exits non-zero
            failed += 1
            print("  FAIL", f"{type(e).__name__}: {e}")
    alpa.shutdown()
    print("alpa is installed correctly" if not failed else f"{failed} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
