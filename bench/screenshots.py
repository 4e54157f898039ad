"""The inspector's screenshots (docs/images/ui-*.png, shown by the README and docs/inspector.md), from a real
quickstart run whose reward climbs.

    .venv/bin/python bench/screenshots.py [--run-dir runs/screenshots] [--reuse] [--out docs/images]

Runs `rlbus up configs/quickstart.yaml name=screenshots logging.run_dir=RUN_DIR` to its end (1-2 minutes on two
CPU cores; a previous run in RUN_DIR is removed first), or with --reuse takes the finished run already in RUN_DIR.
Then serves it with `rlbus ui RUN_DIR` on a free loopback port and photographs six views in Debian's Chromium driven
by Playwright, the browser the inspector's system test uses (tests/support/browser.py), at 1400x1000:

- ui-run.png: the run view (reward, entropy, mismatch, staleness, throughput, weight versions by step);
- ui-samples.png: the samples view as it opens (newest step first);
- ui-sample.png and ui-group.png: one trajectory token by token, and its group side by side. The group is the first
  (by position) of the latest step whose rewards differ within the GROUP_COLUMNS samples the group view shows
  (else within the whole group), and the sample the best rewarded of it (a tool call, then a shorter response, wins
  a tie): a correct calculator call, and in the group beside it a miss;
- ui-producers.png: the producers' time online and weight versions;
- ui-compare.png: an early step (EARLY) against the last one, with a what-if replay of the early step
  (REPLAY_OVERRIDES), which replays from the base model (the run keeps only its last checkpoints).

RUN_DIR is given to `rlbus ui` relative to the repository root when it lies inside it, so the page's header shows
`runs/screenshots`. Any console or page error in the browser fails the command. Prints the run's reward over its
first 5 and last 10 steps, and the time taken.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

from bench.common import run_up  # noqa: E402
from rlbus.schemas.config_io import load_config  # noqa: E402
from tests.support.browser import (  # noqa: E402
    launch_chromium,
    new_page,
    open_run,
    replay_from_page,
    shot,
    ui_server,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = Path("configs") / "quickstart.yaml"
WIDTH, HEIGHT = 1400, 1000
EARLY = 5  # the compared (and replayed) early step: the last of the quickstart's LR warm-up
REPLAY_OVERRIDES = "trainer.lr=1e-4"
GROUP_COLUMNS = 4  # a group's samples the group view shows side by side at WIDTH (the rest scroll sideways)
UP_TIMEOUT_S = 1800.0


def api(url: str, token: str, path: str) -> Any:
    request = urllib.request.Request(url.rstrip("/") + path, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def run_quickstart(run_dir: Path) -> None:
    """`rlbus up` on the quickstart config into `run_dir`, to its end."""
    if run_dir.exists():
        if not (run_dir / "config.yaml").is_file():
            sys.exit(f"{run_dir} exists and holds no run (no config.yaml): not removing it; choose another --run-dir")
        print(f"removing the previous run in {run_dir}", flush=True)
        shutil.rmtree(run_dir)
    argv = [sys.executable, "-m", "rlbus.cli", "up", str(CONFIG), "name=screenshots", f"logging.run_dir={run_dir}"]
    print("running: rlbus " + " ".join(argv[3:]), flush=True)
    rc, output = run_up(argv, UP_TIMEOUT_S)
    if rc != 0:
        sys.exit(f"rlbus up failed (exit {rc}):\n" + "\n".join(output.strip().splitlines()[-40:]))


def rewards(run_dir: Path) -> list[float]:
    """reward/mean per training step, from metrics.jsonl (an evaluation is a row of its own, without it)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["reward/mean"] for r in rows if "reward/mean" in r]


def _rank(r: dict[str, Any]) -> tuple:
    return r["reward"], r["num_tool_calls"] > 0, -r["response_len"], -r["spos"]


def mixed_group_sample(url: str, token: str, last: int) -> dict[str, Any]:
    """The best rewarded sample (a tool call, then a shorter response, wins a tie) of the latest step's first group,
    by position, whose rewards differ within its first GROUP_COLUMNS samples (the columns the group view shows),
    else within the whole group; the last step's first sample if no step has one."""
    mixed: list[list[dict[str, Any]]] = []
    for step in range(last, 0, -1):
        rows = api(url, token, f"/api/samples?step={step}&limit=200")["rows"]
        for gpos in sorted({r["gpos"] for r in rows}):
            group = sorted((r for r in rows if r["gpos"] == gpos), key=lambda r: r["spos"])
            if len({r["reward"] for r in group[:GROUP_COLUMNS]}) > 1:
                return max(group, key=_rank)
            if len({r["reward"] for r in group}) > 1:
                mixed.append(group)
    if mixed:
        return max(mixed[0], key=_rank)
    return min(api(url, token, f"/api/samples?step={last}&limit=200")["rows"], key=lambda r: (r["gpos"], r["spos"]))


def photograph(run_dir: Path, out: Path, total_steps: int) -> None:
    """The six views of the finished run in `run_dir`, as out/ui-*.png."""
    out.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    with ui_server(run_dir, log_path=run_dir / "logs" / "ui-screenshots.log") as (url, token), \
            launch_chromium() as chromium:
        info = api(url, token, "/api/info")
        if info["live"] or info["last_step"] != total_steps:
            sys.exit(f"{run_dir} is not a finished run: step {info['last_step']} of {total_steps}"
                     f"{' (still training)' if info['live'] else ''}; run without --reuse to train it")
        page = new_page(chromium, errors, WIDTH, HEIGHT)
        open_run(page, url, token, total_steps)
        shot(page, out / "ui-run.png")

        page.goto(url + "#samples")
        page.wait_for_selector("#page-range")
        shot(page, out / "ui-samples.png")

        sample = mixed_group_sample(url, token, total_steps)
        print(f"sample {sample['id']}: step {sample['step']}, group {sample['gpos']}, sample {sample['spos']}, "
              f"reward {sample['reward']}, {sample['num_tool_calls']} tool call(s)", flush=True)
        page.goto(f"{url}#sample/{sample['id']}")
        page.wait_for_selector(".tokens .tok")
        page.hover(".tokens .tok.m1")  # the first sampled token: its id, version, log-prob and advantage above
        shot(page, out / "ui-sample.png")
        size = len(api(url, token, f"/api/group?step={sample['step']}&gpos={sample['gpos']}"))
        page.goto(f"{url}#group/{sample['id']}")
        page.wait_for_function(f"document.querySelectorAll('.side > div').length === {size}")
        shot(page, out / "ui-group.png")

        page.goto(url + "#producers")
        page.wait_for_selector("#timeline .main-svg")
        shot(page, out / "ui-producers.png")

        early = min(EARLY, total_steps - 1)
        page.goto(f"{url}#compare/{early}/{total_steps}")
        page.wait_for_selector(f"#replay-go:has-text('replay step {early}')")
        print(f"replaying step {early} ({REPLAY_OVERRIDES}) from the page", flush=True)
        replay_from_page(page, REPLAY_OVERRIDES)
        shot(page, out / "ui-compare.png")
        page.close()
    if errors:
        sys.exit("the page logged errors:\n" + "\n".join(errors))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run-dir", default="runs/screenshots", help="the run directory (default runs/screenshots)")
    p.add_argument("--reuse", action="store_true", help="photograph the finished run in --run-dir, no new run")
    p.add_argument("--out", default="docs/images", help="where the ui-*.png go (default docs/images)")
    args = p.parse_args()
    t0 = time.monotonic()
    run_dir = Path(args.run_dir).resolve()
    if run_dir.is_relative_to(ROOT):
        run_dir = run_dir.relative_to(ROOT)  # as the page's header shows it; the paths below are from ROOT
    out = Path(args.out).resolve()
    os.chdir(ROOT)
    if not args.reuse:
        run_quickstart(run_dir)
    elif not (run_dir / "config.yaml").is_file():
        sys.exit(f"--reuse: no run in {run_dir}")
    total_steps = load_config(run_dir / "config.yaml").trainer.total_steps
    photograph(run_dir, out, total_steps)
    got = rewards(run_dir)
    print(f"wrote {', '.join(sorted(p.name for p in out.glob('ui-*.png')))} in {out}; the run's reward: "
          f"{statistics.fmean(got[:5]):.2f} over its first 5 steps, {statistics.fmean(got[-10:]):.2f} over its last "
          f"10 ({len(got)} steps); {time.monotonic() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
