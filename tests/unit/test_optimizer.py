"""The trainer's AdamW: the fused kernel (`trainer.fused_optimizer`, the default) is the default kernel's update.

    .venv/bin/python -m pytest -q tests/unit/test_optimizer.py
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from rlbus.schemas.config import TrainerConfig
from rlbus.trainer.engine import make_optimizer


def _train(fused: bool, steps: int = 30) -> tuple[list[torch.Tensor], torch.optim.AdamW]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    cfg = TrainerConfig(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), fused_optimizer=fused)
    opt = make_optimizer(list(model.parameters()), cfg)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()], opt


def test_fused_adamw_takes_the_same_steps_as_the_default_kernel() -> None:
    fused, opt_f = _train(True)
    plain, opt_p = _train(False)
    assert opt_f.param_groups[0]["fused"] is True and not opt_p.param_groups[0]["fused"]
    # 30 steps at lr 1e-2 with weight decay: the kernels differ only in float32 rounding (measured max 6e-8 on
    # weights of size ~0.3); 1e-6 absolute is far below one step's change (~1e-2), so a wrong moment, bias
    # correction or decay would fail it.
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for (pa, sa), (pb, sb) in zip(opt_f.state.items(), opt_p.state.items()):
        for k in ("exp_avg", "exp_avg_sq"):  # measured: within 3e-7 of each tensor's largest entry
            assert (sa[k] - sb[k]).abs().max() <= 1e-5 * sb[k].abs().max(), k
        assert float(sa["step"]) == float(sb["step"]) == 30.0


def test_a_torch_without_the_fused_kernel_falls_back_and_says_so(monkeypatch, caplog) -> None:
    real = torch.optim.AdamW

    def no_fused(params, *args, fused=None, **kwargs):
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        return real(params, *args, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", no_fused)
    with caplog.at_level(logging.WARNING, logger="rlbus.trainer"):
        opt = make_optimizer([nn.Parameter(torch.zeros(3))], TrainerConfig())
    assert not opt.param_groups[0]["fused"]
    assert "trainer.fused_optimizer" in caplog.text and "default kernel" in caplog.text


@pytest.mark.parametrize("fused", [True, False])
def test_the_config_picks_the_kernel(fused: bool) -> None:
    opt = make_optimizer([nn.Parameter(torch.zeros(3))], TrainerConfig(fused_optimizer=fused))
    assert bool(opt.param_groups[0]["fused"]) is fused
