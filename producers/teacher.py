"""On-policy distillation's teacher, on each producer: the log-prob the teacher gives every token the student sampled.

With `algorithm.distill` enabled, a producer loads the teacher (any Hugging Face causal LM directory whose tokenizer
is the student's: common/teacher.py checks it, and a mismatch is a ConfigError naming algorithm.distill.teacher) and,
once a group's episodes have all ended, scores the group: one teacher-forced forward over prompt + response per
sample, batched `algorithm.distill.batch_size` sequences at a time, in a thread of its own so that the event loop
(and the engine's other episodes) go on meanwhile. The result, `teacher_log_probs` [R] per sample
(log_softmax(teacher logits / rollout.temperature)[token], exactly 0.0 where response_mask is 0), is stored with the
sample's other tensors in the TransferQueue; the trainer reads it from the batch (consumers/collate.py) and turns it
into the advantage (trainer/algorithms/distill.py), and since it is part of the recorded batch, `rlbus replay`
redoes the step exactly without the teacher.

Why the producers, not a teacher role of its own:
- off the trainer's critical path: the score is ready when the group is published, so a step never waits for it,
  and the trainer never holds the teacher's weights (verl runs the teacher as a separate worker pool; for the sizes
  rlbus runs on one node, that is a second service to place, restart and batch across, for no step time saved);
- once per sample: a group is scored right after it ends, before it is published, so a redelivered task is scored
  with its redo and nothing is scored twice for one training sample;
- it scales with the producers, as generation does: the teacher's forward is one prefill-sized pass per sample,
  far cheaper than the decoding the producer already did.
The cost is memory: one more model per producer (a teacher several times the student's size may rather want fewer,
larger producers). The temperature is the rollout's, as verl scores its teacher: student and teacher are then
compared at the same temperature, and a teacher identical to the student gives a reverse KL of 0 on every token.

    .venv/bin/python -m pytest -q tests/integration/test_distill.py
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from rlbus.common.teacher import check_teacher
from rlbus.common.threads import refresh
from rlbus.schemas.config import HFEngineConfig, RunConfig

if TYPE_CHECKING:
    from rlbus.producers.agent_loops.base import Trajectory

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: One sample to score: (prompt_ids, response_ids, response_mask), as a Trajectory holds them.
Sequences = Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]]


class Teacher:
    """A frozen causal LM that scores the student's sampled tokens; one thread runs its forwards."""

    path: str
    model: torch.nn.Module
    temperature: float  # rollout.temperature: the student's log-probs are at it too
    batch_size: int  # sequences per forward
    device: str
    pad_id: int
    _keeps_logits: bool  # the model's forward takes logits_to_keep (no logits for the prompt's positions)
    _pool: concurrent.futures.ThreadPoolExecutor

    def __init__(self, path: str, *, temperature: float, dtype: str = "float32", device: str = "cpu",
                 batch_size: int = 8) -> None:  # fmt: skip
        self.path = str(path)
        self.temperature = float(temperature)
        self.batch_size = batch_size
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=_DTYPES[dtype]).to(device).eval()
        self.model.requires_grad_(False)
        pad = self.model.config.pad_token_id
        # Any id pads: right padding sits after every real token, which a causal model's real positions never see.
        self.pad_id = int(pad[0] if isinstance(pad, list) else pad) if pad is not None else 0
        self._keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="teacher")

    @classmethod
    def from_config(cls, cfg: RunConfig, student: PreTrainedTokenizerBase) -> Teacher | None:
        """The run's teacher (None when algorithm.distill is off), after checking that it reads the student's ids
        as the student does (`student`: the student's tokenizer; a ConfigError otherwise)."""
        d = cfg.algorithm.distill
        if not d.enabled:
            return None
        check_teacher(d.teacher, student)
        engine = cfg.rollout.engine
        device = d.device or (engine.device if isinstance(engine, HFEngineConfig) else
                              "cuda" if torch.cuda.is_available() else "cpu")  # fmt: skip
        teacher = cls(d.teacher, temperature=cfg.rollout.temperature, dtype=d.dtype, device=device,
                      batch_size=d.batch_size)  # fmt: skip
        log.info("distillation teacher %s on %s (%s, weight %g)", d.teacher, device, d.dtype, d.weight)
        return teacher

    async def score(self, trajectories: Sequence[Trajectory]) -> list[torch.Tensor]:
        """`teacher_log_probs` [R] (float32, on CPU) of each trajectory's response, from the teacher's thread."""
        samples = [(t.prompt_ids, t.response_ids, t.response_mask) for t in trajectories]
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.score_sync, samples)

    @torch.no_grad()
    def score_sync(self, samples: Sequences) -> list[torch.Tensor]:
        """log_softmax(logits / temperature)[token] of each response token, 0.0 where its mask is 0, per sample."""
        refresh()  # this thread's torch pool: the producer's share of the CPUs (common/threads.py)
        out: list[torch.Tensor] = []
        for start in range(0, len(samples), self.batch_size):
            out += self._score_chunk(samples[start : start + self.batch_size])
        return out

    def _score_chunk(self, samples: Sequences) -> list[torch.Tensor]:
        lengths = [len(p) + len(r) for p, r, _ in samples]
        B, L = len(samples), max(lengths)
        ids_BL = torch.full((B, L), self.pad_id, dtype=torch.long)
        attention_BL = torch.zeros((B, L), dtype=torch.long)
        positions_BL = torch.zeros((B, L), dtype=torch.long)
        for i, (p, r, _) in enumerate(samples):
            ids_BL[i, : lengths[i]] = torch.as_tensor(list(p) + list(r), dtype=torch.long)
            attention_BL[i, : lengths[i]] = 1
            positions_BL[i, : lengths[i]] = torch.arange(lengths[i])
        # Token t is scored by the logits at t - 1: the first one needed is the shortest prompt's last position.
        first = max(min(len(p) for p, _, _ in samples) - 1, 0)
        kwargs = {"logits_to_keep": L - first} if self._keeps_logits else {}
        logits = self.model(input_ids=ids_BL.to(self.device), attention_mask=attention_BL.to(self.device),
                            position_ids=positions_BL.to(self.device), use_cache=False, **kwargs).logits
        logits_BKV = logits if self._keeps_logits else logits[:, first:]  # positions first .. L - 1
        out = []
        for i, (p, r, mask) in enumerate(samples):
            n = len(r)
            if n == 0:
                out.append(torch.zeros(0, dtype=torch.float32))
                continue
            if not p:
                raise ValueError("a sample with no prompt token: its first response token has nothing to score it")
            z_RV = logits_BKV[i, len(p) - 1 - first : len(p) - 1 - first + n].float() / self.temperature
            targets_R = ids_BL[i, len(p) : len(p) + n].to(z_RV.device)
            logp_R = z_RV.gather(-1, targets_R[:, None]).squeeze(-1) - torch.logsumexp(z_RV, dim=-1)
            mask_R = torch.as_tensor(list(mask), dtype=torch.bool, device=logp_R.device)
            out.append(torch.where(mask_R, logp_R, torch.zeros_like(logp_R)).cpu())
        return out

    def close(self) -> None:
        """Stop its thread (a forward in flight finishes; nothing waits for it)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
