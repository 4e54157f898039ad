"""Prompt data sets: JSONL, Parquet (verl's layout accepted) and the seeded synthetic arithmetic set.

`load_dataset(cfg.data)` returns a `PromptDataset`, a sized, indexable sequence of `Example`s; the feeder turns
one into a wire `PromptTask` with `example_to_task`. verl's parquet layout is read as is:

    prompt:       list<struct<role, content>>   (a plain string is also accepted: it becomes one user message)
    reward_model: struct<ground_truth, style>   (data.answer_key is a dotted path, default reward_model.ground_truth)
    data_source:  string                        extra_info: struct / map (kept as JSON scalars)

A malformed row raises `DataError` naming the file and the row. `data.system_prompt` is prepended to prompts that
have no system message.

    .venv/bin/python -m pytest -q tests/unit/test_data.py
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any, Iterator, Sequence

import msgspec

from rlbus.common.chat import prompt_token_ids
from rlbus.schemas.config import DataConfig
from rlbus.schemas.errors import RlbusError
from rlbus.schemas.wire import ChatMessage, JsonScalar, PromptTask

log = logging.getLogger(__name__)

_ROLES = ("system", "user", "assistant", "tool")


class DataError(RlbusError):
    """A prompt file is missing, unreadable, or has a malformed row."""

    def __init__(self, source: str, row: int | None, reason: str):
        self.source = source
        self.row = row
        self.reason = reason
        where = f"{source}, row {row}" if row is not None else source
        super().__init__(f"{where}: {reason}")


class Example(msgspec.Struct, kw_only=True):
    """One prompt of a data set, before it is released as a PromptTask."""

    prompt: list[ChatMessage]
    ground_truth: str
    data_source: str = ""
    extra_info: dict[str, JsonScalar] = {}
    index: int = 0  # position in the data set (after filtering)


class PromptDataset(Sequence[Example]):
    """A sized, indexable, immutable list of examples with the name of where they came from."""

    def __init__(self, examples: list[Example], name: str):
        self._examples = examples
        self.name = name

    def __len__(self) -> int:
        return len(self._examples)

    def __getitem__(self, i: int) -> Example:  # type: ignore[override] - slices are not needed
        return self._examples[i]

    def __iter__(self) -> Iterator[Example]:
        return iter(self._examples)

    def __repr__(self) -> str:
        return f"PromptDataset({self.name!r}, {len(self)} examples)"


# ---------------------------------------------------------------------------------------------------------------
# rows -> examples


def _get_path(row: dict, dotted: str) -> Any:
    node: Any = row
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            raise KeyError(dotted)
        node = node[key]
    return node


def _scalar(value: Any) -> JsonScalar:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    # Nested values (verl's tools_kwargs, lists) travel as JSON text: the wire keeps extra_info flat and typed.
    return json.dumps(value, sort_keys=True, default=str)


def _messages(raw: Any, source: str, row: int) -> list[ChatMessage]:
    if isinstance(raw, str):
        return [ChatMessage(role="user", content=raw)]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise DataError(source, row,
                        f"prompt must be a string or a non-empty list of messages, got {type(raw).__name__}")
    out = []
    for j, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(source, row, f"prompt message {j} must be {{'role': str, 'content': str}}, got {m!r:.80}")
        if m["role"] not in _ROLES:
            raise DataError(source, row, f"prompt message {j} has role {m['role']!r}; expected one of {_ROLES}")
        out.append(ChatMessage(role=m["role"], content=m["content"]))
    return out


def row_to_example(row: Any, cfg: DataConfig, source: str, row_num: int) -> Example:
    """One raw row (dict) to an Example, raising DataError(source, row_num, ...) when it is malformed."""
    if not isinstance(row, dict):
        raise DataError(source, row_num, f"expected an object, got {type(row).__name__}")
    if cfg.prompt_key not in row:
        raise DataError(source, row_num, f"no {cfg.prompt_key!r} column (data.prompt_key)")
    prompt = _messages(row[cfg.prompt_key], source, row_num)
    if cfg.system_prompt and not any(m.role == "system" for m in prompt):
        prompt.insert(0, ChatMessage(role="system", content=cfg.system_prompt))
    try:
        truth = _get_path(row, cfg.answer_key)
    except KeyError:
        raise DataError(source, row_num, f"no ground truth at {cfg.answer_key!r} (data.answer_key)") from None
    if truth is None or isinstance(truth, (dict, list)):
        raise DataError(source, row_num,
                        f"ground truth at {cfg.answer_key!r} must be a string or number, got {truth!r:.80}")
    extra = row.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise DataError(source, row_num, f"extra_info must be an object, got {type(extra).__name__}")
    return Example(
        prompt=prompt,
        ground_truth=str(truth),
        data_source=str(row.get("data_source") or Path(source).stem),
        extra_info={str(k): _scalar(v) for k, v in extra.items()},
    )


# ---------------------------------------------------------------------------------------------------------------
# readers


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open("r", encoding="utf-8") as f:
        for num, line in enumerate(f, start=1):  # row = line number, as an editor shows it
            if not line.strip():
                continue
            try:
                yield num, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(str(path), num, f"invalid JSON: {e.msg} at column {e.colno}") from None


def _read_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several unrelated types for a corrupt file; all mean "unreadable"
        raise DataError(str(path), None, f"cannot read as Parquet: {e}") from e
    for num, row in enumerate(table.to_pylist()):  # row = 0-based index, as pandas shows it
        yield num, row


def _synthetic(cfg: DataConfig, *, exclude: frozenset[str] = frozenset()) -> list[Example]:
    from rlbus.common.model.demos import QUICKSTART_SYSTEM_PROMPT, arithmetic_problem, few_shot_messages

    rng = random.Random(cfg.seed)
    system = cfg.system_prompt or QUICKSTART_SYSTEM_PROMPT
    shots = [ChatMessage(role=m["role"], content=m["content"]) for m in few_shot_messages(cfg.few_shot)]
    out: list[Example] = []
    # Bounded: two-digit problems are finite (2 x 90 x 90), so an exclusion set could otherwise starve the loop.
    for i in range(50 * cfg.num_examples):
        if len(out) == cfg.num_examples:
            break
        question, answer = arithmetic_problem(rng)
        if question in exclude:
            continue
        out.append(
            Example(
                prompt=[ChatMessage(role="system", content=system), *shots,
                        ChatMessage(role="user", content=question)],
                ground_truth=str(answer),
                data_source="synthetic_arithmetic",
                extra_info={"seed": cfg.seed, "index": i},
            )
        )
    return out


#: The held-out synthetic set's seed is the training set's plus this.
HELDOUT_SEED_OFFSET = 1000


def load_heldout(cfg: DataConfig, num_examples: int, tokenizer: Any = None) -> PromptDataset:
    """The evaluation prompts: for synthetic data, `num_examples` problems of another seed, none of whose questions
    is in the training set; for a file, its last `num_examples` rows (hold them out of training yourself)."""
    if cfg.type != "synthetic":
        full = load_dataset(cfg, tokenizer)
        examples = list(full)[-num_examples:]
        return PromptDataset(examples, f"{full.name}[-{len(examples)}:]")
    train = {ex.prompt[-1].content for ex in _synthetic(cfg)}
    held_cfg = msgspec.structs.replace(cfg, seed=cfg.seed + HELDOUT_SEED_OFFSET, num_examples=num_examples)
    examples = _synthetic(held_cfg, exclude=frozenset(train))
    if tokenizer is not None:
        examples = drop_long(examples, cfg.max_prompt_tokens, tokenizer, "held-out")
    for i, ex in enumerate(examples):
        ex.index = i
    return PromptDataset(examples, f"synthetic held-out(seed={held_cfg.seed}, n={len(examples)})")


def load_dataset(cfg: DataConfig, tokenizer: Any = None) -> PromptDataset:
    """Load the configured prompt set. With a tokenizer, prompts longer than data.max_prompt_tokens are skipped."""
    if cfg.type == "synthetic":
        examples, name = _synthetic(cfg), f"synthetic(seed={cfg.seed}, n={cfg.num_examples})"
    else:
        path = Path(cfg.path)
        if not path.is_file():
            raise DataError(str(path), None, f"data.path does not exist (data.type={cfg.type})")
        rows = _read_jsonl(path) if cfg.type == "jsonl" else _read_parquet(path)
        examples, name = [row_to_example(row, cfg, str(path), num) for num, row in rows], str(path)
        if not examples:
            raise DataError(str(path), None, "holds no rows")
    if tokenizer is not None:
        examples = drop_long(examples, cfg.max_prompt_tokens, tokenizer, name)
    for i, ex in enumerate(examples):
        ex.index = i
    return PromptDataset(examples, name)


def drop_long(examples: list[Example], max_tokens: int, tokenizer: Any, name: str) -> list[Example]:
    kept = [ex for ex in examples if len(prompt_token_ids(tokenizer, ex.prompt)) <= max_tokens]
    if len(kept) < len(examples):
        log.warning("%s: skipped %d of %d prompts longer than data.max_prompt_tokens=%d",
                    name, len(examples) - len(kept), len(examples), max_tokens)
    if not kept:
        raise DataError(name, None, f"every prompt is longer than data.max_prompt_tokens={max_tokens}")
    return kept


def example_to_task(
    example: Example, *, task_id: str, n: int, epoch: int = 0, attempt: int = 0, released_version: int = 0
) -> PromptTask:
    """The wire task the feeder publishes for one release of an example."""
    return PromptTask(
        task_id=task_id,
        prompt=list(example.prompt),
        ground_truth=example.ground_truth,
        data_source=example.data_source,
        extra_info=dict(example.extra_info),
        n=n,
        index=example.index,
        epoch=epoch,
        attempt=attempt,
        released_version=released_version,
    )
