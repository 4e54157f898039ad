"""The base of every config section and its validation helper, shared by schemas/config.py and schemas/env.py.

A section is a msgspec Struct with keyword-only fields that refuses unknown keys; `_need(ok, field, reason)` raises
the ValueError that `schemas/config_io.py` turns into a `ConfigError` naming the dotted field.
"""

from __future__ import annotations

import msgspec


def _need(ok: bool, field: str, reason: str) -> None:
    # msgspec wraps a ValueError raised in __post_init__ and appends the struct's path; the loader joins them.
    if not ok:
        raise ValueError(f"{field}: {reason}")


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass
