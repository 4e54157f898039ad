"""Rooms and arrows (docs/architecture.md): which package of rlbus may import which, read from the source.

Every import statement of every module counts -- top-level, inside functions, under TYPE_CHECKING -- because a
deferred import is still an arrow. A forbidden arrow fails with the file, line and the rule it breaks.

    .venv/bin/python -m pytest -q tests/unit/test_layering.py
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: package -> the rlbus packages its modules may import (itself included). The CLI sits on top and may import all.
ALLOWED: dict[str, set[str]] = {
    "schemas": {"schemas"},
    "bus": {"schemas", "bus"},
    "common": {"schemas", "common"},
    "producers": {"schemas", "bus", "common", "producers"},
    "consumers": {"schemas", "bus", "common", "consumers"},
    "trainer": {"schemas", "bus", "common", "consumers", "trainer"},
    # The Tinker gateway runs in one process (tinker_api/service.py says why): it composes the trainer's LoRA, log-prob,
    # optimizer and loss code with the producers' HF engine, as the CLI composes roles. No role imports it.
    "tinker_api": {"schemas", "bus", "common", "producers", "trainer", "tinker_api"},
    "cli": {"schemas", "bus", "common", "producers", "consumers", "trainer", "tinker_api", "cli"},
}
PACKAGES = set(ALLOWED)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative imports would hide the arrow's target; the project writes none
                out.append((node.lineno, "." * node.level + (node.module or "")))
            else:
                out.append((node.lineno, node.module or ""))
    return out


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py") if "__pycache__" not in p.parts)


def _violations(path: Path, package: str | None) -> list[str]:
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    found = []
    for line, module in _imports(path):
        head, _, rest = module.partition(".")
        if module.startswith("."):
            found.append(f"{rel}:{line}: relative import {module!r}; write rlbus.<package>... in full")
        elif head in PACKAGES:
            found.append(f"{rel}:{line}: `{module}` bypasses the one import name; write rlbus.{module}")
        elif head == "rlbus" and package is not None:
            target = rest.split(".")[0]
            if target not in ALLOWED[package]:
                found.append(f"{rel}:{line}: {package}/ imports rlbus.{target} ({module}); {package}/ may import "
                             f"only {sorted(ALLOWED[package])}")
    return found


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_package_imports_only_what_its_room_allows(package: str) -> None:
    files = _python_files(package)
    assert files, f"{package}/ holds no Python files"
    problems = [v for f in files for v in _violations(f, package)]
    assert not problems, "forbidden arrows:\n" + "\n".join(problems)


def test_tests_and_benchmarks_use_the_installed_name() -> None:
    # Tests and benchmarks may import anything, but only as rlbus.*: a bare `bus` or `trainer` would import a
    # second copy of a module (two classes of one name) and pass here while failing from an installed wheel.
    problems = [v for f in _python_files("tests", "bench", "examples") for v in _violations(f, None)]
    assert not problems, "\n".join(problems)


def test_the_rule_catches_a_forbidden_arrow(tmp_path: Path) -> None:
    # The checker itself: a producer module reaching into the trainer, a bare import and a relative import.
    bad = tmp_path / "probe.py"
    bad.write_text("from rlbus.trainer.feeder import Feeder\nimport bus.client\nfrom . import engines\n")
    problems = _violations(bad, "producers")
    assert len(problems) == 3, problems
    assert "producers/ imports rlbus.trainer" in problems[0]
    assert "bypasses the one import name" in problems[1]
    assert "relative import" in problems[2]


#: Import circles allowed, named by their modules (sorted): none. A circle not listed here fails, and an entry whose
#: circle is gone fails too (the test says so). The last one went when the preloaded server's roles got the CLI's
#: entry point handed in (cli/preload.py) instead of importing the CLI that imports the launcher that imports them.
KNOWN_CIRCLES: set[tuple[str, ...]] = set()


def _modules() -> dict[str, Path]:
    """rlbus module name -> file, for every module of every package (a package's __init__ is the package)."""
    out = {}
    for path in _python_files(*sorted(PACKAGES)):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(["rlbus", *parts])] = path
    return out


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the rlbus modules it imports, by every import statement (deferred and TYPE_CHECKING ones too).
    `from rlbus.a import b` imports the module rlbus.a.b when there is one, else rlbus.a."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                wanted = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                wanted = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names]
            else:
                continue
            for target in wanted:
                while target and target not in modules:  # `import rlbus.bus.client.x`: the nearest module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def _circles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The import circles of `graph`: its strongly connected components of two modules or more (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_circle_between_modules_of_rlbus() -> None:
    # A circle (a imports b, b imports a, however indirectly and however deferred) means neither module can be read,
    # tested or moved alone; one under TYPE_CHECKING still ties the two together for readers and type checkers.
    circles = _circles(_import_graph(_modules()))
    new = [c for c in circles if c not in KNOWN_CIRCLES]
    assert not new, "import circles:\n" + "\n".join(" <-> ".join(c) for c in new)
    gone = KNOWN_CIRCLES - set(circles)
    assert not gone, f"these circles are gone: remove them from KNOWN_CIRCLES: {sorted(gone)}"


def test_the_circle_check_catches_a_circle_through_type_checking(tmp_path: Path) -> None:
    # The checker itself: a circle of three modules closed by an import under TYPE_CHECKING, beside a clean module.
    files = {"a": "from rlbus.bus.b import X\n", "b": "import rlbus.bus.c\n",
             "c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlbus.bus import a\n",
             "d": "from rlbus.bus.a import Y\n"}
    modules = {}
    for stem, text in files.items():
        (tmp_path / f"{stem}.py").write_text(text)
        modules[f"rlbus.bus.{stem}"] = tmp_path / f"{stem}.py"
    assert _circles(_import_graph(modules)) == [("rlbus.bus.a", "rlbus.bus.b", "rlbus.bus.c")]


#: The longest a Python file of the project may grow (STYLE: split by what the parts do, not by size alone).
MAX_LINES = 600


def test_no_python_file_is_longer_than_the_house_allows() -> None:
    """Every .py file of the project, tests and benchmarks included (the virtualenv and run outputs are not)."""
    skip = {".venv", ".bench", "runs", ".rlbus", ".pytest-shards", "node_modules"}
    long = sorted((n, str(p.relative_to(ROOT))) for p in ROOT.rglob("*.py")
                  if not skip & set(p.relative_to(ROOT).parts)
                  and (n := len(p.read_text(errors="replace").splitlines())) > MAX_LINES)
    assert not long, f"over {MAX_LINES} lines: {long}"
