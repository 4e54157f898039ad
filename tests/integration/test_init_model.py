"""`rlbus init-model` writes a standard Hugging Face directory that AutoModelForCausalLM / AutoTokenizer load, and
a few warm-start steps already lower the demonstration loss. (The full warm start and its tool-use evaluation are
measured by `python -m rlbus.common.model.init_model DIR --eval`, not here: too slow for a test.)

    .venv/bin/python -m pytest -q tests/integration/test_init_model.py
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlbus.common.model.demos import demonstration
from rlbus.common.model.init_model import init_model, main
from rlbus.common.chat import encode_chat
from rlbus.common.model.tokenizer import IM_END
from rlbus.common.model.warm_start import WarmStartConfig, demo_batch, encode_demonstration, warm_start


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_init_model_writes_a_loadable_hf_directory(tmp_path):
    out = init_model(tmp_path / "m", seed=3, steps=2, warm=WarmStartConfig(batch_size=4, log_every=0), log=lambda _: None)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    report = json.loads((out / "warm_start.json").read_text())
    assert report["warm_start"]["steps"] == 2 and report["seconds"] > 0 and report["num_parameters"] < 2_000_000

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert model.config.vocab_size >= len(tok) and model.config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids(IM_END)
    ids = encode_chat(tok, [{"role": "user", "content": "What is 17*23?"}], add_generation_prompt=True)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()

    # Same seed -> same weights (the build is deterministic).
    again = init_model(tmp_path / "m2", seed=3, steps=2, warm=WarmStartConfig(batch_size=4, log_every=0), log=lambda _: None)
    other = AutoModelForCausalLM.from_pretrained(again)
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name


def test_cli_refuses_to_overwrite_without_force(tmp_path, capsys):
    target = tmp_path / "m"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    assert main([str(target), "--steps", "0"]) == 2
    assert "exists" in capsys.readouterr().err
    assert (target / "keep.txt").exists()
    assert main([str(target), "--steps", "0", "--force"]) == 0
    assert (target / "config.json").is_file() and not (target / "keep.txt").exists()


def test_loss_mask_covers_exactly_the_assistant_output():
    from rlbus.common.model.tokenizer import build_tokenizer

    tok = build_tokenizer()
    conv = demonstration("What is 17*23?", "391", use_tool=True)
    ids, mask = encode_demonstration(tok, conv)
    supervised = tok.decode([i for i, m in zip(ids, mask) if m])
    assert supervised == (conv[2]["content"] + IM_END) + (conv[4]["content"] + IM_END)
    # The segmented encoding equals the plain chat-template encoding up to the final newline the loop adds.
    assert ids == encode_chat(tok, conv)[:-1]


def test_a_few_warm_start_steps_lower_the_loss():
    from rlbus.common.model.tiny import tiny_model
    from rlbus.common.model.tokenizer import build_tokenizer

    tok = build_tokenizer()
    model = tiny_model(tok, seed=0)
    batch = demo_batch(tok, random.Random(99), 16, 0.5)

    def loss() -> float:
        ids, attn, labels = batch
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attn).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)).item()

    before = loss()
    warm_start(model, tok, WarmStartConfig(steps=30, batch_size=16, warmup_steps=5, log_every=0), log=lambda _: None)
    after = loss()
    assert after < 0.6 * before, f"held-out demonstration loss {before:.3f} -> {after:.3f}"
