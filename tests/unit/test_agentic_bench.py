"""bench/agentic.py runs what its workloads claim: the arms' configs are valid and are the task they name, the
latencies are the ones asked for (and none in `nolat`), the judge scores as the math reward with its slots, and the
straggling environment pays 1 for the right answer, answers calculator calls, and waits as seeded. The TRL arm runs
only with its venv, gets the rlbus arms' config and prompts, and its row has the same window and N/A for what only
rlbus measures (the TRL side itself needs the TRL venv: the bench's smoke run checks it).

    .venv/bin/python -m pytest -q tests/unit/test_agentic_bench.py
"""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest

from bench import agentic, agentic_tools
from bench.agentic import (CONFIG, RLBUS_ONLY, TRL_SIDE, by_arm, failed_rollouts, parse_args, report, seeded,
                           trl_argv, trl_settings, trl_summary, write_trl_prompts)
from bench.agentic_tools import Lognormal, SlowJudge, StepLatency, StragglerEnv, make_straggler_env
from bench.agentic_workloads import WORKLOADS
from rlbus.common.envs import load_tasks
from rlbus.common.envs.gym import examples
from rlbus.common.model.demos import (QUICKSTART_SYSTEM_PROMPT, answer_text, evaluate_expression, question_expression,
                                      tool_call_text)
from rlbus.producers.rewards.registry import load_reward
from rlbus.schemas.config_io import load_config
from rlbus.schemas.env import GymEnvConfig
from rlbus.schemas.wire import ErrorRaised, PromptTask


@pytest.mark.parametrize("argv,workload,medians,results", [
    ([], "b1", [1.0], "agentic.json"),
    (["--workload", "b2"], "b2", [1.0], "agentic_b2.json"),
    (["--workload", "b3"], "b3", [0.2], "agentic_b3.json"),
    (["--workload", "b3", "--medians", "0.5", "1", "--results", "/tmp/x.json"], "b3", [0.5, 1.0], "x.json"),
])
def test_each_workload_has_its_own_medians_and_results_file(argv, workload, medians, results):
    args = parse_args(argv)
    assert (args.workload, args.medians, args.results.name) == (workload, medians, results)


def test_an_unknown_workload_is_refused():
    with pytest.raises(SystemExit):
        parse_args(["--workload", "b4"])


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("arm", ["nolat", "async", "sync"])
def test_every_arm_is_a_valid_config_of_its_workload(name, arm):
    wl = WORKLOADS[name]
    cfg = load_config(CONFIG, wl.overrides(arm, 7, ["trainer.total_steps=6"]))
    assert cfg.trainer.total_steps == 6 and cfg.rollout.max_inflight_tasks == 0
    assert (cfg.trainer.max_staleness == 0) == (arm == "sync")
    slow_tool = "bench.agentic_tools:RemoteCalculator" in cfg.rollout.tools
    assert slow_tool == (name == "b1" and arm != "nolat")
    assert (cfg.rollout.reward == "bench.agentic_tools:slow_judge") == (name == "b2")
    if name == "b3":
        assert isinstance(cfg.env, GymEnvConfig) and cfg.env.seed == 7 and cfg.rollout.episode_timeout_s == 60
        assert cfg.env.system_prompt == QUICKSTART_SYSTEM_PROMPT  # the quickstart's prompt, as the model knows it
        assert cfg.rollout.redundant_samples == 2


def test_nolat_has_no_latency_and_the_callers_shape_wins():
    b3 = WORKLOADS["b3"]
    quiet = b3.latency_env("nolat", 0.2, 1, environ={})
    assert (quiet["RLBUS_ENV_MEDIAN_S"], quiet["RLBUS_ENV_STRAGGLE"], quiet["RLBUS_ENV_HANG"]) == ("0.0", "0", "0")
    slow = b3.latency_env("async", 0.2, 1, environ={"RLBUS_ENV_STRAGGLE": "0.2"})
    assert slow["RLBUS_ENV_MEDIAN_S"] == "0.2" and slow["RLBUS_ENV_SEED"] == "1"
    assert (slow["RLBUS_ENV_STRAGGLE"], slow["RLBUS_ENV_HANG"]) == ("0.2", "0.005")
    assert WORKLOADS["b2"].latency_env("sync", 1.0, 0, environ={})["RLBUS_JUDGE_SLOTS"] == "4"


def test_the_env_pays_the_right_answer_and_answers_calculator_calls():
    env = StragglerEnv()
    question, _ = env.reset(seed=3)
    assert env.reset(seed=3)[0] == question and question.startswith("What is ")  # deterministic in its seed
    obs, reward, terminated, _, _ = env.respond(tool_call_text(question_expression(question)))
    assert (obs, reward, terminated) == (f"<tool_response>{env.answer}</tool_response>", 0.0, False)
    assert env.respond(answer_text(env.answer))[1:3] == (1.0, True)
    assert env.respond(answer_text(str(int(env.answer) + 1)))[1:3] == (0.0, True)
    assert env.respond("I do not know")[1:3] == (0.0, True)
    assert "unknown tool" in env.respond('<tool_call>{"name": "search", "arguments": {}}</tool_call>')[0]


def test_the_env_releases_tasks_through_rlbus_gym_loader():
    cfg = load_config(CONFIG, [*WORKLOADS["b3"].overrides("async", 0), "env.num_tasks=3"])
    got = examples(cfg.env)
    assert [e.extra_info["gym_seed"] for e in got] == [0, 1, 2]
    assert got[0].prompt[0].role == "system" and got[0].prompt[-1].content == StragglerEnv().reset(seed=0)[0]


def test_latency_draws_are_reproducible_by_seed_and_capped():
    a, b, c = (Lognormal(0.5, 1.0, 2.0, seed=s) for s in (1, 1, 2))
    first = [a.draw() for _ in range(50)]
    assert first == [b.draw() for _ in range(50)] != [c.draw() for _ in range(50)]
    assert max(first) <= 2.0 and min(first) > 0
    assert Lognormal(0.0).draw() == 0.0


def test_stragglers_and_hangs_come_at_their_shares_reproducibly():
    def draws(seed):
        lat = StepLatency(Lognormal(0.01, seed=seed), straggle=0.2, straggle_s=20.0, hang=0.1, hang_s=3600.0)
        return [lat.draw() for _ in range(2000)]

    got = draws(5)
    assert got == draws(5)
    assert 300 <= got.count(20.0) <= 500 and 120 <= got.count(3600.0) <= 280
    with pytest.raises(ValueError):
        StepLatency(Lognormal(1.0), straggle=0.8, hang=0.3)


def test_the_straggler_env_waits_its_steps(monkeypatch):
    monkeypatch.setenv("RLBUS_ENV_MEDIAN_S", "0.05")
    monkeypatch.setenv("RLBUS_ENV_SIGMA", "0")
    agentic_tools._step_latency.cache_clear()
    try:
        env = make_straggler_env()
        env.reset(seed=0)
        t0 = time.perf_counter()
        assert env.step(answer_text(env.answer))[1] == 1.0
        assert time.perf_counter() - t0 >= 0.05
    finally:
        agentic_tools._step_latency.cache_clear()


def test_the_judge_scores_as_the_math_reward_a_few_calls_at_a_time():
    judge = SlowJudge(Lognormal(0.05, sigma=0.0), slots=2)

    async def six() -> tuple[list[float], float]:
        t0 = time.perf_counter()
        scores = await asyncio.gather(*(judge(answer_text(str(i)), "3") for i in range(6)))
        return scores, time.perf_counter() - t0

    scores, elapsed = asyncio.run(six())
    assert scores == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert elapsed >= 0.15  # 6 calls of 0.05 s, 2 at a time: 3 rounds


def test_the_judge_loads_as_rlbus_loads_a_reward(monkeypatch):
    monkeypatch.setenv("RLBUS_JUDGE_MEDIAN_S", "0")
    agentic_tools._judge.cache_clear()
    try:
        cfg = load_config(CONFIG, list(WORKLOADS["b2"].overrides("async", 0)))
        reward = load_reward(cfg.rollout, cfg)
        task = PromptTask(task_id="t", prompt=[], ground_truth="391")
        assert asyncio.run(reward(answer_text("391"), "391", task=task)) == 1.0
    finally:
        agentic_tools._judge.cache_clear()


def test_failed_rollouts_are_counted_from_the_event_log(tmp_path):
    events = tmp_path / "events"
    events.mkdir()
    lines = [{"seq": i, "subject": "events.error", "recorded_at": 0.0, "msg": msgspec.to_builtins(
        ErrorRaised(role="producer", role_id="p0", error="EpisodeTimeout", message="m", failure=f))}
        for i, f in enumerate(["infrastructure", "infrastructure", "environment", ""])]
    (events / "errors.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert failed_rollouts(tmp_path) == {"infra_failures": 2, "env_failures": 1, "dead_letters": 0}
    assert failed_rollouts(tmp_path / "none") == {"infra_failures": 0, "env_failures": 0, "dead_letters": 0}


def _results(workload: str) -> dict:
    run = {"arm": "async", "median_s": 0.2, "seed": 0, "rc": 0, "steps_per_min": 30.0, "trainer_idle": 0.5,
           "p95_step_interval_s": 3.0, "staleness_bound_end": 4, "staleness_mean": 1.5, "first5": 0.2, "last10": 0.5,
           "infra_failures": 3, "env_failures": 0, "ledger_problems": []}
    return {"command": "python bench/agentic.py", "commit": "abc", "date": "2026-12-08", "steps": 30,
            "machine": {"cpu_model": "cpu", "cores": 2, "load_avg_1m": 0.1}, "workload": workload,
            "shape": WORKLOADS[workload].shape_in({}), "results": "bench/results/x.json", "runs": [run]}


def test_the_tables_name_the_workload_and_b3_counts_its_failures():
    b1 = by_arm(_results("b1"))
    assert "The quickstart's task and model; the calculator behind a lognormal latency (sigma 1, capped at 8 s); " \
           "30 steps" in b1 and "| tool median |" in b1 and "failed rollouts" not in b1
    b3 = by_arm(_results("b3"))
    assert "| env step median |" in b3 and "a share 0.02 of steps straggles for 30 s" in b3
    assert b3.splitlines()[-3].endswith("| 3 / 0 |")
    assert "| ledger problems |" in report(_results("b3")) and "4 calls at once" in report(_results("b2"))


# ---------------------------------------------------------------------------------------------------------------
# The TRL arm (bench/agentic_trl.py runs under the TRL venv's python; here only what the bench does around it)


@pytest.fixture
def trl_venv(tmp_path, monkeypatch):
    """A stand-in for .bench/trl-venv's python; the test makes it exist or not."""
    python = tmp_path / "trl-venv" / "bin" / "python"
    monkeypatch.setattr(agentic, "TRL_PY", python)
    return python


def test_the_trl_arm_runs_by_default_only_where_its_venv_is(trl_venv):
    assert parse_args([]).arms == ["nolat", "async", "sync"]
    with pytest.raises(SystemExit):
        parse_args(["--arms", "async", "trl"])  # asked for without the venv: the error says how to make it
    trl_venv.parent.mkdir(parents=True)
    trl_venv.touch()
    assert parse_args([]).arms == ["nolat", "async", "sync", "trl"]
    assert parse_args(["--workload", "b3"]).arms[-1] == "trl"
    assert parse_args(["--workload", "b2"]).arms == ["nolat", "async", "sync"]  # no TRL judge
    with pytest.raises(SystemExit):
        parse_args(["--workload", "b2", "--arms", "trl"])


def test_the_trl_side_gets_the_config_the_rlbus_arms_run(trl_venv, tmp_path):
    wl = WORKLOADS["b3"]
    cfg = load_config(CONFIG, [*seeded(3, 12), *wl.overrides("trl", 3, ["trainer.lr=1e-4"])])
    s = trl_settings(wl, cfg, 3, 12, tmp_path / "model", tmp_path / "prompts.jsonl")
    assert (s["workload"], s["seed"], s["steps"], s["lr"]) == ("b3", 3, 12, 1e-4)  # the caller's override too
    assert (s["n"], s["groups_per_step"], s["mini_batches"], s["max_turns"]) == (8, 4, 2, 2)
    assert (s["max_new_tokens"], s["max_response_tokens"], s["episode_timeout_s"]) == (40, 120, 60)
    assert (s["clip_ratio_low"], s["clip_ratio_high"], s["warmup_steps"], s["lr_schedule"]) == (0.2, 0.28, 5, "cosine")
    assert json.loads(json.dumps(s)) == s  # the settings file the side reads
    assert trl_argv(tmp_path / "s.json", tmp_path / "o.json") == [
        str(trl_venv), str(TRL_SIDE), str(tmp_path / "s.json"), str(tmp_path / "o.json")]
    assert TRL_SIDE.is_file()
    env = wl.latency_env("trl", 0.5, 3, environ={})
    assert (env["RLBUS_ENV_MEDIAN_S"], env["RLBUS_ENV_SEED"], env["RLBUS_ENV_STRAGGLE"]) == ("0.5", "3", "0.02")


@pytest.mark.parametrize("name", ["b1", "b3"])
def test_the_trl_side_trains_on_the_feeders_prompts(name, tmp_path):
    wl = WORKLOADS[name]
    cfg = load_config(CONFIG, [*seeded(1, 5), *wl.overrides("trl", 1)])
    rows = [json.loads(x) for x in write_trl_prompts(wl, cfg, tmp_path / "p.jsonl").read_text().splitlines()]
    tasks = load_tasks(cfg)
    assert len(rows) == len(tasks) and rows[5]["prompt"] == [{"role": m.role, "content": m.content}
                                                             for m in tasks[5].prompt]
    assert rows[0]["prompt"][0] == {"role": "system", "content": QUICKSTART_SYSTEM_PROMPT}
    for row in rows[:50]:  # the truth is the question's answer (b3: the one the environment's reset set)
        question = row["prompt"][-1]["content"]
        assert row["truth"] == str(evaluate_expression(question_expression(question)))


def test_a_trl_run_is_summarised_over_the_same_window_with_na_for_rlbus_only_figures(tmp_path):
    out = tmp_path / "out.json"
    assert trl_summary(out) == {"error": "no output"}
    steps = [{"step": i + 1, "t": 1000.0 + 10 * (i + 1), "reward": 0.1 * i, "tool_calls": 0.5, "tool_failures": 0.0}
             for i in range(6)]
    out.write_text(json.dumps({"t_start": 1000.0, "steps": steps, "timeouts": 2, "versions": {"trl": "1.16.0"}}))
    row = trl_summary(out)
    assert row["steps_per_min"] == 6.0 and row["window_s"] == 30.0  # 3 steps after the warm-up's last, in 30 s
    assert (row["first5"], row["last10"], row["startup_s"]) == (0.2, 0.25, 10.0)
    assert all(row[k] is None for k in RLBUS_ONLY) and row["staleness_mean"] == 0.0
    assert (row["infra_failures"], row["tool_calls_per_sample"]) == (2, 0.5)
    d = _results("b3")
    d["runs"] = [{**d["runs"][0], "median_s": 0.2}, {"arm": "trl", "median_s": 0.2, "seed": 0, "rc": 0, **row}]
    table = report(d)
    assert "| trl | 0.2 s | 0 | 6.0 | - | N/A | 10.00 s | N/A | 0.00 | 0.200 | 0.250 | 2 / 0 | N/A |" in table
    assert "rlbus's steps/min over TRL's at a median of 0.2 s, on the seeds TRL ran (0): async 5.0x." in by_arm(d)
    d["runs"].append({**d["runs"][0], "seed": 1, "steps_per_min": 1000.0})  # a seed TRL did not run: not in the ratio
    assert "on the seeds TRL ran (0): async 5.0x." in by_arm(d)
