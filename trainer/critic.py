"""The critic of PPO with GAE: a value function beside the policy, on a transformer of its own or on the policy's.

`critic.backbone: separate` (verl's critic) is `Critic`: a value model sharded with FSDP2 the same way as the
policy, with its own AdamW. `TrainEngine` owns one when `algorithm.adv_estimator: gae` and drives it within each step:

    values_BT = critic.values(data, micro_batches)                # V of every position, no grad
    adv_BT, returns_BT = gae_advantages_returns(rewards, values_BT, ...)
    critic.update(data, micro_batches, parts, values_BT, returns_BT, mask_BT, acc)   # clipped value loss

Its model is the policy's transformer (or `critic.path`'s) with a fresh scalar head: Hugging Face's
`AutoModelForTokenClassification` with one label and no dropout, as verl's critic.

`critic.backbone: shared` is `SharedValueHead`: a scalar `nn.Linear` (`value_head`) on the policy model's own last
hidden state, a child of the policy's FSDP root unit (sharded with the embeddings and the output head). One forward
gives log-probs and values (trainer/logprobs.py's third column); the engine adds `vf_coef` x the clipped value loss
to the policy loss, one backward, one AdamW: the head is its second parameter group, with `critic.lr` and
`critic.weight_decay`, because under Adam a loss coefficient does not set how fast a parameter moves (the update is
normalised per parameter): `vf_coef` weighs the value loss against the policy loss in the gradient of the shared
transformer, and the head's own LR sets how fast the head learns. Each group is clipped to its own max norm
(`trainer.grad_clip`, `critic.grad_clip`), so the head's early, large errors do not shrink the policy's step. During
`critic_warmup` only the head trains: the value column is computed from detached hidden states and the policy loss
is left out, so the transformer's gradients stay None and AdamW leaves it bit for bit (its moments too).

Either way V_t, the value of the state in which token t is chosen, is the head's output at position t - 1, as the
log-prob of token t comes from the logits at t - 1 (verl: `values[:, -response_length - 1 : -1]`). Producers know
nothing of it: values are computed by the trainer on every arriving batch, and the weights published to them are
the policy's alone. `export_hf` writes either kind as `critic/` (an `AutoModelForTokenClassification`; the shared
one with a copy of the policy's transformer).

Tests: `pytest tests/integration/test_critic.py tests/integration/test_shared_critic.py`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
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
from rlbus.trainer.optim import (
    clip_grad_norm,
    clipped_step,
    load_train_state,
    lr_factor,
    make_optimizer,
    make_scheduler,
    train_state,
)
from rlbus.trainer.parallelize import compute_precision, parallelize

if TYPE_CHECKING:
    from rlbus.trainer.step_metrics import _Accumulator

MicroBatches = Callable[[torch.Tensor], list[torch.Tensor | None]]  # rows -> micro-batches, padded with None
VALUE_HEAD = "value_head"  # the shared head's attribute on the policy model: parameters value_head.weight / .bias
BACKBONE_KEY = "rlbus_critic_backbone"  # in a checkpoint's critic config: "shared" = the head is under "model"


def global_normaliser(mask_BT: torch.Tensor, scale: float) -> algo.LossNormaliser:
    """The loss normaliser of one update: its tokens and sequences summed over all ranks (`scale`: C of
    seq-mean-token-sum-norm)."""
    num_tokens, num_seqs = all_reduce(list(algo.LossNormaliser.local_counts(mask_BT)), "sum")
    return algo.LossNormaliser(num_tokens=num_tokens, num_seqs=num_seqs, scale=max(scale, 1.0))


def value_loss_scale(cfg: CriticConfig, mask_BT: torch.Tensor) -> float:
    """C of the value loss's seq-mean-token-sum-norm: the step's longest response over all ranks (else 1)."""
    if cfg.loss_agg_mode != "seq-mean-token-sum-norm":
        return 1.0
    (scale,) = all_reduce([float(mask_BT.sum(dim=-1).max().item()) if mask_BT.shape[0] else 1.0], "max")
    return scale


def micro_value_loss(cfg: CriticConfig, values_bT: torch.Tensor, returns_bT: torch.Tensor,
                     old_values_bT: torch.Tensor, mask_bT: torch.Tensor, norm: algo.LossNormaliser,
                     acc: _Accumulator) -> torch.Tensor:  # fmt: skip
    """A micro-batch's share of the update's clipped value loss (with grad); its clip fraction goes to `acc`."""
    out = algo.value_loss(values_bT, returns_bT, old_values_bT, mask_bT, norm=norm,
                          cliprange_value=cfg.cliprange_value, agg_mode=cfg.loss_agg_mode)  # fmt: skip
    acc.add("critic/vf_clipfrac", out.clipped_tokens, out.num_tokens)
    return out.loss


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
        parts: list[torch.Tensor],
        old_values_BT: torch.Tensor,
        returns_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        acc: _Accumulator,
    ) -> None:
        """One update of the clipped value loss per row set of `parts` (the actor's: `update_parts`), normalised over
        each update's tokens on all ranks; adds critic/vf_loss, vf_clipfrac, grad_norm, lr and the value metrics to
        `acc`."""
        scale = value_loss_scale(self.cfg, mask_BT)
        for part in parts:
            norm = global_normaliser(mask_BT[part], scale)
            self.optimizer.zero_grad(set_to_none=True)
            update_loss = 0.0
            for idx in micro_batches(part):
                values_bT, loss = self._forward(None if idx is None else {k: v[idx] for k, v in data.items()})
                if idx is not None:
                    loss = micro_value_loss(self.cfg, values_bT, returns_BT[idx], old_values_BT[idx], mask_BT[idx],
                                            norm, acc)  # fmt: skip
                    update_loss += float(loss.detach())
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

    def save_config(self, path: Path) -> None:
        """The value model's Hugging Face config, for `export_hf` (a checkpoint's critic_hf/)."""
        self.model.config.save_pretrained(path)

    def state_dict(self) -> dict[str, Any]:
        return train_state(self.model, self.optimizer, self.scheduler, self.num_updates)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_updates = load_train_state(self.model, self.optimizer, self.scheduler, state)


# -----------------------------------------------------------------------------------------------------------------
# critic.backbone: shared


def attach_value_head(model: nn.Module) -> nn.Linear:
    """Give a causal LM (before `parallelize`) a scalar head on its last hidden state, as `model.value_head`.

    Initialised as Hugging Face initialises a token-classification head (normal with the config's
    initializer_range, zero bias), from the torch RNG the caller seeded; in the model's dtype (one FSDP unit holds
    one dtype). Being a child of the root module, the root unit shards it with the embeddings and the output head.
    """
    weight = next(model.parameters())
    head = nn.Linear(int(model.config.hidden_size), 1, dtype=weight.dtype, device=weight.device)
    nn.init.normal_(head.weight, std=float(getattr(model.config, "initializer_range", 0.02)))
    nn.init.zeros_(head.bias)
    model.add_module(VALUE_HEAD, head)
    return head


class SharedValueHead:
    """The value head on the policy's transformer: its parameter group, LR schedule, loss and optimizer update.

    The engine runs the forwards (`TrainEngine._forward(..., values=True)`) and owns the one optimizer; this class
    says how the head takes part in it.
    """

    cfg: CriticConfig
    trainer_cfg: TrainerConfig
    model: nn.Module  # the policy (FSDP root), `model.value_head` its child
    head_params: list[nn.Parameter]
    policy_params: list[nn.Parameter]  # everything else: the policy proper

    def __init__(self, model: nn.Module, cfg: CriticConfig, trainer_cfg: TrainerConfig) -> None:
        self.cfg, self.trainer_cfg, self.model = cfg, trainer_cfg, model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.head_params = [p for n, p in named if n.startswith(f"{VALUE_HEAD}.")]
        self.policy_params = [p for n, p in named if not n.startswith(f"{VALUE_HEAD}.")]
        if not self.head_params:
            raise ValueError("critic.backbone: shared needs a model made with attach_value_head")

    @property
    def head(self) -> nn.Linear:
        return getattr(self.model, VALUE_HEAD)

    def param_groups(self) -> list[dict[str, Any]]:
        """AdamW's groups: the policy at trainer.lr / weight_decay, then the head at critic.lr / weight_decay."""
        return [{"params": self.policy_params},
                {"params": self.head_params, "lr": self.cfg.lr, "weight_decay": self.cfg.weight_decay}]  # fmt: skip

    def make_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """Per group: the policy's schedule (trainer.warmup_steps) counted from its own first update, as the separate
        critic's actor, whose schedule does not move while it waits; the head's (critic.warmup_steps) from the first."""
        t, n = self.trainer_cfg, self.trainer_cfg.mini_batches
        waited = max(0, self.cfg.critic_warmup - 1) * n  # the updates of the steps before the actor's first

        def factor(update: int, warmup_steps: int) -> float:
            return lr_factor(update, schedule=t.lr_schedule, warmup=warmup_steps * n, total=t.total_steps * n,
                             min_ratio=t.min_lr_ratio)  # fmt: skip

        return torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda u: factor(max(0, u - waited), t.warmup_steps),
                                                             lambda u: factor(u, self.cfg.warmup_steps)])  # fmt: skip

    def actor_waits(self, num_updates: int) -> bool:
        """verl's critic_warmup: the actor first updates at step critic_warmup (steps count from 1); before it, the
        optimizer updates (`num_updates`, a step making `mini_batches`) trained the head alone."""
        return self.cfg.critic_warmup > num_updates // self.trainer_cfg.mini_batches + 1

    def actor_updates(self, num_updates: int) -> int:
        """How many of `num_updates` moved the policy: those after the warm-up's head-only ones."""
        return max(0, num_updates - max(0, self.cfg.critic_warmup - 1) * self.trainer_cfg.mini_batches)

    def step(self, optimizer: torch.optim.Optimizer, scheduler: Any, acc: _Accumulator, *, actor_waits: bool) -> None:
        """One update: the head's and the policy's gradients clipped each to its own max norm; the step is skipped
        when either norm is NaN/inf (as `clipped_step`); the schedule steps either way. While the actor waits its
        gradients are None (the value loss stopped at the hidden states) and only the head is clipped and moved."""
        head_norm = clip_grad_norm(self.head_params, self.cfg.grad_clip)
        policy_norm = 0.0 if actor_waits else clip_grad_norm(self.policy_params, self.trainer_cfg.grad_clip)
        policy_lr, head_lr = (float(g["lr"]) for g in optimizer.param_groups)
        if math.isfinite(head_norm) and math.isfinite(policy_norm):
            optimizer.step()
        scheduler.step()
        if not actor_waits:
            acc.add_update("actor", policy_norm, policy_lr)
        acc.add_update("critic", head_norm, head_lr)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's full weights on CPU on rank 0 (value_head.weight [1, H], value_head.bias [1]); {} elsewhere.
        A collective."""
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v for k, v in full.items() if k.startswith(f"{VALUE_HEAD}.")}

    def save_config(self, path: Path) -> None:
        """The config of the value model this head and the policy's transformer make, for `export_hf`: the policy's
        config as a one-label token classifier without dropout, marked as living in the policy's state."""
        config = copy.deepcopy(self.model.config)
        config.num_labels = 1
        config.classifier_dropout = 0.0
        arch = type(self.model).__name__.removesuffix("ForCausalLM")
        config.architectures = [f"{arch}ForTokenClassification"]
        setattr(config, BACKBONE_KEY, "shared")
        config.save_pretrained(path)
