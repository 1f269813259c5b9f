"""`ring_attn`: exact attention over a sequence sharded on a context-parallel group, and
`virtual_ring_attn`: the same schedule over W simulated ranks on one device.

Each rank keeps its queries; keys and values travel a ring (at the KV head count), each
step folding one rank's block into the running output (fp32, merged in the forward
kernel's epilogue) through the LSE. `ring_masks` gives the kernels each step's visible
key and query intervals in global coordinates (zigzag chunks, packed documents spanning
ranks, causality, the window), so they skip blocks no query sees, and a step nothing
sees (decided on the host) launches nothing and only relays. Backward: dQ accumulates
locally in fp32; each block's dK, dV (fp32) travel a second ring with it, added to by
every rank it visits, arriving back at the owner after W steps; every step uses the
final LSE and ``delta = rowsum(dO * O) - dLSE``. float64 keeps every fp32 above in
float64 (`fusedpar.kernels._common.accumulator`).

The loops take a transport (`fusedpar.ops.ring_transport`): `GroupRing` (this rank's
side of a `fusedpar.comm.Ring`) or `VirtualRing` (every rank in this process, transfers
replaced by copies); `virtual_ring_attn` runs the real loops over a `VirtualRing`, the
ring's exact launches on one device. Which steps compute what: docs/context_parallel.md.
"""

import torch
import torch.distributed as dist
from torch import Tensor

from fusedpar.comm import (
    Group,
    check_same_across_ranks,
    group_by_name,
    group_name,
    group_size,
    resolve_group,
    tuning_agreement,
)
from fusedpar.kernels._common import accumulator
from fusedpar.kernels._tuning import frozen
from fusedpar.kernels.attention import (
    FUSED,
    Intervals,
    attention_backward,
    attention_backward_dkdv,
    attention_backward_dq,
    attention_backward_fused,
    attention_delta,
    attention_forward,
    check_attention_inputs,
    check_cu_seqlens,
    check_softcap,
    check_softmax_scale,
    check_window,
    delta_buffer,
    intervals,
    window_sides,
)
from fusedpar.ops.attention import (
    apply_sinks,
    check_packed,
    check_shards,
    check_sinks,
    flash_attn,
    flash_attn_varlen,
)
from fusedpar.ops.registration import autograd_op, direct_op
from fusedpar.ops.ring_transport import GroupRing, VirtualRing
from fusedpar.ops.sequence import (
    _chunks_of,
    _num_chunks,
    _shard,
    check_crossing_groups,
    check_layout,
    check_sequence_length,
)
from fusedpar.ops.ulysses import check_heads, head_parallel


def _positions(rank: int, size: int, layout: str, s_local: int, device) -> torch.Tensor:
    """Global positions of `rank`'s tokens (sorted: the layouts keep the order)."""
    return _shard(torch.arange(s_local * size, device=device), rank, size, 0, layout)


def _step_sees(rank: int, src: int, size: int, layout: str, s_local: int, causal, window):
    """Whether a query of `rank` can see a key of `src` under the causal mask and the
    window (documents aside): whole ring steps are skipped on the host by this."""
    left, right = window_sides(causal, window)
    chunk = s_local // len(_chunks_of(0, size, layout))
    for a in _chunks_of(rank, size, layout):  # query chunk a, key chunk b
        for b in _chunks_of(src, size, layout):
            reach_right = right is None or (a + 1) * chunk - 1 + right >= b * chunk
            reach_left = left is None or a * chunk - left <= (b + 1) * chunk - 1
            if reach_right and reach_left:
                return True
    return False


def mask_row(rank, size, layout, s_local, device, *, causal, window, cu_seqlens=None):
    """`rank`'s masks against every source rank j in one int32 tensor (W, 4, S_local)
    on `device`: row j holds the `Intervals` (kv_lo, kv_hi, q_lo, q_hi) of the step
    whose KV comes from j, zeros where `_step_sees` skips the step. Built by device ops
    only (no tensor of Python data, nothing copied from the host), so one tensor serves
    a ring call's forward and its backward (`ring_attn` saves it for the backward)."""
    total = s_local * size
    # one sequence: [0, total], made on the device
    cu = torch.arange(2, device=device) * total if cu_seqlens is None else cu_seqlens.to(device)
    mine = _positions(rank, size, layout, s_local, device)
    row = torch.zeros((size, 4, s_local), dtype=torch.int32, device=device)
    for src in range(size):
        if _step_sees(rank, src, size, layout, s_local, causal, window):
            cut = intervals(
                mine,
                _positions(src, size, layout, s_local, device),
                cu,
                cu,
                causal=causal,
                window=window,
            )
            row[src] = torch.cat([cut.kv_lo, cut.kv_hi, cut.q_lo, cut.q_hi])
    return row


def unpack_masks(row, rank, size, layout, *, causal, window):
    """`mask_row`'s tensor as the loops take it: a list over source ranks j of
    `Intervals` (views of `row`) or None for a skipped step."""
    s_local = row.shape[-1]
    return [
        Intervals(*row[src, :, None].unbind(0))
        if _step_sees(rank, src, size, layout, s_local, causal, window)
        else None
        for src in range(size)
    ]


def ring_masks(ranks, size, layout, s_local, device, *, causal, window, cu_seqlens=None):
    """For each rank in `ranks`, a list over source ranks j: the `Intervals` of the
    rank's queries against j's keys, or None when the step is skipped. `cu_seqlens`:
    the documents of the whole packed stream (None: one sequence)."""
    mask = dict(causal=causal, window=window)
    return [
        unpack_masks(
            mask_row(rank, size, layout, s_local, device, **mask, cu_seqlens=cu_seqlens),
            rank,
            size,
            layout,
            **mask,
        )
        for rank in ranks
    ]


def _fresh(shape, device, dtype=torch.float32) -> torch.Tensor:
    """A buffer the loops write completely before reading (fp32; `dtype`: float64 for a
    float64 ring). Tests poison it with NaN through this function, so an element a step
    fails to write shows."""
    return torch.empty(shape, dtype=dtype, device=device)


def _tuned_launches(size: int) -> tuple[bool, ...]:
    """The launches to tune before a loop, by whether they write fresh (step 0) or
    merge/add (later steps): every rank tunes all of them, so the group's tuning
    collectives match."""
    return (True, False) if size > 1 else (True,)


# --- the loops (one list entry per rank the transport plays) --------------------------


class KVBlocks:
    """What travels the rings and how a step gets K and V from it: here K and V
    themselves (contiguous), and their gradients back. `fusedpar.ops.mla_ring` passes
    a latent instead, expanded at each step and its gradient absorbed."""

    absorbs = False  # the dK/dV kernels add into the travelling gradients themselves

    def payloads(self, k, v) -> list:
        return [[k_i.contiguous(), v_i.contiguous()] for k_i, v_i in zip(k, v, strict=True)]

    def expand(self, payload):
        return payload[0], payload[1]


def forward_schedule(
    q,
    k,
    v,
    ring,
    masks,
    *,
    softmax_scale,
    softcap=0.0,
    agreement=None,
    overlap=True,
    attend=attention_forward,
    blocks=None,
):
    """The forward schedule over `ring` (`ring_attn`'s, and `mla_ring_attn`'s with its
    latent as `blocks`); q, k, v: one shard per rank of ``ring.ranks``;
    `masks` from `ring_masks`. Returns lists of out (fp32) and lse. ``overlap=False``
    waits for each transfer before computing (the benchmark's baseline); `attend`
    computes one block (``attention_forward``'s signature; the CPU benchmark passes a
    torch one); `blocks`: what travels (`KVBlocks`: K and V; k and v are then its
    inputs)."""
    size = ring.size
    blocks = blocks or KVBlocks()
    block = dict(softmax_scale=softmax_scale, softcap=softcap, agreement=agreement)
    wide = accumulator(q[0].dtype)  # the running output and LSE: fp32, float64 for float64
    kv = blocks.payloads(k, v)
    own_k, own_v = blocks.expand(kv[0])
    for first in _tuned_launches(size):
        attend(
            q[0],
            own_k,
            own_v,
            intervals=masks[0][ring.ranks[0]],
            out_dtype=wide,
            merge=not first,
            tune_only=True,
            **block,
        )
    out = [_fresh((*t.shape[:3], own_v.shape[-1]), t.device, wide) for t in q]  # (B, S, Hq, Dv)
    lse = [_fresh((t.shape[0], t.shape[2], t.shape[1]), t.device, wide) for t in q]
    with frozen("the ring attention forward", agreement):
        for step in range(size):
            if step + 1 < size:
                incoming = ring.send_recv(kv)  # the next blocks travel while these compute
                if not overlap:
                    incoming = ring.wait()
            for i, rank in enumerate(ring.ranks):
                mask = masks[i][(rank - step) % size]
                if mask is not None:  # step 0 (every row sees itself) writes fresh
                    kv_i = (own_k, own_v) if step == 0 and i == 0 else blocks.expand(kv[i])
                    attend(
                        q[i], *kv_i, intervals=mask, out=out[i], lse=lse[i], merge=step > 0, **block
                    )
            if step + 1 < size:
                kv = ring.wait() if overlap else incoming
    return out, lse


def backward_schedule(
    q,
    k,
    v,
    dout,
    lse,
    delta,
    kv_ring,
    grad_ring,
    masks,
    *,
    softmax_scale,
    softcap=0.0,
    agreement=None,
    sources=None,
    deterministic=False,
    blocks=None,
):
    """The backward schedule (`ring_attn`'s, and `mla_ring_attn`'s with its latent as
    `blocks`): lists (one per rank of the rings) of dQ and of the dK, dV
    of the rank's own KV (fp32; each of the payload's gradients with `blocks`), back
    home after W steps. `delta`: each rank's, or None
    with `sources`, each rank's (out, dlse): the first launch, on the rank's own block,
    makes delta from them (as `attention_backward` does) for every launch after it.

    Each step runs the fused backward (one kernel: dK, dV and dQ) or the split one (dQ,
    launched before the gradients arrive, then dK/dV), as the tuner picks for the own
    block (`attention_backward`'s pick, agreed over the group; the split one when
    `deterministic`). `blocks` as in `forward_schedule`: where it `absorbs`, each step's dK, dV
    go into fp32 scratch and `blocks.absorb` turns them into the travelling payload's
    gradient."""
    size = kv_ring.size
    blocks = blocks or KVBlocks()
    kv = blocks.payloads(k, v)
    wide = accumulator(q[0].dtype)  # dQ, dK, dV sums and delta: fp32, float64 for float64
    f32 = dict(softmax_scale=softmax_scale, softcap=softcap, grad_dtype=wide, agreement=agreement)
    made = [{} for _ in q]  # per rank: the first dQ launch's out and dlse, where it makes delta
    if delta is None:
        delta = [delta_buffer(t.shape, t.device, wide) for t in lse]
        for i, rank in enumerate(kv_ring.ranks):
            out, dlse = sources[i]
            if masks[i][rank] is None:  # no own block to start on (never at step 0 today)
                attention_delta(out, dout[i], dlse, delta[i])
            else:
                made[i] = {"out": out, "dlse": dlse}
    own = (dout[0], q[0], *blocks.expand(kv[0]), lse[0], delta[0])
    pick = attention_backward(
        *own[:5],
        delta=own[5],
        **f32,
        intervals=masks[0][kv_ring.ranks[0]],
        accumulate=True,
        tune_only=True,
        deterministic=deterministic,
    )
    fused = pick is FUSED  # (a ring step adds into fp32: no platform kernel is a candidate)
    for first in _tuned_launches(size):
        tuning = {
            **f32,
            "intervals": masks[0][kv_ring.ranks[0]],
            "accumulate": not first,
            "tune_only": True,
        }
        if fused:
            attention_backward_fused(*own, **tuning, **(made[0] if first else {}))
            continue
        attention_backward_dq(*own, **tuning, **(made[0] if first else {}))
        attention_backward_dkdv(*own, **tuning)
    dq = [_fresh(t.shape, t.device, wide) for t in q]
    with frozen("the ring attention backward", agreement):
        for step in range(size):
            if step + 1 < size:
                kv_ring.send_recv(kv)
            work = []  # (rank index, kernel kwargs, block inputs)
            for i, rank in enumerate(kv_ring.ranks):
                mask = masks[i][(rank - step) % size]
                if mask is not None:  # (the own block's K, V: expanded for the tuning)
                    kv_i = own[2:4] if step == 0 and i == 0 else blocks.expand(kv[i])
                    inputs = (dout[i], q[i], *kv_i, lse[i], delta[i])
                    work.append((i, {**f32, "intervals": mask, "accumulate": step > 0}, inputs))
            for i, kw, inputs in work:  # dQ needs no transfer: launched first
                if not fused:
                    attention_backward_dq(*inputs, dq=dq[i], **kw, **(made[i] if step == 0 else {}))
            if step == 0:  # each owner starts its block's sums: written fresh, no zero fill
                grads = [[_fresh(t.shape, t.device, wide) for t in pair] for pair in kv]
            else:  # the sums from the ranks the held blocks visited before, added to here
                grads = grad_ring.wait()
            for i, kw, inputs in work:
                if blocks.absorbs:  # (zeros: added into from step 1 on, as dQ is)
                    dk, dv = (
                        torch.zeros(t.shape, dtype=wide, device=t.device) for t in inputs[2:4]
                    )
                else:
                    dk, dv = grads[i]
                if fused:
                    attention_backward_fused(
                        *inputs, dq=dq[i], dk=dk, dv=dv, **kw, **(made[i] if step == 0 else {})
                    )
                else:
                    attention_backward_dkdv(*inputs, dk=dk, dv=dv, **kw)
                if blocks.absorbs:
                    blocks.absorb(kv[i], dk, dv, grads[i], first=step == 0)
            if step + 1 < size:
                kv = kv_ring.wait()
            grad_ring.send_recv(grads)  # on to the blocks' next holders (last: the owners)
        home = grad_ring.wait()
    return dq, *([g[j] for g in home] for j in range(len(home[0])))


# --- over a process group ------------------------------------------------------------


def ring_attention_forward(
    q,
    k,
    v,
    pg,
    *,
    causal,
    softmax_scale,
    layout,
    window=(-1, -1),
    softcap=0.0,
    cu_seqlens=None,
    overlap=True,
    attend=attention_forward,
    masks=None,
):
    """This rank's forward ring over `pg`: returns (out fp32, lse). `overlap` and
    `attend` as in `forward_schedule`; `masks`: this rank's row of `ring_masks` (built here
    when not given)."""
    if masks is None:
        masks = rank_masks(pg, q, causal, layout, window, cu_seqlens)
    out, lse = forward_schedule(
        [q],
        [k],
        [v],
        GroupRing(pg),
        [masks],
        softmax_scale=softmax_scale,
        softcap=softcap,
        agreement=tuning_agreement(pg, q.device),
        overlap=overlap,
        attend=attend,
    )
    return out[0], lse[0]


# --- custom ops: fusedpar::ring_attn and its backward -------------------------------------
# The group crosses the op boundary by name. The ring's masks (`mask_row`) are built once
# per call, outside the ops, and saved for the backward: a (W, 4, S_local) int32 tensor,
# 16 bytes a token per ring rank (less than one head of q), where rebuilding them in the
# backward costs W searchsorted launches again. Passed ``masks=None`` (a direct call of
# the op), each op builds them itself.


@torch.library.custom_op("fusedpar::ring_attn", mutates_args=())
def _ring_attn_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: str,
    causal: bool,
    softmax_scale: float | None,
    layout: str,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
    cu_seqlens: Tensor | None,
    masks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    pg = group_by_name(group)
    check_same_across_ranks(
        pg, [*q.shape, *k.shape, v.shape[-1]], "ring_attn: q/k/v shapes", q.device
    )
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, q.shape[1] * dist.get_world_size(pg))
    masks = rank_masks(pg, q, causal, layout, (window_left, window_right), cu_seqlens, masks)
    out, lse = ring_attention_forward(
        q,
        k,
        v,
        pg,
        causal=causal,
        softmax_scale=softmax_scale,
        layout=layout,
        softcap=softcap,
        masks=masks,
    )
    return out.to(q.dtype), lse


@_ring_attn_op.register_fake
def _(q, k, v, *args):  # fresh, contiguous (the kernels' layout), any inputs
    B, S, H, _ = q.shape
    return q.new_empty((B, S, H, v.shape[-1])), q.new_empty((B, H, S), dtype=accumulator(q.dtype))


@torch.library.custom_op("fusedpar::ring_attn_backward", mutates_args=())
def _ring_attn_backward_op(
    dout: Tensor,
    dlse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    group: str,
    causal: bool,
    softmax_scale: float | None,
    layout: str,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
    cu_seqlens: Tensor | None,
    masks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    pg = group_by_name(group)
    masks = rank_masks(pg, q, causal, layout, (window_left, window_right), cu_seqlens, masks)
    rings = GroupRing(pg), GroupRing(pg, tag=1)
    # delta = rowsum(dO * O) - dLSE: made by the first launch (the own block's)
    dq, dk, dv = backward_schedule(
        [q],
        [k],
        [v],
        [dout],
        [lse],
        None,
        *rings,
        [masks],
        softmax_scale=softmax_scale,
        softcap=softcap,
        agreement=tuning_agreement(pg, q.device),
        sources=[(out, dlse)],
        deterministic=deterministic,
    )
    return dq[0].to(q.dtype), dk[0].to(k.dtype), dv[0].to(v.dtype)


@_ring_attn_backward_op.register_fake
def _(dout, dlse, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _mask_row(pg, q, causal, layout, window, cu_seqlens):
    """This rank's `mask_row` over `pg`."""
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    return mask_row(
        rank,
        size,
        layout,
        q.shape[1],
        q.device,
        causal=causal,
        window=window,
        cu_seqlens=cu_seqlens,
    )


def rank_masks(pg, q, causal, layout, window, cu_seqlens, row=None):
    """This rank's row of `ring_masks` (from `row`, its `mask_row`, when given)."""
    if row is None:
        row = _mask_row(pg, q, causal, layout, window, cu_seqlens)
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    return unpack_masks(row, rank, size, layout, causal=causal, window=window)


def _setup(ctx, inputs, output):
    q, k, v, *options, cu_seqlens, masks = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens, masks)
    ctx.options = options


def _backward_op(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens, masks = ctx.saved_tensors
    grads = _ring_attn_backward(dout, dlse, q, k, v, out, lse, *ctx.options, cu_seqlens, masks)
    return *grads, *[None] * (len(ctx.options) + 2)


_ring_attn_backward = direct_op(_ring_attn_backward_op)
_ring_attn = autograd_op(_ring_attn_op, _backward_op, _setup)  # the bodies, in plain eager


def ring_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: str = "zigzag",
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    cu_seqlens: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    ulysses_group: Group = None,
    deterministic: bool = False,
):
    """Attention over a sequence sharded along dim 1 on `group` (context parallelism).

    q (B, S_loc, Hq, D), k (B, S_loc, Hkv, D) and v (B, S_loc, Hkv, Dv): this rank's
    shards in `layout` ("zigzag" or "contiguous", see `fusedpar.ops.sequence`). The
    result is this rank's shard of ``flash_attn`` on the full sequence, (B, S_loc, Hq,
    Dv), and with
    ``return_lse`` its LSE (B, Hq, S_loc) float32 (float64 for float64 q: the ring's
    partials, merge and gradients are then float64 throughout). `window`, `softcap`,
    `sinks` and `deterministic` as in `flash_attn`, in global positions (a sink enters
    each row once, after the merge).
    ``cu_seqlens`` (int32, the same on every rank): the documents of a packed stream of
    length S_loc * W, as in `flash_attn_varlen`;
    q, k, v are then this rank's shard of it, (1, S_loc, H, D). Documents may span
    ranks and need no padding: only the total length must split into the layout's
    chunks. With ``group=None`` or one rank this is `flash_attn` (`flash_attn_varlen`).

    ``ulysses_group``: the 2-D hybrid (USP). Heads are exchanged inside it (as in
    `fusedpar.ulysses_attn`) and the ring runs over `group` on the exchanged tensors;
    q, k, v are this rank's part of the layout of ``fp.shard_sequence(x, group,
    layout=layout, ulysses_group=ulysses_group)``, and the head rules of `ulysses_attn`
    apply over its size. The two groups must share this rank only.
    """
    check_layout(layout)
    if sinks is not None:  # once, on the merged rows: see `apply_sinks`
        check_sinks(sinks, q, "ring_attn")
        out, lse = ring_attn(
            q,
            k,
            v,
            group,
            causal=causal,
            softmax_scale=softmax_scale,
            layout=layout,
            window=window,
            softcap=softcap,
            cu_seqlens=cu_seqlens,
            return_lse=True,
            ulysses_group=ulysses_group,
            deterministic=deterministic,
        )
        out, lse = apply_sinks(out, lse, sinks)
        return (out, lse) if return_lse else out
    window, softcap = check_shards(q, k, v, window, softcap, "ring_attn", softmax_scale)
    pg, ug = resolve_group(group), resolve_group(ulysses_group)
    size, ulysses = group_size(pg), group_size(ug)
    if ulysses > 1:
        check_crossing_groups(pg, ug, "ring_attn")
        check_heads(q.shape[2], k.shape[2], ulysses, "ring_attn over ulysses_group")
    # with a head exchange first, the values too (in eager): before any collective
    check_packed(
        q,
        cu_seqlens,
        q.shape[1] * size * ulysses,
        "ring_attn",
        values=ulysses > 1 and not torch.compiler.is_compiling(),
    )
    if layout == "zigzag" and size > 1 and q.shape[1] * ulysses % 2:
        raise ValueError(
            f"ring_attn: zigzag needs the full length divisible by 2W = {2 * size}, but "
            f"this rank holds {q.shape[1]} tokens (full length {q.shape[1] * size * ulysses})"
        )
    options = dict(
        causal=causal,
        softmax_scale=softmax_scale,
        layout=layout,
        window=window,
        softcap=softcap,
        cu_seqlens=cu_seqlens,
        deterministic=deterministic,
    )
    if ulysses > 1:  # the ring (or, over one rank, flash_attn) on the exchanged heads
        attend = lambda *qkv: ring_attn(*qkv, pg, **options, return_lse=True)  # noqa: E731
        return head_parallel(q, k, v, ug, attend, return_lse=return_lse)
    mask = dict(
        causal=causal,
        softmax_scale=softmax_scale,
        window=window,
        softcap=softcap,
        deterministic=deterministic,
    )
    if size == 1:
        if cu_seqlens is None:
            return flash_attn(q, k, v, **mask, return_lse=return_lse)
        out, lse = flash_attn_varlen(q[0], k[0], v[0], cu_seqlens, **mask, return_lse=True)
        return (out[None], lse[None]) if return_lse else out[None]
    masks = _mask_row(pg, q, causal, layout, window, cu_seqlens)  # once, for both directions
    out, lse = _ring_attn(
        q,
        k,
        v,
        group_name(pg),
        causal,
        softmax_scale,
        layout,
        *window,
        softcap,
        deterministic,
        cu_seqlens,
        masks,
    )
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
    def forward(ctx, q, k, v, size, causal, softmax_scale, layout, window, softcap, cu_seqlens):
        masks = ring_masks(
            range(size),
            size,
            layout,
            q.shape[1] // size,
            q.device,
            causal=causal,
            window=window,
            cu_seqlens=cu_seqlens,
        )
        common = dict(softmax_scale=softmax_scale, softcap=softcap)
        out, lse = forward_schedule(
            *(_shards(t, size, layout) for t in (q, k, v)), VirtualRing(size), masks, **common
        )
        out = _unshard([o.to(q.dtype) for o in out], size, layout)  # rounded as ring_attn's
        lse = _unshard(lse, size, layout, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.size, ctx.layout, ctx.masks, ctx.common = size, layout, masks, common
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        size, layout = ctx.size, ctx.layout
        if dout is None:
            dout = torch.zeros_like(out)
        per_rank = [_shards(t, size, layout) for t in (q, k, v, dout)]
        per_rank.append(_shards(lse, size, layout, dim=2))
        # delta made by each rank's first dQ launch, as ring_attn's
        dlses = [None] * size if dlse is None else _shards(dlse, size, layout, dim=2)
        sources = list(zip(_shards(out, size, layout), dlses, strict=True))
        grads = backward_schedule(
            *per_rank,
            None,
            VirtualRing(size),
            VirtualRing(size),
            ctx.masks,
            **ctx.common,
            sources=sources,
        )
        dq, dk, dv = (
            _unshard(g, size, layout).to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True)
        )
        return dq, dk, dv, *[None] * 7


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
    window, softcap = check_window(window), check_softcap(softcap)
    check_softmax_scale(softmax_scale)
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
    out, lse = VirtualRingAttnFunction.apply(
        q, k, v, world_size, causal, softmax_scale, layout, window, softcap, cu_seqlens
    )
    return (out, lse) if return_lse else out
