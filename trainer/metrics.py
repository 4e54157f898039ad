"""Where a step's metrics go: `<run_dir>/metrics.jsonl` (one JSON object per step), TensorBoard event files and,
with `logging.wandb`, a Weights & Biases run (`logging.wandb_mode: offline` writes `<run_dir>/wandb` only).

On resume the log is cut back to the restored step, so a step redone after a crash appears once; a resumed run
continues the same W&B run (its id is kept in `<run_dir>/wandb_id`).
"""

from __future__ import annotations

import json
import math
import secrets
from pathlib import Path
from typing import Any

from rlbus.common.files import write_atomic
from rlbus.schemas.config import LoggingConfig
from rlbus.schemas.errors import ConfigError

WANDB_ID_FILE = "wandb_id"
#: Rows of steps the stability guard rolled back (trainer/guard.py), moved out of metrics.jsonl.
DISCARDED_FILE = "metrics.discarded.jsonl"


def require_wandb(logging: LoggingConfig, *, check_login: bool = False) -> Any:
    """The wandb module when `logging.wandb` asks for it (None otherwise); a ConfigError naming the field if it is
    asked for and not installed, or (`check_login`, what `rlbus up` does before it starts anything) if online mode
    has no W&B credential."""
    if not logging.wandb:
        return None
    try:
        import wandb
    except ImportError:
        raise ConfigError("logging.wandb", "is true but the wandb package is not installed: "
                                           "pip install 'rlbus[wandb]', or set logging.wandb=false") from None
    if check_login and logging.wandb_mode == "online":
        try:
            wandb.login(verify=False)
        except wandb.errors.UsageError as e:
            raise _no_login(e) from None
    return wandb


def _no_login(e: Exception) -> ConfigError:
    return ConfigError("logging.wandb_mode", f"is online but W&B says: {e} (`wandb login`, or WANDB_API_KEY); "
                                             "or log without a network: logging.wandb_mode=offline")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


class MetricsLog:
    path: Path
    _tb: Any  # torch.utils.tensorboard.SummaryWriter | None
    _wandb: Any  # a wandb Run | None

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, resume_step: int = 0,
                 logging: LoggingConfig | None = None, run_name: str = "", config: dict[str, Any] | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._truncate_after(resume_step)
        self._tb = self._wandb = None
        wandb = require_wandb(logging) if logging is not None else None  # before anything is started
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=resume_step + 1)
        if wandb is not None:
            assert logging is not None
            try:
                self._wandb = wandb.init(
                    project=logging.wandb_project, entity=logging.wandb_entity or None, mode=logging.wandb_mode,
                    dir=str(run_dir), id=_wandb_id(run_dir), resume="allow", name=run_name or None, config=config,
                    settings=wandb.Settings(console="off"))  # the role's own log already has its output
            except wandb.errors.UsageError as e:
                raise _no_login(e) from None

    def _truncate_after(self, step: int) -> None:
        rows = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in rows))

    def discard_after(self, step: int) -> int:
        """Move the rows after `step` into metrics.discarded.jsonl (the stability guard rolled back to `step`): the
        redone steps' rows replace them here, and nothing that was logged is lost. Returns how many moved."""
        rows = read_metrics(self.path)
        gone = [r for r in rows if r.get("step", 0) > step]
        if gone:
            with (self.path.parent / DISCARDED_FILE).open("a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in gone))
            self._truncate_after(step)
        return len(gone)

    def append(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        if self._tb is not None:
            step = int(row["step"])
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            numbers = {k: v for k, v in clean.items()
                       if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
            self._wandb.log(numbers, step=int(row["step"]))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _wandb_id(run_dir: Path) -> str:
    """The run's W&B id, made once and kept in the run directory, so that a resumed run logs into the same run."""
    path = run_dir / WANDB_ID_FILE
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = secrets.token_hex(8)
    path.write_text(run_id + "\n")
    return run_id
