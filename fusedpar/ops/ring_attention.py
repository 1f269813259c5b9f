"""`ring_attn`: exact attention over a sequence sharded on a context-parallel group.

Each rank keeps its queries; keys and values travel a ring (at the KV head count), and
each step folds one rank's block into the running output through the LSE:

| KV of rank j (step r - j) | causal, zigzag                  | causal, contiguous | else |
| ------------------------- | ------------------------------- | ------------------ | ---- |
| j == r                    | local causal block              | causal block       | full |
| j <  r                    | all q x first half of kv        | full               | full |
| j >  r                    | second half of q x all kv       | nothing            | full |

(zigzag: rank r holds chunks r and 2W-1-r; with j < r only chunk j is visible to both of
r's chunks; with j > r both of j's chunks are visible to chunk 2W-1-r only.) Partial
outputs are fp32, merged in fp32 (`fusedpar.kernels.attention_merge`).

Backward: dQ accumulates locally in fp32; each KV block's dK, dV (fp32) travel a second
ring with it, gaining this rank's contribution at each step, and arrive at the owner
after W steps. Every step uses the final LSE and ``delta = rowsum(dO * O) - dLSE``.
"""

import torch
import torch.distributed as dist

from fusedpar.comm import Group, Ring, group_size, resolve_group, tuning_agreement
from fusedpar.kernels._tuning import frozen
from fusedpar.kernels.attention import attention_forward, check_attention_inputs
from fusedpar.kernels.attention_backward import attention_backward, attention_delta
from fusedpar.kernels.attention_merge import merge_attention
from fusedpar.ops.attention import flash_attn
from fusedpar.ops.sequence import check_layout

ALL = slice(None)


def _block(rank: int, src: int, causal: bool, layout: str, s_local: int):
    """(q rows, kv rows, causal) that rank `rank` computes against the KV of `src`, or
    None when the causal mask hides all of it."""
    if not causal:
        return ALL, ALL, False
    if src == rank:
        return ALL, ALL, True
    if layout == "contiguous":
        return (ALL, ALL, False) if src < rank else None
    half = s_local // 2
    return (ALL, slice(0, half), False) if src < rank else (slice(half, None), ALL, False)


def _distinct_blocks(size: int, causal: bool, layout: str, s_local: int):
    """Every (q rows, kv rows, causal) block of the schedule, over all ranks, in one
    order: the launches to tune before the loop (every rank tunes all of them, so the
    group's tuning collectives match)."""
    blocks = []
    for rank in range(size):
        for src in range(size):
            block = _block(rank, src, causal, layout, s_local)
            if block is not None and block not in blocks:
                blocks.append(block)
    return blocks


def ring_attention_forward(q, k, v, pg, *, causal, softmax_scale, layout, overlap=True,
                           attend=attention_forward):  # fmt: skip
    """The forward ring: returns (out fp32, lse). ``overlap=False`` waits for each
    transfer before computing (the benchmark's baseline); `attend` computes one block
    (``attention_forward``'s signature; the CPU benchmark passes a torch one)."""
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    B, S, H, D = q.shape
    out = torch.empty((B, S, H, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    agreement = tuning_agreement(pg, q.device)
    for q_rows, kv_rows, block_causal in _distinct_blocks(size, causal, layout, S):
        attend(q[:, q_rows], k[:, kv_rows], v[:, kv_rows], causal=block_causal,
               softmax_scale=softmax_scale, out_dtype=torch.float32, agreement=agreement,
               tune_only=True)  # fmt: skip
    ring = Ring(pg)
    kv = [k.contiguous(), v.contiguous()]
    with frozen("the ring attention forward", agreement):
        _forward_loop(q, kv, out, lse, ring, rank, size, causal, softmax_scale, layout, overlap,
                      attend, agreement)  # fmt: skip
    return out, lse


def _forward_loop(q, kv, out, lse, ring, rank, size, causal, softmax_scale, layout, overlap,
                  attend, agreement):  # fmt: skip
    S = q.shape[1]
    for step in range(size):
        src = (rank - step) % size
        if step + 1 < size:
            incoming = ring.send_recv(kv)  # the next block travels while this one computes
            if not overlap:
                incoming = ring.wait()
        block = _block(rank, src, causal, layout, S)
        if step == 0:  # the local block covers every query row: write in place
            attend(q, kv[0], kv[1], causal=causal, softmax_scale=softmax_scale, out=out, lse=lse,
                   agreement=agreement)  # fmt: skip
        elif block is not None:
            q_rows, kv_rows, block_causal = block
            blk_out, blk_lse = attend(
                q[:, q_rows], kv[0][:, kv_rows], kv[1][:, kv_rows], causal=block_causal,
                softmax_scale=softmax_scale, out_dtype=torch.float32, agreement=agreement,
            )  # fmt: skip
            merge_attention(out[:, q_rows], lse[:, :, q_rows], blk_out, blk_lse)
        if step + 1 < size:
            kv = ring.wait() if overlap else incoming


class RingAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pg, causal, softmax_scale, layout):
        out, lse = ring_attention_forward(
            q, k, v, pg, causal=causal, softmax_scale=softmax_scale, layout=layout
        )
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pg, ctx.causal, ctx.softmax_scale, ctx.layout = pg, causal, softmax_scale, layout
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        pg = ctx.pg
        size = dist.get_world_size(pg)
        if dout is None:
            dout = torch.zeros_like(out)
        delta = attention_delta(out, dout)
        if dlse is not None:
            delta = delta - dlse
        agreement = tuning_agreement(pg, q.device)
        for q_rows, kv_rows, block_causal in _distinct_blocks(size, ctx.causal, ctx.layout,
                                                              q.shape[1]):  # fmt: skip
            attention_backward(
                dout[:, q_rows], q[:, q_rows], k[:, kv_rows], v[:, kv_rows], lse[:, :, q_rows],
                causal=block_causal, softmax_scale=ctx.softmax_scale, delta=delta[:, :, q_rows],
                accumulate=True, grad_dtype=torch.float32, agreement=agreement, tune_only=True,
            )  # fmt: skip
        with frozen("the ring attention backward", agreement):
            dq, dk, dv = _backward_loop(q, k, v, dout, lse, delta, pg, ctx.causal,
                                        ctx.softmax_scale, ctx.layout, agreement)  # fmt: skip
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _backward_loop(q, k, v, dout, lse, delta, pg, causal, softmax_scale, layout, agreement):
    """The backward ring: returns dQ and this rank's dK, dV (fp32) after W steps."""
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv_ring, grad_ring = Ring(pg), Ring(pg, tag=1)
    kv = [k.contiguous(), v.contiguous()]
    for step in range(size):
        src = (rank - step) % size
        if step + 1 < size:
            kv_ring.send_recv(kv)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        block = _block(rank, src, causal, layout, q.shape[1])
        if block is not None:
            q_rows, kv_rows, block_causal = block
            attention_backward(
                dout[:, q_rows], q[:, q_rows], kv[0][:, kv_rows], kv[1][:, kv_rows],
                lse[:, :, q_rows], causal=block_causal, softmax_scale=softmax_scale,
                delta=delta[:, :, q_rows], dq=dq[:, q_rows], dk=dk[:, kv_rows],
                dv=dv[:, kv_rows], accumulate=True, agreement=agreement,
            )  # fmt: skip
        if step > 0:  # the sums for this block from the ranks it visited before
            dk_in, dv_in = grad_ring.wait()
            dk += dk_in
            dv += dv_in
        if step + 1 < size:
            kv = kv_ring.wait()
        grad_ring.send_recv([dk, dv])  # on to the block's next holder (last: its owner)
    dk, dv = grad_ring.wait()
    return dq, dk, dv


def _check_same_shapes_across_ranks(pg, q, k) -> None:
    """On CPU (gloo) a tiny all-gather of the shapes catches ranks that disagree, which
    would otherwise crash the ring's transfers. Skipped on GPUs: it would cost a host
    sync per call."""
    if q.device.type != "cpu":
        return
    mine = torch.tensor([*q.shape, *k.shape], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(everyone, mine, group=pg)
    shapes = {tuple(t.tolist()) for t in everyone}
    if len(shapes) > 1:
        raise ValueError(f"ring_attn: ranks disagree on q/k shapes: {sorted(shapes)}")


def ring_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: str = "zigzag",
    return_lse: bool = False,
):
    """Attention over a sequence sharded along dim 1 on `group` (context parallelism).

    q (B, S_loc, Hq, D), k and v (B, S_loc, Hkv, D): this rank's shards in `layout`
    ("zigzag" or "contiguous", see `fusedpar.ops.sequence`). The result is this rank's
    shard of ``flash_attn`` on the full sequence, (B, S_loc, Hq, D), and with
    ``return_lse`` its LSE (B, Hq, S_loc) float32. With ``group=None`` or one rank this
    is `flash_attn`.
    """
    check_attention_inputs(q, k, v)
    check_layout(layout)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring_attn: q has {q.shape[1]} local tokens, k and v have "
                         f"{k.shape[1]}: they must be shards of one sequence")  # fmt: skip
    pg = resolve_group(group)
    size = group_size(pg)
    if size == 1:
        return flash_attn(q, k, v, causal=causal, softmax_scale=softmax_scale,
                          return_lse=return_lse)  # fmt: skip
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(
            f"ring_attn: zigzag needs the full length divisible by 2W = {2 * size}, but "
            f"this rank holds {q.shape[1]} tokens (full length {q.shape[1] * size})"
        )
    _check_same_shapes_across_ranks(pg, q, k)
    out, lse = RingAttnFunction.apply(q, k, v, pg, causal, softmax_scale, layout)
    return (out, lse) if return_lse else out
