"""The docs site builds with `mkdocs build --strict`: a broken link or anchor, or a page missing from the nav, fails.

    .venv/bin/python -m pytest -q tests/unit/test_docs_site.py

mkdocs and mkdocs-material are in the dev extra (`make test` installs it); without them this is skipped.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("mkdocs")
pytest.importorskip("material")

ROOT = Path(__file__).resolve().parents[2]


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=300,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})


def test_the_site_builds_strict(tmp_path: Path):
    proc = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "agents" / "index.html").is_file()


def test_every_page_is_in_the_nav():
    def pages(nav) -> set[str]:
        out: set[str] = set()
        for item in nav:
            for value in (item.values() if isinstance(item, dict) else [item]):
                out |= pages(value) if isinstance(value, list) else {value}
        return out

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    assert pages(nav) == {p.name for p in (ROOT / "docs").glob("*.md")}


def test_a_broken_anchor_or_link_fails_the_build(tmp_path: Path):
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[the guide](guide.md#no-such-heading)\n")
    (docs / "guide.md").write_text("# Guide\n\n## A heading\n")
    config.update(docs_dir=str(docs), nav=[{"Home": "index.md"}, {"Guide": "guide.md"}])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    assert _build(tmp_path / "mkdocs.yml", tmp_path / "site").returncode != 0
    (docs / "index.md").write_text("# Home\n\n[the guide](guide.md#a-heading) [gone](gone.md)\n")
    assert _build(tmp_path / "mkdocs.yml", tmp_path / "site").returncode != 0
    (docs / "index.md").write_text("# Home\n\n[the guide](guide.md#a-heading)\n")
    proc = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-2000:]
    shutil.rmtree(tmp_path / "site")
