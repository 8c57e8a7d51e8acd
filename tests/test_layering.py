"""Layering rules of the package, checked on its source: which modules may not import which."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import meshagent

ROOT = Path(meshagent.__file__).parent


@dataclass(frozen=True)
class Rule:
    """Modules under `importer` (except those under `exempt`) must not import `forbidden`."""

    importer: str
    forbidden: str
    why: str
    exempt: tuple[str, ...] = ()

    def breaks(self, module: str, imported: str) -> bool:
        return (
            _under(module, self.importer)
            and not any(_under(module, e) for e in self.exempt)
            and _under(imported, self.forbidden)
        )


RULES = [
    Rule(
        "meshagent",
        "meshagent.testing",
        "test-only code (simulated network, staged pipeline, numpy reference) never ships in an "
        "agent's import graph",
        exempt=("meshagent.testing",),
    ),
]

# (module, imported) pairs that break a rule today. Shrink-only: fix one and remove it here.
KNOWN_EXCEPTIONS: frozenset[tuple[str, str]] = frozenset()


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(module: str, source: str, *, is_package: bool = False) -> Iterator[str]:
    """Every module name `source` may import: `import a.b` gives a.b; `from a import b` gives
    a and a.b (b may be a module); relative imports are resolved against `module`."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def package_imports() -> Iterator[tuple[str, str]]:
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        for imported in imports(module, path.read_text(), is_package=path.name == "__init__.py"):
            yield module, imported


def test_the_walker_sees_the_package_imports():
    found = set(package_imports())
    assert ("meshagent.agent", "meshagent.config") in found
    assert ("meshagent.testing.sim_network", "meshagent.net.transport") in found


@pytest.mark.parametrize(
    ("source", "imported"),
    [
        ("import meshagent.testing.staged", "meshagent.testing.staged"),
        ("from meshagent import testing", "meshagent.testing"),
        ("from ..testing import sim_network", "meshagent.testing.sim_network"),
        ("from . import capacity", "meshagent.serving.capacity"),
    ],
)
def test_every_form_of_import_is_seen(source, imported):
    assert imported in set(imports("meshagent.serving.pipeline", source))


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.importer}-must-not-import-{r.forbidden}")
def test_no_module_breaks_a_layering_rule(rule):
    broken = {(m, i) for m, i in package_imports() if rule.breaks(m, i)}
    assert broken <= KNOWN_EXCEPTIONS, f"{rule.why}: {sorted(broken - KNOWN_EXCEPTIONS)}"


def test_known_exceptions_only_shrink():
    still = {(m, i) for m, i in package_imports() if any(r.breaks(m, i) for r in RULES)}
    fixed = KNOWN_EXCEPTIONS - still
    assert not fixed, f"fixed, so remove from KNOWN_EXCEPTIONS: {sorted(fixed)}"
