"""On-policy distillation's numerics (trainer/algorithms/distill.py), its config section and its batch field.

- the advantage equals tinker-cookbook's `incorporate_kl_penalty` (written out below from its source, with its
  discounted future sum) and verl 0.9.1's policy-gradient distillation (`kl_penalty(..., "k1")`, negated, after
  its `loss_max_clamp`), on single-turn rows and with tool-output holes;
- the mixing is (1 - w) A_env + w A_kl; a teacher identical to the behaviour policy gives 0; metrics are per token;
- the config refuses bad values naming the field; collate carries teacher_log_probs, 0 off the mask, all or none.

    .venv/bin/python -m pytest -q tests/unit/test_distill.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlbus.consumers.collate import collate
from rlbus.schemas.config_io import from_dict
from rlbus.schemas.errors import ConfigError
from rlbus.schemas.wire import SampleMeta
from rlbus.trainer import algorithms as A
from tests.unit.test_rollout_correction import MASKS, make_mask, verl  # noqa: F401 - verl is a fixture

torch.set_num_threads(1)

B, T = 6, 20


def inputs(kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(behaviour, teacher, mask) [B, T]: log-probs of sampled tokens, 0 off the mask as collate makes them."""
    g = torch.Generator().manual_seed(seed)
    mask = make_mask(kind, g, B, T)
    behaviour = -torch.rand(mask.shape, generator=g) * 3 * mask
    teacher = -torch.rand(mask.shape, generator=g) * 8 * mask
    return behaviour, teacher, mask


def tinker_reference(behaviour: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, coef: float,
                     discount: float) -> torch.Tensor:  # fmt: skip
    """tinker-cookbook's incorporate_kl_penalty (distillation/train_on_policy.py) on one datum per row, on an
    advantage of 0: reverse_kl = (sampled - teacher) * mask; kl_advantages = -coef * mask * reverse_kl, then
    discounted_future_sum_vectorized (rl/metrics.py: out[t] = x[t] + gamma * out[t + 1]) when discount > 0."""
    out = []
    for b, q, m in zip(behaviour.numpy(), teacher.numpy(), mask.numpy()):
        reverse_kl = (b - q) * m
        kl_adv = -coef * m * reverse_kl
        if discount > 0:
            acc, disc = 0.0, np.zeros_like(kl_adv)
            for t in range(len(kl_adv) - 1, -1, -1):
                acc = kl_adv[t] + discount * acc
                disc[t] = acc
            kl_adv = disc
        out.append(torch.from_numpy(kl_adv))
    return torch.stack(out)


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("seed", range(3))
def test_pure_distillation_is_tinker_cookbooks_advantage(kind: str, seed: int) -> None:
    behaviour, teacher, mask = inputs(kind, seed)
    spec = A.DistillSpec(weight=1.0)
    data = {"rollout_log_probs": behaviour, "teacher_log_probs": teacher}
    got = A.mix_distill(torch.randn(mask.shape), data, mask, spec)
    torch.testing.assert_close(got, tinker_reference(behaviour, teacher, mask, 1.0, 0.0))
    assert (got[mask == 0] == 0).all()


@pytest.mark.parametrize("discount", [0.5, 0.9, 0.99])
@pytest.mark.parametrize("seed", range(3))
def test_the_discount_is_tinkers_on_a_single_turn(discount: float, seed: int) -> None:
    """One turn: the generated tokens are contiguous (then padding), where tinker's discount over positions and this
    one over generated tokens agree; tinker's values on positions after the response are 0 there too."""
    behaviour, teacher, mask = inputs("ragged", seed)
    got = A.distill_advantages(behaviour, teacher, mask, A.DistillSpec(weight=1.0, discount=discount))
    torch.testing.assert_close(got, tinker_reference(behaviour, teacher, mask, 1.0, discount) * mask)


def test_the_discount_passes_over_inserted_tokens() -> None:
    """Tool output between two turns (mask 0) is neither a term nor a step: as if the turns were adjacent."""
    k = torch.tensor([[1.0, 2.0, 0.0, 0.0, 4.0, 8.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])
    got = A.distill_advantages(k, torch.zeros_like(k), mask, A.DistillSpec(weight=1.0, discount=0.5))
    adjacent = A.distill_advantages(k[:, [0, 1, 4, 5]], torch.zeros(1, 4), torch.ones(1, 4),
                                    A.DistillSpec(weight=1.0, discount=0.5))  # fmt: skip
    torch.testing.assert_close(got[:, [0, 1, 4, 5]], adjacent)
    assert got[0, 2] == got[0, 3] == 0
    torch.testing.assert_close(adjacent, -torch.tensor([[1 + 0.5 * 6, 2 + 0.5 * 8, 4 + 0.5 * 8, 8.0]]))


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("clamp", [0.0, 0.5, 2.0])
def test_equal_to_verls_policy_gradient_distillation(verl, kind: str, clamp: float) -> None:
    """verl's use_policy_gradient path: advantages = -distillation_losses, where distillation_losses =
    kl_penalty(log_prob, teacher_logprobs, "k1"), clamped to [-loss_max_clamp, loss_max_clamp] when set (verl's
    log_prob is the updating policy's; at a step's first update of fresh samples, the behaviour one given here)."""
    behaviour, teacher, mask = inputs(kind, 7)
    losses = verl.core.kl_penalty(logprob=behaviour, ref_logprob=teacher, kl_penalty="k1")
    if clamp:
        losses = losses.clamp(min=-clamp, max=clamp)
    got = A.distill_advantages(behaviour, teacher, mask, A.DistillSpec(weight=1.0, kl_clamp=clamp))
    torch.testing.assert_close(got, -losses * mask)


def test_mixing_weights_the_environment_and_the_teacher() -> None:
    behaviour, teacher, mask = inputs("holes", 3)
    data = {"rollout_log_probs": behaviour, "teacher_log_probs": teacher}
    env = torch.randn(B, T) * mask
    kl = A.distill_advantages(behaviour, teacher, mask, A.DistillSpec(weight=1.0))
    for w in (0.25, 0.5, 0.9):
        torch.testing.assert_close(A.mix_distill(env, data, mask, A.DistillSpec(weight=w)), (1 - w) * env + w * kl)
    off = A.mix_distill(env, {"rollout_log_probs": behaviour}, mask, A.DistillSpec())  # no teacher needed
    assert off is env
    # a teacher that is the behaviour policy: no signal at all
    same = A.mix_distill(env, {"rollout_log_probs": behaviour, "teacher_log_probs": behaviour}, mask,
                         A.DistillSpec(weight=1.0))  # fmt: skip
    assert (same == 0).all()


def test_metrics_are_per_generated_token() -> None:
    behaviour = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, 0.0, 0.0]])
    teacher = torch.tensor([[0.0, -3.0, -2.5, 0.0], [0.0, -4.5, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    sums: dict[str, tuple[float, float]] = {}
    A.mix_distill(torch.zeros(2, 4), {"rollout_log_probs": behaviour, "teacher_log_probs": teacher}, mask,
                  A.DistillSpec(weight=1.0, kl_clamp=1.0), lambda n, v, w: sums.__setitem__(n, (v, w)))  # fmt: skip
    assert sums["distill/reverse_kl"] == pytest.approx((2.0 + 0.5 + 4.0, 3.0))  # before the clamp
    assert sums["distill/teacher_log_prob"] == pytest.approx((-10.0, 3.0))
    assert sums["distill/clamped_frac"] == pytest.approx((2.0, 3.0))  # 2.0 and 4.0 exceed the clamp of 1


def test_spec_from_config_and_the_batch_field_it_needs() -> None:
    cfg = from_dict({"model": {"path": "m"}, "algorithm": {"distill": {"teacher": "t", "weight": 0.3, "discount": 0.9,
                                                                        "kl_clamp": 5.0}}})  # fmt: skip
    assert A.DistillSpec.from_config(cfg.algorithm) == A.DistillSpec(weight=0.3, discount=0.9, kl_clamp=5.0)
    assert A.DistillSpec.from_config(cfg.algorithm).batch_keys == ("teacher_log_probs",)
    # off: weight 0, or no teacher; then a batch recorded without teacher_log_probs still trains (and replays)
    for distill in ({"teacher": "t", "weight": 0.0}, {}):
        off = from_dict({"model": {"path": "m"}, "algorithm": {"distill": distill}})
        assert not off.algorithm.distill.enabled
        assert A.DistillSpec.from_config(off.algorithm).batch_keys == ()


@pytest.mark.parametrize("distill,extra,field", [
    ({"teacher": "t", "weight": 1.5}, {}, "algorithm.distill.weight"),
    ({"teacher": "t", "weight": -0.1}, {}, "algorithm.distill.weight"),
    ({"weight": 0.5}, {}, "algorithm.distill.weight"),  # a mix with no teacher
    ({"teacher": "t", "discount": 1.0}, {}, "algorithm.distill.discount"),
    ({"teacher": "t", "kl_clamp": -1.0}, {}, "algorithm.distill.kl_clamp"),
    ({"teacher": "t", "batch_size": 0}, {}, "algorithm.distill.batch_size"),
    ({"teacher": "t", "dtype": "int8"}, {}, "algorithm.distill.dtype"),
    ({"teacher": "t"}, {"trainer": {"dynamic_sampling": True}}, "trainer.dynamic_sampling"),
    ({"teacher": "t"}, {"rollout": {"engine": {"type": "simulated"}}}, "algorithm.distill.teacher"),
])  # fmt: skip
def test_bad_settings_are_config_errors_naming_the_field(distill: dict, extra: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        from_dict({"model": {"path": "m"}, "algorithm": {"distill": distill}, **extra})
    assert str(e.value).startswith(field), str(e.value)


def _sample(key: str, prompt: list[int], response: list[int], mask: list[int],
            teacher: list[float] | None) -> tuple[SampleMeta, dict[str, torch.Tensor]]:  # fmt: skip
    meta = SampleMeta(key=key, prompt_len=len(prompt), response_len=len(response), reward=1.0)
    t = {"prompt_ids": torch.tensor(prompt), "response_ids": torch.tensor(response),
         "response_mask": torch.tensor(mask), "rollout_log_probs": -torch.ones(len(response)),
         "versions": torch.zeros(len(response), dtype=torch.long)}  # fmt: skip
    if teacher is not None:
        t["teacher_log_probs"] = torch.tensor(teacher)
    return meta, t


def test_collate_places_teacher_log_probs_with_the_tokens() -> None:
    a = _sample("g/0", [1, 2, 3], [10, 11, 20, 12], [1, 1, 0, 1], [-0.5, -1.5, -9.0, -2.5])
    b = _sample("g/1", [1, 2], [14], [1], [-0.25])
    batch = collate([a, b], [0, 0])
    assert batch["teacher_log_probs"].tolist() == [[0, 0, 0, -0.5, -1.5, 0.0, -2.5], [0, 0, -0.25, 0, 0, 0, 0]]
    assert "teacher_log_probs" not in collate([_sample("g/0", [1], [2], [1], None)], [0]).keys()
    with pytest.raises(ValueError, match="all or none"):
        collate([a, _sample("g/1", [1, 2], [14], [1], None)], [0, 0])
    with pytest.raises(ValueError, match="teacher_log_probs has 2 entries for 1 tokens"):
        collate([_sample("g/0", [1], [2], [1], [-1.0, -2.0])], [0])
