"""How reasoning-gym is installed, as a user relies on it: one command in rlbus's clone, `pip install -e
'.[reasoning-gym]'`, installs reasoning-gym with rlbus's pure-Python pycosat (packaging/pycosat) for the
pycosat==0.6.6 every release of it requires, so nothing is compiled, and a bare `import reasoning_gym` works. Where
reasoning-gym went in without its dependencies (no pycosat at all), `import_reasoning_gym()` lends it the stand-in.

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

STAND_IN_DIR = Path(__file__).resolve().parents[2] / "packaging" / "pycosat"
#: gcd's answer scored, a wrong one scored, a zebra puzzle's answer scored (zebra_puzzles is the task that solves SAT).
SCORES = """
ds = reasoning_gym.create_dataset("gcd", size=3, seed=0)
score = reasoning_gym.get_score_answer_fn("gcd")
zebra = reasoning_gym.create_dataset("zebra_puzzles", size=1, seed=0, num_people=3, num_characteristics=3)
print(score(ds[0]["answer"], ds[0]), ds.score_answer("-1", ds[0]), zebra.score_answer(zebra[0]["answer"], zebra[0]))
"""


def _name(req: Requirement) -> str:
    return req.name.lower().replace("_", "-")


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_the_stand_in_is_a_pycosat_every_reasoning_gym_accepts():
    # pip takes the stand-in's direct reference for reasoning-gym's pin only where name and version match it.
    stand_in = tomllib.loads((STAND_IN_DIR / "pyproject.toml").read_text())["project"]
    needs = {_name(r): r for r in map(Requirement, importlib.metadata.requires("reasoning-gym") or [])}
    assert stand_in["name"] == "pycosat"
    assert needs["pycosat"].specifier.contains(stand_in["version"]), f"{needs['pycosat']}, stand-in {stand_in}"


def test_the_extra_installed_reasoning_gym_and_the_stand_in_of_this_clone():
    # rlbus's metadata as installed (setup.py wrote the clone's folder into it).
    extra = {}
    for req in map(Requirement, importlib.metadata.requires("rlbus") or []):
        if req.marker is not None and req.marker.evaluate({"extra": "reasoning-gym"}) and not req.marker.evaluate():
            extra[_name(req)] = req
    assert set(extra) == {"reasoning-gym", "pycosat"}
    assert extra["pycosat"].url == STAND_IN_DIR.as_uri()
    assert extra["reasoning-gym"].specifier.contains(importlib.metadata.version("reasoning-gym"))


def test_a_bare_import_reasoning_gym_works():
    # As docs/environments.md tells a user who scores with reasoning-gym itself: nothing of rlbus imported.
    assert _run("import reasoning_gym\n" + SCORES) == ["1.0", "0.0", "1.0"]


def test_with_no_pycosat_installed_import_reasoning_gym_lends_it_the_stand_in_alone():
    # reasoning-gym installed with --no-deps, no pycosat beside it: a finder first on sys.meta_path hides the installed
    # one. The stand-in, loaded from the clone, is reasoning-gym's alone: nothing else imports a pycosat that is not
    # there, and tools that walk sys.modules asking each module for its file (hypothesis, vLLM) get no ImportError.
    code = """
import importlib, sys

class NoPycosat:
    def find_spec(self, name, path=None, target=None):
        if name == "pycosat":
            raise ModuleNotFoundError("No module named 'pycosat'", name="pycosat")

sys.meta_path.insert(0, NoPycosat())
from rlbus.common.envs.reasoning_gym import STAND_IN, import_reasoning_gym
import_reasoning_gym()
import reasoning_gym
from reasoning_gym.logic.contrib.logic_puzzle import sat_utils
assert sat_utils.pycosat.__file__ == str(STAND_IN), sat_utils.pycosat
assert "pycosat" not in sys.modules
try:
    importlib.import_module("pycosat")
    raise AssertionError("pycosat imports")
except ModuleNotFoundError:
    pass
for module in list(sys.modules.values()):
    getattr(module, "__file__", None)
""" + SCORES
    assert _run(code) == ["1.0", "0.0", "1.0"]
