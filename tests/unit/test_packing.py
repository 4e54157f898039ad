"""Shared-prefix packing gives a group's samples the log-probs, entropies and gradients of their plain rows.

    .venv/bin/python -m pytest -q tests/unit/test_packing.py
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlbus.trainer import logprobs, packing
from rlbus.trainer.engine import token_log_probs


def _batch(groups: list[tuple[list[int], list[list[int]]]], pad: int = 0):
    """Right-padded rows [prompt | response] of (prompt, responses) groups, as consumers/collate.py lays them out."""
    rows, group, plen = [], [], []
    for g, (prompt, responses) in enumerate(groups):
        for r in responses:
            rows.append(prompt + r)
            group.append(g)
            plen.append(len(prompt))
    T = max(map(len, rows)) + 2  # trailing padding, as a batch padded to a longer micro-batch has
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), T)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, plen[i]:len(row)] = 1.0
    lengths = torch.tensor([len(r) for r in rows])
    return ids, lengths, torch.tensor(group), mask


def _model(hidden: int = 32) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=97, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    return logprobs.install(Qwen2ForCausalLM(cfg)).eval()


def _scores(model, ids, lengths, group, mask, *, share: bool):
    pack = packing.plan(ids, lengths, group, mask, hidden_size=1 << 20, share=share)  # attention ~free: packing pays
    sel = pack.select
    with logprobs.scoring(model, None, 0.7, with_entropy=True, entropy_grad=True, select=(sel.src_N, sel.targets_N)):
        out = model(input_ids=pack.input_ids, attention_mask=pack.attention_mask,
                    position_ids=pack.position_ids).logits[0]
    logp = out.new_zeros(ids.shape).index_put((sel.dst_rows_N, sel.dst_pos_N), out[:, 0])
    ent = out.new_zeros(ids.shape).index_put((sel.dst_rows_N, sel.dst_pos_N), out[:, 1])
    return pack, logp, ent


GROUPS = [
    ([5, 6, 7, 8, 9], [[10, 11, 12], [10, 13], [10, 15, 16, 17], [10, 11, 18]]),  # replies begin alike
    ([20, 21], [[22], [23, 24, 25, 26, 27]]),
    ([30, 31, 32, 33], [[34, 35]]),  # a group of one sample stays a plain row
]


def test_packed_equals_plain_rows_values_and_gradients() -> None:
    model = _model()
    ids, lengths, group, mask = _batch(GROUPS)
    coef = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))

    results = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        pack, logp, ent = _scores(model, ids, lengths, group, mask, share=share)
        ((logp * coef).sum() + (ent * coef).sum()).backward()
        results[share] = (pack, logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    plain, packed = results[False], results[True]
    assert plain[0].num_packed_groups == 0 and packed[0].num_packed_groups == 2
    assert packed[0].num_positions < plain[0].num_positions == int(lengths.sum())
    torch.testing.assert_close(packed[1], plain[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[2], plain[2], rtol=1e-5, atol=1e-5)
    for name, grad in plain[3].items():
        torch.testing.assert_close(packed[3][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_plain_rows_score_the_full_logits_at_response_positions_only() -> None:
    model = _model()
    ids, lengths, group, mask = _batch(GROUPS)
    with torch.no_grad():
        _, logp, _ = _scores(model, ids, lengths, group, mask, share=False)
        attn = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        full = token_log_probs(model(input_ids=ids, attention_mask=attn).logits, ids, 0.7)
    torch.testing.assert_close(logp, full * mask, rtol=1e-5, atol=1e-5)
    assert torch.all(logp[mask == 0] == 0)


def test_prefix_is_the_longest_common_one_and_leaves_every_sample_a_token() -> None:
    ids, lengths, _, _ = _batch([GROUPS[0]])
    assert packing.common_prefix(ids, lengths) == 6  # the prompt and the first token of every reply, 10
    ids, lengths, _, _ = _batch([([1, 2, 3], [[4], [4], [4]])])
    assert packing.common_prefix(ids, lengths) == 3  # identical samples: each keeps its last token
    ids, lengths, _, _ = _batch([([1, 2, 3], [[4, 5], [4, 5, 6]])])
    assert packing.common_prefix(ids[:1], lengths[:1]) == 0  # one row: nothing to share


@pytest.mark.parametrize(("prompt", "response", "n", "hidden", "packs"), [
    (34, 8, 8, 128, True),  # the addition task: 3.4x fewer token-positions, attention still cheap
    (200, 512, 8, 896, False),  # GSM8K-like: eight 512-token replies in one row cost more attention than they save
    (200, 64, 8, 896, True),
])  # fmt: skip
def test_cost_model_packs_only_where_it_pays(prompt: int, response: int, n: int, hidden: int, packs: bool) -> None:
    ids, lengths, group, mask = _batch([(list(range(1, prompt + 1)), [[100 + j] * response for j in range(n)])])
    ids[:, prompt] = torch.arange(n) + 1000  # replies differ from their first token
    pack = packing.plan(ids, lengths, group, mask, hidden_size=hidden)
    assert (pack.num_packed_groups == 1) is packs


def test_a_micro_batch_with_nothing_to_score_still_backpropagates() -> None:
    """No response token anywhere (every row's reply masked out): the loss is 0 but still has a graph, as FSDP needs
    every rank's backward to run."""
    model = _model()
    ids, lengths, group, mask = _batch(GROUPS)
    _, logp, ent = _scores(model, ids, lengths, group, torch.zeros_like(mask), share=True)
    assert logp.shape == ids.shape and torch.all(logp == 0) and torch.all(ent == 0)
    (logp.sum() + ent.sum()).backward()
    assert all(p.grad is None or torch.all(p.grad == 0) for p in model.parameters())
