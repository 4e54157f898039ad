"""The web inspector on a large run: open time and the time of every page (`rlbus ui`, cli/ui.py).

    .venv/bin/python bench/inspector.py [--steps 10000 --samples-per-step 30 --tensor-every 100 --repeats 5]

Synthesises a run directory in the real recorded formats (consumers/event_log.py: metrics.jsonl, events/steps.jsonl
with each step's groups and samples, prompts, heartbeats, lifecycle, guard actions and weight versions, the
recorder's own encoders and wire structs; every `--tensor-every`-th step also gets its rank file of tensors, the
others are recorded as `metadata`), then measures:

- the index's open: the first (built from the files) and a cached one (RunIndex.open, cli/ui_index.py);
- `rlbus ui RUN_DIR` as a user starts it: process start until the first page's data answers;
- each page's request over HTTP, with the token (median and max of --repeats): the overview, a first and a deep
  page of samples sorted by reward, a prompt-text search, one sample token by token, a group side by side, the
  producers, two steps compared, and plotly.min.js.

Writes bench/results/inspector.json and the "Inspector" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import date, datetime, timezone
from pathlib import Path

# Run as a script, sys.path[0] is bench/: put the repository root there instead, so `bench.common` imports.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import msgspec  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from rlbus.cli.ui import ADDRESS_FILE, ui_token  # noqa: E402
from rlbus.cli.ui_index import RunIndex  # noqa: E402
from rlbus.consumers.event_log import Entry, ShardRow, StepRecord, events_dir, shard_path  # noqa: E402
from rlbus.consumers.recorder import write_advantages  # noqa: E402
from rlbus.trainer.algorithms.advantages import compute_advantages  # noqa: E402
from rlbus.schemas.wire import (  # noqa: E402
    ChatMessage,
    GuardAction,
    ProducerHeartbeat,
    PromptTask,
    RoleStarted,
    RoleStopped,
    SampleMeta,
    TrajectoryGroup,
    WeightsPublished,
)

from bench.common import git_commit, machine, machine_line, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "inspector.json"
_ENC = msgspec.json.Encoder()


def synthesise(run_dir: Path, *, steps: int, per_step: int, n: int, tensor_every: int, producers: int) -> dict:
    """A finished run of `steps` steps, `per_step` samples each (groups of `n`), in the recorded formats."""
    rng = random.Random(0)
    ev = events_dir(run_dir)
    ev.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"name: bench\nmodel:\n  path: {run_dir / 'no-model'}\n"
                                         f"logging:\n  run_dir: {run_dir}\n")
    t0 = 1.76e9
    files = {name: (ev / name).open("wb") for name in ("steps.jsonl", "prompts.jsonl", "heartbeats.jsonl",
                                                       "lifecycle.jsonl", "guard.jsonl", "weights.jsonl")}
    metrics = (run_dir / "metrics.jsonl").open("wb")

    def entry(name: str, t: float, msg: object) -> None:
        files[name].write(_ENC.encode(Entry(seq=0, subject=f"rlbus.bench.{name}", recorded_at=t, msg=msg)) + b"\n")

    for p in range(producers):
        entry("lifecycle.jsonl", t0, RoleStarted(role="producer", role_id=f"p{p}", pid=1000 + p, created_at=t0))
    num_samples = 0
    for step in range(1, steps + 1):
        t = t0 + step * 2.0
        groups = []
        for g in range(per_step // n):
            task_id = f"e0-i{step * 100 + g}-a0"
            a, b = rng.randrange(100), rng.randrange(100)
            entry("prompts.jsonl", t - 3, PromptTask(task_id=task_id, n=n, ground_truth=str(a + b), created_at=t - 3,
                                                     prompt=[ChatMessage(role="user", content=f"What is {a} + {b}?")]))
            samples = [SampleMeta(key=f"{task_id}/d1-p0-x/{s}", prompt_len=24, response_len=rng.randrange(8, 120),
                                  reward=float(rng.random() < 0.5), num_turns=rng.randrange(1, 3),
                                  num_tool_calls=rng.randrange(0, 2), min_version=max(0, step - 1 - rng.randrange(3)),
                                  max_version=step - 1) for s in range(n)]
            groups.append(TrajectoryGroup(group_id=task_id, task_id=task_id, producer_id=f"p{g % producers}",
                                          samples=samples, index=step * 100 + g, created_at=t - 1))
        rows = [ShardRow(group=gi, sample=si) for gi, grp in enumerate(groups) for si in range(len(grp.samples))]
        full = step % tensor_every == 0
        if full:
            _write_tensors(run_dir, step, groups)
        files["steps.jsonl"].write(_ENC.encode(StepRecord(step=step, trained_version=step - 1, version=step,
                                                          world_size=1, groups=groups, shards=[rows],
                                                          payload="full" if full else "metadata",
                                                          created_at=t)) + b"\n")
        num_samples += len(rows)
        metrics.write(json.dumps({"step": step, "version": step, "reward/mean": rng.random(),
                                  "actor/entropy": rng.random(), "mismatch/kl_k3": rng.random() * 1e-3,
                                  "staleness/mean": rng.random(), "perf/tokens_per_s": 500 + rng.random() * 100,
                                  "time/step": 2.0 + rng.random(), "actor/grad_norm": rng.random(),
                                  **{f"extra/m{i}": rng.random() for i in range(40)}}).encode() + b"\n")
        if step % 50 == 0:
            metrics.write(json.dumps({"step": step, "eval/accuracy": rng.random()}).encode() + b"\n")
        entry("weights.jsonl", t, WeightsPublished(version=step, step=step, num_bytes=1 << 20, checksum="x",
                                                   created_at=t))
        for p in range(producers):
            entry("heartbeats.jsonl", t, ProducerHeartbeat(producer_id=f"p{p}", version=step - 1, pid=1000 + p,
                                                           tokens_generated=step * 900, created_at=t))
        if step % 1000 == 0:
            entry("guard.jsonl", t, GuardAction(step=step, rules=["mismatch_kl"], actions=["warn", "tighten"],
                                                message="mismatch_kl over its bound", created_at=t))
    entry("lifecycle.jsonl", t0 + steps * 2.0, RoleStopped(role="producer", role_id="p0", created_at=t0 + steps * 2))
    for f in [*files.values(), metrics]:
        f.close()
    return {"steps": steps, "samples": num_samples, "tensor_steps": steps // tensor_every,
            "bytes": sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())}


def _write_tensors(run_dir: Path, step: int, groups: list[TrajectoryGroup]) -> None:
    metas = [s for g in groups for s in g.samples]
    B, T = len(metas), max(s.prompt_len + s.response_len for s in metas)
    mask = torch.zeros(B, T, dtype=torch.long)
    rewards = torch.zeros(B, T)
    for i, s in enumerate(metas):
        mask[i, s.prompt_len:s.prompt_len + s.response_len] = 1
        rewards[i, s.prompt_len + s.response_len - 1] = s.reward
    n = len(groups[0].samples)
    path = shard_path(run_dir, step, 0)
    path.parent.mkdir(parents=True)
    group_index = torch.arange(B) // n
    save_file({"input_ids": torch.randint(0, 1000, (B, T)), "attention_mask": torch.ones(B, T, dtype=torch.long),
               "position_ids": torch.arange(T).expand(B, T).contiguous(), "response_mask": mask,
               "rollout_log_probs": -torch.rand(B, T), "versions": torch.full((B, T), step - 1),
               "token_level_rewards": rewards, "group_index": group_index}, str(path),
              metadata={"step": str(step), "rank": "0", "format": "1"})
    # ... and, as the trainer records beside it, the advantages its loss used (the page shows these per token)
    write_advantages(run_dir, "full", step, 0, {"advantages": compute_advantages(rewards, mask.float(), group_index)})


def _get(url: str, token: str) -> float:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()
    return time.perf_counter() - t


def measure_pages(run_dir: Path, steps: int, tensor_every: int, repeats: int) -> tuple[float, dict]:
    """Start `rlbus ui` (cached index) and time each page; returns (start to first answer, per-page times)."""
    token = ui_token(run_dir)
    address = run_dir / "ui" / ADDRESS_FILE
    address.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "rlbus.cli", "ui", str(run_dir), "--hide-token"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        while not address.is_file():
            if proc.poll() is not None or time.perf_counter() - t0 > 120:
                raise RuntimeError("rlbus ui did not start")
            time.sleep(0.01)
        base = address.read_text().strip()
        _get(base + "api/overview", token)
        started = time.perf_counter() - t0
        full_step = tensor_every * (steps // tensor_every // 2)
        sample = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"{base}api/samples?step={full_step}&limit=1", headers={"Authorization": f"Bearer {token}"})).read())
        sid = sample["rows"][0]["id"]
        pages = {
            "overview (all steps)": "api/overview",
            "samples, first page by reward": "api/samples?sort=reward&desc=1&limit=50",
            "samples, last page by reward": "api/samples?sort=reward&desc=1&limit=50&offset=299950",
            "samples, prompt text search": "api/samples?q=17%20%2B%2042&limit=50",
            "samples of one step range": f"api/samples?step={steps // 2}:{steps // 2 + 10}&sort=staleness",
            "one sample, token by token": f"api/sample/{sid}",
            "a group side by side": f"api/group?step={full_step}&gpos=0",
            "producers": "api/producers",
            "two steps compared": f"api/compare?a={steps - 1}&b={steps}",
            "page and plotly.min.js": "static/plotly.min.js",
        }
        out = {}
        for name, path in pages.items():
            times = [_get(base + path, token) for _ in range(repeats)]
            out[name] = {"first_s": times[0], "median_s": statistics.median(times), "max_s": max(times)}
        return started, out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def docs_section(result: dict) -> str:
    """The `## Inspector` section: how long `rlbus ui` takes to open the run, and each page's time."""
    made, o, repeats = result["run"], result["open"], result["repeats"]
    ms = lambda s: f"{s * 1e3:.0f} ms"  # noqa: E731
    pages = "; ".join(f"{name} {ms(v['median_s'])} ({ms(v['first_s'])}, max {ms(v['max_s'])})"
                      for name, v in result["pages"].items())
    return (f"`rlbus ui` on a synthesised run of {made['steps']:,} steps and {made['samples']:,} samples in the "
            f"recorded formats ({made['bytes'] / 1e6:.0f} MB; {made['tensor_steps']} steps with their tensor files, "
            f"the rest recorded as metadata). Command: `{result['command'].strip()}` (commit {result['commit']}, "
            f"{result['date']}).  \n{machine_line(result['machine'])}\n\n"
            f"Opening the run: the index built from the files (first open) {o['first_s']:.2f} s, then cached in "
            f"RUN_DIR/ui ({o['cached_s']:.3f} s every later open); `rlbus ui` started until its first answer "
            f"(cached index) {o['server_first_answer_s']:.2f} s. Each page over HTTP, with the token, median of {repeats} (in brackets: its first request after the "
            f"server started, and the slowest): {pages}.\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--samples-per-step", type=int, default=30)
    p.add_argument("--n", type=int, default=5, help="samples per group")
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--tensor-every", type=int, default=100, help="every k-th step gets its tensor file")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"))
    args = p.parse_args()
    began = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-ui-") as tmp:
        run_dir = Path(tmp) / "run"
        t = time.perf_counter()
        made = synthesise(run_dir, steps=args.steps, per_step=args.samples_per_step, n=args.n,
                          tensor_every=args.tensor_every, producers=args.producers)
        made["synthesis_s"] = time.perf_counter() - t
        index = RunIndex.open(run_dir)  # first open: builds the index
        first_open = time.perf_counter() - t - made["synthesis_s"]
        index.close()
        t = time.perf_counter()
        RunIndex.open(run_dir).close()
        cached_open = time.perf_counter() - t
        started, pages = measure_pages(run_dir, args.steps, args.tensor_every, args.repeats)
    result = {"command": "python bench/inspector.py " + " ".join(sys.argv[1:]), "commit": git_commit(),
              "started": began, "date": date.today().isoformat(), "machine": machine(), "run": made,
              "repeats": args.repeats,
              "open": {"first_s": first_open, "cached_s": cached_open, "server_first_answer_s": started},
              "pages": pages}
    Path(args.results).write_text(json.dumps(result, indent=1))
    body = docs_section(result)
    write_section("## Inspector", body, Path(args.docs))
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
