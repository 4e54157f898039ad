"""A file replaced whole: written beside its place under a hidden temporary name, then renamed over it.

A reader (another process, a crash's successor) sees the old content or the new, never a half-written file: the
feeder's state, checkpoint pointers, a cut-back event log or metrics file, the launcher's producers file, `rlbus ui`'s
address. (bus/ keeps its own: it imports only bus/ and schemas/.)
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Replace `path` with `data` (text is written as UTF-8) in one rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)
