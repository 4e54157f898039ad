"""REINFORCE++, REINFORCE++-baseline, GAE and the clipped value loss against verl 0.9.1's `core_algos`.

    .venv/bin/python -m pytest -q tests/unit/test_advantages_vs_verl.py

Inputs: masks of every shape (`MASKS`: full, ragged, tool-output holes, empty rows, one token, one row), dense and
outcome-only rewards, several gamma / lam. rlbus's rows hold prompt + response; verl's hold the response window
only: both layouts are compared. The whitening's sums over FSDP shards are checked with two threads standing in
for two ranks (the real all-reduce runs in tests/integration/test_critic.py).
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlbus.schemas.config import AlgorithmConfig
from rlbus.trainer import algorithms as A
from tests.unit.test_rollout_correction import MASKS, make_mask, verl  # noqa: F401 - verl is a fixture

torch.set_num_threads(1)

SEEDS = range(8)
GAMMA_LAM = [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.9, 0.5)]


def rewards_for(mask: torch.Tensor, g: torch.Generator, *, dense: bool) -> torch.Tensor:
    """Outcome reward on each row's last response token (the contract), plus per-token ones if `dense`."""
    rewards = torch.zeros_like(mask)
    lengths = mask.shape[1] - mask.flip(-1).argmax(-1) - 1  # last masked-in position
    has = mask.sum(-1) > 0
    rewards[has, lengths[has]] = torch.randint(0, 2, (int(has.sum()),), generator=g).float()
    if dense:
        rewards = rewards + torch.randn(mask.shape, generator=g) * 0.1 * mask
    return rewards


def cases():
    for seed in SEEDS:
        for kind in MASKS:
            g = torch.Generator().manual_seed(seed)
            mask = make_mask(kind, g)
            yield seed, kind, mask, rewards_for(mask, g, dense=seed % 2 == 1), g


def verl_or_refusal(fn, *args, **kwargs):
    """verl's result, or None where verl's whitening raises (fewer than two masked-in tokens in the batch)."""
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        assert "mask" in str(e)
        return None


def close(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor, what: str) -> None:
    on = mask > 0
    torch.testing.assert_close(ours[on], theirs[on], rtol=1e-5, atol=1e-5, msg=what)
    assert float(ours[~on].abs().sum()) == 0.0, f"{what}: rlbus leaves a non-zero value where the mask is 0"


@pytest.mark.parametrize("gamma", [1.0, 0.99, 0.9])
def test_reinforce_plus_plus_equals_verl(verl, gamma: float) -> None:  # noqa: F811
    config = SimpleNamespace(gamma=gamma)
    compared = 0
    for seed, kind, mask, rewards, _ in cases():
        ours = A.compute_advantages(rewards, mask, torch.zeros(mask.shape[0]), estimator="reinforce_plus_plus",
                                    gamma=gamma)  # fmt: skip
        theirs = verl_or_refusal(verl.core.compute_reinforce_plus_plus_outcome_advantage, rewards, mask, config=config)
        if theirs is None:
            assert mask.sum() <= 1 and float(ours.abs().sum()) == 0.0  # rlbus: no spread, no advantage
            continue
        close(ours, theirs[0], mask, f"rf++ gamma {gamma} {kind} seed {seed}")
        compared += 1
        # verl's returns, before whitening, are rlbus's discounted returns
        close(A.discounted_returns(rewards, mask, gamma), theirs[1], mask, f"rf++ returns {kind} seed {seed}")
    assert compared >= len(SEEDS) * (len(MASKS) - 1)


def test_reinforce_plus_plus_baseline_equals_verl(verl) -> None:  # noqa: F811
    for seed, kind, mask, rewards, g in cases():
        # groups of 3, 2 and 1 (a lone sample keeps its raw score in verl: its baseline is 0)
        index = torch.tensor([0, 0, 0, 1, 1, 2][: mask.shape[0]])
        ours = A.compute_advantages(rewards, mask, index, estimator="reinforce_plus_plus_baseline")
        theirs = verl_or_refusal(verl.core.compute_reinforce_plus_plus_baseline_outcome_advantage, rewards, mask,
                                 np.array(index.tolist()))  # fmt: skip
        if theirs is None:
            assert mask.sum() <= 1 and float(ours.abs().sum()) == 0.0
            continue
        close(ours, theirs[0], mask, f"rf++ baseline {kind} seed {seed}")


@pytest.mark.parametrize(("gamma", "lam"), GAMMA_LAM)
def test_gae_advantages_and_returns_equal_verl(verl, gamma: float, lam: float) -> None:  # noqa: F811
    for seed, kind, mask, rewards, g in cases():
        values = torch.randn(mask.shape, generator=g)
        ours_adv, ours_ret = A.gae_advantages_returns(rewards, values, mask, gamma=gamma, lam=lam)
        theirs = verl_or_refusal(verl.core.compute_gae_advantage_return, rewards, values, mask, gamma, lam)
        if theirs is None:
            assert mask.sum() <= 1 and float(ours_adv.abs().sum()) == 0.0
            continue
        what = f"gae gamma {gamma} lam {lam} {kind} seed {seed}"
        close(ours_adv, theirs[0], mask, what)
        close(ours_ret, theirs[1], mask, what + " returns")


def test_full_rows_equal_verls_response_window(verl) -> None:  # noqa: F811
    # rlbus's rows carry the prompt before the response (m = 0 there) and padding after; verl's tensors start at the
    # response. Prompt and padding are context: the same advantages and returns on the response tokens.
    P = 5
    for seed, kind, mask, rewards, g in cases():
        values = torch.randn(mask.shape, generator=g)
        prompt_values = torch.full((mask.shape[0], P), 0.7)  # whatever the critic says of prompt positions
        full_mask = torch.cat([torch.zeros(mask.shape[0], P), mask], dim=1)
        full_rewards = torch.cat([torch.zeros(mask.shape[0], P), rewards], dim=1)
        adv, ret = A.gae_advantages_returns(
            full_rewards, torch.cat([prompt_values, values], dim=1), full_mask, gamma=0.99, lam=0.95
        )
        theirs = verl_or_refusal(verl.core.compute_gae_advantage_return, rewards, values, mask, 0.99, 0.95)
        rfpp = A.compute_advantages(full_rewards, full_mask, torch.zeros(mask.shape[0]),
                                    estimator="reinforce_plus_plus", gamma=0.99)  # fmt: skip
        theirs_rfpp = verl_or_refusal(verl.core.compute_reinforce_plus_plus_outcome_advantage, rewards, mask,
                                      config=SimpleNamespace(gamma=0.99))  # fmt: skip
        if theirs is None:
            continue
        close(adv[:, P:], theirs[0], mask, f"gae window {kind} seed {seed}")
        close(ret[:, P:], theirs[1], mask, f"gae window returns {kind} seed {seed}")
        close(rfpp[:, P:], theirs_rfpp[0], mask, f"rf++ window {kind} seed {seed}")
        assert float(adv[:, :P].abs().sum() + ret[:, :P].abs().sum()) == 0.0


def test_whitening_over_shards_equals_the_whole_batch() -> None:
    # Two threads stand in for two ranks: `reduce` sums each list elementwise over both, as an all-reduce does.
    g = torch.Generator().manual_seed(3)
    mask = make_mask("holes", g, 8, 12)
    rewards, values = rewards_for(mask, g, dense=True), torch.randn(8, 12, generator=g)
    shards = [slice(0, 6), slice(6, 8)]  # whole groups of two per shard, as the trainer assigns them
    barrier, slots = threading.Barrier(2), [None, None]

    def reduce_for(rank: int):
        def reduce(xs: list[float]) -> list[float]:
            slots[rank] = xs
            barrier.wait()
            out = [a + b for a, b in zip(*slots)]
            barrier.wait()
            return out

        return reduce

    for estimator in ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        outs: list[torch.Tensor | None] = [None, None]

        def run(rank: int, estimator: str = estimator, outs: list = outs) -> None:
            s, reduce = shards[rank], reduce_for(rank)
            if estimator == "gae":
                outs[rank] = A.gae_advantages_returns(rewards[s], values[s], mask[s], gamma=0.99, lam=0.9,
                                                      reduce=reduce)[0]  # fmt: skip
            else:
                outs[rank] = A.compute_advantages(rewards[s], mask[s], torch.arange(8)[s] // 2, estimator=estimator,
                                                  gamma=0.99, reduce=reduce)  # fmt: skip

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        if estimator == "gae":
            whole = A.gae_advantages_returns(rewards, values, mask, gamma=0.99, lam=0.9)[0]
        else:
            whole = A.compute_advantages(rewards, mask, torch.arange(8) // 2, estimator=estimator, gamma=0.99)
        torch.testing.assert_close(torch.cat(outs), whole, rtol=1e-5, atol=1e-6, msg=estimator)
        assert float(whole.abs().sum()) > 0


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm"])  # fmt: skip
@pytest.mark.parametrize("cliprange_value", [0.2, 0.5, 5.0])
def test_value_loss_and_clip_fraction_equal_verl(verl, agg_mode: str, cliprange_value: float) -> None:  # noqa: F811
    clipped = 0.0
    for seed, kind, mask, rewards, g in cases():
        old_values = torch.randn(mask.shape, generator=g)
        values = old_values + torch.randn(mask.shape, generator=g) * 0.5
        returns = old_values + torch.randn(mask.shape, generator=g)
        tokens, seqs = A.LossNormaliser.local_counts(mask)
        v_ours = values.clone().requires_grad_(True)
        out = A.value_loss(v_ours, returns, old_values, mask, cliprange_value=cliprange_value, agg_mode=agg_mode,
                           norm=A.LossNormaliser(tokens, seqs, float(mask.shape[-1])))  # fmt: skip
        out.loss.backward()
        v_theirs = values.clone().requires_grad_(True)
        loss, clipfrac = verl.core.compute_value_loss(v_theirs, returns, old_values, mask, cliprange_value,
                                                      loss_agg_mode=agg_mode, dp_size=1, batch_num_tokens=tokens,
                                                      global_batch_size=seqs)  # fmt: skip
        loss.backward()
        what = f"value loss {agg_mode} clip {cliprange_value} {kind} seed {seed}"
        torch.testing.assert_close(out.loss.detach(), loss.detach(), rtol=1e-5, atol=1e-7, msg=what)
        torch.testing.assert_close(v_ours.grad, v_theirs.grad, rtol=1e-5, atol=1e-7, msg=what)
        assert out.clipped_tokens / out.num_tokens == pytest.approx(float(clipfrac), rel=1e-5, abs=1e-7), what
        clipped += out.clipped_tokens
    assert (clipped > 0) == (cliprange_value < 5.0)


def test_explained_variance_is_verls() -> None:
    # verl's critic/vf_explained_var (metric_utils.compute_data_metrics): 1 - var(R - V) / (var(R) + 1e-5) with
    # torch.var (unbiased) over the response tokens; here from sums that add across shards.
    for seed, kind, mask, rewards, g in cases():
        values, returns = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
        on = mask > 0
        if on.sum() < 2:
            continue
        r, v = returns[on], values[on]
        expected = 1.0 - torch.var(r - v) / (torch.var(r) + 1e-5)
        half = mask.shape[0] // 2
        a, b = (A.ValueSums.of(values[s], returns[s], mask[s]) for s in (slice(0, half), slice(half, None)))
        summed = A.ValueSums(*[x + y for x, y in zip(a.as_list(), b.as_list())])
        m = summed.metrics()
        assert m["critic/vf_explained_var"] == pytest.approx(float(expected), rel=1e-4, abs=1e-5), (kind, seed)
        assert m["critic/values_mean"] == pytest.approx(float(v.mean()), rel=1e-5, abs=1e-6)
        assert m["critic/returns_mean"] == pytest.approx(float(r.mean()), rel=1e-5, abs=1e-6)


def test_estimator_names_are_verls(verl) -> None:  # noqa: F811
    for name in A.ADV_ESTIMATORS:
        assert callable(verl.core.get_adv_estimator_fn(name))
        assert AlgorithmConfig(adv_estimator=name).adv_estimator == name


def test_bad_discounts_and_critic_settings_are_config_errors_naming_the_key() -> None:
    from rlbus.schemas.config_io import load_config
    from rlbus.schemas.errors import ConfigError

    for override, key in [("algorithm.gamma=1.5", "algorithm.gamma"), ("algorithm.lam=-0.1", "algorithm.lam"),
                          ("critic.cliprange_value=0", "critic.cliprange_value"), ("critic.lr=0", "critic.lr"),
                          ("critic.critic_warmup=-1", "critic.critic_warmup"),
                          ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator"),
                          ("algorithm.loss_mode=dapo", "algorithm.loss_mode")]:  # fmt: skip
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, ["model.path=x", override])
    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "quickstart_gae.yaml"), ["model.path=x"])
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.critic_warmup == 3
