"""The controller's side of the supervised phase (`trainer.sft`): one round of every rank per step, its metrics and
checkpoints. The trainer's rank 0 runs it in `TrainerService.start()` before the first weights go out, so the
producers' first version, 0, is its result:

    finished = await run_phase(cfg, worker.sft, execute, stopping)     # trainer/service.py

Each step is a `StepPlan` with `sft_step` (trainer/worker.py; the ranks run trainer/sft.py); its row goes to
`RUN_DIR/sft/metrics.jsonl` and `RUN_DIR/sft/tensorboard` (step = the phase's step; the RL steps' rows stay in
`RUN_DIR/metrics.jsonl`). The phase is checkpointed every `trainer.sft.checkpoint_interval` steps (default
`trainer.checkpoint_interval`) and when asked to stop, under `checkpoints/sft/`; its end is the run's step-0
checkpoint, which the service writes (`sft_steps` in its extra blob). A trainer restarted before that goes on from
the phase's newest checkpoint; one restarted after it never runs the phase again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from rlbus.schemas.config import RunConfig
from rlbus.trainer.metrics import MetricsLog
from rlbus.trainer.sft import SftRunner
from rlbus.trainer.worker import StepPlan, StepResult

log = logging.getLogger("rlbus.trainer")


def _row(step: int, result: StepResult) -> dict[str, float]:
    return {"step": step, **result.metrics, **result.timings}


async def run_phase(cfg: RunConfig, runner: SftRunner, execute: Callable[[StepPlan], Awaitable[StepResult]],
                    stopping: asyncio.Event) -> bool:
    """Train the phase's remaining steps on every rank (`runner` is rank 0's, for its counts). Returns whether the
    phase finished; False when `stopping` was set first (the step reached is checkpointed for a restart)."""
    sft = cfg.trainer.sft
    every = sft.checkpoint_interval or cfg.trainer.checkpoint_interval
    metrics = MetricsLog(cfg.run_dir / "sft", tensorboard=cfg.logging.tensorboard, resume_step=runner.steps_done)
    last_ckpt = runner.steps_done
    log.info("supervised phase (trainer.sft): %d conversations, steps %d to %d of %d", len(runner.train),
             runner.steps_done + 1, runner.num_steps, runner.num_steps)
    try:
        for k in range(runner.steps_done + 1, runner.num_steps + 1):
            if stopping.is_set():
                break
            last = k == runner.num_steps
            evaluate = bool(runner.heldout) and (last or bool(sft.eval_interval) and k % sft.eval_interval == 0)
            checkpoint = {"sft_step": k} if k % every == 0 and not last else None  # the last: the run's step 0
            result = await execute(StepPlan(step=0, shards=None, publish=False, checkpoint=checkpoint, sft_step=k,
                                            sft_eval=evaluate))  # fmt: skip
            row = _row(k, result)
            metrics.append(row)
            log.info("sft step %d/%d loss %.4f%s", k, runner.num_steps, row["sft/loss"],
                     f" eval_loss {row['sft/eval_loss']:.4f}" if "sft/eval_loss" in row else "")
            if checkpoint is not None:
                last_ckpt = k
        if not runner.finished and runner.steps_done > last_ckpt:  # stopped: keep what was trained
            k = runner.steps_done  # a round naming the step trained last only checkpoints the phase
            await execute(StepPlan(step=0, shards=None, publish=False, checkpoint={"sft_step": k}, sft_step=k))
            log.info("supervised phase stopped at step %d/%d (checkpointed)", k, runner.num_steps)
    finally:
        metrics.close()
    return runner.finished
