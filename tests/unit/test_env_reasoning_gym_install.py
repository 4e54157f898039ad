"""How reasoning-gym is installed, as a user relies on it: `pip install 'rlbus[reasoning-gym]'` and then
`pip install --no-deps reasoning-gym==0.1.25` leave nothing out but pycosat (a C extension with no wheel; rlbus
hands reasoning-gym a pure-Python solver instead), and reasoning-gym's own API works after one call of rlbus's.

    .venv/bin/python -m pytest -q tests/unit/test_env_reasoning_gym_install.py
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

if importlib.util.find_spec("reasoning_gym") is None:
    pytest.skip("the reasoning-gym extra (make setup installs it)", allow_module_level=True)

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _name(req: Requirement) -> str:
    return req.name.lower().replace("_", "-")


def test_the_extra_names_every_dependency_of_reasoning_gym_but_pycosat_and_the_venv_satisfies_them():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    named = {_name(Requirement(r)) for r in project["optional-dependencies"]["reasoning-gym"]}
    core = {_name(Requirement(r)) for r in project["dependencies"]}
    needs = [Requirement(r) for r in importlib.metadata.requires("reasoning-gym") or []]
    needs = [r for r in needs if r.marker is None or r.marker.evaluate({"extra": ""})]  # not its own extras
    assert "pycosat" in {_name(r) for r in needs}  # what --no-deps is for: if it goes, so can the second command
    for req in needs:
        if _name(req) == "pycosat":
            continue
        assert _name(req) in named | core, f"{req} (a dependency of reasoning-gym) is not in rlbus's extra"
        installed = importlib.metadata.version(req.name)
        assert req.specifier.contains(installed, prereleases=True), f"{req}: {installed} is installed"


def test_reasoning_gyms_own_api_works_after_import_reasoning_gym():
    # As docs/environments.md tells a user who scores with reasoning-gym itself, in a process of its own (nothing
    # imported before it); zebra_puzzles is the task that solves SAT.
    code = """
from rlbus.common.envs.reasoning_gym import import_reasoning_gym
import_reasoning_gym()
import reasoning_gym
ds = reasoning_gym.create_dataset("gcd", size=3, seed=0)
score = reasoning_gym.get_score_answer_fn("gcd")
zebra = reasoning_gym.create_dataset("zebra_puzzles", size=1, seed=0, num_people=3, num_characteristics=3)
print(score(ds[0]["answer"], ds[0]), ds.score_answer("-1", ds[0]), zebra.score_answer(zebra[0]["answer"], zebra[0]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1.0", "0.0", "1.0"]
