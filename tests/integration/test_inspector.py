"""`rlbus ui` in a real browser (Debian's Chromium, Playwright) on a run recorded by the real trainer and recorder
(tests/integration/test_replay.py's record_run: a tiny Qwen2 trained 4 steps, tensors recorded, a checkpoint at
step 2): no request passes without the run's token, every page loads without console errors, the sample page
shows exactly the recorded tokens and masks of a known trajectory, the producers view shows each producer's in-flight
sizing and failure counts and each error's failure class, and a replay started from the page returns the metrics
`rlbus replay` returns.

    .venv/bin/python -m pytest -q tests/integration/test_inspector.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlbus.consumers.event_log import load_rank_batch, read_steps
from tests.integration.test_replay import GROUP_SIZE, GROUPS_PER_STEP, NUM_STEPS, record_run
from tests.support.browser import (  # noqa: F401 (chromium: a fixture)
    chromium,
    http_status,
    new_page,
    replay_from_page,
    replay_on_the_command_line,
    ui_server,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return record_run(tmp_path_factory.mktemp("inspected"))


@pytest.fixture(scope="module")
def server(recorded: dict[str, Any]) -> Any:
    with ui_server(recorded["run_dir"]) as (url, token):
        yield url, token


def test_nothing_answers_without_the_runs_token(server: tuple[str, str], recorded: dict[str, Any]) -> None:
    url, token = server
    for path in ("", "api/overview", "api/samples", "api/sample/1", "static/plotly.min.js", "static/app.js"):
        assert http_status(url + path) == 401, path
        assert http_status(url + path, {"Authorization": "Bearer not-the-token"}) == 401, path
        assert http_status(url + path, {"Cookie": "rlbus_ui=wrong"}) == 401, path
    assert http_status(url + "api/overview", {"Authorization": f"Bearer {token}"}) == 200
    assert http_status(f"{url}?token={token}") == 302  # the printed URL: sets the cookie, drops the token
    # the token lives in a private file of the run directory, and the server listens on loopback only
    creds = recorded["run_dir"] / "creds" / "ui.json"
    assert creds.stat().st_mode & 0o777 == 0o600 and creds.parent.stat().st_mode & 0o777 == 0o700
    assert url.startswith("http://127.0.0.1:")


def test_pages_load_and_the_sample_view_shows_the_recorded_tokens(chromium: Any, server: tuple[str, str],  # noqa: F811
                                                                   recorded: dict[str, Any]) -> None:
    url, token = server
    errors: list[str] = []
    page = new_page(chromium, errors)
    page.goto(f"{url}?token={token}")
    assert page.url == url  # the token left the address bar
    page.wait_for_selector("#chart .main-svg")
    assert page.inner_text("#last-step") == str(NUM_STEPS)
    assert f"{NUM_STEPS} steps, {NUM_STEPS * GROUPS_PER_STEP * GROUP_SIZE} samples" in page.inner_text("#summary")

    page.goto(url + "#samples")
    page.wait_for_selector("#page-range")
    assert page.inner_text("#page-range") == f"1–{NUM_STEPS * GROUPS_PER_STEP * GROUP_SIZE} of " \
                                             f"{NUM_STEPS * GROUPS_PER_STEP * GROUP_SIZE}"
    page.fill("input[name=step]", "3")
    page.click("form#filters button")
    page.wait_for_function("document.querySelector('#page-range').textContent.endsWith(' of 8')")

    # A known trajectory: step 3, group 1, sample 2, as the trainer's batch holds it.
    record = read_steps(recorded["run_dir"])[2]
    (row,) = [i for i, r in enumerate(record.shards[0]) if (r.group, r.sample) == (1, 2)]
    meta = record.groups[1].samples[2]
    batch = load_rank_batch(recorded["run_dir"], 3, 0)
    p, n = meta.prompt_len, meta.prompt_len + meta.response_len
    ids, mask = batch["input_ids"][row, p:n].tolist(), batch["response_mask"][row, p:n].tolist()
    versions = batch["versions"][row, p:n].tolist()
    group = record.groups[1].group_id
    sample_id = page.evaluate(f"""async () => (await (await fetch('/api/samples?step=3&group={group}'
        + '&sort=step&limit=10')).json()).rows.find((r) => r.spos === 2).id""")
    page.goto(f"{url}#sample/{sample_id}")
    page.wait_for_selector(".tokens .tok")
    spans = page.eval_on_selector_all(".tokens .tok", "xs => xs.map((x) => [x.textContent, x.className])")
    assert [t.strip() for t, _ in spans] == [f"t{i}" if i > 1 else ("<eos>" if i == 1 else "<pad>") for i in ids]
    assert [int(c.split(" m")[1]) for _, c in spans] == mask
    assert mask[3:5] == [0, 0] and sum(mask) == len(mask) - 2  # the tool output the recording masked out
    page.hover(".tokens .tok[data-i='5']")
    info = page.inner_text("#tok-info")
    assert f"id {ids[5]}" in info and f"version {versions[5]}" in info and "advantage" in info

    page.goto(f"{url}#group/{sample_id}")
    page.wait_for_function(f"document.querySelectorAll('.side > div').length === {GROUP_SIZE}")
    for view in ("producers", "compare/3/4", "overview"):
        page.goto(f"{url}#{view}")
        page.wait_for_load_state("networkidle")
    assert errors == []


def test_replay_from_the_page_equals_rlbus_replay(chromium: Any, server: tuple[str, str],  # noqa: F811
                                                  recorded: dict[str, Any], tmp_path: Path) -> None:
    url, token = server
    errors: list[str] = []
    page = new_page(chromium, errors)
    page.goto(f"{url}?token={token}")
    page.goto(f"{url}#compare/3/4")
    page.wait_for_selector("#rp textarea")
    shown = replay_from_page(page, "trainer.lr=5e-3", timeout_ms=240_000)
    verdict = page.inner_text("#replay-verdict")
    expected = replay_on_the_command_line(recorded["run_dir"], 3, ["trainer.lr=5e-3"], tmp_path / "replay.json")
    assert shown == expected
    assert "differs from the recorded run" in verdict  # another LR: a what-if, not the recorded step
    assert any(m == "actor/pg_loss" for _, m, _ in shown)
    assert errors == []


def test_proximal_log_probs_recomputed_from_the_page_give_the_recorded_mismatch(
        chromium: Any, server: tuple[str, str], recorded: dict[str, Any]) -> None:  # noqa: F811
    """Proximal log-probs are not recorded; the page recomputes a step's by replay (cli/ui_proximal.py), and the
    behaviour/proximal mismatch of the step's tokens it then shows averages to the step's recorded
    `mismatch/kl_k1` (sum of mask * (log mu - log pi_prox) over the step's tokens, over their count)."""
    url, token = server
    errors: list[str] = []
    page = new_page(chromium, errors)
    page.goto(f"{url}?token={token}")
    ids = page.evaluate("async () => (await (await fetch('/api/samples?step=3&limit=50')).json())"
                        ".rows.map((r) => r.id)")
    page.goto(f"{url}#sample/{ids[0]}")
    page.wait_for_selector("#prox")
    page.click("#prox")
    page.wait_for_function("document.querySelector('#prox') === null && document.querySelector('.tokens .tok')",
                           timeout=240_000)
    page.select_option("#by", "mismatch")
    page.hover(".tokens .tok[data-i='0']")
    assert "proximal - ·" not in page.inner_text("#tok-info")  # a number, not the dash of a missing value
    tokens = page.evaluate("async (ids) => (await Promise.all(ids.map(async (i) => (await (await fetch("
                           "'/api/sample/' + i)).json()).tokens))).flat()", ids)
    trained = [t for t in tokens if t["mask"] == 1]
    assert trained and all(t["proximal"] is not None for t in trained)
    k1 = sum(t["logprob"] - t["proximal"] for t in trained) / len(trained)
    recorded_k1 = recorded["rows"][2]["mismatch/kl_k1"]
    assert k1 == pytest.approx(recorded_k1, rel=1e-4, abs=1e-6)
    assert errors == []


def test_the_producers_view_shows_in_flight_sizing_failure_counts_and_error_classes(
        chromium: Any, recorded: dict[str, Any], tmp_path: Path) -> None:  # noqa: F811
    """The recorded run with producer heartbeats and errors added to its event log: a producer whose heartbeats
    carry the in-flight limit, engine idle share and failure counts shows them (and its limit over time), one whose
    heartbeats predate those fields shows "-", and each error its failure class."""
    import shutil

    import msgspec

    from rlbus.consumers.event_log import KINDS, Entry, events_dir
    from rlbus.schemas.wire import ErrorRaised, ProducerHeartbeat

    run = tmp_path / "run"
    shutil.copytree(recorded["run_dir"], run, ignore=shutil.ignore_patterns("ui", "creds"))
    beats = [ProducerHeartbeat(producer_id="p-new", pid=7, version=1, inflight=3, inflight_limit=limit,
                               engine_idle=idle, infra_failures=2, env_failures=1, tool_retries=5, created_at=100.0 + t)
             for t, limit, idle in ((0, 1, 0.5), (2, 4, 0.25))]
    beats.append(ProducerHeartbeat(producer_id="p-old", pid=8, version=1, created_at=101.0))
    errors = [ErrorRaised(role="producer", role_id="p-new", error="InfrastructureError", message="sandbox down",
                          failure="infrastructure", created_at=102.0),
              ErrorRaised(role="producer", role_id="p-old", error="RuntimeError", message="old log", created_at=103.0)]
    for kind, msgs in (("heartbeats", beats), ("errors", errors)):
        with (events_dir(run) / KINDS[kind][0]).open("ab") as f:
            for i, m in enumerate(msgs):
                f.write(msgspec.json.encode(Entry(seq=i + 1, subject=f"rlbus.t.{kind}", recorded_at=m.created_at,
                                                  msg=m)) + b"\n")
    with ui_server(run) as (url, token):
        console: list[str] = []
        page = new_page(chromium, console)
        page.goto(f"{url}?token={token}")
        page.goto(f"{url}#producers")
        page.wait_for_selector("#producer-table tr[data-producer] td[data-k]")
        cells = page.eval_on_selector_all("#producer-table td[data-k]", "xs => xs.map((x) => "
                                          "[x.parentElement.dataset.producer, x.dataset.k, x.textContent])")
        shown = {(p, k): v for p, k, v in cells}
        assert [shown["p-new", k] for k in ("inflight_limit", "engine_idle", "infra_failures", "env_failures",
                                            "tool_retries")] == ["4", "25%", "2", "1", "5"]
        assert [shown["p-old", k] for k in ("inflight_limit", "engine_idle", "infra_failures", "env_failures",
                                            "tool_retries")] == ["-"] * 5
        page.wait_for_selector("#inflight .main-svg")  # the limit over time
        rows = page.eval_on_selector_all("#errors tr", "xs => xs.map((x) => [...x.children].map((c) => c.textContent))")
        assert rows[0][3] == "failure class"
        assert {r[2]: r[3] for r in rows[1:]} == {"InfrastructureError": "infrastructure", "RuntimeError": "-"}
        page.wait_for_load_state("networkidle")
    assert console == []


def test_a_run_directory_copied_elsewhere_opens_the_same(recorded: dict[str, Any], tmp_path: Path) -> None:
    """The run directory alone, on a machine without the run's model directory: the same samples, token ids instead
    of text, the advantages the trainer recorded beside the batch (equal to those recomputed from its rewards)."""
    import json
    import shutil
    import urllib.request

    copy = tmp_path / "elsewhere" / "run"
    shutil.copytree(recorded["run_dir"], copy, ignore=shutil.ignore_patterns("ui", "creds"))
    config = copy / "config.yaml"
    config.write_text(config.read_text().replace(str(recorded["run_dir"].parent / "model"), "/nonexistent/model"))
    assert "/nonexistent/model" in config.read_text()

    def get(url: str, token: str, path: str) -> Any:
        req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    with ui_server(copy) as (url, token):
        page = get(url, token, "api/samples?step=3&sort=step&desc=0&limit=50")
        assert page["total"] == GROUPS_PER_STEP * GROUP_SIZE
        s = get(url, token, f"api/sample/{page['rows'][0]['id']}")
    record = read_steps(copy)[2]
    batch = load_rank_batch(copy, 3, 0)
    (row,) = [i for i, r in enumerate(record.shards[0]) if (r.group, r.sample) == (s["gpos"], s["spos"])]
    meta = record.groups[s["gpos"]].samples[s["spos"]]
    p, n = meta.prompt_len, meta.prompt_len + meta.response_len
    assert s["tokenizer"] is False
    assert [t["id"] for t in s["tokens"]] == batch["input_ids"][row, p:n].tolist()
    assert [t["text"] for t in s["tokens"]] == [f"[{i}]" for i in batch["input_ids"][row, p:n].tolist()]
    assert all(t["advantage"] is not None for t in s["tokens"] if t["mask"])
    from safetensors.torch import load_file

    from rlbus.consumers.event_log import advantages_path
    from rlbus.trainer.algorithms.advantages import compute_advantages

    used = load_file(str(advantages_path(copy, 3, 0)))["advantages"]
    algo = recorded["cfg"].algorithm
    again = compute_advantages(batch["token_level_rewards"], batch["response_mask"], batch["group_index"],
                               estimator=algo.adv_estimator, norm_by_std=algo.norm_adv_by_std, gamma=algo.gamma)
    assert torch.equal(used, again)
    assert [t["advantage"] for t in s["tokens"]] == pytest.approx(used[row, p:n].tolist())
    assert "recorded" in s["advantage_note"]


@pytest.mark.slow
def test_a_gae_run_shows_the_advantages_and_values_its_trainer_used(tmp_path: Path) -> None:
    """GAE's advantages need the critic's values, which the step's batch does not hold: the trainer records them
    with the step (logging.record=full), and a sample shows per token the advantage and the value step 4 trained on."""
    import json
    import urllib.request

    gae = record_run(tmp_path, algorithm={"adv_estimator": "gae", "lam": 0.95}, critic={"lr": 1e-2})
    computed = gae["engine"].computed  # the last step's: NUM_STEPS
    assert set(computed) == {"advantages", "values", "returns"}
    with ui_server(gae["run_dir"]) as (url, token):
        req = urllib.request.Request(url + f"api/samples?step={NUM_STEPS}&limit=50",
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            first = json.loads(r.read())["rows"][0]
        req = urllib.request.Request(url + f"api/sample/{first['id']}", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            s = json.loads(r.read())
    record = read_steps(gae["run_dir"])[NUM_STEPS - 1]
    (row,) = [i for i, r in enumerate(record.shards[0]) if (r.group, r.sample) == (s["gpos"], s["spos"])]
    meta = record.groups[s["gpos"]].samples[s["spos"]]
    p, n = meta.prompt_len, meta.prompt_len + meta.response_len
    assert [t["advantage"] for t in s["tokens"]] == pytest.approx(computed["advantages"][row, p:n].tolist())
    assert [t["value"] for t in s["tokens"]] == pytest.approx(computed["values"][row, p:n].tolist())
    assert any(t["value"] for t in s["tokens"] if t["mask"]), "the critic's values are all zero"
