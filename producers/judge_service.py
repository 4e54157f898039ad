"""The judge role: a Hugging Face model served as an OpenAI-compatible chat endpoint, batched and bounded, for the
model-based reward producers score episodes with (producers/rewards/judge.py).

    rlbus judge configs/judge_smollm2.yaml                 # judge.model, judge.host / judge.port (0 = a free port)

Routes: `POST /v1/chat/completions` (messages, max_tokens / max_completion_tokens, temperature, top_p, top_k; not
streamed, one choice), `GET /v1/models`, `GET /health` (load and counters as JSON). No API key is asked for: the
role listens on loopback unless `judge.host` says otherwise. Once listening it writes its base URL
(`http://host:port/v1`) to `<run_dir>/judge.url`, where the reward finds it, and removes the file when it stops.

Batched: requests are admitted up to `judge.max_concurrency` at a time and each asks the HF engine for its reply;
the engine merges the calls that wait together into one batch of up to `judge.max_batch_size` sequences (one
forward pass per token for all of them; HFEngine.generate), so 8 concurrent requests cost about what one does.
Bounded: beyond max_concurrency a request waits in a queue of `judge.max_queue`; beyond that it is answered 429 at
once, and the reward retries it later. Every request, its wait in the queue included, has `judge.timeout_s`; past it
the answer is 504. Temperature 0 (the judge's default) is greedy decoding: the engine's sampler needs a temperature
> 0 (its log-probs are of softmax(logits / temperature)), so greedy is temperature 1 with top_k 1, which keeps only
the top token: exact argmax, no tiny temperature to divide by.

Restartable: the role holds no state but its model. Killed, the requests in flight fail as connection errors and the
reward retries them with backoff; a role started again (on the same port, or anywhere: the reward reads the URL
file again before each attempt) takes them up.

Refused requests get OpenAI's error JSON (the `openai` client raises the matching exception):

    400 (param named)              malformed JSON or messages, n != 1, stream, a bad number
    400 context_length_exceeded    a prompt that leaves the model no room to answer
    404 model_not_found            a model name other than judge.model
    429 rate_limit_exceeded        max_concurrency requests at work and max_queue waiting
    500 engine_error               the engine failed
    504 timeout                    the request took longer than judge.timeout_s

    .venv/bin/python -m pytest -q tests/integration/test_judge.py
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from rlbus.bus.loop import run, serve
from rlbus.common.chat import encode_chat
from rlbus.common.logs import setup_logging
from rlbus.common.model.ensure import ensure_model, model_ready
from rlbus.common.served import UrlRole
from rlbus.common.threads import apply_torch_threads, refresh_executor_threads
from rlbus.producers.capture import RequestError, parse_messages
from rlbus.producers.endpoint import body_number, model_context, read_body
from rlbus.producers.engines.base import SamplingParams
from rlbus.schemas.config import ModelConfig, RunConfig
from rlbus.schemas.engines import HFEngineConfig
from rlbus.schemas.errors import ConfigError
from rlbus.schemas.judge import URL_FILE, JudgeConfig

log = logging.getLogger("rlbus.judge")


@dataclass
class JudgeStats:
    """What the role has done since it started (GET /health shows it)."""

    served: int = 0  # requests answered 200
    rejected: int = 0  # answered 429: max_concurrency at work and max_queue waiting
    timed_out: int = 0  # answered 504: past judge.timeout_s
    failed: int = 0  # answered 500: the engine failed
    batches: int = 0  # batches the engine generated (prefill forward passes)
    batched_sequences: int = 0  # sequences in them: batched_sequences / batches is the mean batch size
    forward_passes: int = 0  # forward passes of the model, prefills and decode steps


def load_judge_model(cfg: JudgeConfig) -> str:
    """The judge's model directory, imported from `judge.gguf` first when it holds no model yet."""
    if not cfg.model:
        raise ConfigError("judge.model", "is required to serve a judge (a local Hugging Face model directory)")
    if not cfg.gguf and not model_ready(Path(cfg.model)):
        raise ConfigError("judge.model", f"{cfg.model} holds no model (config.json + *.safetensors); give "
                          "judge.gguf to import one there, or `rlbus init-model` it")
    try:
        return ensure_model(ModelConfig(path=cfg.model, gguf=cfg.gguf))
    except ConfigError as e:  # named after model.*: say it is the judge's
        raise ConfigError(f"judge.{e.field.rpartition('.')[2]}", e.reason) from None


class JudgeServer:
    """The HTTP server (aiohttp), its admission (a semaphore of max_concurrency and a count of waiters) and the
    engine it hands admitted requests to."""

    cfg: JudgeConfig
    engine: Any  # an HFEngine (rlbus.producers.engines.hf), imported with torch when the server is built
    tokenizer: Any
    model: str  # the name requests must use (judge.model)
    context_len: int  # longest prompt + reply the model takes
    stop_token_id: int
    base_url: str  # "http://host:port/v1" once started
    stats: JudgeStats
    _slots: asyncio.Semaphore | None  # max_concurrency requests at work (made on the serving loop)
    _num_waiting: int  # requests queued for a slot
    _num_active: int  # requests holding a slot
    _runner: web.AppRunner | None
    _ids: itertools.count

    def __init__(self, cfg: JudgeConfig, model_path: str):
        from transformers import AutoTokenizer

        from rlbus.producers.engines.hf import HFEngine

        self.cfg, self.model = cfg, cfg.model
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        engine_cfg = HFEngineConfig(device=cfg.device, max_batch_size=cfg.max_batch_size, share_weights=False)
        self.engine = HFEngine(model_path, engine_cfg, seed=0)
        # Counted at the model, whatever merged the calls: a forward over more than one position is a batch's
        # prefill (a chat prompt is never one token), its rows the batch's sequences.
        self.engine.model.register_forward_pre_hook(self._count_forward, with_kwargs=True)
        self.context_len = model_context(self.tokenizer)
        self.stop_token_id = int(self.tokenizer.eos_token_id)
        self.base_url = ""
        self.stats = JudgeStats()
        self._slots, self._num_waiting, self._num_active = None, 0, 0
        self._runner = None
        self._ids = itertools.count(1)

    def _count_forward(self, module: Any, args: tuple, kwargs: dict) -> None:  # on the engine's worker thread
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        self.stats.forward_passes += 1
        if input_ids is not None and input_ids.shape[-1] > 1:
            self.stats.batches += 1
            self.stats.batched_sequences += int(input_ids.shape[0])

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._slots = asyncio.Semaphore(self.cfg.max_concurrency)
        app = web.Application(client_max_size=16 * 1024**2, middlewares=[self._errors])
        app.add_routes([web.post("/v1/chat/completions", self._chat), web.get("/v1/models", self._models),
                        web.get("/health", self._health)])
        # A client that goes away cancels its handler; a request the engine has not started yet is then dropped.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        # reuse_address (asyncio's default on Unix): a role restarted on the port of a killed one binds at once.
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        host, port = site._server.sockets[0].getsockname()[:2]  # the port chosen when 0 was asked for
        self.base_url = f"http://{host}:{port}/v1"
        log.info("judge %r serving on %s (max_concurrency %d, max_queue %d, max_batch_size %d)", self.model,
                 self.base_url, self.cfg.max_concurrency, self.cfg.max_queue, self.cfg.max_batch_size)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.engine.close()

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "model": self.model, "active": self._num_active, "waiting": self._num_waiting,
                "max_concurrency": self.cfg.max_concurrency, "max_queue": self.cfg.max_queue, **asdict(self.stats)}

    # ---------------------------------------------------------------- requests

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestError as e:
            return web.json_response(e.body(), status=e.status)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response(self.health())

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "rlbus"}]})

    def _sampling(self, body: dict, prompt_len: int) -> SamplingParams:
        temperature = body_number(body, "temperature", self.cfg.temperature, lo=0.0, hi=2.0)
        top_p = body_number(body, "top_p", 1.0, lo=0.0, hi=1.0)
        if top_p <= 0:
            raise RequestError(400, "top_p must be > 0", param="top_p")
        top_k = body_number(body, "top_k", 0, lo=-1, integer=True)
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = body_number({"max_tokens": asked}, "max_tokens", self.cfg.max_new_tokens, lo=1, integer=True)
        room = self.context_len - prompt_len
        if room <= 0:
            raise RequestError(400, f"the prompt ({prompt_len} tokens) leaves no room in the model's context of "
                               f"{self.context_len} tokens", param="messages", code="context_length_exceeded")
        greedy = temperature == 0  # argmax: temperature 1, only the top token kept (the sampler needs T > 0)
        return SamplingParams(temperature=1.0 if greedy else float(temperature), top_p=float(top_p),
                              top_k=1 if greedy else max(0, int(top_k)), max_new_tokens=min(int(max_tokens), room),
                              stop_token_ids=(self.stop_token_id,))

    async def _chat(self, request: web.Request) -> web.Response:
        t0 = time.monotonic()
        body = await read_body(request, self.model, "this judge")
        if body.get("stream"):
            raise RequestError(400, "stream is not offered by the judge", param="stream")
        if body_number(body, "n", 1, lo=1, integer=True) != 1:
            raise RequestError(400, "the judge answers one choice per request (n = 1)", param="n")
        messages = parse_messages(body.get("messages"))
        prompt_ids = encode_chat(self.tokenizer, [{"role": m.role, "content": m.content} for m in messages],
                                 add_generation_prompt=True)
        params = self._sampling(body, len(prompt_ids))
        assert self._slots is not None, "start() the server first"
        if self._slots.locked() and self._num_waiting >= self.cfg.max_queue:
            self.stats.rejected += 1
            raise RequestError(429, f"the judge is busy: {self._num_active} requests at work (max_concurrency) and "
                               f"{self._num_waiting} waiting (max_queue); retry later", code="rate_limit_exceeded",
                               kind="rate_limit_error")
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                self._num_waiting += 1
                try:
                    await self._slots.acquire()
                finally:
                    self._num_waiting -= 1
                self._num_active += 1
                try:
                    gen = (await self.engine.generate([prompt_ids], params))[0]
                finally:
                    self._num_active -= 1
                    self._slots.release()
        except TimeoutError:
            self.stats.timed_out += 1
            raise RequestError(504, f"the judge did not answer within judge.timeout_s={self.cfg.timeout_s:g}s "
                               f"({time.monotonic() - t0:.1f}s)", code="timeout", kind="server_error") from None
        except (RequestError, asyncio.CancelledError):
            raise
        except Exception as e:  # the engine's failure: a 500, which the reward retries
            self.stats.failed += 1
            log.error("the engine failed under a request: %s: %s", type(e).__name__, e)
            raise RequestError(500, f"the engine failed: {type(e).__name__}: {e}", code="engine_error",
                               kind="server_error") from e
        self.stats.served += 1
        stopped = gen.finish_reason == "stop"
        ids = gen.token_ids[:-1] if stopped and gen.token_ids and gen.token_ids[-1] == self.stop_token_id \
            else gen.token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return web.json_response({
            "id": f"chatcmpl-judge-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop" if stopped else "length", "logprobs": None}],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(gen.token_ids),
                      "total_tokens": len(prompt_ids) + len(gen.token_ids)},
        })


class JudgeRole(UrlRole):
    """`rlbus judge`: the server, its URL in the run directory, until SIGTERM / SIGINT (bus/loop.py's serve)."""

    cfg: RunConfig
    server: JudgeServer

    def __init__(self, cfg: RunConfig, server: JudgeServer):
        super().__init__(server, cfg.run_dir / URL_FILE, log)
        self.cfg = cfg

    def stopped(self, reason: str) -> None:
        log.info("judge stopped (%s): %s", reason, self.server.health())


async def run_judge(cfg: RunConfig) -> None:
    refresh_executor_threads()  # generation runs in its threads: each re-sizes its torch pool (common/threads.py)
    server = JudgeServer(cfg.judge, load_judge_model(cfg.judge))
    await serve(JudgeRole(cfg, server))


def main(cfg: RunConfig) -> int:
    setup_logging(cfg.logging.level)
    # The judge shares the machine's CPUs with the run's other processes (common/threads.py), as a producer does.
    apply_torch_threads(cfg.judge.torch_threads, cfg.trainer.num_ranks + cfg.rollout.num_producers + 1,
                        role="judge")
    run(run_judge(cfg))
    return 0


__all__ = ["JudgeRole", "JudgeServer", "JudgeStats", "load_judge_model", "main", "run_judge"]
