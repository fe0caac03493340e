"""Every test runs on 8 virtual CPU devices (``docs/design.md``, How tests judge a plan).

The device count must be set before jax initializes its backends; a test session in which
jax was initialized first would silently run on one device, so that fails loudly here.
"""

import copy
import os

NUM_DEVICES = 8

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Ray tests bind every node to 127.0.0.1. Unless clusters are marked local-only before ray
# is imported, Ray resolves a node's 127.0.0.1 to the machine's address and a second
# simulated node cannot reach the first.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# XLA's CPU code generation, made cheaper for the suite: compiling dominates its time (the
# programs are small, each runs a few times) and most of a compile is LLVM and the fusion
# emitters, not the HLO passes the tests read. LLVM at -O0 leaves the optimized HLO and
# XLA's memory analysis byte for byte the same. The legacy fusion emitters fuse elementwise
# work differently (the fusions in the HLO change, not its collectives or shardings); every
# number a test compares comes from ``jax.jit`` compiled under the same flags, and the
# suite passes under XLA's defaults too. Together they halve the suite's time (1844 s ->
# 880 s on 2 cores). A flag already in ``XLA_FLAGS`` is kept, so the defaults are one
# variable away (``--xla_cpu_use_fusion_emitters=true`` and the LLVM level you want).
# Subprocesses and Ray's CPU workers inherit them.
TEST_XLA_FLAGS = {
    "xla_force_host_platform_device_count": str(NUM_DEVICES),
    "xla_backend_optimization_level": "0",
    "xla_cpu_use_fusion_emitters": "false",
}
_flags = os.environ.get("XLA_FLAGS", "")
for _name, _value in TEST_XLA_FLAGS.items():
    if _name not in _flags:
        _flags = f"{_flags} --{_name}={_value}"
os.environ["XLA_FLAGS"] = _flags.strip()

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


#: Format 1's tables of a pipeline plan's per-stage records: record field -> table name.
PINS_OF_FORMAT_1 = {"var_specs": "body_specs", "operand_specs": "operand_specs",
                    "partial_sums": "partial_sums"}  # fmt: skip


def plan_in_older_layout(data: dict, version: int) -> dict:
    """A saved ``ParallelPlan`` (its JSON data) rewritten in an older layout, a new dict:
    format 2 keeps the specs of the values of a pipeline's stage computations (refs
    without a ``/``: not inside a body) in a table of ``[ref, stage, spec]`` rows beside
    the per-stage records; format 1 keeps the records' fields in three more such tables
    (:data:`PINS_OF_FORMAT_1`)."""
    data = copy.deepcopy(data)
    data["format"] = version
    pipeline = data["pipeline_plan"]
    if pipeline is None:
        return data
    pipeline["stage_specs"] = [
        [ref, s, pins["var_specs"].pop(ref)]
        for s, pins in enumerate(pipeline["stage_pins"])
        for ref in [ref for ref in pins["var_specs"] if "/" not in ref]
    ]
    if version == 1:
        stage_pins = pipeline.pop("stage_pins")
        for table, old in PINS_OF_FORMAT_1.items():
            pipeline[old] = [
                [ref, s, entry]
                for s, pins in enumerate(stage_pins)
                for ref, entry in pins[table].items()
            ]
    return data


@pytest.fixture(autouse=True)
def _fresh_alpa():
    """Each test starts and ends with alpa shut down, so no state leaks between tests."""
    import alpa

    alpa.shutdown()
    yield
    alpa.shutdown()
