"""model.lora as config (errors name the field) and the adapter's names and merge (pure logic, no model).

    .venv/bin/python -m pytest -q tests/unit/test_lora.py
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbus.common.lora import adapter_layers, merge_adapter
from rlbus.schemas.config_io import from_dict
from rlbus.schemas.errors import ConfigError
from rlbus.schemas.lora import weights_encoding


def run(**lora) -> object:
    return from_dict({"model": {"path": "m", "lora": lora}})


@pytest.mark.parametrize(("lora", "field"), [
    ({"rank": -1}, "model.lora.rank"),
    ({"rank": 8, "alpha": 0}, "model.lora.alpha"),
    ({"rank": 8, "dropout": 1.0}, "model.lora.dropout"),
    ({"rank": 8, "target_modules": []}, "model.lora.target_modules"),
    ({"rank": 8, "target_modules": ["layers.0.q_proj"]}, "model.lora.target_modules"),
    ({"rank": 8, "sync": "delta"}, "model.lora.sync"),
    ({"rnak": 8}, "rnak"),
])  # fmt: skip
def test_bad_lora_settings_name_the_field(lora: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        run(**lora)
    assert field in str(e.value)


def test_lora_with_a_shared_critic_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as e:
        from_dict({"model": {"path": "m", "lora": {"rank": 8}}, "algorithm": {"adv_estimator": "gae"},
                   "critic": {"backbone": "shared"}})  # fmt: skip
    assert "critic.backbone" in str(e.value) and "model.lora" in str(e.value)
    # the separate critic (a model of its own) is fine beside it
    from_dict({"model": {"path": "m", "lora": {"rank": 8}}, "algorithm": {"adv_estimator": "gae"}})


def test_defaults_are_full_fine_tuning_and_the_encoding_follows_sync() -> None:
    off = run()
    assert not off.model.lora.enabled and weights_encoding(off.model.lora) == {"encoding": "full"}
    on = run(rank=8, alpha=32)
    assert on.model.lora.scale == 4.0
    assert weights_encoding(on.model.lora) == {"encoding": "adapter", "adapter_scale": 4.0}
    assert weights_encoding(run(rank=8, sync="merged").model.lora) == {"encoding": "full"}


@settings(max_examples=30, deadline=None)
@given(out=st.integers(1, 9), inp=st.integers(1, 9), rank=st.integers(1, 4), scale=st.floats(0.1, 8.0),
       seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]))  # fmt: skip
def test_merge_is_w_plus_scale_b_a_in_the_base_dtype(out: int, inp: int, rank: int, scale: float, seed: int,
                                                     dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g).to(dtype)
    a, b = torch.randn(rank, inp, generator=g), torch.randn(out, rank, generator=g)
    base = {"x.q_proj.weight": w, "x.norm.weight": torch.ones(inp)}
    adapter = {"x.q_proj.lora_A.weight": a, "x.q_proj.lora_B.weight": b}
    merged = merge_adapter(base, adapter, scale)
    assert list(merged) == ["x.q_proj.weight"] == adapter_layers(adapter)  # only the adapted layer
    assert merged["x.q_proj.weight"].dtype == dtype
    torch.testing.assert_close(merged["x.q_proj.weight"], (w.float() + scale * b @ a).to(dtype))
    assert merge_adapter(base, {**adapter, "x.q_proj.lora_B.weight": torch.zeros(out, rank)}, scale)[
        "x.q_proj.weight"].equal(w)  # B = 0 (step 0) is the base itself  # fmt: skip


def test_trainer_names_become_wire_names() -> None:
    pytest.importorskip("peft")
    from rlbus.trainer.lora import adapter_tensors, merged_state_dict

    w, a, b = torch.ones(3, 2), torch.ones(1, 2), torch.full((3, 1), 0.5)
    state = {"model.layers.0.self_attn.q_proj.base_layer.weight": w,
             "model.layers.0.self_attn.q_proj.base_layer.bias": torch.zeros(3),
             "model.layers.0.self_attn._checkpoint_wrapped_module.q_proj.lora_A.default.weight": a,
             "model.layers.0.self_attn.q_proj.lora_B.default.weight": b,
             "model.embed_tokens.weight": torch.zeros(4, 2)}  # fmt: skip
    assert set(adapter_tensors(state)) == {"model.layers.0.self_attn.q_proj.lora_A.weight",
                                           "model.layers.0.self_attn.q_proj.lora_B.weight"}  # fmt: skip
    merged = merged_state_dict(state, scale=2.0)
    assert set(merged) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                           "model.embed_tokens.weight"}  # fmt: skip
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], torch.full((3, 2), 2.0))


def test_delta_sync_is_for_full_fine_tuning() -> None:
    with pytest.raises(ConfigError) as e:
        from_dict({"model": {"path": "m", "lora": {"rank": 8}}, "trainer": {"weight_sync": {"encoding": "delta"}}})
    assert "trainer.weight_sync.encoding" in str(e.value)
    ok = from_dict({"model": {"path": "m"}, "trainer": {"weight_sync": {"encoding": "delta", "dtype": "bfloat16"}}})
    assert ok.trainer.weight_sync.dtype == "bfloat16"
