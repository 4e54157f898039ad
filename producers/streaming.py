"""A reply streamed while it is sampled: which of its text can be sent now, and the OpenAI chunks that carry it.

The endpoint (producers/endpoint.py) hands each choice's tokens to a `ReplyStream` as the engine samples them
(`RolloutEngine.generate(..., on_tokens=...)`) and sends what `push` returns at once; when the call is done,
`finish` gives the rest of the reply from the same `Reply` an unstreamed call returns. What was sent is always the
start of that reply's content, so a client folding the deltas gets the unstreamed message exactly. Held back until
the text after it is known:

- a tool call: from `<tool_call>` on, and any tail that could begin one (calls go out whole, when the reply ends:
  their arguments are known only once the call parsed);
- a stop sequence: from its first occurrence on, and any tail that could begin one;
- trailing whitespace (dropped from the content when a tool call follows it; a tokenizer that cleans up spaces
  before punctuation decodes "a ." to "a.") and an incomplete UTF-8 character at the end (decoded as U+FFFD);
- everything, when the call forced a tool call (its content is none).

Each token's log-prob entry goes with the delta that first sends the token's text (the rest with the last delta).

    .venv/bin/python -m pytest -q tests/unit/test_streaming.py tests/integration/test_endpoint.py -k stream
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rlbus.common.chat import TOOL_CALL_START
from rlbus.producers.capture import Reply

#: One content delta: its text and the log-prob entries of the tokens it sends.
Piece = tuple[str, list[dict]]


def _partial(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `marker` (it may become the marker)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def cut_at_stop(decode: Callable[[list[int]], str], ids: list[int], stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(k, the text before the stop) for the fewest first k of `ids` whose text holds a stop sequence; None when
    their whole text holds none."""
    if not stops or not any(s in decode(ids) for s in stops):
        return None
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        found = [text.find(s) for s in stops if s in text]
        if found:
            return k, text[: min(found)]
    return None


class ReplyStream:
    """One choice of a call, as its tokens arrive."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        entry: Callable[[int, float], dict] | None,
        *,
        stops: tuple[str, ...],
        tools: bool,
        forced: bool,
        stop_token_id: int,
    ):
        self._decode, self._entry = decode, entry
        self._markers = (*stops, TOOL_CALL_START) if tools else stops
        self._forced, self._stop_token_id = forced, stop_token_id
        self.ids: list[int] = []
        self.sent = ""  # the content sent so far
        self._ends: list[int] = []  # per token: the length of the text up to and with it
        self._entries: list[dict] = []  # the log-prob entries not sent yet
        self._done = 0  # tokens whose entries were sent
        self.started = False  # whether this choice's first chunk (its role) went out

    def _sendable(self, text: str) -> str:
        cut = len(text)
        for marker in self._markers:
            at = text.find(marker)
            cut = min(cut, at if at >= 0 else len(text) - _partial(text, marker))
        end = cut
        while end and (text[end - 1].isspace() or text[end - 1] == "\ufffd"):
            end -= 1
        return text[:end]

    def push(self, ids: list[int], log_probs: list[float]) -> Piece | None:
        """Take newly sampled tokens; the content that can be sent now (None: nothing yet)."""
        self.ids += ids
        if self._entry is not None:
            self._entries += [self._entry(t, lp) for t, lp in zip(ids, log_probs)]
        if self._forced:
            return None
        body = self.ids[:-1] if self.ids and self.ids[-1] == self._stop_token_id else self.ids
        text = self._decode(body)
        self._ends += [len(text)] * len(ids)
        sendable = self._sendable(text)
        if len(sendable) <= len(self.sent) or not sendable.startswith(self.sent):
            return None
        piece, self.sent = sendable[len(self.sent) :], sendable
        upto = self._done
        while upto < len(self._ends) and self._ends[upto] <= len(self.sent):
            upto += 1
        return piece, self._take(upto)

    def _take(self, upto: int) -> list[dict]:
        """The entries of the tokens up to `upto` not sent yet."""
        out = self._entries[: max(upto - self._done, 0)]
        del self._entries[: len(out)]
        self._done += len(out)
        return out

    def rest(self, reply: Reply) -> tuple[Piece | None, list[dict]]:
        """Once the reply is whole: the content still to send (None: nothing) and the entries left for what follows
        it (its tool calls, or the last delta). Content sent that is not the start of the reply's (which the holds
        above are there to prevent) is reported by a ValueError."""
        content = reply.content or ""
        if not content.startswith(self.sent):
            raise ValueError(f"streamed {self.sent!r}, but the reply's content is {content!r}")
        tail = content[len(self.sent) :]
        self.sent = content
        entries = self._take(len(self.ids))
        if tail:
            return (tail, entries), []
        return None, entries


class Chunks:
    """The `chat.completion.chunk` (or `text_completion`) objects of one streamed call, as OpenAI sends them."""

    def __init__(self, call_id: str, model: str, *, chat: bool):
        self.chat = chat
        self.head: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{call_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }

    def _choice(self, i: int, delta: dict, finish: str | None, entries: list[dict] | None) -> dict:
        if self.chat:
            choice = {"index": i, "delta": delta, "logprobs": {"content": entries} if entries else None}
        else:
            choice = {"index": i, "text": delta.get("content", ""), "logprobs": None}
        return {**self.head, "choices": [{**choice, "finish_reason": finish}]}

    def role(self, i: int) -> list[dict]:
        return [self._choice(i, {"role": "assistant", "content": ""}, None, None)] if self.chat else []

    def content(self, i: int, piece: Piece) -> dict:
        return self._choice(i, {"content": piece[0]}, None, piece[1])

    def end(self, i: int, reply: Reply, entries: list[dict]) -> list[dict]:
        """The reply's tool calls (each: its id and name, then its arguments) and the delta with its finish reason;
        `entries` go with the first of them."""
        out = []
        for j, tc in enumerate(reply.tool_calls if self.chat else ()):
            opening = {"index": j, "id": tc["id"], "type": "function",
                       "function": {"name": tc["function"]["name"], "arguments": ""}}
            out.append(self._choice(i, {"tool_calls": [opening]}, None, entries))
            entries = []
            arguments = {"index": j, "function": {"arguments": tc["function"]["arguments"]}}
            out.append(self._choice(i, {"tool_calls": [arguments]}, None, None))
        out.append(self._choice(i, {}, reply.finish_reason, entries))
        return out

    def usage(self, usage: dict) -> dict:
        return {**self.head, "choices": [], "usage": usage}
