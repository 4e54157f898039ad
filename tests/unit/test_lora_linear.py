"""trainer/lora_linear.py: `LoraLinear` computes what peft's `Linear` computes, value and gradients, and falls back
to peft's forward where it does not apply."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")

from rlbus.trainer.lora_linear import LoraLinear, install  # noqa: E402


class _Block(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj = nn.Linear(12, 20, bias=bias)
        self.down_proj = nn.Linear(20, 7, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.tanh(self.q_proj(x)))


def _pair(bias: bool, dropout: float) -> tuple[nn.Module, nn.Module]:
    """The same adapted block twice: peft's Linear, and LoraLinear (B made non-zero so that it counts)."""
    torch.manual_seed(0)
    ref = _Block(bias).double()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "down_proj"])
    peft.inject_adapter_in_model(cfg, ref)
    for name, p in ref.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_B" in name:
            nn.init.normal_(p)
    ours = copy.deepcopy(ref)
    assert install(ours) == 2
    assert all(type(m) is LoraLinear for n, m in ours.named_modules() if n in ("q_proj", "down_proj"))
    return ref, ours


def _run(model: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = x.detach().clone().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    y = model(x)
    (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    if x.requires_grad:
        grads["x"] = x.grad
    return y.detach(), grads


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("x_grad", [False, True])
def test_same_output_and_gradients_as_peft(bias: bool, dropout: float, x_grad: bool) -> None:
    ref, ours = _pair(bias, dropout)
    ref.train(), ours.train()
    x = torch.randn(3, 5, 12, dtype=torch.float64).requires_grad_(x_grad)
    y_ref, g_ref = _run(ref, x, seed=1)
    y_ours, g_ours = _run(ours, x, seed=1)
    torch.testing.assert_close(y_ours, y_ref)
    assert g_ours.keys() == g_ref.keys() and len(g_ref) == 4 + x_grad
    for name in g_ref:
        torch.testing.assert_close(g_ours[name], g_ref[name], msg=name)
        assert g_ours[name].is_contiguous()


def test_no_grad_and_eval_match_peft() -> None:
    ref, ours = _pair(bias=True, dropout=0.5)
    ref.eval(), ours.eval()  # dropout off: the scoring passes
    x = torch.randn(2, 12, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x))


def test_falls_back_to_peft_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlbus.trainer import lora_linear

    ref, ours = _pair(bias=False, dropout=0.0)
    x = torch.randn(4, 12, dtype=torch.float64)
    calls = []
    real = lora_linear._LoraLinearFn.apply
    monkeypatch.setattr(lora_linear._LoraLinearFn, "apply", lambda *a: calls.append(1) or real(*a))
    ours(x)
    assert len(calls) == 2
    q = ours.q_proj
    q.merge()  # merged: peft's forward, the merged base layer alone
    torch.testing.assert_close(q(x), ref.q_proj(x))
    assert len(calls) == 2
    q.unmerge()
    q.base_layer.weight.requires_grad_(True)  # a base that trains: not this function's case
    torch.testing.assert_close(q(x), ref.q_proj(x))
    assert len(calls) == 2
    q.base_layer.weight.requires_grad_(False)
    q_float = copy.deepcopy(q).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: peft's forward
        assert q_float(x.float()).dtype == torch.bfloat16
    assert len(calls) == 2
    torch.testing.assert_close(q(x), ref.q_proj(x))
    assert len(calls) == 3
