"""The chunked output head gives the numbers of the full logits, values and gradients, and keeps no chunk's logits.

    .venv/bin/python -m pytest -q tests/unit/test_logprobs.py
"""

from __future__ import annotations

import pytest
import torch

from rlbus.trainer import algorithms as A
from rlbus.trainer import logprobs
from rlbus.trainer.engine import token_log_probs


def _full(hidden_bLH, weight_VH, ids_bL, temperature):
    logits = hidden_bLH @ weight_VH.T
    logp = token_log_probs(logits, ids_bL, temperature)
    ent = torch.nn.functional.pad(A.entropy_from_logits(logits[:, :-1].float() / temperature), (1, 0))
    return logp, ent


@pytest.mark.parametrize("chunk_bytes", [1, 3 * 4 * 5000 * 4, 1 << 30])  # one position per chunk, 4 per chunk, whole
def test_chunks_equal_the_full_logits_values_and_gradients(chunk_bytes: int) -> None:
    g = torch.Generator().manual_seed(0)
    b, L, H, V, temp = 3, 17, 32, 5000, 0.8  # a "larger vocabulary" than the hidden size, as real models have
    hidden = torch.randn(b, L, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) * 0.3).requires_grad_()
    ids = torch.randint(0, V, (b, L), generator=g)
    coef_logp, coef_ent = torch.randn(b, L, generator=g), torch.randn(b, L, generator=g)

    logp_ref, ent_ref = _full(hidden, weight, ids, temp)
    ((logp_ref * coef_logp).sum() + (ent_ref * coef_ent).sum()).backward()
    grads_ref = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    scores = logprobs.head_scores(hidden, weight, None, ids, temp, entropy_grad=True, chunk_bytes=chunk_bytes)
    assert scores.shape == (b, L, 2)
    torch.testing.assert_close(scores[..., 0], logp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores[..., 1], ent_ref, rtol=1e-5, atol=1e-5)
    assert torch.all(scores[:, 0] == 0)  # position 0 has no previous logits
    ((scores[..., 0] * coef_logp).sum() + (scores[..., 1] * coef_ent).sum()).backward()
    torch.testing.assert_close(hidden.grad, grads_ref[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.grad, grads_ref[1], rtol=1e-4, atol=1e-5)


def test_entropy_carries_no_gradient_unless_asked() -> None:
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    weight = torch.randn(40, 8, requires_grad=True)
    ids = torch.randint(0, 40, (2, 5))
    scores = logprobs.head_scores(hidden, weight, None, ids, 1.0, entropy_grad=False)
    scores[..., 1].sum().backward()  # the entropy column is a constant for autograd
    assert hidden.grad is None or torch.all(hidden.grad == 0)


def test_backward_keeps_no_chunk_logits() -> None:
    """What autograd holds after the forward is the chunks' inputs, not their [b, c, V] float32 logits."""
    b, L, H, V = 4, 64, 16, 8192
    hidden = torch.randn(b, L, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    ids = torch.randint(0, V, (b, L))
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        scores = logprobs.head_scores(hidden, weight, None, ids, 1.0, chunk_bytes=b * 8 * V * 4)
    assert max(saved) < b * 8 * V  # not even one chunk's logits stay alive between forward and backward
    scores.sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


def test_installed_head_scores_inside_the_model_and_is_plain_outside() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    model = logprobs.install(Qwen2ForCausalLM(cfg))
    assert "lm_head.weight" in model.state_dict()  # Hugging Face names unchanged
    ids = torch.randint(0, 300, (2, 9))
    logits = model(input_ids=ids).logits
    assert logits.shape == (2, 9, 300)
    with logprobs.scoring(model, ids, 0.7, with_entropy=True, chunk_bytes=2 * 3 * 300 * 4):
        scores = model(input_ids=ids).logits
    torch.testing.assert_close(scores[..., 0], token_log_probs(logits, ids, 0.7), rtol=1e-5, atol=1e-5)
    assert model(input_ids=ids).logits.shape == (2, 9, 300)  # the request ends with the block
