"""The ring's masks: for each rank and each ring step, which of the step's keys each of
the rank's queries sees, as the kernels take it.

A step's mask is the call's `AttentionMask` on the step's block (`AttentionMask.on_block`):
its `Intervals`, built from the global positions of the rank's query rows and the source
rank's key rows (zigzag chunks, packed documents spanning ranks, causality, the window:
`fusedpar.kernels.attention.mask`), so the kernels skip blocks no query sees; a step that
nothing sees (decided on the host, `_step_sees`) is None: it launches nothing and only
relays. One rank's masks are one int32 tensor (`mask_row`), built by device ops, saved by
``fusedpar::ring_attn`` for its backward. Which steps compute what: docs/context_parallel.md.
"""

import torch
import torch.distributed as dist

from fusedpar.kernels.attention import AttentionMask, Intervals, intervals, window_sides
from fusedpar.ops.sequence import _chunks_of, _shard


def _positions(rank: int, size: int, layout: str, s_local: int, device) -> torch.Tensor:
    """Global positions of `rank`'s tokens (sorted: the layouts keep the order)."""
    return _shard(torch.arange(s_local * size, device=device), rank, size, 0, layout)


def _step_sees(rank: int, src: int, size: int, layout: str, s_local: int, mask: AttentionMask):
    """Whether a query of `rank` can see a key of `src` under the mask's causality and
    window (documents aside): whole ring steps are skipped on the host by this."""
    left, right = window_sides(mask.causal, mask.window)
    chunk = s_local // len(_chunks_of(0, size, layout))
    for a in _chunks_of(rank, size, layout):  # query chunk a, key chunk b
        for b in _chunks_of(src, size, layout):
            reach_right = right is None or (a + 1) * chunk - 1 + right >= b * chunk
            reach_left = left is None or a * chunk - left <= (b + 1) * chunk - 1
            if reach_right and reach_left:
                return True
    return False


def mask_row(rank, size, layout, s_local, device, mask: AttentionMask, cu_seqlens=None):
    """`rank`'s masks against every source rank j in one int32 tensor (W, 4, S_local)
    on `device`: row j holds the `Intervals` (kv_lo, kv_hi, q_lo, q_hi) of the step
    whose KV comes from j, zeros where `_step_sees` skips the step. `cu_seqlens`: the
    documents of the whole packed stream (None: one sequence). Built by device ops
    only (no tensor of Python data, nothing copied from the host), so one tensor serves
    a ring call's forward and its backward (`ring_attn` saves it for the backward)."""
    total = s_local * size
    # one sequence: [0, total], made on the device
    cu = torch.arange(2, device=device) * total if cu_seqlens is None else cu_seqlens.to(device)
    mine = _positions(rank, size, layout, s_local, device)
    row = torch.zeros((size, 4, s_local), dtype=torch.int32, device=device)
    for src in range(size):
        if _step_sees(rank, src, size, layout, s_local, mask):
            theirs = _positions(src, size, layout, s_local, device)
            cut = intervals(mine, theirs, cu, cu, causal=mask.causal, window=mask.window)
            row[src] = torch.cat([cut.kv_lo, cut.kv_hi, cut.q_lo, cut.q_hi])
    return row


def unpack_masks(row, rank, size, layout, mask: AttentionMask) -> list:
    """`mask_row`'s tensor as the loops take it: a list over source ranks j of `mask`
    on the step's block (its `Intervals`: views of `row`), or None for a skipped step."""
    s_local = row.shape[-1]
    return [
        mask.on_block(Intervals(*row[src, :, None].unbind(0)))
        if _step_sees(rank, src, size, layout, s_local, mask)
        else None
        for src in range(size)
    ]


def ring_masks(ranks, size, layout, s_local, device, mask: AttentionMask, cu_seqlens=None):
    """For each rank in `ranks`, its list over source ranks (`unpack_masks`): the
    masks of a ring played in one process (`fusedpar.ops.virtual_ring`)."""
    return [
        unpack_masks(
            mask_row(rank, size, layout, s_local, device, mask, cu_seqlens),
            rank,
            size,
            layout,
            mask,
        )
        for rank in ranks
    ]


def rank_row(pg, q, layout, mask: AttentionMask, cu_seqlens) -> torch.Tensor:
    """This rank's `mask_row` over `pg`, for its shard q (B, S_local, H, D)."""
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    return mask_row(rank, size, layout, q.shape[1], q.device, mask, cu_seqlens)


def rank_masks(pg, q, layout, mask: AttentionMask, cu_seqlens, row=None) -> list:
    """This rank's row of `ring_masks` (from `row`, its `mask_row`, when given)."""
    if row is None:
        row = rank_row(pg, q, layout, mask, cu_seqlens)
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    return unpack_masks(row, rank, size, layout, mask)
