"""`rlbus rollout`: the real config, model, engine, tools, reward and data set on a few prompts, printed.

The model is the quickstart's tiny Qwen2 with a very short warm start (built once per session in a tmp dir), so
it mostly writes nonsense; what is checked is the plumbing: trajectories come out consistent, rewarded, printed,
and reproducible for a seed.

    .venv/bin/python -m pytest -q tests/integration/test_rollout_dry_run.py
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from rlbus.producers.rollout_dry_run import main, run
from rlbus.schemas.config_io import load_config

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from rlbus.common.model.init_model import init_model

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("models") / "tiny-calculator"
    init_model(out, steps=20, check_target=0, num_threads=1, log=lambda *_: None)
    return str(out)


def _overrides(model_dir: str) -> list[str]:
    return [f"model.path={model_dir}", "model.init_if_missing=false", "rollout.n=2", "rollout.engine.max_batch_size=4"]


def _header(out: str) -> str:
    """The first line `rlbus rollout` prints, up to its reward, as one line however the console wrapped it."""
    return " ".join(out.split()).split(", reward ", 1)[0]


def test_rollout_prints_trajectories_with_rewards(model_dir: str, capsys) -> None:
    from rlbus.cli.main import main as rlbus_main

    # Through the `rlbus` entry point, flags after the overrides as a user would type them.
    rc = rlbus_main(["rollout", QUICKSTART, *_overrides(model_dir), "--num-prompts", "2", "--seed", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "tools ['calculator']" in _header(out)  # the tool loop calls rollout.tools
    assert "prompt 1/2" in out and "prompt 2/2" in out
    assert out.count("sample 0") == 2 and out.count("sample 1") == 2
    assert out.count("reward ") >= 4 and "rollout summary" in out and "mean reward" in out
    assert "mask 1 (generated" in out and "<|im_end|>" in out
    assert "What is " in out  # the synthetic prompts are shown


async def test_rollout_is_consistent_and_reproducible_for_a_seed(model_dir: str) -> None:
    limits = ["rollout.max_new_tokens=16", "rollout.max_response_tokens=40"]
    cfg = load_config(QUICKSTART, _overrides(model_dir) + limits)

    async def once() -> list:
        return await run(cfg, num_prompts=2, seed=3, console=Console(file=io.StringIO()), tokens=False)

    first, second = await once(), await once()
    assert [t.task_id for t, _ in first] == [t.task_id for t, _ in second]
    assert [[s.response_ids for s in g] for _, g in first] == [[s.response_ids for s in g] for _, g in second]
    for task, group in first:
        assert len(group) == 2
        for traj in group:
            n = len(traj.response_ids)
            assert 0 < n <= cfg.rollout.max_response_tokens
            assert len(traj.response_mask) == len(traj.log_probs) == len(traj.versions) == n
            for m, lp, v in zip(traj.response_mask, traj.log_probs, traj.versions):
                assert (lp == 0.0 and v == -1) if m == 0 else (lp <= 0.0 and v == 0)
            assert traj.finish_reason in ("stop", "length", "max_turns")
            assert traj.reward in (0.0, 1.0)
            meta = traj.sample_meta("k")
            assert meta.prompt_len == len(traj.prompt_ids) and meta.response_len == n


def test_rollout_on_a_jsonl_prompt_file(model_dir: str, tmp_path: Path, capsys) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a}+{b}?", "answer": a + b}) + "\n"
                            for a, b in [(12, 30), (40, 2), (7, 8)]))
    rc = main([QUICKSTART, *_overrides(model_dir), "data.type=jsonl", f"data.path={data}", "data.answer_key=answer",
               "data.system_prompt=Solve it.", "--num-prompts", "5", "--no-tokens"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "prompt 3/3" in out and "prompt 4/" not in out  # all three, no more
    assert "Solve it." in out and "What is 40+2?" in out
    assert "mask 1 (generated" not in out


def test_rollout_reports_bad_data_and_config(model_dir: str, tmp_path: Path, capsys) -> None:
    rc = main([QUICKSTART, *_overrides(model_dir), "data.type=jsonl", f"data.path={tmp_path / 'missing.jsonl'}"])
    assert rc == 2 and "missing.jsonl" in capsys.readouterr().err
    rc = main([QUICKSTART, *_overrides(model_dir), "rollout.tools=[no_such_pkg:TOOL]"])
    assert rc == 2 and "rollout.tools" in capsys.readouterr().err


@pytest.mark.parametrize(("overrides", "tools"), [
    (["env.type=gym", "env.make=tests.fixtures.text_games:GuessNumber", "env.num_tasks=4"], "the gym environment's"),
    (["rollout.agent_loop=single_turn"], "none"),
], ids=["gym", "single-turn"])
def test_the_header_lists_the_tools_the_run_uses(model_dir: str, overrides: list[str], tools: str, capsys) -> None:
    # The quickstart's rollout.tools (calculator) stays in the config; the gym environment and a single turn
    # call no tool of it, so the header must not name it.
    rc = main([QUICKSTART, *_overrides(model_dir), *overrides, "rollout.max_turns=1", "--num-prompts", "1",
               "--no-tokens"])
    header = _header(capsys.readouterr().out)
    assert rc == 0
    assert header.endswith(f"tools {tools}") and "'calculator'" not in header

