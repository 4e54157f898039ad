"""The supervised phase (trainer.sft) on real FSDP2 ranks (CPU, gloo): its loss against TRL SFTTrainer's, a phase
that learns, with LoRA too, and its checkpoints resuming exactly; and the phase in a real trainer before RL.

TRL is not installed beside rlbus (a benchmark's own environment holds it), so the reference is what TRL's
`SFTTrainer.compute_loss` runs for one batch: its collator's labels (the token ids, -100 where the assistant mask is
0 and on padding), handed to the model, whose transformers loss shifts them and averages the cross-entropy over the
labelled tokens; and, independently, that average written out by hand.

    .venv/bin/python -m pytest -q tests/integration/test_sft.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlbus.common.data.conversations import load_conversations
from rlbus.common.model.demos import demonstrations
from rlbus.schemas.config import ModelConfig, RolloutConfig, RunConfig, TrainerConfig
from rlbus.schemas.lora import LoraConfig
from rlbus.schemas.sft import SftConfig
from rlbus.trainer.dist import spawn_local

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "common/model/shipped/tiny-calculator"


# ---------------------------------------------------------------------------------------------------------------
# helpers (importable by the spawned ranks)


def write_conversations(path: Path, num: int, seed: int) -> Path:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in demonstrations(num, seed=seed)))
    return path


def _runner(model_dir: str, data: str, lora_rank: int = 0, micro_batch_tokens: int = 0, **sft: object):
    from rlbus.trainer.engine import TrainEngine
    from rlbus.trainer.sft import SftRunner

    cfg = RunConfig(model=ModelConfig(path=model_dir, lora=LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank or 16)),
                    rollout=RolloutConfig(temperature=0.7),  # the RL steps' scoring temperature: not the phase's
                    trainer=TrainerConfig(micro_batch_size=3, grad_clip=1.0, weight_decay=0.01,
                                          micro_batch_tokens=micro_batch_tokens, pack_samples=micro_batch_tokens > 0,
                                          sft=SftConfig(data=data, **sft)))  # fmt: skip
    return SftRunner(TrainEngine.from_config(cfg), cfg, AutoTokenizer.from_pretrained(model_dir))


def _one_step_worker(model_dir: str, data: str, micro_batch_tokens: int = 0) -> dict:
    from rlbus.trainer.dist import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed("cpu")
    runner = _runner(model_dir, data, batch_size=8, lr=1e-3, micro_batch_tokens=micro_batch_tokens)
    # The gradient of step 1's loss, gathered whole (a collective), before the step itself trains on it.
    runner._passes(runner._my_share([runner.train[i] for i in runner.step_rows(1)]), train=True)
    grads = {n: p.grad.full_tensor() for n, p in runner.engine.model.named_parameters() if p.grad is not None}
    runner.optimizer.zero_grad(set_to_none=True)
    metrics = runner.step(1)
    destroy_distributed()
    return {"metrics": metrics, "grads": grads, "rows": runner.step_rows(1)}


def _phase_worker(model_dir: str, data: str, heldout: str, root: str, lora_rank: int, steps: int) -> dict:
    """A phase of `steps` steps, checkpointed half-way; then a second runner restored from that checkpoint trains
    the rest."""
    from rlbus.trainer.dist import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed("cpu")
    kw = {"lora_rank": lora_rank, "eval_data": heldout, "steps": steps, "batch_size": 8, "lr": 1e-2,
          "lr_schedule": "cosine", "warmup_steps": 2}
    runner = _runner(model_dir, data, **kw)
    before = runner.evaluate()
    losses = []
    for k in range(1, steps + 1):
        losses.append(runner.step(k)["sft/loss"])
        if k == steps // 2:
            runner.save(root, {"sft_step": k}, keep=2)
    after = runner.evaluate()
    final = runner.engine.full_state_dict()
    resumed = _runner(model_dir, data, **kw)
    assert resumed.restore(root) and resumed.steps_done == steps // 2
    for k in range(steps // 2 + 1, steps + 1):
        resumed.step(k)
    again = resumed.engine.full_state_dict()
    destroy_distributed()
    return {"before": before, "after": after, "losses": losses, "final": final, "resumed": again}


@pytest.fixture(scope="module")
def fresh_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's tokenizer with an untrained tiny model: a phase has everything to learn."""
    from rlbus.common.model.tiny import tiny_model

    out = tmp_path_factory.mktemp("fresh")
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    tiny_model(tok, seed=0).save_pretrained(out)
    tok.save_pretrained(out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# tests


# (2 ranks, 256): micro-batches of at most 256 token-positions, conversations of 39-78 tokens two to a row where
# they fit (trainer.micro_batch_tokens, trainer.pack_samples: the SFT phase passes its batch to the planner)
@pytest.mark.parametrize(("num_ranks", "micro_batch_tokens"), [(1, 0), (2, 0), (2, 256)])
def test_loss_and_update_equal_trl_sft_semantics(tmp_path: Path, num_ranks: int, micro_batch_tokens: int) -> None:
    """One phase step on 1 or 2 ranks (micro-batches of 3 out of 8 conversations, unequal lengths, uneven per
    rank): its loss is TRL's for the same batch, and so is its gradient (normalised over the whole step's tokens,
    not per micro-batch or rank)."""
    data = write_conversations(tmp_path / "chats.jsonl", 24, seed=11)
    out = spawn_local(num_ranks, _one_step_worker, str(SHIPPED), str(data), micro_batch_tokens)[0]
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    convs = [load_conversations(data, tok)[i] for i in out["rows"]]
    T = max(len(c.ids) for c in convs)
    pad = tok.pad_token_id
    input_ids = torch.tensor([c.ids + [pad] * (T - len(c.ids)) for c in convs])
    attention_mask = torch.tensor([[1] * len(c.ids) + [0] * (T - len(c.ids)) for c in convs])
    mask = torch.tensor([c.mask + [0] * (T - len(c.ids)) for c in convs])
    labels = torch.where(mask.bool(), input_ids, -100)  # TRL's collator: labels[assistant_masks == 0] = -100
    model = AutoModelForCausalLM.from_pretrained(SHIPPED)
    result = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)  # what compute_loss returns
    logp = torch.log_softmax(result.logits[:, :-1].float(), dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]
    by_hand = -logp[labels[:, 1:] != -100].mean()
    assert abs(result.loss.item() - by_hand.item()) < 1e-6
    assert out["metrics"]["sft/loss"] == pytest.approx(result.loss.item(), rel=1e-5)
    assert out["metrics"]["sft/num_tokens"] == float((labels[:, 1:] != -100).sum())

    result.loss.backward()
    grads = dict(model.named_parameters())
    assert len(out["grads"]) >= len(grads) - 1  # the output head is tied to the embedding
    for name, g in out["grads"].items():
        torch.testing.assert_close(g, grads[name].grad, rtol=1e-4, atol=1e-7, msg=name)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert out["metrics"]["sft/grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_phase_lowers_the_heldout_loss_and_resumes_exactly(tmp_path: Path, fresh_model: Path,
                                                             lora_rank: int) -> None:
    data = write_conversations(tmp_path / "train.jsonl", 160, seed=1)
    heldout = write_conversations(tmp_path / "heldout.jsonl", 32, seed=2)
    steps = 16
    out = spawn_local(2, _phase_worker, str(fresh_model), str(data), str(heldout), str(tmp_path / "ckpt"), lora_rank,
                      steps)[0]  # fmt: skip
    # A rank-4 adapter on an untrained model learns far slower than every weight does, but it learns.
    assert out["after"] < (0.95 if lora_rank else 0.7) * out["before"], (out["before"], out["after"], out["losses"])
    assert (tmp_path / "ckpt" / "sft" / "step_00000008" / ".metadata").is_file()
    for name, value in out["final"].items():  # the resumed phase ends on the same weights
        torch.testing.assert_close(out["resumed"][name], value, rtol=1e-5, atol=1e-7, msg=name)


def _heldout_loss(model_dir: Path, heldout: Path) -> float:
    """Token-mean loss of the held-out conversations under a model directory, by transformers' own loss."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    nll = tokens = 0.0
    with torch.no_grad():
        for c in load_conversations(heldout, tok):
            ids = torch.tensor([c.ids])
            labels = torch.where(torch.tensor([c.mask]).bool(), ids, -100)
            n = float((labels[:, 1:] != -100).sum())
            nll += model(input_ids=ids, labels=labels).loss.item() * n
            tokens += n
    return nll / tokens


@pytest.mark.slow
def test_a_phase_before_rl_in_the_trainer(tmp_path: Path, bus_config, run_creds, ray_address, tiny_model_dir,
                                          run_name, role_processes) -> None:
    """`rlbus trainer` with trainer.sft and two RL steps: the phase's rows and held-out loss, the step-0 checkpoint
    that holds its result, a producer that loads that result as version 0, then RL from it."""
    from rlbus.trainer.checkpoint import checkpoint_name
    from rlbus.trainer.metrics import read_metrics
    from tests.support.runs import small_run_config, start_role, wait_exit, write_config

    data = write_conversations(tmp_path / "train.jsonl", 96, seed=1)
    heldout = write_conversations(tmp_path / "heldout.jsonl", 24, seed=2)
    run_dir = tmp_path / "run"
    sft = {"data": str(data), "eval_data": str(heldout), "steps": 12, "batch_size": 8, "lr": 3e-3,
           "checkpoint_interval": 5, "eval_interval": 6}
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, bus_config.url, bus_config.creds_file, ray_address,
                           trainer={"total_steps": 2, "sft": sft})
    cfg_path = write_config(tmp_path / "run.yaml", cfg)
    trainer = start_role("trainer", cfg_path, tmp_path / "logs", creds=run_creds)
    producer = start_role("producer", cfg_path, tmp_path / "logs", "--id", "p0", name="p0", creds=run_creds)
    role_processes += [trainer, producer]
    assert wait_exit(trainer, 600) == 0, trainer.log_path.read_text()[-4000:]

    rows = read_metrics(run_dir / "sft")
    assert [r["step"] for r in rows] == list(range(1, 13))
    evals = [r["sft/eval_loss"] for r in rows if "sft/eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0] < _heldout_loss(tiny_model_dir, heldout)
    extra = json.loads((run_dir / "checkpoints" / checkpoint_name(0) / "extra.json").read_text())
    assert (extra["step"], extra["sft_steps"]) == (0, 12)
    assert not (run_dir / "checkpoints" / "sft").exists()  # step 0 holds the phase's result
    assert [r["step"] for r in read_metrics(run_dir) if "reward/mean" in r] == [1, 2]
    # Version 0 is the phase's result, not the model the producer was built from: it loads it.
    assert "loaded weights v0" in producer.log_path.read_text()
