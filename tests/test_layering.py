"""Layering: a lower layer never imports a higher one.

Every module of the package is read with `ast` (imports inside functions and under
TYPE_CHECKING count too) and checked against `RULES`. A module may always import from its own
package, so a rule that forbids a package to everyone still lets it import itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import meshagent

ROOT = Path(meshagent.__file__).parent

# (importer prefix, forbidden prefix): no module named by the first imports one named by the
# second. Prefixes match whole dotted names ("meshagent.api" is not "meshagent.apix").
RULES: list[tuple[str, str]] = [
    # The API asks serving's model directory; serving never reaches up into the API.
    ("meshagent.serving", "meshagent.api"),
    # The wire protocol is sans-IO: frames in, events out; trio moves its bytes elsewhere.
    ("meshagent.wire", "trio"),
    # The scheduler is a plain object fed events; the runner brings the thread and trio.
    ("meshagent.serving.scheduler", "trio"),
    ("meshagent.serving.prefix_cache", "trio"),
    # Engines run models; what is served, and how, is decided above them.
    ("meshagent.engine", "meshagent.serving"),
    # Test doubles (fake engine, simulated network, staged pipeline, numpy reference) never
    # ship in an agent's import graph.
    ("meshagent", "meshagent.testing"),
]

# Known breaches, as (importing module, imported module). Shrink only: an entry that no longer
# occurs fails the test too, so it is removed when its breach is fixed.
KNOWN: set[tuple[str, str]] = set()


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[list[str]]:
    """What each import statement of `path` may import, relative imports resolved: the
    module, then for `from X import y` also `X.y` (which may be a module)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[list[str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [[alias.name] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append([base, *(f"{base}.{alias.name}" for alias in node.names)])
    return found


def breaches() -> set[tuple[str, str]]:
    out = set()
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        for importer, forbidden in RULES:
            if not _within(module, importer) or _within(module, forbidden):
                continue
            for names in _imports(path):
                hit = next((n for n in names if _within(n, forbidden)), None)
                if hit is not None:
                    out.add((module, hit))
    return out


def test_no_lower_layer_imports_a_higher_one():
    new = breaches() - KNOWN
    assert not new, "lower layer imports a higher one:\n" + "\n".join(
        f"  {m} imports {i}" for m, i in sorted(new)
    )


def test_known_breaches_still_occur():
    fixed = KNOWN - breaches()
    assert not fixed, "fixed; remove from KNOWN: " + ", ".join(map(str, sorted(fixed)))


def test_the_rules_see_a_breach(tmp_path, monkeypatch):
    # The walker itself: a serving module that imports the API, absolutely and relatively.
    pkg = tmp_path / "meshagent"
    (pkg / "serving").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "serving" / "__init__.py").write_text("")
    (pkg / "serving" / "up.py").write_text("from meshagent.api.app import OpenAIApp\n")
    (pkg / "serving" / "rel.py").write_text("from ..api import forwarding\n")
    (pkg / "serving" / "ok.py").write_text("from . import up\nimport trio\n")
    (pkg / "wire").mkdir()
    (pkg / "wire" / "io.py").write_text("def f():\n    import trio.abc\n")
    monkeypatch.setitem(globals(), "ROOT", pkg)
    assert breaches() == {
        ("meshagent.serving.up", "meshagent.api.app"),
        ("meshagent.serving.rel", "meshagent.api"),
        ("meshagent.wire.io", "trio.abc"),
    }
