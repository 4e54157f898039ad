"""What the trainer puts in the weight store for a version, and the announcement that says what it is.

    publisher = WeightPublisher(cfg)                            # connects the run's weight store (and delta store)
    msg = await publisher.put(version, step, state_dict)        # -> WeightsPublished, to announce on `weights`

By what the trainer's rank 0 gathered (trainer/engine.py publish_state_dict) and `trainer.weight_sync`:

    adapter   model.lora, sync: adapter: the adapter alone goes to the store (encoding "adapter")
    full      every weight, in trainer.weight_sync.dtype (encoding "full")
    delta     the full copy goes to the store as ever, and what changed since the version published before
              (common/delta.py) to the run's delta store; the announcement is the delta's (its checksum and bytes)
              and links it to the version before: base_version, base_checksum, and its own full_checksum. A producer
              whose weights are not that base (it missed a version, or restarted), or whose fetched delta fails its
              checksum, loads the full copy instead and says so (producers/weight_sync.py). The first version a
              trainer process publishes has no version before it in this process: it goes out full.

`last_delta_density` is the fraction of values the last delta changed (the step's `weights/delta_density`).

    .venv/bin/python -m pytest -q tests/integration/test_delta_sync.py
"""

from __future__ import annotations

import asyncio

import torch

from rlbus.bus.weight_store import WeightStore
from rlbus.common.delta import encode_delta
from rlbus.schemas.config import RunConfig
from rlbus.schemas.lora import weights_encoding
from rlbus.schemas.wire import WeightsPublished

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class WeightPublisher:
    store: WeightStore
    deltas: WeightStore | None  # trainer.weight_sync.encoding: delta
    last_delta_density: float | None
    _last: tuple[int, str, dict[str, torch.Tensor]] | None  # (version, full checksum, weights) published last

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.store = WeightStore.connect(cfg.name, cfg.ray)
        sync = cfg.trainer.weight_sync
        self.delta_mode = sync.encoding == "delta" and not cfg.model.lora.enabled
        self.deltas = WeightStore.connect(cfg.name, cfg.ray, what="deltas") if self.delta_mode else None
        self.dtype = _DTYPES[sync.dtype]
        self.last_delta_density = None
        self._last = None

    async def put(self, version: int, step: int, state_dict: dict[str, torch.Tensor]) -> WeightsPublished:
        encoding = weights_encoding(self.cfg.model.lora)
        cast = encoding["encoding"] == "full" and self.dtype != torch.float32  # adapters travel as trained
        if cast:
            state_dict = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
        info = await self.store.put(version, state_dict)
        msg = WeightsPublished(version=version, step=step, num_bytes=info.num_bytes, checksum=info.checksum,
                               num_tensors=info.num_tensors, dtype=info.dtype, store=self.cfg.name,
                               **encoding)  # fmt: skip
        self.last_delta_density = None
        if not self.delta_mode:
            return msg
        # The next delta is taken from a copy of our own: at world size 1 the gathered tensors are the trainer's
        # live parameters, which the next step moves in place.
        kept = state_dict if cast else {k: v.clone() for k, v in state_dict.items()}
        last, self._last = self._last, (version, info.checksum, kept)
        msg.full_checksum = info.checksum
        if last is None:
            return msg
        delta = await asyncio.to_thread(encode_delta, last[2], state_dict)
        dinfo = await self.deltas.put(version, delta.tensors)
        self.last_delta_density = delta.density
        return WeightsPublished(version=version, step=step, num_bytes=dinfo.num_bytes, checksum=dinfo.checksum,
                                num_tensors=dinfo.num_tensors, dtype=info.dtype, store=self.cfg.name,
                                encoding="delta", base_version=last[0], base_checksum=last[1],
                                full_checksum=info.checksum)  # fmt: skip

    async def flush(self) -> bool:
        return await self.store.flush()
