"""tinker-cookbook 0.6.1's RL and SFT recipes, unmodified, against `rlbus tinker` on SmolLM2-135M-Instruct, offline.

    .venv/bin/python bench/tinker_cookbook.py --setup       # once: .bench/cookbook-venv (the cookbook and its deps)
    .venv/bin/python bench/tinker_cookbook.py [--steps 3]   # serve, run the recipes; bench/results/tinker_cookbook.json

The recipes, each a `python -m` of the cookbook's own module with its own command-line config (docs/tinker.md,
"tinker-cookbook's recipes", says why each setting is there):

- RL: `tinker_cookbook.recipes.math_rl.train` (the cookbook's RL loop, `tinker_cookbook.rl.train`) on its
  `arithmetic` environment, which makes its problems locally; synchronous, then asynchronous
  (`max_steps_off_policy=1`: sampling runs a step ahead of training).
- SFT: `tinker_cookbook.recipes.chat_sl.train` (the cookbook's supervised loop, `tinker_cookbook.supervised.train`)
  on the conversations file the cookbook ships (`example_data/conversations.jsonl`).

Why a venv of its own, and why this one: tinker-cookbook 0.6.1 requires `tml-renderers>=0.4.1`, which the package
registry does not have (0.2.1 is its newest), so pip cannot install the cookbook with its dependencies anywhere. The
cookbook imports tml-renderers only for Thinking Machines' own model families (Inkling, Kimi K3), so the venv gets
the cookbook with `--no-deps` and every other dependency it declares; rlbus's .venv stays as it is. The venv reads
rlbus's .venv site-packages after its own (a .pth line), so torch, transformers, numpy and tinker are the very
versions rlbus runs (torch 2.13.0, transformers 5.19, tinker 0.38.0), not a second copy.

The service is `rlbus tinker configs/tinker_smollm2.yaml` (its run directory under .bench/cookbook-run), one
process, started here and stopped by its pid. Per recipe: its exit status, the steps it logged, seconds per step (its
own `time/total`) and its reward or loss per step, from the metrics.jsonl it writes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

from bench.common import git_commit, machine, shown

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".bench" / "cookbook-venv"
VENV_PY = VENV / "bin" / "python"
RUN_DIR = ROOT / ".bench" / "cookbook-run"
RESULTS = ROOT / "bench" / "results" / "tinker_cookbook.json"
CONFIG = "configs/tinker_smollm2.yaml"
COOKBOOK_PIN = "tinker-cookbook==0.6.1"
#: tinker-cookbook 0.6.1's declared dependencies, less tml-renderers (above) and those rlbus's .venv already has.
COOKBOOK_DEPS = ["chz>=0.4.0", "blobfile>=3.0.0", "datasets>=2.14.0", "pyrage>=1.4.0",
                 "math-verify>=0.5.0", "pylatexenc>=2.0", "sympy>=1.12.0"]  # the last three: its math-rl extra
RENDERER = "qwen3_instruct"  # ChatML without a thinking block: SmolLM2's chat template token for token
START_TIMEOUT_S = 120.0


def setup() -> None:
    if not VENV_PY.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    site = Path(subprocess.run([str(VENV_PY), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())  # fmt: skip
    (site / "zz_rlbus_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after the venv's own
    pip = [str(VENV_PY), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, *COOKBOOK_DEPS], check=True)
    subprocess.run([*pip, "--no-deps", COOKBOOK_PIN], check=True)
    subprocess.run([str(VENV_PY), "-c", "import tinker_cookbook.recipes.math_rl.train, "
                    "tinker_cookbook.recipes.chat_sl.train"], check=True)  # fmt: skip


def serve() -> tuple[subprocess.Popen, str, str]:
    """`rlbus tinker` on SmolLM2 (a free port); its process, URL and first API key."""
    url_file = RUN_DIR / "tinker.url"
    url_file.unlink(missing_ok=True)
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    log = open(RUN_DIR / "tinker.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "rlbus.cli", "tinker", CONFIG, f"logging.run_dir={RUN_DIR}"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not url_file.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"rlbus tinker did not start; see {RUN_DIR / 'tinker.log'}")
        time.sleep(0.5)
    keys = (RUN_DIR / "creds" / "tinker_keys").read_text().splitlines()
    return proc, url_file.read_text().strip(), next(k for k in keys if k.startswith("tml-"))


def recipes(url: str, steps: int) -> dict[str, list[str]]:
    """Each recipe's command line: the recipe's module and its own config keys."""
    model = str((ROOT / ".rlbus" / "models" / "smollm2-135m-instruct").resolve())
    common = [f"base_url={url}", f"model_name={model}", f"renderer_name={RENDERER}", f"max_steps={steps}",
              "eval_every=0", "save_every=0", "behavior_if_log_dir_exists=delete"]
    rl = ["-m", "tinker_cookbook.recipes.math_rl.train", *common, "env=arithmetic", "loss_fn=importance_sampling",
          "group_size=4", "groups_per_batch=4"]
    conversations = (VENV / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages" /
                     "tinker_cookbook" / "example_data" / "conversations.jsonl")  # fmt: skip
    sl = ["-m", "tinker_cookbook.recipes.chat_sl.train", *common, f"dataset={conversations}", "batch_size=16"]
    return {"rl": [*rl, f"log_path={RUN_DIR / 'rl'}"],
            "rl_async": [*rl, "max_steps_off_policy=1", f"log_path={RUN_DIR / 'rl_async'}"],
            "sl": [*sl, f"log_path={RUN_DIR / 'sl'}"]}


def _shown_arg(arg: str) -> str:
    key, sep, value = arg.partition("=")
    keep = key == "model_name"  # absolute: the name the service serves its base under
    return f"{key}={shown(Path(value))}" if sep and value.startswith("/") and not keep else arg


def run_recipe(name: str, argv: list[str], key: str, timeout_s: float) -> dict[str, Any]:
    # Offline: nothing may reach the Hub (the tokenizer is the model's directory; the data are local files).
    env = dict(os.environ, TINKER_API_KEY=key, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    t0 = time.monotonic()
    with open(RUN_DIR / f"{name}.log", "wb") as log:
        rc = subprocess.run([str(VENV_PY), *argv], cwd=RUN_DIR, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=timeout_s, check=False).returncode  # fmt: skip
    wall = time.monotonic() - t0
    metrics_file = RUN_DIR / name / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.is_file() else []
    timer = "time/total" if name.startswith("rl") else "time/step"  # what each loop calls a step's wall time
    rows = [r for r in rows if timer in r]  # the steps (a last row sums the run up)
    step_s = [r[timer] for r in rows]
    score = "env/all/reward/total" if name.startswith("rl") else "train_mean_nll"
    out = {"command": " ".join([".bench/cookbook-venv/bin/python", *map(_shown_arg, argv)]),
           "exit": rc, "wall_s": round(wall, 1), "steps": len(rows), "step_s": [round(s, 2) for s in step_s],
           score: [round(r[score], 4) for r in rows if score in r]}  # fmt: skip
    if name.startswith("rl"):  # the sampler's log-probs against the trainer's: 0 on-policy, > 0 a step behind
        out["kl_sample_train"] = [round(r.get("optim/kl_sample_train_v1", float("nan")), 5) for r in rows]
    if name == "rl_async":
        out["staleness_mean"] = [r.get("async/staleness_mean") for r in rows]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setup", action="store_true", help="make .bench/cookbook-venv, then exit")
    ap.add_argument("--steps", type=int, default=3, help="steps of each recipe")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds each recipe may take")
    args = ap.parse_args()
    if args.setup:
        setup()
        return 0
    if not VENV_PY.exists():
        sys.exit("no .bench/cookbook-venv: run with --setup first")
    proc, url, key = serve()
    try:
        results = {name: run_recipe(name, argv, key, args.timeout) for name, argv in recipes(url, args.steps).items()}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    report = {"commit": git_commit(), "machine": machine(), "service": f"rlbus tinker {CONFIG}", "renderer": RENDERER,
              "cookbook": COOKBOOK_PIN, "recipes": results}  # fmt: skip
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    for name, r in results.items():
        print(f"{name}: exit {r['exit']}, {r['steps']} steps, s/step {r['step_s']}")
    return 0 if all(r["exit"] == 0 and r["steps"] == args.steps for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
