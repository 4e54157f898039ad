"""The learning math against hand-computed values and direct loop-based references.

    .venv/bin/python -m pytest -q tests/unit/test_algorithms.py
"""

from __future__ import annotations

import math

import pytest
import torch

from rlbus.schemas.config import AlgorithmConfig
from rlbus.trainer import algorithms as A

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------------------------
# loop-based references (deliberately naive: one python loop per definition)


def ref_group_advantages(scores: list[float], groups: list[int], kind: str, norm_by_std: bool = True) -> list[float]:
    out = []
    for i, s in enumerate(scores):
        members = [scores[j] for j in range(len(scores)) if groups[j] == groups[i]]
        n = len(members)
        if n == 1:
            out.append(0.0)
            continue
        mean = sum(members) / n
        if kind == "rloo":
            out.append(s - (sum(members) - s) / (n - 1))
        elif norm_by_std:
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
            out.append((s - mean) / (std + 1e-6))
        else:
            out.append(s - mean)
    return out


def ref_token_loss(logp: float, old: float, adv: float, low: float, high: float, c: float) -> float:
    ratio = math.exp(logp - old)
    l1 = max(-adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high))
    return min(l1, -adv * c) if adv < 0 else l1


def ref_aggregate(loss: list[list[float]], mask: list[list[int]], mode: str, scale: float = 1.0) -> float:
    seqs = [(sum(l * m for l, m in zip(lr, mr)), sum(mr)) for lr, mr in zip(loss, mask)]
    live = [(s, n) for s, n in seqs if n > 0]
    if mode == "token-mean":
        return sum(s for s, _ in live) / sum(n for _, n in live)
    if mode == "seq-mean-token-sum":
        return sum(s for s, _ in live) / len(live)
    if mode == "seq-mean-token-mean":
        return sum(s / n for s, n in live) / len(live)
    return sum(s for s, _ in live) / (len(live) * scale)


def whole_norm(mask: torch.Tensor, scale: float = 1.0) -> A.LossNormaliser:
    tokens, seqs = A.LossNormaliser.local_counts(mask)
    return A.LossNormaliser(num_tokens=tokens, num_seqs=seqs, scale=scale)


# ---------------------------------------------------------------------------------------------------------------
# advantages


def test_grpo_by_hand() -> None:
    # group 7: scores 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = A.grpo_advantages(scores, torch.tensor([7, 7, 7, 7]))
    expect = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert torch.allclose(adv, torch.tensor([expect, -expect, -expect, expect]), atol=1e-6)


@pytest.mark.parametrize("kind,norm", [("grpo", True), ("grpo", False), ("rloo", True)])
def test_group_advantages_match_loop_reference(kind: str, norm: bool) -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(13, generator=g)
    groups = torch.tensor([5, 5, 5, 2, 2, 9, 9, 9, 9, 40, 1, 1, 1])  # group 40 has one sample
    if kind == "grpo":
        adv = A.grpo_advantages(scores, groups, norm_by_std=norm)
    else:
        adv = A.rloo_advantages(scores, groups)
    expect = ref_group_advantages(scores.tolist(), groups.tolist(), kind, norm)
    assert torch.allclose(adv, torch.tensor(expect), atol=1e-5)
    assert adv[9].item() == 0.0  # one-sample group


def test_rloo_by_hand() -> None:
    adv = A.rloo_advantages(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0, 0, 0]))
    assert torch.allclose(adv, torch.tensor([3 - 1.5, 1 - 2.5, 2 - 2.0]))


def test_dr_grpo_is_mean_only_and_equal_scores_give_zero() -> None:
    adv = A.grpo_advantages(torch.tensor([2.0, 4.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]), norm_by_std=False)
    assert adv.tolist() == [-1.0, 1.0, 0.0, 0.0]


def test_token_advantages_broadcast_on_response_tokens_only() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]])
    adv = A.compute_advantages(rewards, mask, torch.tensor([0, 0]), estimator="grpo", norm_by_std=False)
    assert adv.tolist() == [[0.0, 0.5, 0.5, 0.0], [0.0, -0.5, -0.5, -0.5]]
    # a reward sitting on a masked position (tool output) is not part of the score
    rewards[1, 0] = 100.0
    assert torch.equal(A.compute_advantages(rewards, mask, torch.tensor([0, 0]), norm_by_std=False), adv)


# ---------------------------------------------------------------------------------------------------------------
# PPO clip


def _loss_of(logp: float, old: float, adv: float, **kw: float) -> A.PolicyLossOutput:
    t = lambda x: torch.tensor([[x]])  # noqa: E731
    mask = torch.ones(1, 1)
    return A.ppo_clip_loss(t(logp), t(old), t(adv), mask, norm=whole_norm(mask), **kw)


def test_ppo_clip_upper_side_for_positive_advantage() -> None:
    out = _loss_of(math.log(1.5), 0.0, 2.0, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert out.loss.item() == pytest.approx(-2.0 * 1.28)
    assert out.clipfrac == 1.0 and out.dual_clipfrac == 0.0
    inside = _loss_of(math.log(1.1), 0.0, 2.0, clip_ratio_high=0.28)
    assert inside.loss.item() == pytest.approx(-2.0 * 1.1) and inside.clipfrac == 0.0


def test_ppo_clip_lower_side_for_negative_advantage() -> None:
    out = _loss_of(math.log(0.5), 0.0, -1.0, clip_ratio_low=0.2)
    assert out.loss.item() == pytest.approx(0.8)  # max(0.5, 0.8)
    assert out.clipfrac == 1.0


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    out = _loss_of(math.log(5.0), 0.0, -1.0, clip_ratio_c=3.0)
    assert out.loss.item() == pytest.approx(3.0)  # min(max(5, 1.2), 3)
    assert out.dual_clipfrac == 1.0
    positive = _loss_of(math.log(5.0), 0.0, 1.0, clip_ratio_c=3.0)  # no dual clip for A > 0
    assert positive.loss.item() == pytest.approx(-1.2) and positive.dual_clipfrac == 0.0


def test_dual_clip_has_no_gradient() -> None:
    logp = torch.tensor([[math.log(5.0)]], requires_grad=True)
    mask = torch.ones(1, 1)
    out = A.ppo_clip_loss(logp, torch.zeros(1, 1), -torch.ones(1, 1), mask, norm=whole_norm(mask))
    out.loss.backward()
    assert logp.grad is not None and logp.grad.item() == 0.0


def test_log_ratio_is_clamped_before_exp() -> None:
    out = _loss_of(100.0, 0.0, 1.0, clip_ratio_high=1e9, log_ratio_clamp=5.0)
    assert out.loss.item() == pytest.approx(-math.exp(5.0), rel=1e-5)
    assert math.isfinite(out.approx_kl)


def _random_case(seed: int, B: int = 6, T: int = 9) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, T, (B,), generator=g)
    start = torch.randint(0, 2, (B,), generator=g)
    pos = torch.arange(T)[None]
    mask = ((pos >= start[:, None]) & (pos < lens[:, None])).float()
    mask[2] = 0.0  # a sequence with no response tokens counts for nothing
    return {
        "logp": -torch.rand(B, T, generator=g) * 2,
        "old": -torch.rand(B, T, generator=g) * 2,
        "adv": torch.randn(B, T, generator=g),
        "mask": mask,
    }


@pytest.mark.parametrize("mode", A.LOSS_AGG_MODES)
def test_policy_loss_matches_loop_reference(mode: str) -> None:
    c = _random_case(1)
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    out = A.ppo_clip_loss(c["logp"], c["old"], c["adv"], c["mask"], norm=whole_norm(c["mask"], 7.0), agg_mode=mode,
                          **kw)  # fmt: skip
    per_token = [
        [ref_token_loss(lp, o, a, 0.2, 0.28, 3.0) for lp, o, a in zip(*rows)]
        for rows in zip(c["logp"].tolist(), c["old"].tolist(), c["adv"].tolist())
    ]
    expect = ref_aggregate(per_token, c["mask"].int().tolist(), mode, scale=7.0)
    assert out.loss.item() == pytest.approx(expect, rel=1e-5)


@pytest.mark.parametrize("mode", A.LOSS_AGG_MODES)
def test_masked_positions_contribute_nothing(mode: str) -> None:
    c = _random_case(2)
    base = A.ppo_clip_loss(c["logp"], c["old"], c["adv"], c["mask"], norm=whole_norm(c["mask"]), agg_mode=mode)
    off = c["mask"] == 0
    noisy = {k: v.clone() for k, v in c.items()}
    noisy["logp"][off] = 50.0
    noisy["old"][off] = -50.0
    noisy["adv"][off] = float("nan")
    out = A.ppo_clip_loss(noisy["logp"], noisy["old"], noisy["adv"], c["mask"], norm=whole_norm(c["mask"]),
                          agg_mode=mode)  # fmt: skip
    assert out.loss.item() == pytest.approx(base.loss.item(), rel=1e-6)
    assert (out.clipfrac, out.dual_clipfrac) == (base.clipfrac, base.dual_clipfrac)
    assert out.approx_kl == pytest.approx(base.approx_kl)


@pytest.mark.parametrize("mode", A.LOSS_AGG_MODES)
def test_micro_batches_with_global_normaliser_sum_to_whole_batch_loss(mode: str) -> None:
    c = _random_case(3, B=7, T=11)
    logp = c["logp"].clone().requires_grad_(True)
    norm = whole_norm(c["mask"], 11.0)
    whole = A.ppo_clip_loss(logp, c["old"], c["adv"], c["mask"], norm=norm, agg_mode=mode).loss
    (whole_grad,) = torch.autograd.grad(whole, logp)
    total = torch.zeros(())
    for idx in (torch.tensor([0, 1, 2]), torch.tensor([3]), torch.tensor([4, 5, 6])):  # unequal token counts
        total = total + A.ppo_clip_loss(logp[idx], c["old"][idx], c["adv"][idx], c["mask"][idx], norm=norm,
                                        agg_mode=mode).loss  # fmt: skip
    (split_grad,) = torch.autograd.grad(total, logp)
    assert total.item() == pytest.approx(whole.item(), rel=1e-6)
    assert torch.allclose(split_grad, whole_grad, atol=1e-7)
    # The classic bug: a mean of micro-batch means is a different number (here, for token-mean).
    if mode == "token-mean":
        means = [
            A.ppo_clip_loss(logp[idx], c["old"][idx], c["adv"][idx], c["mask"][idx], norm=whole_norm(c["mask"][idx]))
            .loss.item()
            for idx in (torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5, 6]))
        ]
        assert sum(means) / 2 != pytest.approx(whole.item(), rel=1e-3)


def test_token_weights_scale_per_token_loss() -> None:
    c = _random_case(4)
    w = torch.rand(c["mask"].shape, generator=torch.Generator().manual_seed(9)) + 0.5
    norm = whole_norm(c["mask"])
    weighted = A.ppo_clip_loss(c["logp"], c["old"], c["adv"], c["mask"], norm=norm, token_weights_BT=w)
    plain_tok = [
        [ref_token_loss(lp, o, a, 0.2, 0.2, 3.0) * wt for lp, o, a, wt in zip(*rows)]
        for rows in zip(c["logp"].tolist(), c["old"].tolist(), c["adv"].tolist(), w.tolist())
    ]
    assert weighted.loss.item() == pytest.approx(ref_aggregate(plain_tok, c["mask"].int().tolist(), "token-mean"))


# ---------------------------------------------------------------------------------------------------------------
# off-policy correction


def test_decoupled_weights_are_truncated_ratio_of_proximal_to_behaviour() -> None:
    # The default decoupled weight (rollout_is unset): w = min(exp(prox - mu), is_cap) per token.
    spec = A.CorrectionSpec.from_config(AlgorithmConfig(off_policy="decoupled", is_cap=2.0))
    assert (spec.is_level, spec.is_lower, spec.is_upper) == ("token", None, 2.0)
    prox = torch.tensor([[0.0, math.log(0.5), math.log(3.0), 7.0]])
    behaviour = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    corr = A.correct(prox, behaviour, mask, spec)
    assert torch.allclose(corr.weights_BT, torch.tensor([[1.0, 0.5, 2.0, 0.0]]))
    m = A.mismatch_metrics(corr.sums, spec, values_N=corr.values_N)
    assert m["is/weight_mean"] == pytest.approx((1.0 + 0.5 + 2.0) / 3)
    assert m["is/truncated_frac"] == pytest.approx(1 / 3)  # the masked-out 7.0 is not counted
    assert not corr.weights_BT.requires_grad
    assert torch.equal(corr.mask_BT, mask)  # no rejection configured: the loss keeps every response token


def test_off_policy_modes_choose_old_log_probs_and_weights() -> None:
    behaviour, prox, mask = torch.full((1, 2), -1.0), torch.full((1, 2), -2.0), torch.ones(1, 2)
    assert torch.equal(A.old_log_probs_for("bypass", behaviour, None), behaviour)
    assert torch.equal(A.old_log_probs_for("decoupled", behaviour, prox), prox)
    assert torch.equal(A.old_log_probs_for("none", behaviour, prox), prox)
    for mode in ("bypass", "none"):  # no importance weight, the mismatch still measured
        spec = A.CorrectionSpec.from_config(AlgorithmConfig(off_policy=mode))
        corr = A.correct(prox, behaviour, mask, spec)
        assert spec.is_level is None and corr.weights_BT is None
        assert set(A.mismatch_metrics(corr.sums, spec)) == {"mismatch/kl_k1", "mismatch/kl_k3"}
    spec = A.CorrectionSpec.from_config(AlgorithmConfig(off_policy="decoupled"))
    w = A.correct(prox, behaviour, mask, spec).weights_BT
    assert w is not None and torch.allclose(w, torch.full((1, 2), math.exp(-1.0)))
    assert A.needs_proximal("decoupled") and A.needs_proximal("none") and not A.needs_proximal("bypass")
    with pytest.raises(ValueError, match="proximal"):
        A.old_log_probs_for("decoupled", behaviour, None)


# ---------------------------------------------------------------------------------------------------------------
# KL and entropy


def test_k1_k3_by_hand() -> None:
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    assert torch.allclose(A.kl_estimate(logp, ref, "k1"), torch.tensor([[0.5, -1.0]]))
    x = torch.tensor([[-0.5, 1.0]])  # ref - logp
    assert torch.allclose(A.kl_estimate(logp, ref, "k3"), torch.exp(x) - x - 1)
    assert (A.kl_estimate(logp, ref, "k3") >= 0).all()


def test_k3_is_unbiased_estimate_of_kl() -> None:
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    exact = float((p * (p / q).log()).sum())
    # expectation under the sampling policy p, computed exactly over the 3 outcomes
    k3 = A.kl_estimate(p.log()[None], q.log()[None], "k3")[0]
    k1 = A.kl_estimate(p.log()[None], q.log()[None], "k1")[0]
    assert float((p * k3).sum()) == pytest.approx(exact, rel=1e-5)
    assert float((p * k1).sum()) == pytest.approx(exact, rel=1e-5)


def test_kl_reward_penalty_only_on_response_tokens() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    out = A.apply_kl_reward_penalty(rewards, torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-3.0, -2.0, -1.5]]),
                                    torch.tensor([[0, 1, 1]]), kl_coef=0.1, kl_type="k1")  # fmt: skip
    assert torch.allclose(out, torch.tensor([[0.0, -0.1, 1.0 - 0.05]]))


def test_entropy_from_logits() -> None:
    uniform = torch.zeros(1, 1, 8)
    assert A.entropy_from_logits(uniform).item() == pytest.approx(math.log(8), rel=1e-6)
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    p = torch.softmax(logits, -1)
    assert A.entropy_from_logits(logits).item() == pytest.approx(float(-(p * p.log()).sum()), rel=1e-6)
