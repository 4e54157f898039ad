"""Reading and writing the run config (`schemas/config.py`): a YAML file plus `a.b.c=value` overrides in, a
validated `RunConfig` out, and back to YAML with the secrets redacted.

    cfg = load_config("configs/quickstart.yaml", ["trainer.lr=3e-6", "rollout.n=8"])
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    rlbus config show configs/quickstart.yaml trainer.lr=3e-6 rollout.n=8   # the same, from the command line

Unknown keys are errors; a bad value raises `ConfigError` naming the dotted field and the reason (msgspec's
validation error, split into the field's path and a reason that lists a Literal field's choices).
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any, Literal, Union

import msgspec
import yaml

from rlbus.schemas.config import REDACTED, SECRET_FIELDS, RunConfig
from rlbus.schemas.errors import ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    """`trainer.lr=3e-6` -> (["trainer", "lr"], 3e-06). The value is parsed as YAML (so `[a, b]`, `true` work)."""
    if "=" not in text:
        raise ConfigError(text, "an override must look like section.field=value")
    path, _, raw = text.partition("=")
    keys = path.strip().split(".")
    if not all(keys):
        raise ConfigError(path, "empty key in override path")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # PyYAML: ValueError for a date like 2001-13-45
        raise ConfigError(path, f"cannot parse value {raw!r}: {e}") from None
    return keys, value


def apply_override(data: dict, keys: list[str], value: Any) -> None:
    node = data
    for i, k in enumerate(keys[:-1]):
        child = node.get(k)
        if child is None:
            child = node[k] = {}
        elif not isinstance(child, dict):
            raise ConfigError(".".join(keys[: i + 1]), f"is a value ({child!r}), not a section")
        node = child
    node[keys[-1]] = value


def _field_path(err: msgspec.ValidationError) -> tuple[str, str]:
    """Split msgspec's `reason - at `$.a.b`` into ("a.b.<field from reason>", reason)."""
    text = str(err)
    reason, sep, where = text.rpartition(" - at `")
    path = where.rstrip("`").removeprefix("$").lstrip(".") if sep else ""
    if not sep:
        reason = text
    path = path.replace("[", ".").replace("]", "")
    if reason.startswith("Object contains unknown field `"):
        name = reason.split("`")[1]
        return ".".join(p for p in (path, name) if p), "unknown key"
    if reason.startswith("Object missing required field `"):
        name = reason.split("`")[1]
        return ".".join(p for p in (path, name) if p), "is required"
    head, colon, tail = reason.partition(": ")
    if colon and " " not in head:  # our __post_init__ messages: "field: reason"
        return ".".join(p for p in (path, head) if p), tail
    choices = _choices(path)
    if choices:
        reason = f"{reason}; choose from {', '.join(choices)}"
    return path, reason


def _choices(path: str) -> list[str]:
    """The allowed values of a Literal field (or the tags of a tagged union) at a dotted path, else []."""
    typ: Any = RunConfig
    for name in path.split(".") if path else []:
        if name == "type" and _union_tags(typ):
            return _union_tags(typ)
        hints = typing.get_type_hints(typ) if isinstance(typ, type) else {}
        if name not in hints:
            return []
        typ = hints[name]
    if typing.get_origin(typ) is Literal:
        return [str(a) for a in typing.get_args(typ)]
    return _union_tags(typ)


def _union_tags(typ: Any) -> list[str]:
    if typing.get_origin(typ) is Union:
        return [a.__struct_config__.tag for a in typing.get_args(typ) if hasattr(a, "__struct_config__")]
    return []


def _fill_engine_tag(data: dict) -> None:
    engine = data.get("rollout", {}).get("engine") if isinstance(data.get("rollout"), dict) else None
    if isinstance(engine, dict) and "type" not in engine:
        engine["type"] = "hf"


def _check_keys(data: dict) -> None:
    """Every key is a string (msgspec would name only the mapping holding a bad one, as "`key` in `$.a`")."""
    todo: list[tuple[tuple[str, ...], dict]] = [((), data)]
    while todo:
        path, node = todo.pop()
        for k, v in node.items():
            if not isinstance(k, str):
                raise ConfigError(".".join((*path, str(k))), f"a key must be a string, not {type(k).__name__} {k!r}")
            if isinstance(v, dict):
                todo.append(((*path, k), v))


def from_dict(data: dict) -> RunConfig:
    """Validate a plain mapping into a RunConfig, raising ConfigError naming the field."""
    _check_keys(data)
    _fill_engine_tag(data)
    try:
        return msgspec.convert(data, RunConfig, strict=False)
    except msgspec.ValidationError as e:
        field, reason = _field_path(e)
        raise ConfigError(field, reason) from None


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> RunConfig:
    """Load a YAML config file (or nothing) and apply `a.b.c=value` overrides in order."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError("", f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except OSError as e:
            raise ConfigError("", f"cannot read config file {str(p)!r}: {e}") from None
        except (yaml.YAMLError, ValueError, RecursionError) as e:  # ValueError: not UTF-8, or a date like 2001-13-45
            raise ConfigError("", f"{p}: invalid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError("", f"{p}: the top level must be a mapping of sections")
        data = loaded
    for text in overrides:
        keys, value = parse_override(text)
        apply_override(data, keys, value)
    return from_dict(data)


def to_dict(cfg: RunConfig) -> dict:
    return msgspec.to_builtins(cfg)


def to_yaml(cfg: RunConfig) -> str:
    """The config as YAML, secrets redacted (credentials belong in 0600 files: `bus.creds_file`)."""
    data = to_dict(cfg)
    for key in SECRET_FIELDS:
        section, name = key.split(".")
        if data[section][name]:
            data[section][name] = REDACTED
    return yaml.safe_dump(data, sort_keys=False)
