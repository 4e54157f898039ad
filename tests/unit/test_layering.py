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
    "cli": {"schemas", "bus", "common", "producers", "consumers", "trainer", "cli"},
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
