"""On-policy distillation under a real `rlbus up` (embedded NATS, local Ray, a trainer and two producer processes,
HF engine): the student is the session's tiny model, the teacher the shipped quickstart model (the same tokenizer).

- each producer loads the teacher and stores its scores with every sample; the trainer's steps report the reverse
  KL to it (distill/reverse_kl) and train on it;
- what was recorded is what the teacher says: a recorded step's teacher_log_probs are the teacher's teacher-forced
  log-probs of those very tokens at rollout.temperature, 0 where the environment inserted the token;
- `rlbus replay` redoes the recorded steps bit for bit without loading the teacher; the ledger is clean.

    .venv/bin/python -m pytest -q tests/system/test_distill_run.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlbus.consumers.event_log import load_step_batch, read_steps
from rlbus.trainer.metrics import read_metrics
from rlbus.trainer.replay import replay
from tests.support.runs import check_ledger, run_up, small_run_config

pytestmark = pytest.mark.slow

SHIPPED = Path(__file__).resolve().parents[2] / "common/model/shipped/tiny-calculator"
TOTAL = 4
TEMPERATURE = 0.9


def test_a_run_with_a_teacher_records_its_scores_and_replays(tmp_path: Path, tiny_model_dir: Path, run_name: str):
    run_dir = tmp_path / "run"
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, "", "", "",
                           rollout={"num_producers": 2, "temperature": TEMPERATURE},
                           algorithm={"distill": {"teacher": str(SHIPPED), "weight": 0.5, "batch_size": 2}},
                           trainer={"total_steps": TOTAL, "lr": 1e-3},
                           logging={"record": "full"})  # fmt: skip
    run_up(tmp_path, cfg)

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, TOTAL + 1))
    assert all(r["distill/reverse_kl"] != 0 and r["distill/teacher_log_prob"] < 0 for r in rows), rows
    check_ledger(run_dir, cfg)

    # The recorded batch carries the teacher's scores of the sampled tokens, as a direct forward of it gives them.
    teacher = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    record = read_steps(run_dir)[-1]
    batch = load_step_batch(run_dir, record)
    mask_BT = batch["response_mask"] > 0
    with torch.no_grad():
        logits_BTV = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=batch["position_ids"]).logits.float()  # fmt: skip
    logp_BTV = torch.log_softmax(logits_BTV[:, :-1] / TEMPERATURE, dim=-1)
    expected_BT = torch.zeros_like(batch["teacher_log_probs"])
    expected_BT[:, 1:] = logp_BTV.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(batch["teacher_log_probs"][mask_BT], expected_BT[mask_BT], atol=1e-4, rtol=0)
    assert (batch["teacher_log_probs"][~mask_BT] == 0).all() and mask_BT.sum() > 0

    # The replay needs no teacher: its scores are in the recorded batches.
    result, _ = replay(run_dir, 1, TOTAL)
    assert result.identical, [d for d in result.diffs if not d.equal][:5]
