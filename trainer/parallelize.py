"""The one place where parallelism is applied to a model: activation checkpointing, then FSDP2 per block, then root.

Used by `trainer/engine.py` for the policy (and the frozen reference). FSDP2 (`fully_shard`) runs on gloo for CPU
tests and NCCL on GPUs; at world size 1 it still wraps the model so that one code path serves every run.

Mixed precision (`trainer.mixed_precision: bf16`) keeps float32 master weights, gradients and optimizer state on
every device; only the compute changes. On GPU FSDP2 casts the gathered parameters to bf16 (`MixedPrecisionPolicy`,
which also halves the all-gather). On CPU the forward runs under `torch.autocast("cpu", bfloat16)` instead
(`compute_precision`): its matmuls run in bf16 while norms, softmax and the chunked output head stay float32 on the
float32 parameters (measured on SmolLM2-135M, bench/bf16.py: about as fast as FSDP2's cast, under half its log-prob
error).
"""

from __future__ import annotations

import contextlib
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

    # 2. FSDP2 per block. bf16 compute with fp32 gradient reduction on GPU; fp32 parameters on CPU, where bf16 comes
    #    from autocast around the forward (`compute_precision`).
    if mixed_precision == "bf16" and device.type != "cpu":
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


def compute_precision(device: torch.device, mixed_precision: MixedPrecision) -> contextlib.AbstractContextManager:
    """The context a forward of a `parallelize`d model runs in: bf16 autocast on CPU with `bf16`, else nothing.

    Backward needs no context: autograd replays each op in the dtype its forward used. The output head opts out
    (trainer/logprobs.py computes its logits in the weight's own dtype, float32 here).
    """
    if mixed_precision == "bf16" and device.type == "cpu":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()
