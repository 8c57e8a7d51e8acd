"""One vocabulary: what the user reads about one thing is made in one place
(`meshagent/wording.py`), not written anew wherever it is said."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import meshagent
from meshagent.wording import layer_range, not_served, size

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


def test_every_size_is_written_by_one_function():
    # A number formatted into a message and followed by a unit of bytes is a size written by
    # hand: sizes go through `wording.size`, in one unit system everywhere.
    unit = re.compile(r"\s?(B|kB|KB|KiB|MB|MiB|GB|GiB|TB|TiB|K|M|G)\b")
    found = []
    for path in ROOT.rglob("*.py"):
        if path.name == "wording.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.JoinedStr):
                continue
            for before, after in itertools.pairwise(node.values):
                if (
                    isinstance(before, ast.FormattedValue)
                    and isinstance(after, ast.Constant)
                    and unit.match(after.value)
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {after.value!r}")
    assert found == []
    assert [size(n) for n in (512, 1234, 98_366_914, 8.99e9, 40e9, 123e9)] == [
        "512 B", "1.23 kB", "98.4 MB", "8.99 GB", "40.0 GB", "123 GB",
    ]  # fmt: skip
