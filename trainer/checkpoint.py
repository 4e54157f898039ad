"""Trainer checkpoints with torch.distributed.checkpoint (sharded, every rank writes its part), and HF export.

Layout under a checkpoint root (`<run_dir>/checkpoints`):

    step_00000010/            one checkpoint, complete or absent (written as .tmp-step_00000010, then renamed)
        __0_0.distcp ...      DCP shards: model + optimizer (+ LR schedule, update count)
        .metadata
        extra.json            the service's blob (step, version, feeder position, trained group ids, ...)
        rng/rank_00000.pt     each rank's RNG states
        hf/config.json        the model's Hugging Face config, for export_hf
        adapter/adapter_config.json  model.lora's adapter (peft's config; its tensors are in the shards, the
                              frozen base is not: adapter/base.json names model.path and its weights' digest)
        critic_hf/config.json the value model's (adv_estimator: gae; its state is under "critic" in the shards, or,
                              with critic.backbone: shared, the head's under "model" as value_head.*)
    latest                    the name of the newest complete checkpoint (replaced atomically)

    python -c "from rlbus.trainer.checkpoint import export_hf; export_hf('runs/x/checkpoints/step_00000010', 'out', 'model')"

Loading never runs code from the checkpoint, so an untrusted run directory can be resumed, replayed or exported:
DCP's `.metadata` is a pickle (its FileSystemReader reads it with a bare `pickle.load`), so it is read here by an
unpickler that admits only the globals DCP metadata references (`_DCP_METADATA_GLOBALS`) and handed to DCP ready-made;
the non-tensor entries of the shards (LR schedule, optimizer hyper-parameters, update count), which DCP's default
planner reads with `torch.load(weights_only=False)`, and the RNG files go through `torch.load(weights_only=True)`.
Anything else raises `UnsafeCheckpointError` naming the file and the global it refused.

Tests: `pytest tests/integration/test_fsdp.py -k checkpoint`, `pytest tests/integration/test_safe_loading.py`.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import msgspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from rlbus.common.files import write_atomic
from rlbus.schemas.errors import RlbusError
from rlbus.trainer.critic import BACKBONE_KEY, VALUE_HEAD
from rlbus.trainer.dist import all_reduce, barrier, rank
from rlbus.trainer.lora import ADAPTER_DIR

if TYPE_CHECKING:  # the engine imports FSDP and transformers' models; checkpoints need only its attributes
    from rlbus.trainer.engine import TrainEngine

T = TypeVar("T")
LATEST = "latest"
CRITIC_HF = "critic_hf"  # the critic's config inside a checkpoint; `export_hf` writes the critic to out_dir/critic
_PREFIX = "step_"
_NAME = re.compile(r"step_[0-9]+")


class CheckpointError(RlbusError):
    """A checkpoint is missing or incomplete."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"checkpoint {self.path}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:  # DCP gathers a rank's exception to every rank by pickling it
        return type(self), (self.path, self.reason)


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file would run code when loaded, or holds what no checkpoint of ours holds: refused unread.

    `path` is the file, `forbidden` the global it references (`module.name`), or "" when the file is malformed.
    """

    def __init__(self, path: str | os.PathLike, reason: str, forbidden: str = ""):
        self.forbidden = forbidden
        super().__init__(path, reason)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.reason, self.forbidden)


# ---------------------------------------------------------------------------------------------------------------
# safe loading

#: Every global a DCP `.metadata` pickle references (found by saving a checkpoint and listing the pickle's
#: globals): DCP's metadata dataclasses, the shard index entry, torch.Size, a layout by name, the checkpoint id as a
#: path; dtypes (`torch.<dtype>`) are admitted by `_TORCH_DTYPES`. All of them only build plain values.
_DCP_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
})  # fmt: skip
_TORCH_DTYPES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` file, refusing every global outside `_DCP_METADATA_GLOBALS` (and dtypes)."""

    def __init__(self, file: IO[bytes], path: Path):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_GLOBALS or (module == "torch" and name in _TORCH_DTYPES):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            self._path,
            f"refusing to unpickle `{module}.{name}`: DCP metadata references only its own dataclasses, "
            "torch.Size, dtypes and layouts (a planted pickle would run code here)",
            forbidden=f"{module}.{name}",
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(self._path, "a DCP metadata file holds no persistent ids")


def _read_metadata(ckpt: Path) -> Metadata:
    """The checkpoint's DCP metadata, unpickled by `_MetadataUnpickler` and checked for shape."""
    file = ckpt / ".metadata"
    try:
        data = file.read_bytes()
    except OSError as e:
        raise CheckpointError(file, f"cannot read DCP metadata: {e}") from None
    try:
        md = _MetadataUnpickler(io.BytesIO(data), file).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a hostile file makes the unpickler raise is a bad file
        raise UnsafeCheckpointError(file, f"not a DCP metadata file ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise UnsafeCheckpointError(file, f"not a DCP metadata file (holds a {type(md).__name__})")
    for key, item in md.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(item, (TensorStorageMetadata, BytesStorageMetadata)):
            raise UnsafeCheckpointError(file, f"entry {key!r} is not DCP storage metadata")
    if not isinstance(md.storage_data, dict):
        raise UnsafeCheckpointError(file, "no shard index (storage_data)")
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise UnsafeCheckpointError(file, "shard index entries must be MetadataIndex -> _StorageInfo")
        name = info.relative_path
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            # DCP opens `<checkpoint>/<relative_path>`: a path with a directory in it could read any file
            raise UnsafeCheckpointError(file, f"shard file {name!r} is not a file name inside the checkpoint")
    return md


def _weights_only_failure(e: Exception) -> tuple[str, str]:
    """(the global refused, as `module.name`, or ""; what was refused) from torch's weights-only unpickler error."""
    text = str(e)  # a paragraph of torch's advice (to retry with weights_only=False: not here), then what failed
    found = re.search(r"GLOBAL ([\w.]+)", text)  # "Unsupported global: GLOBAL getattr ..." / "... GLOBAL posix.system"
    if found:
        name = found.group(1) if "." in found.group(1) else f"builtins.{found.group(1)}"
        return name, f"refusing to unpickle `{name}`"
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()] or [text]
    detail = next((p for p in paragraphs if "WeightsUnpickler error:" in p), paragraphs[min(1, len(paragraphs) - 1)])
    return "", f"refusing to unpickle it ({detail.replace('WeightsUnpickler error:', '').strip()[:300]})"


def _load_plain(src: str | os.PathLike | IO[bytes], path: Path, what: str) -> Any:
    """`torch.load(weights_only=True)`: tensors and plain Python values only; anything else raises."""
    try:
        return torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        forbidden, reason = _weights_only_failure(e)
        raise UnsafeCheckpointError(
            path, f"{what}: {reason}; it may hold only tensors and plain values", forbidden=forbidden
        ) from None
    except Exception as e:  # noqa: BLE001 - not a torch file, truncated, ...: a bad file, whatever torch raises
        raise UnsafeCheckpointError(path, f"{what} cannot be read ({type(e).__name__}: {e})") from None


class _SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's default planner, but the non-tensor entries are read with `weights_only=True`, not a full unpickle."""

    def __init__(self, ckpt: Path):
        super().__init__()
        self._ckpt = ckpt

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        info = getattr(getattr(self, "metadata", None), "storage_data", {}).get(read_item.storage_index)
        obj = _load_plain(value, self._ckpt / info.relative_path if info else self._ckpt, f"entry {fqn!r}")
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader, handed metadata read by `_read_metadata` instead of unpickling `.metadata` itself."""

    def __init__(self, ckpt: Path, metadata: Metadata):
        super().__init__(ckpt)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files (saves without collectives): never ours
            raise CheckpointError(self.path, "has no global DCP metadata")
        md = self._metadata
        if getattr(md, "storage_meta", None) is None:  # as FileSystemReader.read_metadata
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def _dcp_load(state: dict[str, Any], ckpt: Path, metadata: Metadata | None = None) -> None:
    """`dcp.load(state, checkpoint_id=ckpt)` without unpickling anything from the checkpoint beyond plain values
    (`metadata`: the checkpoint's, when the caller has already read it)."""
    reader = _SafeReader(ckpt, metadata if metadata is not None else _read_metadata(ckpt))
    try:
        dcp.load(state, checkpoint_id=ckpt, storage_reader=reader, planner=_SafeLoadPlanner(ckpt))
    except CheckpointException as e:  # DCP gathers every rank's failure; ours say what was refused
        ours = [exc for exc, _ in e.failures.values() if isinstance(exc, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise


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


def _load_rng_state(file: Path) -> dict[str, Any]:
    state = _load_plain(file, file, "RNG state")
    cuda = state.get("cuda", []) if isinstance(state, dict) else None
    ok = (isinstance(state, dict) and isinstance(state.get("torch"), torch.Tensor)
          and state["torch"].dtype == torch.uint8 and isinstance(state.get("python"), tuple)
          and isinstance(cuda, list) and all(isinstance(t, torch.Tensor) for t in cuda))  # fmt: skip
    if not ok:
        raise UnsafeCheckpointError(
            file,
            "RNG state must be {'torch': ByteTensor, 'python': random.getstate() "
            "tuple, optionally 'cuda': [ByteTensor]}",
        )
    return state


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _NAME.fullmatch(p.name))


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` points at, or None when `root` holds none."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text(errors="replace").strip()
    if not _NAME.fullmatch(name):  # a checkpoint beside the pointer, never a path elsewhere
        raise CheckpointError(pointer, f"`latest` must name a step_<N> directory beside it, not {name[:80]!r}")
    path = Path(root) / name
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
        if getattr(engine, "lora", None) is not None and engine.lora.enabled:
            from rlbus.trainer.lora import BASE_FILE, base_record, save_adapter_config

            save_adapter_config(engine.lora, tmp / ADAPTER_DIR, engine.model_path)
            base = base_record(engine.model_path, getattr(engine, "dtype", "float32"))
            (tmp / ADAPTER_DIR / BASE_FILE).write_bytes(msgspec.json.encode(base))
        critic = getattr(engine, "critic", None) or getattr(engine, "value_head", None)
        if critic is not None:
            critic.save_config(tmp / CRITIC_HF)
    barrier()
    if rank() == 0:
        if final.exists():  # the same step saved again (a resumed run): the new one wins
            shutil.rmtree(final)
        os.rename(tmp, final)
        write_atomic(root / LATEST, final.name.encode())
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old)
    barrier()
    return final


def discard_after(root: str | os.PathLike, step: int) -> list[Path]:
    """Delete the checkpoints after `step` and point `latest` at `step`'s (the stability guard's rollback: the
    steps after it are dropped, and a restart or a replay must never resume from them). Rank 0 only; returns what
    was deleted."""
    root = Path(root)
    keep = root / checkpoint_name(step)
    if not (keep / ".metadata").is_file():
        raise CheckpointError(keep, "no complete checkpoint to roll back to")
    write_atomic(root / LATEST, keep.name.encode())  # first: a crash mid-way resumes from `step`, never later
    gone = [p for p in list_checkpoints(root) if int(p.name[len(_PREFIX):]) > step]
    for p in gone:
        shutil.rmtree(p)
    return gone


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
    rng_file = path / "rng" / f"rank_{rank():05d}.pt"
    rng, refused = None, None
    if rng_file.is_file():  # absent when resuming with more ranks than saved: those ranks keep their seeds
        try:
            rng = _load_rng_state(rng_file)
        except CheckpointError as e:
            refused = e
    if all_reduce([1.0 if refused else 0.0], "max")[0] > 0:  # every rank stops, none waits in dcp.load for it
        raise refused or CheckpointError(path, "another rank refused its RNG state file (see that rank's error)")
    metadata = _read_metadata(path)
    _check_critic_layout(engine, path, metadata)
    _check_lora_layout(engine, path, metadata)
    if getattr(engine, "lora", None) is not None and engine.lora.enabled and not _holds_base(metadata):
        from rlbus.trainer.lora import check_base

        try:
            check_base(path / ADAPTER_DIR, engine.model_path)  # every rank: each reads the base from there
        except ValueError as e:
            raise CheckpointError(path, str(e)) from None
    state = engine.state_dict()
    _dcp_load(state, path, metadata)
    engine.load_state_dict(state)
    if rng is not None:
        try:
            _set_rng_state(rng)
        except (TypeError, ValueError, RuntimeError) as e:
            raise UnsafeCheckpointError(rng_file, f"RNG state does not fit ({type(e).__name__}: {e})") from None
    raw = (path / "extra.json").read_bytes()
    try:
        return msgspec.json.decode(raw, type=extra_type) if extra_type is not None else msgspec.json.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CheckpointError(path / "extra.json", f"cannot decode: {e}") from None


_CRITIC_LAYOUTS = {
    "none": "no critic (algorithm.adv_estimator is not gae)",
    "separate": "a critic model of its own (algorithm.adv_estimator: gae, critic.backbone: separate)",
    "shared": "a value head on the policy (algorithm.adv_estimator: gae, critic.backbone: shared)",
}


def _check_critic_layout(engine: TrainEngine, ckpt: Path, metadata: Metadata) -> None:
    """Refuse, naming the settings, a checkpoint whose critic does not fit the run's: a separate critic's state, a
    head in the policy's state and its optimizer group cannot come from a checkpoint that has none (DCP would say
    only which keys are missing). A saved separate critic the run does without is left unread."""
    keys = metadata.state_dict_metadata
    saved = ("separate" if any(k.startswith("critic.") for k in keys)
             else "shared" if any(k.startswith("model.value_head.") for k in keys) else "none")  # fmt: skip
    run = ("separate" if getattr(engine, "critic", None) is not None
           else "shared" if getattr(engine, "value_head", None) is not None else "none")  # fmt: skip
    if saved != run and not (saved == "separate" and run == "none"):
        raise CheckpointError(
            ckpt, f"it was saved with {_CRITIC_LAYOUTS[saved]}, and this run's config has {_CRITIC_LAYOUTS[run]}; "
            "resume under the settings it was saved with, or start a new run (another logging.run_dir)")


def _check_lora_layout(engine: TrainEngine, ckpt: Path, metadata: Metadata) -> None:
    """Refuse a checkpoint whose adapter does not fit the run's model.lora (with or without one, another rank or
    other target modules): DCP would say only which keys are missing or do not fit."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    saved = sorted(k for k in metadata.state_dict_metadata if k.startswith("model.") and ".lora_A." in k)
    live = get_model_state_dict(engine.model)  # this rank's shards under the checkpoint's names (no collective)
    run = sorted(k for k in live if ".lora_A." in k)
    lora = getattr(engine, "lora", None)
    if [f"model.{k}" for k in run] != saved:
        have = f"an adapter on {len(saved)} layers" if saved else "no adapter (full fine-tuning)"
        want = f"model.lora.rank={lora.rank} on {len(run)} layers" if run else "model.lora.rank=0"
        raise CheckpointError(ckpt, f"it was saved with {have}, and this run's config has {want}; resume under the "
                              "settings it was saved with, or start a new run (another logging.run_dir)")
    if run:
        shapes = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if k in saved}
        wrong = [k for k in run if tuple(live[k].shape) != shapes[f"model.{k}"]]
        if wrong:
            raise CheckpointError(ckpt, f"its adapter has another rank than this run's model.lora.rank={lora.rank} "
                                  f"({wrong[0]}: saved {shapes[f'model.{wrong[0]}']}); resume under the settings "
                                  "it was saved with")


def _holds_base(metadata: Metadata) -> bool:
    """A LoRA checkpoint written before they held the adapter alone also holds the frozen base."""
    return any(".base_layer." in k for k in metadata.state_dict_metadata)


def export_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, tokenizer_src: str | os.PathLike,
              base_model: str | os.PathLike = "") -> Path:
    """Write a Hugging Face model directory (config, safetensors weights, tokenizer) from a trainer checkpoint.

    Runs in one process without a process group (DCP reads every shard). The result loads with
    `AutoModelForCausalLM.from_pretrained(out_dir)` (and vLLM): the policy's weights alone. A checkpoint of a run
    with a critic (gae) also gets the value model next to the policy, in `out_dir/critic`
    (`AutoModelForTokenClassification`, one label: V_t is its output at position t - 1); with critic.backbone:
    shared, that is the policy's transformer (a copy) under the value head, which computes the very same values.
    A LoRA checkpoint's base is the model it recorded (adapter/base.json), or `base_model`, with the same weights.
    """
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    if not (ckpt_dir / ".metadata").is_file() or not (ckpt_dir / "hf" / "config.json").is_file():
        raise CheckpointError(ckpt_dir, "not a complete trainer checkpoint (needs .metadata and hf/config.json)")
    config = AutoConfig.from_pretrained(ckpt_dir / "hf")
    model = AutoModelForCausalLM.from_config(config)
    if (ckpt_dir / ADAPTER_DIR / "adapter_config.json").is_file():
        _export_adapter(ckpt_dir, model, out_dir, base_model)
    else:
        state = {"model": model.state_dict()}
        _dcp_load(state, ckpt_dir)
        model.load_state_dict(state["model"])
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(tokenizer_src).save_pretrained(out_dir)
    if (ckpt_dir / CRITIC_HF / "config.json").is_file():
        critic_config = AutoConfig.from_pretrained(ckpt_dir / CRITIC_HF)
        critic = AutoModelForTokenClassification.from_config(critic_config)
        if getattr(critic_config, BACKBONE_KEY, "separate") == "shared":
            # The policy's transformer (model.*, the same names in both classes) under the value head (its score).
            head = "score" if hasattr(critic, "score") else "classifier"
            name = {k: f"{VALUE_HEAD}.{k[len(head) + 1 :]}" if k.startswith(f"{head}.") else k
                    for k in critic.state_dict()}  # fmt: skip
            state = {"model": {name[k]: v for k, v in critic.state_dict().items()}}
            _dcp_load(state, ckpt_dir)
            critic.load_state_dict({k: state["model"][name[k]] for k in name})
        else:
            state = {"critic": {"model": critic.state_dict()}}
            _dcp_load(state, ckpt_dir)
            critic.load_state_dict(state["critic"]["model"])
        critic.save_pretrained(out_dir / "critic")
    return out_dir


def _export_adapter(ckpt_dir: Path, model: torch.nn.Module, out_dir: Path, base_path: str | os.PathLike) -> None:
    """A LoRA checkpoint: load its adapter's merge into `model`, and write the adapter alone as a peft directory
    in `out_dir/adapter` (`peft.PeftModel.from_pretrained(base, out_dir / "adapter")` loads it)."""
    from rlbus.trainer import lora

    cfg = lora.load_adapter_config(ckpt_dir / ADAPTER_DIR)
    metadata = _read_metadata(ckpt_dir)
    whole = _holds_base(metadata)
    if whole:
        trained = lora.apply_lora(AutoModelForCausalLM.from_config(model.config), cfg)
    else:  # the adapter alone: the base is the model it recorded (model.path), checked by its digest
        try:
            base_dir, dtype = lora.check_base(ckpt_dir / ADAPTER_DIR, base_path)
        except ValueError as e:
            raise CheckpointError(ckpt_dir, str(e)) from None
        # Held as the trainer held it (model.dtype), then widened to the export's dtype as the saved base once was.
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=getattr(torch, dtype)).to(model.dtype)
        trained = lora.apply_lora(base, cfg)
    _dcp_load({"model": {k: v for k, v in trained.state_dict().items() if whole or lora.is_adapter(k)}}, ckpt_dir,
              metadata)  # into trained's own tensors
    state = {"model": trained.state_dict()}
    model.load_state_dict(lora.merged_state_dict(state["model"], cfg.scale))
    base = json.loads((ckpt_dir / ADAPTER_DIR / "adapter_config.json").read_text()).get("base_model_name_or_path")
    lora.save_adapter_dir(lora.adapter_tensors(state["model"]), cfg, out_dir / ADAPTER_DIR, base or "")
