"""A Tinker training model: a LoRA adapter on the service's base model, its AdamW, its accumulated gradients.

Every model of the service shares one copy of the base weights (`Base`): a model is a copy of the module tree whose
frozen parameters are the base's own tensors, with rlbus's adapter injected (trainer/lora.py `apply_lora`: peft's
layers, rlbus's fused LoRA linear). Gradients of forward_backward calls add up in the adapter's `.grad` until an
optim_step applies them with the Adam settings that call carries (learning rate, betas, eps, decoupled weight decay,
optional clipping of the global norm) and clears them, as Tinker documents.

The forward is the plain Hugging Face forward on right-padded rows; `target_log_probs` turns its logits into the
log-prob of each datum's target at each position with the trainer's `token_log_probs` (trainer/engine.py). Methods
here are synchronous and run in a worker thread, one request of a model at a time (tinker_api/futures.py `Ordered`).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

from rlbus.schemas.config import TrainerConfig
from rlbus.schemas.lora import LoraConfig
from rlbus.tinker_api import losses
from rlbus.tinker_api.proto import ForwardBackward
from rlbus.tinker_api.wire import AdamParamsIn, BadRequest
from rlbus.trainer import lora
from rlbus.trainer.engine import token_log_probs
from rlbus.trainer.optim import clip_grad_norm, make_optimizer

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
OPTIMIZER_FILE = "optimizer.pt"
INFO_FILE = "tinker.json"  # the model's LoRA settings, beside the adapter of a saved state
_PEFT_PREFIX = "base_model.model."


class Base:
    """The base model every training model and sampler of the service starts from (frozen, float32, CPU)."""

    path: str  # its Hugging Face directory
    name: str  # what clients call it (tinker.base_model)
    model: nn.Module
    vocab_size: int
    context_len: int

    def __init__(self, path: str, name: str):
        self.path, self.name = path, name
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.model.requires_grad_(False)
        self.model.config.use_cache = False
        self.vocab_size = int(self.model.config.vocab_size)
        self.context_len = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()


def target_modules(train_attn: bool, train_mlp: bool) -> list[str]:
    return [*(ATTN if train_attn else ()), *(MLP if train_mlp else ())]


def target_log_probs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] at every position [B, T]: position t's logits score target t (Tinker's
    alignment), which `token_log_probs` computes once the targets are shifted one place right."""
    logits_ext = torch.cat([logits_BTV, logits_BTV[:, -1:]], dim=1)  # [B, T + 1, V]; the added last row is unread
    ids_ext = torch.cat([targets_BT[:, :1], targets_BT], dim=1)  # position t + 1 holds target t
    return token_log_probs(logits_ext, ids_ext, 1.0)[:, 1:]


class TrainingModel:
    """One training client's model: `forward_backward`, `optim_step`, `save` / `load` of its state."""

    model_id: str
    owner: str
    session_id: str
    rank: int
    lora_cfg: LoraConfig
    module: nn.Module
    adapter: dict[str, nn.Parameter]  # wire name (trainer/lora.py) -> the adapter's parameter
    optimizer: torch.optim.AdamW
    num_steps: int  # optim_steps applied
    pending_grads: int  # forward_backward calls whose gradients wait for the next optim_step

    def __init__(self, base: Base, model_id: str, owner: str, session_id: str, *, rank: int, alpha: float,
                 train_attn: bool = True, train_mlp: bool = True, seed: int | None = None):  # fmt: skip
        modules = target_modules(train_attn, train_mlp)
        if not modules:
            raise BadRequest("lora_config: train_attn or train_mlp must be true (the unembedding is not adapted "
                             "here)")
        self.model_id, self.owner, self.session_id, self.rank = model_id, owner, session_id, rank
        self.lora_cfg = LoraConfig(rank=rank, alpha=alpha, target_modules=modules)
        shared = {id(t): t for t in itertools.chain(base.model.parameters(), base.model.buffers())}
        self.module = copy.deepcopy(base.model, shared)  # a new module tree over the base's own tensors
        with torch.random.fork_rng():
            if seed is not None:
                torch.manual_seed(seed)
            lora.apply_lora(self.module, self.lora_cfg)  # A random, B zero: step 0 is the base model
        self.module.eval()
        self.adapter = lora.adapter_tensors(dict(self.module.named_parameters()))
        params = list(self.adapter.values())
        self.optimizer = make_optimizer(params, TrainerConfig())  # settings come with each optim_step
        self.num_steps, self.pending_grads = 0, 0
        self._vocab = base.vocab_size

    # ------------------------------------------------------------------------------------------------ training

    def logprobs(self, batch: losses.Batch) -> torch.Tensor:
        """Target log-probs [B, T] under the current adapter (with the graph when grad is enabled)."""
        out = self.module(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT, use_cache=False)
        return target_log_probs(out.logits, batch.targets_BT)

    def forward_backward(self, req: ForwardBackward) -> tuple[dict[str, list[np.ndarray]], dict[str, float]]:
        """Run `req` (a forward, or a forward and backward whose gradients add to the pending ones); returns the
        per-datum outputs (`logprobs`) and the metrics (`loss:sum`)."""
        losses.check_config(req.loss_fn, req.config)
        batch = losses.make_batch(req.data, req.loss_fn, self._vocab)
        with torch.set_grad_enabled(not req.forward_only):
            logprobs_BT = self.logprobs(batch)
            loss = losses.loss_sum(req.loss_fn, req.config, logprobs_BT, batch)
            if not req.forward_only:
                loss.backward()
                self.pending_grads += 1
        lp = logprobs_BT.detach()
        outputs = {"logprobs": [lp[i, :n].numpy() for i, n in enumerate(batch.lengths)]}
        return outputs, {"loss:sum": float(loss.detach())}

    def optim_step(self, adam: AdamParamsIn) -> dict[str, float]:
        """One AdamW update with `adam`'s settings from the gradients accumulated since the last; clears them."""
        if adam.learning_rate < 0 or not 0 <= adam.beta1 < 1 or not 0 <= adam.beta2 < 1 or adam.eps <= 0:
            raise BadRequest(f"adam_params: learning_rate >= 0, 0 <= beta1, beta2 < 1 and eps > 0 are needed "
                             f"(got {adam.learning_rate}, {adam.beta1}, {adam.beta2}, {adam.eps})")
        for group in self.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        params = list(self.adapter.values())
        for p in params:  # a step without any forward_backward moves the weights by their momentum only
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norm = clip_grad_norm(params, adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf)
        if math.isfinite(norm):
            self.optimizer.step()
            self.num_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.pending_grads = 0
        return {"grad_norm:mean": norm, "learning_rate:mean": adam.learning_rate,
                "skipped:sum": float(not math.isfinite(norm))}

    # -------------------------------------------------------------------------------------------------- states

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return {k: p.detach().clone() for k, p in self.adapter.items()}

    def save(self, out: Path, base: Base, *, optimizer: bool) -> None:
        """The adapter as a peft directory at `out` (with base.json; and AdamW's state when `optimizer`)."""
        tmp = out.with_name(f".{out.name}.tmp")
        lora.save_adapter_dir(self.adapter_state(), self.lora_cfg, tmp, base_model=base.path)
        (tmp / lora.BASE_FILE).write_text(json.dumps(lora.base_record(base.path)))
        (tmp / INFO_FILE).write_text(json.dumps({"rank": self.rank, "alpha": self.lora_cfg.alpha,
                                                 "target_modules": list(self.lora_cfg.target_modules),
                                                 "num_steps": self.num_steps}))  # fmt: skip
        if optimizer:
            torch.save({"optimizer": self.optimizer.state_dict(), "num_steps": self.num_steps}, tmp / OPTIMIZER_FILE)
        if out.exists():
            import shutil

            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)

    def load(self, src: Path, base: Base, *, optimizer: bool) -> None:
        """Load a state `save` wrote (weights; AdamW's state too when `optimizer`); a BadRequest if it does not fit."""
        adapter = read_adapter(src, base)
        info = read_info(src)
        if info["rank"] != self.rank or sorted(info["target_modules"]) != sorted(self.lora_cfg.target_modules):
            raise BadRequest(f"path: the checkpoint's adapter (rank {info['rank']}, {info['target_modules']}) does "
                             f"not fit this model's (rank {self.rank}, {list(self.lora_cfg.target_modules)})")
        missing = sorted(set(self.adapter) - set(adapter))
        if missing:
            raise BadRequest(f"path: the checkpoint lacks {len(missing)} adapter tensors ({missing[:2]}, ...)")
        with torch.no_grad():
            for k, p in self.adapter.items():
                p.copy_(adapter[k])
        if optimizer:
            if not (src / OPTIMIZER_FILE).is_file():
                raise BadRequest("path: this checkpoint holds no optimizer state (save_weights_for_sampler writes "
                                 "the weights alone; save_state writes both)")
            state = torch.load(src / OPTIMIZER_FILE, weights_only=True)  # tensors and numbers: nothing runs
            self.optimizer.load_state_dict(state["optimizer"])
            self.num_steps = int(state["num_steps"])
        self.optimizer.zero_grad(set_to_none=True)
        self.pending_grads = 0


def read_info(src: Path) -> dict[str, Any]:
    try:
        return json.loads((src / INFO_FILE).read_text())
    except FileNotFoundError:
        raise BadRequest(f"path: {src.name} is not a checkpoint of this service") from None


def read_adapter(src: Path, base: Base) -> dict[str, torch.Tensor]:
    """A saved adapter's tensors (wire names), once its recorded base is checked against `base`."""
    try:
        lora.check_base(src, base.path)
    except ValueError as e:
        raise BadRequest(f"path: {e}") from None
    except FileNotFoundError:
        raise BadRequest(f"path: {src.name} is not a checkpoint of this service") from None
    raw = load_file(str(src / "adapter_model.safetensors"))
    return {k.removeprefix(_PEFT_PREFIX): v for k, v in raw.items()}
