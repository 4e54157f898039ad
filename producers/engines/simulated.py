"""A rollout engine without a model, for pipeline benchmarks: it only takes the time a real one would.

Each generation's length is drawn from a Pareto distribution (shape `tail_alpha`, median `mean_tokens`), capped at
`max_new_tokens`: most responses are short and a few are very long, the long tail that makes synchronous RL wait on
stragglers. A batch sleeps `seconds_per_token * its longest length` (a batched engine decodes until the last row
ends) with asyncio.sleep, so concurrent generate calls overlap as requests to a real server would. Token ids and
log-probs are random but well-formed (log-probs <= 0, one per token), and every generation carries the version.

    .venv/bin/python -m pytest -q tests/unit/test_simulated_engine.py
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING, Mapping

from rlbus.producers.engines.base import Generation, RolloutEngine, SamplingParams
from rlbus.schemas.config import SimulatedEngineConfig

if TYPE_CHECKING:
    import torch


class SimulatedEngine(RolloutEngine):
    _cfg: SimulatedEngineConfig
    _rng: random.Random
    _version: int
    num_generated_tokens: int  # over the engine's life, for benchmarks

    def __init__(self, cfg: SimulatedEngineConfig, *, version: int = 0):
        self._cfg = cfg
        self._rng = random.Random(cfg.seed)
        self._version = version
        self.num_generated_tokens = 0

    @property
    def version(self) -> int:
        return self._version

    def sample_length(self, rng: random.Random, max_new_tokens: int) -> int:
        """Pareto with median mean_tokens: x_m * U^(-1/alpha), x_m = median / 2^(1/alpha)."""
        alpha = self._cfg.tail_alpha
        scale = self._cfg.mean_tokens / 2 ** (1 / alpha)
        u = 1.0 - rng.random()  # in (0, 1]
        return max(1, min(max_new_tokens, round(scale * u ** (-1 / alpha))))

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
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
        self.num_generated_tokens += sum(len(g.token_ids) for g in out)
        await asyncio.sleep(self._cfg.seconds_per_token * max(len(g.token_ids) for g in out))
        return out

    async def load_weights(self, state_dict: Mapping[str, "torch.Tensor"], version: int) -> None:
        self._version = version
