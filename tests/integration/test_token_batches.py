"""Token-budget micro-batches (trainer.micro_batch_tokens, trainer.pack_samples) change no number of a step.

Real FSDP2 on two gloo ranks with the tiny Qwen2 of tests/integration/test_fsdp.py, on a batch of samples 9 to 48
tokens long (uneven ranks: 3 groups and 1): the padded path (micro_batch_size: 3), token-budget micro-batches,
and token-budget micro-batches with several samples packed per row give the same loss, metrics and gradients
(gathered whole just before AdamW steps) for every loss aggregation mode, to 1e-6: measured on an AMD EPYC, the
metrics were at most 7.2e-7 apart (relative) and every gradient tensor at most 6.0e-7 of its largest element.
Once more with groups sharing their prompt, run once per group on every path.

    .venv/bin/python -m pytest -q tests/integration/test_token_batches.py
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from rlbus.schemas.config import AlgorithmConfig, TrainerConfig
from tests.integration.test_fsdp import build_tiny_qwen2, make_batch, rank_share

LOSS_AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
BUDGET = 96  # token-positions per micro-batch: 2 rows of the longest sample (48)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


def _grads_worker(model_dir: str, algo_cfg: AlgorithmConfig, variants: list[TrainerConfig],
                  shared_prompts: bool) -> list[dict]:  # fmt: skip
    """One step per trainer config, each from the same weights: its metrics, and every optimizer update's whole
    gradients (gathered from the shards just before AdamW steps). `shared_prompts`: a group's samples share their
    prompt, and the cost model is told attention is free, so that every path runs shared prompts once."""
    from rlbus.trainer import packing
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(1)
    info = init_distributed("cpu")
    plan = packing.plan
    layouts: list[tuple[int, int, int, int]] = []  # (samples, rows, row length, prompts run once) of each forward

    def recorded_plan(input_ids_bL: torch.Tensor, *args, **kwargs) -> packing.Packing:  # noqa: ANN002, ANN003
        pack = plan(input_ids_bL, *args, **kwargs)
        layouts.append((input_ids_bL.shape[0], *pack.input_ids.shape, pack.num_packed_groups))
        return pack

    packing.plan = recorded_plan
    out = []
    for cfg in variants:
        layouts.clear()
        engine = TrainEngine(model_dir, cfg, algo_cfg, temperature=0.9)
        engine.fuse_proximal = False  # the proximal log-probs from their own no-grad pass, micro-batched alike
        if shared_prompts:
            engine.hidden_size = 1 << 20  # the cost model then packs prompts of 3-6 tokens (as in test_fsdp.py)
        grads: list[dict[str, torch.Tensor]] = []
        engine.optimizer.register_step_pre_hook(lambda *_, _e=engine, _g=grads: _g.append(
            {n: p.grad.full_tensor().clone() for n, p in _e.model.named_parameters()}))
        batch = rank_share(make_batch(T=48, seed=3, shared_prompts=shared_prompts), info.rank, info.world_size)
        metrics = engine.train_step(batch)
        out.append({"metrics": metrics, "grads": grads, "layouts": list(layouts)})
    destroy_distributed()
    return out


def _measured(m: dict) -> set[str]:  # what depends on the machine or on the layout, not on the math
    return {k for k in m if k.startswith("timing/")
            or k in ("perf/tokens_per_s", "perf/peak_rss_gb", "perf/torch_threads", "perf/forward_positions")}


# make test-fast keeps two aggregation modes (as test_fsdp.py does) and shared prompts; make test runs all four.
@pytest.mark.parametrize(("agg_mode", "shared_prompts"), [
    *[(m, False) if m in ("token-mean", "seq-mean-token-mean") else pytest.param(m, False, marks=pytest.mark.slow)
      for m in LOSS_AGG_MODES],
    ("seq-mean-token-sum", True),
])  # fmt: skip
def test_token_budget_and_packed_samples_equal_the_padded_path(tiny_model: Path, agg_mode: str,
                                                               shared_prompts: bool) -> None:
    from rlbus.trainer.dist import spawn_local

    # The proximal pass on its own (fuse_proximal off in the worker), so the no-grad pass is micro-batched too; an
    # entropy bonus (entropy with gradient); no clipping: the gradients compared are the loss's own, of one update
    # from the same weights (a second update would start from weights one float rounding apart).
    padded = TrainerConfig(micro_batch_size=3, mini_batches=1, lr=1e-3, grad_clip=1e9)
    budget = msgspec.structs.replace(padded, micro_batch_tokens=BUDGET)
    packed = msgspec.structs.replace(budget, pack_samples=True)
    algo_cfg = AlgorithmConfig(loss_agg_mode=agg_mode, off_policy="decoupled", is_cap=2.0, entropy_coeff=0.01)
    ranks = spawn_local(2, _grads_worker, str(tiny_model), algo_cfg, [padded, budget, packed], shared_prompts)
    for rank in ranks:
        base, *others = rank
        assert len(base["grads"]) == 1 and "timing/proximal_s" in base["metrics"]
        for other in others:
            m_a, m_b = base["metrics"], other["metrics"]
            assert set(m_a) - _measured(m_a) == set(m_b) - _measured(m_b)
            for k in set(m_a) - _measured(m_a):
                assert m_b[k] == pytest.approx(m_a[k], rel=1e-6, abs=1e-7), k
            for g_a, g_b in zip(base["grads"], other["grads"], strict=True):
                for name, g in g_a.items():
                    assert g.abs().max() > 0, name  # every tensor has a gradient, so the comparison means something
                    # 1e-6 of the tensor's largest element: float32 sums of the same terms in another order
                    torch.testing.assert_close(g_b[name], g, rtol=1e-6, atol=1e-6 * float(g.abs().max()), msg=name)
    # What differs is the layout: packed rows hold several samples and run the fewest padded token-positions, and
    # no budgeted forward goes past the budget (no sample or group here is longer than it).
    for rank in ranks:
        padded_positions = [sum(g * n for _, g, n, _ in r["layouts"]) for r in rank]
        assert padded_positions[2] < padded_positions[0] and padded_positions[2] <= padded_positions[1]
        assert padded_positions[2] < padded_positions[1] or shared_prompts  # rows of whole groups leave no room
        assert any(g < b for b, g, _, _ in rank[2]["layouts"])
        assert all(g * n <= BUDGET for r in rank[1:] for _, g, n, _ in r["layouts"])
        # with shared prompts, every path ran some of them once
        assert all(any(p for *_, p in r["layouts"]) for r in rank) is shared_prompts
