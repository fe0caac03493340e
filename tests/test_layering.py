"""The package's layering (DESIGN §2): imports point down only. Each check runs in a fresh
interpreter and lists the alpa modules an import loaded."""

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    walk = sys.argv[1] == "walk"
    for name in sys.argv[2:]:
        module = importlib.import_module(name)
        for info in pkgutil.iter_modules(getattr(module, "__path__", [])) if walk else ():
            importlib.import_module(f"{name}.{info.name}")
    print("\\n".join(sorted(m for m in sys.modules if m.startswith("alpa"))))
    """
)


def _loaded(*modules: str, walk: bool = True) -> set[str]:
    """The alpa modules loaded by importing ``modules`` (with ``walk``, each with every
    module of its package)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, "walk" if walk else "no", *modules],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


@pytest.mark.parametrize("package", ["alpa.tracing", "alpa.shard_parallel"])
def test_lower_passes_load_nothing_of_the_pipeline_pass(package):
    loaded = _loaded(package)  # the package and every module in it
    assert f"{package}.trace" in loaded or f"{package}.auto_sharding" in loaded
    above = sorted(m for m in loaded if m.startswith(("alpa.pipeline_parallel", "alpa.api")))
    assert above == [], f"import {package} loaded {above}"


def test_import_alpa_loads_on_first_use():
    loaded = _loaded("alpa", walk=False)
    assert loaded == {"alpa"}, loaded
    # The control (the check can fail): the pipeline method stands on the pipeline pass.
    assert "alpa.executables.pipeshard" in _loaded("alpa.pipeshard_method", walk=False)
