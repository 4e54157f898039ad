"""bench/peer_trl.py measures what it says: the shared reward, steady-state rates, time to a reward, and an rlbus
config that is the task it claims (valid, the same data and reward, the same budget)."""

import asyncio
import json
from dataclasses import replace

import pytest
import yaml

from bench.peer_task import SCORES, messages, problems, reward, score, score_close, score_contains, write_jsonl
from bench.peer_trl import (
    TASKS,
    Bench,
    SideRun,
    Stamper,
    producers_label,
    reward_by_step,
    reward_target,
    rlbus_config,
    steady_steps_per_min,
    time_to_reward,
)
from rlbus.common.data import load_dataset
from rlbus.producers.rewards.registry import load_reward
from rlbus.schemas.config_io import load_config


@pytest.mark.parametrize("reply,want", [
    ("<answer>57</answer><|im_end|>", 1.0),
    ("57", 1.0),  # what TRL hands its reward (special tokens skipped)
    (" <answer> 57</answer>", 1.0),
    ("<answer>571</answer>", 0.0),  # a longer number is another number
    ("<answer>56</answer>", 0.0),
    ('<tool_call>{"name": "calculator"', 0.0),
    ("", 0.0),
])
def test_reply_starts_with_the_right_answer(reply, want):
    assert score(reply, "57") == want


def test_problems_are_seeded_two_digit_sums():
    ps = problems(50, 3)
    assert ps == problems(50, 3) and ps != problems(50, 4)
    for q, a in ps:
        x, y = q.removeprefix("What is ").removesuffix("?").split("+")
        assert 10 <= int(x) <= 99 and 10 <= int(y) <= 99 and int(a) == int(x) + int(y)


def test_problems_draw_from_the_operand_range():
    ps = problems(200, 0, (1, 9))
    assert ps[:5] == problems(5, 0, (1, 9))
    pairs = {tuple(int(v) for v in q.removeprefix("What is ").removesuffix("?").split("+")) for q, _ in ps}
    assert all(1 <= x <= 9 and 1 <= y <= 9 for x, y in pairs) and len(pairs) > 40
    assert all(int(a) == int(q[8]) + int(q[10]) for q, a in ps)


@pytest.mark.parametrize("reply,want", [
    ("<answer>15</answer>", 1.0), ("15", 1.0), ("<answer>13</answer>", 0.8), ("12", 0.7), ("5", 0.0),
    ("<answer>40</answer>", 0.0), ("", 0.0), ("<tool_call>", 0.0), ("x 15", 0.0),  # the first number, as `score`
])
def test_close_gives_partial_credit_by_distance(reply, want):
    assert score_close(reply, "15") == pytest.approx(want)


def _bench(task: str, sides: dict[str, list[list[float]]]) -> Bench:
    b = Bench(command="", steps=0, warmup=0, seeds=[], model="", machine={}, versions={}, rlbus_commit="", task=task)
    for side, curves in sides.items():
        b.runs += [SideRun(side, i, ok=True, rewards=c, step_t=[float(k) for k in range(len(c))])
                   for i, c in enumerate(curves)]
    return b


def test_reward_target_by_the_tasks_rule():
    # Both sides start at 0.6 (first 10 steps) and end at 0.7 (TRL) and 0.8 (rlbus) over their last 10.
    b = _bench("adder1", {"trl": [[0.6] * 10 + [0.7] * 10], "rlbus": [[0.6] * 10 + [0.8] * 10]})
    assert reward_target(b, TASKS["adder1"]) == pytest.approx(0.68)  # 0.6 + 0.8 x (0.7 - 0.6)
    assert reward_target(b, TASKS["adder"]) == pytest.approx(0.63)  # 0.9 x 0.7
    assert reward_target(_bench("adder", {}), TASKS["adder"]) == 0.0


def test_reward_by_step_splits_each_side_into_equal_spans():
    b = _bench("adder1", {"trl": [[0.0] * 5 + [1.0] * 5, [0.2] * 10], "rlbus": [[0.5] * 10]})
    lines = reward_by_step(b, parts=2)
    assert "| | steps 1-5 | steps 6-10 |" in lines
    assert "| TRL | 0.100 ± 0.141 | 0.600 ± 0.566 |" in lines and "| rlbus | 0.500 | 0.500 |" in lines
    assert reward_by_step(_bench("adder1", {"trl": [[0.1] * 3]}), parts=5) == []


def test_entropy_by_step_leaves_out_runs_that_did_not_record_it():
    b = _bench("adder1", {"trl": [[0.5] * 4, [0.5] * 4], "rlbus": [[0.5] * 4]})
    b.runs[0].entropy = [0.4, 0.4, 0.2, 0.2]  # the second TRL run predates the field: no entropy
    b.runs[2].entropy = [0.3, 0.3, 0.1, 0.1]
    lines = reward_by_step(b, parts=2, series="entropy")
    assert lines[1].startswith("Entropy")
    assert "| TRL | 0.400 | 0.200 |" in lines and "| rlbus | 0.300 | 0.100 |" in lines
    assert reward_by_step(_bench("adder1", {"trl": [[0.5] * 4]}), parts=2, series="entropy") == []


def test_steady_rate_leaves_out_the_warmup():
    # 3 slow steps (start-up), then one step every 0.5 s: 120 steps/min however long the start took.
    t = [10.0, 11.0, 12.0] + [12.0 + 0.5 * k for k in range(1, 11)]
    assert steady_steps_per_min(t, warmup=3) == pytest.approx(120.0)
    assert steady_steps_per_min(t[:3], warmup=3) == 0.0


def test_time_to_reward_uses_the_running_mean():
    rewards = [0.0] * 10 + [1.0] * 10
    t = [float(i) for i in range(20)]
    assert time_to_reward(rewards, t, 0.5) == 14.0  # first window of 10 with mean >= 0.5 ends at index 14
    assert time_to_reward(rewards, t, 1.1) is None


@pytest.mark.parametrize("name", sorted(TASKS))
def test_rlbus_side_is_the_task(tmp_path, name):
    task = replace(TASKS[name], model=tmp_path / "model")
    data = write_jsonl(tmp_path / "peer.jsonl", 64, 0, task.system, task.operands)
    cfg_dict = rlbus_config(task, data, seed=1, steps=100, run_dir=tmp_path / "run", name="peer")
    path = tmp_path / "peer.yaml"
    path.write_text(yaml.safe_dump(cfg_dict))
    cfg = load_config(path)
    assert (cfg.trainer.groups_per_step, cfg.rollout.n, cfg.rollout.max_new_tokens) == (task.prompts, task.n,
                                                                                        task.max_new_tokens)
    assert (cfg.trainer.lr, cfg.algorithm.kl_coef, cfg.rollout.temperature, cfg.trainer.total_steps) == (task.lr, 0, 1,
                                                                                                       100)
    producers = task.rlbus.get("rollout", {}).get("num_producers", 2)  # the adder's 2, SmolLM2's 1
    assert cfg.rollout.agent_loop == "single_turn" and cfg.rollout.num_producers == producers
    assert producers_label(task, []) == f"{producers} producer{'s' if producers != 1 else ''}"
    assert producers_label(task, ["rollout.num_producers=3"]) == "3 producers"
    assert cfg.model.path == str(tmp_path / "model")
    ds = load_dataset(cfg.data)
    first_q, first_a = problems(1, 0, task.operands)[0]
    assert ds[0].ground_truth == first_a and ds[0].prompt[-1].content == first_q
    assert [m.content for m in ds[0].prompt] == [m["content"] for m in messages(first_q, task.system)]
    fn = load_reward(cfg.rollout)  # the import path resolves to the task's reward, the one the TRL side scores with
    for reply in ("<answer>" + first_a + "</answer>", f"{first_q[8:-1]} = {first_a}", "12"):
        assert asyncio.run(fn(reply, first_a, task=None)) == SCORES[task.reward](reply, first_a)
    assert reward("12", "13") == 0.0
    # ... and the TRL side is handed the same task
    args = task.trl_args()
    assert args[args.index("--system") + 1] == task.system and args[args.index("--reward") + 1] == task.reward
    i = args.index("--operands")
    assert (int(args[i + 1]), int(args[i + 2])) == task.operands


@pytest.mark.parametrize("reply,want", [("27 + 82 = 109", 1.0), ("To find 27+82: 109.", 1.0), ("1090", 0.0),
                                        ("27 + 82", 0.0)])
def test_the_real_models_reward_finds_the_sum_anywhere(reply, want):
    assert score_contains(reply, "109") == want


def test_stamper_reads_rows_and_marks_as_they_land(tmp_path):
    (tmp_path / "logs").mkdir()
    st = Stamper(tmp_path, t0=0.0)
    st.poll()
    assert st.rows == [] and st.marks == {}
    (tmp_path / "logs" / "trainer.log").write_text("12:00:00 INFO rlbus.trainer: trainer up at step 0, version 0\n")
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 1}) + "\n" + '{"step": 2')  # a row still being written
    st.poll()
    assert [r["step"] for r in st.rows] == [1] and "trainer ready" in st.marks
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("}\n")
    st.poll()
    assert [r["step"] for r in st.rows] == [1, 2] and len(st.row_t) == 2


def _env_run(side: str, seed: int, accs: list[float], wall: float = 900.0) -> dict:
    return {"side": side, "seed": seed, "rc": 0, "wall_s": wall,
            "saved": [{"step": 10 * (i + 1), "t": 300.0 * (i + 1), "accuracy": a} for i, a in enumerate(accs)]}


def test_peer_env_summary_sets_the_target_by_the_lower_side_and_scores_another_engine_against_it():
    from bench.common import bounded_ratio, peer_summary

    d = {"runs": [_env_run("rlbus", 0, [0.2, 0.4]), _env_run("trl", 0, [0.1, 0.2], wall=1000.0),
                  _env_run("rlbus-vllm", 0, [0.1, 0.15])]}
    s = peer_summary(d)
    assert s["target"] == pytest.approx(0.18)  # 0.9 x TRL's final 0.2
    assert s["times"] == {"rlbus": [300.0], "trl": [600.0]}
    assert bounded_ratio(s) is None  # both reached it
    other = peer_summary(d, mine="rlbus-vllm", target=s["target"])
    assert other["target"] == s["target"] and other["times"]["rlbus"] == [None]  # never reached: counted apart
    how, mine, trl, ratio = bounded_ratio(other)
    assert (how, mine, trl) == ("at least", 900.0, 600.0) and ratio == pytest.approx(1.5)


def test_step_cost_sorts_each_process_and_role_thread_into_its_group():
    from bench.step_cost import GROUPS, group

    names = {g for g, _ in GROUPS}
    cases = {("python -m rlbus.cli trainer run.yaml", "main"): "trainer loop",
             ("python -m rlbus.cli trainer run.yaml", "other"): "trainer update",
             ("python -m rlbus.cli producer run.yaml --id p0", "main"): "producers loop",
             ("python -m rlbus.cli producer run.yaml --id p0", "other"): "producers generate",
             ("ray::Shard", ""): "TransferQueue", ("ray::WeightVersions", ""): "weight store",
             (".venv/bin/nats-server -c x.conf", ""): "nats-server", ("raylet --raylet_socket", ""): "Ray and the rest"}
    for (cmd, thread), want in cases.items():
        assert group(cmd, thread) == want and want in names


def test_report_names_the_results_file_it_was_made_from(tmp_path):
    from bench.peer_trl import ROOT, load_bench, report

    path = ROOT / "bench" / "results" / "peer_trl_smollm2_lora.json"
    b = load_bench(path)
    assert report(b, path).rstrip().endswith("`bench/results/peer_trl_smollm2_lora.json`.")
    elsewhere = tmp_path / "seeds_2-5.json"  # `--results` or `--from-json` outside the repository
    assert report(b, elsewhere).rstrip().endswith(f"`{elsewhere}`.")
