"""The live view shows what a user watches a run for: step, reward, and the PPO clip fraction among them."""

import json

from rich.console import Console

from rlbus.cli.progress import RunMonitor, summary_table
from rlbus.schemas.config_io import load_config


def _render(console: Console, renderable) -> str:
    with console.capture() as cap:
        console.print(renderable)
    return cap.get()


def test_live_view_shows_reward_and_clip_fraction(tmp_path):
    cfg = load_config(None, ["model.path=m", f"logging.run_dir={tmp_path}", "trainer.total_steps=10"])
    rows = [{"step": 1, "reward/mean": 0.25, "actor/clipfrac": 0.0}, {"step": 2, "reward/mean": 0.5,
                                                                       "actor/clipfrac": 0.125}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    console = Console(width=160, force_terminal=False)
    text = _render(console, RunMonitor(cfg, [], console)._render())
    assert "clip" in text and "0.125" in text and "0.500" in text and "2/10" in text


def test_live_view_before_the_first_step(tmp_path):
    cfg = load_config(None, ["model.path=m", f"logging.run_dir={tmp_path}"])
    console = Console(width=160, force_terminal=False)
    text = _render(console, RunMonitor(cfg, [], console)._render())
    assert "clip" in text and "-" in text


def test_summary_has_the_clip_fraction(tmp_path):
    rows = [{"step": i, "reward/mean": 0.1 * i, "actor/clipfrac": 0.01 * i} for i in range(1, 16)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    console = Console(width=160, force_terminal=False)
    text = _render(console, summary_table(tmp_path))
    assert "actor/clipfrac" in text and "0.030" in text and "0.105" in text  # first 5 mean, last 10 mean


def test_the_closing_summary_names_only_what_the_run_wrote(tmp_path):
    # logging.tensorboard=false and logging.plot=false write neither tensorboard/ nor curves.png: not named.
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "final_model").mkdir()
    table = summary_table(tmp_path)
    assert table.caption == "1 steps; metrics.jsonl, checkpoints/, final_model/"
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "curves.png").write_bytes(b"")
    caption = summary_table(tmp_path).caption
    assert caption.endswith("metrics.jsonl, tensorboard/, curves.png, checkpoints/, final_model/")
