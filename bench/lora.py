"""LoRA against full fine-tuning on SmolLM2-135M-Instruct, and what each weight sync costs: bytes per version and
the generation pause per load of a full copy, a delta (float32 and bfloat16) and an adapter.

    flock /tmp/rlbus-heavy.lock .venv/bin/python bench/lora.py --docs docs/benchmarks.md

1. Trainer, one variant per fresh process (FSDP2, one rank, gloo; `--threads` intra-op threads): full fine-tuning
   (lr 4e-5, configs/smollm2_calculator.yaml's) and LoRA on every linear layer at two ranks (lr 4e-4), rank 8
   also with peft's own `Linear` forward in place of trainer/lora_linear.py's (`lora_r8_peft`); the
   batch is bench/critic.py's (4 groups x 8 sequences of up to 160 tokens, seeded by step). Step time and the
   step's peak RSS (the engine's perf/peak_rss_gb), median and range of the steps after one warm-up. The full
   variant also gathers its weights after every step and encodes the delta from the version before
   (common/delta.py) in float32 and in bfloat16: the fraction of values that changed, and the bytes.
2. Sync, in this process against a local Ray: the versions the trainer made go through the real weight store and
   producers/weight_sync.py into an HF engine holding SmolLM2 (`share_weights` on, the default): full (float32),
   delta (float32, bfloat16) and adapter (rank 8). Per load: the bytes the producer fetched, the load's wall time
   (fetch, checksum, apply or merge, load), and the pause (`HFEngine.last_load_pause_s`: generation held for the
   swap); median and range over `--loads` loads, each from one trained version to the other.

Writes bench/results/lora.json and, with --docs, the "## LoRA and weight sync" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, sys.path[0] is bench/: put the repository root there instead, so `bench.common` imports.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from bench.common import git_commit, machine, machine_line, peft_lora_forward, write_section  # noqa: E402
from bench.critic import make_batch  # noqa: E402
from bench.weights import model_dir as smollm2_dir  # noqa: E402
from rlbus.schemas.config import AlgorithmConfig, TrainerConfig  # noqa: E402
from rlbus.schemas.lora import LoraConfig  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "lora.json"
HEADING = "## LoRA and weight sync"
#: name -> (LoRA rank, 0: full fine-tuning; peft's own forward instead of trainer/lora_linear.py's)
VARIANTS = {"full": (0, False), "lora_r8_peft": (8, True), "lora_r8": (8, False), "lora_r32": (32, False)}


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _train(model: str, rank: int, peft_forward: bool, steps: int, threads: int, out_dir: str) -> dict:
    from rlbus.common.delta import encode_delta
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(threads)
    init_distributed("cpu")
    lora = LoraConfig(rank=rank, alpha=2.0 * rank) if rank else LoraConfig()
    trainer = TrainerConfig(micro_batch_size=8, lr=4e-4 if rank else 4e-5, total_steps=steps + 1)
    with peft_lora_forward(peft_forward):
        engine = TrainEngine(model, trainer, AlgorithmConfig(), temperature=1.0, lora_cfg=lora)
    vocab = int(engine.model.config.vocab_size)
    trainable = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    rows, deltas = [], {"float32": [], "bfloat16": []}
    # clones: at world size 1 the gathered tensors are the live parameters, which the next step moves in place
    prev = {k: v.clone() for k, v in engine.full_state_dict().items()} if not rank else None
    for s in range(steps + 1):
        rows.append(engine.train_step(make_batch(vocab, s)))
        if prev is not None:
            cur = {k: v.clone() for k, v in engine.full_state_dict().items()}
            for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                d = encode_delta({k: v.to(dt) for k, v in prev.items()}, {k: v.to(dt) for k, v in cur.items()})
                full = sum(v.numel() * dt.itemsize for v in cur.values())
                deltas[name].append({"density": d.density, "bytes": d.num_bytes, "full_bytes": full})
            if s >= steps - 1:  # the last two versions: the sync part loads one, then the other
                torch.save(cur, f"{out_dir}/full_{s}.pt")
            prev = cur
        elif s >= steps - 1:
            torch.save(engine.adapter_state_dict(), f"{out_dir}/adapter_r{rank}_{s}.pt")
    destroy_distributed()
    measured = rows[1:]
    return {"rank": rank, "trainable_params": trainable, "threads": threads,
            "step_s": spread([r["timing/step_s"] for r in measured]),
            "update_s": spread([r["timing/update_s"] for r in measured]),
            "peak_rss_gb": spread([r["perf/peak_rss_gb"] for r in measured]), "deltas": deltas}  # fmt: skip


async def _sync(model: str, tmp: str, steps: int, loads: int, run: str) -> dict:
    from rlbus.producers.engines.hf import HFEngine
    from rlbus.producers.weight_sync import WeightSync, connect_deltas
    from rlbus.schemas.config import HFEngineConfig
    from rlbus.schemas.config_io import from_dict
    from rlbus.trainer.publish import WeightPublisher

    pair = [torch.load(f"{tmp}/full_{s}.pt", weights_only=True) for s in (steps - 1, steps)]
    adapters = [torch.load(f"{tmp}/adapter_r8_{s}.pt", weights_only=True) for s in (steps - 1, steps)]
    modes = {"full float32": ({}, pair), "delta float32": ({"encoding": "delta"}, pair),
             "delta bfloat16": ({"encoding": "delta", "dtype": "bfloat16"}, pair),
             "adapter r8": (None, adapters)}  # fmt: skip
    out = {}
    for i, (mode, (sync_cfg, versions)) in enumerate(modes.items()):
        name = f"{run}-{i}"
        cfg = from_dict({"name": name, "model": {"path": model, **({"lora": {"rank": 8, "alpha": 16.0}}
                                                                    if sync_cfg is None else {})},
                         "ray": {"weight_versions_kept": 2, "num_cpus": 2},
                         "trainer": {"weight_sync": sync_cfg or {}}})  # fmt: skip
        publisher = WeightPublisher(cfg)
        engine = HFEngine(model, HFEngineConfig(max_batch_size=8), seed=0)
        sync = WeightSync(engine, publisher.store, model, deltas=connect_deltas(cfg))
        rows = []
        for v in range(loads + 1):  # version 0 sets the producer up (a full copy); the others are measured
            msg = await publisher.put(v, v, versions[v % 2])
            t0 = time.perf_counter()
            fallback = await sync.load(msg)
            wall = time.perf_counter() - t0
            assert fallback is None, fallback
            if v:
                rows.append({"bytes": msg.num_bytes, "load_s": wall, "pause_s": engine.last_load_pause_s,
                             "encoding": msg.encoding})  # fmt: skip
        await engine.close()
        out[mode] = {"encoding": rows[0]["encoding"], "bytes": spread([r["bytes"] for r in rows]),
                     "load_s": spread([r["load_s"] for r in rows]), "pause_s": spread([r["pause_s"] for r in rows])}
        from rlbus.bus.ray_store import teardown

        teardown(name, cfg.ray)
    return out


def table(res: dict, command: str) -> list[str]:
    t = res["trainer"]
    full = t["full"]

    def ratio(v: str, k: str) -> str:
        return f"{full[k]['median'] / t[v][k]['median']:.2f}x" if v != "full" else "1.00x"

    lines = [
        f"Model: SmolLM2-135M-Instruct (float32 weights); batch 4 groups x 8 sequences of up to 160 tokens "
        f"(bench/critic.py's, seeded by step), micro-batch 8, one FSDP2 rank, {full['threads']} threads; median "
        f"[min-max] of {full['step_s']['n']} steps after a warm-up, each variant in a fresh process, one after "
        f"the other. LoRA on every linear layer, alpha = 2 x rank; `lora_r8_peft` runs peft's own layer forward, the "
        f"others trainer/lora_linear.py's. Command: `{command}`.  ",
        machine_line(res["machine"]), "",
        "| trainer | trainable params | step s | speed-up vs full | update s | step peak RSS GB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for v, r in t.items():
        s, u, m = r["step_s"], r["update_s"], r["peak_rss_gb"]
        lines.append(f"| {v} | {r['trainable_params']:,} | {s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}] | "
                     f"{ratio(v, 'step_s')} | {u['median']:.2f} | {m['median']:.2f} [{m['min']:.2f}-{m['max']:.2f}] |")
    lines += ["", "Delta density per step of full fine-tuning (values whose bits changed since the version before, "
              "every step; a delta's bytes over a full copy's in brackets): " + "; ".join(
                  f"{dt} {min(d['density'] for d in ds):.3f}-{max(d['density'] for d in ds):.3f} "
                  f"[{min(d['bytes'] / d['full_bytes'] for d in ds):.3f}-"
                  f"{max(d['bytes'] / d['full_bytes'] for d in ds):.3f}]" for dt, ds in full["deltas"].items()) + "."]
    s = res["sync"]
    fb = s["full float32"]["bytes"]["median"]
    lines[-1] += (f" Weight sync into an HF engine (share_weights on), {s['full float32']['load_s']['n']} loads each, "
                  "alternating between the trainer's last two versions; median [min-max]:")
    lines += ["", "| sync | bytes per version | vs full | load wall s | generation paused ms |",
              "|---|---:|---:|---:|---:|"]
    for mode, r in s.items():
        b, ld, p = r["bytes"], r["load_s"], r["pause_s"]
        lines.append(f"| {mode} | {b['median'] / 1e6:.2f} MB | {b['median'] / fb:.4f} | "
                     f"{ld['median']:.3f} [{ld['min']:.3f}-{ld['max']:.3f}] | "
                     f"{1e3 * p['median']:.2f} [{1e3 * p['min']:.2f}-{1e3 * p['max']:.2f}] |")
    return lines


def main() -> None:
    from rlbus.trainer.dist import spawn_local

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per variant (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--loads", type=int, default=4)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--docs", type=Path, default=None)
    ap.add_argument("--model", default="", help="another causal LM directory (a quick check); default SmolLM2")
    args = ap.parse_args()
    model = args.model or str(smollm2_dir())
    command = "python bench/lora.py " + " ".join(sys.argv[1:])
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    with tempfile.TemporaryDirectory() as tmp:
        trainer = {v: spawn_local(1, _train, model, *vp, args.steps, args.threads, tmp)[0]
                   for v, vp in VARIANTS.items()}
        from rlbus.bus.ray_cluster import ensure_ray
        from rlbus.schemas.config import RayConfig

        ensure_ray(RayConfig(num_cpus=2))
        sync = asyncio.run(_sync(model, tmp, args.steps, args.loads, f"bench-lora-{int(time.time())}"))
    res = {"machine": machine(), "command": command, "commit": git_commit(), "started": started,
           "trainer": trainer, "sync": sync}  # fmt: skip
    args.results.write_text(json.dumps(res, indent=2) + "\n")
    lines = table(res, command)
    print("\n".join(lines))
    if args.docs:
        write_section(HEADING, "\n".join(lines) + "\n", args.docs)


if __name__ == "__main__":
    main()
