"""What the benchmark scripts share: the machine description, the docs/benchmarks.md section writer, a tiny model.

Each script starts with

    sys.path[0] = str(Path(__file__).resolve().parents[1])   # so that `bench.common` imports

so that `bench.common` (this module) imports from the repository root; rlbus itself comes from the installed
package (`rlbus.bus`, `rlbus.trainer`, ...), which no script name can shadow.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def shown(path: Path) -> str:
    """A path as results files and docs name it: from the repository root when it lies inside it."""
    root = DOCS.parents[1]
    return str(path.relative_to(root) if path.is_relative_to(root) else path)


def machine(**extra: Any) -> dict[str, Any]:
    """CPU model, cores, OS, Python, torch, the 1-minute load (a shared machine makes absolute numbers noisy)."""
    import torch

    from rlbus.common.model.init_model import cpu_model

    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        **extra,
    }


def git_commit() -> str:
    """The commit a bench measured (`-dirty` with local edits), for its results and docs section."""
    out = subprocess.run(["git", "describe", "--always", "--dirty"], check=False, cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


TIMED_OUT = 124  # a run's exit status when it ran past its timeout (as timeout(1) reports it)


def run_up(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """A bench's run of `argv` (`rlbus up ...`, a peer's trainer) from the repository root, in `env` (None: this
    process's environment): its exit status and output. Past `timeout` it is stopped as Ctrl-C would (rlbus's roles
    stop and write what they have: the metrics of the steps and evaluations done so far), killed if it has not exited
    a minute later, and the status is TIMED_OUT: the bench records the run and goes on to the next, instead of losing
    every seed's results."""
    # A bench started in the background (`cmd &` in a script) has SIGINT ignored, and a child inherits that: give
    # the run Ctrl-C's default back, so that it can be stopped as Ctrl-C would stop it.
    proc = subprocess.Popen(argv, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        output = proc.communicate(timeout=timeout)[0]
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            output = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            output = proc.communicate()[0]
        return TIMED_OUT, f"{output}\nthe run ran past its timeout of {timeout:.0f} s and was stopped"


def tail_up(argv: list[str], run_dir: Path, timeout_s: float, env: dict[str, str] | None = None
            ) -> tuple[list[dict], list[float], int, float, float]:
    """Start `argv` (an `rlbus up` writing to `run_dir`) from the repository root, stamp each metrics row when it
    appears, wait for the exit; past `timeout_s` it is stopped as Ctrl-C would. Returns the rows, their stamps
    (time.monotonic()), the exit code (TIMED_OUT when stopped), start and end times. Output: run_dir/launcher.out."""
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    rows: list[dict] = []
    stamps: list[float] = []
    pending = ""
    offset = 0
    with open(run_dir / "launcher.out", "wb") as out:
        started = time.monotonic()
        proc = subprocess.Popen(argv, cwd=Path(__file__).resolve().parents[1], stdout=out, stderr=subprocess.STDOUT,
                                env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        while True:
            code = proc.poll()
            if metrics.is_file():
                # Rows are appended whole by one writer; a partial last line waits for the next poll.
                with metrics.open() as f:
                    f.seek(offset)
                    chunk = f.read()
                    offset = f.tell()
                pending += chunk
                *lines, pending = pending.split("\n")
                now = time.monotonic()
                for line in lines:
                    if line.strip():
                        rows.append(json.loads(line))
                        stamps.append(now)
            if code is not None:
                return rows, stamps, code, started, time.monotonic()
            if time.monotonic() - started > timeout_s:
                proc.send_signal(signal.SIGINT)  # the launcher stops its children in order
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                return rows, stamps, TIMED_OUT, started, time.monotonic()
            time.sleep(0.1)


def run_ledger(run_dir: Path) -> dict[str, Any]:
    """A run's ledger as a user checks it (`rlbus events RUN_DIR --ledger --json`): {"trained": N, "problems": [...]};
    where the command fails, trained is None and the one problem says why."""
    proc = subprocess.run([sys.executable, "-m", "rlbus.cli", "events", str(run_dir), "--ledger", "--json"],
                          check=False, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip().splitlines() or ["?"]
        return {"trained": None, "problems": [f"unread: {why[-1]}"]}
    said = json.loads(proc.stdout)
    return {"trained": said["trained"], "problems": said["problems"]}


#: bench/peer_env.py's time-to-target rule: this share of the lower of the two sides' mean final accuracy.
TARGET_SHARE = 0.9


def time_to(run: dict[str, Any], target: float) -> float | None:
    """Seconds from process start to the first saved model of `run` (bench/peer_env.py) that reaches `target`."""
    return next((s["t"] for s in run["saved"] if s["accuracy"] >= target), None)


def peer_summary(d: dict[str, Any], mine: str = "rlbus", target: float | None = None) -> dict[str, Any]:
    """bench/peer_env.py's results: each side's mean final accuracy, the target, each run's time to it (None: never),
    the times of the runs that reached it, and each run's time with a run that never did counted at its whole run
    time (less than it would have needed: a lower bound). `mine` names the rlbus side (another engine's runs are
    "rlbus-vllm"), keyed "rlbus" in the answer; `target` replaces the one made from the two sides' finals."""
    import statistics

    ok = {side: [r for r in d["runs"] if r["side"] == label and r["rc"] == 0]
          for side, label in (("rlbus", mine), ("trl", "trl"))}
    final = {side: statistics.fmean(r["saved"][-1]["accuracy"] for r in runs) if runs else 0.0
             for side, runs in ok.items()}
    target = round(TARGET_SHARE * min(final.values()), 4) if target is None else target
    times = {side: [time_to(r, target) for r in runs] for side, runs in ok.items()}
    reached = {side: [t for t in ts if t is not None] for side, ts in times.items()}
    bounded = {side: [r["wall_s"] if t is None else t for t, r in zip(times[side], ok[side])] for side in ok}
    return {"final": final, "target": target, "times": times, "reached": reached, "bounded": bounded}


def bounded_ratio(s: dict[str, Any]) -> tuple[str, float, float, float] | None:
    """With a run that never reached the target (peer_summary's `s`): ("at most" | "at least" | "", rlbus's mean time
    with such runs counted at their whole run time, TRL's, their ratio); None when every run reached it."""
    import statistics

    short = {side: len(s["reached"][side]) < len(s["times"][side]) for side in ("rlbus", "trl")}
    if not any(short.values()):
        return None
    mine, trl = (statistics.fmean(s["bounded"][side]) for side in ("rlbus", "trl"))
    how = "" if all(short.values()) else "at most" if short["trl"] else "at least"
    return how, mine, trl, mine / trl


def appended(old: dict[str, Any], new: dict[str, Any], same: tuple[str, ...], drop: tuple[str, ...] = ()
             ) -> dict[str, Any]:
    """A bench's `--append`: the `old` results, to which `new`'s runs will be added, with `new`'s command, commit,
    machine and date recorded under "more". They must agree on every key of `same`; the keys in `drop` go (they
    spoke of the runs before)."""
    if differ := [k for k in same if old[k] != new[k]]:
        raise SystemExit("--append: the results file holds another comparison: "
                         + ", ".join(f"{k} {old[k]!r} (not {new[k]!r})" for k in differ))
    more = {k: new[k] for k in ("command", "commit", "machine", "date")}
    return {**{k: v for k, v in old.items() if k not in drop}, "more": [*old.get("more", []), more]}


def more_seeds(d: dict[str, Any]) -> list[str]:
    """One sentence for each `--append` run of a bench (appended's "more")."""
    return [f"More seeds: `{m['command']}` at `{m['commit']}`, {m['date']}." for m in d.get("more", [])]


@contextlib.contextmanager
def peft_lora_forward(active: bool = True) -> Iterator[None]:
    """Inside the block (`active`), `apply_lora` leaves peft's own `Linear` in the model instead of
    trainer/lora_linear.py's: the LoRA benches' baseline."""
    from rlbus.trainer import lora_linear

    install = lora_linear.install
    if active:
        lora_linear.install = lambda _model: 0
    try:
        yield
    finally:
        lora_linear.install = install


def machine_line(m: dict[str, Any]) -> str:
    return (f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['platform']}, Python {m['python']}, torch "
            f"{m['torch']}, 1-minute load {m['load_avg_1m']} while measured.")


def write_section(heading: str, body: str, path: Path = DOCS) -> None:
    """Replace (or append) the `heading` section of the benchmarks page, leaving the other sections alone."""
    section = body if body.startswith(heading) else f"{heading}\n\n{body}"
    section = section.rstrip("\n") + "\n"
    text = path.read_text() if path.exists() else "# Benchmarks\n\nMeasured numbers, with the command and machine.\n"
    start = text.find(heading + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(heading))
        text = text[:start] + section + (text[end:] if end >= 0 else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def tiny_qwen2(path: Path, *, layers: int, hidden: int, vocab: int, seed: int = 0) -> Path:
    """A random Qwen2-style causal LM saved as a Hugging Face directory."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                      max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path
