"""A model-based reward: an LLM judge, asked over an OpenAI-compatible API, scores each episode.

    rollout:
      reward: rlbus.producers.rewards.judge:judge_reward
    judge: {model: .rlbus/models/smollm2-135m-instruct, max_concurrency: 8, retries: 5}   # schemas/judge.py

The judge is `judge.url`, any OpenAI-compatible server (vLLM's, a hosted API with its key in the environment
variable `judge.api_key_env`), or, when that is empty, the served role `rlbus judge CONFIG` (producers/
judge_service.py), whose URL is read from `<run_dir>/judge.url` before every attempt, so a judge restarted on
another port is found. For each episode the reward renders `judge.prompt` with the task's question (its last user
message), the response and the ground truth, asks for a reply of `judge.max_new_tokens` at `judge.temperature`
(0: greedy), and reads the score from it (`judge.score`: the first number scaled by `judge.max_score`, or yes / no).

Failures are the judge's, never the policy's:
- connection errors, timeouts (`judge.timeout_s`), HTTP 5xx and 429 are retried `judge.retries` times with
  exponential backoff (`judge.backoff_s` doubling, with jitter, up to `judge.max_backoff_s`); a missing URL file
  (the role not up yet) counts as a connection error. When every attempt failed the reward raises
  `InfrastructureError("judge <url>", reason)`: the producer gives the task back, and nothing is trained as 0;
- any other HTTP error (400, 404: a wrong `judge.model`, say) is a set-up error: InfrastructureError at once;
- a reply that holds no score is the judge's own output: scored 0.0 and logged (counted in `num_unparsed`).

At most `judge.max_concurrency` requests of one reward are in flight at once (an asyncio.Semaphore); the producer's
episodes wait for the judge without holding up generation, since each awaits its own score.

`rollout.reward: rlbus.producers.rewards.judge:judge_reward` binds it to its run: the registry
(producers/rewards/registry.py) calls `judge_reward.for_run(cfg)`, which reads the run's `judge` section and run
directory. Outside a run, build one from a JudgeConfig: `make_judge_reward(cfg.judge, run_dir=cfg.run_dir)`.

    .venv/bin/python -m pytest -q tests/integration/test_judge.py tests/unit/test_judge_score.py
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
from pathlib import Path

import openai

from rlbus.schemas.config import RunConfig
from rlbus.schemas.errors import ConfigError, InfrastructureError
from rlbus.schemas.judge import URL_FILE, JudgeConfig
from rlbus.schemas.wire import PromptTask

log = logging.getLogger("rlbus.judge")

#: The client waits this much longer than judge.timeout_s, so that the served role's own 504 arrives first.
CLIENT_GRACE_S = 2.0
#: Longest wait for a connection to the judge (a dead host fails fast; a refused connection fails at once).
CONNECT_TIMEOUT_S = 5.0
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def parse_score(reply: str, cfg: JudgeConfig) -> float | None:
    """The score in [0, 1] a judge's reply gives, or None when it gives none.

    number: the reply's first number, which must lie in [0, max_score], divided by max_score ("8/10" -> 0.8,
    "Score: 7.5" -> 0.75, "11" with max_score 10 -> None). yes_no: the first "yes" or "no" as a word -> 1.0 / 0.0."""
    if cfg.score == "number":
        m = _NUMBER.search(reply)
        if m is None:
            return None
        value = float(m.group())
        return value / cfg.max_score if 0 <= value <= cfg.max_score else None
    m = _YES_NO.search(reply)
    return None if m is None else float(m.group(1).lower() == "yes")


def question_of(task: PromptTask) -> str:
    """What the task asks: its last user message (a system prompt or few-shot examples before it are context)."""
    for message in reversed(task.prompt):
        if message.role == "user":
            return message.content
    return ""


def judge_messages(cfg: JudgeConfig, question: str, response: str, ground_truth: str) -> list[dict[str, str]]:
    """The chat the judge is asked: judge.system_prompt (if any), then judge.prompt filled in."""
    user = cfg.prompt.format(question=question, response=response, ground_truth=ground_truth)
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return system + [{"role": "user", "content": user}]


def _retryable(error: Exception) -> bool:
    """Connection errors and timeouts (APITimeoutError is one), 429 and 5xx: the judge may answer later."""
    if isinstance(error, openai.APIConnectionError):
        return True
    return isinstance(error, openai.APIStatusError) and (error.status_code == 429 or error.status_code >= 500)


class _JudgeUnreachable(Exception):
    """No URL to ask yet: the served role has not written its URL file (not started, or restarting)."""


class JudgeReward:
    """The reward callable, `await reward(response_text, ground_truth, task=task) -> float`, and its client.

    One `openai.AsyncOpenAI` per base URL, made on first use in the running event loop (a client belongs to the
    loop it was made in); the semaphore of max_concurrency likewise."""

    cfg: JudgeConfig
    url_file: Path | None  # where the served role's URL is read (judge.url empty), else None
    api_key: str
    num_requests: int  # replies the judge gave
    num_retries: int  # attempts that failed and were retried
    num_unparsed: int  # replies that held no score (scored 0.0)
    _loop: asyncio.AbstractEventLoop | None
    _slots: asyncio.Semaphore | None
    _clients: dict[str, openai.AsyncOpenAI]  # by base URL, of the loop `_loop`

    def __init__(self, cfg: JudgeConfig, *, run_dir: str | os.PathLike | None = None):
        self.cfg = cfg
        if not cfg.url and run_dir is None:
            raise ConfigError("judge.url", "is empty and no run directory was given to find the served role's "
                              f"{URL_FILE} in: set judge.url, or run `rlbus judge CONFIG`")
        if not cfg.model:
            raise ConfigError("judge.model", "is required: the model name every judge request carries")
        self.url_file = None if cfg.url else Path(run_dir) / URL_FILE  # type: ignore[arg-type]
        self.api_key = "none"  # the served role asks for none; the openai client insists on one
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env, "")
            if not key:
                raise ConfigError("judge.api_key_env", f"the environment variable {cfg.api_key_env} is not set")
            self.api_key = key
        self.num_requests = self.num_retries = self.num_unparsed = 0
        self._loop, self._slots, self._clients = None, None, {}

    # ---------------------------------------------------------------- scoring

    async def __call__(self, response_text: str, ground_truth: str, *, task: PromptTask) -> float:
        reply = await self.ask(judge_messages(self.cfg, question_of(task), response_text, ground_truth))
        score = parse_score(reply, self.cfg)
        if score is None:
            self.num_unparsed += 1
            log.warning("the judge's reply for task %s holds no %s score; scored 0.0: %r", task.task_id,
                        self.cfg.score, reply[:200])
            return 0.0
        return score

    def url(self) -> str:
        """The judge's base URL: judge.url, else what the served role wrote in its URL file."""
        if self.url_file is None:
            return self.cfg.url
        try:
            url = self.url_file.read_text().strip()
        except FileNotFoundError:
            raise _JudgeUnreachable(f"no judge is serving: {self.url_file} does not exist") from None
        if not url:
            raise _JudgeUnreachable(f"no judge is serving: {self.url_file} is empty")
        return url

    async def ask(self, messages: list[dict[str, str]]) -> str:
        """The judge's reply to `messages`, with retries; InfrastructureError when the judge did not answer."""
        cfg, attempts = self.cfg, self.cfg.retries + 1
        url = cfg.url or str(self.url_file)
        for attempt in range(attempts):
            try:
                url = self.url()
                async with self._semaphore():
                    completion = await self._client(url).chat.completions.create(
                        model=cfg.model, messages=messages, max_tokens=cfg.max_new_tokens,  # type: ignore[arg-type]
                        temperature=cfg.temperature)
            except (openai.APIError, _JudgeUnreachable) as e:
                if isinstance(e, openai.APIError) and not _retryable(e):
                    raise InfrastructureError(f"judge {url}", f"refused the request: {_describe(e)}") from e
                if attempt + 1 == attempts:
                    raise InfrastructureError(f"judge {url}", f"no answer after {attempts} attempt(s); the last: "
                                              f"{_describe(e)}") from e
                self.num_retries += 1
                delay = min(cfg.max_backoff_s, cfg.backoff_s * 2**attempt) * random.uniform(0.5, 1.0)
                log.info("judge %s: attempt %d of %d failed (%s); again in %.2fs", url, attempt + 1, attempts,
                         _describe(e), delay)
                await asyncio.sleep(delay)
                continue
            self.num_requests += 1
            return (completion.choices[0].message.content or "") if completion.choices else ""
        raise AssertionError("unreachable")  # the loop returns or raises

    # ---------------------------------------------------------------- clients

    def _rebind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or a new event loop (whose clients cannot be closed from here)
            self._loop, self._slots, self._clients = loop, asyncio.Semaphore(self.cfg.max_concurrency), {}

    def _semaphore(self) -> asyncio.Semaphore:
        self._rebind()
        assert self._slots is not None
        return self._slots

    def _client(self, url: str) -> openai.AsyncOpenAI:
        self._rebind()
        client = self._clients.get(url)
        if client is None:
            # max_retries=0: the retries are ours (backoff, the URL file read again, InfrastructureError at the end).
            client = openai.AsyncOpenAI(base_url=url, api_key=self.api_key, max_retries=0, timeout=openai.Timeout(
                self.cfg.timeout_s + CLIENT_GRACE_S, connect=min(CONNECT_TIMEOUT_S, self.cfg.timeout_s)))
            self._clients[url] = client
        return client

    async def close(self) -> None:
        """Close the clients made in the running event loop (those of a loop already gone are dropped)."""
        mine = list(self._clients.values()) if self._loop is asyncio.get_running_loop() else []
        self._clients, self._loop, self._slots = {}, None, None
        for client in mine:
            await client.close()


def _describe(error: BaseException) -> str:
    if isinstance(error, openai.APIStatusError):
        return f"HTTP {error.status_code}: {error.message}"
    return f"{type(error).__name__}: {error}"


def make_judge_reward(cfg: JudgeConfig, *, run_dir: str | os.PathLike | None = None) -> JudgeReward:
    """A reward that scores through the judge `cfg` describes (`run_dir`: where the served role's URL file is,
    needed when judge.url is empty)."""
    return JudgeReward(cfg, run_dir=run_dir)


def for_run(cfg: RunConfig) -> JudgeReward:
    """`judge_reward` bound to a run: its `judge` section, the served role's URL file in its run directory."""
    return make_judge_reward(cfg.judge, run_dir=cfg.run_dir)


async def judge_reward(response_text: str, ground_truth: str, *, task: PromptTask) -> float:
    """`rollout.reward: rlbus.producers.rewards.judge:judge_reward`. The registry replaces it with
    `judge_reward.for_run(cfg)`, the reward bound to the run's `judge` section; called unbound, it cannot know
    which judge to ask."""
    raise ConfigError("rollout.reward", "rlbus.producers.rewards.judge:judge_reward is bound to a run by the reward "
                      "registry (load_reward(cfg.rollout, cfg)); outside a run build it with "
                      "make_judge_reward(cfg.judge, run_dir=cfg.run_dir)")


judge_reward.for_run = for_run  # type: ignore[attr-defined]


__all__ = ["JudgeReward", "for_run", "judge_messages", "judge_reward", "make_judge_reward", "parse_score",
           "question_of"]
