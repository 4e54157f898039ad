"""Real FSDP2 on CPU (gloo, locally spawned ranks): two ranks == one process, checkpoints round-trip, HF export.

    .venv/bin/python -m pytest -q tests/integration/test_fsdp.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest
import torch
from tensordict import TensorDict

from rlbus.schemas.config import AlgorithmConfig, TrainerConfig

VOCAB = 64


# ---------------------------------------------------------------------------------------------------------------
# helpers (importable by the spawned ranks)


def build_tiny_qwen2(path: Path, *, seed: int = 0) -> Path:
    """A 2-layer, 64-wide Qwen2 causal LM plus a word-level tokenizer, saved as a Hugging Face directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(path)
    return path


def make_batch(num_groups: int = 4, group_size: int = 4, T: int = 24, seed: int = 0,
               shared_prompts: bool = False) -> TensorDict:
    """A synthetic RL batch in the trainer's contract: right-padded prompt+response, tool tokens masked out.
    shared_prompts: the samples of a group share their prompt, as a real GRPO group's do."""
    g = torch.Generator().manual_seed(seed)
    B = num_groups * group_size
    prompt_len = torch.randint(3, 7, (B,), generator=g)
    lengths = torch.randint(9, T + 1, (B,), generator=g)  # unequal lengths -> unequal micro-batch token counts
    pos = torch.arange(T)[None]
    attention_mask = (pos < lengths[:, None]).long()
    input_ids = torch.randint(2, VOCAB, (B, T), generator=g) * attention_mask
    if shared_prompts:
        first = torch.arange(B) // group_size * group_size
        prompt_len = prompt_len[first]
        prompt = pos < prompt_len[:, None]
        input_ids = torch.where(prompt, input_ids[first], input_ids)
    response_mask = ((pos >= prompt_len[:, None]) & (pos < lengths[:, None])).float()
    response_mask[:, 7:9] = 0.0  # a "tool output" span inside the response
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.randint(0, 2, (B,), generator=g).float()
    rollout_log_probs = (-torch.rand(B, T, generator=g) - 3.5) * response_mask  # an old, different policy
    return TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (pos.expand(B, T) * attention_mask).long(),
            "response_mask": response_mask,
            "rollout_log_probs": rollout_log_probs,
            "token_level_rewards": rewards,
            "group_index": torch.arange(B) // group_size,
            "versions": torch.where(response_mask > 0, 0, -1).long(),
        },
        batch_size=[B],
    )


def rank_share(batch: TensorDict, rank: int, world: int) -> TensorDict:
    """Whole groups per rank, deliberately uneven: with 2 ranks rank 0 gets 3 groups and rank 1 gets 1."""
    groups = batch["group_index"]
    n = int(groups.max()) + 1
    cut = n - max(1, n // 4) if world == 2 else n
    keep = groups < cut if rank == 0 else groups >= cut
    return batch[keep]


def _train_worker(model_dir: str, trainer_cfg: TrainerConfig, algo_cfg: AlgorithmConfig, steps: int) -> dict:
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(1)
    info = init_distributed("cpu")
    engine = TrainEngine(model_dir, trainer_cfg, algo_cfg, temperature=0.9)
    metrics = [engine.train_step(rank_share(make_batch(seed=s), info.rank, info.world_size)) for s in range(steps)]
    weights = engine.full_state_dict()
    destroy_distributed()
    return {"metrics": metrics, "weights": weights}


def reference_step(model_dir: str, trainer_cfg: TrainerConfig, algo_cfg: AlgorithmConfig, batch: TensorDict) -> dict:
    """The same step as a plain single-process PyTorch loop: one forward of the whole batch, no FSDP.

    The rollout correction as verl applies it: decoupled / none, rejected tokens leave the loss and its normaliser;
    bypass (one update per step, so the policy being updated is the proximal one), they leave the loss only.
    """
    from transformers import AutoModelForCausalLM

    from rlbus.trainer import algorithms as A
    from rlbus.trainer.engine import token_log_probs

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=trainer_cfg.lr, betas=trainer_cfg.betas,
                            weight_decay=trainer_cfg.weight_decay)  # fmt: skip
    mask = batch["response_mask"]

    def logp() -> torch.Tensor:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"]).logits  # fmt: skip
        return token_log_probs(out, batch["input_ids"], 0.9)

    with torch.no_grad():
        prox = logp()
    adv = A.compute_advantages(batch["token_level_rewards"], mask, batch["group_index"])
    spec = A.CorrectionSpec.from_config(algo_cfg)
    corr = A.correct(prox, batch["rollout_log_probs"], mask, spec)
    weights = corr.weights_BT
    if spec.batch_normalize:
        weights = weights / A.batch_norm_factor(corr.sums, spec)
    bypass = algo_cfg.off_policy == "bypass"
    tokens, seqs = A.LossNormaliser.local_counts(mask if bypass else corr.mask_BT)
    norm = A.LossNormaliser(num_tokens=tokens, num_seqs=seqs, scale=float(mask.sum(-1).max()))
    out = A.policy_loss(algo_cfg.loss_mode, logp(), batch["rollout_log_probs"] if bypass else prox, adv, corr.mask_BT,
                        norm=norm, agg_mode=algo_cfg.loss_agg_mode, token_weights_BT=weights)  # fmt: skip
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), trainer_cfg.grad_clip)
    opt.step()
    return {"loss": out.loss.item(), "grad_norm": float(grad_norm), "weights": model.state_dict(),
            "correction": A.mismatch_metrics(corr.sums, spec, values_N=corr.values_N)}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


# ---------------------------------------------------------------------------------------------------------------
# tests


# Rollout corrections as verl users configure them: Seq-TIS, normalised, with token-level two-sided rejection
# (decoupled, so the proximal pass runs before the update); IcePop per sequence (fused into the update's forward);
# Geo-RS in bypass (rejection measured during the update).
CORRECTIONS = {
    "seq_tis_rs": dict(rollout_is="sequence", rollout_is_threshold=1.5, rollout_is_batch_normalize=True,
                       rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25"),
    "seq_icepop": dict(rollout_is="sequence", rollout_is_threshold="0.5_2.0"),
    "bypass_geo_rs": dict(off_policy="bypass", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.8_1.25"),
    # GSPO, whose ratio is a sequence's, with sequence-level TIS (CISPO's and GSPO's numerics: the unit tests)
    "gspo_seq_tis": dict(loss_mode="gspo", rollout_is="sequence", rollout_is_threshold=2.0),
    # GMPO: one loss per sequence, normalised by the sequences of the whole update over both ranks
    "gmpo": dict(loss_mode="geo_mean"),
}  # fmt: skip


# make test-fast keeps the two aggregations; each correction is one more two-rank spawn (make test runs them).
@pytest.mark.parametrize(("agg_mode", "correction"), [("token-mean", None), ("seq-mean-token-mean", None),
                                                      *[pytest.param("seq-mean-token-mean", c, marks=pytest.mark.slow)
                                                        for c in CORRECTIONS]])
def test_two_ranks_equal_one_process(tiny_model: Path, agg_mode: str, correction: str | None) -> None:
    from transformers import AutoModelForCausalLM

    from rlbus.trainer.dist import spawn_local

    torch.set_num_threads(1)
    # Adam's first update is ~lr * sign(g), blind to the gradient's scale and noisy where g ~ 0. Clipping the
    # gradient norm to 1e-6 puts |g| far below Adam's eps (1e-8 per element), where the update is ~lr * g / eps:
    # the weight change is then proportional to the gradient itself, so this compares gradients element-wise.
    trainer_cfg = TrainerConfig(micro_batch_size=3, mini_batches=1, lr=1e-3, grad_clip=1e-6)
    algo_cfg = AlgorithmConfig(loss_agg_mode=agg_mode, off_policy="decoupled", is_cap=2.0)
    if correction is not None:
        algo_cfg = msgspec.structs.replace(algo_cfg, **CORRECTIONS[correction])
    two = spawn_local(2, _train_worker, str(tiny_model), trainer_cfg, algo_cfg, 1)
    ref = reference_step(str(tiny_model), trainer_cfg, algo_cfg, make_batch(seed=0))

    m0, m1 = two[0]["metrics"][0], two[1]["metrics"][0]
    assert m0 == m1  # every rank returns the same (all-reduced) metrics
    assert m0["actor/pg_loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    assert m0["actor/grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    # the correction's metrics over two ranks' shards (sums all-reduced, weights gathered for the percentiles)
    assert {k: m0[k] for k in ref["correction"]} == pytest.approx(ref["correction"], rel=1e-5, abs=1e-7)
    assert ("is/weight_mean" in m0) == (algo_cfg.off_policy == "decoupled")
    if algo_cfg.rollout_rs is not None:
        assert 0 < m0["rs/masked_frac"] < 1  # the rejection really removes some tokens and keeps others
    assert two[1]["weights"] == {}  # full weights are gathered on rank 0 only
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    for name, w in two[0]["weights"].items():
        delta_ref = ref["weights"][name] - initial[name]
        assert delta_ref.abs().max() > 1e-6, name  # every tensor moved, so the comparison means something
        torch.testing.assert_close(w - initial[name], delta_ref, rtol=1e-4, atol=1e-8, msg=name)


def _ckpt_worker(model_dir: str, root: str) -> dict:
    from rlbus.trainer.checkpoint import load_checkpoint, save_checkpoint
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(1)
    info = init_distributed("cpu")
    cfg = TrainerConfig(micro_batch_size=4, lr=1e-3, lr_schedule="cosine", warmup_steps=1, total_steps=5,
                        keep_checkpoints=2)  # fmt: skip
    algo_cfg = AlgorithmConfig()
    share = lambda s: rank_share(make_batch(seed=s), info.rank, info.world_size)  # noqa: E731

    engine = TrainEngine(model_dir, cfg, algo_cfg, temperature=0.9)
    for step in range(1, 4):  # three saves with keep=2: the first one is pruned
        engine.train_step(share(step))
        save_checkpoint(engine, root, step, {"step": step, "version": step, "groups": [1, 2]}, keep=2)
    after_save = engine.full_state_dict()
    continued = engine.train_step(share(10))
    continued_weights = engine.full_state_dict()

    fresh = TrainEngine(model_dir, cfg, algo_cfg, temperature=0.9)
    extra = load_checkpoint(fresh, root)
    restored = fresh.full_state_dict()
    resumed = fresh.train_step(share(10))
    resumed_weights = fresh.full_state_dict()
    destroy_distributed()
    return {"extra": extra, "num_updates": (engine.num_updates, fresh.num_updates), "after_save": after_save,
            "restored": restored, "continued": continued, "resumed": resumed, "continued_weights": continued_weights,
            "resumed_weights": resumed_weights}  # fmt: skip


def test_checkpoint_round_trip_and_hf_export(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbus.trainer.checkpoint import export_hf, latest_checkpoint, list_checkpoints
    from rlbus.trainer.dist import spawn_local

    torch.set_num_threads(1)
    root = tmp_path / "ckpt"
    out = spawn_local(2, _ckpt_worker, str(tiny_model), str(root))[0]

    assert out["extra"] == {"step": 3, "version": 3, "groups": [1, 2]}
    assert [p.name for p in list_checkpoints(root)] == ["step_00000002", "step_00000003"]
    assert latest_checkpoint(root) == root / "step_00000003"
    assert not list(root.glob(".tmp-*"))
    for name, w in out["after_save"].items():  # the model is restored exactly
        assert torch.equal(out["restored"][name], w), name
    # ... and so are the optimizer moments, the LR schedule and the update count: the next step is identical
    assert out["num_updates"] == (4, 4)
    assert out["resumed"]["actor/lr"] == out["continued"]["actor/lr"]
    assert out["resumed"]["actor/pg_loss"] == out["continued"]["actor/pg_loss"]
    for name, w in out["continued_weights"].items():
        assert torch.equal(out["resumed_weights"][name], w), name
    assert not torch.equal(out["continued_weights"]["model.norm.weight"], out["after_save"]["model.norm.weight"])

    hf_dir = export_hf(latest_checkpoint(root), tmp_path / "hf", tiny_model)
    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == "qwen2"
    exported = AutoModelForCausalLM.from_pretrained(hf_dir)
    live = AutoModelForCausalLM.from_pretrained(tiny_model)
    live.load_state_dict(out["after_save"])
    ids = make_batch(seed=5)["input_ids"][:3]
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, live(input_ids=ids).logits)
    assert AutoTokenizer.from_pretrained(hf_dir).convert_tokens_to_ids("t5") == 5
    assert math.isfinite(out["continued"]["actor/grad_norm"])


def _options_worker(model_dir: str, algo_cfg: AlgorithmConfig) -> list[dict[str, float]]:
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(1)
    init_distributed("cpu")
    cfg = TrainerConfig(micro_batch_size=5, mini_batches=2, lr=1e-2, lr_schedule="cosine", warmup_steps=1,
                        total_steps=2)  # fmt: skip
    engine = TrainEngine(model_dir, cfg, algo_cfg, temperature=0.9)
    metrics = [engine.train_step(make_batch(seed=s)) for s in range(2)]
    destroy_distributed()
    return metrics


@pytest.mark.parametrize("use_kl_loss", [True, False])
def test_reference_kl_entropy_bonus_and_mini_batches(tiny_model: Path, use_kl_loss: bool) -> None:
    from rlbus.trainer.dist import spawn_local

    algo_cfg = AlgorithmConfig(kl_coef=0.1, kl_type="k3", use_kl_loss=use_kl_loss, entropy_coeff=0.01,
                               off_policy="bypass", loss_agg_mode="seq-mean-token-sum-norm")  # fmt: skip
    first, second = spawn_local(1, _options_worker, str(tiny_model), algo_cfg)[0]
    for m in (first, second):
        assert all(math.isfinite(v) for v in m.values()), m
        assert {"actor/kl", "actor/entropy", "actor/pg_loss", "actor/clipfrac", "actor/grad_norm"} <= set(m)
        assert "is/weight_mean" not in m  # bypass applies no importance weight
        assert "timing/proximal_s" not in m and "timing/ref_s" in m
    # the reference is the initial policy: KL starts at ~0 (first update) and grows once the policy has moved
    assert 0.0 <= first["actor/kl"] < second["actor/kl"]
    assert second["actor/num_updates"] == 4.0
    # LR: warmup over the first step's 2 updates (0.5, 1.0) x lr, then cosine down to 0 over the remaining 2
    assert first["actor/lr"] == pytest.approx(0.75e-2)
    assert second["actor/lr"] == pytest.approx((1.0 + 0.5) / 2 * 1e-2)
    assert 0.0 < first["actor/entropy"] <= math.log(VOCAB) + 1e-6


def _pg_loss_worker(model_dir: str, algo_cfg: AlgorithmConfig) -> float:
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(1)
    init_distributed("cpu")
    engine = TrainEngine(model_dir, TrainerConfig(micro_batch_size=8, lr=1e-3), algo_cfg, temperature=1.0)
    loss = engine.train_step(make_batch(seed=3))["actor/pg_loss"]
    destroy_distributed()
    return loss


@pytest.mark.slow
def test_seq_mean_token_sum_norm_takes_a_constant_scale(tiny_model: Path) -> None:
    from rlbus.trainer.dist import spawn_local

    longest = float(make_batch(seed=3)["response_mask"].sum(dim=-1).max())
    cfg = AlgorithmConfig(off_policy="bypass", loss_agg_mode="seq-mean-token-sum-norm")
    auto = spawn_local(1, _pg_loss_worker, str(tiny_model), cfg)[0]
    fixed = spawn_local(1, _pg_loss_worker, str(tiny_model),
                        msgspec.structs.replace(cfg, loss_scale_factor=2 * longest))[0]
    assert auto != 0.0
    assert fixed == pytest.approx(auto / 2, rel=1e-5)  # the loss is sum / (N_seq * C): twice C, half the loss


def test_load_from_an_empty_root_is_a_fresh_start(tmp_path: Path) -> None:
    from rlbus.trainer.checkpoint import CheckpointError, load_checkpoint

    assert load_checkpoint(object(), tmp_path / "nothing-here") is None
    (tmp_path / "step_00000001").mkdir()
    with pytest.raises(CheckpointError, match="no DCP metadata"):
        load_checkpoint(object(), tmp_path / "step_00000001")


def _variants_worker(model_dir: str, trainer_cfg: TrainerConfig, algo_cfg: AlgorithmConfig, variants: list[dict],
                     steps: int, shared_prompts: bool = False) -> list[dict]:  # fmt: skip
    """The same steps once per variant (engine attributes set before the first), each from the same start."""
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(1)
    info = init_distributed("cpu")
    out = []
    for attrs in variants:
        engine = TrainEngine(model_dir, trainer_cfg, algo_cfg, temperature=0.9)
        for name, value in attrs.items():
            setattr(engine, name, value)
        metrics = [engine.train_step(rank_share(make_batch(seed=s, shared_prompts=shared_prompts), info.rank,
                                                info.world_size)) for s in range(steps)]  # fmt: skip
        out.append({"metrics": metrics, "weights": engine.full_state_dict()})
    destroy_distributed()
    return out


def _same_numbers(a: dict, b: dict, *, rel: float, atol: float = 1e-8) -> None:
    def measured(m: dict) -> set[str]:  # what depends on the machine, not on the math
        return {k for k in m if k.startswith("timing/")
                or k in ("perf/tokens_per_s", "perf/peak_rss_gb", "perf/torch_threads", "perf/forward_positions")}

    for m_a, m_b in zip(a["metrics"], b["metrics"], strict=True):
        assert set(m_a) - measured(m_a) == set(m_b) - measured(m_b)
        for k in set(m_a) - measured(m_a):
            assert m_a[k] == pytest.approx(m_b[k], rel=rel, abs=1e-7), k
    for name, w in a["weights"].items():
        torch.testing.assert_close(w, b["weights"][name], rtol=rel, atol=atol, msg=name)


@pytest.mark.parametrize("off_policy", [pytest.param("decoupled", marks=pytest.mark.slow),
                                        pytest.param("none", marks=pytest.mark.slow), "seq_icepop"])
def test_proximal_from_the_update_forward_changes_no_number(tiny_model: Path, off_policy: str) -> None:
    """One update per step: the proximal pass is skipped and the step's loss, grad norm, metrics and weights are
    those of the separate pass, over two ranks with several (uneven) micro-batches each."""
    from rlbus.trainer.dist import spawn_local

    trainer_cfg = TrainerConfig(micro_batch_size=3, mini_batches=1, lr=1e-2)
    algo_cfg = AlgorithmConfig(off_policy="decoupled" if off_policy == "seq_icepop" else off_policy, is_cap=1.5,
                               entropy_coeff=0.01, **CORRECTIONS.get(off_policy, {}))  # fmt: skip
    fused, separate = spawn_local(2, _variants_worker, str(tiny_model), trainer_cfg, algo_cfg,
                                  [{}, {"fuse_proximal": False}], 3)[0]  # fmt: skip
    assert all("timing/proximal_s" not in m for m in fused["metrics"])  # the pass did not run
    assert 0.05 < fused["metrics"][0]["perf/peak_rss_gb"] < 64
    assert all("timing/proximal_s" in m for m in separate["metrics"])
    assert separate["metrics"][0]["actor/approx_kl"] == 0.0  # same weights: prox == current, bit for bit
    if off_policy == "decoupled":
        assert fused["metrics"][0]["is/truncated_frac"] > 0  # the IS weights are really in play
    if off_policy == "seq_icepop":
        assert 0 < fused["metrics"][0]["is/masked_frac"] < 1  # some sequences' weights zeroed, not all
    _same_numbers(fused, separate, rel=1e-6)


@pytest.mark.parametrize("mini_batches", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_shared_prefix_packing_changes_no_number(tiny_model: Path, mini_batches: int) -> None:
    """Groups whose samples share their prompt, run once per micro-batch (trainer/packing.py): loss, grad norm,
    metrics and weights are those of the plain rows, over two ranks with micro-batches that split groups, from
    fewer token-positions."""
    from rlbus.trainer.dist import spawn_local

    from transformers import AutoModelForCausalLM

    # As in test_two_ranks_equal_one_process: the gradient clipped far below Adam's eps makes each weight change
    # proportional to its gradient, so the weights compare the gradients element-wise.
    trainer_cfg = TrainerConfig(micro_batch_size=3, mini_batches=mini_batches, lr=1e-3, grad_clip=1e-6)
    algo_cfg = AlgorithmConfig(off_policy="decoupled", is_cap=1.5, entropy_coeff=0.01)
    plain = msgspec.structs.replace(trainer_cfg, share_prefix=False)
    # The cost model would leave rows this short unpacked on a 32-wide model: say attention is free, so it packs.
    packed, unpacked = spawn_local(2, _variants_worker, str(tiny_model), trainer_cfg, algo_cfg,
                                   [{"hidden_size": 1 << 20}, {"cfg": plain}], 3, True)[0]  # fmt: skip
    for p, u in zip(packed["metrics"], unpacked["metrics"], strict=True):
        assert p["perf/forward_positions"] < 0.9 * u["perf/forward_positions"]  # prompts of 3-6 tokens here
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    for d in (packed, unpacked):
        d["weights"] = {k: w - initial[k] for k, w in d["weights"].items()}
    # Weight changes, not weights: a norm weight near 1 whose update differs by float rounding may land one ulp
    # (6e-8) apart, as it does with the fused AdamW kernel (trainer.fused_optimizer); allow that ulp, no more.
    _same_numbers(packed, unpacked, rel=1e-4, atol=6e-8)


def test_several_updates_per_step_still_run_the_proximal_pass(tiny_model: Path) -> None:
    from rlbus.trainer.dist import spawn_local

    cfg = TrainerConfig(micro_batch_size=5, mini_batches=2, lr=1e-2)
    (only,) = spawn_local(1, _variants_worker, str(tiny_model), cfg, AlgorithmConfig(off_policy="decoupled"),
                          [{}], 1)[0]  # fmt: skip
    assert "timing/proximal_s" in only["metrics"][0]  # the second update's weights differ from the first's


def test_chunked_output_head_equals_the_whole_logits(tmp_path: Path) -> None:
    """A random model with a vocabulary 64x its hidden size: one position per chunk against one chunk for all,
    entropy bonus on (entropy with gradient), two FSDP ranks."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlbus.trainer.dist import spawn_local

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "m")
    # grad_clip far below Adam's eps makes the weight change proportional to the gradient (as in
    # test_two_ranks_equal_one_process), so the weights compare the gradients element-wise.
    trainer_cfg = TrainerConfig(micro_batch_size=4, mini_batches=1, lr=1e-3, grad_clip=1e-6)
    algo_cfg = AlgorithmConfig(off_policy="decoupled", entropy_coeff=0.05)
    chunked, whole = spawn_local(2, _variants_worker, str(tmp_path / "m"), trainer_cfg, algo_cfg,
                                 [{"logits_chunk_bytes": 1}, {"logits_chunk_bytes": 1 << 40}], 1)[0]  # fmt: skip
    assert chunked["metrics"][0]["actor/entropy"] > 1.0
    initial = Qwen2ForCausalLM.from_pretrained(tmp_path / "m").state_dict()
    for d in (chunked, whole):
        d["weights"] = {k: w - initial[k] for k, w in d["weights"].items()}
    # One ulp of a norm weight near 1 (6e-8), as in the packing test above: on an Intel Xeon the two logit orders
    # left model.norm and one input_layernorm element 5.96e-8 apart (on an AMD EPYC they rounded alike).
    _same_numbers(chunked, whole, rel=1e-4, atol=6e-8)


def _zero_grad_worker(model_dir: str, skip: bool) -> dict:
    """A step with signal, then one whose every group scored alike (no advantage, so no gradient)."""
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(1)
    init_distributed("cpu")
    cfg = TrainerConfig(micro_batch_size=8, mini_batches=2, lr=1e-2, skip_zero_grad_updates=skip)
    engine = TrainEngine(model_dir, cfg, AlgorithmConfig(), temperature=1.0)
    first = engine.train_step(make_batch(seed=0))
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    uniform = make_batch(seed=1)
    uniform["token_level_rewards"] = torch.zeros_like(uniform["token_level_rewards"])  # every sample scores 0
    second = engine.train_step(uniform)
    after = engine.full_state_dict()
    out = {"first": first, "second": second, "moved": max((after[k] - before[k]).abs().max().item() for k in before),
           "scheduler_steps": engine.scheduler.last_epoch}
    destroy_distributed()
    return out


def test_an_update_with_no_gradient_moves_no_weight(tiny_model: Path) -> None:
    """trainer.skip_zero_grad_updates: a mini-batch whose groups each scored alike has a gradient of exactly zero;
    AdamW would still move every weight along its momentum (verl and TRL step anyway: `false`). Skipped, the
    weights stay bit for bit, the LR schedule goes on, and the step counts the skipped updates."""
    from rlbus.trainer.dist import spawn_local

    skipped = spawn_local(1, _zero_grad_worker, str(tiny_model), True)[0]
    stepped = spawn_local(1, _zero_grad_worker, str(tiny_model), False)[0]
    for run in (skipped, stepped):
        assert run["first"]["actor/grad_norm"] > 0 and "actor/zero_grad_updates" not in run["first"]
        assert run["second"]["actor/grad_norm"] == 0.0
        assert run["scheduler_steps"] == 4
    assert skipped["second"]["actor/zero_grad_updates"] == 2.0  # the count of updates skipped for it
    assert "actor/zero_grad_updates" not in stepped["second"]  # none skipped (a run recorded so replays equal)
    assert skipped["moved"] == 0.0
    assert stepped["moved"] > 1e-4  # momentum alone: of the order of the LR
