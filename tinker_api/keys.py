"""API keys of the Tinker service: who may call it, and the owner each key's sessions, models and files belong to.

The keys file holds one key per line (`tml-` and at least 16 more characters; `#` starts a comment) and must be
readable by its owner alone (mode 0600, like every rlbus secret: docs/security.md). When the configured file does
not exist, `rlbus tinker` makes it with one fresh key and logs where it is; add a line per client to let more in.
The file is read again when it changes, so a key added or removed takes effect without a restart.

A key is never stored elsewhere: its owner is the first 16 hex digits of its SHA-256, which names the key's
directory of saved weights and tags everything it makes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from pathlib import Path

from rlbus.schemas.errors import ConfigError
from rlbus.schemas.tinker import KEY_PREFIX

log = logging.getLogger("rlbus.tinker")
MIN_KEY_LEN = len(KEY_PREFIX) + 16


def owner_of(key: str) -> str:
    """The owner id of `key`: names its directory and tags its objects; the key itself is kept nowhere."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(24)


class Keys:
    """The accepted keys, read from `path` (and again whenever its modification time changes)."""

    path: Path
    _keys: list[str]
    _stamp: tuple[int, int]  # (mtime_ns, size) of the file as last read

    def __init__(self, path: str | os.PathLike, *, create: bool = True):
        self.path = Path(path)
        if not self.path.exists() and create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"# API keys of rlbus tinker, one per line\n{new_key()}\n")
            log.info("tinker: made an API key in %s (export TINKER_API_KEY from it)", self.path)
        self._keys, self._stamp = [], (0, 0)
        self._read()

    def _read(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            raise ConfigError("tinker.keys_file", f"{self.path} does not exist") from None
        if (st.st_mtime_ns, st.st_size) == self._stamp:
            return
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise ConfigError("tinker.keys_file", f"{self.path} is readable by others (mode "
                              f"{stat.S_IMODE(st.st_mode):o}); chmod 600 it")
        keys = []
        for n, line in enumerate(self.path.read_text().splitlines(), 1):
            key = line.split("#", 1)[0].strip()
            if not key:
                continue
            if not key.startswith(KEY_PREFIX) or len(key) < MIN_KEY_LEN:
                raise ConfigError("tinker.keys_file", f"{self.path}:{n}: a key must start with {KEY_PREFIX!r} "
                                  f"and have at least {MIN_KEY_LEN} characters")
            keys.append(key)
        if not keys:
            raise ConfigError("tinker.keys_file", f"{self.path} holds no key")
        self._keys, self._stamp = keys, (st.st_mtime_ns, st.st_size)

    def owner(self, key: str | None) -> str | None:
        """The owner of `key` if it is accepted, else None (compared in constant time)."""
        if not key or not key.startswith(KEY_PREFIX):
            return None
        try:
            self._read()
        except ConfigError as e:  # a bad edit of the file: keep the keys read last, say why
            log.error("tinker: %s; keeping the keys read before", e)
        ok = False
        for k in self._keys:
            ok |= hmac.compare_digest(k.encode(), key.encode())
        return owner_of(key) if ok else None
