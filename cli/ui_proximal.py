"""A recorded step's proximal log-probs, recomputed: the policy the step trained from, applied to the step's batch.

    python -m rlbus.cli.ui_proximal RUN_DIR --step K --out RUN_DIR/ui/proximal/step_0000000K.safetensors

The trainer computes proximal log-probs inside its step and keeps only their summary (`mismatch/kl_k1`,
`mismatch/kl_k3`). The inspector asks for them token by token, so this rebuilds the weights of version K - 1 with
`rlbus replay`'s own code (trainer/replay.py: the newest checkpoint before, then the recorded steps up to K - 1 on
the recorded thread count; the base model for K = 1) and runs the trainer's `compute_log_probs` on step K's recorded
batch. Writes `proximal_log_probs` [B, T] (rows and positions as the step's batch, ranks concatenated in rank
order). The inspector starts it as a child process, one at a time, like its replays (cli/ui.py).

Tests: `pytest tests/integration/test_inspector.py`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

#: Where the inspector keeps them: RUN_DIR/ui/proximal/step_<K>.safetensors
FOLDER = "proximal"


def proximal_path(index_dir: Path, step: int) -> Path:
    return index_dir / FOLDER / f"step_{step:08d}.safetensors"


def recompute(run_dir: Path, step: int, out: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    from rlbus.consumers.event_log import RecordError, load_step_batch, read_steps
    from rlbus.trainer.replay import build_engine, replay, replay_config, replay_threads

    records = {r.step: r for r in read_steps(run_dir)}
    if step not in records or records[step].payload != "full":
        raise RecordError(run_dir, f"step {step} has no recorded tensors")
    if step > 1:
        _, engine = replay(run_dir, step - 1, 1)  # the engine after step K - 1: version K - 1, what K trained from
    else:
        cfg = replay_config(run_dir)
        replay_threads(cfg, records[step])
        engine = build_engine(cfg, None)
    with torch.no_grad():
        logp_BT = engine.compute_log_probs(load_step_batch(run_dir, records[step]))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    save_file({"proximal_log_probs": logp_BT.float().cpu().contiguous()}, str(tmp),
              metadata={"step": str(step), "version": str(step - 1)})
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlbus.cli.ui_proximal", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, required=True, help="the recorded step whose proximal log-probs to compute")
    p.add_argument("--out", required=True, help="safetensors file to write")
    args = p.parse_args(argv)
    print(recompute(Path(args.run_dir), args.step, Path(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
