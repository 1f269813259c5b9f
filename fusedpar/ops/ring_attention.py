"""`ring_attn`: exact attention over a sequence sharded on a context-parallel group, and
`virtual_ring_attn`: the same schedule over W simulated ranks on one device.

Each rank keeps its queries; keys and values travel a ring (at the KV head count), and
each step folds one rank's block into the running output through the LSE:

| KV of rank j (step r - j) | causal, zigzag                  | causal, contiguous | else |
| ------------------------- | ------------------------------- | ------------------ | ---- |
| j == r                    | local causal block              | causal block       | full |
| j <  r                    | all q x first half of kv        | full               | full |
| j >  r                    | second half of q x all kv       | nothing            | full |

(zigzag: rank r holds chunks r and 2W-1-r; with j < r only chunk j is visible to both of
r's chunks; with j > r both of j's chunks are visible to chunk 2W-1-r only.) The running
output is fp32: step 0 writes it, later steps merge into it in the forward kernel's
epilogue (``attention_forward(merge=True)``), so no block partial is written and re-read.

Backward: dQ accumulates locally in fp32 (written at step 0, added to after); each KV
block's dK, dV (fp32) travel a second ring with it: written fresh by the block's owner
at step 0, then added to in place by every rank the block visits, arriving back at the
owner after W steps. Every step uses the final LSE and ``delta = rowsum(dO * O) - dLSE``.

The loops take a transport: `_GroupRing` (this rank's side of a `fusedpar.comm.Ring`)
or `VirtualRing` (every rank in this process, transfers replaced by copies, all ranks'
step s run before step s + 1). `virtual_ring_attn` runs the real loops over a
`VirtualRing`: the ring's exact launches, checkable and measurable on one device.
"""

import torch
import torch.distributed as dist

from fusedpar.comm import Group, Ring, group_size, resolve_group, tuning_agreement
from fusedpar.kernels._tuning import frozen
from fusedpar.kernels.attention import attention_forward, check_attention_inputs
from fusedpar.kernels.attention_backward import (
    attention_backward_dkdv,
    attention_backward_dq,
    attention_delta,
)
from fusedpar.ops.attention import flash_attn
from fusedpar.ops.sequence import (
    _chunks_of,
    _num_chunks,
    _shard,
    check_layout,
    check_sequence_length,
)

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
    """Every (q rows, kv rows, causal, first step) launch of the schedule, over all
    ranks, in one order: the launches to tune before the loop (every rank tunes all of
    them, so the group's tuning collectives match). The first step writes the block's
    results fresh; later steps merge or add into them."""
    blocks = []
    for rank in range(size):
        for step in range(size):
            block = _block(rank, (rank - step) % size, causal, layout, s_local)
            if block is not None and (*block, step == 0) not in blocks:
                blocks.append((*block, step == 0))
    return blocks


def _fresh(shape, device) -> torch.Tensor:
    """A buffer the loops write completely before reading (fp32). Tests poison it with
    NaN through this function, so an element a step fails to write shows."""
    return torch.empty(shape, dtype=torch.float32, device=device)


# --- transports ----------------------------------------------------------------------


class _GroupRing:
    """This rank's side of a ring over a process group: lists of one rank's tensors."""

    def __init__(self, pg, *, tag: int = 0):
        self._ring = Ring(pg, tag=tag)
        self.size = self._ring.size
        self.ranks = [self._ring.rank]

    def send_recv(self, per_rank):
        return [self._ring.send_recv(per_rank[0])]

    def wait(self):
        return [self._ring.wait()]


class VirtualRing:
    """`size` ranks in one process: rank r's send arrives at rank r + 1 as a copy.

    ``send_recv(per_rank)`` takes one list of tensors per rank (``ranks`` order) and
    copies them along the ring at once (the copies stand in for the transfers); ``wait``
    returns what each rank received. Misuse raises as `fusedpar.comm.Ring` does."""

    def __init__(self, size: int):
        self.size = size
        self.ranks = list(range(size))
        self._in_flight = None

    def send_recv(self, per_rank):
        if self._in_flight is not None:
            raise RuntimeError("VirtualRing.send_recv called again before wait()")
        if len(per_rank) != self.size:
            raise ValueError(f"VirtualRing: {len(per_rank)} ranks' tensors for {self.size} ranks")
        self._in_flight = [[t.clone() for t in per_rank[(r - 1) % self.size]] for r in self.ranks]
        return self._in_flight

    def wait(self):
        if self._in_flight is None:
            raise RuntimeError("VirtualRing.wait called with no send_recv in flight")
        received, self._in_flight = self._in_flight, None
        return received


# --- the loops (one list entry per rank the transport plays) --------------------------


def _forward(q, k, v, ring, *, causal, softmax_scale, layout, agreement=None, overlap=True,
             attend=attention_forward):  # fmt: skip
    """The forward schedule over `ring`; q, k, v: one shard per rank of ``ring.ranks``.
    Returns lists of out (fp32) and lse. ``overlap=False`` waits for each transfer
    before computing (the benchmark's baseline); `attend` computes one block
    (``attention_forward``'s signature; the CPU benchmark passes a torch one)."""
    size, S = ring.size, q[0].shape[1]
    for q_rows, kv_rows, block_causal, first in _distinct_blocks(size, causal, layout, S):
        attend(q[0][:, q_rows], k[0][:, kv_rows], v[0][:, kv_rows], causal=block_causal,
               softmax_scale=softmax_scale, out_dtype=torch.float32, merge=not first,
               agreement=agreement, tune_only=True)  # fmt: skip
    out = [_fresh(t.shape, t.device) for t in q]
    lse = [_fresh((t.shape[0], t.shape[2], t.shape[1]), t.device) for t in q]
    kv = [[k_i.contiguous(), v_i.contiguous()] for k_i, v_i in zip(k, v, strict=True)]
    with frozen("the ring attention forward", agreement):
        for step in range(size):
            if step + 1 < size:
                incoming = ring.send_recv(kv)  # the next blocks travel while these compute
                if not overlap:
                    incoming = ring.wait()
            for i, rank in enumerate(ring.ranks):
                block = _block(rank, (rank - step) % size, causal, layout, S)
                if block is None:
                    continue
                q_rows, kv_rows, block_causal = block  # step 0: every row, written fresh
                attend(q[i][:, q_rows], kv[i][0][:, kv_rows], kv[i][1][:, kv_rows],
                       causal=block_causal, softmax_scale=softmax_scale,
                       out=out[i][:, q_rows], lse=lse[i][:, :, q_rows], merge=step > 0,
                       agreement=agreement)  # fmt: skip
            if step + 1 < size:
                kv = ring.wait() if overlap else incoming
    return out, lse


def _backward(q, k, v, dout, lse, delta, kv_ring, grad_ring, *, causal, softmax_scale, layout,
              agreement=None):  # fmt: skip
    """The backward schedule: lists (one per rank of the rings) of dQ and of the dK, dV
    of the rank's own KV (fp32), back home after W steps."""
    size, S = kv_ring.size, q[0].shape[1]
    f32 = dict(causal=causal, softmax_scale=softmax_scale, grad_dtype=torch.float32,
               agreement=agreement)  # fmt: skip
    for q_rows, kv_rows, block_causal, first in _distinct_blocks(size, causal, layout, S):
        block_args = (dout[0][:, q_rows], q[0][:, q_rows], k[0][:, kv_rows], v[0][:, kv_rows],
                      lse[0][:, :, q_rows], delta[0][:, :, q_rows])  # fmt: skip
        tuning = {**f32, "causal": block_causal, "accumulate": not first, "tune_only": True}
        attention_backward_dq(*block_args, **tuning)
        attention_backward_dkdv(*block_args, **tuning)
    dq = [_fresh(t.shape, t.device) for t in q]
    kv = [[k_i.contiguous(), v_i.contiguous()] for k_i, v_i in zip(k, v, strict=True)]
    with frozen("the ring attention backward", agreement):
        for step in range(size):
            if step + 1 < size:
                kv_ring.send_recv(kv)
            work = []  # (rank index, q rows, kv rows, kernel kwargs, block inputs)
            for i, rank in enumerate(kv_ring.ranks):
                block = _block(rank, (rank - step) % size, causal, layout, S)
                if block is not None:
                    q_rows, kv_rows, block_causal = block
                    inputs = (dout[i][:, q_rows], q[i][:, q_rows], kv[i][0][:, kv_rows],
                              kv[i][1][:, kv_rows], lse[i][:, :, q_rows],
                              delta[i][:, :, q_rows])  # fmt: skip
                    work.append((i, q_rows, kv_rows, {**f32, "causal": block_causal}, inputs))
            for i, q_rows, _, kw, inputs in work:  # dQ needs no transfer: launched first
                attention_backward_dq(*inputs, dq=dq[i][:, q_rows], accumulate=step > 0, **kw)
            if step == 0:  # each owner starts its block's sums: written fresh, no zero fill
                grads = [[_fresh(t.shape, t.device) for t in pair] for pair in kv]
            else:  # the sums from the ranks the held blocks visited before, added to here
                grads = grad_ring.wait()
            for i, _, kv_rows, kw, inputs in work:
                dk, dv = (g[:, kv_rows] for g in grads[i])
                attention_backward_dkdv(*inputs, dk=dk, dv=dv, accumulate=step > 0, **kw)
            if step + 1 < size:
                kv = kv_ring.wait()
            grad_ring.send_recv(grads)  # on to the blocks' next holders (last: the owners)
        home = grad_ring.wait()
    return dq, [g[0] for g in home], [g[1] for g in home]


def _delta(out, dout, dlse):
    delta = attention_delta(out, dout)
    return delta if dlse is None else delta - dlse


# --- over a process group ------------------------------------------------------------


def ring_attention_forward(q, k, v, pg, *, causal, softmax_scale, layout, overlap=True,
                           attend=attention_forward):  # fmt: skip
    """This rank's forward ring over `pg`: returns (out fp32, lse). `overlap` and
    `attend` as in `_forward`."""
    out, lse = _forward([q], [k], [v], _GroupRing(pg), causal=causal,
                        softmax_scale=softmax_scale, layout=layout,
                        agreement=tuning_agreement(pg, q.device), overlap=overlap,
                        attend=attend)  # fmt: skip
    return out[0], lse[0]


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
        if dout is None:
            dout = torch.zeros_like(out)
        delta = _delta(out, dout, dlse)
        rings = _GroupRing(pg), _GroupRing(pg, tag=1)
        dq, dk, dv = _backward([q], [k], [v], [dout], [lse], [delta], *rings, causal=ctx.causal,
                               softmax_scale=ctx.softmax_scale, layout=ctx.layout,
                               agreement=tuning_agreement(pg, q.device))  # fmt: skip
        return dq[0].to(q.dtype), dk[0].to(k.dtype), dv[0].to(v.dtype), None, None, None, None


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


# --- on one device ---------------------------------------------------------------------


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
    def forward(ctx, q, k, v, size, causal, softmax_scale, layout):
        common = dict(causal=causal, softmax_scale=softmax_scale, layout=layout)
        out, lse = _forward(*(_shards(t, size, layout) for t in (q, k, v)), VirtualRing(size),
                            **common)  # fmt: skip
        out = _unshard([o.to(q.dtype) for o in out], size, layout)  # rounded as ring_attn's
        lse = _unshard(lse, size, layout, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.size, ctx.common = size, common
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        size, layout = ctx.size, ctx.common["layout"]
        if dout is None:
            dout = torch.zeros_like(out)
        delta = _delta(out, dout, dlse)
        per_rank = [_shards(t, size, layout) for t in (q, k, v, dout)]
        per_rank += [_shards(t, size, layout, dim=2) for t in (lse, delta)]
        grads = _backward(*per_rank, VirtualRing(size), VirtualRing(size), **ctx.common)
        dq, dk, dv = (_unshard(g, size, layout).to(t.dtype)
                      for g, t in zip(grads, (q, k, v), strict=True))  # fmt: skip
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
    return_lse: bool = False,
):
    """`ring_attn`'s schedule over `world_size` simulated ranks on one device.

    q (B, S, Hq, D), k and v (B, S, Hkv, D) are the FULL sequence. They are sharded in
    `layout`, the ring's forward and backward loops run for every rank (step s of all
    ranks before step s + 1; transfers are copies), and the result is gathered back:
    the same (B, S, Hq, D) output (and LSE) as ``flash_attn(q, k, v, causal=causal)``,
    up to the order of the fp32 sums. Differentiable. For tests of the ring on one
    device (CPU too) and for the one-GPU ring benchmark; S must split into the layout's
    chunks (2W for zigzag, W for contiguous).
    """
    check_attention_inputs(q, k, v)
    check_layout(layout)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"virtual_ring_attn: world_size must be an int >= 1, got {world_size!r}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"virtual_ring_attn: q has {q.shape[1]} tokens, k and v have "
                         f"{k.shape[1]}: ring attention needs one sequence")  # fmt: skip
    if q.shape[1] < _num_chunks(world_size, layout):
        raise ValueError(f"virtual_ring_attn: {q.shape[1]} tokens cannot fill the "
                         f"{_num_chunks(world_size, layout)} chunks of layout {layout!r} "
                         f"at W={world_size}")  # fmt: skip
    check_sequence_length(q.shape[1], world_size, layout, "virtual_ring_attn")
    if world_size == 1:  # one rank holds the sequence in order, whatever the layout
        layout = "contiguous"
    out, lse = VirtualRingAttnFunction.apply(q, k, v, world_size, causal, softmax_scale, layout)
    return (out, lse) if return_lse else out
