"""Trainer checkpoints with torch.distributed.checkpoint (sharded, every rank writes its part), and HF export.

Layout under a checkpoint root (`<run_dir>/checkpoints`):

    step_00000010/            one checkpoint, complete or absent (written as .tmp-step_00000010, then renamed)
        __0_0.distcp ...      DCP shards: model + optimizer (+ LR schedule, update count)
        .metadata
        extra.json            the service's blob (step, version, feeder position, trained group ids, ...)
        rng/rank_00000.pt     each rank's RNG states
        hf/config.json        the model's Hugging Face config, for export_hf
    latest                    the name of the newest complete checkpoint (replaced atomically)

    python -c "from rlbus.trainer.checkpoint import export_hf; export_hf('runs/x/checkpoints/step_00000010', 'out', 'model')"

Tests: `pytest tests/integration/test_fsdp.py -k checkpoint`.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rlbus.schemas.errors import RlbusError
from rlbus.trainer.dist import barrier, rank

if TYPE_CHECKING:  # the engine imports FSDP and transformers' models; checkpoints need only its attributes
    from rlbus.trainer.engine import TrainEngine

T = TypeVar("T")
LATEST = "latest"
_PREFIX = "step_"


class CheckpointError(RlbusError):
    """A checkpoint is missing or incomplete."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"checkpoint {self.path}: {reason}")


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX))


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` points at, or None when `root` holds none."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not (path / ".metadata").is_file():
        raise CheckpointError(path, "`latest` points at a directory that holds no complete checkpoint")
    return path


def save_checkpoint(engine: TrainEngine, root: str | os.PathLike, step: int, extra: Any, *, keep: int = 2) -> Path:
    """Save `engine.state_dict()` and `extra` (anything msgspec encodes) as checkpoint `step`; keep the newest `keep`.

    A collective: every rank calls it with the same arguments. `root` must be one directory all ranks see.
    """
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{final.name}"
    if rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crash mid-save; never pointed at
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
    barrier()
    dcp.save(engine.state_dict(), checkpoint_id=tmp)
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank():05d}.pt")
    if rank() == 0:
        (tmp / "extra.json").write_bytes(msgspec.json.encode(extra))
        AutoConfig.from_pretrained(engine.model_path).save_pretrained(tmp / "hf")
    barrier()
    if rank() == 0:
        if final.exists():  # the same step saved again (a resumed run): the new one wins
            shutil.rmtree(final)
        os.rename(tmp, final)
        _write_atomic(root / LATEST, final.name.encode())
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old)
    barrier()
    return final


def load_checkpoint(engine: TrainEngine, path: str | os.PathLike, extra_type: type[T] | None = None) -> T | Any | None:
    """Restore `engine` (model, optimizer, LR schedule, update count, this rank's RNG) from a checkpoint.

    `path` is a checkpoint directory, or a root whose `latest` pointer names one; a root with no `latest` (or no
    root at all) is a fresh start and returns None. Otherwise returns the extra blob, decoded into `extra_type` when
    given (else JSON builtins). A collective: every rank calls it, with the same path.
    """
    path = Path(path)
    if not path.name.startswith(_PREFIX):
        found = latest_checkpoint(path)
        if found is None:
            return None
        path = found
    if not (path / ".metadata").is_file():
        raise CheckpointError(path, "no DCP metadata (not a checkpoint, or an incomplete one)")
    state = engine.state_dict()
    dcp.load(state, checkpoint_id=path)
    engine.load_state_dict(state)
    rng_file = path / "rng" / f"rank_{rank():05d}.pt"
    if rng_file.is_file():  # absent when resuming with more ranks than saved: those ranks keep their seeds
        _set_rng_state(torch.load(rng_file, weights_only=False))
    raw = (path / "extra.json").read_bytes()
    return msgspec.json.decode(raw, type=extra_type) if extra_type is not None else msgspec.json.decode(raw)


def export_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, tokenizer_src: str | os.PathLike) -> Path:
    """Write a Hugging Face model directory (config, safetensors weights, tokenizer) from a trainer checkpoint.

    Runs in one process without a process group (DCP reads every shard). The result loads with
    `AutoModelForCausalLM.from_pretrained(out_dir)`.
    """
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    if not (ckpt_dir / ".metadata").is_file() or not (ckpt_dir / "hf" / "config.json").is_file():
        raise CheckpointError(ckpt_dir, "not a complete trainer checkpoint (needs .metadata and hf/config.json)")
    config = AutoConfig.from_pretrained(ckpt_dir / "hf")
    model = AutoModelForCausalLM.from_config(config)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=ckpt_dir)
    model.load_state_dict(state["model"])
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(tokenizer_src).save_pretrained(out_dir)
    return out_dir
