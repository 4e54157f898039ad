"""Prompt data sets: JSONL, Parquet in verl's layout, the seeded synthetic set, and errors naming file and row."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlbus.common.data import DataError, example_to_task, load_dataset
from rlbus.common.model.demos import QUICKSTART_SYSTEM_PROMPT
from rlbus.schemas.config import DataConfig
from rlbus.schemas.wire import ChatMessage, PromptTask, TypedDecoder, encode


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_string_and_message_prompts(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "train.jsonl", [
        {"prompt": "What is 2+2?", "answer": 4},
        {"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "3*3?"}],
         "answer": "9", "data_source": "mine", "extra_info": {"split": "train", "tags": ["a", "b"]}},
    ])
    ds = load_dataset(DataConfig(type="jsonl", path=str(path), answer_key="answer", system_prompt="SYS"))
    assert len(ds) == 2
    first, second = ds[0], ds[1]
    # A plain string becomes a user message; the system prompt goes first where none is given.
    assert first.prompt == [ChatMessage(role="system", content="SYS"), ChatMessage(role="user", content="What is 2+2?")]
    assert first.ground_truth == "4" and first.data_source == "train" and first.index == 0
    assert [m.role for m in second.prompt] == ["system", "user"] and second.prompt[0].content == "Be terse."
    assert second.data_source == "mine" and second.index == 1
    assert second.extra_info == {"split": "train", "tags": '["a", "b"]'}  # nested values travel as JSON text


def test_parquet_in_verl_layout(tmp_path: Path) -> None:
    path = tmp_path / "gsm8k_train.parquet"
    table = pa.table({
        "data_source": ["openai/gsm8k", "openai/gsm8k"],
        "prompt": [[{"role": "user", "content": "Natalia sold 48 clips... #### at the end"}],
                   [{"role": "user", "content": "Weng earns $12 an hour..."}]],
        "ability": ["math", "math"],
        "reward_model": [{"ground_truth": "72", "style": "rule"}, {"ground_truth": "10", "style": "rule"}],
        "extra_info": [{"split": "train", "index": 0, "answer": "48/2 = 24 ... #### 72"},
                       {"split": "train", "index": 1, "answer": "12/60 ... #### 10"}],
    })
    pq.write_table(table, path)
    ds = load_dataset(DataConfig(type="parquet", path=str(path)))
    assert len(ds) == 2
    assert ds[1].prompt == [ChatMessage(role="user", content="Weng earns $12 an hour...")]
    assert ds[1].ground_truth == "10" and ds[0].ground_truth == "72"
    assert ds[0].data_source == "openai/gsm8k"
    assert ds[1].extra_info == {"split": "train", "index": 1, "answer": "12/60 ... #### 10"}


def test_synthetic_is_deterministic_per_seed() -> None:
    a = load_dataset(DataConfig(type="synthetic", num_examples=50, seed=7))
    b = load_dataset(DataConfig(type="synthetic", num_examples=50, seed=7))
    c = load_dataset(DataConfig(type="synthetic", num_examples=50, seed=8))
    assert len(a) == 50
    assert list(a) == list(b)
    assert [e.prompt for e in a] != [e.prompt for e in c]
    ex = a[3]
    assert ex.prompt[0] == ChatMessage(role="system", content=QUICKSTART_SYSTEM_PROMPT)
    question = ex.prompt[1].content
    assert question.startswith("What is ") and ex.index == 3
    x, op, y = question.removeprefix("What is ").removesuffix("?").partition("*" if "*" in question else "+")
    assert int(ex.ground_truth) == (int(x) * int(y) if op == "*" else int(x) + int(y))


def test_example_to_task_round_trips_on_the_wire() -> None:
    ex = load_dataset(DataConfig(type="synthetic", num_examples=4, seed=0))[2]
    task = example_to_task(ex, task_id="e1-i2-a0", n=4, epoch=1, attempt=0, released_version=3)
    assert (task.task_id, task.n, task.index, task.epoch, task.released_version) == ("e1-i2-a0", 4, 2, 1, 3)
    assert task.prompt == ex.prompt and task.ground_truth == ex.ground_truth
    decoded = TypedDecoder(PromptTask).decode(encode(task))
    assert decoded.prompt == task.prompt and decoded.extra_info == task.extra_info


def test_long_prompts_are_skipped_with_a_tokenizer(tmp_path: Path) -> None:
    from rlbus.common.model.tokenizer import build_tokenizer

    tok = build_tokenizer(["What is 2+2? <answer>4</answer>"] * 4)
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "short", "a": 1}, {"prompt": "long " * 200, "a": 2}])
    ds = load_dataset(DataConfig(type="jsonl", path=str(path), answer_key="a", max_prompt_tokens=64), tokenizer=tok)
    assert [e.ground_truth for e in ds] == ["1"] and ds[0].index == 0


@pytest.mark.parametrize(
    ("rows", "row", "message"),
    [
        ([{"prompt": "ok", "answer": 1}, "{not json"], 2, "invalid JSON"),
        ([{"prompt": "ok", "answer": 1}, {"answer": 2}], 2, "no 'prompt' column"),
        ([{"prompt": "ok"}], 1, "no ground truth at 'answer'"),
        ([{"prompt": [], "answer": 1}], 1, "non-empty list"),
        ([{"prompt": [{"role": "user"}], "answer": 1}], 1, "prompt message 0"),
        ([{"prompt": [{"role": "wizard", "content": "x"}], "answer": 1}], 1, "role 'wizard'"),
        ([{"prompt": "ok", "answer": None}], 1, "must be a string or number"),
        ([{"prompt": "ok", "answer": 1, "extra_info": [1]}], 1, "extra_info must be an object"),
        (["[1, 2]"], 1, "expected an object"),
    ],
)
def test_malformed_rows_name_file_and_row(tmp_path: Path, rows: list, row: int, message: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=message) as info:
        load_dataset(DataConfig(type="jsonl", path=str(path), answer_key="answer"))
    assert info.value.row == row and info.value.source == str(path)
    assert f"bad.jsonl, row {row}" in str(info.value)


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(DataConfig(type="jsonl", path=str(tmp_path / "nope.jsonl")))
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"this is not parquet")
    with pytest.raises(DataError, match="cannot read as Parquet"):
        load_dataset(DataConfig(type="parquet", path=str(junk)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="holds no rows"):
        load_dataset(DataConfig(type="jsonl", path=str(empty)))
