"""`rlbus tinker CONFIG`: the Tinker API on your own machine, for code written against Thinking Machines' `tinker` SDK.

    rlbus tinker configs/tinker.yaml                      # serves model.path; writes <run_dir>/tinker.url
    export TINKER_BASE_URL=$(cat runs/tinker/tinker.url)
    export TINKER_API_KEY=$(grep -v '^#' runs/tinker/creds/tinker_keys | head -1)
    python my_tinker_script.py                            # unchanged: ServiceClient() finds both

Design: this first version runs in ONE process, torch on CPU, and does the heavy work itself with rlbus's own
pieces: the base model loaded once and shared by every training model (tinker_api/training.py), LoRA injected by
the trainer's `apply_lora` with its fused linear, target log-probs by the trainer's `token_log_probs`, AdamW by the
trainer's `make_optimizer` and `clip_grad_norm`, the policy losses by `trainer/algorithms/policy_loss.py`,
checkpoints as peft adapter directories with the trainer's base record (`trainer/lora.py`), and sampling by the
producers' HF engine with adapters merged by `common/lora.py` (tinker_api/sampling.py). It does not route requests
to `rlbus up` roles over the bus. Why, for now: a Tinker client drives its own loop one request at a time and waits
for each answer, so what the bus and FSDP2 give a run (asynchrony between rollout and training, many producers,
sharding) has nothing to act on for one small model, while the bus would add a hop to every call and a run
directory per training client; and a Tinker model is many adapters on one base, which the trainer role (one policy
per run) does not hold. So the gateway is an in-process role like `rlbus judge`, and `tinker_api` may import the
trainer and the producers (tests/unit/test_layering.py says so). Routing forward_backward and sample to trainer and
producer roles on the bus, for models beyond one process, is the next step (docs/tinker.md, "What is next").

Lifecycle: start (load the base, open the keys file, listen, write the URL file), serve until SIGTERM / SIGINT,
close (remove the URL file, stop taking requests, fail those in flight). Checkpoints and the records of sessions,
models and sampling sessions outlive the process (tinker_api/records.py): started again on the same directory, even
after SIGKILL, the service restores each when a client asks for it, a training model only when its weights and
AdamW's state are known exactly (saved, or not trained since it was made). Futures do not outlive it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from rlbus.bus.loop import run, serve
from rlbus.common.logs import setup_logging
from rlbus.common.model.ensure import ensure_model
from rlbus.common.served import UrlRole
from rlbus.common.threads import apply_torch_threads, refresh_executor_threads
from rlbus.schemas.config import RunConfig
from rlbus.schemas.tinker import URL_FILE
from rlbus.tinker_api.keys import Keys
from rlbus.tinker_api.server import TinkerServer
from rlbus.tinker_api.training import Base

log = logging.getLogger("rlbus.tinker")
KEYS_FILE = "creds/tinker_keys"  # under the run directory, when tinker.keys_file is ""


def build_server(cfg: RunConfig) -> TinkerServer:
    """The server of `cfg`: its base model (model.path, made if model.init_if_missing), keys and checkpoint root."""
    t = cfg.tinker
    path = str(Path(ensure_model(cfg.model)).resolve())
    base = Base(path, t.base_model or path)
    keys = Keys(t.keys_file or cfg.run_dir / KEYS_FILE)
    root = Path(t.dir) if t.dir else cfg.run_dir / "tinker"
    root.mkdir(parents=True, exist_ok=True)
    return TinkerServer(t, base, keys, root)


class TinkerRole(UrlRole):
    """The server, its URL in the run directory, until SIGTERM / SIGINT (bus/loop.py's serve)."""

    server: TinkerServer

    def __init__(self, cfg: RunConfig, server: TinkerServer):
        super().__init__(server, cfg.run_dir / URL_FILE, log)

    def started(self) -> None:
        log.info("tinker: keys in %s; URL in %s", self.server.keys.path, self.url_file)

    def stopped(self, reason: str) -> None:
        log.info("tinker: stopped (%s)", reason)


async def run_tinker(cfg: RunConfig) -> None:
    refresh_executor_threads()  # training and sampling run in worker threads: each re-sizes its torch pool
    server = await asyncio.to_thread(build_server, cfg)
    await serve(TinkerRole(cfg, server))


def main(cfg: RunConfig) -> int:
    setup_logging(cfg.logging.level)
    apply_torch_threads(cfg.tinker.torch_threads, 1, role="tinker")  # alone on the machine, unless told otherwise
    run(run_tinker(cfg))
    return 0


__all__ = ["TinkerRole", "build_server", "main", "run_tinker"]
