"""`rlbus replay` reproduces recorded steps bit for bit from a checkpoint, and runs what-ifs on the same data.

The recorded run is made in-process with the real pieces (no bus, no Ray): a tiny Qwen2, TrainEngine, batches
built by consumers.collate from random tokens, the recorder's shard writer and step records, MetricsLog, and a
checkpoint at step 2.

    .venv/bin/python -m pytest -q tests/integration/test_replay.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbus.schemas.config import RunConfig
from rlbus.schemas.config_io import from_dict, to_yaml
from rlbus.schemas.wire import SampleMeta, TrajectoryGroup
from tests.integration.test_fsdp import VOCAB, build_tiny_qwen2

NUM_STEPS = 4
GROUPS_PER_STEP = 2
GROUP_SIZE = 4


def make_groups(step: int, producers: tuple[str, ...] = ("p0", "p1")) -> tuple[list[TrajectoryGroup], dict]:
    """Groups of random trajectories (prompt, assistant turn, masked tool output, assistant turn) and their tensors."""
    g = torch.Generator().manual_seed(1000 + step)
    groups, stored = [], {}
    for gi in range(GROUPS_PER_STEP):
        gid = f"e0-i{step * 10 + gi}-a0"
        samples = []
        for si in range(GROUP_SIZE):
            P, R = int(torch.randint(3, 7, (1,), generator=g)), int(torch.randint(8, 16, (1,), generator=g))
            mask = torch.ones(R, dtype=torch.long)
            mask[3:5] = 0  # the tool's output, carried in the context, not trained on
            key = f"{gid}/{si}"
            stored[key] = {
                "prompt_ids": torch.randint(2, VOCAB, (P,), generator=g),
                "response_ids": torch.randint(2, VOCAB, (R,), generator=g),
                "response_mask": mask,
                "rollout_log_probs": -torch.rand(R, generator=g) - 3.5,
                "versions": torch.full((R,), max(0, step - 2), dtype=torch.long),
            }
            samples.append(SampleMeta(key=key, prompt_len=P, response_len=R, reward=float(si % 2), num_turns=2,
                                      num_tool_calls=1, min_version=max(0, step - 2), max_version=max(0, step - 2)))
        groups.append(TrajectoryGroup(group_id=gid, task_id=gid, producer_id=producers[gi % len(producers)],
                                      samples=samples, index=step * 10 + gi))
    return groups, stored


def run_config(run_dir: Path, model_dir: Path, mode: str = "full", **sections: dict) -> RunConfig:
    return from_dict({
        "name": "replaytest",
        **sections,
        "model": {"path": str(model_dir), **sections.get("model", {})},
        "trainer": {"total_steps": NUM_STEPS, "groups_per_step": GROUPS_PER_STEP, "micro_batch_size": 3,
                    "mini_batches": 2, "lr": 1e-3, "checkpoint_interval": 2, "keep_checkpoints": 4},
        "rollout": {"n": GROUP_SIZE, "temperature": 0.9},
        "logging": {"run_dir": str(run_dir), "record": mode, "tensorboard": False},
    })  # fmt: skip


def record_run(root: Path, mode: str = "full", **sections: dict) -> dict[str, Any]:
    """Train NUM_STEPS steps the way StepWorker / TrainerService do, with the recorder on; checkpoint at step 2.
    `sections`: config sections added to the run's (e.g. algorithm=..., critic=...)."""
    from rlbus.consumers.collate import collate
    from rlbus.consumers.recorder import Recorder, write_advantages, write_shard
    from rlbus.trainer.checkpoint import save_checkpoint
    from rlbus.trainer.engine import TrainEngine
    from rlbus.trainer.metrics import MetricsLog
    from rlbus.trainer.worker import plan_shards

    torch.set_num_threads(1)
    model_dir = build_tiny_qwen2(root / "model")
    run_dir = root / "run"
    cfg = run_config(run_dir, model_dir, mode, **sections)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    engine = TrainEngine.from_config(cfg, str(model_dir))  # as every trainer rank builds it
    recorder = Recorder(run_dir, cfg.logging.record)
    metrics_log = MetricsLog(run_dir, tensorboard=False)
    rows, weights_after = [], {}
    for step in range(1, NUM_STEPS + 1):
        groups, stored = make_groups(step)
        shards = plan_shards(groups, 1)
        shard = shards[0]
        batch = collate([(m, stored[m.key]) for m, _ in shard], [gi for _, gi in shard], pad_id=0)
        write_shard(run_dir, cfg.logging.record, step, 0, batch)  # StepWorker.execute, before train_step
        m = engine.train_step(batch)
        write_advantages(run_dir, cfg.logging.record, step, 0, engine.computed)  # StepWorker.execute, after it
        row = {**m, "reward/mean": 0.5, "step": step, "version": step}
        metrics_log.append(row)
        recorder.step(step=step, version=step, groups=groups, shards=shards, metrics=row)
        rows.append(row)
        if step == 2:
            save_checkpoint(engine, run_dir / "checkpoints", step, {"step": step, "version": step}, keep=4)
        weights_after[step] = {k: v.clone() for k, v in engine.full_state_dict().items()}
    metrics_log.close()
    return {"run_dir": run_dir, "rows": rows, "weights": weights_after, "cfg": cfg, "engine": engine}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return record_run(tmp_path_factory.mktemp("recorded"))


def test_replay_reproduces_steps_bit_for_bit(recorded: dict[str, Any]) -> None:
    from rlbus.trainer.replay import replay

    result, engine = replay(recorded["run_dir"], from_step=3, num_steps=2)
    assert result.from_checkpoint == 2 and result.steps == [3, 4]
    for step in (3, 4):
        original = recorded["rows"][step - 1]
        for name in ("actor/pg_loss", "actor/grad_norm", "actor/clipfrac", "actor/entropy", "perf/num_tokens"):
            assert result.metrics[step][name] == original[name], (step, name)
    assert result.identical, [d for d in result.diffs if not d.equal]
    replayed = engine.full_state_dict()
    original = recorded["weights"][4]
    assert replayed.keys() == original.keys()
    assert all(torch.equal(replayed[k], original[k]) for k in original)
    # ... and the weights really moved between step 2 and 4, so the comparison means something
    assert not all(torch.equal(recorded["weights"][2][k], original[k]) for k in original)


def test_replay_from_the_base_model_when_no_checkpoint_precedes(recorded: dict[str, Any]) -> None:
    from rlbus.trainer.replay import replay

    result, _ = replay(recorded["run_dir"], from_step=1, num_steps=1)
    assert result.from_checkpoint == 0
    assert result.identical
    assert result.metrics[1]["actor/pg_loss"] == recorded["rows"][0]["actor/pg_loss"]


def test_replay_runs_on_the_thread_count_the_trainer_recorded(recorded: dict[str, Any]) -> None:
    """The trainer ran on 1 thread (record_run) and says so in every step's `perf/torch_threads`; a replay started
    in a process with another count switches to the recorded one, so a user need not know it."""
    import msgspec

    from rlbus.common.threads import choose_threads
    from rlbus.consumers.event_log import read_steps
    from rlbus.trainer.replay import replay, replay_config, replay_threads

    assert [r["perf/torch_threads"] for r in recorded["rows"]] == [1.0] * NUM_STEPS
    torch.set_num_threads(2)
    try:
        result, _ = replay(recorded["run_dir"], from_step=3, num_steps=2)
        assert result.torch_threads == 1 and torch.get_num_threads() == 1
        assert result.identical, [d for d in result.diffs if not d.equal]
        # A run recorded before the metric existed: the count its rank 0 chose from the config, as chosen here.
        old = msgspec.structs.replace(read_steps(recorded["run_dir"])[0], metrics={})
        cfg = recorded["cfg"]
        want, _ = choose_threads(cfg.trainer.torch_threads, 1 + cfg.rollout.num_producers, takes_remainder=True)
        assert replay_threads(cfg, old) == want == torch.get_num_threads()
        # A what-if on the thread count is the user's to make.
        what_if = ["trainer.torch_threads=2"]
        assert replay_threads(replay_config(recorded["run_dir"], what_if), read_steps(recorded["run_dir"])[0],
                              what_if) == 2
    finally:
        torch.set_num_threads(1)


def test_what_if_replay_reports_differences(recorded: dict[str, Any], tmp_path: Path, capsys) -> None:
    from rlbus.trainer.replay import main

    out = tmp_path / "diff.json"
    code = main([str(recorded["run_dir"]), "--from-step", "3", "--steps", "2", "--json", str(out),
                 "algorithm.clip_ratio_high=0.0", "algorithm.clip_ratio_low=0.0", "trainer.lr=1e-2"])
    assert code == 0
    report = json.loads(out.read_text())
    assert not report["identical"]
    changed = {(d["step"], d["metric"]) for d in report["diffs"] if not d["equal"]}
    assert (3, "actor/clipfrac") in changed and (4, "actor/pg_loss") in changed
    assert [d["replayed"] for d in report["diffs"] if d["metric"] == "actor/lr"] == [1e-2, 1e-2]  # lr override won
    assert "differs" in capsys.readouterr().out
    # --strict turns a difference into a failing exit code (for scripted bisection)
    assert main([str(recorded["run_dir"]), "--from-step", "3", "--strict", "algorithm.clip_ratio_high=0.0"]) == 1


def test_replay_refuses_steps_it_cannot_reproduce(recorded: dict[str, Any], tmp_path: Path) -> None:
    from rlbus.consumers.event_log import RecordError
    from rlbus.trainer.replay import replay

    with pytest.raises(RecordError, match=r"steps \[5\] have no step record"):
        replay(recorded["run_dir"], from_step=4, num_steps=2)


# ---------------------------------------------------------------------------------------------------------------
# a real recorded run: trainer and producer processes, bus, Ray


@pytest.mark.slow
def test_real_run_is_archived_and_replays_bit_for_bit(tmp_path: Path, bus_config, run_creds, ray_address, tiny_model_dir,
                                                      run_name, role_processes, capsys) -> None:
    from rlbus.consumers.event_log import read_entries, read_steps
    from rlbus.trainer.replay import replay
    from rlbus.cli.events import main as events_main
    from tests.support.runs import small_run_config, start_role, stop, wait_exit, write_config
    from rlbus.trainer.metrics import read_metrics

    # Not the trainer's count (it ran with OMP_NUM_THREADS=1): the replay takes that from the record itself.
    torch.set_num_threads(2)
    run_dir = tmp_path / "run"
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, bus_config.url, bus_config.creds_file, ray_address,
                           trainer={"total_steps": 4, "groups_per_step": 2, "checkpoint_interval": 2,
                                    "keep_checkpoints": 2})
    cfg_path = write_config(tmp_path / "run.yaml", cfg)
    trainer = start_role("trainer", cfg_path, tmp_path / "logs", creds=run_creds)
    producer = start_role("producer", cfg_path, tmp_path / "logs", "--id", "p0", name="p0", creds=run_creds)
    role_processes += [trainer, producer]
    assert wait_exit(trainer, timeout=600) == 0
    stop(producer)

    steps = read_steps(run_dir)
    assert [r.step for r in steps] == [1, 2, 3, 4]
    assert all(r.payload == "full" and r.payload_bytes > 0 for r in steps)
    trained = {g.group_id for r in steps for g in r.groups}
    archived = {e.msg.group_id for e in read_entries(run_dir, "traj")}
    released = {e.msg.task_id for e in read_entries(run_dir, "prompts")}
    assert trained <= archived <= released
    assert [e.msg.version for e in read_entries(run_dir, "weights")][:5] == [0, 1, 2, 3, 4]
    assert any(e.msg.producer_id == "p0" for e in read_entries(run_dir, "heartbeats"))
    assert [r["record/bytes"] for r in read_metrics(run_dir)] == [r.payload_bytes for r in steps]

    result, _ = replay(run_dir, from_step=3, num_steps=2)
    assert result.from_checkpoint == 2
    assert result.identical, [d for d in result.diffs if not d.equal]

    gid = steps[0].groups[0].group_id
    assert events_main([str(run_dir), "--group", gid, "--decode", "--json"]) == 0
    decoded = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert len(decoded) == cfg["rollout"]["n"] and all(d["turns"] and d["prompt_text"] for d in decoded)
