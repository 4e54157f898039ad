"""A rollout engine without a model, for pipeline benchmarks: it only takes the time a real one would.

Each generation's length is drawn from a Pareto distribution (shape `tail_alpha`, median `mean_tokens`), capped at
`max_new_tokens`: most responses are short and a few are very long, the long tail that makes synchronous RL wait on
stragglers. A batch sleeps `seconds_per_token * its longest length` (a batched engine decodes until the last row
ends) with asyncio.sleep, so concurrent generate calls overlap as requests to a real server would. Token ids and
log-probs are random but well-formed (log-probs <= 0, one per token), and every generation carries the version.
With `inflight_updates` a load reaches the calls in flight, as vLLM's does: token i of a call is made
`seconds_per_token * (i + 1)` after the call began and carries the version loaded by then. A cancelled call (an
interrupted turn) counts the tokens it had made by then in `tokens_interrupted`.

    .venv/bin/python -m pytest -q tests/unit/test_simulated_engine.py
"""

from __future__ import annotations

import asyncio
import bisect
import random
import time
from typing import TYPE_CHECKING, Mapping

from rlbus.producers.engines.base import Generation, RolloutEngine, SamplingParams, TokenSink
from rlbus.schemas.config import SimulatedEngineConfig

if TYPE_CHECKING:
    import torch


class SimulatedEngine(RolloutEngine):
    _cfg: SimulatedEngineConfig
    _rng: random.Random
    _version: int
    _loads: list[tuple[float, int]]  # (monotonic time, version) of every load, oldest first
    num_generated_tokens: int  # over the engine's life, for benchmarks
    tokens_interrupted: int  # tokens made by calls cancelled before their end

    def __init__(self, cfg: SimulatedEngineConfig, *, version: int = 0, instance: str = ""):
        self._cfg = cfg
        # One stream per engine instance: producers built from one config (same seed) must not draw the same
        # lengths in step, or their stragglers would all arrive together.
        self._rng = random.Random(f"{cfg.seed}/{instance}" if instance else cfg.seed)
        self._version = version
        self._loads = [(float("-inf"), version)]
        self.num_generated_tokens = self.tokens_interrupted = 0

    @property
    def updates_in_flight(self) -> bool:
        return self._cfg.inflight_updates

    def _version_at(self, t: float) -> int:
        return self._loads[bisect.bisect_right(self._loads, (t, float("inf"))) - 1][1]

    @property
    def version(self) -> int:
        return self._version

    def sample_length(self, rng: random.Random, max_new_tokens: int) -> int:
        """Pareto with median mean_tokens: x_m * U^(-1/alpha), x_m = median / 2^(1/alpha)."""
        alpha = self._cfg.tail_alpha
        scale = self._cfg.mean_tokens / 2 ** (1 / alpha)
        u = 1.0 - rng.random()  # in (0, 1]
        return max(1, min(max_new_tokens, round(scale * u ** (-1 / alpha))))

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, on_tokens: TokenSink | None = None
    ) -> list[Generation]:
        if not prompts:
            return []
        rng = random.Random(params.seed) if params.seed is not None else self._rng
        version = self._version  # the whole call is one chunk on one version
        out: list[Generation] = []
        allowed = [i for i in range(self._cfg.vocab_size) if i not in params.stop_token_ids] or [self._cfg.vocab_size]
        for _ in prompts:
            length = self.sample_length(rng, params.max_new_tokens)
            stop = rng.random() < 0.5 and params.stop_token_ids and length < params.max_new_tokens
            # Only the last token of a "stop" generation may be a stop id.
            ids = [rng.choice(allowed) for _ in range(length)]
            if stop:
                ids[-1] = params.stop_token_ids[0]
            log_probs = [-rng.expovariate(1.0) for _ in ids]
            out.append(Generation(token_ids=ids, log_probs=log_probs, finish_reason="stop" if stop else "length", version=version))
        spt = self._cfg.seconds_per_token
        began = time.monotonic()
        try:
            await asyncio.sleep(spt * max(len(g.token_ids) for g in out))
        except asyncio.CancelledError:
            made = int((time.monotonic() - began) / spt) if spt > 0 else 0
            self.tokens_interrupted += sum(min(made, len(g.token_ids)) for g in out)
            raise
        self.num_generated_tokens += sum(len(g.token_ids) for g in out)
        if self._cfg.inflight_updates and self._version_at(time.monotonic()) != version:
            for g in out:
                g.token_versions = [self._version_at(began + spt * (i + 1)) for i in range(len(g.token_ids))]
        if on_tokens is not None:  # a call is sampled whole here
            for i, g in enumerate(out):
                on_tokens(i, list(g.token_ids), list(g.log_probs))
        return out

    async def load_weights(self, state_dict: Mapping[str, "torch.Tensor"], version: int, *,
                           partial: bool = False) -> None:
        self._version = version
        self._loads.append((time.monotonic(), version))
