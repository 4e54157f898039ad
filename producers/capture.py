"""Token-exact capture of one rollout's OpenAI-style calls: what the model saw and sampled, as training sequences.

An agent talking to the producer's endpoint (producers/endpoint.py) sends whole conversations as text. Tokenizing
that text again would not give the ids the model sampled (a BPE reading of the model's reply can differ from the
ids it produced, and a template may re-render earlier turns), so the trainer would score tokens the policy never
sampled. A `Conversation` (one per rollout, one per API key) avoids that. Each reply it hands out is a node holding
the ids of everything before it and the ids the engine sampled. When a later call's messages are an earlier node's
messages plus that node's reply (matched by content: text and tool calls) plus new messages, the new prompt is the
node's ids, then the sampled ids of the reply as they were, then only the tokens the chat template writes after the
reply (its end-of-turn, the tool results, the next assistant header), tokenized alone with mask 0. A call that
extends no earlier reply (the agent rewrote its history) starts a new sequence. After the rollout every node no
later call extended is one training sequence (`Trajectory`): response_mask 1 exactly on sampled ids.

    .venv/bin/python -m pytest -q tests/unit/test_capture.py
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from rlbus.common.chat import TOOL_CALL_END, TOOL_CALL_START
from rlbus.producers.agent_loops.base import Trajectory
from rlbus.producers.agent_loops.tool_parser import parse_tool_calls
from rlbus.producers.engines.base import Generation
from rlbus.schemas.errors import RlbusError
from rlbus.schemas.wire import ChatMessage

log = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(RlbusError):
    """A request the endpoint refuses, answered as OpenAI's error JSON with `status` (the client raises the
    matching exception: 400 BadRequestError, 401 AuthenticationError, 404 NotFoundError)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _bad(message: str, param: str, code: str | None = None) -> RequestError:
    return RequestError(400, message, param=param, code=code)


def _canonical_args(args: Any) -> str:
    """Tool-call arguments as one canonical JSON text (frameworks re-serialise what they were given)."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return args
    return json.dumps(args, sort_keys=True)


def _text(content: Any, param: str) -> str:
    """A message's content: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                raise _bad("only text content parts are supported", param)
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise _bad("content must be a string, null or a list of text parts", param)


@dataclass(frozen=True)
class Message:
    """One request message, validated; `key` is what a later call must repeat for it to count as the same."""

    role: str
    content: str
    tool_calls: tuple[tuple[str, str], ...] = ()  # (name, canonical JSON arguments)

    @property
    def key(self) -> tuple:
        return self.role, self.content.strip(), self.tool_calls

    def template(self) -> dict[str, str]:
        """The message as the chat template takes it. Tool calls the agent wrote itself (not replies this
        conversation sampled, which are replaced by their own text) are written as the tool parser reads them."""
        text = self.content
        for name, args in self.tool_calls:
            call = json.dumps({"name": name, "arguments": json.loads(args) if _is_json(args) else args})
            text += f"{TOOL_CALL_START}{call}{TOOL_CALL_END}"
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": text}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def parse_messages(raw: Any) -> list[Message]:
    """`messages` of a chat request, validated (400 naming the field otherwise)."""
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"each message needs a role among {', '.join(ROLES)}", param)
        calls: list[tuple[str, str]] = []
        for j, call in enumerate(m.get("tool_calls") or ()):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise _bad("a tool call needs function.name", f"{param}.tool_calls[{j}]")
            calls.append((fn["name"], _canonical_args(fn.get("arguments") or "{}")))
        out.append(
            Message(role=m["role"], content=_text(m.get("content"), f"{param}.content"), tool_calls=tuple(calls))
        )
    return out


@dataclass(frozen=True)
class ToolChoice:
    """A request's `tools` and what its `tool_choice` asks of every reply."""

    tools: list[dict] | None  # None when the request has none
    allowed: bool  # replies may carry tool calls ("none" says they may not: any call the model writes stays text)
    name: str = ""  # the function every reply must call (a named function, or "required" with one tool)
    required: bool = False  # every reply must be a tool call ("required" or a named function)

    @property
    def opening(self) -> str:
        """The text every reply must begin with: the tool-call opening, up to the arguments when the function is
        known, up to the name otherwise ("" when nothing is forced). Written as the project's parser reads it and
        as the calculator demonstrations spell it (json.dumps)."""
        if not self.required:
            return ""
        if self.name:
            return f'{TOOL_CALL_START}{{"name": {json.dumps(self.name)}, "arguments": '
        return f'{TOOL_CALL_START}{{"name": "'


def parse_tools(raw: Any, tool_choice: Any) -> ToolChoice:
    """`tools` and `tool_choice` of a chat request, validated (400 naming the field otherwise)."""
    if raw is None:
        if tool_choice not in (None, "none", "auto"):
            raise _bad("tool_choice needs tools", "tool_choice")
        return ToolChoice(tools=None, allowed=False)
    if not isinstance(raw, list):
        raise _bad("tools must be a list of function tools", "tools")
    names = []
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not fn["name"]
        ):
            raise _bad(
                'each tool must be {"type": "function", "function": {"name": ..., "parameters": {...}}}', f"tools[{i}]"
            )
        if not isinstance(fn.get("parameters", {}), dict):
            raise _bad("function.parameters must be a JSON Schema object", f"tools[{i}].function.parameters")
        names.append(fn["name"])
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or name not in names:
            raise _bad(f"tool_choice names no tool of the request ({', '.join(names)})", "tool_choice")
        return ToolChoice(tools=list(raw), allowed=True, name=name, required=True)
    if tool_choice == "required":
        return ToolChoice(tools=list(raw), allowed=True, name=names[0] if len(set(names)) == 1 else "", required=True)
    if tool_choice not in (None, "none", "auto"):
        raise _bad('tool_choice must be "none", "auto", "required" or a function', "tool_choice")
    return ToolChoice(tools=list(raw), allowed=tool_choice != "none")


@dataclass
class Reply:
    """One choice of a call: the message handed back, with the sampled text it came from."""

    text: str  # the sampled tokens' text, without the closing eos
    content: str | None
    tool_calls: list[dict]  # OpenAI's {"id", "type": "function", "function": {"name", "arguments"}}
    finish_reason: str  # "stop", "length" or "tool_calls"

    @property
    def key(self) -> tuple:
        calls = tuple((c["function"]["name"], _canonical_args(c["function"]["arguments"])) for c in self.tool_calls)
        return "assistant", (self.content or "").strip(), calls


def make_reply(
    text: str,
    stopped: bool,
    *,
    tools_allowed: bool,
    call_id: str,
    captured: str | None = None,
    forced: tuple[str, str] | None = None,
) -> Reply:
    """The assistant message for `text` (what the reply says: the sampled text, with a forced opening before it and
    without what followed a stop sequence): tool calls the project's parser reads (tool_parser.py) become
    `tool_calls` when the request allowed tools and every call parsed; otherwise the text is the content.
    `captured`: the text of every token of the reply in the sequence, when it is more than `text` (a stop
    sequence's own tokens). `forced`: (function name, opening text) when the request forced a call of that
    function: a reply whose call does not parse is still that call, its arguments the text the model wrote after
    the opening, as OpenAI's are ("the model does not always generate valid JSON": the agent validates them)."""
    calls = parse_tool_calls(text) if tools_allowed else []
    if forced is not None and not (calls and all(not c.error for c in calls)):
        name, opening = forced
        raw = text.removeprefix(opening)
        raw = raw.split(TOOL_CALL_END, 1)[0].strip()
        raw = raw[:-1].rstrip() if raw.endswith("}}") else raw  # the call object's own closing brace
        call = {"id": f"{call_id}_0", "type": "function", "function": {"name": name, "arguments": raw}}
        return Reply(
            text=text if captured is None else captured,
            content=None,
            tool_calls=[call],
            finish_reason="tool_calls" if stopped else "length",
        )
    if calls and all(not c.error for c in calls):
        content = text
        while TOOL_CALL_START in content:  # the prose around the calls stays the content
            start = content.index(TOOL_CALL_START)
            end = content.find(TOOL_CALL_END, start)
            content = content[:start] + ("" if end < 0 else content[end + len(TOOL_CALL_END) :])
        tool_calls = [
            {
                "id": f"{call_id}_{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for i, c in enumerate(calls)
        ]
        return Reply(
            text=text if captured is None else captured,
            # Without the whitespace that led up to the call (as a stream holds it back: producers/streaming.py).
            content=content.rstrip() or None,
            tool_calls=tool_calls,
            finish_reason="tool_calls" if stopped else "length",
        )
    return Reply(
        text=text if captured is None else captured,
        content=text,
        tool_calls=[],
        finish_reason="stop" if stopped else "length",
    )


@dataclass
class Node:
    """One sampled reply and everything before it, as a training sequence up to its last sampled token."""

    traj: Trajectory
    keys: list[tuple]  # the request's messages (Message.key), the reply excluded
    template: list[dict]  # the request's messages as rendered, the reply excluded
    tools: list[dict] | None
    reply: Reply
    stopped: bool  # the reply ended with the eos the model sampled
    text: str | None = None  # /v1/completions: the prompt's text and the reply's (None for a chat reply)
    extended: bool = False  # a later call continued from it (it is then not a sequence of its own)


@dataclass
class Prepared:
    """What a call will run: its prompt ids, and the sequence so far that the reply extends."""

    prompt_ids: list[int]
    base: Trajectory
    template: list[dict]
    keys: list[tuple]
    tools: list[dict] | None
    parent: Node | None
    opening: str = ""  # the text of the forced opening at the end of prompt_ids (tool_choice), "" when none


@dataclass
class Conversation:
    """The calls of one rollout (one API key), captured token by token. Not thread-safe: one event loop."""

    tokenizer: Any
    max_response_tokens: int
    nodes: list[Node] = field(default_factory=list)
    failure: BaseException | None = None  # a server-side failure (the engine's), re-raised by the agent loop
    num_calls: int = 0
    _openings: dict[tuple[str, str], tuple[list[int], str]] = field(default_factory=dict)

    def render(self, template: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(
            template, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _parent(self, keys: list[tuple]) -> Node | None:
        """The node whose messages and reply the request repeats, the longest such (latest on a tie)."""
        best: Node | None = None
        for node in self.nodes:
            k = len(node.keys)
            repeats = len(keys) > k and keys[:k] == node.keys and keys[k] == node.reply.key
            if repeats and (best is None or k >= len(best.keys)):
                best = node
        return best

    def prepare(self, messages: list[Message], tools: list[dict] | None) -> Prepared:
        """The prompt of a chat call: continued token by token from the earlier reply it repeats, if any."""
        keys = [m.key for m in messages]
        parent = self._parent(keys)
        if parent is not None:
            done = parent.template + [{"role": "assistant", "content": parent.reply.text}]
            template = done + [m.template() for m in messages[len(done) :]]
            inserted = self._inserted(parent, done, template, tools)
            if inserted is not None:
                base = copy.deepcopy(parent.traj)
                base.add_inserted(inserted)
                base.messages += [ChatMessage(role=t["role"], content=t["content"]) for t in template[len(done) :]]
                return Prepared(
                    prompt_ids=base.prompt_ids + base.response_ids,
                    base=base,
                    template=template,
                    keys=keys,
                    tools=tools,
                    parent=parent,
                )
        template = [m.template() for m in messages]
        prompt_ids = self.encode(self.render(template, tools, add_generation_prompt=True))
        base = Trajectory(
            prompt_ids=prompt_ids, messages=[ChatMessage(role=t["role"], content=t["content"]) for t in template]
        )
        return Prepared(prompt_ids=prompt_ids, base=base, template=template, keys=keys, tools=tools, parent=None)

    def opening_ids(self, choice: ToolChoice) -> tuple[list[int], str]:
        """The ids (and their text) of the opening `choice` forces, tokenized as the tokenizer writes it inside a
        whole call, so that the model continues from a tokenization it has seen: the longest prefix of the ids of
        the opening plus a typical continuation whose text lies within the opening (a trailing space would else be
        its own token where the model writes ` {` as one). The function's name is always whole."""
        key = (choice.opening, choice.name)
        if key not in self._openings:
            opening = choice.opening
            whole = self.encode(opening + ('{"x": 1}}' if choice.name else 'x", "arguments": {}}') + TOOL_CALL_END)
            ids: list[int] = []
            for k in range(1, len(whole) + 1):
                if not opening.startswith(self.tokenizer.decode(whole[:k], skip_special_tokens=False)):
                    break
                ids = whole[:k]
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            need = opening.index(json.dumps(choice.name)) + len(json.dumps(choice.name)) if choice.name else 0
            if len(text) < max(need, len(TOOL_CALL_START)):  # the tokenizer merges the name's end with what follows
                ids, text = self.encode(opening), opening
            self._openings[key] = (ids, text)
        return self._openings[key]

    def force(self, prepared: Prepared, choice: ToolChoice) -> None:
        """Begin every reply of the call with the opening `choice` forces (tool_choice "required" or a function):
        its ids go at the end of the prompt, in the sequence as context the model did not sample (the prompt itself
        in a sequence's first call, mask 0 after a reply), and the model samples the rest of the call."""
        ids, text = self.opening_ids(choice)
        prepared.prompt_ids = prepared.prompt_ids + ids
        base = prepared.base
        if base.response_ids:
            base.add_inserted(ids)
        else:
            base.prompt_ids = base.prompt_ids + ids
        prepared.opening = text

    def _inserted(
        self, parent: Node, done: list[dict], template: list[dict], tools: list[dict] | None
    ) -> list[int] | None:
        """Ids the template writes between the parent's last sampled token and the new call's reply; None when
        the template does not render the earlier turns the same way again (then a new sequence begins)."""
        before = self.render(done, parent.tools, add_generation_prompt=False)
        after = self.render(template, tools, add_generation_prompt=True)
        eos = self.tokenizer.eos_token
        end = before.rfind(eos)
        if not after.startswith(before) or end < 0:
            log.warning(
                "the chat template renders earlier turns differently in a later call; that call starts a "
                "new training sequence (its earlier replies are not trained twice)"
            )
            return None
        # After a sampled eos the template's own text follows; a reply cut by max_tokens gets the eos inserted.
        tail = before[end + len(eos) :] if parent.stopped else before[end:]
        return self.encode(tail + after[len(before) :])

    def prepare_completion(self, prompt: str | list[int]) -> Prepared:
        """The prompt of a /v1/completions call: a text (or ids) that begins with an earlier completion's prompt
        and reply continues that sequence (only the new text is tokenized); anything else starts a new one."""
        for node in reversed(self.nodes):
            if node.text is None:
                continue
            ids = node.traj.prompt_ids + node.traj.response_ids
            if isinstance(prompt, str):
                rest = prompt[len(node.text) :] if prompt.startswith(node.text) else None
                inserted = self.encode(rest) if rest is not None else None
            else:
                inserted = list(prompt[len(ids) :]) if list(prompt[: len(ids)]) == ids else None
            if inserted is not None:
                base = copy.deepcopy(node.traj)
                base.add_inserted(inserted)
                return Prepared(prompt_ids=ids + inserted, base=base, template=[], keys=[], tools=None, parent=node)
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return Prepared(prompt_ids=ids, base=Trajectory(prompt_ids=ids), template=[], keys=[], tools=None, parent=None)

    def budget(self, prepared: Prepared) -> int:
        """Tokens the reply may still have within rollout.max_response_tokens."""
        return self.max_response_tokens - len(prepared.base.response_ids)

    def record(
        self,
        prepared: Prepared,
        gen: Generation,
        reply: Reply,
        elapsed_s: float,
        stop_id: int,
        *,
        prompt_text: str | None = None,
        stop_matched: bool = False,
    ) -> Node:
        """One sampled choice of a prepared call, as a node (its parent, if any, is now extended). `prompt_text`:
        a completion's prompt as text, which a later completion may continue; `stop_matched`: the reply ended on a
        stop sequence of the request (its last token completed it; a later call inserts the eos, mask 0)."""
        traj = copy.deepcopy(prepared.base)
        traj.add_generated(list(gen.token_ids), list(gen.log_probs), gen.versions())
        traj.num_turns += 1
        traj.num_tool_calls += len(reply.tool_calls)
        traj.gen_time_s += elapsed_s
        traj.messages.append(ChatMessage(role="assistant", content=reply.text))
        stopped = gen.finish_reason == "stop" and bool(gen.token_ids) and gen.token_ids[-1] == stop_id
        traj.finish_reason = "stop" if stopped or stop_matched else "length"
        if prepared.parent is not None:
            prepared.parent.extended = True
        node = Node(
            traj=traj,
            keys=prepared.keys,
            template=prepared.template,
            tools=prepared.tools,
            reply=reply,
            stopped=stopped,
            text=None if prompt_text is None else prompt_text + reply.text,
        )
        self.nodes.append(node)
        return node

    def trajectories(self) -> list[Trajectory]:
        """Every sequence of the rollout: each reply no later call continued, with all that led to it."""
        return [n.traj for n in self.nodes if not n.extended]
