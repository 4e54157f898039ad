"""LoRA on real FSDP2 (gloo, locally spawned ranks): two ranks == one, only the adapter trains, the merge is peft's,
checkpoints resume exactly, and `export_hf` writes a merged model and a peft adapter directory.

    .venv/bin/python -m pytest -q tests/integration/test_lora.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rlbus.schemas.config import AlgorithmConfig, TrainerConfig
from rlbus.schemas.lora import LoraConfig
from tests.integration.test_fsdp import build_tiny_qwen2, make_batch, rank_share

pytest.importorskip("peft")

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
TRAINER = TrainerConfig(micro_batch_size=3, lr=1e-2, grad_clip=1.0, lr_schedule="cosine", warmup_steps=1,
                        total_steps=6, keep_checkpoints=2)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_lora"))


def _engine(model_dir: str, lora_cfg: LoraConfig = LORA):
    from rlbus.trainer.engine import TrainEngine

    return TrainEngine(model_dir, TRAINER, AlgorithmConfig(), temperature=0.9, lora_cfg=lora_cfg)


def _train_worker(model_dir: str, steps: int) -> dict:
    from rlbus.trainer.dist import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    info = init_distributed("cpu")
    engine = _engine(model_dir)
    trainable = sorted(n for n, p in engine.model.named_parameters() if p.requires_grad)
    metrics = [engine.train_step(rank_share(make_batch(seed=s), info.rank, info.world_size)) for s in range(steps)]
    out = {"metrics": metrics, "merged": engine.full_state_dict(), "adapter": engine.adapter_state_dict(),
           "trainable": trainable}  # fmt: skip
    destroy_distributed()
    return out


def test_lora_trains_the_adapter_alone_and_two_ranks_equal_one(tiny_model: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlbus.trainer.dist import spawn_local
    from rlbus.trainer.lora import save_adapter_dir

    torch.set_num_threads(1)
    one = spawn_local(1, _train_worker, str(tiny_model), 2)[0]
    two = spawn_local(2, _train_worker, str(tiny_model), 2)
    assert two[1]["merged"] == {} and two[1]["adapter"] == {}  # gathered on rank 0 only
    assert all(".lora_A." in n or ".lora_B." in n for n in one["trainable"])
    assert len(one["trainable"]) == 2 * 3 * 2  # 2 layers x 3 target modules x (A, B)
    for a, b in zip(one["metrics"], two[0]["metrics"]):
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], rel=1e-4, abs=1e-7)
    for name, w in one["adapter"].items():
        torch.testing.assert_close(two[0]["adapter"][name], w, rtol=1e-3, atol=1e-6, msg=name)

    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    merged = one["merged"]
    assert set(merged) == set(base)  # the plain model's names: producers and exports load it as is
    moved = {n for n in base if not torch.equal(merged[n], base[n])}
    assert moved == {f"model.layers.{i}.{m}.weight" for i in range(2)
                     for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}  # fmt: skip
    assert all(one["adapter"][n].abs().max() > 0 for n in one["adapter"])  # B left zero, A moved

    # Our merge is peft's: the adapter saved as a peft directory, loaded onto the base and merged by peft.
    adapter_dir = save_adapter_dir(one["adapter"], LORA, tmp_path / "adapter", str(tiny_model))
    peft_merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model),
                                            adapter_dir).merge_and_unload().state_dict()  # fmt: skip
    for name in moved:
        torch.testing.assert_close(merged[name], peft_merged[name], rtol=1e-5, atol=1e-6, msg=name)


def _ckpt_worker(model_dir: str, root: str, other_base: str) -> dict:
    from rlbus.trainer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.optim import train_state

    torch.set_num_threads(1)
    info = init_distributed("cpu")
    share = lambda s: rank_share(make_batch(seed=s), info.rank, info.world_size)  # noqa: E731
    engine = _engine(model_dir)
    for step in (1, 2):
        engine.train_step(share(step))
    save_checkpoint(engine, root, 2, {"step": 2}, keep=2)
    # As LoRA checkpoints were written before they left the base out: every weight in the shards.
    engine.state_dict = lambda: train_state(engine.model, engine.optimizer, engine.scheduler, engine.num_updates)
    save_checkpoint(engine, root + "-whole", 2, {"step": 2}, keep=2)
    del engine.state_dict
    after_save = engine.full_state_dict()
    continued = engine.train_step(share(10))
    continued_adapter = engine.adapter_state_dict()

    whole = _engine(model_dir)
    load_checkpoint(whole, root + "-whole")
    restored_whole = whole.full_state_dict()
    fresh = _engine(model_dir)
    load_checkpoint(fresh, root)
    restored = fresh.full_state_dict()
    resumed = fresh.train_step(share(10))
    resumed_adapter = fresh.adapter_state_dict()

    refusals = []
    for other in (LoraConfig(rank=8, alpha=8.0, target_modules=LORA.target_modules), LoraConfig()):
        try:
            load_checkpoint(_engine(model_dir, other), root)
        except CheckpointError as e:
            refusals.append(str(e))
    try:  # the checkpoint holds the adapter alone: a resume on other base weights is refused, not silently wrong
        load_checkpoint(_engine(other_base), root)
    except CheckpointError as e:
        refusals.append(str(e))
    destroy_distributed()
    return {"after_save": after_save, "restored": restored, "restored_whole": restored_whole, "continued": continued,
            "resumed": resumed,
            "continued_adapter": continued_adapter, "resumed_adapter": resumed_adapter, "refusals": refusals}


def test_lora_checkpoint_resumes_exactly_and_exports_merged_and_adapter(tiny_model: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlbus.trainer.checkpoint import CheckpointError, _read_metadata, export_hf, latest_checkpoint
    from rlbus.trainer.dist import spawn_local

    torch.set_num_threads(1)
    root = tmp_path / "ckpt"
    other_base = tmp_path / "other-base"
    shutil.copytree(tiny_model, other_base)
    changed = AutoModelForCausalLM.from_pretrained(other_base)
    with torch.no_grad():
        changed.model.layers[1].mlp.up_proj.weight[0, 0] += 1e-3  # a layer the adapter does not touch
    changed.save_pretrained(other_base)
    out = spawn_local(2, _ckpt_worker, str(tiny_model), str(root), str(other_base))[0]
    for name, w in out["after_save"].items():
        assert torch.equal(out["restored"][name], w), name
        assert torch.equal(out["restored_whole"][name], w), name  # a checkpoint that holds the base resumes too
    assert out["resumed"]["actor/pg_loss"] == out["continued"]["actor/pg_loss"]
    assert out["resumed"]["actor/lr"] == out["continued"]["actor/lr"]
    for name, w in out["continued_adapter"].items():  # the adapter's AdamW moments came back too
        assert torch.equal(out["resumed_adapter"][name], w), name
    rank_msg, full_msg, base_msg = out["refusals"]
    assert "model.lora.rank=8" in rank_msg and "another rank" in rank_msg
    assert "an adapter on 6 layers" in full_msg and "model.lora.rank=0" in full_msg
    assert str(tiny_model.resolve()) in base_msg and str(other_base.resolve()) in base_msg and "differ" in base_msg

    # The shards hold the adapter, its AdamW moments and the schedule, not the frozen base (the whole one's did).
    ckpt = latest_checkpoint(root)
    saved = _read_metadata(ckpt).state_dict_metadata
    assert any(".lora_A." in k for k in saved) and not any(
        ".base_layer." in k or "embed_tokens" in k or "lm_head" in k for k in saved)
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.distcp"))  # noqa: E731
    base_bytes = sum(f.stat().st_size for f in tiny_model.glob("*.safetensors"))
    assert size(latest_checkpoint(f"{root}-whole")) - size(ckpt) > 0.9 * base_bytes

    hf_dir = export_hf(latest_checkpoint(root), tmp_path / "hf", tiny_model)
    exported = AutoModelForCausalLM.from_pretrained(hf_dir)
    live = AutoModelForCausalLM.from_pretrained(tiny_model)
    live.load_state_dict(out["after_save"])
    via_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), hf_dir / "adapter")
    ids = make_batch(seed=5)["input_ids"][:3]
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, live(input_ids=ids).logits)
        torch.testing.assert_close(via_peft(input_ids=ids).logits, live(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    assert not torch.equal(exported.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                           AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()[
                               "model.layers.0.self_attn.q_proj.weight"])  # fmt: skip
    whole = AutoModelForCausalLM.from_pretrained(export_hf(latest_checkpoint(f"{root}-whole"), tmp_path / "hf-w",
                                                           tiny_model))  # fmt: skip
    for name, w in exported.state_dict().items():
        assert torch.equal(whole.state_dict()[name], w), name
    with pytest.raises(CheckpointError, match="differ"):  # exported on another base: refused, naming both
        export_hf(ckpt, tmp_path / "hf-other", tiny_model, base_model=other_base)


def test_lora_beside_a_separate_critic_replays_bit_for_bit(tmp_path: Path) -> None:
    """`rlbus replay` of a LoRA run (its adapter restored from the checkpoint, as the guard's rollback restores it)
    reproduces the steps bit for bit; the critic (gae, its own model, fully trained) trains beside the adapter."""
    from rlbus.trainer.replay import replay
    from tests.integration.test_replay import record_run

    recorded = record_run(tmp_path, model={"lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}},
                          algorithm={"adv_estimator": "gae", "lam": 0.95}, critic={"lr": 1e-2})  # fmt: skip
    assert recorded["engine"].lora.enabled and recorded["engine"].critic is not None
    assert "critic/vf_loss" in recorded["rows"][-1]
    result, engine = replay(recorded["run_dir"], from_step=3, num_steps=2)
    assert result.from_checkpoint == 2
    assert result.identical, [d for d in result.diffs if not d.equal]
    live, replayed = recorded["engine"].adapter_state_dict(), engine.adapter_state_dict()
    assert live and all(torch.equal(live[k], replayed[k]) for k in live)
    assert not all(torch.equal(recorded["weights"][2][k], recorded["weights"][4][k]) for k in recorded["weights"][4])


def test_lora_dropout_acts_in_the_update_only(tiny_model: Path) -> None:
    """Dropout on the adapter's input runs in the update's forwards; the scoring passes stay deterministic (as the
    producers' are), and the proximal log-probs come from a pass of their own, not from a dropped-out forward."""
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.lora import dropout_active

    torch.set_num_threads(1)
    init_distributed("cpu")
    try:
        engine = _engine(str(tiny_model), LoraConfig(rank=4, alpha=8.0, dropout=0.5, target_modules=["q_proj"]))
        drops = [m for n, m in engine.model.named_modules() if "lora_dropout" in n and isinstance(m, torch.nn.Dropout)]
        assert drops and not any(m.training for m in drops)  # from the start, not only after an update
        engine.train_step(make_batch(seed=1))  # B moves off zero: the adapter now changes the output
        batch = make_batch(seed=2)
        assert not engine._proximal_from_update()
        first, second = engine.compute_log_probs(batch), engine.compute_log_probs(batch)
        assert torch.equal(first, second)
        with torch.no_grad(), dropout_active(engine.model, True):
            dropped = engine.compute_log_probs(batch)
        assert not torch.equal(dropped, first)
        assert not any(m.training for m in drops)
        plain = _engine(str(tiny_model), LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj"]))
        assert plain._proximal_from_update()
    finally:
        destroy_distributed()
