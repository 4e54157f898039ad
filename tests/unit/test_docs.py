"""The README stays true: its config reference is the generated one, its commands exist, its first lines work."""

from pathlib import Path

import msgspec

from rlbus.cli.config_doc import SECTIONS, reference_markdown
from rlbus.cli.main import PASSTHROUGH, build_parser
from rlbus.schemas.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_config_reference_is_the_generated_one():
    assert reference_markdown() in README, "README's config reference is stale: paste `rlbus config reference`"


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
    import re

    named = set(re.findall(r"`rlbus ([a-z-]+)", README))
    assert named and named <= known, named - known
