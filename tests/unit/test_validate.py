"""cli/validate.py: every error a config can hold beyond its schema, each naming its field, found without starting
anything; `rlbus config show` prints them and exits 2.

    .venv/bin/python -m pytest -q tests/unit/test_validate.py
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from rlbus.cli.main import main as rlbus_main
from rlbus.cli.validate import CONFIG_ERROR_EXIT, ConfigInvalid, check_config, config_errors, find_object
from rlbus.schemas.config_io import load_config
from rlbus.schemas.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
HAS_RG = importlib.util.find_spec("reasoning_gym") is not None
#: The issue's two reasoning-gym mistakes, on the quickstart (its model is made by init_if_missing: no error there).
RG = ["env.type=reasoning_gym", "rollout.agent_loop=single_turn", "rollout.tools=[]"]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A directory that holds a model as far as the check can tell (config.json + safetensors)."""
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"")
    return out


def _errors(*overrides: str) -> list[ConfigError]:
    return config_errors(load_config(QUICKSTART, list(overrides)))


def _fields(*overrides: str) -> list[str]:
    return [e.field for e in _errors(*overrides)]


#: (overrides, the field its error names, words the message holds): the cases `rlbus config show` is tested on too.
CASES = [
    pytest.param([*RG, "env.tasks=[{name: no_such_task_xyz}]"], "env.tasks[0].name",
                 "reasoning-gym has no task 'no_such_task_xyz'", id="unknown-task",
                 marks=pytest.mark.skipif(not HAS_RG, reason="the reasoning-gym extra")),
    pytest.param([*RG, "env.tasks=[{name: count_bits, config: {max_bits: 5}}]"], "env.tasks[0].config.max_bits",
                 "count_bits has no setting 'max_bits' (did you mean max_n?)", id="unknown-setting",
                 marks=pytest.mark.skipif(not HAS_RG, reason="the reasoning-gym extra")),
    pytest.param(["rollout.reward=no_such_pkg.rewards:score"], "rollout.reward", "cannot import module 'no_such_pkg",
                 id="reward-module"),
    pytest.param(["rollout.reward=rlbus.producers.rewards.math:no_such_fn"], "rollout.reward",
                 "has no attribute 'no_such_fn'", id="reward-attribute"),
    pytest.param(["rollout.tools=[calculator, no_such_pkg.tools:SEARCH]"], "rollout.tools",
                 "cannot import module 'no_such_pkg.tools'", id="tool-path"),
    pytest.param(["model.path=/nonexistent/model", "model.init_if_missing=false"], "model.path",
                 "/nonexistent/model holds no model", id="missing-model"),
]


@pytest.mark.parametrize(("overrides", "field", "words"), CASES)
def test_each_error_names_its_field(overrides, field, words):
    errors = _errors(*overrides)
    assert [e.field for e in errors] == [field], errors
    assert words in str(errors[0])


@pytest.mark.parametrize(("overrides", "field", "words"), CASES)
def test_config_show_prints_the_config_then_the_errors_and_exits_2(overrides, field, words, capsys):
    assert rlbus_main(["config", "show", QUICKSTART, *overrides]) == CONFIG_ERROR_EXIT == 2
    out, err = capsys.readouterr()
    assert "name: quickstart" in out  # the resolved config is still shown
    assert f"rlbus: config error: {field}: " in err and words in err


def test_a_good_config_shows_with_exit_0(capsys):
    assert rlbus_main(["config", "show", QUICKSTART]) == 0
    assert capsys.readouterr().err == ""


def test_the_shipped_quickstart_has_no_error():
    assert _errors() == []


def test_a_missing_model_is_fine_when_something_will_make_it():
    assert _fields("model.path=/nonexistent/model", "model.init_if_missing=true") == []
    assert _fields("model.path=/nonexistent/model", "model.init_if_missing=false",
                   "model.gguf=/nonexistent/model.gguf") == ["model.gguf"]  # ... and only when it can


def test_judge_and_critic_models_are_checked_where_the_run_uses_them(model_dir):
    served = ["judge.model=/nonexistent/judge", "rollout.reward=rlbus.producers.rewards.judge:judge_reward"]
    assert _fields(*served) == ["judge.model"]  # `rlbus up` would serve it from there
    assert _fields(*served, "judge.url=http://127.0.0.1:9/v1") == []  # a judge elsewhere: its model is a name
    assert _fields("algorithm.adv_estimator=gae", "critic.path=/nonexistent/critic") == ["critic.path"]
    assert _fields("algorithm.adv_estimator=gae", f"critic.path={model_dir}") == []


def test_a_users_reward_and_tool_are_found_in_the_current_directory(tmp_path, monkeypatch):
    # The roles put the current directory on the path (common/imports.py); the check resolves from it too.
    (tmp_path / "my_run.py").write_text(
        "def reward(response, ground_truth, *, task):\n    return 1.0\n\n"
        "class Search:\n    name = 'search'\n    description = 'finds'\n"
        "    async def __call__(self, arguments):\n        return ''\n\n"
        "LIMIT = 3\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert _fields("rollout.reward=my_run:reward", "rollout.tools=[calculator, my_run:Search]") == []
    assert _fields("rollout.tools=[my_run:LIMIT]") == ["rollout.tools"]  # found, and not a tool


def test_openai_agent_function():
    agent = "rollout.openai.function=rlbus.producers.agents.calculator:rollout"
    assert _fields("rollout.agent_loop=openai", agent) == []
    errors = _errors("rollout.agent_loop=openai", "rollout.openai.function=rlbus.producers.rewards.math:compute_score")
    assert [e.field for e in errors] == ["rollout.openai.function"] and "async function" in str(errors[0])


def test_data_path():
    assert _fields("data.type=jsonl", "data.path=/nonexistent/train.jsonl") == ["data.path"]


def test_gym_ids_and_kwargs():
    pytest.importorskip("gymnasium")
    gym = ["env.type=gym", "rollout.tools=[]"]
    game = "env.make=tests.fixtures.text_games:GuessNumber"
    assert _fields(*gym, game, "env.kwargs={high: 8}") == []
    errors = _errors(*gym, game, "env.kwargs={highest: 8}")
    assert [e.field for e in errors] == ["env.kwargs"] and "highest" in str(errors[0])
    errors = _errors(*gym, "env.make=CartPol-v1")
    assert [e.field for e in errors] == ["env.make"] and "did you mean CartPole-v1" in str(errors[0])


def test_a_verifiers_load_is_found_in_its_source_without_importing_it(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delitem(sys.modules, "tests.fixtures.vf_envs", raising=False)  # another test may have imported it
    find_object("tests.fixtures.vf_envs:single", "env.load")
    with pytest.raises(ConfigError) as e:
        find_object("tests.fixtures.vf_envs:singel", "env.load")
    assert e.value.field == "env.load" and "has no attribute 'singel' (did you mean single?)" in str(e.value)
    with pytest.raises(ConfigError, match="cannot import module 'tests.fixtures.no_such_envs'"):
        find_object("tests.fixtures.no_such_envs:single", "env.load")
    assert "tests.fixtures.vf_envs" not in sys.modules  # found, not imported (verifiers takes ~10 s to import)


def test_several_errors_are_all_reported():
    cfg = load_config(QUICKSTART, ["rollout.reward=no_such_pkg:score", "model.path=/nonexistent/model",
                                   "model.init_if_missing=false"])
    with pytest.raises(ConfigInvalid) as e:
        check_config(cfg)
    assert [x.field for x in e.value.errors] == ["model.path", "rollout.reward"]
    assert str(e.value).splitlines()[0] == "2 errors:"


def test_a_load_in_a_namespace_package_is_found_before_its_parent_is_imported():
    """`rlbus up` checks env.load in a fresh process, where a folder without __init__.py (tests/fixtures) has no
    imported parent to describe it by (the path finder raised KeyError there)."""
    code = ("import sys; from rlbus.cli.validate import find_object; "
            "find_object('tests.fixtures.vf_envs:single', 'env.load'); "
            "assert 'tests' not in sys.modules and 'tests.fixtures.vf_envs' not in sys.modules; print('found')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "found" in proc.stdout, proc.stderr[-2000:]
