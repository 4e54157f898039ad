"""The delta between two weight versions: what changed, bit for bit, as sparse indices and values per tensor.

    delta = encode_delta(old, new)             # trainer: .tensors {name::idx, name::val} or {name::all}, .density
    fresh = apply_delta(old, delta.tensors)    # producer: new tensors for the changed names (old is never written)

Encoding, per tensor, in the dtype the versions are published in (trainer.weight_sync.dtype):

    unchanged          absent
    sparse             `name::idx` int32 [k] (flat positions whose bits changed) and `name::val` [k] (their new values)
    dense              `name::all` the whole new tensor, when k * (4 + itemsize) >= numel * itemsize

Why this one: a change is found by comparing bit patterns (an integer view), so the result is exact (no float
arithmetic, -0.0 and NaN payloads included) and `apply_delta` reproduces the new version bit for bit; it is two
vectorised torch ops per tensor (compare, nonzero / index_put), at memory speed and with no compressor to feed on the
trainer's CPU. The dense fallback bounds the worst case at the full size plus a few bytes: under float32, AdamW moves
nearly every weight every step (its update is lr * m / sqrt(v), non-zero wherever a gradient ever was), so a
float32 delta is dense; in bfloat16 most of those moves are below half a unit in the last place and leave the
rounded weight as it was, which is where the sparse form pays (docs/benchmarks.md measures both on SmolLM2).
XOR of the bits with a general-purpose compressor would shave a float32 delta somewhat (the high bits of a small
change XOR to zero) at the price of compressing and decompressing the whole model every version on the CPU.

    .venv/bin/python -m pytest -q tests/unit/test_delta.py
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

IDX, VAL, ALL = "::idx", "::val", "::all"
_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers of its width, flat (a view where the tensor is contiguous)."""
    return t.contiguous().reshape(-1).view(_INT_OF[t.element_size()])


class Delta(NamedTuple):
    tensors: dict[str, torch.Tensor]  # the encoding (module doc)
    num_changed: int  # values whose bits changed
    num_values: int  # values in the version

    @property
    def density(self) -> float:
        return self.num_changed / max(1, self.num_values)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def encode_delta(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> Delta:
    """What changed from `old` to `new` (same names, shapes and dtypes), per tensor sparse or dense (module doc)."""
    if old.keys() != new.keys():
        raise ValueError(f"delta: versions hold other tensors ({sorted(old.keys() ^ new.keys())[:3]})")
    out: dict[str, torch.Tensor] = {}
    num_changed = 0
    for name, t_new in new.items():
        t_old = old[name]
        if t_old.shape != t_new.shape or t_old.dtype != t_new.dtype:
            raise ValueError(f"delta: {name} changed shape or dtype ({tuple(t_old.shape)} {t_old.dtype} -> "
                             f"{tuple(t_new.shape)} {t_new.dtype})")
        changed_N = (_bits(t_old) != _bits(t_new)).nonzero().reshape(-1)
        k = changed_N.numel()
        num_changed += k
        if k == 0:
            continue
        if k * (4 + t_new.element_size()) >= t_new.numel() * t_new.element_size():
            out[name + ALL] = t_new.contiguous()
        else:
            out[name + IDX] = changed_N.to(torch.int32)
            out[name + VAL] = t_new.contiguous().reshape(-1)[changed_N]
    return Delta(out, num_changed, sum(t.numel() for t in new.values()))


def apply_delta(old: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The new tensors of the names `delta` changes (fresh tensors; `old`'s are read, never written)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in delta.items():
        if key.endswith(ALL):
            name = key[: -len(ALL)]
            if tuple(t.shape) != tuple(old[name].shape) or t.dtype != old[name].dtype:
                raise ValueError(f"delta: {name} does not fit the version it applies to")
            out[name] = t.clone()
        elif key.endswith(IDX):
            name = key[: -len(IDX)]
            fresh = old[name].clone()
            fresh.view(-1)[t.long()] = delta[name + VAL].to(fresh.dtype)
            out[name] = fresh
        elif not key.endswith(VAL):
            raise ValueError(f"delta: {key!r} is neither {IDX}, {VAL} nor {ALL}")
    return out
