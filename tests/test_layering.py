"""The package's layering (``docs/architecture.md``): imports point down only. Each check
runs in a fresh interpreter and lists the alpa modules an import loaded."""

import ast
import os
import re
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
    assert "alpa.executables.pipeshard" in _loaded("alpa.methods.pipeshard_method", walk=False)


# ----------------------------------------------------------------------------- the import graph
#
# Read from the source (AST), every import counted: at module level and inside functions
# alike, only those under ``if TYPE_CHECKING:`` left out (they never run).

_ALPA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "alpa")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _modules(root: str) -> dict[str, str]:
    """Module name -> file, for the package at ``root``."""
    top = os.path.dirname(root)
    found = {}
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, top)[:-3].replace(os.sep, ".")
                found[name.removesuffix(".__init__")] = path
    return found


def import_graph(root: str) -> dict[str, set[str]]:
    """``module -> the package's modules it imports`` (``from a.b import c`` names module
    ``a.b.c`` when that is one, else ``a.b``)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for module, path in modules.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        targets: list[str] = []
        with open(path, encoding="utf-8") as f:
            stack: list = [ast.parse(f.read(), path)]
        while stack:
            node = stack.pop()
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                stack.extend(node.orelse)
                continue
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets += [f"{base}.{a.name}" for a in node.names]
            stack.extend(ast.iter_child_nodes(node))
        graph[module] = {t for t in map(resolve, targets) if t and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_alpa():
    graph = import_graph(_ALPA)
    assert len(graph) > 80 and "alpa.executables.base" in graph["alpa.executables.mesh"]
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_function_local_cycle(tmp_path):
    # The control: a cycle closed by an import inside a function (as alpa's used to be),
    # and none where the closing import is under TYPE_CHECKING.
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from pkg.sub import high\n")
    (pkg / "sub" / "high.py").write_text("from pkg import low\n")
    assert cycles(import_graph(str(pkg))) == [["pkg.low", "pkg.sub.high"]]
    (pkg / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import high\n"
    )
    assert cycles(import_graph(str(pkg))) == []


# What each layer may not import (docs/architecture.md): the passes below the
# methods, the runtimes below the executables, and alpa.parallel_method, Alpa's path that
# re-exports every method, only for users.
_METHODS = (
    "alpa.api",
    "alpa.call_cache",
    "alpa.parallel_method",
    "alpa.methods.shard_method",
    "alpa.methods.pipeshard_method",
    "alpa.methods.create_state_parallel",
    "alpa.methods.follow_parallel",
    "alpa.methods.planned_parallel",
)
_FORBIDDEN = {
    "alpa.tracing": (
        "alpa.shard_parallel",
        "alpa.pipeline_parallel",
        "alpa.runtime",
        "alpa.executables",
        "alpa.record.parallel_plan",
        "alpa.record.plan_refs",
        *_METHODS,
    ),
    "alpa.shard_parallel": (
        "alpa.pipeline_parallel",
        "alpa.runtime",
        "alpa.executables",
        "alpa.record.parallel_plan",
        "alpa.record.plan_refs",
        *_METHODS,
    ),
    # The runtime runs instruction lists and imports no compiler pass.
    "alpa.runtime": (
        "alpa.tracing",
        "alpa.shard_parallel",
        "alpa.pipeline_parallel",
        "alpa.executables",
        "alpa.record.parallel_plan",
        "alpa.record.plan_refs",
        *_METHODS,
    ),
    "alpa.pipeline_parallel": (
        "alpa.executables",
        "alpa.record.parallel_plan",
        "alpa.record.plan_refs",
        *_METHODS,
    ),
    "alpa.executables": _METHODS,
    "alpa.record.parallel_plan": _METHODS,
    "alpa.record.plan_json": _METHODS,
    "alpa.record.plan_refs": _METHODS,
}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} imports {t}"
        for m, targets in graph.items()
        for layer, forbidden in _FORBIDDEN.items()
        if _within(m, layer)
        for t in targets
        if any(_within(t, f) for f in forbidden)
    )


def test_imports_point_one_way():
    graph = import_graph(_ALPA)
    assert _violations(graph) == []
    # The control: the executables stand on the runtime and the planners.
    assert "alpa.runtime.local_runtime" in graph["alpa.executables.pipeshard"]
    assert _violations({"alpa.runtime.x": {"alpa.pipeline_parallel.y"}}) == [
        "alpa.runtime.x imports alpa.pipeline_parallel.y"
    ]


# Inside the two planners: sub-packages in order, from the bottom; each imports only those
# below it and its package's records, never its package's entry modules.
_SUBPACKAGES = {
    "alpa.shard_parallel": (
        ("strategies", "ilp", "gradients", "lowering"),
        ("sharding_plan", "auto_sharding_option"),
    ),
    "alpa.pipeline_parallel": (("layers", "program", "scheduling", "stages"), ()),
}
# Alpa's import paths kept as modules that forward to the code's place: for users only.
_ALPAS_PATHS = {
    "alpa.parallel_method": None,
    "alpa.create_state_parallel": "alpa.methods.create_state_parallel",
    "alpa.follow_parallel": "alpa.methods.follow_parallel",
    "alpa.parallel_plan": "alpa.record.parallel_plan",
    "alpa.pipeline_parallel.stage_construction": "alpa.pipeline_parallel.stages.stage_construction",
    "alpa.pipeline_parallel.layer_construction": "alpa.pipeline_parallel.layers.layer_construction",
    "alpa.pipeline_parallel.runtime_emitter": "alpa.pipeline_parallel.scheduling.runtime_emitter",
    "alpa.pipeline_parallel.schedules": "alpa.pipeline_parallel.scheduling.schedules",
    "alpa.pipeline_parallel.primitive_def": "alpa.tracing.primitive_def",
}


def _place(module: str, package: str, order: tuple) -> tuple[int | None, str]:
    """``module``'s place in ``package``: the rank of its sub-package in ``order`` (None for
    a top-level module) and the name under the package."""
    name = module[len(package) + 1 :].split(".")[0]
    return (order.index(name) if name in order else None), name


def _subpackage_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for package, (order, records) in _SUBPACKAGES.items():
        for m, targets in graph.items():
            if not _within(m, package) or m == package:
                continue
            rank, _ = _place(m, package, order)
            if rank is None:
                continue
            for t in targets:
                if not _within(t, package) or t == package:
                    continue
                t_rank, name = _place(t, package, order)
                if (t_rank is None and name not in records) or (t_rank or 0) > rank:
                    found.append(f"{m} imports {t}")
    return sorted(found)


def test_sub_packages_point_down():
    graph = import_graph(_ALPA)
    assert _subpackage_violations(graph) == []
    # The controls: an arrow up between sub-packages, and one to the package's entry.
    assert (
        "alpa.pipeline_parallel.program.computation"
        in graph["alpa.pipeline_parallel.stages.stage_problem"]
    )
    assert _subpackage_violations(
        {
            "alpa.pipeline_parallel.layers.x": {"alpa.pipeline_parallel.stages.y"},
            "alpa.shard_parallel.ilp.x": {
                "alpa.shard_parallel.auto_sharding",
                "alpa.shard_parallel.sharding_plan",
                "alpa.shard_parallel.strategies.y",
            },
        }
    ) == [
        "alpa.pipeline_parallel.layers.x imports alpa.pipeline_parallel.stages.y",
        "alpa.shard_parallel.ilp.x imports alpa.shard_parallel.auto_sharding",
    ]


def test_alpas_paths_forward_and_nothing_in_alpa_imports_them():
    import importlib

    graph = import_graph(_ALPA)
    users = sorted(f"{m} imports {t}" for m, ts in graph.items() for t in ts if t in _ALPAS_PATHS)
    assert users == []
    for path, real in _ALPAS_PATHS.items():
        if real is None:
            continue
        shim, module = importlib.import_module(path), importlib.import_module(real)
        public = [n for n in vars(module) if not n.startswith("_")]
        assert public and all(getattr(shim, n) is getattr(module, n) for n in public), path


def test_every_package_has_a_face():
    """Each package's ``__init__.py`` says what it holds and names its entry point."""
    for module, path in _modules(_ALPA).items():
        if not path.endswith("__init__.py") or module in ("alpa", "alpa.model"):
            continue
        with open(path, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read()))
        assert doc and "Entry point" in doc, f"{module} has no docstring naming its entry point"


def test_architecture_md_lists_every_module():
    # docs/architecture.md is the layout: one row per module, every path real.
    doc = os.path.join(os.path.dirname(_ALPA), "docs", "architecture.md")
    with open(doc, encoding="utf-8") as f:
        text = f.read()
    rows = set(re.findall(r"^\| `(alpa/[\w/]+\.py)` \|", text, flags=re.M))
    on_disk = {
        os.path.relpath(path, os.path.dirname(_ALPA)).replace(os.sep, "/")
        for path in _modules(_ALPA).values()
    }
    assert sorted(on_disk - rows) == [], "modules missing from docs/architecture.md"
    assert sorted(rows - on_disk) == [], "docs/architecture.md lists modules that do not exist"


def test_no_function_of_alpa_is_over_120_lines():
    long = []
    for module, path in _modules(_ALPA).items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > 120:
                    long.append(f"{module}.{node.name}: {lines} lines")
    assert long == []
