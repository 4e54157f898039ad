"""PPO with a critic (GAE) on real FSDP2 (gloo, spawned ranks) and a tiny Qwen2: two ranks equal one process, the
critic's warm-up holds the actor, a checkpoint resumes policy and critic exactly, the export carries the critic,
and `rlbus replay` reproduces GAE steps bit for bit.

    .venv/bin/python -m pytest -q tests/integration/test_critic.py
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlbus.schemas.config import AlgorithmConfig, CriticConfig, TrainerConfig
from tests.integration.test_fsdp import build_tiny_qwen2, make_batch, rank_share

ALGO = AlgorithmConfig(adv_estimator="gae", gamma=1.0, lam=0.95, off_policy="decoupled")
CRITIC = CriticConfig(lr=1e-3, cliprange_value=0.2, critic_warmup=2)  # the actor first updates at step 2
# One update per step here: with several, one process must cut the rows as the ranks did (engine.rank_rows, the
# two-update test below; the replay test runs two per step too).
TRAINER = TrainerConfig(micro_batch_size=3, mini_batches=1, lr=1e-3, total_steps=4)
COMPARED = ("actor/pg_loss", "actor/clipfrac", "critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm",
            "critic/values_mean", "critic/returns_mean", "critic/vf_explained_var")  # fmt: skip


def _same(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if not k.startswith(("timing/", "perf/"))} == {
        k: v for k, v in b.items() if not k.startswith(("timing/", "perf/"))
    }


def _gae_worker(model_dir: str, root: str | None, critic: CriticConfig = CRITIC) -> dict:
    """Three steps (the first the critic's warm-up), a checkpoint after the second and step 3 again from it.
    Either critic (`critic.backbone`): tests/integration/test_shared_critic.py runs it with the shared head."""
    from rlbus.trainer.checkpoint import load_checkpoint, save_checkpoint
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(1)
    info = init_distributed("cpu")
    share = lambda s: rank_share(make_batch(seed=s), info.rank, info.world_size)
    make = lambda: TrainEngine(model_dir, TRAINER, ALGO, temperature=0.9, critic_cfg=critic)
    engine = make()
    # copies: at world size 1 the full state dicts are the live parameters
    policy_0 = {k: v.clone() for k, v in engine.full_state_dict().items()}
    critic_0 = {k: v.clone() for k, v in engine.critic_full_state_dict().items()}
    metrics = [engine.train_step(share(1))]  # the critic's warm-up: the actor waits
    out = {
        "policy_still": all(torch.equal(w, policy_0[k]) for k, w in engine.full_state_dict().items()),
        "critic_moved": any(not torch.equal(w, critic_0[k]) for k, w in engine.critic_full_state_dict().items()),
    }
    metrics.append(engine.train_step(share(2)))
    if root is not None:
        save_checkpoint(engine, root, 2, {"step": 2}, keep=1)
        out["probe_values"] = engine.compute_values(make_batch(seed=7))
        out["policy_2"], out["critic_2"] = engine.full_state_dict(), engine.critic_full_state_dict()
    metrics.append(engine.train_step(share(3)))
    out["weights_3"] = (engine.full_state_dict(), engine.critic_full_state_dict())
    if root is not None:
        fresh = make()
        load_checkpoint(fresh, root)
        out["resumed"] = fresh.train_step(share(3))
        out["resumed_weights_3"] = (fresh.full_state_dict(), fresh.critic_full_state_dict())
    destroy_distributed()
    out["metrics"] = metrics
    return out


@pytest.mark.slow
def test_gae_two_ranks_warmup_resume_and_export(tmp_path: Path) -> None:
    from transformers import AutoModelForTokenClassification

    from rlbus.trainer.checkpoint import export_hf, latest_checkpoint
    from rlbus.trainer.dist import spawn_local

    torch.set_num_threads(1)
    model_dir = build_tiny_qwen2(tmp_path / "model")
    root = tmp_path / "ckpt"
    two = spawn_local(2, _gae_worker, str(model_dir), str(root))
    one = spawn_local(1, _gae_worker, str(model_dir), None)[0]
    r0 = two[0]

    # warm-up: step 1 trained the critic and left the policy exactly where it was
    assert r0["policy_still"] and r0["critic_moved"]
    first, second = r0["metrics"][0], r0["metrics"][1]
    assert first["actor/waiting"] == 1.0 and "actor/pg_loss" not in first
    assert "actor/waiting" not in second and math.isfinite(second["actor/pg_loss"])
    # one update per step: the values being trained are those the advantages used, so the clip is never active
    assert first["critic/grad_norm"] > 0 and second["critic/vf_clipfrac"] == 0.0
    # the critic learns the returns of these batches: its error shrinks from the fresh head's
    assert second["critic/vf_loss"] < first["critic/vf_loss"]

    # two uneven ranks (3 groups + 1) equal one process: whitening, normalisers and metrics are whole-batch
    assert two[0]["metrics"] == two[1]["metrics"]
    for step in range(3):
        for name in COMPARED:
            if name in one["metrics"][step]:
                assert r0["metrics"][step][name] == pytest.approx(one["metrics"][step][name], rel=2e-4, abs=1e-6), (
                    step,
                    name,
                )

    # resume from the step-2 checkpoint: step 3 again, the same numbers and weights for policy and critic
    assert _same(r0["resumed"], r0["metrics"][2])
    for live, resumed in zip(r0["weights_3"], r0["resumed_weights_3"]):
        assert live.keys() == resumed.keys() and all(torch.equal(live[k], resumed[k]) for k in live)

    # the export holds the critic next to the policy, and it gives the trainer's values (V_t from position t - 1)
    out = export_hf(latest_checkpoint(root), tmp_path / "hf", model_dir)
    critic = AutoModelForTokenClassification.from_pretrained(out / "critic")
    for k, w in r0["critic_2"].items():
        assert torch.equal(critic.state_dict()[k], w), k
    assert_exported_critic_gives_the_trainers_values(critic, r0["probe_values"])


@pytest.mark.slow
def test_gae_replays_bit_for_bit(tmp_path: Path) -> None:
    from rlbus.trainer.replay import replay
    from tests.integration.test_replay import record_run

    recorded = record_run(tmp_path, algorithm={"adv_estimator": "gae", "lam": 0.95},
                          critic={"lr": 1e-2, "critic_warmup": 2, "cliprange_value": 0.01})  # fmt: skip
    assert recorded["rows"][0]["actor/waiting"] == 1.0 and "critic/vf_loss" in recorded["rows"][3]
    # two updates per step: the second one's values have moved, and the clip of the value loss bites
    assert all(0 < row["critic/vf_clipfrac"] < 1 for row in recorded["rows"])
    result, engine = replay(recorded["run_dir"], from_step=3, num_steps=2)
    assert result.from_checkpoint == 2
    assert result.identical, [d for d in result.diffs if not d.equal]
    assert {"critic/vf_loss", "critic/values_mean", "critic/vf_explained_var"} <= {d.name for d in result.diffs}
    live, replayed = recorded["engine"].critic.full_state_dict(), engine.critic.full_state_dict()
    assert all(torch.equal(live[k], replayed[k]) for k in live)


def assert_exported_critic_gives_the_trainers_values(critic, probe_values: torch.Tensor) -> None:
    """The exported critic (an AutoModelForTokenClassification) on the probe batch gives the values the trainer
    computed for it: V_t from position t - 1, zero off the response."""
    probe = make_batch(seed=7)
    with torch.no_grad():
        v = critic(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"],
                   position_ids=probe["position_ids"]).logits[..., 0]  # fmt: skip
    expected = torch.nn.functional.pad(v[:, :-1], (1, 0)) * probe["response_mask"]
    torch.testing.assert_close(probe_values, expected, rtol=1e-5, atol=1e-6)


def _two_update_worker(model_dir: str, rank_rows: list[int] | None) -> list[dict]:
    """Two steps of GAE with two optimizer updates each; with `rank_rows` (one process only) the updates take the
    rows as two ranks of those shares cut them (what `rlbus replay` does for a run recorded on two ranks)."""
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(1)
    info = init_distributed("cpu")
    engine = TrainEngine(model_dir, TRAINER_2, ALGO, temperature=0.9, critic_cfg=CriticConfig(lr=1e-3))
    engine.rank_rows = rank_rows
    metrics = []
    for s in (1, 2):
        whole = make_batch(seed=s)
        if rank_rows is None:
            batch = rank_share(whole, info.rank, info.world_size)
        else:  # the shares concatenated in rank order, as consumers/event_log.py load_step_batch gives them
            batch = torch.cat([rank_share(whole, r, 2) for r in (0, 1)])
        metrics.append(engine.train_step(batch))
    destroy_distributed()
    return metrics


TRAINER_2 = TrainerConfig(micro_batch_size=3, mini_batches=2, lr=1e-3, total_steps=4)


@pytest.mark.slow
def test_two_updates_per_step_on_two_ranks_equal_one_process_cutting_as_the_ranks_did(tmp_path: Path) -> None:
    """The replay of a multi-rank run with several updates per step: each update must train the k-th mini-batch of
    every rank's rows (trainer/engine.py update_parts); one cut of the concatenation trains other rows."""
    from rlbus.trainer.dist import spawn_local

    torch.set_num_threads(1)
    model_dir = build_tiny_qwen2(tmp_path / "model")
    two = spawn_local(2, _two_update_worker, str(model_dir), None)[0]
    rows = [rank_share(make_batch(seed=1), r, 2).batch_size[0] for r in (0, 1)]
    assert rows[0] != rows[1]  # uneven shares: a plain cut of the concatenation differs from the ranks' cuts
    as_ranks = spawn_local(1, _two_update_worker, str(model_dir), rows)[0]
    plain = spawn_local(1, _two_update_worker, str(model_dir), None)[0]
    names = ("actor/pg_loss", "critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "actor/grad_norm")
    for step in range(2):
        for name in names:
            assert as_ranks[step][name] == pytest.approx(two[step][name], rel=2e-4, abs=1e-6), (step, name)
    # the test can tell: cut once, the second update of step 1 already trains other rows
    assert any(plain[s][n] != pytest.approx(two[s][n], rel=2e-4, abs=1e-6) for s in range(2) for n in names)
