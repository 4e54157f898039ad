"""Token log-probs and entropy at real vocabulary size, without a [B, T, V] float32 copy of the batch's logits.

A causal LM's head turns hidden states [b, L, H] into logits [b, L, V]; at SmolLM2's 49k vocabulary a 16 x 160
token batch is 0.5 GB of float32 logits per copy, and log_softmax / softmax / their backward each want another.
Here the head is applied over chunks of the positions scored: each chunk's logits [c, V] are made, reduced to the
log-prob of the next token (gather - logsumexp) and the entropy, and dropped. Under autograd each chunk runs inside
a non-reentrant checkpoint, so backward recomputes one chunk's logits at a time instead of keeping every chunk's.
The trainer scores only the positions its loss reads (`response_mask`), not the prompt's.

The trainer needs this inside the model's own forward: under FSDP2 the head's weight is whole only while the root
module runs (it is the root unit, tied to the embedding), and the root's hooks must see the backward. So
`install(model)` replaces the output head's `forward` (not the module: parameter names stay as Hugging Face has
them), and `scoring(model, ids, ...)` makes that head return `[b, L, 2]` (log-prob, entropy) instead of logits for
the calls inside the block. With `value_head=` (the shared critic, trainer/critic.py) a third column is the value
head's output on the same hidden state: V_t beside the log-prob of token t, from one forward.

    .venv/bin/python -m pytest -q tests/unit/test_logprobs.py tests/integration/test_fsdp.py
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

#: Float32 logits made at once per chunk. 64 MiB: 341 tokens of a 49k vocabulary, the whole micro-batch of a small
#: one; large enough that the head's matmul stays efficient.
CHUNK_BYTES = 64 * 1024**2


def token_log_probs(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature)[token] [B, T]: position t scored by the logits at t - 1; position 0 gets 0.
    The reference the chunked head is held to (full logits; the trainer itself never makes them)."""
    z_BTV = logits_BTV[:, :-1].float() / temperature
    picked_BT = z_BTV.gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1)
    # gather - logsumexp avoids materialising a second [B, T, V] tensor for log_softmax.
    return F.pad(picked_BT - torch.logsumexp(z_BTV, dim=-1), (1, 0))


def _chunk_scores(
    hidden_bcH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_bc: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> torch.Tensor:
    """[b, c, 2]: log softmax(z)[target] and the entropy of softmax(z), z = head(hidden) / temperature (float32).

    The head's matmul runs in the weight's dtype, outside any autocast: under CPU bf16 autocast
    (trainer.mixed_precision) the weight is the float32 master, so the logits are float32 (bf16 logits of magnitude
    20 are off by ~0.05, which doubled the log-prob error against float32 on SmolLM2; MiniMax-M1 kept its head in
    float32 for the same reason). Under FSDP2's bf16 parameters (GPU) the weight is bf16 and so is the matmul; the
    softmax is float32 either way.
    """
    with torch.autocast(hidden_bcH.device.type, enabled=False):
        z_bcV = F.linear(hidden_bcH.to(weight_VH.dtype), weight_VH, bias_V).float() / temperature
        lse_bc = torch.logsumexp(z_bcV, dim=-1)
        logp_bc = z_bcV.gather(-1, targets_bc[..., None]).squeeze(-1) - lse_bc
        if not with_entropy:
            return torch.stack([logp_bc, torch.zeros_like(logp_bc)], dim=-1)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            # H = logsumexp(z) - sum_v softmax(z)_v z_v, as algorithms.entropy_from_logits
            entropy_bc = lse_bc - (torch.softmax(z_bcV, dim=-1) * z_bcV).sum(dim=-1)
        return torch.stack([logp_bc, entropy_bc], dim=-1)


def chunk_length(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Positions per chunk so that one chunk's float32 logits [c, V] stay within `chunk_bytes`."""
    return max(1, chunk_bytes // max(1, vocab * 4))


def selected_scores(
    hidden_xH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    src_N: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float,
    *,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """[N, 2]: (log-prob of targets_N[i], entropy) under the logits of hidden state src_N[i] of the flattened
    hidden states (any leading shape, [..., H]); the head runs over chunks of the N positions."""
    flat_xH = hidden_xH.reshape(-1, hidden_xH.shape[-1])
    step = chunk_length(weight_VH.shape[0], chunk_bytes)
    parts = []
    for start in range(0, len(src_N), step):
        # The gather stays outside the checkpoint: what it keeps is the chunk's [c, H] hidden states.
        args = (flat_xH[src_N[start:start + step]][None], weight_VH, bias_V, targets_N[None, start:start + step],
                temperature, with_entropy, entropy_grad)  # fmt: skip
        if torch.is_grad_enabled():  # keep only the chunk's inputs; backward recomputes its logits
            parts.append(checkpoint(_chunk_scores, *args, use_reentrant=False)[0])
        else:
            parts.append(_chunk_scores(*args)[0])
    if not parts:  # nothing to score: an empty [0, 2] still tied to the graph, so backward (and FSDP's hooks) run
        return flat_xH[:0, :1].float().expand(-1, 2)
    return torch.cat(parts)


def head_scores(
    hidden_bLH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    input_ids_bL: torch.Tensor,
    temperature: float,
    *,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """[b, L, 2]: position t's (log-prob of token t, entropy) under the logits at t - 1; position 0 gets (0, 0).

    Equal, within float tolerance, to `token_log_probs` / `entropy_from_logits` of the full logits.
    """
    b, L, _ = hidden_bLH.shape
    src_bL = torch.arange(b * L, device=hidden_bLH.device).view(b, L)[:, :-1]
    scores = selected_scores(hidden_bLH, weight_VH, bias_V, src_bL.reshape(-1), input_ids_bL[:, 1:].reshape(-1),
                             temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
                             chunk_bytes=chunk_bytes)  # fmt: skip
    return F.pad(scores.view(b, L - 1, 2), (0, 0, 1, 0))


def selected_values(hidden_xH: torch.Tensor, value_head: nn.Linear, src_N: torch.Tensor, *, grad: bool) -> torch.Tensor:
    """[N, 1]: the scalar value head on hidden state src_N[i] of the flattened hidden states (float32).

    As the output head, outside any autocast in the weight's dtype. `grad=False` detaches the hidden states: the
    value loss then trains the head alone, not the transformer under it (the shared critic's warm-up).
    """
    flat_NH = hidden_xH.reshape(-1, hidden_xH.shape[-1])[src_N]
    if not grad:
        flat_NH = flat_NH.detach()
    with torch.autocast(hidden_xH.device.type, enabled=False):
        return F.linear(flat_NH.to(value_head.weight.dtype), value_head.weight, value_head.bias).float()


@dataclass
class _Request:
    src_N: torch.Tensor | None  # flattened hidden-state positions to score; None: every position of input_ids_bL
    targets: torch.Tensor  # [N] tokens they predict, or input_ids_bL [b, L]
    temperature: float
    with_entropy: bool
    entropy_grad: bool
    chunk_bytes: int
    value_head: nn.Linear | None = None  # a third column: this head's value of the same hidden state
    value_grad: bool = True  # False: the value column's gradient stops at the hidden state


def _head_forward(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    request: _Request | None = self._rlbus_scoring
    if request is None:  # an ordinary call: logits, as the module's own forward
        return self._rlbus_forward(hidden)
    kw = dict(with_entropy=request.with_entropy, entropy_grad=request.entropy_grad, chunk_bytes=request.chunk_bytes)
    bias = getattr(self, "bias", None)
    if request.src_N is None:
        scores_bL2 = head_scores(hidden, self.weight, bias, request.targets, request.temperature, **kw)
        if request.value_head is None:
            return scores_bL2
        b, L, _ = hidden.shape
        src_N = torch.arange(b * L, device=hidden.device).view(b, L)[:, :-1].reshape(-1)
        values_bL1 = F.pad(selected_values(hidden, request.value_head, src_N, grad=request.value_grad)
                           .view(b, L - 1, 1), (0, 0, 1, 0))  # fmt: skip
        return torch.cat([scores_bL2, values_bL1], dim=-1)
    scores_N2 = selected_scores(hidden, self.weight, bias, request.src_N, request.targets, request.temperature, **kw)
    if request.value_head is not None:
        values_N1 = selected_values(hidden, request.value_head, request.src_N, grad=request.value_grad)
        scores_N2 = torch.cat([scores_N2, values_N1], dim=-1)  # [N, 3]
    # [1, N, 2 or 3], a tensor of its own: FSDP2 warns of (and in-place ops would break) a root output that is a view.
    return scores_N2.unsqueeze(0).clone()


def install(model: nn.Module) -> nn.Module:
    """Let `scoring(model, ...)` turn the output head's logits into chunked (log-prob, entropy); returns model.

    Only a plain linear head (`weight` [V, H], optional `bias`) is supported: what every Hugging Face causal LM has.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(f"model: the output head is a {type(head).__name__}, chunked log-probs need an nn.Linear")
    if not hasattr(head, "_rlbus_forward"):
        head._rlbus_forward = head.forward
        head._rlbus_scoring = None
        head.forward = types.MethodType(_head_forward, head)
    return model


@contextlib.contextmanager
def scoring(
    model: nn.Module,
    input_ids_bL: torch.Tensor | None,
    temperature: float,
    *,
    with_entropy: bool,
    entropy_grad: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
    select: tuple[torch.Tensor, torch.Tensor] | None = None,
    value_head: nn.Linear | None = None,
    value_grad: bool = True,
) -> Iterator[None]:
    """Within the block, `model(input_ids=input_ids_bL, ...).logits` is [b, L, 2] (log-prob, entropy), not logits;
    with `select=(src_N, targets_N)` it is [1, N, 2]: the scores of those flattened positions only
    (`selected_scores`; trainer/packing.py makes them). With `value_head`, a third column holds its value of the
    hidden state each log-prob came from (`selected_values`; it must be a module the forward has gathered, e.g. a
    child of the FSDP root).

    `model` must have been through `install`. Entropy carries a gradient only when `entropy_grad`; the values, into
    the transformer, only when `value_grad`.
    """
    head = model.get_output_embeddings()
    if not hasattr(head, "_rlbus_scoring"):
        raise RuntimeError("logprobs.scoring: call logprobs.install(model) first")
    src_N, targets = select if select is not None else (None, input_ids_bL)
    head._rlbus_scoring = _Request(src_N, targets, float(temperature), with_entropy, entropy_grad, chunk_bytes,
                                   value_head, value_grad)  # fmt: skip
    try:
        yield
    finally:
        head._rlbus_scoring = None
