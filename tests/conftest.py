"""Every test runs on 8 virtual CPU devices (DESIGN §8).

The device count must be set before jax initializes its backends; a test session in which
jax was initialized first would silently run on one device, so that fails loudly here.
"""

import os

NUM_DEVICES = 8

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Ray tests bind every node to 127.0.0.1. Unless clusters are marked local-only before ray
# is imported, Ray resolves a node's 127.0.0.1 to the machine's address and a second
# simulated node cannot reach the first.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count={NUM_DEVICES}"

import jax  # noqa: E402
import pytest  # noqa: E402

if len(jax.devices()) < NUM_DEVICES:
    raise RuntimeError(
        f"tests need {NUM_DEVICES} virtual CPU devices but jax has {len(jax.devices())}: "
        "jax was initialized before tests/conftest.py could set XLA_FLAGS"
    )


def devices_or_skip(n: int):
    """The first ``n`` devices, or skip the test when there are fewer."""
    devices = jax.devices()
    if len(devices) < n:
        pytest.skip(f"needs {n} devices, have {len(devices)}")
    return devices[:n]


@pytest.fixture(autouse=True)
def _fresh_alpa():
    """Each test starts and ends with alpa shut down, so no state leaks between tests."""
    import alpa

    alpa.shutdown()
    yield
    alpa.shutdown()
