"""A reply streamed while it is sampled (producers/streaming.py), on the real quickstart tokenizer (byte-level: a
character may take several tokens, and its first ones decode to U+FFFD).

What a streaming client relies on: the deltas it folds are the content the unstreamed call returns, whatever the
reply holds (tool calls, stop sequences, whitespace before a call, split characters) and however the engine
groups the tokens it reports; nothing that ends up outside the content is ever sent.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlbus.common.model.tokenizer import build_tokenizer
from rlbus.producers.capture import make_reply
from rlbus.producers.streaming import Chunks, ReplyStream, cut_at_stop

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call>'
PARTS = ["The answer", " is", " 391", ".", " ", "\n", "  ", "é", "中", "<tool", "_call>", CALL, "<answer>",
         "</answer>", "STOP", "ST", "OP", ",", " .", "<|im_end|>"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def unstreamed(tok, ids: list[int], stops: tuple[str, ...], tools: bool):
    """The reply the endpoint makes of a whole generation (producers/endpoint.py, Endpoint._sample)."""
    stopped = bool(ids) and ids[-1] == tok.eos_token_id
    body = ids[:-1] if stopped else ids
    decode = lambda xs: tok.decode(xs, skip_special_tokens=False)
    cut = cut_at_stop(decode, body, stops)
    if cut is None:
        return make_reply(decode(body), stopped, tools_allowed=tools, call_id="call_x")
    return make_reply(cut[1], True, tools_allowed=tools, call_id="call_x", captured=decode(body[: cut[0]]))


def streamed(tok, ids: list[int], sizes: list[int], stops: tuple[str, ...], tools: bool, *, logprobs: bool = True):
    """(every delta sent while sampling, the deltas after it, all entries sent) for `ids` reported in groups."""
    entry = (lambda t, lp: {"token": t, "logprob": lp}) if logprobs else None
    s = ReplyStream(lambda xs: tok.decode(xs, skip_special_tokens=False), entry, stops=stops, tools=tools,
                    forced=False, stop_token_id=tok.eos_token_id)
    live, entries, at = [], [], 0
    for size in sizes + [len(ids)]:
        group = ids[at : at + size]
        at += len(group)
        if not group:
            continue
        piece = s.push(group, [-float(i) for i in range(at - len(group), at)])
        if piece is not None:
            assert piece[0], "an empty delta"
            live.append(piece[0])
            entries += piece[1]
        if at == len(ids):
            break
    rest, left = s.rest(unstreamed(tok, ids, stops, tools))
    after = [] if rest is None else [rest[0]]
    entries += (rest[1] if rest else []) + left
    return live, after, entries


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    parts=st.lists(st.sampled_from(PARTS), max_size=12),
    spelled=st.booleans(),
    sizes=st.lists(st.integers(1, 4), max_size=40),
    stop=st.sampled_from([(), ("STOP",), ("</answer>", "\n\n")]),
    tools=st.booleans(),
    eos=st.booleans(),
)
def test_the_deltas_fold_into_the_unstreamed_content(tok, parts, spelled, sizes, stop, tools, eos):
    text = "".join(parts)
    ids = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)] if spelled else \
        tok.encode(text, add_special_tokens=False)
    ids += [tok.eos_token_id] if eos else []
    live, after, entries = streamed(tok, ids, sizes, stop, tools)
    reply = unstreamed(tok, ids, stop, tools)
    assert "".join(live + after) == (reply.content or "")
    assert [e["token"] for e in entries] == ids  # every token's entry, once, in order
    for delta in live:
        assert "\ufffd" not in delta or "\ufffd" in (reply.content or "")
    if reply.tool_calls:
        assert not any("<tool_call>" in d for d in live)


def test_text_goes_out_as_it_is_sampled_and_the_call_waits(tok):
    """Prose before a call is sent token by token, except its trailing whitespace and anything from the opening
    tag on; the call's own text is never content."""
    ids = tok.encode("Let me see.\n" + CALL, add_special_tokens=False) + [tok.eos_token_id]
    live, after, _ = streamed(tok, ids, [1] * len(ids), (), True)
    assert "".join(live) == "Let me see." and len(live) > 3 and after == []
    reply = unstreamed(tok, ids, (), True)
    assert reply.content == "Let me see." and reply.tool_calls[0]["function"]["name"] == "calculator"


def test_a_stop_sequence_is_never_sent(tok):
    ids = tok.encode("12 ST", add_special_tokens=False) + tok.encode("OP 34", add_special_tokens=False)
    live, after, _ = streamed(tok, ids, [1] * len(ids), ("STOP",), False)
    # " ST" waited (it began the stop sequence); the space before it went out once the reply was whole.
    assert "".join(live) == "12" and after == [" "]


def test_a_forced_call_sends_no_content(tok):
    s = ReplyStream(lambda xs: tok.decode(xs), None, stops=(), tools=True, forced=True, stop_token_id=2)
    assert s.push(tok.encode('{"expression": "1+1"}}', add_special_tokens=False), [0.0] * 9) is None


def test_chunks_carry_tool_calls_and_the_finish_reason(tok):
    reply = make_reply("ok " + CALL, True, tools_allowed=True, call_id="call_7")
    chunks = Chunks("7", "policy", chat=True)
    out = chunks.role(0) + chunks.end(0, reply, [{"token": "x", "logprob": -1.0}])
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    call = out[1]["choices"][0]["delta"]["tool_calls"][0]
    assert (call["id"], call["function"]["name"]) == ("call_7_0", "calculator")
    assert out[1]["choices"][0]["logprobs"] == {"content": [{"token": "x", "logprob": -1.0}]}
    assert out[2]["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] == '{"expression": "17*23"}'
    assert out[-1]["choices"][0]["finish_reason"] == "tool_calls" and out[-1]["object"] == "chat.completion.chunk"
    text = Chunks("8", "policy", chat=False)
    assert text.role(0) == [] and text.content(0, ("hi", []))["choices"][0]["text"] == "hi"
