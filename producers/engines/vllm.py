"""The vLLM rollout engine (one GPU, optional extra `rlbus[vllm]`; imported only when `rollout.engine.type: vllm`).

Same contract as the HF engine: token ids in, sampled token ids + one log-prob per token out, every generation
stamped with the weight version, weights swapped in place between chunks.

- Log-probs: vLLM by default returns *raw* log-probs (before temperature). We start it with
  `logprobs_mode="processed_logprobs"` (vLLM >= 0.10.2) and ask for `logprobs=0` (only the sampled token), which is
  `log_softmax(logits / temperature)[token]` -- the trainer's quantity -- whenever top_p == 1 and top_k == 0 (the
  RL default). With top-p/top-k on, vLLM's processed log-probs are of the *renormalised* nucleus; that is the true
  behaviour policy but not the trainer's unfiltered log-prob, so we say so once in the log (decoupled PPO recomputes
  proximal log-probs anyway).
- Weights: `LLM.collective_rpc(fn)` runs `fn(worker)` in every worker; `fn` hands the HF-named tensors to the vLLM
  model's own `load_weights` (which knows how to fuse q/k/v and gate/up), then the prefix cache is reset so no KV
  computed by old weights is reused. With one GPU we keep vLLM's engine core in this process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the state dict is not pickled at all; with tensor parallelism the callable
  and tensors are pickled to the workers (VLLM_ALLOW_INSECURE_SERIALIZATION=1).
- Only the given stop ids end a generation (`ignore_eos=True`), as in the HF engine; the stop token is kept.

Checked end to end on a GPU by `python tests/gpu/check_vllm.py` (skips cleanly without CUDA or vLLM).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Mapping

from rlbus.producers.engines.base import Generation, RolloutEngine, SamplingParams
from rlbus.schemas.config import VLLMEngineConfig
from rlbus.schemas.errors import ConfigError

log = logging.getLogger(__name__)


def _load_weights_in_worker(worker: Any, named_tensors: list[tuple[str, Any]]) -> int:
    """Runs inside a vLLM worker (via collective_rpc): load HF-named tensors into the worker's model."""
    model = worker.model_runner.model
    loaded = model.load_weights(weights=iter(named_tensors))
    return len(loaded) if loaded is not None else len(named_tensors)


def _model_max_len(model_path: str, wanted: int) -> int:
    """vLLM refuses a max_model_len beyond the model's position embeddings; clamp to them."""
    config = Path(model_path) / "config.json"
    if config.is_file():
        limit = json.loads(config.read_text()).get("max_position_embeddings")
        if isinstance(limit, int) and limit > 0:
            return min(wanted, limit)
    return wanted


class VLLMEngine(RolloutEngine):
    _cfg: VLLMEngineConfig
    _version: int
    _lock: threading.Lock  # generate chunks and weight loads run one at a time, in worker threads
    _llm: Any  # vllm.LLM
    _warned_filtered: bool

    def __init__(self, model_path: str, engine_cfg: VLLMEngineConfig, *, version: int = 0, trust_remote_code: bool = False):
        if engine_cfg.tensor_parallel_size == 1:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        else:
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        try:
            from vllm import LLM
        except ImportError as e:
            raise ConfigError("rollout.engine.type", f"vllm is not installed ({e}); pip install 'rlbus[vllm]'") from None
        self._cfg = engine_cfg
        self._version = version
        self._lock = threading.Lock()
        self._warned_filtered = False
        self._llm = LLM(
            model=model_path,
            tokenizer=model_path,
            skip_tokenizer_init=True,  # token ids in and out; the agent loop owns the tokenizer
            dtype=engine_cfg.dtype,
            gpu_memory_utilization=engine_cfg.gpu_memory_utilization,
            tensor_parallel_size=engine_cfg.tensor_parallel_size,
            max_model_len=_model_max_len(model_path, engine_cfg.max_model_len),
            enforce_eager=engine_cfg.enforce_eager,
            trust_remote_code=trust_remote_code,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # our SamplingParams are the whole truth, not the model's generation_config
            seed=0,
        )

    @property
    def version(self) -> int:
        return self._version

    def _sampling_params(self, params: SamplingParams, index: int) -> Any:
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
            # One seed per request: the same seed on n copies of a prompt would give n identical samples.
            seed=None if params.seed is None else params.seed + index,
        )

    def _generate_sync(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if params.temperature <= 0:
            raise ValueError(f"temperature: must be > 0, got {params.temperature}")
        if (params.top_p < 1 or params.top_k > 0) and not self._warned_filtered:
            self._warned_filtered = True
            log.warning("vllm engine: with top_p < 1 or top_k > 0 the returned log-probs are of the renormalised "
                        "nucleus, not log_softmax(logits / T) of the full vocabulary")
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        sampling = [self._sampling_params(params, i) for i in range(len(prompts))]
        with self._lock:
            version = self._version
            outputs = self._llm.generate(requests, sampling_params=sampling, use_tqdm=False)
        results = []
        for out in outputs:
            completion = out.outputs[0]
            token_ids = list(completion.token_ids)
            # logprobs: one {token_id: Logprob} per generated token, holding at least the sampled token.
            log_probs = [float(step[tok].logprob) for tok, step in zip(token_ids, completion.logprobs)]
            stopped = bool(token_ids) and token_ids[-1] in params.stop_token_ids
            results.append(
                Generation(token_ids=token_ids, log_probs=log_probs, finish_reason="stop" if stopped else "length", version=version)
            )
        return results

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        return await asyncio.to_thread(self._generate_sync, prompts, params)

    def _load_sync(self, state_dict: Mapping[str, Any], version: int) -> None:
        named = [(name, tensor.detach()) for name, tensor in state_dict.items()]
        with self._lock:
            self._llm.collective_rpc(_load_weights_in_worker, args=(named,))
            self._llm.reset_prefix_cache()  # cached KV was computed by the old weights
            self._version = version

    async def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        await asyncio.to_thread(self._load_sync, state_dict, version)

    async def close(self) -> None:
        with self._lock:
            self._llm = None
