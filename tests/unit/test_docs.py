"""The docs stay true: the config reference is the generated one, the README's commands exist, its first lines work,
and every link from the README (which the docs site does not build) reaches a page and a heading that exist.

    .venv/bin/python -m pytest -q tests/unit/test_docs.py
"""

import re
from pathlib import Path

import msgspec

from bench.report import slug
from rlbus.cli.config_doc import SECTIONS, reference_markdown
from rlbus.cli.main import PASSTHROUGH, build_parser
from rlbus.schemas.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CONFIG_PAGE = ROOT / "docs" / "config.md"


def test_the_config_reference_page_is_the_generated_one():
    assert reference_markdown() in CONFIG_PAGE.read_text(), (
        "docs/config.md's table is stale: replace it with the output of `rlbus config reference`")


def test_every_config_section_is_in_the_reference():
    sections = {f.name for f in msgspec.structs.fields(RunConfig) if isinstance(f.type, type)
                and issubclass(f.type, msgspec.Struct)}
    assert sections <= {name.split(" ")[0] for name in SECTIONS}, sections - set(SECTIONS)


def test_every_config_key_has_a_meaning():
    rows = [r for r in reference_markdown().splitlines()[2:]]
    assert rows and all(not r.rstrip().endswith("|  |") for r in rows), [r for r in rows if r.endswith("|  |")]


def test_readme_starts_with_the_two_commands_and_they_exist():
    head = README.split("```")[1]
    assert "make run" in head and "make test" in head
    makefile = (ROOT / "Makefile").read_text()
    assert "\nrun:" in makefile and "\ntest:" in makefile
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_commands_named_in_the_readme_exist():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    known = set(sub.choices) | set(PASSTHROUGH)

    named = set(re.findall(r"`rlbus ([a-z-]+)", README))
    assert named and named <= known, named - known


def _headings(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M)}


def test_readme_links_reach_pages_and_headings_that_exist():
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    assert links
    broken = []
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _headings(target):
            broken.append(f"{link}: no such heading in {path or 'README.md'}")
    assert not broken, broken


def test_readme_stays_short():
    assert len(README.splitlines()) <= 300, "the README is for users: detail belongs in a page of docs/"
