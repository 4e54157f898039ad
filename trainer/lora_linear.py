"""The forward and backward of one LoRA-adapted linear layer, as one autograd function.

peft's `Linear` computes `base(x) + lora_B(lora_A(dropout(x))) * scaling`: per layer, in the forward, two small
matrix products, a multiply and an add over the whole output, and in the backward their mirror images, one of them,
B's gradient `g^T h`, a product of a transposed [N, out] matrix with an [N, r] one, which CPU BLAS runs at about a
third of the speed of the same product the other way round. With every linear layer adapted that is 210 adapters on
SmolLM2-135M, and they cost the LoRA step much of what freezing the base saves.

`LoraLinear` (which `apply_lora` makes each peft `Linear` of the trainer's model) keeps peft's modules, parameters
and names, and computes the same function in fewer passes:

    forward    y = x W^T (+ b), then y += s (x_d A^T) B^T in place (one addmm; x_d = dropout(x), or x itself)
    backward   g_h = s g B                        [N, r]
               dB  = (h^T (s g))^T = s (h^T g)^T  [out, r]   the fast orientation, transposed afterwards
               dA  = g_h^T x_d                    [r, in]
               dx  = g W (+= g_h A when x_d is x) [N, in]    only when x needs a gradient

W and b are frozen (no gradient). On SmolLM2-135M at rank 8 a forward and backward runs 1.13x faster than with peft's
forward, and keeps less for the backward (bench/lora_layer.py; docs/benchmarks.md). Anything else (merged or
disabled adapters, several active adapters, a LoRA variant such as DoRA, extra arguments, autocast) takes peft's own
forward.

    .venv/bin/python -m pytest -q tests/unit/test_lora_linear.py
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora.layer import Linear as PeftLinear
from torch import nn


class _LoraLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, x_d: torch.Tensor, weight_OI: torch.Tensor, bias_O: torch.Tensor | None,
                a_RI: torch.Tensor, b_OR: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
        shape = x.shape
        x_NI, xd_NI = x.reshape(-1, shape[-1]), x_d.reshape(-1, shape[-1])
        h_NR = xd_NI @ a_RI.t()
        y_NO = torch.addmm(bias_O, x_NI, weight_OI.t()) if bias_O is not None else x_NI @ weight_OI.t()
        y_NO.addmm_(h_NR, b_OR.t(), alpha=scale)
        ctx.scale, ctx.same = scale, x_d is x
        ctx.save_for_backward(xd_NI, h_NR, weight_OI, a_RI, b_OR)
        return y_NO.view(*shape[:-1], weight_OI.shape[0])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xd_NI, h_NR, weight_OI, a_RI, b_OR = ctx.saved_tensors
        g_NO = g.reshape(-1, g.shape[-1])
        gh_NR = (g_NO @ b_OR).mul_(ctx.scale)
        grad_b = (h_NR.t() @ g_NO).mul_(ctx.scale).t().contiguous() if ctx.needs_input_grad[5] else None
        grad_a = gh_NR.t() @ xd_NI if ctx.needs_input_grad[4] else None
        in_shape = (*g.shape[:-1], weight_OI.shape[1])
        grad_x = grad_xd = None
        if ctx.needs_input_grad[0]:
            grad_x = g_NO @ weight_OI
            if ctx.same:
                grad_x.addmm_(gh_NR, a_RI)
            grad_x = grad_x.view(in_shape)
        if not ctx.same and ctx.needs_input_grad[1]:
            grad_xd = (gh_NR @ a_RI).view(in_shape)
        return grad_x, grad_xd, None, None, grad_a, grad_b, None


class LoraLinear(PeftLinear):
    """A peft LoRA `Linear` whose plain case (one active adapter, not merged) runs `_LoraLinearFn`."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        active = self.active_adapters
        if (args or kwargs or self.disable_adapters or self.merged or len(active) != 1 or active[0] not in self.lora_A
                or active[0] in self.lora_variant or torch.is_autocast_enabled(x.device.type)):  # fmt: skip
            return super().forward(x, *args, **kwargs)
        name = active[0]
        base, a, b = self.get_base_layer(), self.lora_A[name].weight, self.lora_B[name].weight
        frozen = not base.weight.requires_grad and (base.bias is None or not base.bias.requires_grad)
        if not isinstance(base, nn.Linear) or not frozen or not x.dtype == a.dtype == b.dtype == base.weight.dtype:
            return super().forward(x)
        drop = self.lora_dropout[name]
        x_d = drop(x) if isinstance(drop, nn.Dropout) and drop.training and drop.p > 0 else x
        return _LoraLinearFn.apply(x, x_d, base.weight, base.bias, a, b, float(self.scaling[name]))


def install(model: nn.Module) -> int:
    """Make every peft LoRA `Linear` of `model` a `LoraLinear` (in place; same parameters); returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is PeftLinear:
            module.__class__ = LoraLinear
            n += 1
    return n
