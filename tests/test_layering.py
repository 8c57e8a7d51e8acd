"""Layering: a lower layer never imports a higher one, no two modules of the package import each
other (directly or round a longer circle), nothing in the package, the benchmarks or net-sim
imports the tests, and no worker thread waits on the event loop (`trio.from_thread`).

Every module is read with `ast`: imports inside functions and under TYPE_CHECKING count too (a
circle hidden under TYPE_CHECKING is still two modules that know each other; a `Protocol` on
the lower side is the way out). A module may always import from its own package, so a rule
that forbids a package to everyone still lets it import itself. Each check is also run over a
small tree with a planted breach, so that a check that can no longer see one fails too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import meshagent

ROOT = Path(meshagent.__file__).parent
REPO = ROOT.parent

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
    ("meshagent.serving.draft_policy", "trio"),
    ("meshagent.serving.kv_book", "trio"),
    ("meshagent.serving.awaited", "trio"),
    # Executors are one-way: they tell the runner what they learn through a sink
    # (`executor.ExecutorSink`) and know nothing else of it.
    ("meshagent.serving.executor", "meshagent.serving.runner"),
    ("meshagent.serving.pipeline", "meshagent.serving.runner"),
    ("meshagent.serving.chain", "meshagent.serving.runner"),
    ("meshagent.serving.stage_server", "meshagent.serving.runner"),
    # Engines run models; what is served, and how, is decided above them.
    ("meshagent.engine", "meshagent.serving"),
    # The catalogue's entries and book are sans-IO (merging is a function of the entries);
    # the catalogue sits below serving and the API, which read it.
    ("meshagent.catalog.entry", "trio"),
    ("meshagent.catalog.book", "trio"),
    ("meshagent.catalog", "meshagent.serving"),
    ("meshagent.catalog", "meshagent.api"),
    # Test doubles (fake engine, simulated network, tiny models, numpy reference) never ship in
    # an agent's import graph.
    ("meshagent", "meshagent.testing"),
]

# Shrink-only lists of what is known and not yet fixed: an entry that no longer occurs fails
# the check too, so it is removed when it is fixed. Layering breaches as (importing module,
# imported module); import circles as their modules, sorted.
KNOWN: set[tuple[str, str]] = set()
KNOWN_CIRCLES: set[tuple[str, ...]] = set()

# Where code that is shipped or run as a tool lives: none of it may import the tests (what a
# benchmark or the certification shares with the tests lives in `meshagent.testing`, or in
# the package proper).
NOT_TESTS = ("meshagent", "bench", "net-sim")
# `from tests... import` or `import tests...` in a shell script's inline Python.
_SHELL_IMPORT = re.compile(r"^\s*(?:from|import)\s+(tests(?:\.[\w.]+)?)\b", re.MULTILINE)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def modules(root: Path) -> dict[str, Path]:
    """The modules of the package at `root`, by dotted name."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(path: Path, module: str = "") -> list[list[str]]:
    """What each import statement of `path` (the module named `module`) may import, relative
    imports resolved: the module, then for `from X import y` also `X.y` (which may be a
    module)."""
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


def breaches(root: Path = ROOT) -> set[tuple[str, str]]:
    """(importing module, imported name) for every import that breaks one of `RULES`."""
    out = set()
    for module, path in modules(root).items():
        for importer, forbidden in RULES:
            if not _within(module, importer) or _within(module, forbidden):
                continue
            for names in imports(path, module):
                hit = next((n for n in names if _within(n, forbidden)), None)
                if hit is not None:
                    out.add((module, hit))
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Which modules of the package each of its modules imports. A package's `__init__` that
    runs on the way to one of its modules is not counted: re-exporting a package's modules
    there makes no circle between concepts."""
    found = modules(root)
    graph = {}
    for module, path in found.items():
        graph[module] = set()
        for base, *members in imports(path, module):
            # `from X import y`: the module X.y where there is one, X for any other name.
            named = {m for m in members if m in found}
            if len(named) < len(members) or not members:
                named.add(base)
            graph[module] |= {n for n in named if n in found and n != module}
    return graph


def circles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The groups of modules that reach each other through imports (the strongly connected
    components of more than one module), each as its modules, sorted."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: set[tuple[str, ...]] = set()
    for start in sorted(graph):
        if start in order:
            continue
        # Tarjan's algorithm, iterative: (module, the imports still to look at).
        order[start] = low[start] = len(order)
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter(sorted(graph[start])))]
        while work:
            v, rest = work[-1]
            w = next(rest, None)
            if w is not None:
                if w not in order:
                    order[w] = low[w] = len(order)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], order[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == order[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    out.add(tuple(sorted(group)))
    return out


def imports_of_tests(repo: Path = REPO) -> set[tuple[str, str]]:
    """(file, imported name) for every import of the `tests` package in `NOT_TESTS`: Python
    files, and the Python that shell scripts run inline."""
    out = set()
    for top in NOT_TESTS:
        for path in sorted((repo / top).rglob("*")):
            where = str(path.relative_to(repo))
            if path.suffix == ".py":
                names = [n for group in imports(path) for n in group[:1]]
            elif path.suffix == ".sh":
                names = _SHELL_IMPORT.findall(path.read_text())
            else:
                continue
            out |= {(where, n) for n in names if _within(n, "tests")}
    return out


def shrink_only(found: set, known: set) -> list[str]:
    """What is wrong with `found` against the shrink-only list `known`: what is new, and what
    the list still names though it no longer occurs."""
    return [f"new: {x}" for x in sorted(found - known)] + [
        f"fixed, remove it from the list: {x}" for x in sorted(known - found)
    ]


# ----- the package as it is -----


def calls_into_the_loop(root: Path = ROOT) -> set[tuple[str, int]]:
    """(module, line) of every use of `trio.from_thread`: a worker thread that waits on the
    event loop (the runner's hand-off, `run_sync_soon`, never waits)."""
    out = set()
    for module, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            named = isinstance(node, ast.Attribute) and node.attr == "from_thread"
            imported = isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "trio.from_thread"
            )
            if named or imported:
                out.add((module, node.lineno))
    return out


def test_no_worker_thread_waits_on_the_event_loop():
    assert not calls_into_the_loop()


def test_a_call_into_the_loop_is_seen(tmp_path):
    _tree(tmp_path, {"pkg/worker.py": "import trio\n\ndef f():\n    trio.from_thread.run(g)\n"})
    assert calls_into_the_loop(tmp_path / "pkg") == {("pkg.worker", 4)}


def test_no_lower_layer_imports_a_higher_one():
    wrong = shrink_only(breaches(), KNOWN)
    assert not wrong, "lower layer imports a higher one:\n" + "\n".join(wrong)


def test_no_two_modules_import_each_other():
    wrong = shrink_only(circles(import_graph()), KNOWN_CIRCLES)
    assert not wrong, "modules that import each other (directly or round a circle):\n" + (
        "\n".join(wrong)
    )


def test_nothing_shipped_or_run_as_a_tool_imports_the_tests():
    found = imports_of_tests()
    assert not found, "imports of the tests (move what is shared to meshagent/testing):\n" + (
        "\n".join(f"  {f} imports {n}" for f, n in sorted(found))
    )


# ----- each check sees a planted breach -----


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_rules_see_a_breach(tmp_path):
    # A serving module that imports the API, absolutely and relatively; trio in the wire.
    _tree(
        tmp_path,
        {
            "meshagent/__init__.py": "",
            "meshagent/serving/__init__.py": "",
            "meshagent/serving/up.py": "from meshagent.api.app import OpenAIApp\n",
            "meshagent/serving/rel.py": "from ..api import forwarding\n",
            "meshagent/serving/ok.py": "from . import up\nimport trio\n",
            "meshagent/wire/io.py": "def f():\n    import trio.abc\n",
            "meshagent/cli/run.py": "from meshagent.testing import fake_engine\n",
            "meshagent/testing/sim.py": "from meshagent.testing import fake_engine\n",
        },
    )
    assert breaches(tmp_path / "meshagent") == {
        ("meshagent.serving.up", "meshagent.api.app"),
        ("meshagent.serving.rel", "meshagent.api"),
        ("meshagent.wire.io", "trio.abc"),
        ("meshagent.cli.run", "meshagent.testing"),
    }


def test_a_circle_is_seen(tmp_path):
    # Two modules that import each other (one of them in a function, relatively), three round
    # a circle (one under TYPE_CHECKING), and imports that only point one way.
    _tree(
        tmp_path,
        {
            "meshagent/__init__.py": "from meshagent import a\n",
            "meshagent/a.py": "from meshagent.b import B\n",
            "meshagent/b.py": "def f():\n    from . import a\n",
            "meshagent/c.py": "import meshagent.a\nfrom meshagent import b\n",
            "meshagent/net/__init__.py": "from meshagent.net.x import X\n",
            "meshagent/net/x.py": "from meshagent.net import y\n",
            "meshagent/net/y.py": "from .z import Z\n",
            "meshagent/net/z.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from meshagent.net.x import X\n"
            ),
            "meshagent/net/w.py": "from meshagent.net.x import X\nfrom meshagent import c\n",
        },
    )
    assert circles(import_graph(tmp_path / "meshagent")) == {
        ("meshagent.a", "meshagent.b"),
        ("meshagent.net.x", "meshagent.net.y", "meshagent.net.z"),
    }


def test_an_import_of_the_tests_is_seen(tmp_path):
    _tree(
        tmp_path,
        {
            "bench/a.py": "from tests.e2e.agents import invite\nimport testsuite\n",
            "bench/b.py": "import json\n\ndef f():\n    import tests.conftest as c\n",
            "bench/run.sh": (
                'python - <<EOF\nfrom tests.engine.tiny import write\nEOF\necho "import tests"\n'
            ),
            "net-sim/netsim/c.py": "from tests import peer_values\nfrom tests_x import y\n",
            "meshagent/d.py": "from meshagent.testing import tiny_gguf\n",
            "tests/e.py": "from tests.e2e import agents\n",
        },
    )
    assert imports_of_tests(tmp_path) == {
        ("bench/a.py", "tests.e2e.agents"),
        ("bench/b.py", "tests.conftest"),
        ("bench/run.sh", "tests.engine.tiny"),
        ("net-sim/netsim/c.py", "tests"),
    }


def test_a_shrink_only_list_fails_when_an_entry_is_fixed_or_one_is_new():
    assert shrink_only({"a"}, {"a"}) == []
    assert shrink_only({"a"}, {"a", "b"}) == ["fixed, remove it from the list: b"]
    assert shrink_only({"a", "c"}, {"a"}) == ["new: c"]
