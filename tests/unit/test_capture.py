"""Token-exact capture of OpenAI-style calls (producers/capture.py), on the real quickstart tokenizer.

The engine's generations are written by hand here, so that a reply can be sampled as ids that are *not* what the
tokenizer would make of its text: the one way to tell reused ids from re-tokenized text.
"""

from __future__ import annotations

import json

import pytest

from rlbus.common.model.demos import prompt_messages
from rlbus.common.model.tokenizer import build_tokenizer
from rlbus.producers.capture import Conversation, RequestError, make_reply, parse_messages, parse_tools
from rlbus.producers.engines.base import Generation

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def spelled_out(tok, text: str) -> list[int]:
    """Ids of `text` one character at a time: the same text as tok.encode(text), other ids."""
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]


def sample(
    conv: Conversation, tok, messages: list[dict], ids: list[int], *, stop: bool = True, version: int = 0, tools=TOOLS
) -> tuple:
    """One call: prepare its prompt, "sample" `ids` (+ eos when `stop`), record; returns (prompt ids, reply)."""
    prepared = conv.prepare(parse_messages(messages), tools)
    token_ids = ids + ([tok.eos_token_id] if stop else [])
    gen = Generation(
        token_ids=token_ids,
        log_probs=[-0.25] * len(token_ids),
        version=version,
        finish_reason="stop" if stop else "length",
    )
    reply = make_reply(tok.decode(ids, skip_special_tokens=False), stop, tools_allowed=True, call_id="call_x")
    conv.record(prepared, gen, reply, 0.01, tok.eos_token_id)
    return prepared.prompt_ids, reply


def echoed(reply) -> dict:
    """The assistant message as a framework sends it back: arguments re-serialised, content null."""
    calls = [
        {
            "id": c["id"],
            "type": "function",
            "function": {
                "name": c["function"]["name"],
                "arguments": json.dumps(json.loads(c["function"]["arguments"]), indent=1),
            },
        }
        for c in reply.tool_calls
    ]
    return {"role": "assistant", "content": reply.content, "tool_calls": calls or None}


def test_a_later_call_reuses_the_sampled_ids_not_the_text(tok):
    conv = Conversation(tok, max_response_tokens=400)
    first = prompt_messages("What is 17*23?")
    sampled = spelled_out(tok, CALL)
    assert sampled != tok.encode(CALL, add_special_tokens=False)  # the point: a non-canonical sampling
    prompt1, reply = sample(conv, tok, first, sampled, version=3)
    assert reply.finish_reason == "tool_calls" and reply.content is None
    assert json.loads(reply.tool_calls[0]["function"]["arguments"]) == {"expression": "17*23"}

    second = first + [echoed(reply), {"role": "tool", "tool_call_id": "call_x_0", "content": "391"}]
    prompt2, _ = sample(conv, tok, second, tok.encode("<answer>391</answer>", add_special_tokens=False), version=4)
    assert prompt2[: len(prompt1) + len(sampled) + 1] == prompt1 + sampled + [tok.eos_token_id]
    inserted = prompt2[len(prompt1) + len(sampled) + 1 :]
    assert (
        tok.decode(inserted) == "\n<|im_start|>user\n<tool_response>391</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )

    [traj] = conv.trajectories()  # the first reply was continued: one sequence
    assert traj.prompt_ids == prompt1
    assert traj.prompt_ids + traj.response_ids == prompt2 + tok.encode(
        "<answer>391</answer>", add_special_tokens=False
    ) + [tok.eos_token_id]
    n1, n2 = len(sampled) + 1, len(tok.encode("<answer>391</answer>", add_special_tokens=False)) + 1
    assert traj.response_mask == [1] * n1 + [0] * len(inserted) + [1] * n2
    assert traj.versions == [3] * n1 + [-1] * len(inserted) + [4] * n2
    assert traj.log_probs == [-0.25] * n1 + [0.0] * len(inserted) + [-0.25] * n2
    assert (traj.num_turns, traj.num_tool_calls, traj.finish_reason) == (2, 1, "stop")


def test_a_reply_cut_by_max_tokens_gets_its_eos_inserted_with_mask_0(tok):
    conv = Conversation(tok, max_response_tokens=400)
    first = prompt_messages("What is 5+5?")
    cut = tok.encode("Let me think", add_special_tokens=False)
    prompt1, reply = sample(conv, tok, first, cut, stop=False)
    assert reply.finish_reason == "length"
    prompt2, _ = sample(conv, tok, first + [echoed(reply), {"role": "user", "content": "go on"}], [5])
    assert prompt2[: len(prompt1) + len(cut)] == prompt1 + cut
    inserted = prompt2[len(prompt1) + len(cut) :]
    assert inserted[0] == tok.eos_token_id
    [traj] = conv.trajectories()
    assert traj.response_mask == [1] * len(cut) + [0] * len(inserted) + [1, 1]


def test_a_rewritten_history_starts_a_new_sequence_and_keeps_the_old_one(tok):
    conv = Conversation(tok, max_response_tokens=400)
    first = prompt_messages("What is 5+5?")
    _, reply = sample(conv, tok, first, tok.encode("<answer>10</answer>", add_special_tokens=False))
    edited = dict(echoed(reply), content="<answer>11</answer>")  # the agent changed what the model said
    sample(conv, tok, first + [edited, {"role": "user", "content": "sure?"}], [5])
    a, b = conv.trajectories()
    assert a.prompt_ids != b.prompt_ids and sum(a.response_mask) == len(a.response_ids)
    # The rewritten reply is context of the new sequence (mask 0, part of its prompt), never trained.
    assert tok.decode(b.prompt_ids).count("<answer>11</answer>") == 1 and b.response_mask == [1, 1]


def test_n_replies_branch_and_each_branch_is_a_sequence(tok):
    conv = Conversation(tok, max_response_tokens=400)
    first = prompt_messages("What is 2+2?")
    sample(conv, tok, first, tok.encode("<answer>4</answer>", add_special_tokens=False))
    _, r2 = sample(conv, tok, first, tok.encode("<answer>5</answer>", add_special_tokens=False))
    sample(conv, tok, first + [echoed(r2), {"role": "user", "content": "sure?"}], [5])
    trajs = conv.trajectories()
    assert len(trajs) == 2
    assert [t.num_turns for t in trajs] == [1, 2]


def test_completions_continue_by_text_and_by_ids(tok):
    conv = Conversation(tok, max_response_tokens=400)
    prepared = conv.prepare_completion("Q: 2+2?\nA:")
    gen = Generation(token_ids=spelled_out(tok, " 4"), log_probs=[-1.0, -1.0], version=0, finish_reason="length")
    reply = make_reply(" 4", False, tools_allowed=False, call_id="c")
    conv.record(prepared, gen, reply, 0.0, tok.eos_token_id, prompt_text="Q: 2+2?\nA:")
    again = conv.prepare_completion("Q: 2+2?\nA: 4\nQ: 3+3?")
    assert again.prompt_ids[: len(prepared.prompt_ids) + 2] == prepared.prompt_ids + gen.token_ids
    assert again.base.response_mask[:2] == [1, 1] and set(again.base.response_mask[2:]) == {0}


@pytest.mark.parametrize(
    "tools,choice,param",
    [
        ({"type": "function"}, None, "tools"),
        ([{"type": "function", "function": {"description": "no name"}}], None, "tools[0]"),
        ([{"type": "code_interpreter"}], None, "tools[0]"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools[0].function.parameters"),
        (TOOLS, {"type": "function", "function": {"name": "other"}}, "tool_choice"),
        (None, "required", "tool_choice"),
    ],
)
def test_malformed_tools_are_refused_naming_the_field(tools, choice, param):
    with pytest.raises(RequestError) as err:
        parse_tools(tools, choice)
    assert (err.value.status, err.value.param) == (400, param)


def test_malformed_messages_are_refused_naming_the_field():
    for messages, param in [
        ([], "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0]"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
    ]:
        with pytest.raises(RequestError) as err:
            parse_messages(messages)
        assert (err.value.status, err.value.param) == (400, param)


def test_a_malformed_tool_call_in_a_reply_stays_text(tok):
    reply = make_reply(
        '<tool_call>{"name": "calculator", "arguments": </tool_call>', True, tools_allowed=True, call_id="c"
    )
    assert reply.tool_calls == [] and reply.finish_reason == "stop" and reply.content.startswith("<tool_call>")
    assert make_reply(CALL, True, tools_allowed=False, call_id="c").tool_calls == []  # tool_choice "none"


def test_a_forced_call_whose_arguments_do_not_parse_is_still_that_call(tok):
    """tool_choice "required" / a named function: the reply is a call of that function; its arguments are what the
    model wrote after the forced opening, valid JSON or not (OpenAI's contract: the agent validates them)."""
    conv = Conversation(tok, max_response_tokens=400)
    choice = parse_tools(TOOLS, {"type": "function", "function": {"name": "calculator"}})
    ids, opening = conv.opening_ids(choice)
    assert opening.startswith('<tool_call>{"name": "calculator", "arguments"') and ids == tok.encode(
        opening, add_special_tokens=False
    )
    bad = make_reply(
        opening + ' {"expression": " "6+90"}}</tool_call>',
        True,
        tools_allowed=True,
        call_id="c",
        forced=("calculator", opening),
    )
    assert bad.finish_reason == "tool_calls" and bad.content is None
    assert bad.tool_calls[0]["function"] == {"name": "calculator", "arguments": '{"expression": " "6+90"}'}
    good = make_reply(
        opening + ' {"expression": "6+90"}}</tool_call>',
        True,
        tools_allowed=True,
        call_id="c",
        forced=("calculator", opening),
    )
    assert json.loads(good.tool_calls[0]["function"]["arguments"]) == {"expression": "6+90"}
    assert not parse_tools(TOOLS, "none").allowed and not parse_tools(TOOLS, "auto").required
    assert parse_tools(TOOLS, "required").name == "calculator"  # one tool: its name is forced too
