"""The `trainer.sft` section: a supervised phase (cross-entropy on conversations) before RL, in the same trainer.

With `data` set the trainer first trains next-token cross-entropy on the assistant turns of a file of conversations
(OpenAI-style `messages`, rendered by the model's own chat template; common/data/conversations.py), through the
same FSDP2 model, LoRA adapter, AdamW and checkpoints as the RL steps (trainer/sft.py), then publishes the result as
version 0, which the producers roll out from. `trainer.total_steps: 0` makes a supervised run with no RL step.

    rlbus config show configs/quickstart.yaml trainer.sft.data=chats.jsonl trainer.sft.steps=200    # docs/sft.md
"""

from __future__ import annotations

import math
from typing import Literal

from rlbus.schemas.sections import _need, _Section


class SftConfig(_Section):
    data: str = ""  # conversations (JSONL or Parquet, an OpenAI `messages` list per row); "" = no SFT phase
    messages_key: str = "messages"  # the column holding each row's message list
    steps: int = 0  # optimizer steps of the phase; 0 = as many as `epochs` passes over the data take
    epochs: int = 1  # passes over the data when steps is 0
    batch_size: int = 16  # conversations per optimizer step, all ranks together (micro-batches: trainer's)
    max_length: int = 1024  # tokens of a conversation kept (its start); one with no assistant token left is skipped
    lr: float = 1e-5  # AdamW learning rate of the phase (betas, weight decay, grad clip: trainer's)
    lr_schedule: Literal["constant", "cosine"] = "constant"  # constant, or cosine decay after warmup
    warmup_steps: int = 0  # linear LR warmup steps
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    loss_agg_mode: Literal["token-mean", "sum"] = "token-mean"  # mean over the step's assistant tokens (TRL's), or sum
    shuffle: bool = True  # shuffle the conversations each epoch
    seed: int = 0  # shuffle seed (epoch e uses seed and e)
    eval_data: str = ""  # held-out conversations: their token-mean loss is sft/eval_loss ("" = none)
    eval_interval: int = 0  # evaluate every N steps (and after the last); 0 = after the last only
    checkpoint_interval: int = 0  # steps between checkpoints of the phase; 0 = trainer.checkpoint_interval

    def __post_init__(self) -> None:
        _need(self.steps >= 0, "steps", "must be >= 0 (0 = by epochs)")
        _need(self.epochs >= 0, "epochs", "must be >= 0")
        _need(not self.data or self.steps > 0 or self.epochs > 0, "steps",
              "and epochs are both 0: the phase would train nothing (set one, or leave data empty for no phase)")
        _need(self.batch_size >= 1, "batch_size", "must be >= 1")
        _need(self.max_length >= 2, "max_length", "must be >= 2 (a token and the one it predicts)")
        _need(self.lr > 0 and math.isfinite(self.lr), "lr", "must be a finite number > 0")
        _need(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        _need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        _need(bool(self.messages_key), "messages_key", "must name a column")
        _need(self.eval_interval >= 0, "eval_interval", "must be >= 0")
        _need(self.checkpoint_interval >= 0, "checkpoint_interval", "must be >= 0")
        _need(not self.eval_data or bool(self.data), "eval_data", "needs trainer.sft.data (there is no phase)")

    @property
    def enabled(self) -> bool:
        """Whether the run has a supervised phase."""
        return bool(self.data)


def check_sft(sft: SftConfig, kl_coef: float) -> None:
    """Refuse what the supervised phase cannot be combined with (a ValueError naming the field)."""
    if sft.enabled and kl_coef > 0:
        raise ValueError("algorithm.kl_coef: the frozen reference is model.path's weights, not the result of "
                         "trainer.sft; a KL penalty after an SFT phase is not supported yet (export the SFT "
                         "result and point model.path at it, or set kl_coef: 0)")
