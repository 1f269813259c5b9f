"""`virtual_ring_attn`: `ring_attn`'s schedule over W simulated ranks on one device.

The full sequence is cut into every rank's shard (`layout`), the ring's own loops
(`fusedpar.ops.ring_attention.forward_schedule`, `backward_schedule`) run for all ranks
at once over a `VirtualRing` (step s of every rank before step s + 1; transfers are
copies), and the shards are put back together: the ring's exact launches, for tests of
the ring on one device (CPU too) and for the one-GPU ring benchmark.
"""

import torch

from fusedpar.kernels.attention import AttentionMask, check_attention_inputs, check_cu_seqlens
from fusedpar.ops.attention import check_packed
from fusedpar.ops.ring_attention import backward_schedule, forward_schedule
from fusedpar.ops.ring_masks import ring_masks
from fusedpar.ops.ring_transport import VirtualRing
from fusedpar.ops.sequence import (
    _chunks_of,
    _num_chunks,
    _shard,
    check_layout,
    check_sequence_length,
)


def _shards(x, size, layout, dim=1):
    return [_shard(x, r, size, dim, layout) for r in range(size)]


def _unshard(pieces, size, layout, dim=1):
    """The full tensor from every rank's piece (the inverse of `_shards`)."""
    per_rank = len(_chunks_of(0, size, layout))
    chunks = {}
    for r, piece in enumerate(pieces):
        chunks.update(zip(_chunks_of(r, size, layout), piece.chunk(per_rank, dim), strict=True))
    return torch.cat([chunks[c] for c in range(_num_chunks(size, layout))], dim)


class VirtualRingAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, size, layout, mask: AttentionMask, cu_seqlens):
        masks = ring_masks(
            range(size), size, layout, q.shape[1] // size, q.device, mask, cu_seqlens
        )
        shards = (_shards(t, size, layout) for t in (q, k, v))
        out, lse = forward_schedule(*shards, VirtualRing(size), masks)
        out = _unshard([o.to(q.dtype) for o in out], size, layout)  # rounded as ring_attn's
        lse = _unshard(lse, size, layout, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.size, ctx.layout, ctx.masks = size, layout, masks
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        size, layout = ctx.size, ctx.layout
        if dout is None:
            dout = torch.zeros_like(out)
        # delta made by each rank's first dQ launch, as ring_attn's
        dlses = [None] * size if dlse is None else _shards(dlse, size, layout, dim=2)
        outputs = zip(_shards(out, size, layout), _shards(lse, size, layout, dim=2), strict=True)
        grads = zip(_shards(dout, size, layout), dlses, strict=True)
        grads = backward_schedule(
            *(_shards(t, size, layout) for t in (q, k, v)),
            list(outputs),
            list(grads),
            (VirtualRing(size), VirtualRing(size)),
            ctx.masks,
        )
        dq, dk, dv = (
            _unshard(g, size, layout).to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True)
        )
        return dq, dk, dv, None, None, None, None


def virtual_ring_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    world_size: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: str = "zigzag",
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    cu_seqlens: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """`ring_attn`'s schedule over `world_size` simulated ranks on one device.

    q (B, S, Hq, D), k (B, S, Hkv, D) and v (B, S, Hkv, Dv) are the FULL sequence (B =
    1 for a packed stream with `cu_seqlens`). They are sharded in `layout`, the ring's
    forward and backward loops run for every rank (step s of all ranks before step s +
    1; transfers are copies), and the result is gathered back: the same (B, S, Hq, Dv)
    output (and
    LSE) as `flash_attn` (`flash_attn_varlen`) with the same mask, up to the order of
    the fp32 sums. Differentiable. For tests of the ring on one device (CPU too) and
    for the one-GPU ring benchmark; S must split into the layout's chunks (2W for
    zigzag, W for contiguous).
    """
    check_attention_inputs(q, k, v)
    check_layout(layout)
    mask = AttentionMask(causal, window, softcap, softmax_scale)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"virtual_ring_attn: world_size must be an int >= 1, got {world_size!r}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"virtual_ring_attn: q has {q.shape[1]} tokens, k and v have "
            f"{k.shape[1]}: ring attention needs one sequence"
        )
    if q.shape[1] < _num_chunks(world_size, layout):
        raise ValueError(
            f"virtual_ring_attn: {q.shape[1]} tokens cannot fill the "
            f"{_num_chunks(world_size, layout)} chunks of layout {layout!r} "
            f"at W={world_size}"
        )
    check_sequence_length(q.shape[1], world_size, layout, "virtual_ring_attn")
    check_packed(q, cu_seqlens, q.shape[1], "virtual_ring_attn")
    if cu_seqlens is not None:  # this one runs eagerly: its values are read here
        check_cu_seqlens(cu_seqlens, q.shape[1])
    if world_size == 1:  # one rank holds the sequence in order, whatever the layout
        layout = "contiguous"
    out, lse = VirtualRingAttnFunction.apply(q, k, v, world_size, layout, mask, cu_seqlens)
    return (out, lse) if return_lse else out
