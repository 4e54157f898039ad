"""Where a step's metrics go: `<run_dir>/metrics.jsonl` (one JSON object per step) and TensorBoard event files.

On resume the log is cut back to the restored step, so a step redone after a crash appears once.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


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

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, resume_step: int = 0):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._truncate_after(resume_step)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=resume_step + 1)

    def _truncate_after(self, step: int) -> None:
        rows = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(self.path)

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

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
