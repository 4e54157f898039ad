"""The merge of a LoRA adapter into its base weights: W + scale * B A, in the wire names of trainer/lora.py.

Neutral ground: the trainer merges to export and to publish merged weights, a producer merges an adapter-only
version into the base weights it was built from (producers/weight_sync.py). Torch only, no peft.

    .venv/bin/python -m pytest -q tests/unit/test_lora.py
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def adapter_layers(adapter: Mapping[str, torch.Tensor]) -> list[str]:
    """The layers an adapter (wire names) changes, as the names of their weights (`...q_proj.weight`)."""
    return sorted(f"{k[: -len(LORA_A)]}.weight" for k in adapter if k.endswith(LORA_A))


def merge_adapter(base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor],
                  scale: float) -> dict[str, torch.Tensor]:
    """`{layer.weight: W + scale * B @ A}` for each layer of `adapter` (wire names), W from `base`, in W's dtype.

    The product is computed in float32 (as peft's own merge on CPU); a layer without its W in `base` raises KeyError.
    """
    merged: dict[str, torch.Tensor] = {}
    for name_a, a_RI in adapter.items():
        if not name_a.endswith(LORA_A):
            continue
        layer = name_a[: -len(LORA_A)]
        b_OR = adapter[layer + LORA_B]
        w_OI = base[f"{layer}.weight"]
        delta_OI = (b_OR.float() @ a_RI.float()) * scale
        merged[f"{layer}.weight"] = (w_OI.float() + delta_OI).to(w_OI.dtype)
    return merged
