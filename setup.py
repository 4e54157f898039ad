"""The project's extras, from pyproject.toml's [tool.rlbus.optional-dependencies], with `{root:uri}` (hatchling's
name for it; setuptools has no such substitution) replaced by this clone's folder as a file URL.

The `reasoning-gym` extra installs rlbus's pure-Python pycosat from packaging/pycosat by a direct reference, and pip
takes only absolute URLs in metadata, so the path is made here, at build time, in the folder pip builds from (the
clone, for `pip install -e .` and `pip install .`). Everything else is in pyproject.toml.

    pip install -e '.[reasoning-gym]'
"""

import tomllib
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def extras() -> dict[str, list[str]]:
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["rlbus"]["optional-dependencies"]
    return {name: [req.replace("{root:uri}", ROOT.as_uri()) for req in reqs] for name, reqs in table.items()}


setup(extras_require=extras())
