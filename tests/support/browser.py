"""A real browser for the inspector's tests: Debian's Chromium driven by Playwright, and `rlbus ui` as a process.

    with ui_server(run_dir) as (url, token): ...       # `rlbus ui RUN_DIR` on a free loopback port, stopped by pid
    page = new_page(chromium, errors)                   # console errors and page errors collected in `errors`
    shot(page, path)                                    # a PNG of the page once its requests are done

bench/screenshots.py drives the same browser outside pytest (`launch_chromium`), for docs/images/ui-*.png.

Playwright's own browser download is not used: `chromium` launches the system Chromium (`apt-get install -y
chromium`, which `make setup` does when it is missing). A machine without it fails these tests; it does not skip them.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = ("chromium", "chromium-browser")


def chromium_path() -> str:
    for name in CHROMIUM:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("no Chromium on this machine: `apt-get install -y chromium` (make setup installs it when missing)")


@contextlib.contextmanager
def launch_chromium() -> Iterator[Any]:
    """A headless Chromium, driven by Playwright's sync API."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # --no-sandbox: Chromium's sandbox refuses to run as root, as CI containers do.
        browser = pw.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """A headless Chromium (module scope)."""
    with launch_chromium() as browser:
        yield browser


def new_page(browser: Any, errors: list[str], width: int = 1400, height: int = 1000) -> Any:
    page = browser.new_page(viewport={"width": width, "height": height})
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    return page


def open_run(page: Any, url: str, token: str, last_step: int) -> None:
    """The inspector's run view, once it shows `last_step` and its chart is drawn."""
    page.goto(f"{url}?token={token}")
    page.wait_for_function(f"+document.querySelector('#last-step').textContent === {last_step}")
    page.wait_for_selector("#chart .main-svg")


def shot(page: Any, path: Path) -> None:
    """A PNG of the viewport, taken once the page has no request in flight (its charts and tables drawn)."""
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(path))


@contextlib.contextmanager
def ui_server(run_dir: Path, timeout: float = 90.0, log_path: Path | None = None) -> Iterator[tuple[str, str]]:
    """`rlbus ui RUN_DIR` as a user starts it (from the repository root, RUN_DIR as given: the page shows it);
    yields (its address, the run's token). Its output goes to `log_path` (default: ui-test.log beside RUN_DIR)."""
    from rlbus.cli.ui import ADDRESS_FILE, TOKEN_FILE

    address = run_dir / "ui" / ADDRESS_FILE
    address.unlink(missing_ok=True)
    log_path = log_path or run_dir.parent / "ui-test.log"
    log = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "rlbus.cli", "ui", str(run_dir), "--hide-token"], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not address.is_file():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"rlbus ui did not start (exit {proc.poll()}):\n"
                            + log_path.read_text(errors="replace")[-3000:])
            time.sleep(0.05)
        import json

        token = json.loads((run_dir / "creds" / TOKEN_FILE).read_text())["token"]
        yield address.read_text().strip(), token
    finally:
        proc.terminate()  # ours, by pid
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def http_status(url: str, headers: dict[str, str] | None = None) -> int:
    """The status of a GET (no redirect followed)."""
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def replay_from_page(page: Any, overrides: str, timeout_ms: int = 300_000) -> list[list[Any]]:
    """On the compare view: type the overrides, start the replay of step A, wait for it; its metrics as shown,
    [step, metric, replayed value] per row."""
    page.fill("#rp textarea", overrides)
    page.click("#replay-go")
    page.wait_for_selector("#replay-verdict", timeout=timeout_ms)
    return page.eval_on_selector_all("#replay-table td[data-metric]", "xs => xs.map((x) => "
                                     "[+x.dataset.step, x.dataset.metric, +x.dataset.value])")


def replay_on_the_command_line(run_dir: Path, step: int, overrides: list[str], out: Path) -> list[list[Any]]:
    """`rlbus replay RUN_DIR --from-step STEP --json OUT OVERRIDES...`: [step, metric, replayed value] per row."""
    import json

    cli = subprocess.run([sys.executable, "-m", "rlbus.cli", "replay", str(run_dir), "--from-step", str(step),
                          "--json", str(out), *overrides], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    return [[d["step"], d["metric"], d["replayed"]] for d in json.loads(out.read_text())["diffs"]]
