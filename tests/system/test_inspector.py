"""`rlbus up --ui` on the tiny quickstart-style model (embedded NATS, local Ray, trainer and producer processes),
watched in a real browser (Debian's Chromium, Playwright): the page is refused without the run's token, the run
view advances while the run trains, the sample view shows the recorded tokens and masks of a trajectory, every view
loads without console errors, and a what-if replay started from the page returns `rlbus replay`'s metrics. Each
view is also photographed, into the test's tmp_path; the screenshots in docs/images/ui-*.png come from a real
quickstart run instead (bench/screenshots.py).

    .venv/bin/python -m pytest -q tests/system/test_inspector.py
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from rlbus.consumers.event_log import load_rank_batch, read_steps
from tests.support.browser import (  # noqa: F401 (chromium: a fixture)
    chromium,
    http_status,
    new_page,
    open_run,
    replay_from_page,
    replay_on_the_command_line,
    shot,
    ui_server,
)
from tests.support.runs import log_tail, small_run_config, start_role, stop, write_config

pytestmark = pytest.mark.slow

TOTAL = 30  # enough steps that the page sees the run train, not only its end
REPLAYED = TOTAL - 3  # a step with a checkpoint before it (every 2 steps, 20 kept)


def test_the_inspector_follows_a_live_run_and_replays_a_step(chromium: Any, tmp_path: Path,  # noqa: F811
                                                             tiny_model_dir: Path, run_name: str) -> None:
    run_dir = tmp_path / "run"
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, "", "", "",
                           trainer={"total_steps": TOTAL, "checkpoint_interval": 2, "keep_checkpoints": 20},
                           # room for a whole calculator call and its (masked) result in the screenshots
                           rollout={"num_producers": 1, "max_new_tokens": 32, "max_response_tokens": 64})
    up = start_role("up", write_config(tmp_path / "run.yaml", cfg), tmp_path / "logs", "--ui", name="up")
    errors: list[str] = []
    try:
        address = run_dir / "ui" / "address"
        deadline = time.monotonic() + 300
        while not address.is_file():
            assert up.poll() is None and time.monotonic() < deadline, log_tail(up)
            time.sleep(0.2)
        url = address.read_text().strip()
        token = json.loads((run_dir / "creds" / "ui.json").read_text())["token"]
        assert url.startswith("http://127.0.0.1:")
        assert http_status(url) == 401 and http_status(url + "api/overview") == 401
        assert http_status(url + "api/overview", {"Authorization": f"Bearer {token}"}) == 200
        assert token not in (run_dir / "logs" / "ui.log").read_text()  # its log names the file, not the token

        page = new_page(chromium, errors)
        page.goto(f"{url}?token={token}")
        page.wait_for_selector("#live")
        assert page.inner_text("#live") == "● live"
        # The run view advances by itself while the run trains: no reload, the page polls.
        page.wait_for_function("+document.querySelector('#last-step').textContent >= 1", timeout=300_000)
        first = int(page.inner_text("#last-step"))
        assert first < TOTAL, "the run finished before the page saw it train"
        page.wait_for_function(f"+document.querySelector('#last-step').textContent > {first}", timeout=300_000)
        page.wait_for_selector("#chart .main-svg")
        page.close()  # before the run ends: its inspector goes with it, and a page still polling would log that

        assert up.wait(timeout=900) == 0, log_tail(up)
    finally:
        stop(up, signal.SIGKILL)

    # The finished run, opened again as a user would after the run (`rlbus ui RUN_DIR`).
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with ui_server(run_dir) as (url, token):
        page = new_page(chromium, errors)
        open_run(page, url, token, TOTAL)
        shot(page, shots / "ui-run.png")

        page.goto(url + "#samples")
        page.wait_for_selector("#page-range")
        assert page.inner_text("#page-range").endswith(f" of {TOTAL * 2 * 2}")  # groups_per_step 2, n 2
        shot(page, shots / "ui-samples.png")

        # A known trajectory, as the trainer's batch holds it: one with a tool call (its result masked out) if the
        # run made one, else the longest of the last step.
        record = max(read_steps(run_dir), key=lambda r: (any(x.num_tool_calls for g in r.groups for x in g.samples),
                                                         r.step))
        rank, row, gpos, spos, meta = max(((r, i, x.group, x.sample, record.groups[x.group].samples[x.sample])
                                           for r, rows in enumerate(record.shards) for i, x in enumerate(rows)),
                                          key=lambda t: (t[4].num_tool_calls > 0, t[4].response_len))
        batch = load_rank_batch(run_dir, record.step, rank)
        p, n = meta.prompt_len, meta.prompt_len + meta.response_len
        ids, mask = batch["input_ids"][row, p:n].tolist(), batch["response_mask"][row, p:n].tolist()
        sample_id = page.evaluate(f"""async () => (await (await fetch('/api/samples?step={record.step}'
            + '&limit=50')).json()).rows.find((r) => r.gpos === {gpos} && r.spos === {spos}).id""")
        page.goto(f"{url}#sample/{sample_id}")
        page.wait_for_selector(".tokens .tok")
        spans = page.eval_on_selector_all(".tokens .tok", "xs => xs.map((x) => [+x.dataset.id, x.className])")
        assert [i for i, _ in spans] == ids
        assert [int(c.split(" m")[1]) for _, c in spans] == mask
        assert "".join(page.eval_on_selector_all(".tokens .tok", "xs => xs.map((x) => x.textContent)")).strip()
        page.hover(".tokens .tok[data-i='1']")
        assert f"id {ids[1]}" in page.inner_text("#tok-info")
        shot(page, shots / "ui-sample.png")
        page.goto(f"{url}#group/{sample_id}")
        page.wait_for_function("document.querySelectorAll('.side > div').length === 2")
        shot(page, shots / "ui-group.png")

        page.goto(url + "#producers")
        page.wait_for_selector("#timeline .main-svg")
        shot(page, shots / "ui-producers.png")

        # Replay a step from the page with another LR; the same command on the command line says the same.
        page.goto(f"{url}#compare/{REPLAYED - 1}/{REPLAYED - 1}")
        page.wait_for_selector("#rp textarea")
        page.fill("input[name=a]", str(REPLAYED))
        page.fill("input[name=b]", str(REPLAYED + 1))
        page.click("#cmp button")
        page.wait_for_selector(f"#replay-go:has-text('replay step {REPLAYED}')")
        shown = replay_from_page(page, "trainer.lr=3e-4")
        shot(page, shots / "ui-compare.png")
    assert shown == replay_on_the_command_line(run_dir, REPLAYED, ["trainer.lr=3e-4"], tmp_path / "replay.json")
    assert errors == []
