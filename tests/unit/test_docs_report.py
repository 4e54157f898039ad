"""The current figures in README.md and docs/benchmarks.md are what bench/report.py makes from bench/results now, so the
two pages cannot disagree with each other or with the results.

    .venv/bin/python -m pytest -q tests/unit/test_docs_report.py
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import report

ROOT = Path(__file__).resolve().parents[2]


def test_both_tables_are_what_the_generator_makes_now():
    assert report.current(report.README.read_text()) == report.readme_table(), "README.md: run python bench/report.py"
    assert report.current(report.BENCHMARKS.read_text()) == report.benchmarks_table(), (
        "docs/benchmarks.md: run python bench/report.py")
    assert report.main(["--check"]) == 0


def test_the_readme_rows_are_the_benchmarks_rows():
    benchmarks = set(report.rows())
    readme = report.rows(headline_only=True, link_prefix="docs/benchmarks.md")
    assert len(readme) > 2
    for row in readme[2:]:
        assert row.replace("](docs/benchmarks.md#", "](#") in benchmarks


def test_every_figure_links_to_a_section_that_exists_and_says_where_it_came_from():
    text = re.sub(r"```.*?```", "", report.BENCHMARKS.read_text(), flags=re.S)
    anchors = {report.slug(h) for h in re.findall(r"^#{2,6} (.+?)\s*$", text, flags=re.M)}
    for fig in report.FIGURES:
        assert report.slug(fig.section) in anchors, f"{fig.title}: no section {fig.section!r} in docs/benchmarks.md"
        assert " - " not in fig.section, "GitHub and the docs site make different anchors of ' - '"
        for name in fig.files:
            assert (report.RESULTS / name).is_file(), name
        p = report.provenance(fig.files[0], report._load(fig.files[0]))
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", p["date"]) and p["commit"] and p["command"], fig.title
    for name, known in report.PROVENANCE.items():
        assert known.get("source"), f"PROVENANCE[{name!r}] must say where its values came from"


def test_a_changed_result_changes_both_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    before = report.benchmarks_table(), report.readme_table()
    data = (report.RESULTS / "bus.json").read_text().replace('"ratio": 0.957', '"ratio": 0.5')
    for path in report.RESULTS.glob("*.json"):
        (tmp_path / path.name).write_text(data if path.name == "bus.json" else path.read_text())
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    after = report.benchmarks_table(), report.readme_table()
    assert "0.50x raw nats-py" in after[0] and "0.50x raw nats-py" in after[1]
    assert before[0] != after[0] and before[1] != after[1]


def test_commands_are_shown_as_a_user_types_them():
    raw = (".venv/bin/python bench/quickstart_seeds.py --seeds 0 1 2 3 4 5 --results /tmp/x.json --keep /tmp/k "
           "--docs docs/benchmarks.md --heading '## A heading' --busy 2")
    assert report.command(raw) == "python bench/quickstart_seeds.py --seeds $(seq 0 5) --busy 2"
    assert report.command("python bench/x.py --seeds 0 2 5") == "python bench/x.py --seeds 0 2 5"
