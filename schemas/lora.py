"""The `model.lora` section: train a low-rank adapter (LoRA, through `peft`) instead of every weight.

With `rank > 0` the trainer freezes the base model and trains, for each linear layer whose name ends in one of
`target_modules`, two matrices A [rank, in] and B [out, rank]; the layer computes W x + (alpha / rank) B A x. B starts
at zero, so step 0's policy is the base model. Producers keep the base weights they were built from and receive the
adapter alone (`sync: adapter`, a few MB) or the merged weights (`sync: merged`, as under full fine-tuning).

    rlbus config show configs/quickstart.yaml model.lora.rank=8 model.lora.alpha=16     # docs/lora.md

Needs the `lora` extra (`pip install 'rlbus[lora]'`, which is `peft`).

Also here, the other side of what a version publishes under full fine-tuning: `trainer.weight_sync`, every weight or
what changed since the version before (common/delta.py), in the dtype the producers' engines run.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from rlbus.schemas.sections import _need, _Section

#: Every linear layer of a Llama / Qwen2 / Mistral block (attention and MLP).
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class LoraConfig(_Section):
    rank: int = 0  # adapter rank r; 0 = full fine-tuning (no adapter)
    alpha: float = 16.0  # scale numerator: the adapter's output is multiplied by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input during the update's forwards (not the scoring passes)
    target_modules: list[str] = msgspec.field(default_factory=lambda: list(ALL_LINEAR))  # linear layers, by name
    sync: Literal["adapter", "merged"] = "adapter"  # what a weight version publishes: the adapter, or merged weights

    def __post_init__(self) -> None:
        _need(self.rank >= 0, "rank", "must be >= 0 (0: full fine-tuning)")
        _need(self.alpha > 0, "alpha", "must be > 0")
        _need(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")
        _need(not self.enabled or bool(self.target_modules), "target_modules",
              "must name at least one linear layer (q_proj, v_proj, ...) when rank > 0")
        bad = [m for m in self.target_modules if not _MODULE_NAME.fullmatch(m)]
        _need(not bad, "target_modules", f"{bad} are not module names (the last part of a layer's name: q_proj)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank: what the adapter's product B A is multiplied by."""
        return self.alpha / self.rank if self.rank else 0.0


class WeightSyncConfig(_Section):
    encoding: Literal["full", "delta"] = "full"  # full fine-tuning: every weight, or what changed since the last version
    dtype: Literal["float32", "bfloat16"] = "float32"  # versions are published in this dtype (the engines' own)


def check_lora(lora: LoraConfig, adv_estimator: str, backbone: str, sync: WeightSyncConfig) -> None:
    """Refuse what LoRA cannot be combined with (raised as a ValueError naming the field, as a section's checks)."""
    if lora.enabled and sync.encoding == "delta":
        raise ValueError("trainer.weight_sync.encoding: delta is for full fine-tuning; with model.lora a version "
                         "publishes the adapter alone (model.lora.sync: adapter), a few MB")
    if lora.enabled and adv_estimator == "gae" and backbone == "shared":
        raise ValueError("critic.backbone: shared puts the value head on the policy's transformer, which "
                         "model.lora freezes; use critic.backbone: separate (its own, fully trained model) with LoRA")


def weights_encoding(lora: LoraConfig) -> dict[str, str | float]:
    """The WeightsPublished fields (schemas/wire.py) saying what a version of a run with `lora` holds."""
    if lora.enabled and lora.sync == "adapter":
        return {"encoding": "adapter", "adapter_scale": lora.scale}
    return {"encoding": "full"}
