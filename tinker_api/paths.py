"""`tinker://` paths and the directories behind them, one tree per key.

    tinker://<model_id>/weights/<name>            save_state: adapter, AdamW's state, the base it was trained on
    tinker://<model_id>/sampler_weights/<name>    save_weights_for_sampler: the adapter alone

live under `tinker.dir` as `<owner>/<model_id>/<kind>/<name>/` (the owner: tinker_api/keys.py), so a path is found
only under the tree of the key that asks: another key's path reads as missing. Each directory is a peft adapter
directory (adapter_config.json, adapter_model.safetensors) that `peft.PeftModel.from_pretrained(base, dir)` loads
as it is, with `base.json` (trainer/lora.py: the base model's path and digest) and, for a state, `optimizer.pt`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlbus.tinker_api.wire import BadRequest

PREFIX = "tinker://"
Kind = Literal["weights", "sampler_weights"]
KINDS: tuple[str, ...] = ("weights", "sampler_weights")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: Kind
    name: str

    def __str__(self) -> str:
        return f"{PREFIX}{self.model_id}/{self.kind}/{self.name}"

    def directory(self, root: Path, owner: str) -> Path:
        return root / owner / self.model_id / self.kind / self.name


def check_name(name: str, field: str = "path") -> str:
    """A checkpoint name that is one safe path component; a BadRequest otherwise."""
    if not _NAME.fullmatch(name):
        raise BadRequest(f"{field}: {name!r} must be 1-128 letters, digits, '.', '_' or '-' (starting with a "
                         "letter or digit)")
    return name


def parse(path: str, field: str = "path") -> TinkerPath:
    """`tinker://<model_id>/<weights|sampler_weights>/<name>`; a BadRequest names what is wrong."""
    if not path.startswith(PREFIX):
        raise BadRequest(f"{field}: {path!r} is not a tinker:// path")
    parts = path[len(PREFIX) :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not _MODEL_ID.fullmatch(parts[0]):
        raise BadRequest(f"{field}: {path!r} is not tinker://<model_id>/<weights|sampler_weights>/<name>")
    return TinkerPath(parts[0], parts[1], check_name(parts[2], field))  # type: ignore[arg-type]
