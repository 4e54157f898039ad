"""The tiny Qwen2-style causal LM of the quickstart: standard `transformers` classes, small enough for CPU RL.

About 0.12M parameters (hidden 64, 2 layers, 4 query / 2 key-value heads, tied embeddings): the quickstart's skills
are choosing the tool and copying digits (two attention layers suffice), and a model this small warm-starts in a
minute or two on one CPU thread and keeps a GRPO step of the quickstart to a second or two. (At hidden 128 and 4
layers, six times the compute per token, the copy became reliable no sooner per step.)
Being a stock Qwen2ForCausalLM, it loads anywhere a real model does (AutoModelForCausalLM, vLLM, FSDP2).

Built by `rlbus init-model OUT_DIR` (common/model/init_model.py).
"""

from __future__ import annotations

import msgspec
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)


class TinyModelSpec(msgspec.Struct, kw_only=True, frozen=True):
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # grouped-query attention, as in Qwen2
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    vocab_multiple: int = 64  # embedding rows are padded up to a multiple of this (ids beyond the tokenizer unused)

    head_dim: int = 0  # width of one attention head; 0 = hidden_size / num_attention_heads (Qwen2's only choice)

    @classmethod
    def with_head_dim(cls, head_dim: int) -> "TinyModelSpec":
        """The default shape with its 4 query / 2 key-value heads `head_dim` wide, the width unchanged. 16 is the
        quickstart's; vLLM's CPU attention kernels take 32 and up. (Tried first: 2 heads of 32 learned half as much
        in the quickstart's 45 steps, reward 0.24 -> 0.40; width 128 with 4 heads of 32 did not warm-start in the
        quickstart's warm start of 1200 steps then, reward 0.)"""
        base = cls()
        return base if head_dim == base.hidden_size // base.num_attention_heads else cls(head_dim=head_dim)


def tiny_config(tokenizer: PreTrainedTokenizerBase, spec: TinyModelSpec = TinyModelSpec()) -> PretrainedConfig:
    """A Qwen2Config sized for `tokenizer`, with its eos (<|im_end|>) and pad ids. Heads of their own width
    (`spec.head_dim`) need a LlamaConfig with attention biases: the same layers as Qwen2's, but Qwen2's classes (in
    transformers and in vLLM) derive the head width from the model width."""
    vocab = -(-len(tokenizer) // spec.vocab_multiple) * spec.vocab_multiple
    common = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    if spec.head_dim and spec.head_dim != spec.hidden_size // spec.num_attention_heads:
        return LlamaConfig(**common, head_dim=spec.head_dim, attention_bias=True, mlp_bias=False)
    return Qwen2Config(**common, use_sliding_window=False)


def tiny_model(tokenizer: PreTrainedTokenizerBase, *, seed: int = 0, spec: TinyModelSpec = TinyModelSpec()) -> PreTrainedModel:
    """A freshly initialised tiny model (deterministic for a given seed)."""
    config = tiny_config(tokenizer, spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.float()


if __name__ == "__main__":
    from rlbus.common.model.tokenizer import build_tokenizer

    m = tiny_model(build_tokenizer())
    print(m.config)
    print(f"{sum(p.numel() for p in m.parameters()):,} parameters")
