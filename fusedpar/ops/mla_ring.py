"""`mla_ring_attn`: ring attention for DeepSeek's latent attention that moves the latent.

The ring moves the normalized KV latent and the rotated shared k_rope (512 + 64 values
a token at DeepSeek-V3's sizes) instead of `ring_attn`'s expanded K and V; each step
expands the block it holds with `kv_b_proj` (this rank's heads), and the backward
absorbs each step's dK, dV into the latent's gradient, which travels home:

| step   | forward                                | backward                                   |
| ------ | -------------------------------------- | ------------------------------------------ |
| expand | ``k_nope, v = c @ W_kvb.T``,           | the same (recomputed)                      |
|        | ``k = [k_rope (every head), k_nope]``  |                                            |
| attend | `attention_forward` (merge)            | `attention_backward` (dQ added, dK dV new) |
| absorb |                                        | ``dc = [dk_nope, dv] @ W_kvb``, dk_rope    |
|        |                                        | summed over heads; ``dW_kvb += [dk_nope,   |
|        |                                        | dv].T c``                                  |

The schedule is `ring_attention`'s own loops (`forward_schedule`, `backward_schedule`)
over `ring_masks.rank_masks` with `LatentBlocks` as what travels. The ring alone (no Ulysses group):
the hybrid moves expanded heads (`fusedpar.nn.ParallelMLA` picks). docs/context_parallel.md.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from fusedpar.comm import Group, check_same_across_ranks, resolve_group, tuning_agreement
from fusedpar.kernels.attention import AttentionMask
from fusedpar.ops.attention import check_packed
from fusedpar.ops.ring_attention import backward_schedule, forward_schedule
from fusedpar.ops.ring_masks import rank_masks
from fusedpar.ops.ring_transport import GroupRing
from fusedpar.ops.sequence import check_sequence_length


class LatentBlocks:
    """The latent as what travels the rings (`ring_attention.KVBlocks`' interface):
    payload ``[c]``, c (B, S_loc, r + dr) the normalized latent beside the rotated
    k_rope; expanded through `w` (H * (dn + dv), r); the gradients absorbed into c's,
    and `w`'s summed in ``dw`` (fp32) over the steps."""

    absorbs = True

    def __init__(self, w: Tensor, nope: int, v_dim: int, rope: int):
        self.w, self.nope, self.v_dim, self.rope = w, nope, v_dim, rope
        self.dw = None

    def payloads(self, latents, _) -> list:
        return [[c.contiguous()] for c in latents]

    def expand(self, payload):
        """k (B, S, H, dr + dn), v (B, S, H, dv): views of one GEMM's output and k_rope."""
        c = payload[0]
        r = c.shape[-1] - self.rope
        kv = F.linear(c[..., :r], self.w).unflatten(-1, (-1, self.nope + self.v_dim))
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = c[..., None, r:].expand(-1, -1, kv.shape[2], -1)
        return torch.cat([k_rope, k_nope], dim=-1), v

    def absorb(self, payload, dk, dv, d_payload, first: bool) -> None:
        """c's gradient from this step's dK, dV (fp32) into ``d_payload[0]`` (written at
        the owner's step, added to after), and w's into ``dw``."""
        c = payload[0]
        r, wide = c.shape[-1] - self.rope, dk.dtype
        dkv = torch.cat([dk[..., self.rope :], dv], dim=-1).flatten(-2)  # (B, S, H (dn + dv))
        grad = torch.cat([dkv @ self.w.to(wide), dk[..., : self.rope].sum(2)], dim=-1)
        dw = dkv.flatten(0, 1).T @ c[..., :r].flatten(0, 1).to(wide)
        self.dw = dw if self.dw is None else self.dw + dw
        if first:
            d_payload[0].copy_(grad)
        else:
            d_payload[0].add_(grad)


class _LatentRing(torch.autograd.Function):
    """out (B, S_loc, H, dv) of q (B, S_loc, H, dr + dn) over every rank's latent."""

    @staticmethod
    def forward(ctx, q, latent, w, pg, layout, mask, nope, v_dim, cu_seqlens, deterministic):
        masks = rank_masks(pg, q, layout, mask, cu_seqlens)
        blocks = LatentBlocks(w, nope, v_dim, q.shape[-1] - nope)
        out, lse = forward_schedule(
            [q],
            [latent],
            None,
            GroupRing(pg),
            [masks],
            agreement=tuning_agreement(pg, q.device),
            blocks=blocks,
        )
        out = out[0].to(q.dtype)
        ctx.save_for_backward(q, latent, w, out, lse[0])
        ctx.options = (pg, masks, nope, v_dim, deterministic)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, latent, w, out, lse = ctx.saved_tensors
        pg, masks, nope, v_dim, deterministic = ctx.options
        blocks = LatentBlocks(w, nope, v_dim, q.shape[-1] - nope)
        rings = GroupRing(pg), GroupRing(pg, tag=1)
        dq, d_latent = backward_schedule(
            [q],
            [latent],
            None,
            [(out, lse)],
            [(dout.contiguous(), None)],
            rings,
            [masks],
            agreement=tuning_agreement(pg, q.device),
            deterministic=deterministic,
            blocks=blocks,
        )
        dw = torch.zeros_like(w) if blocks.dw is None else blocks.dw.to(w.dtype)
        return dq[0].to(q.dtype), d_latent[0].to(latent.dtype), dw, *[None] * 7


def mla_ring_attn(
    q: Tensor,
    latent: Tensor,
    w_kvb: Tensor,
    group: Group,
    *,
    qk_nope_head_dim: int,
    v_head_dim: int,
    softmax_scale: float,
    layout: str = "zigzag",
    cu_seqlens: Tensor | None = None,
    deterministic: bool = False,
) -> Tensor:
    """Causal attention of q (B, S_loc, H, dr + dn: rotary dims first) over the sequence
    sharded on `group` in `layout`, whose keys and values are made from `latent` (B,
    S_loc, r + dr: the normalized KV latent, then the rotated k_rope) by `w_kvb` (H *
    (dn + dv), r; rows per head dn then dv). Returns (B, S_loc, H, dv). Differentiable
    in q, latent and w_kvb. `cu_seqlens`: packed documents of the whole stream."""
    pg = resolve_group(group)
    if pg is None or dist.get_world_size(pg) == 1:
        raise ValueError(
            "mla_ring_attn: a ring of one rank moves nothing: use flash_attn on the expanded heads"
        )
    H, rope = q.shape[2], q.shape[-1] - qk_nope_head_dim
    r = latent.shape[-1] - rope
    if w_kvb.shape != (H * (qk_nope_head_dim + v_head_dim), r):
        raise ValueError(
            f"mla_ring_attn: w_kvb must be ({H * (qk_nope_head_dim + v_head_dim)}, "
            f"{r}) for {H} heads, got {tuple(w_kvb.shape)}"
        )
    if latent.shape[:2] != q.shape[:2] or latent.dtype != q.dtype:
        raise ValueError(
            f"mla_ring_attn: latent {tuple(latent.shape)} {latent.dtype} must share "
            f"q's (B, S_loc) {tuple(q.shape[:2])} and dtype {q.dtype}"
        )
    # what no rank sees alone: one collective, as ring_attn checks
    check_same_across_ranks(
        pg,
        [*q.shape, *latent.shape, *w_kvb.shape],
        "mla_ring_attn: q/latent/w_kvb shapes",
        q.device,
    )
    size = dist.get_world_size(pg)
    check_sequence_length(q.shape[1] * size, size, layout, "mla_ring_attn")
    check_packed(q, cu_seqlens, q.shape[1] * size, "mla_ring_attn", values=True)
    mask = AttentionMask(causal=True, softmax_scale=softmax_scale)
    return _LatentRing.apply(
        q,
        latent,
        w_kvb,
        pg,
        layout,
        mask,
        qk_nope_head_dim,
        v_head_dim,
        cu_seqlens,
        deterministic,
    )
