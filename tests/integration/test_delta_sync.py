"""Delta weight sync against the real weight stores (local Ray): the trainer's publisher puts a full copy and the
delta, linked by checksums; a producer that holds the delta's base applies it and ends bit for bit on the version; one
that missed a version, joined late, or fetched a corrupt delta loads the full copy instead and says why.

    .venv/bin/python -m pytest -q tests/integration/test_delta_sync.py
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from rlbus.producers.engines.hf import HFEngine
from rlbus.producers.weight_sync import WeightSync, connect_deltas
from rlbus.schemas.config import HFEngineConfig
from rlbus.schemas.config_io import from_dict
from rlbus.trainer.publish import WeightPublisher
from tests.integration.test_fsdp import build_tiny_qwen2

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_delta"))


def versions(model_dir: Path, n: int) -> list[dict[str, torch.Tensor]]:
    """Version 0 (the model) and n more, each moving a few values of a few tensors, as a small bf16 step does."""
    from transformers import AutoModelForCausalLM

    sd = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()}
    out, g = [sd], torch.Generator().manual_seed(0)
    for _ in range(n):
        sd = {k: v.clone() for k, v in sd.items()}
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
            flat = sd[name].view(-1)
            idx = torch.randint(0, flat.numel(), (5,), generator=g)
            flat[idx] += 0.5
        out.append(sd)
    return out


def engine_weights(engine: HFEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


async def test_deltas_chain_and_fall_back_to_full_copies(tiny_model: Path, ray_config, run_name) -> None:
    cfg = from_dict({"name": run_name, "model": {"path": str(tiny_model)},
                     "ray": {**msgspec.structs.asdict(ray_config), "weight_versions_kept": 8},
                     "trainer": {"weight_sync": {"encoding": "delta", "dtype": "bfloat16"}}})  # fmt: skip
    publisher = WeightPublisher(cfg)
    sds = versions(tiny_model, 3)
    msgs = [await publisher.put(v, v, sd) for v, sd in enumerate(sds)]
    assert msgs[0].encoding == "full" and msgs[0].full_checksum == msgs[0].checksum and msgs[0].dtype == "bfloat16"
    for v in (1, 2, 3):
        m = msgs[v]
        assert m.encoding == "delta" and (m.base_version, m.base_checksum) == (v - 1, msgs[v - 1].full_checksum)
        assert m.num_bytes < 0.01 * msgs[0].num_bytes  # 10 values changed of ~30k
    assert publisher.last_delta_density == pytest.approx(10 / sum(t.numel() for t in sds[0].values()), rel=0.5)
    want = {v: {k: t.to(torch.bfloat16).float() for k, t in sd.items()} for v, sd in enumerate(sds)}

    def new_sync() -> tuple[HFEngine, WeightSync]:
        engine = HFEngine(str(tiny_model), HFEngineConfig(), seed=0)
        return engine, WeightSync(engine, publisher.store, str(tiny_model), deltas=connect_deltas(cfg))

    # Up to date: every delta applies, and the engine ends bit for bit on each version.
    engine, sync = new_sync()
    for v in range(4):
        assert await sync.load(msgs[v]) is None
        assert engine.version == v
        assert all(torch.equal(t, want[v][k]) for k, t in engine_weights(engine).items())

    # Late (or restarted): nothing to apply the delta to; the full copy goes in, and the reason says so.
    late, late_sync = new_sync()
    reason = await late_sync.load(msgs[3])
    assert reason is not None and "no weights of this run" in reason
    assert all(torch.equal(t, want[3][k]) for k, t in engine_weights(late).items())

    # Missed a version: its weights are not the delta's base.
    gap, gap_sync = new_sync()
    assert await gap_sync.load(msgs[1]) is not None  # late for v1 too: full copy
    reason = await gap_sync.load(msgs[3])
    assert reason is not None and "holds v1" in reason and "base v2" in reason
    assert all(torch.equal(t, want[3][k]) for k, t in engine_weights(gap).items())
    assert await gap_sync.load(msgs[3]) is not None  # v3 from v3: not its base either; still right

    # A corrupt delta (its bytes do not have the announced checksum): refused, the full copy loaded instead.
    bad, bad_sync = new_sync()
    assert await bad_sync.load(msgs[2]) is not None
    forged = msgspec.structs.replace(msgs[3], checksum="0" * 32)
    reason = await bad_sync.load(forged)
    assert reason is not None and "WeightsChecksumMismatch" in reason
    assert all(torch.equal(t, want[3][k]) for k, t in engine_weights(bad).items())
    for e in (engine, late, gap, bad):
        await e.close()


async def test_the_publisher_takes_the_next_delta_from_its_own_copy(tiny_model: Path, ray_config, run_name) -> None:
    """At world size 1 the trainer hands over its live parameters, which the next step moves in place: the delta
    must still be taken from the version as it was published."""
    cfg = from_dict({"name": run_name, "model": {"path": str(tiny_model)}, "ray": msgspec.structs.asdict(ray_config),
                     "trainer": {"weight_sync": {"encoding": "delta"}}})  # fmt: skip
    publisher = WeightPublisher(cfg)
    live = versions(tiny_model, 0)[0]
    await publisher.put(0, 0, live)
    with torch.no_grad():
        live["model.norm.weight"].add_(1.0)  # an optimizer step, in place
    msg = await publisher.put(1, 1, live)
    assert msg.encoding == "delta" and publisher.last_delta_density == pytest.approx(
        live["model.norm.weight"].numel() / sum(t.numel() for t in live.values()))
