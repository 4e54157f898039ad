"""The Hugging Face `transformers` rollout engine (CPU default; also runs on one GPU): batched sampling with exact
per-token log-probs and weight loading that pauses generation only for a swap of tensors.

We use our own sampling loop over the model's KV cache instead of `model.generate`, because:
- the log-prob of each sampled token must be `log_softmax(logits / temperature)[token]` from the raw logits, the same
  quantity the trainer recomputes; `generate`'s `output_scores` are the top-p/top-k *processed* scores (-inf outside
  the nucleus) and its `output_logits` path changes between transformers releases;
- per-sequence stop tokens (the agent loop's `<|im_end|>`, `</tool_call>`) and per-row finish reasons are a few lines
  here, while `generate` stops only on eos for the whole batch and pads finished rows silently.

Prompts of different lengths are left-padded with explicit position ids (each sequence's positions start at 0, as
in the trainer's unpadded forward), so a teacher-forced forward pass of the same weights reproduces the log-probs
within float tolerance (tests/integration/test_hf_engine.py measures it).

    .venv/bin/python -m pytest -q tests/integration/test_hf_engine.py
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from functools import partial
from typing import Callable, Mapping

import msgspec
import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from rlbus.producers.engines.base import Generation, RolloutEngine, SamplingParams, TokenSink
from rlbus.schemas.config import HFEngineConfig
from rlbus.schemas.errors import WeightLoadError


def _cache_kwarg(model: PreTrainedModel) -> str:
    # transformers 5.x renamed `past_key_values` to `cache` (the old name is deprecated); accept both.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _filter_logits(scaled_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k and outside the top-p nucleus. Used only to choose the token."""
    if top_k > 0 and top_k < scaled_BV.shape[-1]:
        kth_B1 = torch.topk(scaled_BV, top_k, dim=-1).values[:, -1:]
        scaled_BV = scaled_BV.masked_fill(scaled_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(scaled_BV, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays).
        drop_sorted_BV = (torch.cumsum(probs_BV, dim=-1) - probs_BV) >= top_p
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
        scaled_BV = scaled_BV.masked_fill(drop_BV, float("-inf"))
    return scaled_BV


@torch.no_grad()
def sample(
    model: PreTrainedModel,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    pad_token_id: int,
    version: int = 0,
    generator: torch.Generator | None = None,
    on_step: Callable[[list[int], list[int], list[float]], None] | None = None,
    limits: list[int] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> list[Generation]:
    """Sample one continuation per prompt in a single batch (synchronous; the engine runs it in a worker thread).
    `on_step(rows, ids, log_probs)`: after each decode step, the token each unfinished row sampled.

    Rows of several calls can share the batch: `limits` gives each row its own max_new_tokens (params' is the
    largest; a row past its limit finishes "length"), `generators` each row's random stream (rows sharing one draw
    together, one multinomial per stream and step, so a seeded call samples what it would alone)."""
    if params.temperature <= 0:
        raise ValueError(f"temperature: must be > 0 (log-probs are of softmax(logits / temperature)), got {params.temperature}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: every prompt needs at least one token")
    device = next(model.parameters()).device
    num_seqs, max_len = len(prompts), max(len(p) for p in prompts)
    input_ids_BT = torch.full((num_seqs, max_len), pad_token_id, dtype=torch.long)
    mask_BT = torch.zeros((num_seqs, max_len), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids_BT[i, max_len - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask_BT[i, max_len - len(p) :] = 1
    input_ids_BT, mask_BT = input_ids_BT.to(device), mask_BT.to(device)
    positions_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)

    cache = DynamicCache(config=model.config)
    cache_kw = _cache_kwarg(model)
    stop_ids = torch.tensor(list(params.stop_token_ids) or [-1], device=device)
    limits = list(limits) if limits is not None else [params.max_new_tokens] * num_seqs
    row_gens = list(generators) if generators is not None else [generator] * num_seqs
    streams: dict[int, tuple[torch.Generator | None, list[int]]] = {}  # one draw per random stream and step
    for i, g in enumerate(row_gens):
        streams.setdefault(id(g), (g, []))[1].append(i)
    draws = [(g, torch.tensor(rows, device=device)) for g, rows in streams.values()]
    tokens: list[list[int]] = [[] for _ in range(num_seqs)]
    logps: list[list[float]] = [[] for _ in range(num_seqs)]
    finish = ["length"] * num_seqs
    done_B = torch.zeros(num_seqs, dtype=torch.bool, device=device)

    step_ids_BT, step_pos_BT = input_ids_BT, positions_BT
    for _ in range(params.max_new_tokens):
        out = model(input_ids=step_ids_BT, attention_mask=mask_BT, position_ids=step_pos_BT, use_cache=True, **{cache_kw: cache})
        scaled_BV = out.logits[:, -1, :].float() / params.temperature
        logprobs_BV = torch.log_softmax(scaled_BV, dim=-1)  # what the trainer computes: unfiltered
        choose_BV = _filter_logits(scaled_BV, params.top_k, params.top_p)
        probs_BV = torch.softmax(choose_BV, dim=-1)
        if len(draws) == 1:
            next_B = torch.multinomial(probs_BV, 1, generator=draws[0][0]).squeeze(-1)
        else:
            next_B = torch.empty(num_seqs, dtype=torch.long, device=device)
            for g, rows_R in draws:
                next_B[rows_R] = torch.multinomial(probs_BV[rows_R], 1, generator=g).squeeze(-1)
        next_lp_B = logprobs_BV.gather(-1, next_B.unsqueeze(-1)).squeeze(-1)
        rows = (~done_B).nonzero().flatten().tolist()
        ids, lps = next_B.tolist(), next_lp_B.tolist()  # one copy out each, not one per row (it adds up per token)
        for i in rows:
            tokens[i].append(ids[i])
            logps[i].append(lps[i])
        if on_step is not None:
            on_step(rows, [ids[i] for i in rows], [lps[i] for i in rows])
        hit_B = torch.isin(next_B, stop_ids) & ~done_B
        hits = hit_B.nonzero().flatten().tolist()
        for i in hits:
            finish[i] = "stop"
        done_B |= hit_B
        full = [i for i in rows if i not in hits and len(tokens[i]) >= limits[i]]  # at its own limit: "length"
        if full:
            done_B[full] = True
        if (hits or full) and bool(done_B.all()):
            break
        # Finished rows keep decoding junk that is never read; it costs less than reshaping the cache.
        step_ids_BT = next_B.unsqueeze(-1)
        step_pos_BT = step_pos_BT[:, -1:] + 1
        mask_BT = torch.cat([mask_BT, torch.ones((num_seqs, 1), dtype=mask_BT.dtype, device=device)], dim=-1)
    return [
        Generation(token_ids=tokens[i], log_probs=logps[i], finish_reason=finish[i], version=version)  # type: ignore[arg-type]
        for i in range(num_seqs)
    ]


def _merge_key(params: SamplingParams) -> tuple:
    """What calls must share to run in one batch: everything but max_new_tokens and the seed."""
    return params.temperature, params.top_p, params.top_k, params.stop_token_ids


def _shifted(on_step: Callable[[list[int], list[int], list[float]], None], start: int, rows: list[int], *step) -> None:
    """A chunk's decode step, its rows numbered in the whole call (the chunk starts at row `start`)."""
    on_step([start + r for r in rows], *step)


class HFEngine(RolloutEngine):
    """A transformers model that samples prompt batches in a worker thread and swaps weights between chunks."""

    model: PreTrainedModel
    pad_token_id: int
    _cfg: HFEngineConfig
    _version: int
    _lock: threading.Lock  # serialises generate chunks and the swap of new weights (both in worker threads)
    _load_lock: threading.Lock  # one weight load at a time
    last_load_pause_s: float  # how long the last weight load held generation (the swap, not the copy)
    last_load_work_s: float  # the last load's own work: staging (copies, if any) plus the swap, not its waits
    _spare: dict[str, torch.Tensor]  # the tensors the last load swapped out: the next load copies into them
    _shared: set[str]  # parameters that are read in place from the weight store's object (not ours to write)
    _generator: torch.Generator
    # generate() calls not yet running: (prompts, params, their future, their token sink)
    _waiting: list[tuple[list[list[int]], SamplingParams, asyncio.Future, TokenSink | None]]
    _batcher: asyncio.Task | None  # runs the waiting calls, merged into batches, one batch at a time

    def __init__(self, model_path: str, engine_cfg: HFEngineConfig, *, version: int = 0, seed: int | None = None):
        self._cfg = engine_cfg
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(engine_cfg.device).eval()
        pad = self.model.config.pad_token_id
        if pad is None:
            pad = self.model.config.eos_token_id
        if isinstance(pad, list):
            pad = pad[0]
        # Any id works for padding: padded positions are masked out of attention and never read.
        self.pad_token_id = int(pad) if pad is not None else 0
        self._version = version
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()
        self.last_load_pause_s = 0.0
        self.last_load_work_s = 0.0
        self._spare = {}
        self._shared = set()
        self._waiting = []
        self._batcher = None
        self._generator = torch.Generator(device=engine_cfg.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    @property
    def version(self) -> int:
        return self._version

    def _generate_sync(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        on_step: Callable[[list[int], list[int], list[float]], None] | None = None,
        rows: list[tuple[int, int | None]] | None = None,
    ) -> list[Generation]:
        """`rows`: per prompt, its own max_new_tokens and seed (prompts of several merged calls); None: params'."""
        if rows is None:
            rows = [(params.max_new_tokens, params.seed)] * len(prompts)
        streams: dict[int | None, torch.Generator] = {None: self._generator}
        for _, seed in rows:  # a seeded call draws from its own stream, whatever else shares the batch
            if seed not in streams:
                streams[seed] = torch.Generator(device=self._cfg.device).manual_seed(seed)
        results: list[Generation] = []
        step = self._cfg.max_batch_size
        for start in range(0, len(prompts), step):
            chunk = rows[start : start + step]
            limits = [limit for limit, _ in chunk]
            # One chunk runs on one weight version; a load waits for it and the next chunk sees the new weights.
            with self._lock:
                results += sample(
                    self.model,
                    prompts[start : start + step],
                    msgspec.structs.replace(params, max_new_tokens=max(limits)),
                    pad_token_id=self.pad_token_id,
                    version=self._version,
                    on_step=None if on_step is None else partial(_shifted, on_step, start),
                    limits=limits,
                    generators=[streams[seed] for _, seed in chunk],
                )
        return results

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, on_tokens: TokenSink | None = None
    ) -> list[Generation]:
        """Sample `prompts`. Calls that wait together are merged into one batch (the same temperature, top-p,
        top-k and stop tokens; each keeps its own max_new_tokens and seed; up to `max_batch_size` sequences): the
        turns of episodes that are ready at once (a group's samples, other tasks' samples back from their tools)
        run one forward per token for all of them instead of one per call. `on_tokens` hears of every token after
        the decode step that sampled it."""
        if not prompts:
            return []
        loop = asyncio.get_running_loop()
        if self._batcher is not None and self._batcher.get_loop() is not loop:  # a new event loop (tests do that)
            self._batcher, self._waiting = None, []
        done: asyncio.Future[list[Generation]] = loop.create_future()
        self._waiting.append((prompts, params, done, on_tokens))
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._run_batches())
        return await done

    async def _run_batches(self) -> None:
        while self._waiting:
            live = [r for r in self._waiting if not r[2].done()]  # a cancelled caller's request is dropped
            if not live:
                self._waiting = []
                break
            head = live[0][1]  # the batch runs with the sampling settings of the oldest live request
            batch, rest, size = [], [], 0
            for request in live:
                prompts, params, _, _ = request
                mergeable = _merge_key(params) == _merge_key(head) and size + len(prompts) <= self._cfg.max_batch_size
                if not batch or mergeable:
                    batch.append(request)
                    size += len(prompts)
                else:
                    rest.append(request)
            self._waiting = rest
            rows = [(params.max_new_tokens, None if params.seed is None else params.seed + i)
                    for prompts, params, _, _ in batch for i in range(len(prompts))]
            if len(batch) == 1:
                rows = None  # one call: its seed's stream draws for all its rows, as it always did
            try:
                out = await asyncio.to_thread(
                    # Each chunk runs to its rows' longest limit (_generate_sync), whatever head's own is.
                    self._generate_sync, [p for r in batch for p in r[0]], head, self._step_sink(batch), rows,
                )
            except Exception as e:
                for _, _, done, _ in batch:
                    if not done.done():
                        done.set_exception(e)
                continue
            offset = 0
            for prompts, _, done, _ in batch:
                if not done.done():
                    done.set_result(out[offset:offset + len(prompts)])
                offset += len(prompts)

    @staticmethod
    def _step_sink(batch: list) -> Callable[[list[int], list[int], list[float]], None] | None:
        """For the worker thread: each decode step's tokens, handed to the sinks of the calls merged into `batch`
        (rows numbered within each call) on the event loop's thread; None when no call has a sink."""
        owners: list[tuple[TokenSink | None, int]] = []  # per row of the batch: its call's sink, its index there
        for prompts, _, _, sink in batch:
            owners += [(sink, i) for i in range(len(prompts))]
        if all(sink is None for sink, _ in owners):
            return None
        loop = asyncio.get_running_loop()

        def deliver(rows: list[int], ids: list[int], log_probs: list[float]) -> None:
            for row, token, lp in zip(rows, ids, log_probs):
                sink, index = owners[row]
                if sink is not None:
                    sink(index, [token], [lp])

        return lambda *step: loop.call_soon_threadsafe(deliver, *step)

    def _load_sync(self, state_dict: Mapping[str, torch.Tensor], version: int, partial: bool = False) -> None:
        with self._load_lock:  # one load at a time; generation goes on while the new weights are copied
            own = self.model.state_dict(keep_vars=True)  # the Parameter / buffer objects themselves
            # partial: an adapter's layers, merged (producers/weight_sync.py); the other tensors stay as they are
            missing = [] if partial else [k for k in own if k not in state_dict]
            # A tied lm_head is the embedding itself; senders may leave it out.
            if getattr(self.model.config, "tie_word_embeddings", False):
                missing = [k for k in missing if k != "lm_head.weight"]
            unexpected = [k for k in state_dict if k not in own]
            bad_shape = [k for k in state_dict if k in own and tuple(state_dict[k].shape) != tuple(own[k].shape)]
            if missing or unexpected or bad_shape:
                raise WeightLoadError(version, missing=missing, unexpected=unexpected, bad_shape=bad_shape)
            # Shared (engine.share_weights, CPU, same dtype): the parameter becomes the fetched tensor itself, a
            # read-only view of the weight store's object in Ray's shared memory. Nothing is copied, and every
            # producer on a node reads the same bytes; the object stays pinned while a producer uses it. Else copy
            # aside first, outside the generation lock, into the tensors the previous load swapped out (memory
            # already touched: a copy into fresh pages costs several times more) or, the first time, new ones; from
            # the second load on the engine then holds two copies of the weights. A tensor shared by two names (tied
            # embeddings) is taken once.
            t_stage = time.perf_counter()
            staged: list[tuple[str, torch.Tensor, torch.Tensor, bool]] = []  # (name, param, new data, shared)
            seen: set[int] = set()
            with torch.no_grad():
                for name, tensor in state_dict.items():
                    target = own[name]
                    if id(target) in seen:
                        continue
                    seen.add(id(target))
                    if self._cfg.share_weights and tensor.device.type == "cpu" and target.device == tensor.device \
                            and tensor.dtype == target.dtype:
                        staged.append((name, target, tensor, True))
                        continue
                    spare = self._spare.pop(name, None)
                    if spare is not None and spare.shape == target.shape and spare.dtype == target.dtype \
                            and spare.device == target.device:
                        staged.append((name, target, spare.copy_(tensor), False))
                    else:
                        staged.append((name, target, tensor.to(device=target.device, dtype=target.dtype, copy=True),
                                       False))
            staging_s = time.perf_counter() - t_stage
            with self._lock:  # waits for the chunk in flight; generation pauses only for the swap
                t0 = time.perf_counter()
                for name, target, fresh, shared in staged:
                    if shared:  # our own copy (if any) is freed: no load copies into memory any more
                        self._shared.add(name)
                    elif name in self._shared:  # the store's object is not ours to copy into
                        self._shared.discard(name)
                    else:
                        self._spare[name] = target.data
                    target.data = fresh
                self._version = version
                self.last_load_pause_s = time.perf_counter() - t0
                self.last_load_work_s = staging_s + self.last_load_pause_s

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, *,
                           partial: bool = False) -> None:
        await asyncio.to_thread(self._load_sync, state_dict, version, partial)

    @property
    def loads_partial(self) -> bool:
        return True

    async def close(self) -> None:
        with self._lock:
            self.model = None  # type: ignore[assignment]  # frees the weights; the engine is unusable afterwards
            self._spare = {}
            self._shared = set()
