"""User code named in a config: `"pkg.module:attr"` resolved, with a ConfigError naming the field when it fails.

Tools, rewards, agents and environments are all given this way; the module is imported the way Python imports any
module (the current directory and PYTHONPATH first), so a run started from a project's root finds its packages.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from rlbus.schemas.errors import ConfigError


def cwd_on_path() -> None:
    """Put the current directory on the import path, as `python -m` would: the `rlbus` console script puts its own
    bin/ first instead, and a user's `my_agent:rollout` beside the config is found all the same."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def import_object(path: str, field: str) -> Any:
    """Resolve "pkg.module:attr" (attr may be dotted), raising ConfigError(field, ...) saying what failed."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(field, f"{path!r} is neither a built-in name nor an import path 'pkg.module:attr'")
    cwd_on_path()
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(field, f"cannot import module {module_name!r} for {path!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(field, f"{path!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
