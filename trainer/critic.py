"""The critic of PPO with GAE: a value model beside the policy, sharded with FSDP2 the same way, with its own AdamW.

`TrainEngine` owns one when `algorithm.adv_estimator: gae` and drives it within each step:

    values_BT = critic.values(data, micro_batches)                # V of every position, no grad
    adv_BT, returns_BT = gae_advantages_returns(rewards, values_BT, ...)
    critic.update(data, parts, micro_batches, values_BT, returns_BT, mask_BT, acc)   # clipped value loss

The model is the policy's transformer (or `critic.path`'s) with a fresh scalar head: Hugging Face's
`AutoModelForTokenClassification` with one label and no dropout, as verl's critic. V_t, the value of the state in
which token t is chosen, is the head's output at position t - 1, as the log-prob of token t comes from the logits
at t - 1 (verl: `values[:, -response_length - 1 : -1]`). Producers know nothing of it: values are computed by the
trainer on every arriving batch.

Tests: `pytest tests/integration/test_critic.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoConfig, AutoModelForTokenClassification

from rlbus.schemas.config import CriticConfig, TrainerConfig
from rlbus.trainer import algorithms as algo
from rlbus.trainer.dist import all_reduce
from rlbus.trainer.optim import clipped_step, load_train_state, make_optimizer, make_scheduler, train_state
from rlbus.trainer.parallelize import compute_precision, parallelize

if TYPE_CHECKING:
    from rlbus.trainer.engine import _Accumulator

MicroBatches = Callable[[torch.Tensor], list[torch.Tensor | None]]  # rows -> micro-batches, padded with None


def load_value_model(path: str, dtype: torch.dtype) -> nn.Module:
    """The causal LM at `path` as a value model: its transformer and a new scalar head (seeded by the caller)."""
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # the values must be a function of the weights (replay, ranks agree)
    model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype)
    model.config.use_cache = False
    # The head's output on [b, T, H] is a view (linear reshapes), and FSDP2 warns of a root output that is a view
    # (an in-place op on it would skip its backward hook): give it a tensor of its own, [b, T, 1] floats.
    head = getattr(model, "score", None) or getattr(model, "classifier", None)  # Llama/Qwen2 name it score
    if isinstance(head, nn.Module):
        head.register_forward_hook(lambda _module, _args, out: out.clone())
    return model


class Critic:
    """One rank's share of the value model, its AdamW and its LR schedule."""

    cfg: CriticConfig
    trainer_cfg: TrainerConfig
    model: nn.Module
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    num_updates: int  # optimizer updates of the critic so far
    device: torch.device
    world_size: int

    def __init__(self, path: str, cfg: CriticConfig, trainer_cfg: TrainerConfig, *, device: torch.device,
                 world_size: int, dtype: torch.dtype, gradient_checkpointing: bool) -> None:  # fmt: skip
        self.cfg, self.trainer_cfg = cfg, trainer_cfg
        self.device, self.world_size = device, world_size
        self.model = parallelize(load_value_model(path, dtype), device=device,
                                 mixed_precision=trainer_cfg.mixed_precision,
                                 activation_checkpointing=gradient_checkpointing)  # fmt: skip
        own = msgspec.structs.replace(trainer_cfg, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.optimizer = make_optimizer([p for p in self.model.parameters() if p.requires_grad], own)
        self.scheduler = make_scheduler(self.optimizer, own, warmup_steps=cfg.warmup_steps)
        self.num_updates = 0

    @property
    def steps_done(self) -> int:
        """Steps the critic has trained (each makes `trainer.mini_batches` updates)."""
        return self.num_updates // self.trainer_cfg.mini_batches

    def _forward(self, mb: dict[str, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [b, T] with V_t at position t, 0 at position 0; a zero scalar tied to the graph). None: empty."""
        if mb is None:  # this rank ran out of sequences; FSDP still needs its collectives
            ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            with compute_precision(self.device, self.trainer_cfg.mixed_precision):
                out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=ids).logits
            return ids.float(), out.sum() * 0.0
        b, T = mb["input_ids"].shape
        width = int(mb["attention_mask"].sum(dim=-1).max().item()) if b else 1  # right padding: trim to the longest
        with compute_precision(self.device, self.trainer_cfg.mixed_precision):
            out_bW1 = self.model(input_ids=mb["input_ids"][:, :width], attention_mask=mb["attention_mask"][:, :width],
                                 position_ids=mb["position_ids"][:, :width]).logits  # fmt: skip
        values_bW = F.pad(out_bW1[..., 0].float()[:, :-1], (1, 0))
        return F.pad(values_bW, (0, T - width)) * mb["response_mask"].float(), out_bW1.sum() * 0.0

    @torch.no_grad()
    def values(self, data: dict[str, torch.Tensor], micro_batches: MicroBatches) -> torch.Tensor:
        """V_t of every response token [B, T] (0 elsewhere) under the current critic, micro-batched."""
        out_BT = torch.zeros(data["input_ids"].shape, dtype=torch.float32, device=self.device)
        for idx in micro_batches(torch.arange(data["input_ids"].shape[0], device=self.device)):
            values_bT, _ = self._forward(None if idx is None else {k: v[idx] for k, v in data.items()})
            if idx is not None:
                out_BT[idx] = values_bT
        return out_BT

    def update(
        self,
        data: dict[str, torch.Tensor],
        micro_batches: MicroBatches,
        old_values_BT: torch.Tensor,
        returns_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        acc: _Accumulator,
    ) -> None:
        """`trainer.mini_batches` updates of the clipped value loss, normalised over each update's tokens on all
        ranks; adds critic/vf_loss, vf_clipfrac, grad_norm, lr and the value metrics to `acc`."""
        B = data["input_ids"].shape[0]
        scale = 1.0
        if self.cfg.loss_agg_mode == "seq-mean-token-sum-norm":
            (scale,) = all_reduce([float(mask_BT.sum(dim=-1).max().item()) if B else 1.0], "max")
        for part in torch.arange(B, device=self.device).tensor_split(self.trainer_cfg.mini_batches):
            num_tokens, num_seqs = all_reduce(list(algo.LossNormaliser.local_counts(mask_BT[part])), "sum")
            norm = algo.LossNormaliser(num_tokens=num_tokens, num_seqs=num_seqs, scale=max(scale, 1.0))
            self.optimizer.zero_grad(set_to_none=True)
            update_loss = 0.0
            for idx in micro_batches(part):
                values_bT, loss = self._forward(None if idx is None else {k: v[idx] for k, v in data.items()})
                if idx is not None:
                    out = algo.value_loss(values_bT, returns_BT[idx], old_values_BT[idx], mask_BT[idx], norm=norm,
                                          cliprange_value=self.cfg.cliprange_value,
                                          agg_mode=self.cfg.loss_agg_mode)  # fmt: skip
                    loss = out.loss
                    update_loss += float(out.loss.detach())
                    acc.add("critic/vf_clipfrac", out.clipped_tokens, out.num_tokens)
                # FSDP averages gradients over ranks; the normaliser is already global, so undo the average.
                (loss * self.world_size).backward()
            acc.add("critic/vf_loss", update_loss, 1.0)
            acc.add_update("critic", *clipped_step(self.model, self.optimizer, self.scheduler, self.cfg.grad_clip))
            self.num_updates += 1
        self.optimizer.zero_grad(set_to_none=True)

    # -------------------------------------------------------------------------------------------------------------
    # weights and state

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full value-model weights on CPU with Hugging Face names on rank 0; {} elsewhere. A collective."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def state_dict(self) -> dict[str, Any]:
        return train_state(self.model, self.optimizer, self.scheduler, self.num_updates)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_updates = load_train_state(self.model, self.optimizer, self.scheduler, state)
