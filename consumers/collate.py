"""Turn stored trajectories into the trainer's batch: one TensorDict, every [B, T] tensor aligned with input_ids.

Each trajectory is stored in the TransferQueue as 1-D tensors (prompt_ids [P], response_ids [R], response_mask [R],
rollout_log_probs [R], versions [R]); the group's metadata (SampleMeta) carries its reward. The batch layout
(trainer/engine.py documents how it is consumed):

    input_ids            [B, T]  prompt then response, right-padded with pad_id
    attention_mask       [B, T]  1 on real tokens
    position_ids         [B, T]  0..len-1 on real tokens, 0 on padding
    response_mask        [B, T]  1 where the policy generated the token (tool output, prompt, padding: 0)
    rollout_log_probs    [B, T]  behaviour log-prob of the token at that position (0 where response_mask is 0)
    versions             [B, T]  policy version that generated the token (-1 elsewhere)
    token_level_rewards  [B, T]  the sample's reward on its last generated token, 0 elsewhere
    group_index          [B]     samples of one GRPO group share a value
    response_len         [B]     response tokens, tool output included (SampleMeta.response_len)
    truncated            [B]     bool: generation was cut at a length limit (finish_reason "length")
    teacher_log_probs    [B, T]  the distillation teacher's log-prob of the token (0 where response_mask is 0); only
                                 when the samples carry it (algorithm.distill: producers/teacher.py), all or none
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from tensordict import TensorDict

from rlbus.schemas.wire import SampleMeta

TRAJECTORY_FIELDS = ("prompt_ids", "response_ids", "response_mask", "rollout_log_probs", "versions")
#: Per-token fields a sample may carry beyond those, each [R], placed as rollout_log_probs is (0 off the mask).
OPTIONAL_TOKEN_FIELDS = ("teacher_log_probs",)


def collate(
    samples: Sequence[tuple[SampleMeta, Mapping[str, torch.Tensor]]],
    group_index: Sequence[int],
    *,
    pad_id: int = 0,
) -> TensorDict:
    """Build the [B, T] batch from (metadata, stored tensors) pairs; `group_index[i]` is sample i's group."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    if len(group_index) != len(samples):
        raise ValueError(f"group_index has {len(group_index)} entries for {len(samples)} samples")
    lengths = []
    for meta, t in samples:
        missing = [f for f in TRAJECTORY_FIELDS if f not in t]
        if missing:
            raise ValueError(f"trajectory {meta.key} lacks fields {missing}")
        p, r = t["prompt_ids"].numel(), t["response_ids"].numel()
        if (p, r) != (meta.prompt_len, meta.response_len):
            raise ValueError(f"trajectory {meta.key}: stored lengths ({p}, {r}) != announced "
                             f"({meta.prompt_len}, {meta.response_len})")
        lengths.append(p + r)
    B, T = len(samples), max(lengths)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    position_ids = torch.zeros((B, T), dtype=torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.float32)
    log_probs = torch.zeros((B, T), dtype=torch.float32)
    versions = torch.full((B, T), -1, dtype=torch.long)
    rewards = torch.zeros((B, T), dtype=torch.float32)
    optional = {}
    for name in OPTIONAL_TOKEN_FIELDS:
        have = [meta.key for meta, t in samples if name in t]
        if have and len(have) != B:
            lacking = [meta.key for meta, t in samples if name not in t]
            raise ValueError(f"{len(have)} of {B} samples carry {name}; {lacking[:3]} do not (all or none)")
        if have:
            optional[name] = torch.zeros((B, T), dtype=torch.float32)
    for i, (meta, t) in enumerate(samples):
        p, n = meta.prompt_len, lengths[i]
        input_ids[i, :p] = t["prompt_ids"]
        input_ids[i, p:n] = t["response_ids"]
        attention_mask[i, :n] = 1
        position_ids[i, :n] = torch.arange(n)
        mask = t["response_mask"].to(torch.float32)
        response_mask[i, p:n] = mask
        log_probs[i, p:n] = t["rollout_log_probs"].to(torch.float32) * mask  # exactly 0 off the mask
        versions[i, p:n] = torch.where(mask > 0, t["versions"].to(torch.long), -1)
        for name, out in optional.items():
            if t[name].numel() != n - p:
                raise ValueError(f"trajectory {meta.key}: {name} has {t[name].numel()} entries for {n - p} tokens")
            out[i, p:n] = torch.where(mask > 0, t[name].to(torch.float32), 0.0)
        generated = torch.nonzero(mask > 0)
        if len(generated):
            rewards[i, p + int(generated[-1])] = meta.reward
    return TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "rollout_log_probs": log_probs,
            "versions": versions,
            "token_level_rewards": rewards,
            "group_index": torch.as_tensor(list(group_index), dtype=torch.long),
            "response_len": torch.as_tensor([meta.response_len for meta, _ in samples], dtype=torch.long),
            "truncated": torch.as_tensor([meta.finish_reason == "length" for meta, _ in samples], dtype=torch.bool),
            **optional,
        },
        batch_size=[B],
    )
