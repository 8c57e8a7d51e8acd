"""One vocabulary: what the user reads about one thing is made in one place
(`meshagent/wording.py`), not written anew wherever it is said."""

from __future__ import annotations

import ast
from pathlib import Path

import meshagent
from meshagent.wording import layer_range, not_served

ROOT = Path(meshagent.__file__).parent


def _said(tree: ast.AST) -> list[str]:
    """The string literals of a module that are not docstrings (f-strings' literal parts too)."""
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            docs.add(id(first.value))
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def test_every_not_served_reason_is_worded_in_one_place():
    found = []
    for path in ROOT.rglob("*.py"):
        if path.name == "wording.py":
            continue
        for text in _said(ast.parse(path.read_text())):
            if "not served" in text or "not serving" in text:
                found.append(f"{path.relative_to(ROOT)}: {text!r}")
    assert found == []
    assert not_served("m", "it needs 1 GB more") == "m is not served: it needs 1 GB more"
    assert layer_range(10, 20) == "10-20"
