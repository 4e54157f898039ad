"""Hostile input gets a typed error: wire decoders raise only SchemaError, the config loader only ConfigError.

Wire: random bytes, truncated and byte-mutated encodings of real messages, real messages with a field replaced by a
random value, and valid msgpack of the wrong shape, through `TypedDecoder` for every wire type and the `Event`
union. Config: `load_config` with random `a.b=value` overrides over real keys, and random YAML documents (and bytes)
in a file. Each input found to raise anything else is kept as an `@example`.

    .venv/bin/python -m pytest -q tests/unit/test_fuzz.py
    RLBUS_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest -q tests/unit/test_fuzz.py     # a longer hunt
"""

from __future__ import annotations

import os
import tempfile
import typing
from pathlib import Path
from typing import Any, Union

import msgspec
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rlbus.schemas import wire
from rlbus.schemas.config import RunConfig
from rlbus.schemas.config_io import load_config
from rlbus.schemas.errors import ConfigError, SchemaError
from tests.unit.test_wire import ALL

FUZZ = settings(
    max_examples=int(os.environ.get("RLBUS_FUZZ_EXAMPLES", "250")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# ---------------------------------------------------------------------------------------------------------------
# wire decoders

WIRE_TYPES: list[Any] = [
    wire.PromptTask, wire.SampleMeta, wire.TrajectoryGroup, wire.WeightsPublished, wire.StepCompleted,
    wire.ProducerHeartbeat, wire.RoleStarted, wire.RoleStopped, wire.ErrorRaised, wire.DeadLetter, wire.ChatMessage,
]  # fmt: skip
TARGETS: dict[str, Any] = {t.__name__: t for t in WIRE_TYPES} | {"Event": wire.Event}
DECODERS = {name: wire.TypedDecoder(t) for name, t in TARGETS.items()}
#: real messages of every type (test_wire's), plus a sample and a chat message on their own
EXAMPLES = [*ALL, ALL[1].samples[0], ALL[0].prompt[0]]
ENCODED = [wire.encode(m) for m in EXAMPLES]


def check_decode(name: str, data: bytes) -> None:
    """Decoding returns a value of the target type or raises SchemaError; nothing else."""
    try:
        out = DECODERS[name].decode(data)
    except SchemaError:
        return
    target = TARGETS[name]
    allowed = typing.get_args(target) if typing.get_origin(target) is Union else (target,)
    assert isinstance(out, allowed), (name, type(out))


decoder_names = st.sampled_from(sorted(DECODERS))

#: any value msgpack can carry (ints within msgpack's range, ext types included)
msgpack_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=12),
    st.binary(max_size=12), st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=8)),
    st.sampled_from([k for m in EXAMPLES if isinstance(m, wire.Wire) for k in [type(m).__struct_config__.tag]]),
)  # fmt: skip
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | st.integers(-3, 3), inner, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(name=decoder_names, data=st.binary(max_size=256))
def test_random_bytes_decode_or_raise_schema_error(name: str, data: bytes) -> None:
    check_decode(name, data)


@FUZZ
@given(name=decoder_names, msg=st.sampled_from(ENCODED), data=st.data())
def test_truncated_and_mutated_messages_decode_or_raise_schema_error(name: str, msg: bytes, data) -> None:
    cut = data.draw(st.integers(0, len(msg)), label="cut")
    check_decode(name, msg[:cut])
    mutated = bytearray(msg)
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        mutated[data.draw(st.integers(0, len(msg) - 1))] = data.draw(st.integers(0, 255))
    check_decode(name, bytes(mutated))
    at = data.draw(st.integers(0, len(msg)), label="insert at")
    check_decode(name, msg[:at] + data.draw(st.binary(min_size=1, max_size=8)) + msg[at:])


@FUZZ
@given(name=decoder_names, value=msgpack_values)
def test_valid_msgpack_of_any_shape_decodes_or_raises_schema_error(name: str, value: Any) -> None:
    check_decode(name, msgspec.msgpack.encode(value))


@FUZZ
@given(name=decoder_names, msg=st.sampled_from(EXAMPLES), data=st.data())
def test_real_messages_with_a_field_replaced_decode_or_raise_schema_error(name: str, msg: Any, data) -> None:
    """The nearest misses: a real message whose one field (or one nested field) holds a random value, or is gone."""
    obj = msgspec.to_builtins(msg)
    node = obj
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans(), label="descend"):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        child = node[data.draw(st.sampled_from(keys), label="into")]
        if not isinstance(child, (dict, list)) or not child:
            break
        node = child
    if isinstance(node, (dict, list)) and node:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        key = data.draw(st.sampled_from(keys), label="field")
        if data.draw(st.booleans(), label="drop"):
            del node[key]
        else:
            node[key] = data.draw(msgpack_values, label="value")
    check_decode(name, msgspec.msgpack.encode(obj))


# ---------------------------------------------------------------------------------------------------------------
# config loader


def _struct_types(hint: Any) -> list[type]:
    args = typing.get_args(hint) if typing.get_origin(hint) is Union else (hint,)
    return [a for a in args if isinstance(a, type) and issubclass(a, msgspec.Struct)]


def _keys(typ: type, prefix: str = "") -> list[str]:
    out = []
    for name, hint in typing.get_type_hints(typ).items():
        key = f"{prefix}{name}"
        out.append(key)
        structs = _struct_types(hint)
        if len(structs) > 1:  # a tagged union: its tag and every member's fields
            out.append(f"{key}.type")
        for s in structs:
            out.extend(_keys(s, f"{key}."))
    return sorted(set(out))


REAL_KEYS = _keys(RunConfig)
SECTIONS = sorted({k.split(".")[0] for k in REAL_KEYS})
FIELD_NAMES = sorted({k.rsplit(".", 1)[-1] for k in REAL_KEYS})
#: YAML that is tricky to parse or to convert: bad timestamps, special floats, tags, anchors, broken syntax
YAML_SNIPPETS = [
    "", "~", "null", "true", "no", "0", "-1", "007", "0x1F", "0o17", "1_000", "3e-6", "1e999", "-.inf", ".nan",
    "2001-01-01", "2001-13-45", "2001-02-30 25:61:61", "12:30:00", "[a, b]", "[1, [2]]", "{}", "{type: vllm}",
    "{a: {b: c}}", "!!binary AAAA", "!!binary ~~~", "!!int abc", "!!float x", "!!timestamp 2001-99-99", "!!set {a}",
    "!!python/object/apply:os.system [echo]", "&a [*a]", "*x", "'", '"', "[", "{", "}", ": ", "- a", "? a", "|", ">",
    "%YAML 1.1", "\t", "\x00", "a: b: c", "[" * 600 + "]" * 600, "calculator", "hf", "vllm", "simulated", "/m",
]  # fmt: skip
yaml_values = st.one_of(
    st.sampled_from(YAML_SNIPPETS), st.text(max_size=16), st.integers().map(str), st.floats().map(repr),
    st.lists(st.sampled_from(YAML_SNIPPETS[:40]), max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"),
)  # fmt: skip
override_keys = st.one_of(
    st.sampled_from(REAL_KEYS),
    st.tuples(st.sampled_from(REAL_KEYS), st.sampled_from([".x", ".0", ".type", ".path"])).map("".join),
)
BASE = "model: {path: /m}\n"


@pytest.fixture(scope="module")
def cfg_file() -> Path:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d) / "c.yaml"


def check_load(path: Path | None, overrides: list[str]) -> ConfigError | None:
    """Loading returns a RunConfig or raises ConfigError with a dotted field (maybe ""); nothing else."""
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        # A dotted path of the document's own keys, not msgspec's "`key` in `$.a`" (a key may itself hold a "`").
        assert isinstance(e.field, str) and "`$" not in e.field and "` in `" not in e.field, repr(e.field)
        return e
    assert isinstance(cfg, RunConfig)
    return None


@FUZZ
@given(key=override_keys, value=yaml_values, base=st.booleans())
@example(key="trainer.lr", value="2001-13-45", base=True)  # was ValueError from PyYAML's timestamp constructor
@example(key="trainer.lr", value="[" * 600 + "]" * 600, base=True)  # was RecursionError from PyYAML
def test_one_override_loads_or_names_its_section(cfg_file: Path, key: str, value: str, base: bool) -> None:
    cfg_file.write_text(BASE if base else "")
    err = check_load(cfg_file, [f"{key}={value}"])
    if err is not None and base:  # over a valid file, what one override breaks lies in that override's section
        assert err.field.split(".")[0] == key.split(".")[0], (err.field, str(err))


@FUZZ
@given(overrides=st.lists(st.tuples(override_keys, yaml_values).map("=".join), max_size=4))
def test_several_overrides_load_or_raise_config_error(cfg_file: Path, overrides: list[str]) -> None:
    cfg_file.write_text(BASE)
    check_load(cfg_file, overrides)
    check_load(None, overrides)


yaml_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10), st.binary(max_size=6),
    st.dates(), st.sampled_from(["hf", "vllm", "simulated", "cpu", "/m", "grpo", "token-mean", "full"]),
)  # fmt: skip
yaml_trees = st.recursive(
    yaml_scalars,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=6) | st.integers(-2, 2) | st.none(), inner,
                      max_size=4),
    max_leaves=10,
)  # fmt: skip
yaml_documents = st.dictionaries(st.sampled_from([*SECTIONS, "bogus"]), yaml_trees, max_size=5)


@FUZZ
@given(doc=yaml_documents, with_model=st.booleans())
@example(doc={"trainer": {1: 2}}, with_model=True)  # was a ConfigError whose field read 'key` in `$.trainer'
@example(doc={"algorithm": {"`": {0: None}}}, with_model=False)  # a key "`" is the user's, named as it is
def test_random_yaml_documents_load_or_raise_config_error(cfg_file: Path, doc: dict, with_model: bool) -> None:
    if with_model:
        doc = {"model": {"path": "/m"}, **doc}
    cfg_file.write_text(yaml.safe_dump(doc))
    check_load(cfg_file, [])


@FUZZ
@given(text=st.text(alphabet=st.sampled_from(list("ab1 :-[]{},'\"!&*?|>#%@`~.\n\t")), max_size=80))
@example(text="model: {path: /m}\nname: 2001-13-45")  # was ValueError from PyYAML's timestamp constructor
@example(text="[" * 2000)  # was RecursionError from PyYAML
def test_random_yaml_text_loads_or_raises_config_error(cfg_file: Path, text: str) -> None:
    cfg_file.write_text(text)
    check_load(cfg_file, [])
    cfg_file.write_text(BASE + text)
    check_load(cfg_file, [])


@FUZZ
@given(data=st.binary(max_size=64))
@example(data=b"\xff\xfemodel: {}")  # was UnicodeDecodeError reading the file
def test_random_bytes_as_config_file_load_or_raise_config_error(cfg_file: Path, data: bytes) -> None:
    cfg_file.write_bytes(data)
    check_load(cfg_file, [])
