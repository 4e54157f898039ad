"""The wheel: `pip install rlbus` adds exactly one name, `rlbus`, to site-packages, and carries every module; its
metadata has every extra, the stand-in pycosat named by the folder it was built from.

Builds the wheel from a copy of the sources (so no stale build/ directory can leak removed modules into it) and
reads its file list and metadata.

    .venv/bin/python -m pytest -q tests/integration/test_packaging.py
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
#: Repository folder -> its name once installed.
FOLDERS = {"bus": "rlbus/bus", "cli": "rlbus/cli", "common": "rlbus/common", "consumers": "rlbus/consumers",
           "producers": "rlbus/producers", "schemas": "rlbus/schemas", "tinker_api": "rlbus/tinker_api",
           "trainer": "rlbus/trainer"}


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return src


@pytest.fixture(scope="module")
def wheel(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob("rlbus-*.whl")
    return path


@pytest.fixture(scope="module")
def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_one_top_level_name(wheel_names: list[str]) -> None:
    tops = {n.split("/", 1)[0] for n in wheel_names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"rlbus"}


def test_every_module_of_every_package_is_in_the_wheel(wheel_names: list[str]) -> None:
    in_wheel = set(wheel_names)
    want = {f"{FOLDERS[p.relative_to(ROOT).parts[0]]}/{'/'.join(p.relative_to(ROOT).parts[1:])}"
            for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts}
    assert want - in_wheel == set(), "modules missing from the wheel (add their package to pyproject.toml)"
    assert not [n for n in wheel_names if n.startswith(("rlbus/tests", "rlbus/bench", "tests/", "bench/"))]


def test_the_command_entry_point(wheel: Path, wheel_names: list[str]) -> None:
    (name,) = [n for n in wheel_names if n.endswith(".dist-info/entry_points.txt")]
    with zipfile.ZipFile(wheel) as zf:
        assert "rlbus = rlbus.cli.main:main" in zf.read(name).decode()


def test_the_inspectors_page_is_in_the_wheel(wheel_names: list[str]) -> None:
    """`rlbus ui` serves these files from the installed package (pyproject.toml's package-data)."""
    want = {f"rlbus/cli/ui_static/{p.name}" for p in (ROOT / "cli" / "ui_static").iterdir() if p.is_file()}
    assert want and want <= set(wheel_names)


def test_the_quickstart_model_is_in_the_wheel(wheel_names: list[str]) -> None:
    """`model.init_if_missing` copies the quickstart's model from the installed package (common/model/ensure.py)."""
    shipped = ROOT / "common" / "model" / "shipped"
    want = {f"rlbus/common/model/shipped/{p.relative_to(shipped)}" for p in shipped.glob("*/*") if p.is_file()}
    assert {"rlbus/common/model/shipped/tiny-calculator/model.safetensors",
            "rlbus/common/model/shipped/tiny-calculator/tokenizer.json"} <= want <= set(wheel_names)


def test_the_extras_name_the_stand_in_pycosat_of_the_folder_built_from(src: Path, wheel: Path,
                                                                       wheel_names: list[str]) -> None:
    """setup.py makes [tool.rlbus.optional-dependencies] the extras, `{root:uri}` the source folder's URL."""
    (name,) = [n for n in wheel_names if n.endswith(".dist-info/METADATA")]
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(name).decode()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["rlbus"]["optional-dependencies"]
    assert set(re.findall(r"^Provides-Extra: (.+)$", metadata, flags=re.M)) == set(extras)
    (pycosat,) = [Requirement(r) for r in re.findall(r"^Requires-Dist: (pycosat .*)$", metadata, flags=re.M)]
    assert pycosat.url == (src / "packaging" / "pycosat").resolve().as_uri()
    assert pycosat.marker.evaluate({"extra": "reasoning-gym"}) and not pycosat.marker.evaluate({"extra": "dev"})
