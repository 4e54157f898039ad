"""Rollout correction against verl 0.9.1 itself (weights, rejection, metrics, the loss they feed), plus the metrics
by hand and the invariance of the sums across shards.

    .venv/bin/python -m pytest -q tests/unit/test_rollout_correction.py

verl is a test-only reference, installed by the Makefile's setup (`pip install --no-deps verl==0.9.1 ...`); these
tests fail, never skip, where it cannot be imported.
"""

from __future__ import annotations

import importlib.metadata
import math
from types import SimpleNamespace

import pytest
import torch

from rlbus.schemas.config import AlgorithmConfig
from rlbus.trainer import algorithms as A
from rlbus.trainer.algorithms.rollout_correction import percentiles

torch.set_num_threads(1)

SEEDS = range(12)
B, T = 6, 12
MASKS = ("all_ones", "ragged", "holes", "empty_rows", "one_token", "one_row")
# Every verl rollout_is setting: level x (TIS cap | IcePop bounds).
IS_CASES = [(level, threshold) for level in ("token", "sequence") for threshold in (2.0, 1.2, "0.5_5.0", "0.8_1.25")]
# Every verl rejection option with a bound that keeps some and rejects some of these inputs, and two chains.
RS_CASES = [
    ("token_k1", "0.8_1.25"), ("token_k1", 1.3), ("token_k2", 0.02), ("token_k3", 0.02),
    ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k1", 3.0), ("seq_sum_k2", 0.3), ("seq_sum_k3", 0.3),
    ("seq_mean_k1", "0.9_1.1"), ("seq_mean_k1", 1.08), ("seq_mean_k2", 0.03), ("seq_mean_k3", 0.03),
    ("seq_max_k2", 0.1), ("seq_max_k3", 0.1),
    ("token_k1,seq_mean_k3", "0.7_1.4,0.03"), ("seq_sum_k1,seq_max_k2,token_k3", "2.0"),
]  # fmt: skip


@pytest.fixture(scope="module")
def verl() -> SimpleNamespace:
    """verl 0.9.1's rollout-correction helpers and policy loss: fail (not skip) when they are missing."""
    try:
        version = importlib.metadata.version("verl")
        from verl.trainer.ppo import core_algos, rollout_corr_helper
        from verl.workers.config.actor import ActorConfig
    except ImportError as e:  # PackageNotFoundError is an ImportError too
        pytest.fail(f"verl 0.9.1 is the numerics reference of these tests and cannot be imported ({e}); install it "
                    "with the Makefile's line: .venv/bin/pip install --no-deps verl==0.9.1 omegaconf==2.4.0 "
                    "codetiming orjson")  # fmt: skip
    assert version == "0.9.1", f"the reference is verl 0.9.1, found {version}"
    return SimpleNamespace(rc=rollout_corr_helper, core=core_algos, ActorConfig=ActorConfig)


def make_mask(kind: str, g: torch.Generator, b: int = B, t: int = T) -> torch.Tensor:
    if kind == "all_ones":
        return torch.ones(b, t)
    if kind == "one_token":
        return torch.zeros(b, t).index_fill_(1, torch.tensor([0]), 1.0)
    if kind == "one_row":
        return make_mask("ragged", g, 1, t)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    if kind == "holes":  # tool-output tokens inside the response carry response_mask = 0
        mask = mask * (torch.rand(b, t, generator=g) > 0.3).float()
        mask[:, 0] = 1.0
    if kind == "empty_rows":
        mask[::2] = 0.0
    return mask


def make_log_probs(g: torch.Generator, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(proximal, behaviour): a small mismatch with a few far-off tokens, garbage where the mask is 0 anyway."""
    behaviour = -torch.rand(shape, generator=g) * 3.0
    log_ratio = torch.randn(shape, generator=g) * 0.2
    outliers = torch.rand(shape, generator=g) < 0.05
    log_ratio = torch.where(outliers, torch.randn(shape, generator=g) * 2.0, log_ratio)
    return behaviour + log_ratio, behaviour


def spec_of(**fields) -> A.CorrectionSpec:
    return A.CorrectionSpec.from_config(AlgorithmConfig(**fields))


def cases(seeds=SEEDS, masks=MASKS):
    for seed in seeds:
        for kind in masks:
            g = torch.Generator().manual_seed(seed)
            mask = make_mask(kind, g)
            prox, behaviour = make_log_probs(g, tuple(mask.shape))
            yield prox, behaviour, mask


def close(ours: float, theirs: float, what: str) -> None:
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6), f"{what}: rlbus {ours} vs verl {theirs}"


# ---------------------------------------------------------------------------------------------------------------
# against verl 0.9.1


@pytest.mark.parametrize(("level", "threshold"), IS_CASES)
@pytest.mark.parametrize("batch_normalize", [False, True])
def test_importance_weights_and_their_metrics_equal_verl(verl, level, threshold, batch_normalize) -> None:
    spec = spec_of(rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=batch_normalize)
    for prox, behaviour, mask in cases():
        corr = A.correct(prox, behaviour, mask, spec)
        try:
            theirs_BT, m = verl.rc.compute_rollout_correction_weights(
                prox - behaviour, mask, rollout_is=level, rollout_is_threshold=threshold,
                rollout_is_batch_normalize=batch_normalize,
            )  # fmt: skip
        except ZeroDivisionError:
            # verl divides by a zero mean when IcePop zeroes every weight; rlbus reports no effective sample
            assert float(corr.weights_BT.abs().sum()) == 0.0
            assert A.mismatch_metrics(corr.sums, spec, values_N=corr.values_N)["is/ess"] == 0.0
            continue
        ours_BT = corr.weights_BT / (A.batch_norm_factor(corr.sums, spec) if batch_normalize else 1.0)
        torch.testing.assert_close(ours_BT, theirs_BT, rtol=1e-6, atol=1e-7)
        ours = A.mismatch_metrics(corr.sums, spec, values_N=corr.values_N)
        close(ours["is/weight_mean"], m["rollout_is_mean"], "mean")
        close(ours["is/truncated_frac"], m["rollout_is_ratio_fraction_high"], "fraction above")
        close(ours["is/below_frac"], m["rollout_is_ratio_fraction_low"], "fraction below")
        close(ours["is/ess"], m["rollout_is_eff_sample_size"], "ESS")
        if level == "token":  # verl's sequence-level max is the raw (untruncated) one; rlbus reports applied weights
            close(ours["is/max"], m["rollout_is_max"], "max")
        if isinstance(threshold, str):
            close(ours["is/masked_frac"], m["rollout_is_oob_ratio"], "IcePop share outside")
        if batch_normalize:
            close(ours["is/batch_norm_factor"], m["rollout_is_batch_norm_factor"], "batch norm factor")
        assert torch.equal(corr.mask_BT, mask)  # IS alone never removes a token from the loss


@pytest.mark.parametrize(("options", "threshold"), RS_CASES)
def test_rejection_mask_and_shares_equal_verl(verl, options, threshold) -> None:
    spec = spec_of(rollout_rs=options, rollout_rs_threshold=threshold)
    kept = rejected = 0
    for prox, behaviour, mask in cases():
        corr = A.correct(prox, behaviour, mask, spec)
        theirs_BT, m = verl.rc.compute_rollout_rejection_mask(prox - behaviour, mask, options, threshold)
        assert torch.equal(corr.mask_BT, theirs_BT.float()), (options, threshold)
        assert torch.equal(A.rejection_mask(prox - behaviour, mask, spec), corr.mask_BT)
        ours = A.mismatch_metrics(corr.sums, spec)
        close(ours["rs/masked_frac"], m["rollout_rs_masked_fraction"], "token share rejected")
        close(ours["rs/seq_masked_frac"], m["rollout_rs_seq_masked_fraction"], "sequence share rejected")
        kept, rejected = kept + int(corr.mask_BT.sum()), rejected + int((mask - corr.mask_BT).sum())
    assert kept > 0 and rejected > 0, "the bound neither keeps nor rejects: this case tests nothing"


def test_bounds_are_inclusive_as_verls(verl) -> None:
    # Random inputs never land on a bound; these do exactly: lr = 0 gives w = 1 and k1 = 0, lr = 1 gives k2 = 1/2.
    behaviour = torch.zeros(2, 3)
    prox = torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    k3_of_one = float(torch.exp(torch.tensor(1.0)) - 2.0)  # k3 at lr = 1, exactly as float32 computes it
    for options, threshold in [("token_k1", "1_1"), ("token_k2", 0.5), ("seq_max_k2", 0.5), ("seq_sum_k2", 1.0),
                               ("token_k3", k3_of_one), ("seq_mean_k1", "1_2")]:  # fmt: skip
        corr = A.correct(prox, behaviour, mask, spec_of(rollout_rs=options, rollout_rs_threshold=threshold))
        theirs, _ = verl.rc.compute_rollout_rejection_mask(prox - behaviour, mask, options, threshold)
        assert torch.equal(corr.mask_BT, theirs.float()), options
    for threshold in ("1_1", 1.0, "1_2"):
        spec = spec_of(rollout_is="token", rollout_is_threshold=threshold)
        corr = A.correct(prox, behaviour, mask, spec)
        theirs, m = verl.rc.compute_rollout_correction_weights(prox - behaviour, mask, "token", threshold)
        torch.testing.assert_close(corr.weights_BT, theirs)
        ours = A.mismatch_metrics(corr.sums, spec, values_N=corr.values_N)
        close(ours["is/below_frac"], m["rollout_is_ratio_fraction_low"], "fraction below")
        close(ours["is/truncated_frac"], m["rollout_is_ratio_fraction_high"], "fraction above")


def test_mismatch_kl_equals_verl(verl) -> None:
    for prox, behaviour, mask in cases():
        ours = A.mismatch_metrics(A.correct(prox, behaviour, mask, spec_of(off_policy="none")).sums, spec_of())
        theirs = verl.rc.compute_offpolicy_metrics(prox, behaviour, mask)
        close(ours["mismatch/kl_k1"], theirs["kl"], "k1")
        close(ours["mismatch/kl_k3"], theirs["k3_kl"], "k3")


@pytest.mark.parametrize(
    ("fields", "verl_kwargs"),
    [
        ({"rollout_is": "sequence", "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"},  # Seq-MIS
         {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "seq_sum_k1",
          "rollout_rs_threshold": "0.5_2.0"}),
        ({"rollout_is": "token", "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.9_1.1"},  # Geo-RS + TIS
         {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
          "rollout_rs_threshold": "0.9_1.1"}),
        ({"rollout_is": "token", "rollout_is_threshold": "0.5_5.0", "rollout_is_batch_normalize": True,
          "rollout_rs": "token_k3", "rollout_rs_threshold": 0.05},  # IcePop + K3-RS, normalised
         {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0", "rollout_is_batch_normalize": True,
          "rollout_rs": "token_k3", "rollout_rs_threshold": 0.05}),
        ({"off_policy": "none", "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.03},  # K3-RS, no weights
         {"rollout_is": None, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.03}),
        ({"off_policy": "decoupled", "is_cap": 2.0}, {"rollout_is": "token", "rollout_is_threshold": 2.0}),  # default
    ],
)  # fmt: skip
def test_whole_correction_equals_verls_pipeline(verl, fields, verl_kwargs) -> None:
    spec = spec_of(**fields)
    for prox, behaviour, mask in cases(masks=("all_ones", "ragged", "holes", "empty_rows", "one_token")):
        corr = A.correct(prox, behaviour, mask, spec)
        proto, theirs_mask, m = verl.rc.compute_rollout_correction_and_rejection_mask(prox, behaviour, mask,
                                                                                      **verl_kwargs)
        assert torch.equal(corr.mask_BT, theirs_mask)
        if proto is None:
            assert corr.weights_BT is None
        else:
            factor = A.batch_norm_factor(corr.sums, spec) if spec.batch_normalize else 1.0
            torch.testing.assert_close(corr.weights_BT / factor, proto.batch["rollout_is_weights"], rtol=1e-6,
                                       atol=1e-7)  # fmt: skip
        ours = A.mismatch_metrics(corr.sums, spec, values_N=corr.values_N)
        pairs = {"mismatch/kl_k1": "kl", "mismatch/kl_k3": "k3_kl", "is/weight_mean": "rollout_is_mean",
                 "is/ess": "rollout_is_eff_sample_size", "rs/masked_frac": "rollout_rs_masked_fraction"}
        for name, verl_name in pairs.items():
            if "rollout_corr/" + verl_name in m:
                close(ours[name], m["rollout_corr/" + verl_name], name)


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_policy_loss_with_weights_and_rejection_equals_verl(verl, agg_mode) -> None:
    # Decoupled: the rejected tokens leave the loss and its normaliser (verl masks response_mask before the update).
    spec = spec_of(rollout_is="sequence", rollout_is_threshold=3.0, rollout_rs="token_k1",
                   rollout_rs_threshold="0.7_1.4")  # fmt: skip
    actor = verl.ActorConfig(strategy="fsdp", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                             ppo_micro_batch_size_per_gpu=1, rollout_n=1)  # fmt: skip
    for seed, (prox, behaviour, mask) in enumerate(cases(masks=("all_ones", "ragged", "holes", "empty_rows"))):
        corr = A.correct(prox, behaviour, mask, spec)
        g = torch.Generator().manual_seed(1000 + seed)
        logp = prox + torch.randn(prox.shape, generator=g) * 0.2
        adv = torch.randn(prox.shape, generator=g) * corr.mask_BT
        tokens, seqs = A.LossNormaliser.local_counts(corr.mask_BT)
        ours = A.ppo_clip_loss(logp, prox, adv, corr.mask_BT, norm=A.LossNormaliser(tokens, seqs), agg_mode=agg_mode,
                               clip_ratio_low=0.2, clip_ratio_high=0.28, token_weights_BT=corr.weights_BT).loss
        actor.global_batch_info.update(dp_size=1, batch_num_tokens=tokens, global_batch_size=seqs)
        theirs, _ = verl.core.compute_policy_loss_vanilla(prox, logp, adv, corr.mask_BT, loss_agg_mode=agg_mode,
                                                          config=actor, rollout_is_weights=corr.weights_BT)
        if tokens == 0:  # verl divides 0 by 0 where every token is rejected; rlbus's loss is 0 (no gradient)
            assert float(ours) == 0.0
            continue
        close(float(ours), float(theirs), f"{agg_mode} loss")


def test_config_parses_thresholds_as_verl(verl) -> None:
    for spec in (2.0, 5, "3.5", "0.5_5.0", "1_1"):
        lower, upper = AlgorithmConfig(rollout_is="token", rollout_is_threshold=spec).is_bounds
        assert (upper, lower) == verl.rc._parse_rollout_is_threshold(spec)
    for options, spec in [(["seq_sum_k1"], 2.0), (["token_k1", "seq_max_k3"], "0.5_2.0,0.1"),
                          (["seq_mean_k2", "token_k3"], "0.02"), (["seq_mean_k1"], "0.999_1.001")]:  # fmt: skip
        ours = AlgorithmConfig(rollout_rs=",".join(options), rollout_rs_threshold=spec).rs_bounds
        theirs = verl.rc._parse_rollout_rs_thresholds(options, spec)
        assert ours == tuple((o, theirs[o]["lower"], theirs[o]["upper"]) for o in options)
    for bad in ("0_2", "3_2", "-1", "x"):  # verl refuses these too
        with pytest.raises(ValueError):
            verl.rc._parse_rollout_is_threshold(bad)
        with pytest.raises(ValueError, match="rollout_is_threshold"):
            AlgorithmConfig(rollout_is="token", rollout_is_threshold=bad)
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        AlgorithmConfig(rollout_rs="token_k2", rollout_rs_threshold="0.5_2.0")  # k2 takes an upper bound only


# ---------------------------------------------------------------------------------------------------------------
# the metrics by hand


def test_mismatch_kl_k1_k3_by_hand() -> None:
    prox = torch.tensor([[-1.0, -2.0, -0.5, 9.0]])
    behaviour = torch.tensor([[-1.5, -1.0, -0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is padding: its huge ratio must not count
    m = A.mismatch_metrics(A.correct(prox, behaviour, mask, spec_of()).sums, spec_of())
    lr = [0.5, -1.0, 0.0]  # prox - behaviour on the 3 tokens
    assert m["mismatch/kl_k1"] == pytest.approx(sum(-x for x in lr) / 3)
    assert m["mismatch/kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in lr) / 3)
    assert m["mismatch/kl_k3"] >= 0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_ess_is_one_when_every_weight_is_equal(level) -> None:
    mask = make_mask("ragged", torch.Generator().manual_seed(0))
    behaviour = torch.full(mask.shape, -1.0)
    # token: every token ratio exp(0.3); sequence: every row's log ratio sums to 0.3
    prox = behaviour + (0.3 if level == "token" else 0.3 * mask / mask.sum(-1, keepdim=True))
    spec = spec_of(rollout_is=level, rollout_is_threshold=5.0)
    corr = A.correct(prox, behaviour, mask, spec)
    m = A.mismatch_metrics(corr.sums, spec, values_N=corr.values_N)
    assert m["is/ess"] == pytest.approx(1.0, abs=1e-6)
    assert m["is/p5"] == pytest.approx(math.exp(0.3), rel=1e-5) == m["is/max"]


def test_ess_and_shares_by_hand() -> None:
    # token weights 1, 2 (within the cap) and 4 -> 3 (truncated): ESS = (1 + 2 + 3)^2 / (3 * (1 + 4 + 9)) = 36 / 42
    behaviour = torch.zeros(1, 3)
    prox = torch.tensor([[0.0, math.log(2.0), math.log(4.0)]])
    spec = spec_of(rollout_is="token", rollout_is_threshold=3.0)
    corr = A.correct(prox, behaviour, torch.ones(1, 3), spec)
    m = A.mismatch_metrics(corr.sums, spec, values_N=corr.values_N)
    assert m["is/ess"] == pytest.approx(36 / 42)
    assert m["is/truncated_frac"] == pytest.approx(1 / 3) and m["is/below_frac"] == 0.0
    assert (m["is/p50"], m["is/max"]) == (pytest.approx(2.0), pytest.approx(3.0))
    # IcePop [0.8, 3]: the weight 4 is zeroed, not truncated; the zero counts in the ESS
    spec = spec_of(rollout_is="token", rollout_is_threshold="0.8_3")
    corr = A.correct(prox, behaviour, torch.ones(1, 3), spec)
    m = A.mismatch_metrics(corr.sums, spec, values_N=corr.values_N)
    assert torch.allclose(corr.weights_BT, torch.tensor([[1.0, 2.0, 0.0]]))
    assert m["is/masked_frac"] == pytest.approx(1 / 3) and m["is/ess"] == pytest.approx(9 / 15)


def test_rejected_share_by_hand() -> None:
    # token_k1 keeps behaviour / proximal in [0.5, 2]: the token with ratio 4 (k1 = -log 4) goes, and only it
    behaviour = torch.zeros(2, 3)
    prox = torch.tensor([[0.0, math.log(4.0), 0.1], [0.2, -0.3, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    spec = spec_of(rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    corr = A.correct(prox, behaviour, mask, spec)
    assert torch.equal(corr.mask_BT, torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]))
    m = A.mismatch_metrics(corr.sums, spec)
    assert m["rs/masked_frac"] == pytest.approx(1 / 5) and m["rs/seq_masked_frac"] == pytest.approx(1 / 2)
    # seq_sum_k1 on the same rows: row 0 sums to -(log 4 + 0.1) < log 0.5, rejected whole; row 1 to 0.1, kept
    spec = spec_of(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0")
    assert torch.equal(A.correct(prox, behaviour, mask, spec).mask_BT, torch.tensor([[0.0] * 3, [1.0, 1.0, 0.0]]))


def test_sums_add_up_across_shards() -> None:
    # Micro-batches and FSDP ranks see different rows: the step's metrics are those of the whole batch.
    spec = spec_of(rollout_is="sequence", rollout_is_threshold="0.5_5.0", rollout_is_batch_normalize=True,
                   rollout_rs="seq_mean_k1,token_k3", rollout_rs_threshold="0.9_1.1,0.05")  # fmt: skip
    for prox, behaviour, mask in cases(masks=("ragged", "holes", "empty_rows")):
        whole = A.correct(prox, behaviour, mask, spec)
        shards = [A.correct(prox[rows], behaviour[rows], mask[rows], spec) for rows in torch.arange(B).split(4)]
        total = shards[0].sums + shards[1].sums
        values = torch.cat([s.values_N for s in shards])
        assert A.mismatch_metrics(total, spec, values_N=values) == pytest.approx(
            A.mismatch_metrics(whole.sums, spec, values_N=whole.values_N), rel=1e-9, abs=1e-12)
        assert torch.equal(torch.cat([s.mask_BT for s in shards]), whole.mask_BT)
        assert torch.equal(torch.cat([s.weights_BT for s in shards]), whole.weights_BT)
        normalised = whole.weights_BT / A.batch_norm_factor(whole.sums, spec)
        row_w = normalised.sum(-1) / mask.sum(-1).clamp(min=1)
        assert float(row_w[mask.sum(-1) > 0].mean()) == pytest.approx(1.0, rel=1e-5)  # mean sequence weight is 1


def test_percentiles_are_torch_quantile() -> None:
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 1000):
        x = torch.rand(n, generator=g)
        ours = percentiles(x, (0.05, 0.5, 0.95))
        assert ours == pytest.approx(torch.quantile(x.double(), torch.tensor([0.05, 0.5, 0.95]).double()).tolist())


def test_an_empty_step_reports_zeros_not_nans() -> None:
    spec = spec_of(rollout_is="token", rollout_rs="token_k2", rollout_rs_threshold=0.1)
    corr = A.correct(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), spec)
    m = A.mismatch_metrics(corr.sums, spec, values_N=corr.values_N)
    assert all(math.isfinite(v) for v in m.values()) and "is/p50" not in m


def test_garbage_at_padded_positions_stays_out() -> None:
    # Log-probs off the response mask are whatever the collator left there: NaN or inf must not reach a weight,
    # a rejection decision or a metric (a NaN weight times a masked loss would still poison the gradient).
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    prox = torch.tensor([[-1.0, -0.5, float("nan")], [-2.0, float("inf"), float("nan")]])
    behaviour = torch.tensor([[-1.2, -0.5, 0.0], [-2.0, float("-inf"), 3.0]])
    for fields in ({"rollout_is": "token"}, {"rollout_is": "sequence", "rollout_is_threshold": "0.5_2"},
                   {"rollout_is": "token", "rollout_rs": "seq_mean_k1,seq_max_k3,token_k2",
                    "rollout_rs_threshold": "0.5_2,1,1"}):  # fmt: skip
        spec = spec_of(**fields)
        corr = A.correct(prox, behaviour, mask, spec)
        assert torch.isfinite(corr.weights_BT).all() and (corr.weights_BT[mask == 0] == 0).all()
        assert torch.equal(corr.mask_BT, mask)  # the real tokens are well within every bound
        assert all(math.isfinite(v) for v in A.mismatch_metrics(corr.sums, spec, values_N=corr.values_N).values())
