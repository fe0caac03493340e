"""The repository's text stands on its own: no file points at a design document or a
folder outside the repository, and no docstring or comment cites an issue number in place
of saying what it means. The design's text is ``docs/design.md`` and the pages beside it.

Each check is run on a planted line first (the control), so that it can fail."""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The trees and files whose text is checked.
TREES = ("alpa", "tests", "benchmark", "examples", "docs", ".ci")
FILES = ("README.md", "pyproject.toml", "setup.py")
TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt", ".toml", ".cfg", ".sh", ".yaml", ".yml", ".json")

# Pointers out of the repository: the design file that lived beside it, its sections
# (the word and a section sign), and the folder beside the checkout. Written in pieces, so
# that this file does not match itself.
OUTSIDE_POINTERS = re.compile(
    "|".join(
        (
            re.escape("DESIGN" + ".md"),
            "DESIGN" + r"\s*§",
            re.escape(".." + "/shared"),
            re.escape("/work/" + "shared"),
        )
    )
)

# The word "issue" and a number (with or without "#"), or "#" and two digits or more: a
# tracker's number where the text should say the thing itself.
ISSUE_CITATION = re.compile(r"\bissues? ?#?\d+|(?<![\w&])#\d{2,}\b", re.IGNORECASE)


def _text_files() -> list[str]:
    paths = [os.path.join(ROOT, f) for f in FILES if os.path.exists(os.path.join(ROOT, f))]
    for tree in TREES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, tree)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__pycache__"))]
            paths += [os.path.join(folder, f) for f in files if f.endswith(TEXT_SUFFIXES)]
    return sorted(paths)


def outside_pointers(name: str, text: str) -> list[str]:
    """``name:line: text`` of every line of ``text`` that points outside the repository."""
    return [
        f"{name}:{i}: {line.strip()}"
        for i, line in enumerate(text.splitlines(), 1)
        if OUTSIDE_POINTERS.search(line)
    ]


def issue_citations(name: str, source: str) -> list[str]:
    """``name:line: text`` of every docstring and comment of the Python ``source`` that
    cites an issue number."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and ISSUE_CITATION.search(doc):
                line = node.body[0].lineno
                found.append(f"{name}:{line}: docstring: {ISSUE_CITATION.search(doc)[0]}")
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and ISSUE_CITATION.search(tok.string):
            found.append(f"{name}:{tok.start[0]}: {tok.string.strip()}")
    return found


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def test_no_file_points_outside_the_repository():
    planted = "see ../" + "shared/DESIGN" + ".md, DESIGN " + "§4.5"
    assert outside_pointers("planted.py", f"x = 1\n# {planted}\n") == [f"planted.py:2: # {planted}"]
    assert outside_pointers("fine.md", "see `docs/design.md`, Layering\n") == []
    paths = _text_files()
    assert os.path.join(ROOT, "docs", "design.md") in paths
    found = [
        hit for path in paths for hit in outside_pointers(os.path.relpath(path, ROOT), _read(path))
    ]
    assert found == [], "text pointing outside the repository:\n" + "\n".join(found)


def test_no_docstring_or_comment_cites_an_issue():
    planted = '"""Layers planned (issue 30, item 2)."""\n\n\ndef f():\n    return 1  # see #27\n'
    assert issue_citations("planted.py", planted) == [
        "planted.py:1: docstring: issue 30",
        "planted.py:5: # see #27",
    ]
    fine = '"""Every 30 layers, item 2 of a list; &#39; is an entity."""\n'
    assert issue_citations("fine.py", fine) == []
    paths = [p for p in _text_files() if p.endswith(".py")]
    assert os.path.join(ROOT, "alpa", "pipeline_parallel", "layers", "stacked_rows.py") in paths
    found = [
        hit for path in paths for hit in issue_citations(os.path.relpath(path, ROOT), _read(path))
    ]
    assert found == [], "docstrings or comments citing an issue:\n" + "\n".join(found)
