"""What the Tinker path costs per call: a forward_backward's wall time at the client minus the service's compute.

    .venv/bin/python bench/tinker_cost.py [--calls 60] [--batch 32] [--seq-len 128] [--docs docs/benchmarks.md]

`rlbus tinker` serves the shipped tiny model (one torch thread) in its own process, at DEBUG, where it logs each
forward_backward's compute time (the model's forward and backward, timed in the worker thread that runs them). This
process is the client: the unmodified `tinker` SDK (0.38.0) sends `forward_backward(data, "cross_entropy")` and
waits for its result, one call at a time, `--calls` times after 5 warm-up calls, on a batch sized so that the compute
is about 0.1 s. Per call, overhead = client wall time - service compute: the SDK's request building and protobuf
encoding, the HTTP round trip of the request, the service's decoding, its seq_id queue and the hand-off to a worker
thread, the result's protobuf encoding, the long-poll `retrieve_future` that brings it back, and the SDK's decoding.
An `optim_step` after each (learning rate 0: the same work every call) is timed the
same way: a call with little compute. Medians, with the 10th and 90th percentiles; results in bench/results/
tinker_cost.json and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

from bench.common import git_commit, machine, machine_line, write_section

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "tinker_cost.json"
HEADING = "## The Tinker path's cost per call"
KEY = "tml-bench-key-0123456789abcdef"
WARMUP = 5
COMPUTE = re.compile(r"tinker: (\S+) (forward_backward|optim_step) seq (\d+) compute_s=([0-9.]+)")


def serve(tmp: Path) -> tuple[subprocess.Popen, str, Path]:
    from rlbus.common.model.ensure import SHIPPED

    keys = tmp / "keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o600)
    cfg = tmp / "tinker.yaml"
    cfg.write_text(json.dumps({"name": "tinkercost", "model": {"path": str(SHIPPED / "tiny-calculator")},
                               "logging": {"run_dir": str(tmp / "run"), "level": "DEBUG"},
                               "tinker": {"keys_file": str(keys), "torch_threads": 1}}))  # fmt: skip
    log = tmp / "tinker.log"
    proc = subprocess.Popen([sys.executable, "-m", "rlbus.cli", "tinker", str(cfg)], cwd=ROOT,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url_file = tmp / "run" / "tinker.url"
    deadline = time.monotonic() + 120
    while not url_file.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"rlbus tinker did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, url_file.read_text().strip(), log


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else xs[0]


def summary(xs_s: list[float]) -> dict[str, float]:
    ms = [x * 1e3 for x in xs_s]
    return {"median_ms": round(statistics.median(ms), 2), "p10_ms": round(pct(ms, 10), 2),
            "p90_ms": round(pct(ms, 90), 2)}  # fmt: skip


def measure(url: str, log: Path, calls: int, batch: int, seq_len: int) -> dict[str, Any]:
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key=KEY)
    base = tinker.RestClient(base_url=url, api_key=KEY).get_server_capabilities().result().supported_models[0]
    tc = sc.create_lora_training_client(base_model=base.model_name, rank=8, seed=0).result()
    ids = [(7 * i) % 300 + 3 for i in range(seq_len + 1)]
    data = [types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * seq_len})] * batch  # fmt: skip
    fb_wall, step_wall = [], []
    for i in range(WARMUP + calls):
        t0 = time.perf_counter()
        tc.forward_backward(data, "cross_entropy").result()
        t1 = time.perf_counter()
        tc.optim_step(types.AdamParams(learning_rate=0.0)).result()  # moves nothing: every call the same work
        t2 = time.perf_counter()
        if i >= WARMUP:
            fb_wall.append(t1 - t0)
            step_wall.append(t2 - t1)
    sc.close("success").result()
    time.sleep(0.5)  # the last log lines
    logged = [m for m in COMPUTE.finditer(log.read_text()) if m[1] == tc.model_id]
    compute = {kind: [float(m[4]) for m in logged if m[2] == kind][WARMUP:] for kind in ("forward_backward",
                                                                                          "optim_step")}
    assert all(len(c) == calls for c in compute.values()), f"compute times logged for {calls} calls: {compute}"
    return {"calls": calls, "batch": batch, "seq_len": seq_len, "forward_backward_wall": summary(fb_wall),
            "forward_backward_compute": summary(compute["forward_backward"]),
            "forward_backward_overhead": summary([w - c for w, c in zip(fb_wall, compute["forward_backward"])]),
            "optim_step_wall": summary(step_wall), "optim_step_compute": summary(compute["optim_step"]),
            "optim_step_overhead": summary([w - c for w, c in zip(step_wall, compute["optim_step"])])}


def section(r: dict[str, Any]) -> str:
    fb, c, o = (r[f"forward_backward_{k}"] for k in ("wall", "compute", "overhead"))
    s, sc, so = (r[f"optim_step_{k}"] for k in ("wall", "compute", "overhead"))
    return f"""{HEADING}

`rlbus tinker` on the shipped tiny model (one torch thread), driven by the unmodified `tinker` SDK 0.38.0 from
another process on the same machine, one call at a time: `forward_backward(cross_entropy)` on {r['batch']} rows of
{r['seq_len']} tokens, {r['calls']} calls after {WARMUP} warm-up calls (medians, 10th-90th percentile).

| | median | p10-p90 |
|---|---|---|
| forward_backward, wall at the client | {fb['median_ms']} ms | {fb['p10_ms']}-{fb['p90_ms']} ms |
| its compute in the service (forward + backward) | {c['median_ms']} ms | {c['p10_ms']}-{c['p90_ms']} ms |
| the Tinker path per call (wall - compute, per call) | {o['median_ms']} ms | {o['p10_ms']}-{o['p90_ms']} ms |
| optim_step, wall at the client | {s['median_ms']} ms | {s['p10_ms']}-{s['p90_ms']} ms |
| its compute in the service (AdamW on the adapter) | {sc['median_ms']} ms | {sc['p10_ms']}-{sc['p90_ms']} ms |
| the Tinker path per call (wall - compute, per call) | {so['median_ms']} ms | {so['p10_ms']}-{so['p90_ms']} ms |

The path: the SDK's request and its protobuf, HTTP over loopback, the service's decoding, its seq_id queue and hand-off
to a worker thread, the result's protobuf, the long-poll `retrieve_future` that returns it, the SDK's decoding.

    .venv/bin/python bench/tinker_cost.py --calls {r['calls']} --batch {r['batch']} --seq-len {r['seq_len']}

{machine_line(r['machine'])} Commit {r['commit']}; bench/results/tinker_cost.json.
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=60, help="timed calls (after 5 warm-up calls)")
    ap.add_argument("--batch", type=int, default=32, help="rows per forward_backward")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per row")
    ap.add_argument("--docs", type=Path, default=None, help="write the section into this page (docs/benchmarks.md)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tinker-cost-") as tmp:
        proc, url, log = serve(Path(tmp))
        try:
            r = measure(url, log, args.calls, args.batch, args.seq_len)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    r = {"commit": git_commit(), "machine": machine(), **r}
    RESULTS.write_text(json.dumps(r, indent=2) + "\n")
    print(json.dumps({k: v for k, v in r.items() if k != "machine"}, indent=1))
    if args.docs:
        write_section(HEADING, section(r), args.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
