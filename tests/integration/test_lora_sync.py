"""Adapter-only weight sync: a version that holds model.lora's adapter alone, put in the real weight store (local
Ray), brings the HF engine to base + adapter in place, as peft merges it; each version applies to the base, not to
the version before; a producer that joins late gets the same weights; a forged adapter is refused.

    .venv/bin/python -m pytest -q tests/integration/test_lora_sync.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlbus.bus.weight_store import WeightStore
from rlbus.producers.engines.base import SamplingParams
from rlbus.producers.engines.hf import HFEngine
from rlbus.producers.engines.simulated import SimulatedEngine
from rlbus.producers.weight_sync import WeightSync
from rlbus.schemas.config import HFEngineConfig, SimulatedEngineConfig
from rlbus.schemas.errors import WeightsChecksumMismatch
from rlbus.schemas.lora import LoraConfig, weights_encoding
from rlbus.schemas.wire import WeightsPublished
from tests.integration.test_fsdp import build_tiny_qwen2

pytest.importorskip("peft")
torch.set_num_threads(1)

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "up_proj"])
LAYERS = [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "mlp.up_proj")]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_sync"))


def random_adapter(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """An adapter in wire names, both matrices non-zero (a trained one's B has moved from 0)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in LAYERS:
        o, i = base[f"{layer}.weight"].shape
        out[f"{layer}.lora_A.weight"] = torch.randn(LORA.rank, i, generator=g) * 0.1
        out[f"{layer}.lora_B.weight"] = torch.randn(o, LORA.rank, generator=g) * 0.1
    return out


def peft_merged(model_dir: Path, adapter: dict[str, torch.Tensor], tmp: Path) -> dict[str, torch.Tensor]:
    """What peft itself makes of base + adapter (the adapter saved as a peft directory, merged by peft)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlbus.trainer.lora import save_adapter_dir

    d = save_adapter_dir(adapter, LORA, tmp, str(model_dir))
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), d).merge_and_unload().state_dict()


async def publish(ws: WeightStore, version: int, adapter: dict[str, torch.Tensor]) -> WeightsPublished:
    info = await ws.put(version, adapter)
    return WeightsPublished(version=version, step=version, num_bytes=info.num_bytes, checksum=info.checksum,
                            num_tensors=info.num_tensors, **weights_encoding(LORA))  # fmt: skip


async def test_adapter_versions_apply_to_the_base_in_place(tiny_model: Path, tmp_path: Path, ray_config,
                                                           run_name) -> None:
    from transformers import AutoModelForCausalLM

    ws = WeightStore.connect(run_name, ray_config)
    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    adapters = {v: random_adapter(tiny_model, seed=v) for v in (1, 2)}
    announced = {v: await publish(ws, v, a) for v, a in adapters.items()}
    assert announced[1].encoding == "adapter" and announced[1].adapter_scale == LORA.alpha / LORA.rank
    full_bytes = sum(t.numel() * t.element_size() for t in base.values())
    assert announced[1].num_bytes < 0.25 * full_bytes  # rank 4 on a 64-wide model; on SmolLM2 it is ~1%

    engine = HFEngine(str(tiny_model), HFEngineConfig(), seed=0)
    sync = WeightSync(engine, ws, str(tiny_model))
    params = engine.model.state_dict(keep_vars=True)
    before = {k: id(v) for k, v in params.items()}
    for v in (1, 2):
        await sync.load(announced[v])
        assert engine.version == v
        want = peft_merged(tiny_model, adapters[v], tmp_path / f"v{v}")
        live = engine.model.state_dict()
        for name in base:
            if name.removesuffix(".weight") in LAYERS:  # v2 is base + adapter 2, not v1 + adapter 2
                torch.testing.assert_close(live[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
                assert not torch.equal(live[name], base[name])
            else:
                assert torch.equal(live[name], base[name]), name
    # in place: the engine's modules kept their Parameter objects (a swap of their data, between chunks)
    assert {k: id(v) for k, v in engine.model.state_dict(keep_vars=True).items()} == before
    (gen,) = await engine.generate([[2, 3, 4]], SamplingParams(max_new_tokens=4))
    assert gen.versions() == [2] * len(gen.token_ids)

    # A producer that joins late (or restarts) builds from model.path and gets base + adapter of the latest version.
    late = HFEngine(str(tiny_model), HFEngineConfig(), seed=0)
    await WeightSync(late, ws, str(tiny_model)).load(announced[2])
    assert all(torch.equal(late.model.state_dict()[k], t) for k, t in engine.model.state_dict().items())

    # An announcement whose checksum the store's bytes do not have is refused, and the engine keeps what it has.
    forged = WeightsPublished(**{**{f: getattr(announced[1], f) for f in announced[1].__struct_fields__},
                                 "checksum": "0" * 32})  # fmt: skip
    with pytest.raises(WeightsChecksumMismatch):
        await sync.load(forged)
    assert engine.version == 2
    await engine.close()
    await late.close()


async def test_an_engine_that_loads_whole_state_dicts_gets_base_plus_merged(tiny_model: Path, ray_config,
                                                                             run_name) -> None:
    from transformers import AutoModelForCausalLM

    from rlbus.common.lora import merge_adapter

    ws = WeightStore.connect(run_name, ray_config)
    engine = SimulatedEngine(SimulatedEngineConfig())
    assert not engine.loads_partial
    adapter = random_adapter(tiny_model, seed=3)
    whole = WeightSync(engine, ws, str(tiny_model))._merge(adapter, LORA.scale)
    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert set(whole) == set(base) - {"lm_head.weight"}  # tied to the embedding: not in the safetensors
    merged = merge_adapter(base, adapter, LORA.scale)
    assert set(merged) == {f"{layer}.weight" for layer in LAYERS}
    assert all(torch.equal(whole[k], merged.get(k, base[k])) for k in whole)
