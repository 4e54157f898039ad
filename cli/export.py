"""`rlbus export RUN_DIR/checkpoints/step_N OUT`: a trainer checkpoint as a Hugging Face model directory.

The tokenizer comes from the run's base model (`model.path` in `RUN_DIR/config.yaml`). The result loads with
`AutoModelForCausalLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)` (and by vLLM). A run with
`model.lora` exports the adapter merged into OUT and the adapter alone as a peft directory in OUT/adapter
(`peft.PeftModel.from_pretrained(base, OUT/adapter)`); a run with a critic, the critic in OUT/critic.
"""

from __future__ import annotations

from pathlib import Path

from rlbus.schemas.config_io import load_config
from rlbus.trainer.checkpoint import export_hf, latest_checkpoint


def _run_dir_of(ckpt_dir: Path) -> Path:
    # RUN_DIR/checkpoints/step_N
    return ckpt_dir.resolve().parent.parent


def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, tokenizer_src: str | None = None) -> Path:
    ckpt = Path(ckpt_dir)
    if not ckpt.name.startswith("step_"):  # a checkpoints root: take its latest
        found = latest_checkpoint(ckpt)
        if found is None:
            raise FileNotFoundError(f"{ckpt} holds no checkpoint")
        ckpt = found
    if tokenizer_src is None:
        cfg_path = _run_dir_of(ckpt) / "config.yaml"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{cfg_path} not found: cannot tell which tokenizer the run used")
        tokenizer_src = load_config(cfg_path).model.path
    return export_hf(ckpt, out_dir, tokenizer_src)
