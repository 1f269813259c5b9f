"""`ring_attn`: exact attention over a sequence sharded on a context-parallel group.

Each rank keeps its queries; keys and values travel a ring (at the KV head count), each
step folding one rank's block into the running output (fp32, merged in the forward
kernel's epilogue) through the LSE. `fusedpar.ops.ring_masks` gives the kernels each
step's mask (`AttentionMask` on the step's key and query intervals, in global
coordinates), so they skip blocks no query sees, and a step nothing sees (decided on the
host) launches nothing and only relays. Backward: dQ accumulates locally in fp32; each
block's dK, dV (fp32) travel a second ring with it, added to by every rank it visits,
arriving back at the owner after W steps; every step uses the final LSE and ``delta =
rowsum(dO * O) - dLSE``. float64 keeps every fp32 above in float64
(`fusedpar.kernels.common.accumulator`).

The loops take a transport (`fusedpar.ops.ring_transport`): `GroupRing` (this rank's
side of a `fusedpar.comm.Ring`) or `VirtualRing` (every rank in this process, transfers
replaced by copies); `fusedpar.ops.virtual_ring` runs the real loops over a
`VirtualRing`, the ring's exact launches on one device. Which steps compute what:
docs/context_parallel.md.
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
from fusedpar.kernels.attention import (
    FUSED,
    AttentionMask,
    Gradients,
    attention_backward,
    attention_backward_dkdv,
    attention_backward_dq,
    attention_backward_fused,
    attention_delta,
    attention_forward,
    check_cu_seqlens,
    delta_buffer,
)
from fusedpar.kernels.common import accumulator
from fusedpar.kernels.tuning import Launch, frozen
from fusedpar.ops.attention import (
    apply_sinks,
    check_packed,
    check_shards,
    check_sinks,
    masked_flash_attn,
    unflat,
)
from fusedpar.ops.registration import autograd_op, direct_op
from fusedpar.ops.ring_masks import rank_masks, rank_row
from fusedpar.ops.ring_transport import GroupRing
from fusedpar.ops.sequence import check_crossing_groups, check_layout
from fusedpar.ops.ulysses import check_heads, head_parallel


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
    q, k, v, ring, masks, *, agreement=None, overlap=True, attend=None, blocks=None
):
    """The forward schedule over `ring` (`ring_attn`'s, and `mla_ring_attn`'s with its
    latent as `blocks`); q, k, v: one shard per rank of ``ring.ranks``; `masks` from
    `fusedpar.ops.ring_masks` (each step's `AttentionMask`, or None). Returns lists of
    out (fp32) and lse. ``overlap=False`` waits for each transfer before computing (the
    benchmark's baseline); `attend` computes one block (``attention_forward``'s
    signature, the default; the CPU benchmark passes a torch one); `blocks`: what
    travels (`KVBlocks`: K and V; k and v are then its inputs)."""
    size = ring.size
    attend = attend or attention_forward
    blocks = blocks or KVBlocks()
    wide = accumulator(q[0].dtype)  # the running output and LSE: fp32, float64 for float64
    kv = blocks.payloads(k, v)
    own_k, own_v = blocks.expand(kv[0])
    own_mask = masks[0][ring.ranks[0]]
    for first in _tuned_launches(size):
        attend(
            q[0],
            own_k,
            own_v,
            own_mask,
            out_dtype=wide,
            merge=not first,
            launch_as=Launch(agreement, tune_only=True),
        )
    out = [_fresh((*t.shape[:3], own_v.shape[-1]), t.device, wide) for t in q]  # (B, S, Hq, Dv)
    lse = [_fresh((t.shape[0], t.shape[2], t.shape[1]), t.device, wide) for t in q]
    launched = Launch(agreement)
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
                        q[i],
                        *kv_i,
                        mask,
                        out=out[i],
                        lse=lse[i],
                        merge=step > 0,
                        launch_as=launched,
                    )
            if step + 1 < size:
                kv = ring.wait() if overlap else incoming
    return out, lse


def backward_schedule(
    q, k, v, outputs, grads, rings, masks, *, agreement=None, deterministic=False, blocks=None
):
    """The backward schedule (`ring_attn`'s, and `mla_ring_attn`'s with its latent as
    `blocks`) over ``rings = (kv_ring, grad_ring)``: lists (one per rank of the rings)
    of dQ and of the dK, dV of the rank's own KV (fp32; each of the payload's gradients
    with `blocks`), back home after W steps. Per rank, `outputs` holds the forward's
    (out, lse) and `grads` their gradients (dout, dlse or None): the first launch, on
    the rank's own block, makes ``delta = rowsum(dO * O) - dLSE`` from out and dlse (as
    `attention_backward` does) for every launch after it.

    Each step runs the fused backward (one kernel: dK, dV and dQ) or the split one (dQ,
    launched before the gradients arrive, then dK/dV), as the tuner picks for the own
    block (`attention_backward`'s pick, agreed over the group; the split one when
    `deterministic`). `blocks` as in `forward_schedule`: where it `absorbs`, each step's dK, dV
    go into fp32 scratch and `blocks.absorb` turns them into the travelling payload's
    gradient."""
    kv_ring, grad_ring = rings
    size = kv_ring.size
    blocks = blocks or KVBlocks()
    kv = blocks.payloads(k, v)
    dout, lse = [g[0] for g in grads], [o[1] for o in outputs]
    wide = accumulator(q[0].dtype)  # dQ, dK, dV sums and delta: fp32, float64 for float64
    made = [{} for _ in q]  # per rank: the first dQ launch's out and dlse, where it makes delta
    delta = [delta_buffer(t.shape, t.device, wide) for t in lse]
    for i, rank in enumerate(kv_ring.ranks):
        (out, _), (_, dlse) = outputs[i], grads[i]
        if masks[i][rank] is None:  # no own block to start on (never at step 0 today)
            attention_delta(out, dout[i], dlse, delta[i])
        else:
            made[i] = {"delta_from": (out, dlse)}
    own = (dout[0], q[0], *blocks.expand(kv[0]), lse[0], delta[0])
    own_mask = masks[0][kv_ring.ranks[0]]
    tune_only = Launch(agreement, tune_only=True)
    pick = attention_backward(
        *own[:5],
        own_mask,
        delta=own[5],
        grads=Gradients(accumulate=True, dtype=wide, deterministic=deterministic),
        launch_as=tune_only,
    )
    fused = pick is FUSED  # (a ring step adds into fp32: no platform kernel is a candidate)
    for first in _tuned_launches(size):
        tuning = {"grads": Gradients(accumulate=not first, dtype=wide), "launch_as": tune_only}
        if fused:
            attention_backward_fused(*own, own_mask, **tuning, **(made[0] if first else {}))
            continue
        attention_backward_dq(*own, own_mask, **tuning, **(made[0] if first else {}))
        attention_backward_dkdv(*own, own_mask, **tuning)
    dq = [_fresh(t.shape, t.device, wide) for t in q]
    launched = Launch(agreement)
    with frozen("the ring attention backward", agreement):
        for step in range(size):
            if step + 1 < size:
                kv_ring.send_recv(kv)
            work = []  # (rank index, block mask, block inputs)
            for i, rank in enumerate(kv_ring.ranks):
                mask = masks[i][(rank - step) % size]
                if mask is not None:  # (the own block's K, V: expanded for the tuning)
                    kv_i = own[2:4] if step == 0 and i == 0 else blocks.expand(kv[i])
                    inputs = (dout[i], q[i], *kv_i, lse[i], delta[i])
                    work.append((i, mask, inputs))
            for i, block, inputs in work:  # dQ needs no transfer: launched first
                if not fused:
                    into = Gradients(dq=dq[i], accumulate=step > 0, dtype=wide)
                    attention_backward_dq(
                        *inputs,
                        block,
                        grads=into,
                        launch_as=launched,
                        **(made[i] if step == 0 else {}),
                    )
            if step == 0:  # each owner starts its block's sums: written fresh, no zero fill
                sums = [[_fresh(t.shape, t.device, wide) for t in pair] for pair in kv]
            else:  # the sums from the ranks the held blocks visited before, added to here
                sums = grad_ring.wait()
            for i, block, inputs in work:
                if blocks.absorbs:  # (zeros: added into from step 1 on, as dQ is)
                    dk, dv = (
                        torch.zeros(t.shape, dtype=wide, device=t.device) for t in inputs[2:4]
                    )
                else:
                    dk, dv = sums[i]
                into = Gradients(dq[i], dk, dv, accumulate=step > 0, dtype=wide)
                if fused:
                    attention_backward_fused(
                        *inputs,
                        block,
                        grads=into,
                        launch_as=launched,
                        **(made[i] if step == 0 else {}),
                    )
                else:
                    attention_backward_dkdv(*inputs, block, grads=into, launch_as=launched)
                if blocks.absorbs:
                    blocks.absorb(kv[i], dk, dv, sums[i], first=step == 0)
            if step + 1 < size:
                kv = kv_ring.wait()
            grad_ring.send_recv(sums)  # on to the blocks' next holders (last: the owners)
        home = grad_ring.wait()
    return dq, *([g[j] for g in home] for j in range(len(home[0])))


# --- over a process group ------------------------------------------------------------


def ring_attention_forward(
    q, k, v, pg, *, layout, mask, cu_seqlens=None, overlap=True, attend=None, masks=None
):
    """This rank's forward ring over `pg` under `mask`: returns (out fp32, lse).
    `overlap` and `attend` as in `forward_schedule`; `masks`: this rank's row of
    `fusedpar.ops.ring_masks.ring_masks` (built here when not given)."""
    if masks is None:
        masks = rank_masks(pg, q, layout, mask, cu_seqlens)
    out, lse = forward_schedule(
        [q],
        [k],
        [v],
        GroupRing(pg),
        [masks],
        agreement=tuning_agreement(pg, q.device),
        overlap=overlap,
        attend=attend,
    )
    return out[0], lse[0]


# --- custom ops: fusedpar::ring_attn and its backward -------------------------------------
# The group crosses the op boundary by name, the mask as its scalars (`AttentionMask.flat`).
# The ring's masks (`mask_rows`: `fusedpar.ops.ring_masks.mask_row`) are built once per
# call, outside the ops, and saved for the backward: a (W, 4, S_local) int32 tensor, 16
# bytes a token per ring rank (less than one head of q), where rebuilding them in the
# backward costs W searchsorted launches again. Passed None (a direct call of the op),
# each op builds them itself.


@torch.library.custom_op("fusedpar::ring_attn", mutates_args=())
def _ring_attn_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: str,
    layout: str,
    mask: list[float],
    deterministic: bool,
    cu_seqlens: Tensor | None,
    mask_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    pg = group_by_name(group)
    check_same_across_ranks(
        pg, [*q.shape, *k.shape, v.shape[-1]], "ring_attn: q/k/v shapes", q.device
    )
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, q.shape[1] * dist.get_world_size(pg))
    m = unflat(mask)
    masks = rank_masks(pg, q, layout, m, cu_seqlens, mask_rows)
    out, lse = ring_attention_forward(q, k, v, pg, layout=layout, mask=m, masks=masks)
    return out.to(q.dtype), lse


@_ring_attn_op.register_fake
def _(q, k, v, group, layout, mask, deterministic, cu_seqlens, mask_rows=None):
    # fresh, contiguous (the kernels' layout), any inputs
    B, S, H, _ = q.shape
    return q.new_empty((B, S, H, v.shape[-1])), q.new_empty((B, H, S), dtype=accumulator(q.dtype))


@torch.library.custom_op("fusedpar::ring_attn_backward", mutates_args=())
def _ring_attn_backward_op(
    dout: Tensor,
    dlse: Tensor,
    saved: list[Tensor],
    group: str,
    layout: str,
    mask: list[float],
    deterministic: bool,
    cu_seqlens: Tensor | None,
    mask_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv; `saved`: the forward's q, k, v, out, lse."""
    q, k, v, out, lse = saved
    pg = group_by_name(group)
    masks = rank_masks(pg, q, layout, unflat(mask), cu_seqlens, mask_rows)
    rings = GroupRing(pg), GroupRing(pg, tag=1)
    # delta = rowsum(dO * O) - dLSE: made by the first launch (the own block's)
    dq, dk, dv = backward_schedule(
        [q],
        [k],
        [v],
        [(out, lse)],
        [(dout, dlse)],
        rings,
        [masks],
        agreement=tuning_agreement(pg, q.device),
        deterministic=deterministic,
    )
    return dq[0].to(q.dtype), dk[0].to(k.dtype), dv[0].to(v.dtype)


@_ring_attn_backward_op.register_fake
def _(dout, dlse, saved, group, layout, mask, deterministic, cu_seqlens, mask_rows=None):
    q, k, v = saved[:3]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, *options, cu_seqlens, mask_rows = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens, mask_rows)
    ctx.options = options


def _backward_op(ctx, dout, dlse):
    *saved, cu_seqlens, mask_rows = ctx.saved_tensors
    grads = _ring_attn_backward(dout, dlse, saved, *ctx.options, cu_seqlens, mask_rows)
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
    check_sinks(sinks, q, "ring_attn")
    mask = AttentionMask(causal, window, softcap, softmax_scale, sinks)
    return masked_ring_attn(
        q,
        k,
        v,
        group,
        mask,
        layout=layout,
        cu_seqlens=cu_seqlens,
        ulysses_group=ulysses_group,
        return_lse=return_lse,
        deterministic=deterministic,
    )


def masked_ring_attn(
    q,
    k,
    v,
    group,
    mask,
    *,
    layout,
    cu_seqlens,
    ulysses_group,
    return_lse=False,
    deterministic=False,
):
    """`ring_attn` with its mask as one value (`AttentionMask`, its sinks checked by the
    caller): what `ring_attn` and the layers call."""
    check_layout(layout)
    check_shards(q, k, v, "ring_attn")
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

    def ring(q, k, v):  # (out, lse) over pg, or flash_attn over one rank; no sinks
        if size == 1:
            return masked_flash_attn(q, k, v, mask, cu_seqlens, deterministic)
        rows = rank_row(pg, q, layout, mask, cu_seqlens)  # once, for both directions
        name, flat = group_name(pg), mask.flat()
        return _ring_attn(q, k, v, name, layout, flat, deterministic, cu_seqlens, rows)

    with_lse = return_lse or mask.sinks is not None  # else the LSE is never exchanged back
    if ulysses == 1:
        out, lse = ring(q, k, v)
    elif with_lse:  # the ring (or, over one rank, flash_attn) on the exchanged heads
        out, lse = head_parallel(q, k, v, ug, ring, return_lse=True)
    else:
        return head_parallel(q, k, v, ug, ring, return_lse=False)
    out, lse = apply_sinks(out, lse, mask)  # once, on the merged rows
    return (out, lse) if return_lse else out
