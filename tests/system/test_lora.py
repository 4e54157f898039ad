"""Under a real `rlbus up` (embedded NATS, local Ray, trainer and two producer processes, HF engine):

- a LoRA job: every version after 0 is published as the adapter alone, producers apply it and roll out on it (their
  groups carry the versions), the guard's rollback restores the adapter from a checkpoint, `rlbus replay` reproduces
  the redone steps bit for bit, `rlbus export` writes the merged model and the adapter directory, the ledger is
  clean (the rollback is forced as in tests/system/test_guard.py: guard.max_mismatch_kl=1e-12);
- a full fine-tuning job with delta sync: versions chained by checksums, applied by the producers.

    .venv/bin/python -m pytest -q tests/system/test_lora.py
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlbus.consumers.event_log import read_entries
from rlbus.trainer.metrics import read_metrics
from rlbus.trainer.replay import replay
from tests.support.runs import check_ledger, run_up, small_run_config

pytestmark = pytest.mark.slow
pytest.importorskip("peft")

TOTAL = 8


def test_lora_job_syncs_adapters_rolls_back_replays_and_exports(tmp_path, tiny_model_dir, run_name, monkeypatch):
    from transformers import AutoModelForCausalLM

    # The tiny model never answers right: a reward by length gives every group a spread, so the adapter learns.
    (tmp_path / "length_reward.py").write_text(
        "def reward(response, ground_truth, *, task):\n    return (len(response) % 5) / 4\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the launcher's children import the reward from here
    run_dir = tmp_path / "run"
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, "", "", "",
                           model={"lora": {"rank": 4, "alpha": 8.0}},
                           trainer={"total_steps": TOTAL, "checkpoint_interval": 2, "keep_checkpoints": 20,
                                    "lr": 1e-3},
                           rollout={"num_producers": 2, "reward": "length_reward:reward"},
                           guard={"max_mismatch_kl": 1e-12, "cooldown_steps": 3, "max_rollbacks": 1,
                                  "rule_actions": {"mismatch_kl": ["warn", "rollback"]}})  # fmt: skip
    run_up(tmp_path, cfg)

    # Every version went out as the adapter alone, a small fraction of the model's bytes.
    full_bytes = sum(t.numel() * t.element_size() for t in AutoModelForCausalLM.from_pretrained(tiny_model_dir)
                     .state_dict().values())  # fmt: skip
    announced = [e.msg for e in read_entries(run_dir, "weights")]
    assert announced and all(w.encoding == "adapter" and w.adapter_scale == 2.0 for w in announced)
    assert all(w.num_bytes < 0.1 * full_bytes for w in announced)
    # ... and the producers rolled out on the adapted versions (their groups carry versions past 0)
    assert max(s.max_version for e in read_entries(run_dir, "traj") for s in e.msg.samples) >= TOTAL // 2
    assert not read_entries(run_dir, "dead-letter")  # no announcement was refused

    # The guard rolled back once, to a checkpoint; the replay from it reproduces the redone steps bit for bit.
    rollbacks = [a.msg for a in read_entries(run_dir, "guard") if "rollback" in a.msg.actions]
    assert len(rollbacks) == 1
    rb = rollbacks[0]
    check_ledger(run_dir, cfg)
    assert any(r["actor/grad_norm"] > 0 for r in read_metrics(run_dir))  # the adapter did learn
    result, _ = replay(run_dir, rb.rollback_to + 1, TOTAL - rb.rollback_to)
    assert result.from_checkpoint == rb.rollback_to
    assert result.identical, [d for d in result.diffs if not d.equal][:5]

    out = tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "rlbus.cli", "export", str(run_dir / "checkpoints"), str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "config.json").is_file() and (out / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out).state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    changed = {k for k in base if not (merged[k] == base[k]).all()}
    assert changed and all(k.endswith("proj.weight") for k in changed)  # the adapted layers, nothing else


def test_delta_sync_job_chains_versions_and_producers_apply_them(tmp_path, tiny_model_dir, run_name, monkeypatch):
    """Full fine-tuning with trainer.weight_sync.encoding: delta (bfloat16) under `rlbus up`: after the first version
    every announcement is a delta linked to the one before, producers apply them (the only full copies they load
    are the ones a late start makes them), and the run's ledger is clean."""
    (tmp_path / "length_reward.py").write_text(
        "def reward(response, ground_truth, *, task):\n    return (len(response) % 5) / 4\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    run_dir = tmp_path / "run"
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, "", "", "",
                           trainer={"total_steps": 6, "lr": 1e-4,
                                    "weight_sync": {"encoding": "delta", "dtype": "bfloat16"}},
                           rollout={"num_producers": 2, "reward": "length_reward:reward"})  # fmt: skip
    run_up(tmp_path, cfg)
    announced = [e.msg for e in read_entries(run_dir, "weights")]
    assert announced[0].encoding == "full" and announced[0].dtype == "bfloat16"
    for before, w in zip(announced, announced[1:]):
        assert w.encoding == "delta" and (w.base_version, w.base_checksum) == (before.version, before.full_checksum)
        assert w.num_bytes < announced[0].num_bytes
    fallbacks = [e.msg for e in read_entries(run_dir, "errors") if e.msg.error == "WeightsDeltaFallback"]
    assert all("no weights of this run" in f.message for f in fallbacks), [f.message for f in fallbacks]
    rows = read_metrics(run_dir)
    densities = [r["weights/delta_density"] for r in rows if "weights/delta_density" in r]
    # 0: a version equal to the one before (an update whose gradient was exactly zero, every group uniform, is
    # skipped: trainer.skip_zero_grad_updates).
    assert densities and all(0 <= d < 1 for d in densities) and max(densities) > 0
    check_ledger(run_dir, cfg)
