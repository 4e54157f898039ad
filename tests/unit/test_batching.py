"""Token-budget micro-batches (trainer/batching.py) and sample packing (trainer/packing.py, pack_samples).

    .venv/bin/python -m pytest -q tests/unit/test_batching.py
"""

from __future__ import annotations

import random

import msgspec
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlbus.schemas.config import TrainerConfig
from rlbus.trainer import batching, logprobs, packing


def _lengths(seed: int, n: int = 40, lo: int = 20, hi: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_every_row_once_and_the_budget_kept(seed: int, pack: bool) -> None:
    lengths = _lengths(seed) + [700]  # one sample longer than the budget
    budget = 512
    batches = batching.plan(lengths, budget, pack=pack)
    flat = [i for mb in batches for row in mb for i in row]
    assert sorted(flat) == list(range(len(lengths)))  # every row exactly once
    for mb in batches:
        if any(lengths[i] > budget for row in mb for i in row):
            assert mb == [[len(lengths) - 1]]  # the long one alone
        else:
            assert batching.padded_tokens(mb, lengths) <= budget
        assert all(len(row) == 1 for row in mb) or pack


@pytest.mark.parametrize("seed", range(3))
def test_sorted_budget_pads_less_than_counted_micro_batches_and_packing_less_still(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [int(30 * 10 ** rng.random()) for _ in range(64)]  # a 10x spread, log-uniform: most of them short
    counted = [[[i] for i in range(a, a + 8)] for a in range(0, 64, 8)]  # micro_batch_size: 8

    def padding(batches: list[list[list[int]]]) -> float:
        return 1 - sum(lengths) / sum(batching.padded_tokens(mb, lengths) for mb in batches)

    budget, packed = batching.plan(lengths, 2048), batching.plan(lengths, 2048, pack=True)
    assert padding(packed) < 0.1 < 0.3 < padding(counted)
    assert padding(packed) < padding(budget) < padding(counted)


def test_split_rows_restores_the_order_and_falls_back_to_micro_batch_size() -> None:
    lengths = torch.tensor(_lengths(3, n=23))
    mask_BT = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).long()
    rows = torch.arange(3, 23)  # an update's rows, not the whole batch
    values_B = torch.randn(23)
    for cfg in (TrainerConfig(micro_batch_size=4), TrainerConfig(micro_batch_tokens=400),
                TrainerConfig(micro_batch_tokens=400, pack_samples=True)):  # fmt: skip
        data = {"attention_mask": mask_BT, "input_ids": torch.randint(1, 50, mask_BT.shape) * mask_BT,
                "group_index": torch.arange(23) // 4}  # random prompts: no shared prefix, every sample a unit
        parts = batching.split_rows(rows, cfg, data, hidden_size=64)
        out_B = torch.zeros(23)
        for idx in parts:
            out_B[idx] = values_B[idx] * 2  # as the engine scatters a micro-batch's results by its row indices
        assert torch.equal(out_B[rows], values_B[rows] * 2) and torch.all(out_B[:3] == 0)
        assert ("pack_row" in data) is bool(cfg.micro_batch_tokens)
        if not cfg.micro_batch_tokens:
            assert [len(p) for p in parts] == [4, 4, 4, 4, 4]
            continue
        for idx in parts:  # the forward's token-positions: rows x longest row, rows as packing.plan lays them out
            row_of = data["pack_row"][idx].tolist()
            packed = {r: [int(i) for i, q in zip(idx, row_of) if q == r] for r in row_of}
            assert batching.padded_tokens(list(packed.values()), lengths.tolist()) <= 400
        if cfg.pack_samples:
            assert any(len(set(data["pack_row"][idx].tolist())) < len(idx) for idx in parts)  # some rows shared
    no_data = batching.split_rows(rows, TrainerConfig(micro_batch_tokens=400, micro_batch_size=4), None, hidden_size=64)
    assert [len(p) for p in no_data] == [4, 4, 4, 4, 4]  # no lengths given: by count


def test_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        TrainerConfig(micro_batch_tokens=-1)
    with pytest.raises(ValueError, match="pack_samples"):
        TrainerConfig(pack_samples=True)
    cfg = msgspec.convert({"micro_batch_tokens": 4096, "pack_samples": True}, TrainerConfig)
    assert (cfg.micro_batch_tokens, cfg.pack_samples) == (4096, True)


def test_packed_samples_score_as_their_own_rows_and_see_no_other() -> None:
    """Several samples in one row: log-probs, entropies and gradients those of the plain rows; changing one sample's
    tokens changes no other sample's scores (no attention across samples)."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    model = logprobs.install(Qwen2ForCausalLM(cfg)).eval()
    lengths = torch.tensor([12, 5, 4, 7, 3, 9])
    T = 14
    ids = torch.randint(1, 97, (6, T), generator=torch.Generator().manual_seed(2))
    ids = ids * (torch.arange(T)[None] < lengths[:, None])
    mask = ((torch.arange(T)[None] >= 2) & (torch.arange(T)[None] < lengths[:, None])).float()
    group = torch.arange(6)
    coef = torch.randn(6, T, generator=torch.Generator().manual_seed(1))
    pack_row = torch.tensor([0, 1, 1, 2, 2, 3])  # [12], [5, 4], [7, 3], [9]

    def scores(ids_bT: torch.Tensor, pack: bool) -> tuple[packing.Packing, torch.Tensor, torch.Tensor]:
        p = packing.plan(ids_bT, lengths, group, mask, hidden_size=32, pack_row_b=pack_row if pack else None)
        sel = p.select
        with logprobs.scoring(model, None, 0.7, with_entropy=True, entropy_grad=True,
                              select=(sel.src_N, sel.targets_N)):  # fmt: skip
            out = model(input_ids=p.input_ids, attention_mask=p.attention_mask, position_ids=p.position_ids).logits[0]
        put = lambda col: out.new_zeros(6, T).index_put((sel.dst_rows_N, sel.dst_pos_N), out[:, col])  # noqa: E731
        return p, put(0), put(1)

    results = {}
    for pack in (False, True):
        model.zero_grad(set_to_none=True)
        p, logp, ent = scores(ids, pack)
        ((logp * coef).sum() + (ent * coef).sum()).backward()
        results[pack] = (p, logp.detach(), ent.detach(), {n: q.grad.clone() for n, q in model.named_parameters()})
    plain, packed = results[False], results[True]
    assert packed[0].input_ids.shape == (4, 12) and packed[0].num_positions == int(lengths.sum())
    assert plain[0].input_ids.shape == (6, 12)
    torch.testing.assert_close(packed[1], plain[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(packed[2], plain[2], rtol=1e-6, atol=1e-6)
    for name, grad in plain[3].items():
        torch.testing.assert_close(packed[3][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():
        changed = ids.clone()
        changed[1, :5] = (changed[1, :5] + 1) % 96 + 1  # sample 1 shares a row with sample 2
        _, logp_changed, _ = scores(changed, True)
    assert not torch.allclose(logp_changed[1], packed[1][1])
    others = [i for i in range(6) if i != 1]
    torch.testing.assert_close(logp_changed[others], packed[1][others], rtol=1e-6, atol=1e-6)


def test_groups_sharing_a_prompt_stay_whole_and_pack_beside_other_units() -> None:
    """Groups whose samples share their prompt are planned as one unit each (their prompt run once), packed rows
    hold several units, a prompt unit anywhere in its row; every sample scores as in its own plain row."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    model = logprobs.install(Qwen2ForCausalLM(cfg)).eval()
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([30, 9, 11, 10, 12, 8, 28, 16, 13, 6])
    group = torch.tensor([0, 1, 1, 1, 2, 2, 3, 4, 5, 6])  # groups 1 and 2 share a 6-token prompt each
    T = 30
    ids = torch.randint(1, 97, (10, T), generator=g)
    for rows in ([1, 2, 3], [4, 5]):
        ids[rows, :6] = ids[rows[0], :6]
    ids = ids * (torch.arange(T)[None] < lengths[:, None])
    mask = ((torch.arange(T)[None] >= 6) & (torch.arange(T)[None] < lengths[:, None])).float()
    data = {"input_ids": ids, "attention_mask": (ids > 0).long(), "group_index": group}
    trainer_cfg = TrainerConfig(micro_batch_tokens=60, pack_samples=True)
    # attention said free (hidden_size 2^20), so the cost model packs each shared prompt
    parts = batching.split_rows(torch.arange(10), trainer_cfg, data, hidden_size=1 << 20)
    rows = data["pack_row"]
    for members in ([1, 2, 3], [4, 5]):
        assert len(set(rows[members].tolist())) == 1  # a group's samples in one row
    # units by length 30, 28, 18 (group 1), 16 (sample 7), 14 (group 2), ... in rows of 30: group 2's unit goes after
    # sample 7, so its shared prompt starts mid-row
    (row_7,) = [idx.tolist() for idx in parts if 7 in idx.tolist()]
    assert rows[7] == rows[4] and row_7.index(7) < row_7.index(4)
    with torch.no_grad():
        plain = packing.plan(ids, lengths, group, mask, hidden_size=1 << 20, share=False)
        sel = plain.select
        with logprobs.scoring(model, None, 0.7, with_entropy=False, select=(sel.src_N, sel.targets_N)):
            out = model(input_ids=plain.input_ids, attention_mask=plain.attention_mask,
                        position_ids=plain.position_ids).logits[0]
        want = out.new_zeros(10, T).index_put((sel.dst_rows_N, sel.dst_pos_N), out[:, 0])
        got = torch.zeros(10, T)
        num_packed = 0
        for idx in parts:
            p = packing.plan(ids[idx], lengths[idx], group[idx], mask[idx], hidden_size=1 << 20, pack_row_b=rows[idx])
            assert p.input_ids.numel() <= 60  # the budget: rows x row length
            num_packed += p.num_packed_groups
            s = p.select
            with logprobs.scoring(model, None, 0.7, with_entropy=False, select=(s.src_N, s.targets_N)):
                out = model(input_ids=p.input_ids, attention_mask=p.attention_mask,
                            position_ids=p.position_ids).logits[0]
            got[idx] = out.new_zeros(len(idx), T).index_put((s.dst_rows_N, s.dst_pos_N), out[:, 0])
    assert num_packed == 2
    assert any(len(set(rows[idx].tolist())) < len(idx) for idx in parts)  # some row holds several units
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_group_longer_than_the_budget_is_planned_as_its_samples() -> None:
    ids = torch.randint(1, 97, (3, 20), generator=torch.Generator().manual_seed(0))
    ids[:, :10] = ids[0, :10]  # one group, a 10-token prompt shared: run once it is a row of 10 + 3 x 10 = 40
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "group_index": torch.zeros(3, dtype=torch.long)}
    for budget, rows in ((40, 1), (39, 3)):
        parts = batching.split_rows(torch.arange(3), TrainerConfig(micro_batch_tokens=budget), data,
                                    hidden_size=1 << 20)  # fmt: skip
        assert len(set(data["pack_row"].tolist())) == rows
        for idx in parts:
            p = packing.plan(ids[idx], torch.full((len(idx),), 20), data["group_index"][idx],
                             torch.ones(len(idx), 20), hidden_size=1 << 20, pack_row_b=data["pack_row"][idx])
            assert p.input_ids.numel() <= budget
