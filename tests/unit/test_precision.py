"""bf16 on CPU: the forward's context (`parallelize.compute_precision`) and a float32 output head inside it.

    .venv/bin/python -m pytest -q tests/unit/test_precision.py
"""

from __future__ import annotations

import torch

from rlbus.trainer import logprobs
from rlbus.trainer.parallelize import compute_precision

CPU = torch.device("cpu")


def test_bf16_on_cpu_is_autocast_and_none_is_nothing() -> None:
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    with compute_precision(CPU, "bf16"):
        assert (a @ b).dtype == torch.bfloat16
    with compute_precision(CPU, "none"):
        assert (a @ b).dtype == torch.float32


def test_the_output_head_stays_float32_under_bf16_autocast() -> None:
    """Log-probs and entropy under the trainer's bf16 context equal float32's exactly (the head opts out of
    autocast), values and gradients; a bf16 head would be off by ~1e-2 at these logit sizes."""
    g = torch.Generator().manual_seed(0)
    b, L, H, V = 2, 9, 32, 3000
    hidden = torch.randn(b, L, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    ids = torch.randint(0, V, (b, L), generator=g)
    ref = logprobs.head_scores(hidden, weight, None, ids, 1.0, entropy_grad=True)
    ref.sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    with compute_precision(CPU, "bf16"):
        got = logprobs.head_scores(hidden, weight, None, ids, 1.0, entropy_grad=True)
    got.sum().backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close((hidden.grad, weight.grad), grads, rtol=0, atol=0)
    # what the opt-out avoids: the same head in bf16
    z16 = (hidden.detach().bfloat16() @ weight.detach().bfloat16().T).float()
    logp16 = torch.log_softmax(z16[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert (logp16 - ref[:, 1:, 0].detach()).abs().max() > 1e-2
