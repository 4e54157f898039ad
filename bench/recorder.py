"""The recorder's cost: a training step with logging.record=full against off, same engine, same batches.

    .venv/bin/python bench/recorder.py [--layers 2 --hidden 256 --vocab 4096 --groups 4 --n 4 --seq 256 --rounds 6]

Each round trains the same step twice, alternating the order: once as the trainer does with record=off (collate,
train_step), once with record=full (collate, write_shard, train_step, the step record) -- so load on a shared
machine hits both sides alike. Reports the median step time of each, the recorder's own time, and the bytes a step
adds to the run directory (tensors and step record). Prints a table; writes bench/results/recorder.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, sys.path[0] is bench/: put the repository root there instead, so `bench.common` imports.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from rlbus.consumers.collate import collate  # noqa: E402
from rlbus.consumers.event_log import events_dir  # noqa: E402
from rlbus.consumers.recorder import Recorder, write_shard  # noqa: E402
from rlbus.schemas.config import AlgorithmConfig, TrainerConfig  # noqa: E402
from rlbus.schemas.wire import SampleMeta, TrajectoryGroup  # noqa: E402
from rlbus.trainer.engine import TrainEngine  # noqa: E402

from bench.common import machine, tiny_qwen2  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "recorder.json"


def make_step(step: int, *, groups: int, n: int, seq: int, vocab: int) -> tuple[list[TrajectoryGroup], dict]:
    g = torch.Generator().manual_seed(step)
    out, stored = [], {}
    for gi in range(groups):
        samples = []
        for si in range(n):
            P = 32
            R = int(torch.randint(seq // 2 - P, seq - P + 1, (1,), generator=g))
            key = f"g{step}-{gi}/{si}"
            mask = torch.ones(R, dtype=torch.long)
            mask[R // 3:R // 3 + 8] = 0  # a tool output span
            stored[key] = {"prompt_ids": torch.randint(0, vocab, (P,), generator=g),
                           "response_ids": torch.randint(0, vocab, (R,), generator=g), "response_mask": mask,
                           "rollout_log_probs": -torch.rand(R, generator=g) - 1.0,
                           "versions": torch.zeros(R, dtype=torch.long)}  # fmt: skip
            samples.append(SampleMeta(key=key, prompt_len=P, response_len=R, reward=float(si % 2)))
        out.append(TrajectoryGroup(group_id=f"g{step}-{gi}", task_id=f"g{step}-{gi}", producer_id="p0",
                                   samples=samples))
    return out, stored


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--groups", type=int, default=4, help="groups per step")
    ap.add_argument("--n", type=int, default=4, help="samples per group")
    ap.add_argument("--seq", type=int, default=256, help="longest prompt + response")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny_qwen2(root / "model", layers=args.layers, hidden=args.hidden, vocab=args.vocab)
        tcfg = TrainerConfig(micro_batch_size=8, lr=1e-6)
        engine = TrainEngine(str(root / "model"), tcfg, AlgorithmConfig(), temperature=1.0)
        run_dir = root / "run"
        recorder = Recorder(run_dir, "full")
        steps = [make_step(s, groups=args.groups, n=args.n, seq=args.seq, vocab=args.vocab) for s in range(2)]

        def one(step: int, mode: str) -> tuple[float, float]:
            groups, stored = steps[step % 2]
            shard = [(s, gi) for gi, g in enumerate(groups) for s in g.samples]
            t0 = time.perf_counter()
            batch = collate([(m, stored[m.key]) for m, _ in shard], [gi for _, gi in shard])
            t_rec = time.perf_counter()
            write_shard(run_dir, mode, step, 0, batch)
            rec_s = time.perf_counter() - t_rec
            metrics = engine.train_step(batch)
            if mode == "full":
                t_rec = time.perf_counter()
                recorder.step(step=step, version=step, groups=groups, shards=[shard], metrics=metrics)
                rec_s += time.perf_counter() - t_rec
            return time.perf_counter() - t0, rec_s

        one(0, "off")  # warm-up
        times: dict[str, list[float]] = {"off": [], "full": []}
        rec_times: list[float] = []
        step = 1
        for r in range(args.rounds):
            for mode in (("off", "full") if r % 2 == 0 else ("full", "off")):
                total, rec = one(step, mode)
                times[mode].append(total)
                if mode == "full":
                    rec_times.append(rec)
                step += 1
        shard_files = sorted((events_dir(run_dir) / "steps").glob("step_*/rank_0.safetensors"))
        tensor_bytes = statistics.median(p.stat().st_size for p in shard_files)
        record_lines = (events_dir(run_dir) / "steps.jsonl").read_bytes().splitlines()
        record_bytes = statistics.median(len(ln) + 1 for ln in record_lines)
        tokens = sum(s.prompt_len + s.response_len for g in steps[0][0] for s in g.samples)

    off, full, rec = (statistics.median(times["off"]), statistics.median(times["full"]),
                      statistics.median(rec_times))  # fmt: skip
    result = {
        "config": vars(args),
        "batch": {"sequences": args.groups * args.n, "tokens": tokens},
        "step_s": {"off": off, "full": full, "off_all": times["off"], "full_all": times["full"]},
        "recorder_s": rec,
        "overhead_frac": rec / off,
        "bytes_per_step": {"tensors": tensor_bytes, "step_record": record_bytes, "total": tensor_bytes + record_bytes},
        "bytes_per_token": (tensor_bytes + record_bytes) / tokens,
        "machine": machine(threads=torch.get_num_threads()),
    }
    table = Table(title=f"recorder cost: {args.groups}x{args.n} sequences, {tokens} tokens per step")
    for col in ("record", "step s (median)", "recorder s (median)", "bytes / step"):
        table.add_column(col, justify="right")
    table.add_row("off", f"{off:.3f}", "-", "0")
    table.add_row("metadata", "-", "-", f"{record_bytes:,.0f}")
    table.add_row("full", f"{full:.3f}", f"{rec:.4f} ({100 * rec / off:.1f}% of a step)",
                  f"{tensor_bytes + record_bytes:,.0f}")
    console.print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    console.print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
