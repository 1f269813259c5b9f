"""Sharding a sequence over a context-parallel group, and putting it back.

| layout       | chunks | rank r holds        | per rank |
| ------------ | ------ | ------------------- | -------- |
| "zigzag"     | 2W     | chunks r and 2W-1-r | S / W    |
| "contiguous" | W      | chunk r             | S / W    |

Zigzag balances causal work: an early chunk paired with a late one. W = 4, S = 16:

    positions  0 1 | 2 3 | 4 5 | 6 7 | 8 9 | 10 11 | 12 13 | 14 15
    rank       0   | 1   | 2   | 3   | 3   | 2     | 1     | 0

`shard_sequence` (full -> local) and `gather_sequence` (local -> full) are
differentiable duals: the gradient of a shard is gathered, that of a gather sharded.
With a Ulysses group too (the hybrid, USP), each ring rank's share is split again,
contiguously, over its Ulysses group: W = 2, U = 2, S = 16, zigzag:

    positions     0-3 | 4-7 | 8-11 | 12-15
    ring rank     0   | 1   | 1    | 0
    ulysses rank  0   | 0   | 1    | 1
"""

import torch
import torch.distributed as dist

from fusedpar.comm import Group, all_gather_async, group_rank, group_size, resolve_group
from fusedpar.kernels.attention import check_cu_seqlens

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _num_chunks(size: int, layout: str) -> int:
    return 2 * size if layout == "zigzag" else size


def _chunks_of(rank: int, size: int, layout: str) -> tuple[int, ...]:
    return (rank, 2 * size - 1 - rank) if layout == "zigzag" else (rank,)


def check_sequence_length(seq_len: int, size: int, layout: str, what: str = "sequence") -> None:
    """Raise ValueError unless a full length `seq_len` splits into the layout's chunks."""
    check_layout(layout)
    chunks = _num_chunks(size, layout)
    if size > 1 and seq_len % chunks:
        raise ValueError(
            f"{what}: the full length {seq_len} must be divisible by {chunks} "
            f"({'2W' if layout == 'zigzag' else 'W'} for layout {layout!r} with W={size})"
        )


def check_crossing_groups(group: Group, ulysses_group: Group, what: str) -> None:
    """Raise ValueError unless the ring group and the Ulysses group share this rank and
    no other (on a mesh: two different axes). Local: no communication."""
    pg, ug = resolve_group(group), resolve_group(ulysses_group)
    if pg is None or ug is None:
        return
    shared = set(dist.get_process_group_ranks(pg)) & set(dist.get_process_group_ranks(ug))
    if len(shared) > 1:
        raise ValueError(
            f"{what}: the ring group and the Ulysses group overlap in ranks "
            f"{sorted(shared)}: they must be different axes of the mesh, sharing "
            f"only this rank"
        )


def _check_ulysses_split(local_len: int, ulysses: int, what: str) -> None:
    if ulysses > 1 and local_len % ulysses:
        raise ValueError(
            f"{what}: each ring rank's {local_len} tokens do not divide by the "
            f"Ulysses degree {ulysses}"
        )


def _shard(x: torch.Tensor, rank: int, size: int, dim: int, layout: str) -> torch.Tensor:
    pieces = x.chunk(_num_chunks(size, layout), dim=dim)
    return torch.cat([pieces[c] for c in _chunks_of(rank, size, layout)], dim=dim)


def _gather(x: torch.Tensor, pg, dim: int, layout: str) -> torch.Tensor:
    size = dist.get_world_size(pg)
    gathered = all_gather_async(x.movedim(dim, 0), pg).wait()
    per_rank = len(_chunks_of(0, size, layout))
    pieces = gathered.chunk(size * per_rank)  # rank-major: rank r's chunks in its order
    owner = {
        c: r * per_rank + i for r in range(size) for i, c in enumerate(_chunks_of(r, size, layout))
    }
    full = torch.cat([pieces[owner[c]] for c in range(_num_chunks(size, layout))])
    return full.movedim(0, dim)


class _ShardSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg, dim, layout):
        ctx.pg, ctx.dim, ctx.layout = pg, dim, layout
        return _shard(x, dist.get_rank(pg), dist.get_world_size(pg), dim, layout)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.pg, ctx.dim, ctx.layout), None, None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg, dim, layout):
        ctx.pg, ctx.dim, ctx.layout = pg, dim, layout
        return _gather(x, pg, dim, layout)

    @staticmethod
    def backward(ctx, grad):
        pg = ctx.pg
        shard = _shard(grad, dist.get_rank(pg), dist.get_world_size(pg), ctx.dim, ctx.layout)
        return shard, None, None, None


def shard_sequence(
    x: torch.Tensor,
    group: Group,
    *,
    dim: int = 1,
    layout: str = "zigzag",
    ulysses_group: Group = None,
):
    """This rank's part of the full sequence `x` along `dim` (every rank passes the same
    full `x`); with `ulysses_group`, its contiguous part of that over the Ulysses group
    (the hybrid layout). Backward: the gradient is gathered, so each rank gets the full
    one."""
    pg, ug = resolve_group(group), resolve_group(ulysses_group)
    dim = dim % x.dim()
    check_sequence_length(x.shape[dim], group_size(pg), layout, "shard_sequence")
    check_crossing_groups(pg, ug, "shard_sequence")
    _check_ulysses_split(x.shape[dim] // group_size(pg), group_size(ug), "shard_sequence")
    if group_size(pg) > 1:
        x = _ShardSequence.apply(x, pg, dim, layout)
    if group_size(ug) > 1:
        x = _ShardSequence.apply(x, ug, dim, "contiguous")
    return x


def gather_sequence(
    x: torch.Tensor,
    group: Group,
    *,
    dim: int = 1,
    layout: str = "zigzag",
    ulysses_group: Group = None,
):
    """The full sequence from every rank's part `x` along `dim`, in order, on every rank
    (the inverse of `shard_sequence` with the same groups). Backward: each rank keeps
    its part of the gradient (the output is replicated)."""
    pg, ug = resolve_group(group), resolve_group(ulysses_group)
    check_layout(layout)
    check_crossing_groups(pg, ug, "gather_sequence")
    dim = dim % x.dim()
    size, ulysses = group_size(pg), group_size(ug)
    if size > 1 and layout == "zigzag" and x.shape[dim] * ulysses % 2:
        raise ValueError(
            f"gather_sequence: a zigzag shard holds two equal chunks, but its "
            f"length along dim {dim} is {x.shape[dim] * ulysses}"
        )
    if ulysses > 1:
        x = _GatherSequence.apply(x, ug, dim, "contiguous")
    if size > 1:
        x = _GatherSequence.apply(x, pg, dim, layout)
    return x


def sequence_positions(
    seq_len: int,
    group: Group,
    *,
    layout: str = "zigzag",
    device=None,
    cu_seqlens: torch.Tensor | None = None,
    ulysses_group: Group = None,
) -> torch.Tensor:
    """Global positions (int64, (seq_len / (W U),), U the Ulysses degree, 1 without one)
    of this rank's tokens, for RoPE. With
    ``cu_seqlens`` (the documents of a packed stream of length `seq_len`, as in
    `fusedpar.flash_attn_varlen`) positions restart at 0 in every document. With
    `ulysses_group`, this rank's part of the hybrid layout (see the module doc)."""
    size, rank = group_size(group), group_rank(group)
    ulysses = group_size(ulysses_group)
    check_sequence_length(seq_len, size, layout, "sequence_positions")
    check_crossing_groups(group, ulysses_group, "sequence_positions")
    _check_ulysses_split(seq_len // size, ulysses, "sequence_positions")
    positions = torch.arange(seq_len, device=device)
    if cu_seqlens is not None:
        # The values are read in eager mode only (a host sync); a compiled graph leaves
        # them to the attention op that takes the same cu_seqlens.
        check_cu_seqlens(cu_seqlens, seq_len, values=not torch.compiler.is_compiling())
        starts = cu_seqlens.to(positions.device, torch.int64)
        positions = positions - starts[torch.searchsorted(starts, positions, right=True) - 1]
    if size > 1:
        positions = _shard(positions, rank, size, 0, layout)
    if ulysses > 1:
        positions = positions.chunk(ulysses)[group_rank(ulysses_group)]
    return positions
