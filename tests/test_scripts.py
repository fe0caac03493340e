"""The scripts of ``benchmark/`` and ``examples/`` still name what alpa has.

They run for minutes (or on clusters that are not here), so no test runs them; but a
module moved or a name renamed inside ``alpa`` breaks them silently. Every ``import
alpa...`` and ``from alpa... import name`` in them (inside functions too) must resolve:
the module imports and has the name.
"""

from __future__ import annotations

import ast
import importlib
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(
    os.path.relpath(os.path.join(root, name), REPO)
    for folder in ("benchmark", "examples")
    for root, _, names in os.walk(os.path.join(REPO, folder))
    for name in names
    if name.endswith(".py")
)


def alpa_imports(source: str) -> list[tuple[str, str | None, int]]:
    """``(module, name or None, line)`` of every import of an ``alpa`` module in
    ``source``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if _is_alpa(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_alpa(node.module):
            found += [(node.module, a.name, node.lineno) for a in node.names if a.name != "*"]
    return found


def _is_alpa(module: str | None) -> bool:
    return module is not None and (module == "alpa" or module.startswith("alpa."))


def unresolved(source: str) -> list[str]:
    """The imports of ``source`` that alpa does not have, as text."""
    missing = []
    for module, name, line in alpa_imports(source):
        try:
            loaded = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"line {line}: import {module}: {e}")
            continue
        if name is not None and not hasattr(loaded, name):
            try:  # a submodule imported by name
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"line {line}: from {module} import {name}: no such name")
    return missing


def test_there_are_scripts_to_check():
    assert "examples/quickstart.py" in SCRIPTS
    assert "benchmark/pipeline/bench_auto_pipeline.py" in SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS)
def test_a_script_imports_only_what_alpa_has(path):
    with open(os.path.join(REPO, path)) as f:
        assert unresolved(f.read()) == []


def test_the_check_finds_a_moved_module_and_a_renamed_name():
    source = (
        "import alpa\n"
        "from alpa.pipeline_parallel.stages.stage_dp import training_dp\n"
        "def main():\n"
        "    from alpa.stage_dp import training_dp\n"  # moved
        "    from alpa.record.parallel_plan import PlanRecord\n"  # no such name
        "    import alpa.no_such_module\n"
    )
    problems = unresolved(source)
    assert [p.split(":")[0] for p in problems] == ["line 4", "line 5", "line 6"], problems
