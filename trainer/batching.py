"""How a step's rows are cut: into optimizer updates, and each update into micro-batches by count or by tokens.

`trainer.micro_batch_size` (the default) cuts an update's rows into consecutive micro-batches of that many
sequences, each padded to its longest row: one long sample sets the cost of its whole micro-batch. With
`trainer.micro_batch_tokens: N` the rows are placed first-fit decreasing (sorted longest first, each into the first
micro-batch with room) into micro-batches whose forward runs at most N token-positions, padding included: rows x
the longest row. A sample longer than N gets a micro-batch of its own. The budget wins: micro_batch_size is unused.

What is placed is a unit: one sample, or a GRPO group whose shared prompt runs once (`trainer.share_prefix`, where
trainer/packing.py's cost model says so: `packing.group_units`), kept whole so that sorting by length does not split
the groups whose prompt is shared (a group longer than N goes back to being its samples). With
`trainer.pack_samples` several units share one row, each attending causally to itself only (a block-diagonal causal
4-D mask, position ids restarting per sample). The units go first-fit decreasing into rows as long as the longest
unit (at most N), so that a packed row's square attention costs about what that unit's own row would; the rows then
go into micro-batches as units do. Either way `split_rows` records the planned rows in the batch (`pack_row`) and
`packing.plan` lays each row out from its members (a row may come out shorter than planned, where samples of one
group that were planned apart share their prompt in it, never longer).

None of this changes the loss: the engine's normaliser counts the whole update's tokens and sequences on every rank
before the first micro-batch, each row's loss terms are its own, and results are put back by row index.

    .venv/bin/python -m pytest -q tests/unit/test_batching.py tests/integration/test_token_batches.py
"""

from __future__ import annotations

from typing import Any

import torch

from rlbus.schemas.config import TrainerConfig
from rlbus.trainer import packing


def update_parts(B: int, mini_batches: int, device: Any = None,
                 rank_rows: list[int] | None = None) -> list[torch.Tensor]:
    """The rows of each of a step's `mini_batches` optimizer updates: consecutive slices of the B rows, as each rank
    cuts its own. `rank_rows` (a replay of a run recorded on several ranks, their shards concatenated in rank order:
    how many rows each held): update k trains the k-th slice of every rank's rows, as the ranks together did; one
    slice of the concatenation would give later updates other rows."""
    if not rank_rows or len(rank_rows) < 2:
        return list(torch.arange(B, device=device).tensor_split(mini_batches))
    if sum(rank_rows) != B:
        raise ValueError(f"rank_rows {rank_rows} do not add up to the batch's {B} rows")
    starts = [sum(rank_rows[:r]) for r in range(len(rank_rows))]
    per_rank = [torch.arange(a, a + n, device=device).tensor_split(mini_batches) for a, n in zip(starts, rank_rows)]
    return [torch.cat([cuts[k] for cuts in per_rank]) for k in range(mini_batches)]


def _first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Bins of positions into `sizes`, longest first, each into the first bin with room (one longer alone)."""
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        b = next((b for b, u in enumerate(used) if u + sizes[i] <= capacity), None)
        if b is None:
            bins.append([i])
            used.append(sizes[i])
        else:
            bins[b].append(i)
            used[b] += sizes[i]
    return bins


def plan(lengths: list[int], budget: int, *, pack: bool = False) -> list[list[list[int]]]:
    """Micro-batches of positions into `lengths` (of units: samples, or groups run with their prompt once), each a
    list of rows, each row a list of positions (one per row unless `pack`): first-fit decreasing under `budget`
    token-positions per micro-batch (rows x longest row).

    `pack`: the units first go first-fit decreasing into rows as long as the longest (at most `budget`), then the
    rows into micro-batches as single units would.
    """
    rows = [[i] for i in range(len(lengths))]
    if pack and lengths:
        rows = _first_fit_decreasing(lengths, min(budget, max(lengths)))
    row_lens = [sum(lengths[i] for i in row) for row in rows]
    batches: list[list[int]] = []  # rows of each micro-batch, its first the longest
    for r in sorted(range(len(rows)), key=lambda r: (-row_lens[r], r)):
        mb = next((mb for mb in batches if (len(mb) + 1) * row_lens[mb[0]] <= budget), None)
        if mb is None:
            batches.append([r])
        else:
            mb.append(r)
    return [[rows[r] for r in mb] for mb in batches]


def padded_tokens(rows: list[list[int]], lengths: list[int]) -> int:
    """Token-positions a micro-batch's forward runs: its rows times its longest row (padding included)."""
    return len(rows) * max(sum(lengths[i] for i in row) for row in rows)


def split_rows(rows: torch.Tensor, cfg: TrainerConfig, data: dict[str, torch.Tensor] | None, *,
               hidden_size: int) -> list[torch.Tensor]:
    """One rank's micro-batches of `rows` (indices into the step's batch): by `micro_batch_size`, or, given the
    batch's tensors `data`, by `micro_batch_tokens`, planned over units (`packing.group_units`: a group whose
    shared prompt runs once where that is cheaper by the cost model at `hidden_size`, else one sample). Then it also
    writes `data["pack_row"]` [B], the row each sample has in its micro-batch, which `packing.plan` lays out."""
    if not rows.numel():
        return []
    if not cfg.micro_batch_tokens or data is None:
        return list(rows.split(cfg.micro_batch_size))
    ids_bL, group_b = data["input_ids"][rows].cpu(), data["group_index"][rows].cpu()
    lengths_b = data["attention_mask"][rows].sum(dim=-1).cpu()
    lengths = lengths_b.tolist()
    size = lambda prefix, members: prefix + sum(lengths[i] - prefix for i in members)  # noqa: E731 - a unit's row
    units: list[tuple[int, list[int]]] = []
    for prefix, members in packing.group_units(ids_bL, lengths_b, group_b, hidden_size, cfg.share_prefix):
        # a group past the budget goes back to being its samples
        units += [(prefix, members)] if size(prefix, members) <= cfg.micro_batch_tokens else [(0, [i]) for i in members]
    batches = plan([size(*u) for u in units], cfg.micro_batch_tokens, pack=cfg.pack_samples)
    pack_row = data.setdefault("pack_row", torch.zeros(len(data["attention_mask"]), dtype=torch.long,
                                                       device=rows.device))  # fmt: skip
    for r, row in enumerate(row for mb in batches for row in mb):
        pack_row[rows[[i for u in row for i in units[u][1]]]] = r
    return [rows[torch.tensor([i for row in mb for u in row for i in units[u][1]], device=rows.device)]
            for mb in batches]  # fmt: skip
