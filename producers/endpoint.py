"""An OpenAI-compatible endpoint on a producer, backed by its own rollout engine, for agents written elsewhere.

    endpoint = Endpoint(engine, tokenizer, cfg.rollout)            # rollout.openai: host, port, model name
    await endpoint.start()                                         # http://127.0.0.1:<free port>/v1
    with endpoint.conversation() as conv:                          # a fresh API key for one rollout
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=conv.key)
        ...                                                        # conv.capture.trajectories() afterwards
    await endpoint.close()

Routes: `POST /v1/chat/completions` (messages, tools, tool_choice, temperature, top_p, top_k, max_tokens /
max_completion_tokens, n, seed, stop, stream, stream_options.include_usage, logprobs), `POST /v1/completions`
(prompt as text or token ids; the same sampling fields, stop and stream), `GET /v1/models`. Every route needs
`Authorization: Bearer <key>` of a rollout in flight (401 otherwise); a key dies with its rollout. It listens on
loopback unless `rollout.openai.host` says otherwise. Replies are sampled by the engine exactly as the agent loops
sample (stop at eos, log-probs of softmax(logits / temperature)); tool calls in a reply are read by the project's
parser (agent_loops/tool_parser.py) and handed back as OpenAI `tool_calls`. What each call saw and sampled is
captured token by token (producers/capture.py).

- tool_choice "none": no reply carries `tool_calls` (a call the model writes stays text). "required" or a named
  function: every reply begins with the tool-call opening, written by the endpoint into the prompt (up to
  `"arguments":` when the function is known: named, or the only tool; up to `"name": "` otherwise), so the
  model samples the rest of a call of that function. The opening is context the model did not sample (prompt, or
  mask 0 inside a sequence) and the rest is the model's, with its own log-probs: no token is constrained. The
  reply is that call; its arguments are what the model wrote (valid JSON or not, as OpenAI's: the agent validates
  them). With several tools and "required", a reply whose call does not parse comes back as text.
- stop: the reply ends where its text first holds a stop sequence; the sequence keeps exactly the tokens sampled
  up to the one that completed it (a one-token stop ends the generation in the engine; what the engine sampled
  past a longer one is dropped) and a later call inserts the eos, mask 0, as after a reply cut by max_tokens.
- stream: OpenAI's server-sent `chat.completion.chunk`s, sent while the reply is sampled: content deltas as the
  engine samples their tokens (text that may yet turn out to be a tool call or a stop sequence waits until it is
  known: producers/streaming.py), each tool call whole once the reply is (its id and name, then its arguments), a
  last chunk with the finish reason, `data: [DONE]`. The deltas fold into the unstreamed reply exactly. A failure
  before the first delta is an HTTP error; one after it ends the stream with an error event.

Requests the endpoint refuses get OpenAI's error JSON:

    401 invalid_api_key            no key, or a key of no rollout in flight
    404 model_not_found            a model name other than rollout.openai.model
    400 (param named)              malformed messages, tools, tool_choice, stop, seed; temperature <= 0;
                                   a temperature, top_p or top_k other than the run's rollout.* (_sampling says why)
    400 context_length_exceeded    a prompt over the model's context, or no room left in rollout.max_response_tokens
    500 engine_error               the engine failed (the rollout then fails with the engine's error)

    .venv/bin/python -m pytest -q tests/integration/test_endpoint.py
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import web

from rlbus.producers.capture import (
    Conversation,
    Prepared,
    Reply,
    RequestError,
    make_reply,
    parse_messages,
    parse_tools,
)
from rlbus.producers.engines.base import Generation, RolloutEngine, SamplingParams, TokenSink
from rlbus.producers.streaming import Chunks, ReplyStream, cut_at_stop
from rlbus.schemas.config import RolloutConfig

log = logging.getLogger(__name__)


@dataclass
class Call:
    """What one request asks of the engine and of the reply's form."""

    sampling: SamplingParams
    n: int
    stops: tuple[str, ...]  # stop sequences: the reply ends where its text first holds one
    stream: bool  # answer as server-sent events
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    logprobs: bool  # each sampled token's log-prob in the reply


@dataclass
class Session:
    """One rollout's access to the endpoint: its key and what its calls captured."""

    key: str
    capture: Conversation


def body_number(body: dict, name: str, default: float, *, lo: float, hi: float | None = None, integer: bool = False):
    """A request body's number `name` (`default` when absent), or RequestError(400) naming it when it is no number or
    outside [lo, hi]."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise RequestError(400, f"{name} must be {'an integer' if integer else 'a number'}", param=name)
    if value < lo or (hi is not None and value > hi):
        raise RequestError(400, f"{name} must be in [{lo:g}, {'inf' if hi is None else f'{hi:g}'}]", param=name)
    return value


async def read_body(request: Any, model: str, server: str) -> dict:
    """An OpenAI request's JSON object body, for `model`; RequestError (400, or 404 for another model) otherwise.
    `server` names what answers in the 404's message ("this endpoint", "this judge")."""
    try:
        body = await request.json()
    except ValueError:
        raise RequestError(400, "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    if body.get("model") != model:
        raise RequestError(404, f"the model {body.get('model')!r} does not exist; {server} serves {model!r}",
                           param="model", code="model_not_found")
    return body


def model_context(tokenizer: Any) -> int:
    """The model's context length: its config's max_position_embeddings when the tokenizer was loaded from the
    model's directory, else the tokenizer's model_max_length."""
    config = Path(getattr(tokenizer, "name_or_path", "") or ".") / "config.json"
    if config.is_file():
        positions = json.loads(config.read_text()).get("max_position_embeddings")
        if isinstance(positions, int) and positions > 0:
            return positions
    return int(getattr(tokenizer, "model_max_length", 0) or 0) or 1 << 30


class Endpoint:
    """The HTTP server (aiohttp) and the sessions of the rollouts in flight."""

    engine: RolloutEngine
    tokenizer: Any
    cfg: RolloutConfig
    model: str  # the name requests must use
    context_len: int  # longest prompt + reply the model takes
    stop_token_id: int
    base_url: str  # "http://host:port/v1" once started
    num_calls: int  # calls answered (bench/endpoint.py reads these three)
    engine_s: float  # seconds of those calls spent in engine.generate
    handler_s: float  # seconds from a request's arrival to its reply (engine time included)
    _sessions: dict[str, Session]
    _runner: web.AppRunner | None
    _num_ids: int

    def __init__(self, engine: RolloutEngine, tokenizer: Any, cfg: RolloutConfig, *, context_len: int = 0):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.model = cfg.openai.model
        self.context_len = context_len or model_context(tokenizer)
        self.stop_token_id = int(tokenizer.eos_token_id)
        self.base_url = ""
        self.num_calls, self.engine_s, self.handler_s = 0, 0.0, 0.0
        self._sessions = {}
        self._runner = None
        self._num_ids = 0

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024**2, middlewares=[self._errors])
        app.add_routes(
            [
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/completions", self._completions),
                web.get("/v1/models", self._models),
            ]
        )
        # A client that goes away cancels its call's handler, and with it the call (nothing of it is captured).
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.openai.host, self.cfg.openai.port)
        await site.start()
        host, port = site._server.sockets[0].getsockname()[:2]  # the port chosen when 0 was asked for
        self.base_url = f"http://{host}:{port}/v1"
        log.info("OpenAI-compatible endpoint on %s (model %r)", self.base_url, self.model)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @contextlib.contextmanager
    def conversation(self) -> Iterator[Session]:
        """A new API key for one rollout; the key stops working when the block ends."""
        session = Session(
            key=f"rlbus-{secrets.token_urlsafe(24)}", capture=Conversation(self.tokenizer, self.cfg.max_response_tokens)
        )
        self._sessions[session.key] = session
        try:
            yield session
        finally:
            del self._sessions[session.key]

    # ---------------------------------------------------------------- requests

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        t0 = time.perf_counter()
        try:
            return await handler(request)
        except RequestError as e:
            return web.json_response(e.body(), status=e.status)
        finally:
            self.handler_s += time.perf_counter() - t0

    def _session(self, request: web.Request) -> Session:
        auth = request.headers.get("Authorization", "")
        session = self._sessions.get(auth.removeprefix("Bearer ").strip()) if auth.startswith("Bearer ") else None
        if session is None:
            raise RequestError(
                401, "no valid API key: each rollout has its own, valid while it runs", code="invalid_api_key"
            )
        return session

    async def _body(self, request: web.Request) -> dict:
        return await read_body(request, self.model, "this endpoint")

    async def _models(self, request: web.Request) -> web.Response:
        self._session(request)
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "rlbus"}]}
        )

    def _stops(self, body: dict) -> tuple[str, ...]:
        stop = body.get("stop")
        if stop is None:
            return ()
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not 1 <= len(stops) <= 4 or not all(isinstance(s, str) and s for s in stops):
            raise RequestError(400, "stop must be a non-empty string or a list of 1 to 4 of them", param="stop")
        return tuple(stops)

    def _sampling(self, body: dict) -> tuple[float, float, int]:
        """A request's temperature, top_p and top_k (vLLM's extension, in the client's extra_body): the run's own.

        A request may restate them but not change them. The trainer recomputes every sample's log-probs at
        rollout.temperature (and the IS correction and mismatch metrics compare against them), so a sample drawn
        at another temperature would be trained as if drawn at the run's: silently off-policy. Refused instead,
        naming the parameter (one sampling distribution per run also keeps a GRPO group's samples comparable)."""
        temperature = body_number(body, "temperature", self.cfg.temperature, lo=0.0)
        if temperature <= 0:
            raise RequestError(
                400,
                "temperature must be > 0: a trained policy samples, and its log-probs are "
                "of softmax(logits / temperature)",
                param="temperature",
            )
        top_p = body_number(body, "top_p", self.cfg.top_p, lo=0.0, hi=1.0)
        if top_p <= 0:
            raise RequestError(400, "top_p must be > 0", param="top_p")
        top_k = body_number(body, "top_k", self.cfg.top_k, lo=-1, integer=True)
        top_k = 0 if top_k == -1 else top_k  # vLLM's "off" is -1, the run's is 0
        for name, asked, run in (("temperature", temperature, self.cfg.temperature), ("top_p", top_p, self.cfg.top_p),
                                 ("top_k", top_k, self.cfg.top_k)):
            if abs(asked - run) > 1e-9 * max(1.0, abs(run)):
                raise RequestError(
                    400,
                    f"{name}={asked:g} differs from this run's rollout.{name}={run:g}: the trainer recomputes every "
                    f"sample's log-probs at the run's sampling parameters, so a sample drawn at another {name} "
                    f"would be trained as if it had not been. Leave {name} out, or set rollout.{name} to it",
                    param=name,
                )
        return float(temperature), float(top_p), int(top_k)

    def _params(self, body: dict, prepared: Prepared, session: Session, *, prompt_param: str = "messages") -> Call:
        n = body_number(body, "n", 1, lo=1, hi=self.cfg.openai.max_n, integer=True)
        temperature, top_p, top_k = self._sampling(body)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RequestError(400, "seed must be an integer", param="seed")
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = body_number({"max_tokens": asked}, "max_tokens", self.cfg.max_new_tokens, lo=1, integer=True)
        room = min(session.capture.budget(prepared), self.context_len - len(prepared.prompt_ids))
        if room <= 0:
            raise RequestError(
                400,
                f"the prompt ({len(prepared.prompt_ids)} tokens, {len(prepared.base.response_ids)}"
                f" of them in this rollout's response) leaves no room: the model's context is "
                f"{self.context_len} tokens, a rollout's response at most "
                f"{self.cfg.max_response_tokens}",
                param=prompt_param,
                code="context_length_exceeded",
            )
        stops = self._stops(body)
        # A stop sequence that is one token ends the generation in the engine; longer ones are found in the text.
        stop_ids = {self.stop_token_id}
        for text in stops:
            ids = session.capture.encode(text)
            if len(ids) == 1:
                stop_ids.add(ids[0])
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise RequestError(400, "stream must be a boolean", param="stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise RequestError(400, "stream_options must be an object", param="stream_options")
        sampling = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=min(int(max_tokens), room),
            stop_token_ids=tuple(sorted(stop_ids, key=lambda i: i != self.stop_token_id)),
            seed=seed,
        )
        return Call(
            sampling=sampling,
            n=int(n),
            stops=stops,
            stream=stream,
            include_usage=bool(options.get("include_usage")),
            logprobs=bool(body.get("logprobs")),
        )

    async def _sample(
        self,
        session: Session,
        prepared: Prepared,
        call: Call,
        *,
        tools_allowed: bool,
        prompt_text: str | None = None,
        function: str = "",
        call_id: str = "",
        on_tokens: TokenSink | None = None,
    ) -> tuple[list[tuple[Reply, Generation]], str]:
        call_id = call_id or self._new_id()
        t0 = time.perf_counter()
        streaming = {} if on_tokens is None else {"on_tokens": on_tokens}
        try:
            gens = await self.engine.generate([prepared.prompt_ids] * call.n, call.sampling, **streaming)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the engine's failure: the client gets a 500, the rollout the engine's error
            session.capture.failure = session.capture.failure or e
            log.error("the engine failed under a call: %s: %s", type(e).__name__, e)
            raise RequestError(
                500, f"the engine failed: {type(e).__name__}: {e}", code="engine_error", kind="server_error"
            ) from e
        elapsed = time.perf_counter() - t0
        self.num_calls += 1
        self.engine_s += elapsed
        out = []
        decode = self.tokenizer.decode
        decode_all = partial(decode, skip_special_tokens=False)
        forced = (function, prepared.opening) if function else None
        for gen in gens:
            stopped = gen.finish_reason == "stop" and bool(gen.token_ids) and gen.token_ids[-1] == self.stop_token_id
            body_ids = gen.token_ids[:-1] if stopped else gen.token_ids
            cut = cut_at_stop(decode_all, body_ids, call.stops)
            if cut is None:
                text = prepared.opening + decode(body_ids, skip_special_tokens=False)
                reply = make_reply(text, stopped, tools_allowed=tools_allowed, call_id=f"call_{call_id}", forced=forced)
            else:
                # A stop sequence ends the reply: the sequence keeps exactly the tokens sampled up to the one that
                # completed it (what the engine sampled after that is dropped, never trained); the reply's text
                # stops before the stop sequence, as OpenAI's does.
                k, before = cut
                versions = gen.token_versions[:k] if gen.token_versions else []
                gen = Generation(
                    token_ids=gen.token_ids[:k],
                    log_probs=gen.log_probs[:k],
                    finish_reason="stop",
                    version=gen.version,
                    token_versions=versions,
                )
                captured = prepared.opening + decode(gen.token_ids, skip_special_tokens=False)
                reply = make_reply(
                    prepared.opening + before,
                    True,
                    tools_allowed=tools_allowed,
                    call_id=f"call_{call_id}",
                    captured=captured,
                    forced=forced,
                )
            session.capture.record(
                prepared,
                gen,
                reply,
                elapsed,
                self.stop_token_id,
                prompt_text=prompt_text,
                stop_matched=cut is not None,
            )
            out.append((reply, gen))
        session.capture.num_calls += 1
        return out, call_id

    def _new_id(self) -> str:
        self._num_ids += 1
        return f"{self._num_ids}{secrets.token_hex(4)}"

    def _logprob_entry(self, token: int, log_prob: float) -> dict:
        return {
            "token": self.tokenizer.decode([token], skip_special_tokens=False),
            "logprob": log_prob,
            "bytes": None,
            "top_logprobs": [],
        }

    def _logprob_entries(self, gen: Generation) -> list[dict]:
        return [self._logprob_entry(t, lp) for t, lp in zip(gen.token_ids, gen.log_probs)]

    @staticmethod
    def _usage(prepared: Prepared, replies: list[tuple[Reply, Generation]]) -> dict:
        prompt_len, completion = len(prepared.prompt_ids), sum(len(gen.token_ids) for _, gen in replies)
        return {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion}

    def _response(
        self, prefix: str, kind: str, call_id: str, choices: list[dict], prepared: Prepared, replies: list
    ) -> web.Response:
        return web.json_response(
            {
                "id": f"{prefix}-{call_id}",
                "object": kind,
                "created": int(time.time()),
                "model": self.model,
                "choices": choices,
                "usage": self._usage(prepared, replies),
            }
        )

    # ---------------------------------------------------------------- streaming

    async def _streamed(
        self, request: web.Request, session: Session, prepared: Prepared, call: Call, *, chat: bool, **sample: Any
    ) -> web.StreamResponse:
        """The call answered as server-sent events while it is sampled: each choice's content goes out as its
        tokens arrive (what producers/streaming.py lets through), its tool calls and finish reason once it is
        whole. The response starts with the first text there is to send, so a failure before it (a refused
        prompt, a dead engine) is still an HTTP error; a failure after it ends the stream with OpenAI's error
        event, which the `openai` client raises as an APIError. A client that goes away cancels the call."""
        call_id = self._new_id()
        chunks = Chunks(call_id, self.model, chat=chat)
        entry = (lambda t, lp: self._logprob_entry(t, lp)) if call.logprobs else None
        choices = [
            ReplyStream(
                partial(self.tokenizer.decode, skip_special_tokens=False),
                entry,
                stops=call.stops,
                tools=sample.get("tools_allowed", False),
                forced=bool(sample.get("function")),
                stop_token_id=self.stop_token_id,
            )
            for _ in range(call.n)
        ]
        out: list[dict] = []  # chunks not written yet
        ready = asyncio.Event()

        def heard(i: int, ids: list[int], log_probs: list[float]) -> None:
            piece = choices[i].push(ids, log_probs)
            if piece is not None:
                out.extend(self._opening(chunks, choices[i], i))
                out.append(chunks.content(i, piece))
                ready.set()

        sampling = asyncio.create_task(
            self._sample(session, prepared, call, call_id=call_id, on_tokens=heard, **sample)
        )
        response: web.StreamResponse | None = None
        try:
            while not sampling.done():
                waiter = asyncio.create_task(ready.wait())
                await asyncio.wait([sampling, waiter], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                ready.clear()
                if out and not sampling.done():
                    response = response or await self._prepare(request)
                    await self._write(response, out)
            try:
                replies, _ = sampling.result()
            except RequestError as e:
                if response is None:
                    raise
                await self._write(response, [e.body()])  # OpenAI's error event; no [DONE]
                await response.write_eof()
                return response
            for i, (reply, _) in enumerate(replies):
                try:
                    piece, entries = choices[i].rest(reply)
                except ValueError as e:  # what ReplyStream's holds are there to prevent: say so, send the rest
                    log.error("a streamed reply went astray: %s", e)
                    piece, entries = None, []
                out.extend(self._opening(chunks, choices[i], i))
                if piece is not None:
                    out.append(chunks.content(i, piece))
                out.extend(chunks.end(i, reply, entries))
            if call.include_usage:
                out.append(chunks.usage(self._usage(prepared, replies)))
            response = response or await self._prepare(request)
            await self._write(response, out)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            if not sampling.done():  # the client went away (a write failed) or the handler was cancelled
                sampling.cancel()
                await asyncio.gather(sampling, return_exceptions=True)

    @staticmethod
    def _opening(chunks: Chunks, choice: ReplyStream, i: int) -> list[dict]:
        """A choice's first chunk (its role), once."""
        if choice.started:
            return []
        choice.started = True
        return chunks.role(i)

    @staticmethod
    async def _prepare(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        return response

    @staticmethod
    async def _write(response: web.StreamResponse, chunks: list[dict]) -> None:
        data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
        chunks.clear()
        await response.write(data)

    # ---------------------------------------------------------------- routes

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        body = await self._body(request)
        messages = parse_messages(body.get("messages"))
        choice = parse_tools(body.get("tools"), body.get("tool_choice"))
        prepared = session.capture.prepare(messages, choice.tools)
        if choice.required:
            session.capture.force(prepared, choice)
        call = self._params(body, prepared, session)
        function = choice.name if choice.required else ""
        if call.stream:
            return await self._streamed(
                request, session, prepared, call, chat=True, tools_allowed=choice.allowed, function=function
            )
        replies, call_id = await self._sample(session, prepared, call, tools_allowed=choice.allowed, function=function)
        choices = []
        for i, (reply, gen) in enumerate(replies):
            message: dict[str, Any] = {"role": "assistant", "content": reply.content}
            if reply.tool_calls:
                message["tool_calls"] = reply.tool_calls
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "finish_reason": reply.finish_reason,
                    "logprobs": {"content": self._logprob_entries(gen)} if call.logprobs else None,
                }
            )
        return self._response("chatcmpl", "chat.completion", call_id, choices, prepared, replies)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list
        ok_ids = (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        )
        if not (isinstance(prompt, str) and prompt) and not ok_ids:
            raise RequestError(400, "prompt must be one non-empty text or list of token ids", param="prompt")
        prepared = session.capture.prepare_completion(prompt)
        call = self._params(body, prepared, session, prompt_param="prompt")
        call.logprobs = False  # /v1/completions' logprobs is a number (top-k), not offered here
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)
        if call.stream:
            return await self._streamed(
                request, session, prepared, call, chat=False, tools_allowed=False, prompt_text=text
            )
        replies, call_id = await self._sample(session, prepared, call, tools_allowed=False, prompt_text=text)
        choices = [
            {"index": i, "text": reply.content or "", "finish_reason": reply.finish_reason, "logprobs": None}
            for i, (reply, _) in enumerate(replies)
        ]
        return self._response("cmpl", "text_completion", call_id, choices, prepared, replies)
