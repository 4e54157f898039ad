"""What outlives the `rlbus tinker` process: a small JSON record per session, training model and sampling session,
under the tree of the key that made it (tinker.dir/<owner>/), so that a service started again on the same directory
restores them when a client asks for them.

    <owner>/sessions/<session_id>.json        a session (restored with a fresh heartbeat clock)
    <owner>/<model_id>/model.json             a training model: LoRA settings, seed, the state it equals, `changed`
    <owner>/samplers/<sampling_id>.json       a sampling session: the tinker:// path it samples, or the base

A training model is restored exactly when its weights and AdamW's state are known: its initialisation (the seed is
always recorded; the service draws one when the client gives none) or the state it was last saved as or loaded from.
Every request that changes it (forward_backward, optim_step, a load of weights alone) sets `changed` before it runs;
save_state clears it when no gradients are pending. A model killed while `changed` is set is not restored: what it
learnt since that state lived only in memory, and continuing from the state silently would train on stale weights.
A request for it fails with NotFound naming the state to resume from (`create_training_client_from_state_with_
optimizer`). A finished session's records go with its models.

Records are written with one rename each (common/files.py), so a kill leaves the old record or the new one. Ids from
requests name files only after they match the shapes the service makes (a uuid's hex digits), so none escapes the
owner's tree.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import TypeVar

import msgspec

from rlbus.common.files import write_atomic

_R = TypeVar("_R")

SESSION_ID = re.compile(r"[0-9a-f]{32}")
MODEL_ID = re.compile(r"([0-9a-f]{32}):train:[0-9]{1,9}")
SAMPLING_ID = re.compile(r"sampler-[0-9a-f]{32}")
MODEL_FILE = "model.json"


class ModelRecord(msgspec.Struct, kw_only=True):
    """A training model as a restarted service makes it again."""

    session_id: str
    rank: int
    alpha: float  # LoRA scale numerator when it was made (tinker.lora_alpha may change between starts)
    train_attn: bool
    train_mlp: bool
    seed: int  # the initialisation of A (B starts at zero)
    state: str | None = None  # tinker:// path of the state it equals; None: its initialisation
    optimizer: bool = True  # whether that state includes AdamW's moments and step count (else a fresh AdamW)
    changed: bool = False  # changed since `state`: not restorable


class SamplerRecord(msgspec.Struct, kw_only=True):
    model_path: str | None  # the tinker:// sampler weights it samples; None: the base model


class Records:
    """Records under `root` (tinker.dir), one tree per owner."""

    root: Path
    _model_decoder: msgspec.json.Decoder[ModelRecord]
    _sampler_decoder: msgspec.json.Decoder[SamplerRecord]

    def __init__(self, root: Path):
        self.root = root
        self._model_decoder = msgspec.json.Decoder(ModelRecord)
        self._sampler_decoder = msgspec.json.Decoder(SamplerRecord)

    def _write(self, path: Path, value: object) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, msgspec.json.encode(value))

    # ------------------------------------------------------------------------------------------------ sessions

    def _session_file(self, owner: str, session_id: str) -> Path | None:
        return self.root / owner / "sessions" / f"{session_id}.json" if SESSION_ID.fullmatch(session_id) else None

    def save_session(self, owner: str, session_id: str) -> None:
        path = self._session_file(owner, session_id)
        if path is not None:
            self._write(path, {})

    def has_session(self, owner: str, session_id: str) -> bool:
        path = self._session_file(owner, session_id)
        return path is not None and path.is_file()

    def drop_session(self, owner: str, session_id: str) -> None:
        """The session's record and its models' (their checkpoints stay)."""
        path = self._session_file(owner, session_id)
        if path is None:
            return
        path.unlink(missing_ok=True)
        for record in (self.root / owner).glob(f"{session_id}:train:*/{MODEL_FILE}"):
            record.unlink(missing_ok=True)

    # -------------------------------------------------------------------------------------------------- models

    def _model_file(self, owner: str, model_id: str) -> Path | None:
        return self.root / owner / model_id / MODEL_FILE if MODEL_ID.fullmatch(model_id) else None

    def save_model(self, owner: str, model_id: str, record: ModelRecord) -> None:
        path = self._model_file(owner, model_id)
        if path is not None:
            self._write(path, record)

    def model(self, owner: str, model_id: str) -> ModelRecord | None:
        path = self._model_file(owner, model_id)
        return _read(path, self._model_decoder)

    # ------------------------------------------------------------------------------------------------ samplers

    def _sampler_file(self, owner: str, sampling_id: str) -> Path | None:
        ok = SAMPLING_ID.fullmatch(sampling_id)
        return self.root / owner / "samplers" / f"{sampling_id}.json" if ok else None

    def save_sampler(self, owner: str, sampling_id: str, record: SamplerRecord) -> None:
        path = self._sampler_file(owner, sampling_id)
        if path is not None:
            self._write(path, record)

    def sampler(self, owner: str, sampling_id: str) -> SamplerRecord | None:
        path = self._sampler_file(owner, sampling_id)
        return _read(path, self._sampler_decoder)


def _read(path: Path | None, decoder: msgspec.json.Decoder[_R]) -> _R | None:
    """The record at `path`, decoded; None for no path (an id that is not well formed) or no file."""
    if path is None:
        return None
    with contextlib.suppress(FileNotFoundError):
        return decoder.decode(path.read_bytes())
    return None
