"""The quickstart tokenizer: exact round trips, one token per digit, single-id special tokens, the chat format the
agent loop relies on, and identical behaviour after save/load -- also when transformers picks Qwen2Tokenizer for a
`model_type: qwen2` directory.

    .venv/bin/python -m pytest -q tests/unit/test_tokenizer.py
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, Qwen2Config

from rlbus.common.model.demos import QUICKSTART_SYSTEM_PROMPT, demonstration_corpus
from rlbus.common.chat import encode_chat
from rlbus.common.model.tokenizer import SPECIAL_TOKENS, build_tokenizer, render_chat

TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call>'
CONVERSATION = [
    {"role": "system", "content": QUICKSTART_SYSTEM_PROMPT},
    {"role": "user", "content": "What is 17*23?"},
    {"role": "assistant", "content": TOOL_CALL},
    {"role": "tool", "content": "391"},
    {"role": "assistant", "content": "<answer>391</answer>"},
]
EXPECTED = (
    "<|im_start|>system\nSolve the arithmetic problem. You may call the calculator tool.<|im_end|>\n"
    "<|im_start|>user\nWhat is 17*23?<|im_end|>\n"
    f"<|im_start|>assistant\n{TOOL_CALL}<|im_end|>\n"
    "<|im_start|>user\n<tool_response>391</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<answer>391</answer><|im_end|>\n"
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_vocab_is_small_and_build_is_deterministic(tok):
    assert len(tok) < 512
    again = build_tokenizer()
    assert again.get_vocab() == tok.get_vocab()
    assert again.encode(EXPECTED, add_special_tokens=False) == tok.encode(EXPECTED, add_special_tokens=False)


@pytest.mark.parametrize(
    "text",
    [
        EXPECTED,
        "What is 45+38?",
        "  leading and trailing spaces \n\n\ttabs\r\nand CRLF  ",
        "~!@#$%^&*()_+`-={}[]|\\:;\"'<>,.?/ 0123456789",
        '<tool_call>{"name": "calculator", "arguments": {"expression": "(12 - 3) / 4.5"}}</tool_call><|im_end|>',
        "unicode: héllo wörld, 数学, emoji 🙂",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_every_demonstration_round_trips(tok):
    for text in demonstration_corpus(64, seed=7):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_digits_are_one_token_each(tok):
    for number in ["0", "7", "42", "391", "1234567890", "000", "9801"]:
        ids = tok.encode(f"x {number}+{number}=", add_special_tokens=False)
        digit_tokens = [t for t in tok.convert_ids_to_tokens(ids) if any(c.isdigit() for c in t)]
        assert digit_tokens == list(number) * 2, digit_tokens


def test_special_tokens_are_single_ids(tok):
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    for token, token_id in zip(SPECIAL_TOKENS, ids):
        assert tok.encode(token, add_special_tokens=False) == [token_id]
        # ... also when glued to text on both sides
        assert token_id in tok.encode(f"ab{token}cd", add_special_tokens=False)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id != tok.pad_token_id


def test_chat_template_is_exactly_the_format(tok):
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == EXPECTED
    assert render_chat(CONVERSATION) == EXPECTED
    prompt = tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == EXPECTED.split(f"<|im_start|>assistant\n{TOOL_CALL}")[0] + "<|im_start|>assistant\n"
    assert render_chat(CONVERSATION[:2], add_generation_prompt=True) == prompt


def test_encode_chat_matches_pieces(tok):
    ids = encode_chat(tok, CONVERSATION)
    assert ids == tok.encode(EXPECTED, add_special_tokens=False)
    # Chat markers split the text, so a turn-by-turn encoding (how the agent loop grows a sequence) is identical.
    pieces = EXPECTED.split("<|im_start|>")[1:]
    by_turn = [i for p in pieces for i in tok.encode("<|im_start|>" + p, add_special_tokens=False)]
    assert by_turn == ids


@pytest.mark.parametrize("with_qwen2_config", [False, True])
def test_save_and_load_with_auto_tokenizer(tok, tmp_path, with_qwen2_config):
    tok.save_pretrained(tmp_path)
    if with_qwen2_config:  # a model directory: transformers 5 then loads Qwen2Tokenizer, rebuilding the pipeline
        Qwen2Config(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    texts = [EXPECTED, *demonstration_corpus(16, seed=3), "What is 99*99? spaces  and\ttabs"]
    for text in texts:
        assert loaded.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
        assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text
    assert loaded.apply_chat_template(CONVERSATION, tokenize=False) == EXPECTED
    assert (loaded.eos_token_id, loaded.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert loaded.padding_side == "left"
    assert len(loaded) == len(tok)
