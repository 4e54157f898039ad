"""Shared-prefix packing: the samples of a GRPO group share their prompt, so the forward runs it once per group.

A group's n samples start with the same prompt tokens (the agent loop's first turn), and the trainer's batch holds
each sample whole ([prompt | response | pad], consumers/collate.py): a forward over it computes the prompt's hidden
states n times, identically (a causal model's state at position t depends on tokens 0..t alone), and a backward
sends n copies of the same gradients through them. Packed, a group is one row

    [shared prefix | sample 1's rest | sample 2's rest | ... ]

with a 4-D attention mask (each rest attends to the prefix and causally to itself, never to another sample's
rest) and position ids that restart after the prefix for every rest, so every token sees exactly the context and
position it has in its own row: the same tensors, within float rounding, from fewer token-positions. The output head
then scores only the positions the loss reads (the policy's own tokens, `response_mask`), each from the hidden state
before it: a rest's first token from the prefix's last position, which its n samples share.

Packing does not always pay: a packed row's attention costs its length squared, n rests together, where the plain
rows cost n (prefix + rest) squared. `plan` packs a group only when a cost model of the forward (token-positions
times the per-token matmuls, plus query-key pairs times the attention's cost per pair) says it is cheaper:
two-digit addition (34 prompt tokens, 8 samples of at most 8 tokens) runs 3.4x fewer token-positions; 8 GSM8K
samples of 512 tokens after a 200-token prompt stay unpacked. The prefix is the group's longest common prefix
(the prompt, or more where every sample begins its reply alike), at most every sample's length less one.

The same layout packs whole samples (`pack_row_b`; `trainer.pack_samples`, planned by trainer/batching.py): a row
`[sample 1 | sample 2 | ...]` of units without a prefix, each attending causally to itself alone (a block-diagonal
causal mask), position ids restarting at 0 for each. Hugging Face's SDPA attention takes the 4-D boolean mask as is,
on CPU and GPU, and computes the row's whole square; a varlen kernel (flash-attention's, from position ids that
restart) would skip the blocks between samples and is not wired here.

    .venv/bin/python -m pytest -q tests/unit/test_packing.py tests/integration/test_fsdp.py tests/unit/test_batching.py
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Selection:
    """Positions the output head scores: `src_N` indexes the flattened [rows * length] hidden states, `targets_N` the
    tokens they predict; (`dst_rows_N`, `dst_pos_N`) is where each score goes in the caller's [b, T] layout."""

    src_N: torch.Tensor
    targets_N: torch.Tensor
    dst_rows_N: torch.Tensor
    dst_pos_N: torch.Tensor


@dataclass(frozen=True)
class Packing:
    """One micro-batch's model inputs, packed or plain, and what the head scores."""

    input_ids: torch.Tensor  # [G, Lp]
    position_ids: torch.Tensor  # [G, Lp]
    attention_mask: torch.Tensor  # [G, 1, Lp, Lp] bool (packed) or [G, Lp] (plain rows, right-padded)
    select: Selection
    num_packed_groups: int  # groups whose shared prefix runs once (0 and no packed samples: the plain rows)
    num_positions: int  # real token-positions the forward runs (sum over its rows)


def common_prefix(ids_nL: torch.Tensor, lengths_n: torch.Tensor) -> int:
    """Length of the tokens every row begins with, capped so that each row keeps at least one token of its own."""
    cap = int(lengths_n.min()) - 1
    if cap <= 0 or ids_nL.shape[0] < 2:
        return 0
    same_L = (ids_nL[:, :cap] == ids_nL[:1, :cap]).all(dim=0)
    differs = torch.nonzero(~same_L)
    return int(differs[0]) if len(differs) else cap


def forward_cost(row_lengths: list[int], *, hidden_size: int, dense: bool = False) -> float:
    """Relative cost of a forward over rows of these lengths: per token-position the layers' matmuls (about 12 H^2
    multiply-adds a layer), per query-key pair the attention's 2 H (scores, then values). Plain rows count their
    causal pairs; a packed row (`dense`) every pair of its square mask, which attention computes whole."""
    pairs = (lambda n: n * n) if dense else (lambda n: n * (n + 1) / 2)
    return sum(n + pairs(n) * 2 / (12 * hidden_size) for n in row_lengths)


def group_units(input_ids_bL: torch.Tensor, lengths_b: torch.Tensor, group_b: torch.Tensor, hidden_size: int,
                 share: bool) -> list[tuple[int, list[int]]]:
    """(prefix, member rows) per group whose packed row is cheaper, else (0, [i]) per row of it: the units a packed
    row is made of (trainer/batching.py plans micro-batches of them)."""
    lengths = [int(n) for n in lengths_b]
    rows_of: dict[int, list[int]] = {}
    for i, g in enumerate(group_b.tolist()):
        rows_of.setdefault(g, []).append(i)
    units: list[tuple[int, list[int]]] = []
    for rows in rows_of.values():
        prefix = common_prefix(input_ids_bL[rows], lengths_b[rows]) if share and len(rows) > 1 else 0
        row_len = prefix + sum(lengths[i] - prefix for i in rows)
        if prefix > 0 and forward_cost([row_len], hidden_size=hidden_size, dense=True) < forward_cost(
                [lengths[i] for i in rows], hidden_size=hidden_size):
            units.append((prefix, rows))
        else:
            units.extend((0, [i]) for i in rows)
    return units


def plan(
    input_ids_bL: torch.Tensor,
    lengths_b: torch.Tensor,
    group_b: torch.Tensor,
    response_mask_bL: torch.Tensor,
    *,
    hidden_size: int,
    share: bool = True,
    pack_row_b: torch.Tensor | None = None,
) -> Packing:
    """Pack each group of the micro-batch whose packed row is cheaper (`forward_cost`); the others stay plain rows.

    input_ids_bL: right-padded rows; lengths_b: their real lengths; group_b: GRPO group of each row (rows of one
    group share their prompt); response_mask_bL: the positions the head scores. share=False: plain rows only.
    pack_row_b: the rows trainer/batching.py planned (`trainer.micro_batch_tokens`): samples with the same id share
    a row, as the units `group_units` makes of them, each unit attending to itself alone.
    """
    b = input_ids_bL.shape[0]
    lengths = [int(n) for n in lengths_b]
    # Packed rows, each a list of units (prefix length, member rows): a unit's members share its first `prefix`
    # tokens, run once; a plain row is [(0, [i])].
    if pack_row_b is not None:  # the planned rows, each its units as `group_units` makes them of its members
        members: dict[int, list[int]] = {}
        for i, r in enumerate(pack_row_b.tolist()):
            members.setdefault(r, []).append(i)
        layout = [[(prefix, [rows[j] for j in unit]) for prefix, unit in
                   group_units(input_ids_bL[rows], lengths_b[rows], group_b[rows], hidden_size, share)]
                  for rows in members.values()]  # fmt: skip
    else:
        layout = [[unit] for unit in group_units(input_ids_bL, lengths_b, group_b, hidden_size, share)]
    row_lens = [sum(prefix + sum(lengths[i] - prefix for i in rows) for prefix, rows in units) for units in layout]
    num_packed = sum(1 for units in layout for prefix, _ in units if prefix > 0)
    dst_rows, dst_pos = torch.nonzero(response_mask_bL[:, 1:] > 0, as_tuple=True)
    dst_pos = dst_pos + 1  # a scored token t is predicted by the hidden state at t - 1
    targets = input_ids_bL[dst_rows, dst_pos]
    if all(len(units) == 1 and units[0][0] == 0 for units in layout):  # plain rows in their own order: the forward
        Lp = max(1, max(lengths))  # the trainer always ran
        return Packing(
            input_ids=input_ids_bL[:, :Lp],
            position_ids=torch.arange(Lp).expand(b, Lp) * (torch.arange(Lp)[None] < lengths_b[:, None]),
            attention_mask=(torch.arange(Lp)[None] < lengths_b[:, None]).long(),
            select=Selection(dst_rows * Lp + dst_pos - 1, targets, dst_rows, dst_pos),
            num_packed_groups=0,
            num_positions=sum(lengths),
        )
    G, Lp = len(layout), max(row_lens)
    ids_GL = torch.zeros(G, Lp, dtype=input_ids_bL.dtype)
    pos_GL = torch.zeros(G, Lp, dtype=torch.long)
    unit_GL = torch.full((G, Lp), -1, dtype=torch.long)  # the unit a position belongs to; -1: padding
    seg_GL = torch.zeros(G, Lp, dtype=torch.long)  # 0: its unit's shared prefix, j >= 1: member j's rest
    # Where each source row's position u lands: packed row, and packed position u + start (u < prefix: the unit's
    # shared prefix) or u + shift (its own rest).
    where_row = torch.zeros(b, dtype=torch.long)
    start_b = torch.zeros(b, dtype=torch.long)
    shift_b = torch.zeros(b, dtype=torch.long)
    prefix_b = torch.zeros(b, dtype=torch.long)
    for g, units in enumerate(layout):
        at = 0
        for unit, (prefix, rows) in enumerate(units):
            start = at
            ids_GL[g, at:at + prefix] = input_ids_bL[rows[0], :prefix]
            pos_GL[g, at:at + prefix] = torch.arange(prefix)
            unit_GL[g, at:at + prefix] = unit
            at += prefix
            for j, i in enumerate(rows, start=1):
                rest = lengths[i] - prefix
                ids_GL[g, at:at + rest] = input_ids_bL[i, prefix:lengths[i]]
                pos_GL[g, at:at + rest] = torch.arange(prefix, lengths[i])
                unit_GL[g, at:at + rest] = unit
                seg_GL[g, at:at + rest] = j
                where_row[i], start_b[i], shift_b[i], prefix_b[i] = g, start, at - prefix, prefix
                at += rest
    q, k = torch.arange(Lp)[:, None], torch.arange(Lp)[None, :]
    unit_q, unit_k = unit_GL[:, :, None], unit_GL[:, None, :]
    seg_q, seg_k = seg_GL[:, :, None], seg_GL[:, None, :]
    # Causal, within one unit, to its shared prefix or to the same member's own tokens: never another sample's.
    allowed = (k <= q) & (unit_k >= 0) & (unit_k == unit_q) & ((seg_k == 0) | (seg_k == seg_q))
    allowed |= (q == k) & (unit_q < 0)  # a padding position sees itself: no all-masked row (NaN in attention)
    u = dst_pos - 1
    src = where_row[dst_rows] * Lp + u + torch.where(u >= prefix_b[dst_rows], shift_b[dst_rows], start_b[dst_rows])
    return Packing(
        input_ids=ids_GL,
        position_ids=pos_GL,
        attention_mask=allowed[:, None],
        select=Selection(src, targets, dst_rows, dst_pos),
        num_packed_groups=num_packed,
        num_positions=sum(row_lens),
    )
