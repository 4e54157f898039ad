"""On-policy distillation end to end on tiny models that share the quickstart's tokenizer: the student a tiny model
warm-started for 40 steps (it writes a tool call's shape, often wrongly), the teacher the shipped quickstart model,
which answers the calculator's questions right (common/model/shipped/tiny-calculator).

- the producers' teacher scores each sampled token as a direct Hugging Face forward of the teacher does, 0 where the
  environment inserted the token, with prompts of several lengths batched together;
- a teacher that is the student scores the engine's own behaviour log-probs (the reverse KL is 0);
- a teacher with another tokenizer (or another eos) is a config error naming algorithm.distill.teacher, in
  `rlbus up`'s check (which then starts nothing) and in the producer alike;
- a student that samples, is scored by the teacher and trains on the trainer's step (one FSDP2 rank, gloo) moves
  toward it: the sampled reverse KL falls, and on the teacher's own answers the student's log-prob rises and the
  exact KL(student || teacher) over the vocabulary falls;
- a distillation step replays bit for bit from its recorded batch, with no teacher.
A real `rlbus up` with a teacher: tests/system/test_distill_run.py.

    .venv/bin/python -m pytest -q tests/integration/test_distill.py
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlbus.common.chat import encode_chat
from rlbus.common.model.demos import prompt_messages
from rlbus.common.model.init_model import init_model
from rlbus.common.model.tiny import tiny_model
from rlbus.common.model.tokenizer import build_tokenizer
from rlbus.common.teacher import FIELD, check_teacher
from rlbus.producers.agent_loops.base import Trajectory
from rlbus.producers.engines.base import SamplingParams
from rlbus.producers.engines.hf import HFEngine
from rlbus.producers.teacher import Teacher
from rlbus.schemas.config import HFEngineConfig
from rlbus.schemas.config_io import from_dict
from rlbus.schemas.errors import ConfigError
from tests.support.engines import one_torch_thread  # noqa: F401 - a fixture (pytestmark below)
from tests.support.engines import teacher_forced_logprobs

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "common/model/shipped/tiny-calculator"
QUESTIONS = ["What is 17*23?", "What is 5+38?", "What is 9*9? Show the steps.", "What is 640+77?",
             "What is 12*12?", "What is 81+19?", "What is 7*8?", "What is 250+250?"]  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A short warm start (no check): it writes the answer's shape now and then, the teacher always does
    return init_model(tmp_path_factory.mktemp("distill") / "student", steps=40, check_target=0, num_threads=1,
                      log=lambda *_: None)  # fmt: skip


@pytest.fixture(scope="module")
def prompts(student_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    return [encode_chat(tokenizer, prompt_messages(q), add_generation_prompt=True) for q in QUESTIONS]


def sampled(student_dir: Path, prompts: list[list[int]], temperature: float, *, holes: bool) -> list[Trajectory]:
    """The student's sample of each prompt as a trajectory; with `holes`, odd ones get tokens inserted mid-response
    (tool output: mask 0), after which the engine's log-probs no longer describe the context."""
    engine = HFEngine(str(student_dir), HFEngineConfig(max_batch_size=32, share_weights=False), seed=0)
    params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=3)
    gens = asyncio.run(engine.generate(prompts, params))
    out = []
    for i, gen in enumerate(gens):
        t = Trajectory(prompt_ids=list(prompts[i]))
        k = len(gen.token_ids) // 2 if holes and i % 2 else len(gen.token_ids)
        t.add_generated(gen.token_ids[:k], gen.log_probs[:k], [0] * k)
        if k < len(gen.token_ids):  # the environment's tokens (mask 0) between two of the model's turns
            t.add_inserted([5, 6, 7])
            t.add_generated(gen.token_ids[k:], gen.log_probs[k:], [0] * (len(gen.token_ids) - k))
        out.append(t)
    return out


def test_teacher_log_probs_equal_a_direct_forward_of_the_teacher(student_dir: Path, prompts: list[list[int]]) -> None:
    trajectories = sampled(student_dir, prompts[:5], temperature=1.0, holes=True)
    assert len({len(t.prompt_ids) for t in trajectories}) > 1  # prompts of several lengths share a forward
    teacher = Teacher(str(SHIPPED), temperature=0.7, batch_size=3)  # chunks of 3 sequences: 3 + 2
    try:
        scores = asyncio.run(teacher.score(trajectories))
    finally:
        teacher.close()
    reference = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    worst, lowest = 0.0, 0.0
    for t, got in zip(trajectories, scores):
        assert got.dtype == torch.float32 and got.shape == (len(t.response_ids),)
        mask = torch.tensor(t.response_mask, dtype=torch.bool)
        expected = teacher_forced_logprobs(reference, t.prompt_ids, t.response_ids, temperature=0.7)
        assert (got[~mask] == 0).all()
        worst = max(worst, (got[mask] - expected[mask]).abs().max().item())
        lowest = min(lowest, expected[mask].min().item())
    assert lowest < -1.0  # the teacher disagrees with some sampled token: not a comparison of zeros
    assert worst < 1e-5, f"teacher vs a direct forward: max |diff| = {worst:.3g}"


def test_a_teacher_that_is_the_student_scores_the_behaviour_log_probs(student_dir: Path, prompts: list[list[int]]):
    """The teacher is scored at rollout.temperature, as the engine's behaviour log-probs are: with the student's own
    weights as teacher, the per-token reverse KL is 0 (within float rounding)."""
    trajectories = sampled(student_dir, prompts, temperature=0.8, holes=False)
    teacher = Teacher(str(student_dir), temperature=0.8, batch_size=4)
    try:
        scores = teacher.score_sync([(t.prompt_ids, t.response_ids, t.response_mask) for t in trajectories])
    finally:
        teacher.close()
    kl = torch.cat([torch.tensor(t.log_probs) - s for t, s in zip(trajectories, scores)])
    assert kl.abs().max().item() < 1e-4


def _other_tokenizer_model(out: Path) -> Path:
    tokenizer = build_tokenizer(["a teacher from another family", "with a vocabulary of its own 0123456789"] * 50,
                                vocab_size=300)  # fmt: skip
    tiny_model(tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_a_teacher_with_another_tokenizer_is_a_config_error(student_dir: Path, tmp_path: Path) -> None:
    from rlbus.cli.validate import config_errors

    def run(teacher: Path):
        return from_dict({"model": {"path": str(student_dir)}, "algorithm": {"distill": {"teacher": str(teacher)}}})

    check_teacher(SHIPPED, student_dir)  # the same tokenizer: accepted
    assert not [e for e in config_errors(run(SHIPPED)) if e.field == FIELD]
    other = _other_tokenizer_model(tmp_path / "other")
    with pytest.raises(ConfigError, match="does not share the student's tokenizer: the vocabularies differ") as e:
        check_teacher(other, student_dir)
    assert e.value.field == FIELD
    assert [e.field for e in config_errors(run(other))] == [FIELD]  # `rlbus up` stops before starting anything
    with pytest.raises(ConfigError, match="the vocabularies differ"):  # so does a producer started alone
        Teacher.from_config(run(other), AutoTokenizer.from_pretrained(student_dir))
    # the same vocabulary with another end-of-sequence token
    eos = shutil.copytree(SHIPPED, tmp_path / "eos")
    tok_cfg = json.loads((eos / "tokenizer_config.json").read_text())
    tok_cfg["eos_token"] = "<|endoftext|>" if tok_cfg.get("eos_token") != "<|endoftext|>" else "<|im_start|>"
    (eos / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    with pytest.raises(ConfigError, match="eos_token differs"):
        check_teacher(eos, student_dir)
    with pytest.raises(ConfigError, match="holds no model"):
        check_teacher(tmp_path / "missing", student_dir)


def test_rlbus_up_refuses_such_a_teacher_at_once_and_starts_nothing(tmp_path: Path) -> None:
    import subprocess
    import sys

    other = _other_tokenizer_model(tmp_path / "other")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = subprocess.run([sys.executable, "-m", "rlbus.cli", "up", str(ROOT / "configs" / "quickstart.yaml"),
                           f"model.path={SHIPPED}", f"algorithm.distill.teacher={other}"],
                          cwd=cwd, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"rlbus: config error: {FIELD}: the teacher at {other} does not share the student's tokenizer" in proc.stderr
    assert list(cwd.iterdir()) == []  # no run directory: no bus, Ray or role was started


# ---------------------------------------------------------------------------------------------------------------
# the loop: student samples, the teacher scores, the trainer steps, the sampler loads the new weights

STEPS = 12


def _distill_worker(student_dir: str, prompts: list[list[int]]) -> dict:
    from rlbus.consumers.collate import collate
    from rlbus.schemas.wire import SampleMeta
    from rlbus.trainer import algorithms as A
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(1)
    init_distributed("cpu")
    n = 4
    cfg = from_dict({
        "model": {"path": student_dir},
        "rollout": {"temperature": 1.0, "n": n, "max_new_tokens": 12},
        "algorithm": {"off_policy": "bypass", "distill": {"teacher": str(SHIPPED), "weight": 1.0}},
        "trainer": {"lr": 2e-3, "micro_batch_size": 32, "mini_batches": 1, "grad_clip": 1.0},
    })  # fmt: skip
    train = TrainEngine.from_config(cfg)
    teacher = Teacher.from_config(cfg, AutoTokenizer.from_pretrained(student_dir))
    sampler = HFEngine(student_dir, HFEngineConfig(max_batch_size=32, share_weights=False), seed=0)

    def batch_of(trajectories: list[Trajectory], scores: list[torch.Tensor]):
        samples = []
        for i, t in enumerate(trajectories):
            tensors = {**t.tensors(), "teacher_log_probs": scores[i]}
            meta = SampleMeta(key=f"s{i}", prompt_len=len(t.prompt_ids), response_len=len(t.response_ids), reward=0.0)
            samples.append((meta, tensors))
        return collate(samples, [i // n for i in range(len(samples))])

    async def loop() -> dict:
        # The teacher's own answers (greedy): what the student should come to say.
        greedy = await HFEngine(str(SHIPPED), HFEngineConfig(max_batch_size=32), seed=0).generate(
            prompts, SamplingParams(temperature=1e-4, max_new_tokens=12))
        answers = []
        for p, g in zip(prompts, greedy):
            t = Trajectory(prompt_ids=list(p))
            t.add_generated(g.token_ids, [0.0] * len(g.token_ids), [0] * len(g.token_ids))
            answers.append(t)
        probe = batch_of(answers, [torch.zeros(len(t.response_ids)) for t in answers])  # (the step's keys)

        teacher_model = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval()
        student_model = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
        at_BT = probe["response_mask"] > 0  # positions scored: the teacher's answer tokens

        def student_on_answers() -> tuple[float, float]:
            """(the student's mean log-prob of the teacher's answer tokens, the exact KL(student || teacher) over
            the vocabulary at those positions, mean per position), with the trainer's current weights."""
            logp = train.compute_log_probs(probe)
            student_model.load_state_dict(train.full_state_dict())
            with torch.no_grad():
                inputs = {k: probe[k] for k in ("input_ids", "attention_mask", "position_ids")}
                s_BTV = torch.log_softmax(student_model(**inputs).logits[:, :-1], -1)[at_BT[:, 1:]]
                t_BTV = torch.log_softmax(teacher_model(**inputs).logits[:, :-1], -1)[at_BT[:, 1:]]
            kl = (s_BTV.exp() * (s_BTV - t_BTV)).sum(-1).mean()
            return float(logp[at_BT].mean()), float(kl)

        out = {"answers": [student_on_answers()], "reverse_kl": []}
        for step in range(1, STEPS + 1):
            gens = await sampler.generate([p for p in prompts for _ in range(n)],
                                          SamplingParams(temperature=1.0, max_new_tokens=12, seed=step))
            trajectories = []
            for i, g in enumerate(gens):
                t = Trajectory(prompt_ids=list(prompts[i // n]))
                t.add_generated(g.token_ids, g.log_probs, [step - 1] * len(g.token_ids))
                trajectories.append(t)
            batch = batch_of(trajectories, await teacher.score(trajectories))
            metrics = train.train_step(batch)
            if step == 1:  # the step's advantage is the teacher's: -(behaviour - teacher) on each sampled token
                expected = A.distill_advantages(batch["rollout_log_probs"], batch["teacher_log_probs"],
                                                batch["response_mask"], A.DistillSpec(weight=1.0))  # fmt: skip
                torch.testing.assert_close(train.computed["advantages"], expected)
            out["reverse_kl"].append(metrics["distill/reverse_kl"])
            await sampler.load_weights(train.full_state_dict(), step)
        out["answers"].append(student_on_answers())
        return out

    try:
        return asyncio.run(loop())
    finally:
        teacher.close()
        destroy_distributed()


def test_distillation_moves_the_student_toward_the_teacher(student_dir: Path, prompts: list[list[int]]) -> None:
    from rlbus.trainer.dist import spawn_local

    out = spawn_local(1, _distill_worker, str(student_dir), prompts)[0]
    kl, ((logp0, exact0), (logp1, exact1)) = out["reverse_kl"], out["answers"]
    print(f"sampled reverse KL per token by step: {[round(x, 3) for x in kl]}; on the teacher's answers, the "
          f"student's log-prob {logp0:.3f} -> {logp1:.3f} and the exact KL(student || teacher) {exact0:.3f} -> "
          f"{exact1:.3f} per token")
    assert exact1 < 0.7 * exact0, (exact0, exact1)
    assert logp1 > logp0, (logp0, logp1)
    assert sum(kl[-3:]) / 3 < 0.7 * kl[0], kl


# ---------------------------------------------------------------------------------------------------------------
# the teacher's scores are part of the recorded batch: `rlbus replay` redoes a distillation step without the teacher


def test_a_distillation_step_replays_bit_for_bit_without_the_teacher(tmp_path: Path, monkeypatch) -> None:
    from tests.integration import test_replay as R
    from rlbus.trainer.replay import replay

    def with_teacher(step: int, *args):  # what a producer stores: the teacher's scores, 0 where the mask is 0
        groups, stored = make_groups(step, *args)
        g = torch.Generator().manual_seed(step)
        for t in stored.values():
            t["teacher_log_probs"] = -torch.rand(t["response_ids"].shape, generator=g) * 6 * t["response_mask"]
        return groups, stored

    make_groups = R.make_groups
    monkeypatch.setattr(R, "make_groups", with_teacher)
    # The teacher's directory does not exist: the trainer never loads it (the producers do), nor does the replay.
    recorded = R.record_run(tmp_path, algorithm={"distill": {"teacher": str(tmp_path / "gone"), "weight": 0.5}})
    result, _ = replay(recorded["run_dir"], from_step=3, num_steps=2)
    assert result.identical, [d for d in result.diffs if not d.equal]
    assert result.metrics[4]["distill/reverse_kl"] == recorded["rows"][3]["distill/reverse_kl"] != 0
    # ... and the teacher's signal is in the recorded step: without it the same batch trains otherwise
    what_if, _ = replay(recorded["run_dir"], from_step=3, num_steps=1, overrides=["algorithm.distill.weight=0"])
    assert what_if.metrics[3]["actor/pg_loss"] != recorded["rows"][2]["actor/pg_loss"]
    assert "distill/reverse_kl" not in what_if.metrics[3]
