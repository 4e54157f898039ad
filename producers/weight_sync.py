"""How a producer (or the evaluator) turns a published weight version into a load of its engine.

A version's `encoding` (schemas/wire.py WeightsPublished) says what the weight store holds:

    full      every weight: fetched, checked against the announced checksum, loaded as it is
    adapter   model.lora's adapter alone (a few MB): fetched and checked the same way, then merged into the base
              weights of `model.path`, W + scale * B A per adapted layer (common/lora.py). The base never changes
              under LoRA, so the adapter alone brings any producer, a late joiner or a restarted one included, to
              the version: it was built from model.path. An engine that loads some tensors in place
              (`loads_partial`: the HF engine) gets the adapted layers only; any other (vLLM) gets the whole state
              dict, the adapted layers merged, in its in-place full load.
    delta     what changed since `base_version` (common/delta.py), from the run's delta store, applied to the full
              weights of the version this sync loaded last (kept here: one more copy of the weights, in the dtype they
              are published in). It applies only when those are the delta's base (version and full checksum: the
              chain's link) and the delta's bytes pass their checksum; otherwise the full copy of the version is
              loaded instead, and `load` returns why (the producer logs it and says so on the bus).

The base weights are read from model.path's safetensors once, on the first adapter version (the adapted layers
only, or every tensor for an engine that loads whole state dicts), and kept: one more copy of those layers.

    .venv/bin/python -m pytest -q tests/integration/test_lora_sync.py
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import torch

from rlbus.bus.weight_store import WeightStore
from rlbus.common.delta import apply_delta
from rlbus.common.lora import adapter_layers, merge_adapter
from rlbus.producers.engines.base import RolloutEngine
from rlbus.schemas.config import RunConfig
from rlbus.schemas.errors import WeightsChecksumMismatch, WeightsLost, WeightsMissing
from rlbus.schemas.wire import WeightsPublished

log = logging.getLogger("rlbus.producer")


def read_safetensors(model_dir: str | Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a Hugging Face model directory's safetensors files (one file or an index of shards): `names`, or
    every tensor when None. Raises FileNotFoundError when the directory holds no safetensors."""
    from safetensors import safe_open

    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        where = json.loads(index.read_text())["weight_map"]
        files = sorted(set(where.values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
        where = None
    if not files:
        raise FileNotFoundError(f"{root}: no *.safetensors to read the base weights of an adapter from")
    wanted = set(names) if names is not None else None
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(root / file), framework="pt") as f:
            for key in f.keys():
                if (wanted is None or key in wanted) and (where is None or where.get(key) == file):
                    out[key] = f.get_tensor(key)
    missing = sorted(wanted - out.keys()) if wanted is not None else []
    if missing:
        raise KeyError(f"{root}: the adapter changes layers the model directory does not hold: {missing[:3]}")
    return out


def connect_deltas(cfg: RunConfig) -> WeightStore | None:
    """The run's delta store when its versions may be deltas (trainer.weight_sync.encoding: delta), else None."""
    if cfg.trainer.weight_sync.encoding != "delta" or cfg.model.lora.enabled:
        return None
    return WeightStore.connect(cfg.name, cfg.ray, what="deltas")


class WeightSync:
    """Loads announced versions into one engine: fetch, verify, (merge an adapter,) load."""

    engine: RolloutEngine
    store: WeightStore
    deltas: WeightStore | None  # the run's delta store (trainer.weight_sync.encoding: delta)
    model_path: str  # the base weights an adapter version applies to
    _base: dict[str, torch.Tensor]  # base tensors read from model_path so far
    _current: dict[str, torch.Tensor]  # delta sync: the full weights loaded last (never written: deltas make new ones)
    _held: tuple[int, str] | None  # delta sync: their (version, full checksum)

    def __init__(self, engine: RolloutEngine, store: WeightStore, model_path: str,
                 deltas: WeightStore | None = None):
        self.engine = engine
        self.store = store
        self.deltas = deltas
        self.model_path = model_path
        self._base, self._current, self._held = {}, {}, None

    async def load(self, published: WeightsPublished) -> str | None:
        """Bring the engine to `published`'s weights (waits for the chunk in flight). Returns None, or why a delta
        was not applied and the full copy was loaded instead. Raises WeightsMissing, WeightsLost,
        WeightsChecksumMismatch as `WeightStore.get`, ValueError for an encoding it does not know."""
        if published.encoding == "delta":
            reason = await self._load_delta(published)
            if reason is not None:
                await self._load_full(published, published.full_checksum)
            return reason
        if published.encoding == "full":
            await self._load_full(published, published.checksum)
        elif published.encoding == "adapter":
            state_dict = await self.store.get(published.version, expect=published.checksum)
            merged = await asyncio.to_thread(self._merge, state_dict, published.adapter_scale)
            await self.engine.load_weights(merged, published.version, partial=self.engine.loads_partial)
        else:
            raise ValueError(f"weights v{published.version}: unknown encoding {published.encoding!r}")
        return None

    async def _load_full(self, published: WeightsPublished, checksum: str) -> None:
        state_dict = await self.store.get(published.version, expect=checksum)
        await self.engine.load_weights(state_dict, published.version)
        if published.full_checksum:  # delta sync: the next delta applies to these
            self._current, self._held = dict(state_dict), (published.version, published.full_checksum)

    async def _load_delta(self, published: WeightsPublished) -> str | None:
        """Apply a delta version; None when it went in, else why not (nothing was loaded then)."""
        base = (published.base_version, published.base_checksum)
        if self.deltas is None:
            return "this producer has no delta store"
        if self._held != base:
            held = f"v{self._held[0]} ({self._held[1]})" if self._held else "no weights of this run"
            return f"it holds {held}, not the delta's base v{base[0]} ({base[1]})"
        try:
            delta = await self.deltas.get(published.version, expect=published.checksum)
            fresh = await asyncio.to_thread(apply_delta, self._current, delta)
        except (WeightsMissing, WeightsLost, WeightsChecksumMismatch, KeyError, ValueError) as e:
            return f"the delta cannot be applied ({type(e).__name__}: {e})"
        current = {**self._current, **fresh}
        await self.engine.load_weights(fresh if self.engine.loads_partial else current, published.version,
                                       partial=self.engine.loads_partial)  # fmt: skip
        self._current, self._held = current, (published.version, published.full_checksum)
        return None

    def _merge(self, adapter: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
        layers = adapter_layers(adapter)
        if self.engine.loads_partial:
            need = [n for n in layers if n not in self._base]
            if need:
                self._base.update(read_safetensors(self.model_path, need))
            return merge_adapter(self._base, adapter, scale)
        if not self._base:
            self._base = read_safetensors(self.model_path)
        return {**self._base, **merge_adapter(self._base, adapter, scale)}
