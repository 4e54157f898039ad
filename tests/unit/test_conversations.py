"""Conversations for supervised training (common/data/conversations.py): the assistant-token mask on real chat
templates, tool calls, truncation, files.

    .venv/bin/python -m pytest -q tests/unit/test_conversations.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rlbus.common.data.conversations import encode_conversation, load_conversations, template_messages
from rlbus.common.data.datasets import DataError
from rlbus.common.model.demos import demonstrations
from rlbus.common.model.warm_start import copy_drill, encode_demonstration

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "common/model/shipped/tiny-calculator"

#: ChatML with transformers' `{% generation %}` tags around what the assistant writes (its content and <|im_end|>):
#: the route TRL's assistant_only_loss takes, an independent account of the mask to compare with.
GENERATION_CHATML = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>' + message['content'] + '</tool_response><|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
)


@pytest.fixture(scope="module")
def tiny():
    return AutoTokenizer.from_pretrained(TINY)


def test_the_mask_is_the_rollouts_segmentation_of_the_quickstart_demonstrations(tiny) -> None:
    """The warm start lays its demonstrations out token for token as the agent loop builds a rollout; the generic
    route through the chat template must give the same ids and the same mask, tool turns and copy drills too."""
    rng = random.Random(1)
    convs = demonstrations(200, seed=3) + [copy_drill(rng) for _ in range(200)]
    for messages in convs:
        conv = encode_conversation(tiny, template_messages(messages))
        ids, mask = encode_demonstration(tiny, messages)
        assert (conv.ids, conv.mask) == (list(ids), list(mask))


def test_the_mask_equals_the_templates_generation_tags(tiny) -> None:
    """transformers' assistant mask from `{% generation %}` tags (what TRL's assistant_only_loss uses) agrees with
    the prefix diff on every token."""
    for messages in demonstrations(100, seed=5):
        m = template_messages(messages)
        conv = encode_conversation(tiny, m)
        out = tiny.apply_chat_template(m, chat_template=GENERATION_CHATML, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)  # fmt: skip
        n = len(conv.ids)  # the rendering goes on with the last turn's "\n", which predicts nothing trained
        assert list(out["input_ids"])[:n] == conv.ids
        assert list(out["assistant_masks"])[:n] == conv.mask
        assert sum(out["assistant_masks"]) == sum(conv.mask)


def test_smollm2_template_masks_each_assistant_turn_through_its_eos(smollm2_dir) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2_dir)  # imported from the smollm2 extra on first use
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."},
                {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6, of course."}]
    conv = encode_conversation(tok, messages)
    spans, cur = [], []
    for i, m in zip(conv.ids, conv.mask):
        if m:
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    spans += [cur] if cur else []
    assert [tok.decode(s) for s in spans] == ["It is 4.<|im_end|>", "6, of course.<|im_end|>"]
    # The template's default system prompt (no system message given) is context, never trained.
    trained = tok.decode([i for i, m in zip(conv.ids, conv.mask) if m])
    assert "SmolLM" in tok.decode(conv.ids) and "SmolLM" not in trained
    # Against the template's own text with generation tags (a system message first: SmolLM2 adds none then).
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    conv = encode_conversation(tok, with_system)
    out = tok.apply_chat_template(with_system, chat_template=GENERATION_CHATML, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)  # fmt: skip
    assert list(out["assistant_masks"])[: len(conv.ids)] == conv.mask


def test_openai_tool_calls_become_the_text_the_agent_loops_parser_reads(tiny) -> None:
    from rlbus.producers.agent_loops.tool_parser import parse_tool_calls

    raw = [{"role": "developer", "content": "Use tools."}, {"role": "user", "content": "What is 17*23?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "c1", "type": "function",
                "function": {"name": "calculator", "arguments": "{\"expression\": \"17*23\"}"}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "391"},
           {"role": "assistant", "content": "<answer>391</answer>"}]  # fmt: skip
    m = template_messages(raw)
    assert m[0]["role"] == "system"
    (call,) = parse_tool_calls(m[2]["content"])
    assert (call.name, call.arguments) == ("calculator", {"expression": "17*23"})
    conv = encode_conversation(tiny, m)
    trained = tiny.decode([i for i, k in zip(conv.ids, conv.mask) if k])
    assert trained == m[2]["content"] + "<|im_end|>" + "<answer>391</answer><|im_end|>"
    assert "391</tool_response>" in tiny.decode(conv.ids)  # the tool's output is context


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny) -> None:
    tok = AutoTokenizer.from_pretrained(TINY)
    # Drops every assistant turn but the last (as templates that strip past reasoning do).
    tok.chat_template = ("{%- for m in messages -%}{%- if m['role'] != 'assistant' or loop.last -%}"
                         "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
                         "{%- endfor -%}"
                         "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(ValueError, match="rewrites earlier turns"):
        encode_conversation(tok, messages)


def test_files_truncation_and_errors(tiny, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": d} for d in demonstrations(6, seed=2)]
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    a, b = load_conversations(jsonl, tiny), load_conversations(parquet, tiny)
    assert [c.ids for c in a] == [c.ids for c in b] and len(a) == 6
    # Cut to the first 20 tokens: the system prompt and question alone remain, nothing to train: skipped.
    first_answer = min(c.mask.index(1) for c in a)
    cut = load_conversations(jsonl, tiny, max_length=first_answer + 3)
    assert all(len(c.ids) <= first_answer + 3 and any(c.mask) for c in cut)
    with pytest.raises(DataError, match="no conversation to train on"):
        load_conversations(jsonl, tiny, max_length=first_answer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl, row 2: has no assistant message"):
        load_conversations(bad, tiny)
    with pytest.raises(DataError, match="needs a 'conversation' column"):
        load_conversations(jsonl, tiny, messages_key="conversation")
