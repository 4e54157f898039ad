"""End-to-end check of the vLLM rollout engine on one GPU; prints `SKIP: <reason>` and exits 0 without CUDA or vLLM.

What it checks, on the tiny quickstart model (random weights, built here):
1. generate: prompts of different lengths, stop tokens honoured (finish_reason stop/length), one log-prob per token;
2. log-prob agreement: the engine's per-token log-probs vs a teacher-forced Hugging Face forward of the same
   weights in the same dtype on the same GPU (max / mean |diff| printed; bf16 kernels differ, so the bound is loose);
3. load_weights: new weights change greedy output, later generations carry the new version, and their log-probs
   agree with a forward of the new weights.

    python tests/gpu/check_vllm.py [--dtype bfloat16|float16|float32] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

#: |engine - HF| bounds per dtype: (max over tokens, mean over tokens).
TOLERANCE = {"float32": (1e-2, 1e-3), "float16": (0.15, 0.02), "bfloat16": (0.5, 0.08)}


def skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return f"vllm is not installed ({e})"
    return None


def _teacher_forced(model, prompt: list[int], tokens: list[int], temperature: float):
    import torch

    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        logits_TV = model(input_ids=ids).logits[0].float()
    logp_TV = torch.log_softmax(logits_TV / temperature, dim=-1)[len(prompt) - 1 : -1]
    return logp_TV.gather(-1, torch.tensor(tokens, device="cuda").unsqueeze(-1)).squeeze(-1).cpu()


def _agreement(model, prompts, gens, temperature: float) -> tuple[float, float]:
    import torch

    diffs = [
        (_teacher_forced(model, p, g.token_ids, temperature) - torch.tensor(g.log_probs)).abs()
        for p, g in zip(prompts, gens)
        if g.token_ids
    ]
    flat = torch.cat(diffs)
    return flat.max().item(), flat.mean().item()


async def run_checks(model_dir: Path, dtype: str) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbus.producers.engines.base import SamplingParams
    from rlbus.producers.engines.vllm import VLLMEngine
    from rlbus.common.model.demos import prompt_messages
    from rlbus.common.model.tiny import tiny_model
    from rlbus.common.chat import encode_chat
    from rlbus.schemas.config import VLLMEngineConfig

    failures: list[str] = []
    tok = AutoTokenizer.from_pretrained(model_dir)
    torch_dtype = getattr(torch, dtype)
    prompts = [encode_chat(tok, prompt_messages(q), add_generation_prompt=True)
               for q in ["What is 17*23?", "What is 5+38?", "What is 9*9? Show every step, carefully."]]
    prompts.append(prompts[0][:3])
    engine = VLLMEngine(str(model_dir), VLLMEngineConfig(dtype=dtype, gpu_memory_utilization=0.3, enforce_eager=True), version=0)

    # 1. generate + stop tokens
    free = await engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, seed=0))
    for g in free:
        if len(g.token_ids) != 16 or len(g.log_probs) != 16 or g.finish_reason != "length" or g.version != 0:
            failures.append(f"generate without stops: {len(g.token_ids)} tokens, finish {g.finish_reason}, v{g.version}")
    stop_id = free[0].token_ids[2]
    stopped = await engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, seed=0, stop_token_ids=(stop_id,)))
    for g in stopped:
        if stop_id in g.token_ids[:-1]:
            failures.append(f"stop id {stop_id} inside a generation: {g.token_ids}")
        if (g.finish_reason == "stop") != (bool(g.token_ids) and g.token_ids[-1] == stop_id):
            failures.append(f"finish_reason {g.finish_reason} does not match the last token {g.token_ids[-1:]}")
    print(f"generate: ok ({[len(g.token_ids) for g in stopped]} tokens with stop id {stop_id})")

    # 2. log-prob agreement with HF in the same dtype
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).cuda().eval()
    max_tol, mean_tol = TOLERANCE[dtype]
    for temperature in (1.0, 0.7):
        gens = await engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=24, seed=1))
        worst, mean = _agreement(hf, prompts, gens, temperature)
        print(f"log-prob agreement T={temperature} ({dtype}): max |diff| {worst:.3g}, mean {mean:.3g}")
        if worst > max_tol or mean > mean_tol:
            failures.append(f"log-probs differ from HF at T={temperature}: max {worst:.3g} > {max_tol} or mean {mean:.3g} > {mean_tol}")

    # 3. load new weights
    greedy = SamplingParams(temperature=1e-3, max_new_tokens=16)
    before = await engine.generate(prompts, greedy)
    new_model = tiny_model(tok, seed=123)
    await engine.load_weights(new_model.state_dict(), version=5)
    after = await engine.generate(prompts, greedy)
    if engine.version != 5 or any(g.version != 5 for g in after):
        failures.append(f"version after load: engine {engine.version}, generations {[g.version for g in after]}")
    if [g.token_ids for g in after] == [g.token_ids for g in before]:
        failures.append("greedy output unchanged after loading new weights")
    new_hf = new_model.to(device="cuda", dtype=torch_dtype).eval()
    sampled = await engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=24, seed=2))
    worst, mean = _agreement(new_hf, prompts, sampled, 1.0)
    print(f"after load_weights: log-prob agreement with the new weights: max |diff| {worst:.3g}, mean {mean:.3g}")
    if worst > max_tol or mean > mean_tol:
        failures.append(f"after load_weights log-probs are not the new model's: max {worst:.3g}, mean {mean:.3g}")
    await engine.close()
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(TOLERANCE))
    ap.add_argument("--keep", default="", help="build the model here instead of a temporary directory")
    args = ap.parse_args(argv)
    reason = skip_reason()
    if reason:
        print(f"SKIP: {reason}")
        return 0
    from rlbus.common.model.init_model import init_model
    from rlbus.common.model.tiny import TinyModelSpec

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.keep) if args.keep else Path(tmp) / "tiny"
        if not (model_dir / "config.json").is_file():
            # Heads 32 wide, as on CPU: attention kernels take 32 and up everywhere, 16 not everywhere.
            init_model(model_dir, steps=0, force=True, spec=TinyModelSpec.with_head_dim(32))
        failures = asyncio.run(run_checks(model_dir, args.dtype))
    for f in failures:
        print(f"FAIL: {f}")
    print("vllm engine check:", "FAILED" if failures else "PASSED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
