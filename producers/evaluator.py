"""The evaluator role: scores weight versions on a held-out prompt set while the run trains, as verl's `test_freq`
and AReaL's eval rollouts do, without ever holding the trainer up.

    rlbus evaluator CONFIG bus.url=... bus.creds_file=producer.json ray.address=...   (`rlbus up` starts it when
                                                                                      eval.interval > 0)

It follows the weights announcements like a producer, and evaluates version 0, every `eval.interval`-th version
and the last one (`trainer.total_steps`): it loads that version from the weight store into its own rollout engine
(the producers' engine and agent loop: the same chat template, tools and reward), rolls out the held-out prompts
(common/envs `load_heldout_tasks`: the environment's held-out split, no question of the training set) in one batched
agent loop, greedy by default (`eval.temperature: 0`) or `eval.n` samples each (pass@n), and publishes an
`EvalCompleted` on `events.eval`. The trainer writes it into metrics.jsonl / TensorBoard as `eval/*`.

Training goes on meanwhile: when versions come faster than evaluations, the evaluator skips to the newest due
version (the last one is never skipped), and after its last step the trainer waits at most `eval.final_timeout_s`
for the last version's score.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import msgspec

from rlbus.bus.client import Bus
from rlbus.bus.loop import run, serve
from rlbus.bus.ray_cluster import ensure_ray
from rlbus.bus.weight_store import WeightStore
from rlbus.producers.weight_sync import WeightSync, connect_deltas
from rlbus.common.data.datasets import example_to_task
from rlbus.common.envs import load_heldout_tasks
from rlbus.common.logs import setup_logging
from rlbus.common.threads import apply_torch_threads, refresh_executor_threads
from rlbus.producers.agent_loops.base import Trajectory
from rlbus.producers.build import build_rollout
from rlbus.schemas.config import RunConfig
from rlbus.schemas.errors import WeightsChecksumMismatch, WeightsMissing
from rlbus.schemas.wire import EvalCompleted, PromptTask, RoleStarted, RoleStopped, WeightsPublished

log = logging.getLogger("rlbus.evaluator")

#: Role id of the evaluator in lifecycle events and the launcher's supervision.
EVALUATOR_ID = "evaluator"


def eval_run_config(cfg: RunConfig) -> RunConfig:
    """The run config the evaluator's rollout stack is built from: eval sampling instead of the training one.
    Greedy is top-k 1 at temperature 1 (the engine's log-probs need a temperature > 0; the choice is the argmax)."""
    e = cfg.eval
    greedy = e.temperature == 0
    rollout = msgspec.structs.replace(cfg.rollout, n=e.n, temperature=1.0 if greedy else e.temperature,
                                      top_k=1 if greedy else cfg.rollout.top_k,
                                      top_p=1.0 if greedy else cfg.rollout.top_p)
    return msgspec.structs.replace(cfg, rollout=rollout)


def is_due(version: int, cfg: RunConfig) -> bool:
    """Version 0, every eval.interval-th version, and the run's last."""
    interval = cfg.eval.interval
    return interval > 0 and (version % interval == 0 or version == cfg.trainer.total_steps)


def eval_metrics(groups: list[list[Trajectory]]) -> dict[str, float]:
    """eval/* of one evaluation: accuracy (a sample's reward >= 1 is a right answer), pass@n, tool use, lengths."""
    samples = [t for g in groups for t in g]
    num = max(len(samples), 1)
    n = max((len(g) for g in groups), default=1)
    out = {
        "eval/accuracy": sum(t.reward >= 1.0 for t in samples) / num,
        "eval/reward": sum(t.reward for t in samples) / num,
        "eval/tool_call_rate": sum(t.num_tool_calls > 0 for t in samples) / num,
        "eval/tool_calls": sum(t.num_tool_calls for t in samples) / num,
        "eval/response_length": sum(len(t.response_ids) for t in samples) / num,
        "eval/turns": sum(t.num_turns for t in samples) / num,
    }
    if n > 1:
        out[f"eval/pass@{n}"] = sum(any(t.reward >= 1.0 for t in g) for g in groups) / max(len(groups), 1)
    return out


class Evaluator:
    """Follows the weights, evaluates the versions that are due, publishes `EvalCompleted`."""

    cfg: RunConfig
    bus: Bus | None
    weight_store: WeightStore | None
    weight_sync: WeightSync | None
    tasks: list[PromptTask]
    evaluated: set[int]
    _pending: WeightsPublished | None  # the newest due announcement not evaluated yet
    _wake: asyncio.Event
    _stopping: asyncio.Event
    _loaded: str  # checksum of the weights the engine holds ("" = the model directory it was built from)

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.bus = self.weight_store = self.weight_sync = None
        self.stack = None
        self.tasks, self.evaluated = [], set()
        self._pending = None
        self._wake, self._stopping = asyncio.Event(), asyncio.Event()
        self._loaded = ""

    async def start(self) -> None:
        cfg = self.cfg
        self.bus = await Bus.connect(cfg.bus, cfg.name, name=EVALUATOR_ID)
        await self.bus.await_streams()
        self.stack = build_rollout(eval_run_config(cfg), seed=cfg.trainer.seed)  # before Ray, as a producer's
        ensure_ray(cfg.ray)
        self.weight_store = WeightStore.connect(cfg.name, cfg.ray)
        self.weight_sync = WeightSync(self.stack.engine, self.weight_store, self.stack.model_path,
                                      deltas=connect_deltas(cfg))
        heldout = load_heldout_tasks(cfg, cfg.eval.num_prompts, self.stack.tokenizer)
        self.tasks = [example_to_task(ex, task_id=f"eval-{ex.index}", n=cfg.eval.n) for ex in heldout]
        await self.bus.publish_event(RoleStarted(role="evaluator", role_id=EVALUATOR_ID, host=socket.gethostname(),
                                                 pid=os.getpid(), detail=f"{len(self.tasks)} held-out prompts"))
        log.info("evaluator up: %s, every %d version(s)", heldout.name, cfg.eval.interval)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self.bus is not None:  # a shutdown with the server gone must not retry each call for bus.retry_s
            self.bus.stopping()

    async def run(self) -> None:
        watcher = asyncio.create_task(self._watch(), name="weights")
        try:
            while not self._stopping.is_set():
                await self._wake.wait()
                self._wake.clear()
                if watcher.done():
                    watcher.result()  # re-raise a failed watch
                published, self._pending = self._pending, None
                if published is not None and not self._stopping.is_set():
                    await self._evaluate(published)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    async def _watch(self) -> None:
        async for published in self.bus.watch(self.bus.subjects.weights, WeightsPublished, deliver="all"):
            if is_due(published.version, self.cfg) and published.version not in self.evaluated:
                self._pending = published  # a newer due version replaces one still waiting
                self._wake.set()

    async def _evaluate(self, published: WeightsPublished) -> None:
        t0 = time.perf_counter()
        base = published.version == 0 and not self._loaded and not published.sft_steps  # model.path's own weights
        if not base and published.weights_checksum != self._loaded:
            try:
                await self.weight_sync.load(published)
            except (WeightsMissing, WeightsChecksumMismatch) as e:
                log.warning("cannot evaluate v%d: %s", published.version, e)
                return
        self._loaded = published.weights_checksum
        groups = await self.stack.agent_loop.rollout_many(self.tasks, self.cfg.eval.n)
        seconds = time.perf_counter() - t0
        metrics = eval_metrics(groups)
        metrics["eval/seconds"] = seconds
        self.evaluated.add(published.version)
        await self.bus.publish_event(EvalCompleted(version=published.version, step=published.step,
                                                   num_prompts=len(self.tasks), metrics=metrics, seconds=seconds,
                                                   evaluator_id=EVALUATOR_ID))
        log.info("eval v%d: accuracy %.3f tool calls %.2f (%d prompts, %.1fs)", published.version,
                 metrics["eval/accuracy"], metrics["eval/tool_call_rate"], len(self.tasks), seconds)

    async def close(self, reason: str, clean: bool) -> None:
        if self.bus is not None:
            await self.bus.publish_event(RoleStopped(role="evaluator", role_id=EVALUATOR_ID, reason=reason,
                                                     clean=clean))
            await self.bus.close()
        if self.stack is not None:
            await self.stack.agent_loop.close()
            await self.stack.engine.close()


async def run_evaluator(cfg: RunConfig) -> None:
    refresh_executor_threads()  # generation runs in its threads: each re-sizes its torch pool (common/threads.py)
    await serve(Evaluator(cfg))


def main(cfg: RunConfig) -> int:
    setup_logging(cfg.logging.level)
    apply_torch_threads(cfg.rollout.torch_threads, cfg.trainer.num_ranks + cfg.rollout.num_producers + 1,
                        role="evaluator")
    run(run_evaluator(cfg))
    return 0
