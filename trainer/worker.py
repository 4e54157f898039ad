"""One trainer rank: what every FSDP rank does in a round -- fetch its own tensors, train, gather weights, checkpoint.

Rank 0's controller (trainer/service.py) decides each round and broadcasts it as a `StepPlan`; every rank (rank 0
included, in a thread) runs `StepWorker.execute(plan)`. Ranks > 0 do nothing else: `serve()` follows the plans until
rank 0 sends None. No tensor passes through the controller: each rank fetches its own share of the step's
TransferQueue keys and collates it (consumers/collate.py).

    worker = StepWorker(cfg, model_path)          # joins the process group, builds the engine, restores a checkpoint
    result = worker.execute(worker.broadcast(plan))
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import torch.distributed as dist
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rlbus.bus.ray_cluster import ensure_ray
from rlbus.bus.transfer_queue import TransferQueue
from rlbus.common.threads import refresh
from rlbus.consumers.collate import collate
from rlbus.consumers.recorder import write_advantages, write_shard
from rlbus.schemas.config import RunConfig
from rlbus.schemas.errors import PayloadMissing
from rlbus.schemas.wire import SampleMeta, TrajectoryGroup
from rlbus.trainer.checkpoint import checkpoint_name, load_checkpoint, save_checkpoint
from rlbus.trainer.dist import destroy_distributed, init_distributed
from rlbus.trainer.engine import TrainEngine
from rlbus.trainer.guard import install_lr_scale, set_lr_scale
from rlbus.trainer.sft import SftRunner


class StepPlan(msgspec.Struct, kw_only=True):
    """What every rank does this round. Broadcast by rank 0; None ends the ranks' loop."""

    step: int  # the step this round produces (0 = publish-only round at start)
    shards: list[list[tuple[SampleMeta, int]]] | None  # per rank: (sample, group index in the step); None = no train
    publish: bool  # gather the full state dict on rank 0
    checkpoint: dict | None  # extra state to save with a checkpoint at this step, or None
    lr_scale: float = 1.0  # the stability guard's multiplier of the LR schedule for this round's updates
    restore: int | None = None  # first restore the checkpoint of this step (the guard's rollback), or None
    # > 0: this step of the supervised phase (trainer.sft) instead, trained unless it is the one trained last (then
    # the round only checkpoints the phase); `checkpoint` then saves the phase's checkpoint (trainer/sft.py)
    sft_step: int = 0
    sft_eval: bool = False  # with sft_step: also the held-out loss (trainer.sft.eval_data) after the update


class StepResult(msgspec.Struct, kw_only=True):
    missing: list[str] = []
    metrics: dict[str, float] = {}
    state_dict: Any = None  # rank 0 only, when publish: {name: full tensor on CPU}
    timings: dict[str, float] = {}


def plan_shards(groups: list[TrajectoryGroup], num_ranks: int) -> list[list[tuple[SampleMeta, int]]]:
    """Whole groups per rank (GRPO needs a whole group on one rank), balanced by tokens (largest first)."""
    if len(groups) < num_ranks:
        raise ValueError(f"{len(groups)} groups cannot feed {num_ranks} ranks (trainer.groups_per_step too small)")
    order = sorted(range(len(groups)), key=lambda i: -sum(s.prompt_len + s.response_len for s in groups[i].samples))
    shards: list[list[tuple[SampleMeta, int]]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for gi in order:
        r = min(range(num_ranks), key=lambda k: (load[k], len(shards[k])))
        shards[r].extend((s, gi) for s in groups[gi].samples)
        load[r] += sum(s.prompt_len + s.response_len for s in groups[gi].samples)
    return shards


class StepWorker:
    """The part of a step every rank runs: fetch own tensors, train, gather weights, checkpoint."""

    cfg: RunConfig
    engine: TrainEngine
    tq: TransferQueue
    rank: int
    world: int
    pad_id: int
    tokenizer: PreTrainedTokenizerBase  # the model's tokenizer (prompt-length filtering of the data set)
    restored: dict  # the checkpoint's extra blob (step, version, feeder, trained ids); {} on a fresh start
    sft: SftRunner | None  # the supervised phase still to train (trainer.sft, on a fresh start only), else None

    def __init__(self, cfg: RunConfig, model_path: str):
        info = init_distributed(cfg.trainer.device)
        self.cfg, self.rank, self.world = cfg, info.rank, info.world_size
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.engine = TrainEngine.from_config(cfg, model_path)
        # A collective: every rank restores its shards of model and optimizer from the same checkpoint.
        install_lr_scale(self.engine)  # the stability guard may scale the LR schedule (plan.lr_scale)
        self.restored = load_checkpoint(self.engine, cfg.run_dir / "checkpoints") or {}
        # trainer.sft's phase comes before the first RL checkpoint: a run that has one is past it. A collective too
        # (the phase's own checkpoint, when a previous trainer died in the middle of it).
        self.sft = None
        if cfg.trainer.sft.enabled and not self.restored:
            self.sft = SftRunner(self.engine, cfg, self.tokenizer)
            self.sft.restore(cfg.run_dir / "checkpoints")
        # Ray last: under `rlbus up` the head may still be starting while the model loads (ensure_ray waits for it).
        ensure_ray(cfg.ray)
        self.tq = TransferQueue.connect(cfg.name, cfg.ray)

    def broadcast(self, plan: StepPlan | None) -> StepPlan | None:
        if self.world == 1:
            return plan
        box = [plan]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def execute(self, plan: StepPlan) -> StepResult:
        refresh()  # every rank re-sizes its torch pool to its share of the CPUs now (common/threads.py)
        timings: dict[str, float] = {}
        metrics: dict[str, float] = {}
        if plan.restore is not None:  # a collective: every rank restores its shards (and its RNG) of that step
            t0 = time.perf_counter()
            load_checkpoint(self.engine, self.cfg.run_dir / "checkpoints" / checkpoint_name(plan.restore))
            timings["time/restore"] = time.perf_counter() - t0
        if plan.sft_step:
            return self._sft_step(plan)
        if self.sft is not None and self.sft.finished:  # the phase is over: its optimizer's memory goes
            self.sft = None
        if plan.shards is not None:
            t0 = time.perf_counter()
            shard = plan.shards[self.rank]
            keys = [meta.key for meta, _ in shard]
            missing: list[str] = []
            stored: list[dict] = []
            try:
                stored = self.tq.get_list_sync(keys)
            except PayloadMissing as e:
                missing = e.keys
            if self.world > 1:
                everyone: list[list[str]] = [[] for _ in range(self.world)]
                dist.all_gather_object(everyone, missing)
                missing = [k for ks in everyone for k in ks]
            if missing:
                return StepResult(missing=missing)
            batch = collate([(m, t) for (m, _), t in zip(shard, stored)], [gi for _, gi in shard], pad_id=self.pad_id)
            timings["time/fetch"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            # logging.record=full: this rank's exact batch, for `rlbus replay` (consumers/recorder.py)
            write_shard(self.cfg.run_dir, self.cfg.logging.record, plan.step, self.rank, batch)
            timings["time/record"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            set_lr_scale(self.engine, plan.lr_scale)  # from the schedule's position: 1.0 is the schedule's own LR
            metrics = self.engine.train_step(batch)
            timings["time/train"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            write_advantages(self.cfg.run_dir, self.cfg.logging.record, plan.step, self.rank, self.engine.computed)
            timings["time/record"] += time.perf_counter() - t0
        state_dict = None
        if plan.publish:
            t0 = time.perf_counter()
            state_dict = self.engine.publish_state_dict()
            timings["time/gather_weights"] = time.perf_counter() - t0
        if plan.checkpoint is not None:
            t0 = time.perf_counter()
            save_checkpoint(self.engine, self.cfg.run_dir / "checkpoints", plan.step, plan.checkpoint,
                            keep=self.cfg.trainer.keep_checkpoints)
            timings["time/checkpoint"] = time.perf_counter() - t0
        return StepResult(metrics=metrics, state_dict=state_dict if self.rank == 0 else None, timings=timings)

    def _sft_step(self, plan: StepPlan) -> StepResult:
        """A step of the supervised phase (trainer/sft.py): train, evaluate if asked, checkpoint the phase if asked."""
        t0 = time.perf_counter()
        metrics = self.sft.step(plan.sft_step) if plan.sft_step > self.sft.steps_done else {}
        timings = {"time/train": time.perf_counter() - t0}
        if plan.sft_eval:
            metrics["sft/eval_loss"] = self.sft.evaluate()
        if plan.checkpoint is not None:
            t0 = time.perf_counter()
            self.sft.save(self.cfg.run_dir / "checkpoints", plan.checkpoint, keep=self.cfg.trainer.keep_checkpoints)
            timings["time/checkpoint"] = time.perf_counter() - t0
        return StepResult(metrics=metrics, timings=timings)

    def serve(self) -> None:
        """Ranks > 0: follow rank 0's plans until it sends None."""
        while (plan := self.broadcast(None)) is not None:
            self.execute(plan)

    def close(self) -> None:
        destroy_distributed()
