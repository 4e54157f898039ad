"""PPO's critic as a value head on the policy's own transformer (`critic.backbone: shared`), on real FSDP2 (gloo,
spawned ranks) and a tiny Qwen2: during the warm-up the head learns alone (value loss falls, explained variance
rises, the policy stays bit for bit), then both train from one forward and one backward; two ranks equal one
process; a checkpoint resumes policy, head and their one AdamW exactly; producers get the policy's weights alone;
the export is a plain causal LM beside a critic that gives the trainer's values; `rlbus replay` reproduces steps bit
for bit.

    .venv/bin/python -m pytest -q tests/integration/test_shared_critic.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlbus.schemas.config import AlgorithmConfig, CriticConfig, TrainerConfig
from tests.integration.test_critic import (
    ALGO,
    TRAINER,
    _gae_worker,
    assert_exported_critic_gives_the_trainers_values,
)
from tests.integration.test_fsdp import build_tiny_qwen2, make_batch

# test_critic.py's run (one update per step, lam 0.95, the actor first updates at step 2) with the head on the policy
CRITIC = CriticConfig(backbone="shared", lr=1e-2, vf_coef=0.5, cliprange_value=0.2, critic_warmup=2)
COMPARED = ("actor/pg_loss", "actor/clipfrac", "actor/grad_norm", "actor/entropy", "critic/vf_loss",
            "critic/vf_clipfrac", "critic/grad_norm", "critic/values_mean", "critic/returns_mean",
            "critic/vf_explained_var")  # fmt: skip


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(("timing/", "perf/"))}


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _learn_worker(model_dir: str, steps: int) -> dict:
    """One rank: the same batch every step, the head alone for `steps` steps (the actor waits), then one more."""
    from transformers import AutoModelForCausalLM

    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(1)
    init_distributed("cpu")
    critic = CriticConfig(backbone="shared", lr=3e-2, critic_warmup=steps + 1)
    algo = AlgorithmConfig(adv_estimator="gae", gamma=1.0, lam=1.0)  # lam 1: the returns do not depend on V
    engine = TrainEngine(model_dir, TrainerConfig(micro_batch_size=8, lr=1e-3), algo, temperature=1.0,
                         critic_cfg=critic)  # fmt: skip
    batch = make_batch(seed=3)
    # copies: at world size 1 the full state dicts are the live parameters
    policy_0, head_0 = _copy(engine.full_state_dict()), _copy(engine.critic_full_state_dict())
    metrics = [engine.train_step(batch) for _ in range(steps)]
    out = {"metrics": metrics, "policy_still": _equal(engine.full_state_dict(), policy_0),
           "head_moved": not _equal(engine.critic_full_state_dict(), head_0)}  # fmt: skip
    metrics.append(engine.train_step(batch))  # the actor's first step, with the value loss in its loss
    out["policy_moved"] = not _equal(engine.full_state_dict(), policy_0)
    out["published"] = set(engine.full_state_dict())
    out["plain"] = set(AutoModelForCausalLM.from_pretrained(model_dir).state_dict())
    destroy_distributed()
    return out


def test_head_learns_alone_in_warmup_then_with_the_policy(tmp_path: Path) -> None:
    from rlbus.trainer.dist import spawn_local

    torch.set_num_threads(1)
    model_dir = build_tiny_qwen2(tmp_path / "model")
    out = spawn_local(1, _learn_worker, str(model_dir), 8)[0]
    warm, first = out["metrics"][:8], out["metrics"][8]
    loss = [m["critic/vf_loss"] for m in warm]
    explained = [m["critic/vf_explained_var"] for m in warm]
    print("vf_loss", [f"{x:.4f}" for x in loss], "explained", [f"{x:.3f}" for x in explained])
    # the head fits the fixed batch's returns: its loss falls and it explains more of them
    assert loss[-1] < 0.5 * loss[0] and sum(loss[-3:]) < 0.6 * sum(loss[:3])
    assert explained[-1] > explained[0] + 0.2 and explained[-1] > 0
    # ... with the policy untouched: no policy metric, the policy's weights bit for bit
    assert out["policy_still"] and out["head_moved"]
    assert all(m["actor/waiting"] == 1.0 and "actor/pg_loss" not in m and "actor/grad_norm" not in m for m in warm)
    # then the actor trains: pg loss and value loss from one forward, the policy moves
    assert "actor/waiting" not in first and first["actor/grad_norm"] > 0 and first["critic/grad_norm"] > 0
    # actor/num_updates counts the policy's updates: none in the warm-up, then one
    assert [m["actor/num_updates"] for m in warm] == [0.0] * 8 and first["actor/num_updates"] == 1.0
    assert out["policy_moved"]
    # producers are sent the policy's weights only: exactly a plain causal LM's names, no value head
    assert out["published"] == out["plain"] and not any(k.startswith("value_head") for k in out["published"])


def test_two_ranks_resume_and_export(tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from rlbus.trainer.checkpoint import export_hf, latest_checkpoint
    from rlbus.trainer.dist import spawn_local

    torch.set_num_threads(1)
    model_dir = build_tiny_qwen2(tmp_path / "model")
    root = tmp_path / "ckpt"
    two = spawn_local(2, _gae_worker, str(model_dir), str(root), CRITIC)  # the separate critic's test, shared
    one = spawn_local(1, _gae_worker, str(model_dir), None, CRITIC)[0]
    r0 = two[0]

    first, second = r0["metrics"][0], r0["metrics"][1]
    assert first["actor/waiting"] == 1.0 and "actor/waiting" not in second
    assert r0["policy_still"] and r0["critic_moved"]  # the warm-up step moved the head alone
    # two uneven ranks (rank 1 runs empty passes) equal one process: every metric, every step
    assert _untimed(two[0]["metrics"][2]) == _untimed(two[1]["metrics"][2])
    for step in range(3):
        for name in COMPARED:
            assert (name in r0["metrics"][step]) == (name in one["metrics"][step]), (step, name)
            if name in one["metrics"][step]:
                assert r0["metrics"][step][name] == pytest.approx(one["metrics"][step][name], rel=2e-4, abs=1e-6), (
                    step,
                    name,
                )
    # weights after three updates: Adam divides by the root of the squared gradient, so where a gradient is ~0 its
    # float rounding moves a weight by up to a fraction of an update (lr 1e-3): 2e-5 allowed
    for sharded, whole in zip(r0["weights_3"], one["weights_3"]):
        for k in whole:
            torch.testing.assert_close(sharded[k], whole[k], rtol=1e-4, atol=2e-5)

    # resume from the step-2 checkpoint: step 3 again, the same numbers and weights for policy and head (their
    # AdamW moments and LR schedules came back with them, or the update would differ)
    assert _untimed(r0["resumed"]) == _untimed(r0["metrics"][2])
    for live, resumed in zip(r0["weights_3"], r0["resumed_weights_3"]):
        assert _equal(live, resumed)

    # the export: a plain causal LM of the policy's weights, no value head in its files ...
    out = export_hf(latest_checkpoint(root), tmp_path / "hf", model_dir)
    policy_2, head_2 = r0["policy_2"], r0["critic_2"]
    names = set()
    for f in out.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            names |= set(fh.keys())
    assert not any("value_head" in n for n in names)
    plain, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    assert _equal({k: v for k, v in plain.state_dict().items() if k in policy_2}, policy_2)
    # ... and beside it the critic the two make, which gives the trainer's values (V_t from position t - 1)
    critic = AutoModelForTokenClassification.from_pretrained(out / "critic")
    assert torch.equal(critic.score.weight, head_2["value_head.weight"])
    assert torch.equal(critic.score.bias, head_2["value_head.bias"])
    assert_exported_critic_gives_the_trainers_values(critic, r0["probe_values"])


def test_shared_critic_replays_bit_for_bit(tmp_path: Path) -> None:
    from rlbus.trainer.replay import replay
    from tests.integration.test_replay import record_run

    critic = {"backbone": "shared", "lr": 1e-2, "critic_warmup": 2, "cliprange_value": 0.01, "vf_coef": 0.5}
    recorded = record_run(tmp_path, algorithm={"adv_estimator": "gae", "lam": 0.95}, critic=critic)
    rows = recorded["rows"]
    assert rows[0]["actor/waiting"] == 1.0 and "actor/pg_loss" in rows[3]
    # two updates per step: the second one's values have moved, and the clip of the value loss bites
    assert all(0 < row["critic/vf_clipfrac"] < 1 for row in rows)
    result, engine = replay(recorded["run_dir"], from_step=3, num_steps=2)
    assert result.from_checkpoint == 2
    assert result.identical, [d for d in result.diffs if not d.equal]
    assert {"critic/vf_loss", "critic/grad_norm", "critic/lr", "actor/pg_loss"} <= {d.name for d in result.diffs}
    live = recorded["engine"]
    assert _equal(live.full_state_dict(), engine.full_state_dict())
    assert _equal(live.critic_full_state_dict(), engine.critic_full_state_dict())
    # the what-if path keeps each group's own hyper-parameters: the head's LR is the critic's, not the policy's
    assert [g["lr"] for g in engine.optimizer.param_groups] == [g["lr"] for g in live.optimizer.param_groups]


def test_shared_critic_config_errors_name_the_field() -> None:
    from rlbus.schemas.config_io import load_config
    from rlbus.schemas.errors import ConfigError

    base = ["model.path=m", "algorithm.adv_estimator=gae"]
    for override, field in [("critic.backbone=same", "critic.backbone"), ("critic.vf_coef=0", "critic.vf_coef"),
                            ("critic.vf_coef=nan", "critic.vf_coef")]:  # fmt: skip
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(None, [*base, override])
    with pytest.raises(ConfigError, match=r"critic\.path: must be empty with backbone: shared"):
        load_config(None, [*base, "critic.backbone=shared", "critic.path=/some/critic"])
    cfg = load_config(None, [*base, "critic.backbone=shared", "critic.vf_coef=0.25"])
    assert cfg.critic.backbone == "shared" and cfg.critic.vf_coef == 0.25


def _switch_worker(model_dir: str, root: str) -> dict:
    """A checkpoint saved under each critic layout, resumed under each other one: what load_checkpoint says."""
    from rlbus.trainer.checkpoint import load_checkpoint, save_checkpoint
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(1)
    init_distributed("cpu")
    layouts = {"none": (AlgorithmConfig(adv_estimator="grpo"), CriticConfig()),
               "separate": (ALGO, CriticConfig(critic_warmup=0)),
               "shared": (ALGO, CriticConfig(backbone="shared", critic_warmup=0))}  # fmt: skip
    make = lambda layout: TrainEngine(model_dir, TRAINER, layouts[layout][0], temperature=1.0,
                                      critic_cfg=layouts[layout][1])  # fmt: skip
    out = {}
    for saved in layouts:
        engine = make(saved)
        engine.train_step(make_batch(seed=1))
        save_checkpoint(engine, Path(root) / saved, 1, {"step": 1}, keep=1)
        for run in layouts:
            try:
                load_checkpoint(make(run), Path(root) / saved)
                out[saved, run] = "resumed"
            except Exception as e:  # noqa: BLE001 - the message is what the test reads
                out[saved, run] = f"{type(e).__name__}: {e}"
    destroy_distributed()
    return out


def test_resuming_under_another_critic_layout_names_the_settings(tmp_path: Path) -> None:
    """A checkpoint resumed with the critic switched (none / separate / shared) is refused with the settings it was
    saved under and the run's, not DCP's list of missing keys; a saved separate critic a GRPO run drops is fine."""
    from rlbus.trainer.dist import spawn_local

    model_dir = build_tiny_qwen2(tmp_path / "model")
    out = spawn_local(1, _switch_worker, str(model_dir), str(tmp_path / "ckpt"))[0]
    for (saved, run), said in out.items():
        if saved == run or (saved, run) == ("separate", "none"):
            assert said == "resumed", (saved, run, said)
            continue
        assert said.startswith("CheckpointError"), (saved, run, said)
        before, after = said.split("this run's config has")
        assert _LAYOUT_WORDS[saved] in before and _LAYOUT_WORDS[run] in after, said


_LAYOUT_WORDS = {"none": "no critic", "separate": "critic.backbone: separate", "shared": "critic.backbone: shared"}


def _export_worker(model_dir: str, root: str) -> None:
    from rlbus.trainer.checkpoint import save_checkpoint
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(1)
    init_distributed("cpu")
    engine = TrainEngine(model_dir, TRAINER, ALGO, temperature=1.0,
                         critic_cfg=CriticConfig(backbone="shared", critic_warmup=0))  # fmt: skip
    for seed in (1, 2):
        engine.train_step(make_batch(seed=seed))
    save_checkpoint(engine, root, 2, {"step": 2}, keep=1)
    destroy_distributed()


@pytest.mark.slow
async def test_exported_policy_serves_in_vllm(tmp_path: Path) -> None:
    """The export of a shared-head run is what vLLM loads as any causal LM (it reads every top-level safetensors
    file: a head there would be an unknown weight), and it samples the trained policy's log-probs."""
    from tests.support.vllm import require_vllm

    require_vllm()
    from transformers import AutoModelForCausalLM

    from rlbus.common.model.init_model import init_model
    from rlbus.producers.engines.base import SamplingParams
    from rlbus.producers.engines.vllm import VLLMEngine
    from rlbus.schemas.config import VLLMEngineConfig
    from rlbus.trainer.checkpoint import export_hf, latest_checkpoint
    from rlbus.trainer.dist import spawn_local
    from tests.integration.test_vllm_engine import LOGPROB_TOL, SPEC
    from tests.support.engines import teacher_forced_logprobs

    model_dir = init_model(tmp_path / "model", steps=0, spec=SPEC, log=lambda _: None)
    spawn_local(1, _export_worker, str(model_dir), str(tmp_path / "ckpt"))
    out = export_hf(latest_checkpoint(tmp_path / "ckpt"), tmp_path / "hf", model_dir)
    assert (out / "critic" / "config.json").is_file()
    engine = VLLMEngine(str(out), VLLMEngineConfig(max_model_len=128, max_num_seqs=4), seed=0)
    try:
        prompts = [[5, 6, 7, 9], [8, 11, 12]]
        gens = await engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=1))
    finally:
        await engine.close()
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, gen in zip(prompts, gens):
        assert len(gen.token_ids) == 12
        sampled = torch.tensor(gen.log_probs)
        assert (teacher_forced_logprobs(trained, prompt, gen.token_ids) - sampled).abs().max() < LOGPROB_TOL
    # ... and the trained policy is not the base model: the comparison above tells them apart
    assert any((teacher_forced_logprobs(base, p, g.token_ids) - torch.tensor(g.log_probs)).abs().max() > LOGPROB_TOL
               for p, g in zip(prompts, gens))  # fmt: skip
