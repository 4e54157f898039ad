"""The policy losses (vanilla PPO clip, GSPO, CISPO, SAPO, GMPO, DPPO-TV/KL) against verl 0.9.1's registered ones:
loss, gradient, metrics.

    .venv/bin/python -m pytest -q tests/unit/test_policy_losses_vs_verl.py

Every loss mode x every aggregation mode x masks of every shape (`MASKS`) x seeds, with and without rollout IS
weights. The gradient is compared as well as the value: GSPO and CISPO differ from PPO mostly in where the
stop-gradients sit. Each mode runs with its own hyperparameters (`HYPER`), set away from the defaults so that a value
that failed to reach the loss would show, and so that every clip the mode has is active on these inputs.
"""

from __future__ import annotations

import pytest
import torch

from rlbus.schemas.config import AlgorithmConfig
from rlbus.trainer import algorithms as A
from tests.unit.test_rollout_correction import MASKS, make_mask, verl  # noqa: F401 - verl is a fixture

torch.set_num_threads(1)

SEEDS = range(6)
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# (clip_ratio_low, clip_ratio_high, clip_ratio_c) per mode: geo_mean's clip is on the log ratio, dppo_*'s are the
# divergence thresholds and the IS truncation; clip_ratio_c is low where it acts: the inputs' ratios rarely pass 3.
HYPER = {"vanilla": (0.2, 0.28, 1.3), "gspo": (3e-4, 4e-4, 3.0), "cispo": (0.2, 0.28, 3.0), "sapo": (0.2, 0.28, 3.0),
         "geo_mean": (0.1, 0.15, 3.0), "dppo_tv": (0.05, 0.08, 1.3), "dppo_kl": (0.01, 0.02, 1.3)}  # fmt: skip
TAUS = (1.5, 2.5)  # SAPO's (tau_pos, tau_neg), not verl's defaults (1.0, 1.05)


def inputs(seed: int, kind: str) -> tuple[torch.Tensor, ...]:
    """(old, new log-probs, advantages, mask, IS weights): ratios spread so that both clip sides are active."""
    g = torch.Generator().manual_seed(seed)
    mask = make_mask(kind, g)
    old = -torch.rand(mask.shape, generator=g) * 3.0
    new = old + torch.randn(mask.shape, generator=g) * 0.3
    adv = torch.randn(mask.shape, generator=g)
    weights = torch.rand(mask.shape, generator=g) * 2.0
    return old, new, adv, mask, weights


def ours_and_verls(verl, mode: str, agg_mode: str, old, new, adv, mask, weights):  # noqa: F811
    """(rlbus output, rlbus grad, verl loss, verl metrics, verl grad) for the same inputs."""
    clip_low, clip_high, clip_c = HYPER[mode]
    tokens, seqs = A.LossNormaliser.local_counts(mask)
    scale = float(mask.shape[-1])  # verl's default C of seq-mean-token-sum-norm: the response length
    new_ours = new.clone().requires_grad_(True)
    out = A.policy_loss(mode, new_ours, old, adv, mask, norm=A.LossNormaliser(tokens, seqs, scale), agg_mode=agg_mode,
                        clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=clip_c, tau_pos=TAUS[0],
                        tau_neg=TAUS[1], token_weights_BT=weights)  # fmt: skip
    out.loss.backward()
    actor = verl.ActorConfig(strategy="fsdp", clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=clip_c,
                             tau_pos=TAUS[0], tau_neg=TAUS[1], ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                             policy_loss={"loss_mode": mode})  # fmt: skip
    actor.global_batch_info.update(dp_size=1, batch_num_tokens=tokens, global_batch_size=seqs)
    new_theirs = new.clone().requires_grad_(True)
    theirs, m = verl.core.get_policy_loss_fn(mode)(old, new_theirs, adv, mask, loss_agg_mode=agg_mode, config=actor,
                                                    rollout_is_weights=weights)  # fmt: skip
    if tokens > 0:
        theirs.backward()
    if mode == "geo_mean" and tokens > 0:
        # verl averages GMPO's sequence losses over the micro-batch's rows, fully masked ones included; rlbus over
        # the batch's sequences with a token (the seq-mean modes' N_seq): verl's value x rows / N_seq is rlbus's.
        theirs, new_theirs.grad = theirs * mask.shape[0] / seqs, new_theirs.grad * mask.shape[0] / seqs
    return out, new_ours.grad, theirs, m, new_theirs.grad


@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("mode", A.POLICY_LOSS_MODES)
def test_policy_loss_value_gradient_and_metrics_equal_verl(verl, mode: str, agg_mode: str) -> None:  # noqa: F811
    clipped = lower = 0.0
    for seed in SEEDS:
        for kind in MASKS:
            old, new, adv, mask, weights = inputs(seed, kind)
            for w in (None, weights):
                out, grad, theirs, m, their_grad = ours_and_verls(verl, mode, agg_mode, old, new, adv, mask, w)
                if mask.sum() == 0:
                    continue  # MASKS has no empty batch; an empty one is tested below
                what = f"{mode} {agg_mode} {kind} seed {seed} weights {w is not None}"
                torch.testing.assert_close(out.loss.detach(), theirs.detach(), rtol=1e-5, atol=1e-7, msg=what)
                torch.testing.assert_close(grad, their_grad, rtol=1e-5, atol=1e-7, msg=what)
                assert out.clipfrac == pytest.approx(m["actor/pg_clipfrac"], rel=1e-5, abs=1e-7), what
                assert out.approx_kl == pytest.approx(m["actor/ppo_kl"], rel=1e-5, abs=1e-7), what
                assert out.dual_clipfrac == pytest.approx(m["actor/pg_clipfrac_lower"], rel=1e-5, abs=1e-7), what
                clipped, lower = clipped + out.clipfrac, lower + out.dual_clipfrac
    if mode == "sapo":  # no hard clip: verl reports 0 for both
        assert clipped == lower == 0.0
        return
    assert clipped > 0, "no token was ever clipped: the clip side of the loss went untested"
    if mode in ("vanilla", "geo_mean", "dppo_tv", "dppo_kl"):
        assert lower > 0, "the second clip (dual clip, lower clip, IS truncation) was never active: untested"


@pytest.mark.parametrize("mode", A.POLICY_LOSS_MODES)
def test_micro_batches_add_up_to_the_whole_batch(mode: str) -> None:
    # The trainer sums micro-batch losses normalised by whole-batch counts (over ranks too): every mode, the
    # sequence-level ones (geo_mean, sapo's fixed aggregation) included, must give the whole batch's loss and gradient.
    old, new, adv, mask, weights = inputs(1, "empty_rows")
    tokens, seqs = A.LossNormaliser.local_counts(mask)
    norm = A.LossNormaliser(tokens, seqs, float(mask.shape[-1]))
    whole = new.clone().requires_grad_(True)
    expected = A.policy_loss(mode, whole, old, adv, mask, norm=norm, agg_mode="seq-mean-token-mean",
                             token_weights_BT=weights).loss  # fmt: skip
    expected.backward()
    parts, total = new.clone().requires_grad_(True), 0.0
    for rows in torch.arange(mask.shape[0]).tensor_split(3):
        out = A.policy_loss(mode, parts[rows], old[rows], adv[rows], mask[rows], norm=norm,
                            agg_mode="seq-mean-token-mean", token_weights_BT=weights[rows])  # fmt: skip
        out.loss.backward()
        total += float(out.loss.detach())
    assert total == pytest.approx(float(expected.detach()), rel=1e-5)
    torch.testing.assert_close(parts.grad, whole.grad, rtol=1e-5, atol=1e-7)


def test_gspo_ratio_is_one_per_sequence_and_its_gradient_scales_every_token() -> None:
    # By hand: a sequence's ratio is the geometric mean of its token ratios, the same for all its tokens, and each
    # token's gradient is -A * s_i / N (token-mean) where the clip is not active.
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.1, -0.1, 0.3], [0.2, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.ones(2, 3)
    out = A.gspo_loss(new, old, adv, mask, norm=A.LossNormaliser(4, 2), clip_ratio_low=1.0, clip_ratio_high=10.0)
    out.loss.backward()
    s = torch.tensor([0.1, 0.2]).exp()  # exp(mean log ratio) of each sequence
    assert float(out.loss.detach()) == pytest.approx(float(-(3 * s[0] + s[1]) / 4), rel=1e-6)
    expected = -torch.tensor([[s[0], s[0], s[0]], [s[1], 0.0, 0.0]]) / 4
    torch.testing.assert_close(new.grad, expected)


def test_cispo_keeps_the_gradient_of_clipped_tokens_where_ppo_drops_it() -> None:
    # A token far above the clip range with a positive advantage: PPO's clipped objective has no gradient there;
    # CISPO's is -A * clip(rho) = -1.28 per token (token-mean over one token).
    old, new = torch.zeros(1, 1), torch.full((1, 1), 1.0)
    adv, mask, norm = torch.ones(1, 1), torch.ones(1, 1), A.LossNormaliser(1, 1)
    grads = {}
    for mode in ("vanilla", "cispo"):
        x = new.clone().requires_grad_(True)
        out = A.policy_loss(mode, x, old, adv, mask, norm=norm, clip_ratio_low=0.2, clip_ratio_high=0.28)
        out.loss.backward()
        grads[mode] = float(x.grad)
        assert out.clipfrac == 1.0
    assert grads["vanilla"] == 0.0
    assert grads["cispo"] == pytest.approx(-1.28)


def test_an_empty_batch_gives_zero_loss_where_verl_gives_nan(verl) -> None:  # noqa: F811
    # rlbus's choice: a batch whose tokens were all rejected contributes nothing (loss 0, no gradient); verl divides
    # 0 by 0 tokens and returns NaN, which would poison the optimizer (but for geo_mean, whose mean over rows is 0).
    old, new, adv, _, weights = inputs(0, "all_ones")
    mask = torch.zeros_like(old)
    for mode in A.POLICY_LOSS_MODES:
        out, grad, theirs, _, _ = ours_and_verls(verl, mode, "token-mean", old, new, adv, mask, weights)
        assert float(out.loss.detach()) == 0.0 and float(grad.abs().sum()) == 0.0
        assert float(theirs.detach()) == 0.0 if mode == "geo_mean" else torch.isnan(theirs)


def test_loss_mode_names_and_defaults_are_verls(verl) -> None:  # noqa: F811
    for mode in A.POLICY_LOSS_MODES:
        assert callable(verl.core.get_policy_loss_fn(mode))
        assert AlgorithmConfig(loss_mode=mode).loss_mode == mode
    theirs, ours = verl.ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1), AlgorithmConfig()
    for name in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg"):
        assert getattr(ours, name) == getattr(theirs, name), name
    with pytest.raises(ValueError, match="loss_mode"):
        A.policy_loss("ppo", *inputs(0, "all_ones")[:4], norm=A.LossNormaliser(1, 1))
