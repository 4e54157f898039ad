"""One rank's side of the supervised phase (`trainer.sft`): cross-entropy on the assistant tokens of conversations,
through the RL engine's own FSDP2 model, LoRA adapter, chunked output head and checkpoints.

The controller (trainer/sft_phase.py) sends one `StepPlan` per phase step; every rank then runs `SftRunner.step(k)`:

    runner = SftRunner(engine, cfg, tokenizer)      # loads and tokenizes trainer.sft.data (common/data/conversations)
    metrics = runner.step(k)                        # step k's conversations: this rank's share, one AdamW update
    loss = runner.evaluate()                        # token-mean loss on trainer.sft.eval_data

Step k's conversations are positions (k - 1) * batch_size ... of a stream of seeded epoch permutations (the same on
every rank, so no data passes between ranks), dealt to ranks by token count. The loss of an update is
-sum(log p(token | before)) over the assistant tokens of the whole step, all micro-batches and ranks, divided by
their number (`token-mean`: TRL SFTTrainer's assistant-only loss, transformers' shifted cross-entropy with -100 off
the mask; `tests/integration/test_sft.py` compares) or not (`sum`). The phase has its own AdamW and LR schedule
(trainer.sft.lr ...), saved in the phase's checkpoints (`checkpoints/sft/`); the RL steps after it start with the
engine's own, fresh, as a separate SFT run followed by RL would. Log-probs are of softmax(logits), temperature 1,
whatever rollout.temperature the RL steps score at.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from rlbus.common.data.conversations import Conversation, load_conversations
from rlbus.schemas.config import RunConfig
from rlbus.trainer import lora
from rlbus.trainer.checkpoint import load_checkpoint, save_checkpoint
from rlbus.trainer.dist import all_reduce
from rlbus.trainer.engine import TrainEngine
from rlbus.trainer.optim import clipped_step, load_train_state, make_optimizer, make_scheduler, train_state

#: The phase's checkpoints, under the run's checkpoint root (the RL steps' are `step_<N>` beside it).
SFT_CHECKPOINTS = "sft"


def batch_tensors(convs: list[Conversation], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded rows in the trainer's batch layout (consumers/collate.py): the assistant mask is the
    `response_mask` the engine scores (position t: the token predicted from the tokens before it; position 0
    predicts nothing), each row its own group (no shared prompt to pack)."""
    B, T = len(convs), max((len(c.ids) for c in convs), default=1)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    position_ids = torch.zeros((B, T), dtype=torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.float32)
    for i, c in enumerate(convs):
        n = len(c.ids)
        input_ids[i, :n] = torch.tensor(c.ids)
        attention_mask[i, :n] = 1
        position_ids[i, :n] = torch.arange(n)
        response_mask[i, 1:n] = torch.tensor(c.mask[1:], dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "response_mask": response_mask, "group_index": torch.arange(B)}  # fmt: skip


def deal(lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Positions of one step's conversations per rank, balanced by tokens (longest first, to the lightest rank)."""
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min(range(num_ranks), key=lambda k: (load[k], len(shares[k])))
        shares[r].append(i)
        load[r] += lengths[i]
    return shares


class SftRunner:
    """The supervised phase on one rank: the data, the phase's optimizer, and one update per `step`."""

    engine: TrainEngine
    train: list[Conversation]
    heldout: list[Conversation]  # trainer.sft.eval_data ([] without)
    num_steps: int  # steps of the whole phase
    steps_done: int  # steps trained so far (restored from a phase checkpoint)
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR

    def __init__(self, engine: TrainEngine, cfg: RunConfig, tokenizer: Any):
        self.engine, self.cfg = engine, cfg.trainer.sft
        sft = self.cfg
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.train = load_conversations(sft.data, tokenizer, messages_key=sft.messages_key, max_length=sft.max_length)
        self.heldout = (load_conversations(sft.eval_data, tokenizer, messages_key=sft.messages_key,
                                           max_length=sft.max_length) if sft.eval_data else [])  # fmt: skip
        self.num_steps = sft.steps or math.ceil(sft.epochs * len(self.train) / sft.batch_size)
        # The phase's schedule: trainer's AdamW settings (betas, weight decay, kernel), the phase's LR over its steps.
        phase = msgspec.structs.replace(cfg.trainer, lr=sft.lr, lr_schedule=sft.lr_schedule,
                                        min_lr_ratio=sft.min_lr_ratio, warmup_steps=sft.warmup_steps,
                                        total_steps=self.num_steps, mini_batches=1)
        self.optimizer = make_optimizer([p for p in engine.model.parameters() if p.requires_grad], phase)
        self.scheduler = make_scheduler(self.optimizer, phase, warmup_steps=sft.warmup_steps)
        self.steps_done = 0

    @property
    def finished(self) -> bool:
        return self.steps_done >= self.num_steps

    def step_rows(self, step: int) -> list[int]:
        """The data set positions of step `step`'s conversations (steps count from 1), all ranks together."""
        n, B = len(self.train), self.cfg.batch_size
        out = []
        for p in range((step - 1) * B, step * B):
            epoch, i = divmod(p, n)
            out.append(self._order(epoch)[i])
        return out

    def _order(self, epoch: int) -> list[int]:
        if getattr(self, "_epoch", None) != epoch:
            order = list(range(len(self.train)))
            if self.cfg.shuffle:
                random.Random(f"sft-{self.cfg.seed}-{epoch}").shuffle(order)
            self._epoch, self._epoch_order = epoch, order
        return self._epoch_order

    def _my_share(self, convs: list[Conversation]) -> list[Conversation]:
        info = self.engine.info
        mine = deal([len(c.ids) for c in convs], info.world_size)[info.rank]
        return [convs[i] for i in mine]  # longest first: micro-batches of similar lengths

    def _passes(self, convs: list[Conversation], *, train: bool) -> tuple[float, float]:
        """Forward (and backward, `train`) over this rank's conversations in micro-batches; returns the global
        (summed negative log-likelihood, assistant tokens). token-mean divides each micro-batch's sum by the global
        count before its backward, so the gradient is the whole step's mean, whatever the micro-batching."""
        eng = self.engine
        data = {k: v.to(eng.info.device) for k, v in batch_tensors(convs, self.pad_id).items()} if convs else None
        local_tokens = float(data["response_mask"].sum()) if data is not None else 0.0
        (tokens,) = all_reduce([local_tokens], "sum")
        norm = max(tokens, 1.0) if self.cfg.loss_agg_mode == "token-mean" else 1.0
        rows = torch.arange(len(convs), device=eng.info.device)
        nll = 0.0
        temperature, eng.temperature = eng.temperature, 1.0  # cross-entropy of the model's own distribution
        try:
            for idx in eng._micro_batches(rows, data):
                mb = None if idx is None else eng._rows(data, idx)
                with torch.set_grad_enabled(train), lora.dropout_active(eng.model, train and eng.lora.dropout > 0):
                    out = eng._forward(eng.model, mb, with_entropy=False)
                loss = out.zero
                if mb is not None:
                    nll_b = -(out.logp_bT * mb["response_mask"]).sum()
                    nll += float(nll_b.detach())
                    loss = loss + nll_b / norm
                if train:  # FSDP averages gradients over ranks; the normaliser is already global: undo the average
                    (loss * eng.info.world_size).backward()
        finally:
            eng.temperature = temperature
        (nll,) = all_reduce([nll], "sum")
        return nll, tokens

    def step(self, step: int) -> dict[str, float]:
        """Train phase step `step` (from 1): one AdamW update on its conversations; the same metrics on every rank."""
        t0 = time.perf_counter()
        eng = self.engine
        convs = self._my_share([self.train[i] for i in self.step_rows(step)])
        eng.forward_positions = 0
        self.optimizer.zero_grad(set_to_none=True)
        nll, tokens = self._passes(convs, train=True)
        grad_norm, lr, stepped = clipped_step(eng.model, self.optimizer, self.scheduler, eng.cfg.grad_clip,
                                              skip_zero=False)  # fmt: skip
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done = step
        (num_tokens, positions) = all_reduce([float(sum(len(c.ids) for c in convs)), float(eng.forward_positions)],
                                             "sum")  # fmt: skip
        (step_s,) = all_reduce([time.perf_counter() - t0], "max")
        return {"sft/loss": nll / max(tokens, 1.0), "sft/num_tokens": tokens, "sft/grad_norm": grad_norm,
                "sft/lr": lr, "sft/skipped_updates": float(not stepped), "perf/num_tokens": num_tokens,
                "perf/forward_positions": positions, "timing/step_s": step_s,
                "perf/tokens_per_s": num_tokens / max(step_s, 1e-9)}  # fmt: skip

    @torch.no_grad()
    def evaluate(self, convs: list[Conversation] | None = None) -> float:
        """Token-mean loss of `convs` (default: the held-out conversations) under the current weights. A collective."""
        convs = self.heldout if convs is None else convs
        info = self.engine.info
        nll, tokens = self._passes(convs[info.rank :: info.world_size], train=False)
        return nll / max(tokens, 1.0)

    # -------------------------------------------------------------------------------------------------------------
    # the phase's checkpoints: the engine's model with the phase's optimizer and schedule

    def save(self, root: str | Path, extra: Any, keep: int) -> Path:
        """Checkpoint the phase at `steps_done` under `root/sft` (a collective)."""
        return save_checkpoint(_PhaseState(self), Path(root) / SFT_CHECKPOINTS, self.steps_done, extra, keep=keep)

    def restore(self, root: str | Path) -> bool:
        """Resume from the newest phase checkpoint under `root/sft`, if any (a collective)."""
        return load_checkpoint(_PhaseState(self), Path(root) / SFT_CHECKPOINTS) is not None


class _PhaseState:
    """What trainer/checkpoint.py saves and loads for the phase: the engine, with the phase's optimizer and
    schedule in place of the RL ones (everything else, model path, LoRA, critic, is the engine's)."""

    def __init__(self, runner: SftRunner):
        self._runner = runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner.engine, name)

    def state_dict(self) -> dict[str, Any]:
        eng, r = self._runner.engine, self._runner
        keep = lora.is_adapter if eng.lora.enabled else None
        state = train_state(eng.model, r.optimizer, r.scheduler, r.steps_done, keep=keep)
        if eng.critic is not None:  # untouched by the phase; saved so that the checkpoint's layout is the run's
            state["critic"] = eng.critic.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        eng, r = self._runner.engine, self._runner
        r.steps_done = load_train_state(eng.model, r.optimizer, r.scheduler, state, partial=eng.lora.enabled)
        if eng.critic is not None:
            eng.critic.load_state_dict(state["critic"])
