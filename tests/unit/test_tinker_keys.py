"""The Tinker service's keys file and tinker:// paths (tinker_api/keys.py, tinker_api/paths.py): who gets in, and that
no path escapes its key's tree. The service itself, with the real SDK: tests/integration/test_tinker.py.

    .venv/bin/python -m pytest -q tests/unit/test_tinker_keys.py
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from rlbus.schemas.errors import ConfigError
from rlbus.tinker_api import paths
from rlbus.tinker_api.keys import Keys, owner_of
from rlbus.tinker_api.wire import BadRequest


def _write(path: Path, text: str, mode: int = 0o600) -> None:
    path.write_text(text)
    os.chmod(path, mode)


def test_a_missing_keys_file_is_made_with_one_private_key(tmp_path: Path) -> None:
    keys = Keys(tmp_path / "creds" / "tinker_keys")
    assert stat.S_IMODE(keys.path.stat().st_mode) == 0o600
    (key,) = [line for line in keys.path.read_text().splitlines() if not line.startswith("#")]
    assert key.startswith("tml-") and keys.owner(key) == owner_of(key)
    assert keys.owner("tml-" + "x" * 30) is None and keys.owner(None) is None and keys.owner("") is None
    assert keys.owner(key[4:]) is None  # without its prefix: refused, as the SDK would refuse to send it


def test_keys_are_read_again_when_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    a, b = "tml-a-0123456789abcdef", "tml-b-0123456789abcdef"
    _write(path, f"{a}  # alice\n")
    keys = Keys(path)
    assert keys.owner(a) and keys.owner(b) is None
    _write(path, f"{a}\n{b}\n")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert keys.owner(b) == owner_of(b) != owner_of(a)


def test_a_keys_file_others_can_read_or_a_bad_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    _write(path, "tml-a-0123456789abcdef\n", mode=0o644)
    with pytest.raises(ConfigError, match="tinker.keys_file: .* readable by others"):
        Keys(path)
    _write(path, "sk-not-a-tinker-key-0123456789\n")
    with pytest.raises(ConfigError, match="must start with 'tml-'"):
        Keys(path)
    _write(path, "# nothing\n")
    with pytest.raises(ConfigError, match="holds no key"):
        Keys(path)


def test_tinker_paths_stay_in_their_keys_tree(tmp_path: Path) -> None:
    p = paths.parse("tinker://abc:train:0/sampler_weights/step-3")
    assert (p.model_id, p.kind, p.name) == ("abc:train:0", "sampler_weights", "step-3")
    assert str(p) == "tinker://abc:train:0/sampler_weights/step-3"
    assert p.directory(tmp_path, "owner1") == tmp_path / "owner1" / "abc:train:0" / "sampler_weights" / "step-3"
    for bad in ("tinker://abc/weights/../x", "tinker://abc/weights/..", "tinker://../weights/x", "s3://abc/weights/x",
                "tinker://abc/other/x", "tinker://abc/weights/.hidden", "tinker://abc/weights/"):
        with pytest.raises(BadRequest):
            paths.parse(bad)
