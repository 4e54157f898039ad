"""LoRA on the trainer's policy (`model.lora`, schemas/lora.py): inject the adapter, name and merge its tensors.

The adapter is injected into the Hugging Face model in place (`peft.inject_adapter_in_model`), not wrapped in a
`PeftModel`: the model keeps its class, its config and its module tree, so the chunked output head
(trainer/logprobs.py), FSDP2's per-block sharding (trainer/parallelize.py) and checkpoints work unchanged. A targeted
layer `...q_proj` becomes a peft `Linear` holding `q_proj.base_layer` (the frozen weight) and `q_proj.lora_A.default`,
`q_proj.lora_B.default`; every other parameter is frozen.

Names, in three spellings:

    trainer   model.layers.0.self_attn.q_proj.base_layer.weight, ....q_proj.lora_A.default.weight
    wire      model.layers.0.self_attn.q_proj.weight (merged), model.layers.0.self_attn.q_proj.lora_A.weight (adapter)
    peft dir  base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight (adapter_model.safetensors)

`merge_adapter` (common/lora.py) computes W + (alpha / r) B A for each targeted layer: the trainer's merged export and
merged sync, and a producer's application of an adapter-only version (producers/weight_sync.py), all use it.

    .venv/bin/python -m pytest -q tests/unit/test_lora.py tests/integration/test_lora.py
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from rlbus.common.lora import merge_adapter
from rlbus.schemas.lora import LoraConfig

ADAPTER_DIR = "adapter"  # in a checkpoint: the adapter's peft config; in an export: the peft adapter directory
BASE_FILE = "base.json"  # in a checkpoint's adapter/: the base model it was trained on (path and content digest)
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")
_PEFT_PREFIX = "base_model.model."
_DEFAULT = ".default"  # peft's adapter name, in the trainer's parameter names


def peft_config(cfg: LoraConfig) -> "peft.LoraConfig":  # noqa: F821 - peft is imported lazily (an extra)
    try:
        import peft
    except ImportError as e:
        raise ImportError("model.lora needs peft: pip install 'rlbus[lora]'") from e
    return peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                           target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")  # fmt: skip


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Inject `cfg`'s adapter into `model` (in place; A from torch's RNG, B zero) and freeze everything else."""
    from peft import inject_adapter_in_model

    from rlbus.trainer import lora_linear

    mode = model.training
    try:
        inject_adapter_in_model(peft_config(cfg), model)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"model.lora.target_modules: {cfg.target_modules} do not fit this model ({e})") from None
    model.train(mode)  # the new modules are made in training mode: their dropout would act in every pass
    lora_linear.install(model)  # the same modules, a forward and backward in fewer passes (trainer/lora_linear.py)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return model


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _clean(name: str) -> str:
    """A trainer parameter name with activation checkpointing's wrapper and peft's adapter name taken out."""
    return name.replace("._checkpoint_wrapped_module", "").replace(_DEFAULT, "")


def adapter_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a trainer state dict, in wire names (`...q_proj.lora_A.weight`)."""
    return {_clean(k): v for k, v in state.items() if is_adapter(k)}


def merged_state_dict(state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A trainer state dict with an adapter as the plain model's state dict: adapters merged, Hugging Face names."""
    plain = {_clean(k).replace(".base_layer.", "."): v for k, v in state.items() if not is_adapter(k)}
    plain.update(merge_adapter(plain, adapter_tensors(state), scale))
    return plain


@contextlib.contextmanager
def dropout_active(model: nn.Module, active: bool) -> Iterator[None]:
    """Run the adapter's dropout (peft's `lora_dropout` modules) in training mode inside the block: the model stays
    in eval mode otherwise, so scoring passes are deterministic and match the producers' log-probs."""
    drops = [m for n, m in model.named_modules() if "lora_dropout" in n and isinstance(m, nn.Dropout)]
    if not active or not drops:
        yield
        return
    for m in drops:
        m.train()
    try:
        yield
    finally:
        for m in drops:
            m.eval()


def save_adapter_config(cfg: LoraConfig, out_dir: str | os.PathLike, base_model: str = "") -> None:
    """peft's `adapter_config.json` of `cfg` in `out_dir` (a checkpoint's record of its adapter; an export's)."""
    pc = peft_config(cfg)
    pc.base_model_name_or_path = base_model or None
    pc.save_pretrained(str(out_dir))


def load_adapter_config(path: str | os.PathLike) -> LoraConfig:
    """The `LoraConfig` of an `adapter_config.json` this module wrote (in a checkpoint's `adapter/`)."""
    raw = json.loads((Path(path) / "adapter_config.json").read_text())
    return LoraConfig(rank=int(raw["r"]), alpha=float(raw["lora_alpha"]), dropout=float(raw.get("lora_dropout", 0.0)),
                      target_modules=sorted(raw["target_modules"]))  # fmt: skip


def save_adapter_dir(adapter: Mapping[str, torch.Tensor], cfg: LoraConfig, out_dir: str | os.PathLike,
                     base_model: str = "") -> Path:
    """A peft adapter directory (adapter_config.json, adapter_model.safetensors) that
    `peft.PeftModel.from_pretrained(base, out_dir)` loads: `adapter` in wire names."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_adapter_config(cfg, out, base_model)
    save_file({_PEFT_PREFIX + k: v.contiguous() for k, v in adapter.items()}, str(out / "adapter_model.safetensors"))
    return out


def base_record(model_path: str | os.PathLike, dtype: str = "float32") -> dict[str, str]:
    """What a LoRA checkpoint records of its base (it stores the adapter alone): where it was, a digest of its
    weight files' contents, so that a resume or an export from another base is refused, not silently wrong, and the
    dtype (model.dtype) the trainer held it in."""
    path = Path(model_path).resolve()
    return {"model_path": str(path), "digest": _digest(path, *_stamp(path)), "dtype": dtype}


def check_base(adapter_dir: str | os.PathLike, model_path: str | os.PathLike = "") -> tuple[Path, str]:
    """The base model directory of a checkpoint's adapter (`model_path` if given, else the one it recorded) and the
    dtype the trainer held it in; a ValueError names both directories if its weights are not those the adapter was
    trained on."""
    saved = json.loads((Path(adapter_dir) / BASE_FILE).read_text())
    path = Path(model_path or saved["model_path"])
    if not path.is_dir():
        raise ValueError(f"its base model {saved['model_path']} (model.path) is not there: the checkpoint holds the "
                         "adapter alone; put the base back, or name it")
    now = base_record(path)
    if now["digest"] != saved["digest"]:
        raise ValueError(f"its adapter was trained on the base model at {saved['model_path']} (digest "
                         f"{saved['digest'][:12]}), and the weights at {now['model_path']} differ (digest "
                         f"{now['digest'][:12]}); use that base model")
    return path, saved.get("dtype", "float32")


def _stamp(path: Path) -> tuple[tuple[str, int, int], ...]:
    files = sorted({f for pattern in _WEIGHT_FILES for f in path.glob(pattern)})
    return tuple((f.name, (st := f.stat()).st_size, st.st_mtime_ns) for f in files)


@functools.lru_cache(maxsize=8)
def _digest(path: Path, *stamp: tuple[str, int, int]) -> str:
    """sha256 over the weight files' names and bytes (about 0.9 s for SmolLM2's 538 MB here); cached while their
    sizes and modification times stay."""
    h = hashlib.sha256()
    for name, _, _ in stamp:
        h.update(name.encode() + b"\0")
        with (path / name).open("rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()
