"""Sampling for the Tinker API on rlbus's Hugging Face rollout engine (producers/engines/hf.py).

A sampler is an `HFEngine` holding one set of weights: the base model, or the base with a saved adapter merged in
(common/lora.py `merge_adapter`, loaded as a partial weight load: only the adapted layers change). Samplers are made
on first use and the `tinker.max_samplers` most recently used are kept. Requests on one sampler are batched by the
engine (calls that wait together and share temperature, top_p, top_k and stop tokens run as one batch).

Per request: temperature (0 = greedy: the top token, its log-prob at temperature 1), top_p, top_k (-1 = off),
max_tokens, seed (each of the n samples draws from the seeded stream), n (`num_samples`), stop (None: the model's
end-of-sequence token; []: nothing stops; token ids; strings: one that is a single token stops there, a longer one
is matched on the decoded text and the sequence is cut after the token that completes it), and prompt log-probs
(`log p(prompt[i] | prompt[:i])` at temperature 1, None for the first token; what `compute_logprobs` returns).
A sampled token's log-prob is `log_softmax(logits / temperature)[token]`, as the engine computes it for the trainer.
Not served (a user error says so): top-k prompt or sample log-probs, target prompt log-probs, prompt alternatives,
`prompt_logprobs_last_n`, and image chunks.
"""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path

import torch
from transformers import AutoTokenizer

from rlbus.common.lora import merge_adapter
from rlbus.producers.engines.base import Generation, SamplingParams
from rlbus.producers.engines.hf import HFEngine
from rlbus.schemas.engines import HFEngineConfig
from rlbus.tinker_api import proto
from rlbus.tinker_api.training import Base, read_adapter, read_info, target_log_probs
from rlbus.tinker_api.wire import BadRequest, SampleRequest


class Samplers:
    """HF engines by the weights they hold (None: the base), least recently used dropped beyond `max_samplers`."""

    base: Base
    tokenizer: object
    eos_ids: tuple[int, ...]
    max_tokens: int  # the most tokens a request may ask for
    _cfg: HFEngineConfig
    _max: int
    _engines: collections.OrderedDict[str, HFEngine]  # key: the weights directory, "" for the base
    _lock: asyncio.Lock  # one engine made at a time (each loads the model)

    def __init__(self, base: Base, *, max_samplers: int, max_batch_size: int, max_tokens: int):
        self.base = base
        self.tokenizer = AutoTokenizer.from_pretrained(base.path)
        eos = base.model.config.eos_token_id
        self.eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        self.max_tokens = max_tokens
        self._cfg = HFEngineConfig(max_batch_size=max_batch_size, share_weights=False)
        self._max = max_samplers
        self._engines = collections.OrderedDict()
        self._lock = asyncio.Lock()

    async def engine(self, weights: Path | None) -> HFEngine:
        key = str(weights) if weights is not None else ""
        async with self._lock:
            if key in self._engines:
                self._engines.move_to_end(key)
                return self._engines[key]
            engine = await asyncio.to_thread(HFEngine, self.base.path, self._cfg)
            if weights is not None:
                merged = await asyncio.to_thread(self._merged, weights)
                await engine.load_weights(merged, version=0, partial=True)
            self._engines[key] = engine
            while len(self._engines) > self._max:
                _, old = self._engines.popitem(last=False)
                await old.close()
            return engine

    def _merged(self, weights: Path) -> dict[str, torch.Tensor]:
        adapter = read_adapter(weights, self.base)
        info = read_info(weights)
        return merge_adapter(self.base.state_dict(), adapter, float(info["alpha"]) / int(info["rank"]))

    def _params(self, req: SampleRequest) -> tuple[SamplingParams, list[str]]:
        """The engine's sampling settings of `req`, and the stop strings matched on text afterwards."""
        sp = req.sampling_params
        max_tokens = self.max_tokens if sp.max_tokens is None else sp.max_tokens
        if not 1 <= max_tokens <= self.max_tokens:
            raise BadRequest(f"sampling_params.max_tokens: must be in [1, {self.max_tokens}] (tinker.max_tokens)")
        if sp.temperature < 0 or not 0 < sp.top_p <= 1 or sp.top_k == 0 or sp.top_k < -1:
            raise BadRequest("sampling_params: temperature >= 0, 0 < top_p <= 1 and top_k -1 or >= 1 are needed")
        stop_ids: list[int] = list(self.eos_ids) if sp.stop is None else []
        texts: list[str] = []
        for s in [sp.stop] if isinstance(sp.stop, str) else (sp.stop or []):
            if isinstance(s, int):
                stop_ids.append(s)
                continue
            ids = self.tokenizer.encode(s, add_special_tokens=False)
            if len(ids) == 1:
                stop_ids.append(ids[0])
            elif s:
                texts.append(s)
        greedy = sp.temperature == 0  # the engine divides by the temperature: greedy is top_k 1 at temperature 1
        params = SamplingParams(temperature=1.0 if greedy else sp.temperature, top_p=1.0 if greedy else sp.top_p,
                                top_k=1 if greedy else max(sp.top_k, 0), max_new_tokens=max_tokens,
                                stop_token_ids=tuple(stop_ids), seed=sp.seed)  # fmt: skip
        return params, texts

    def _cut(self, gen: Generation, texts: list[str]) -> proto.Sequence:
        """`gen` as a sampled sequence, cut after the token that completes a stop string (if one appears)."""
        if texts and gen.finish_reason != "stop":
            for k in range(1, len(gen.token_ids) + 1):
                if any(t in self.tokenizer.decode(gen.token_ids[:k]) for t in texts):
                    return proto.Sequence(gen.token_ids[:k], gen.log_probs[:k], stopped=True)
        return proto.Sequence(gen.token_ids, gen.log_probs, stopped=gen.finish_reason == "stop")

    async def sample(self, weights: Path | None, req: SampleRequest) -> bytes:
        """Run `req` on the sampler of `weights`: a SampleResponse message."""
        unserved = [name for name, on in (("topk_prompt_logprobs", req.topk_prompt_logprobs > 0),
                                          ("topk_sample_logprobs", req.topk_sample_logprobs > 0),
                                          ("prompt_alt_tokens_k", req.prompt_alt_tokens_k > 0),
                                          ("target_prompt_logprobs", req.target_prompt_logprobs is not None),
                                          ("prompt_logprobs_last_n", req.prompt_logprobs_last_n is not None))
                    if on]  # fmt: skip
        if unserved:
            raise BadRequest(f"{', '.join(unserved)}: not served by rlbus tinker (docs/tinker.md)")
        prompt = req.prompt.to_ints()
        if not prompt or min(prompt) < 0 or max(prompt) >= self.base.vocab_size:
            raise BadRequest(f"prompt: needs at least one token, every id in [0, {self.base.vocab_size})")
        if not 1 <= req.num_samples <= 128:
            raise BadRequest("num_samples: must be in [1, 128]")
        params, texts = self._params(req)
        if self.base.context_len and len(prompt) + params.max_new_tokens > self.base.context_len:
            raise BadRequest(f"prompt: {len(prompt)} tokens + max_tokens {params.max_new_tokens} exceed the "
                             f"model's context of {self.base.context_len}")
        engine = await self.engine(weights)
        gens = await engine.generate([prompt] * req.num_samples, params)
        prompt_lp = await asyncio.to_thread(self._prompt_logprobs, engine, prompt) if req.prompt_logprobs else None
        return proto.sample_response([self._cut(g, texts) for g in gens], prompt_lp)

    @staticmethod
    @torch.no_grad()
    def _prompt_logprobs(engine: HFEngine, prompt: list[int]) -> list[float | None]:
        ids_1T = torch.tensor([prompt])
        logits_1TV = engine.model(input_ids=ids_1T, use_cache=False).logits
        # position t's logits score token t + 1; position 0 has no context
        lp = target_log_probs(logits_1TV[:, :-1], ids_1T[:, 1:])[0].tolist() if len(prompt) > 1 else []
        return [None, *lp]

    async def close(self) -> None:
        for engine in self._engines.values():
            await engine.close()
        self._engines.clear()
