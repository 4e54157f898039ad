"""The vLLM engine on the real pretrained model (SmolLM2-135M-Instruct, float32, on CPU): its log-probs are the
trainer's (a teacher-forced transformers forward of the same weights) within SMOLLM2_TOL, and a weight version loaded
in place (every layer: fused q/k/v and gate/up, the tied output head) gives exactly the new weights' log-probs.

    .venv/bin/python -m pytest -q tests/integration/test_vllm_real_model.py
"""

from __future__ import annotations


import pytest
import torch

from rlbus.common.chat import encode_chat
from rlbus.common.model.demos import prompt_messages
from rlbus.producers.engines.base import SamplingParams
from rlbus.schemas.config import VLLMEngineConfig
from tests.support.engines import teacher_forced_logprobs
from tests.support.vllm import require_vllm

pytestmark = pytest.mark.slow

require_vllm()

#: |vLLM - transformers| per sampled token, float32 on CPU, 30 layers (measured here: see the test's print).
SMOLLM2_TOL = 2e-3


def _worst(model, prompts, gens) -> float:
    return max((teacher_forced_logprobs(model, p, g.token_ids) - torch.tensor(g.log_probs)).abs().max().item()
               for p, g in zip(prompts, gens))


async def test_smollm2_logprobs_and_in_place_load_match_transformers(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbus.producers.engines.vllm import VLLMEngine

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [encode_chat(tok, prompt_messages(q), add_generation_prompt=True)
               for q in ("What is 17*23?", "What is 5+38?", "Compute 9*9 and explain.")]
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    engine = VLLMEngine(str(smollm2_dir), VLLMEngineConfig(max_model_len=512, max_num_seqs=8), seed=0)
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=4)
        gens = await engine.generate(prompts, params)
        before = _worst(reference, prompts, gens)
        # A new version: every weight moved a little (an optimizer step's worth), loaded in place.
        torch.manual_seed(0)
        with torch.no_grad():
            for p in reference.parameters():
                p.add_(torch.randn_like(p) * 0.02 * p.abs().mean())
        await engine.load_weights(reference.state_dict(), 1)
        gens = await engine.generate(prompts, params)
        after = _worst(reference, prompts, gens)
        assert all(g.versions() == [1] * len(g.token_ids) for g in gens)
        assert engine.last_load_path == "direct"  # on CPU: every layer repacked straight from the segment
    finally:
        await engine.close()
    print(f"SmolLM2 max |vLLM - transformers| log-prob: {before:.3g} as built, {after:.3g} after an in-place load")
    assert before < SMOLLM2_TOL and after < SMOLLM2_TOL
