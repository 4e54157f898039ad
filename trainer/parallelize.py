"""The one place where parallelism is applied to a model: activation checkpointing, then FSDP2 per block, then root.

Used by `trainer/engine.py` for the policy (and the frozen reference). FSDP2 (`fully_shard`) runs on gloo for CPU
tests and NCCL on GPUs; at world size 1 it still wraps the model so that one code path serves every run.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

MixedPrecision = Literal["none", "bf16"]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a Hugging Face causal LM (the `ModuleList` holding its `_no_split_modules`)."""
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            if not block_names or type(module[0]).__name__ in block_names:
                return module
    raise ValueError(f"model: found no ModuleList of decoder blocks in {type(model).__name__}")


def parallelize(
    model: nn.Module,
    *,
    device: torch.device,
    mixed_precision: MixedPrecision = "none",
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
) -> FSDPModule:
    """Shard `model` over the default process group (FSDP2) and return it (same object, now an FSDPModule).

    Order matters: checkpoint wrappers must sit inside the FSDP units, so that a recomputed block re-gathers
    its own parameters and nothing else; each block is its own unit so that only one block's full parameters
    are alive at a time; the root unit takes what is left (embeddings, final norm, LM head).
    """
    model.to(device)
    layers = decoder_layers(model)

    # 1. Activation checkpointing: recompute each block's activations in backward instead of keeping them.
    if activation_checkpointing:
        for i, block in enumerate(layers):
            layers[i] = checkpoint_wrapper(block)

    # 2. FSDP2 per block. bf16 compute with fp32 gradient reduction on GPU; full fp32 otherwise (gloo has no bf16
    #    reduce-scatter worth having and CPU bf16 matmuls are slow).
    if mixed_precision == "bf16":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp_policy = MixedPrecisionPolicy()
    for block in layers:
        fully_shard(block, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)

    # 3. The root: embeddings, final norm, LM head (tied weights stay together in this one unit). Not resharded
    #    after forward: backward needs it first anyway.
    fully_shard(model, mp_policy=mp_policy, reshard_after_forward=False)
    assert isinstance(model, FSDPModule)
    return model
