"""`ulysses_attn`: attention over a sequence sharded on a group by trading the sequence
for heads (DeepSpeed-Ulysses), and the same exchange under ``ring_attn(...,
ulysses_group=)``, the 2-D hybrid (USP).

P ranks; rank r holds the contiguous tokens [r S/P, (r+1) S/P) of every head:

| step       | op                                   | shape on a rank                     |
| ---------- | ------------------------------------ | ----------------------------------- |
| q, k, v in | ``scatter_heads([q, k, v], group)``  | (B, S/P, H, D) -> (B, S, H r/P, D)  |
| attention  | ``flash_attn`` (hybrid: the ring)    | (B, S, Hq/P, D), every token        |
| out back   | ``gather_heads([out], group)``       | (B, S, Hq/P, D) -> (B, S/P, Hq, D)  |

One all-to-all per tensor, posted together on the group's side stream; the backward of
one exchange is the other. Every rank sees the whole sequence for its heads, so masks,
windows and packed documents apply as on one device. Hq must divide by P, and Hkv
divide P or be divisible by it; with Hkv < P, K and V heads are replicated to P before
the exchange (r: the replication, else 1) and the backward sums the replicas' gradients
in fp32. Hybrid: the exchange runs inside the Ulysses group, the ring over the ring
group on the exchanged tensors, in USP's layout (`fusedpar.shard_sequence`).
"""

import torch
import torch.distributed as dist
from torch import Tensor

from fusedpar.comm import (
    Group,
    all_to_all_async,
    check_same_across_ranks,
    group_by_name,
    group_name,
    group_size,
    resolve_group,
)
from fusedpar.kernels.attention import AttentionMask
from fusedpar.kernels.common import accumulator
from fusedpar.ops.attention import (
    apply_sinks,
    check_packed,
    check_shards,
    check_sinks,
    masked_flash_attn,
)
from fusedpar.ops.registration import autograd_op


def check_heads(n_heads: int, n_kv_heads: int, size: int, what: str) -> int:
    """The replication of each KV head for a head exchange over `size` ranks (1, or
    P / Hkv when Hkv < P). ValueError, naming the counts, for heads that do not fit."""
    if n_heads % size:
        raise ValueError(
            f"{what}: the {n_heads} query heads do not divide by the Ulysses degree {size}"
        )
    if n_kv_heads % size == 0:
        return 1
    if size % n_kv_heads == 0:
        return size // n_kv_heads
    raise ValueError(
        f"{what}: {n_kv_heads} KV heads and Ulysses degree {size}: the KV heads "
        f"must divide by {size}, or divide it (then each is replicated "
        f"{size} / Hkv times)"
    )


# --- the exchanges: fusedpar::scatter_heads and fusedpar::gather_heads ---------------------
# x (B, s, H, D) on each of P ranks <-> (B, P s, H rep / P, D); each is the other's backward.


def _heads_first(x: Tensor, size: int, replicas: int) -> Tensor:
    """(B, s, H, D) -> the send buffer (P, B, s, H rep / P, D): chunk j for rank j."""
    if replicas > 1:
        x = x.repeat_interleave(replicas, dim=2)
    return x.unflatten(2, (size, -1)).permute(2, 0, 1, 3, 4).contiguous()


def _sequence_whole(received: Tensor) -> Tensor:
    """(P, B, s, h, D), rank p's tokens at p -> (B, P s, h, D): a view when B = 1."""
    P, B, s, h, D = received.shape
    return received.transpose(0, 1).reshape(B, P * s, h, D)


def _sequence_first(x: Tensor, size: int) -> Tensor:
    """(B, S, h, D) -> the send buffer (P, B, S / P, h, D): rank j's tokens for rank j."""
    return x.unflatten(1, (size, -1)).transpose(0, 1).contiguous()


def _heads_whole(received: Tensor, replicas: int) -> Tensor:
    """(P, B, s, h, D), rank p's heads at p -> (B, s, P h / rep, D), replicas summed."""
    heads = received.permute(1, 2, 0, 3, 4).flatten(2, 3)  # (B, s, P h, D)
    if replicas > 1:  # h = 1 here: heads j rep .. j rep + rep - 1 are KV head j's replicas
        heads = heads.unflatten(2, (-1, replicas)).sum(3, dtype=accumulator(heads.dtype))
    return heads.to(received.dtype).contiguous()


def _check_exchange(xs, group, replicas, what):
    if len(xs) != len(replicas):
        raise ValueError(f"{what}: {len(xs)} tensors but {len(replicas)} replica counts")
    pg = group_by_name(group)
    check_same_across_ranks(pg, [v for x in xs for v in x.shape], f"{what}: shapes", xs[0].device)
    return pg, dist.get_world_size(pg)


@torch.library.custom_op("fusedpar::scatter_heads", mutates_args=())
def _scatter_heads_op(xs: list[Tensor], group: str, replicas: list[int]) -> list[Tensor]:
    pg, size = _check_exchange(xs, group, replicas, "scatter_heads")
    pending = [
        all_to_all_async(_heads_first(x, size, r), pg) for x, r in zip(xs, replicas, strict=True)
    ]
    return [_sequence_whole(p.wait()) for p in pending]


@_scatter_heads_op.register_fake
def _(xs, group, replicas):
    size = dist.get_world_size(group_by_name(group))
    return [
        x.new_empty((x.shape[0], x.shape[1] * size, x.shape[2] * r // size, x.shape[3]))
        for x, r in zip(xs, replicas, strict=True)
    ]


@torch.library.custom_op("fusedpar::gather_heads", mutates_args=())
def _gather_heads_op(xs: list[Tensor], group: str, replicas: list[int]) -> list[Tensor]:
    pg, size = _check_exchange(xs, group, replicas, "gather_heads")
    pending = [all_to_all_async(_sequence_first(x, size), pg) for x in xs]
    return [_heads_whole(p.wait(), r) for p, r in zip(pending, replicas, strict=True)]


@_gather_heads_op.register_fake
def _(xs, group, replicas):
    size = dist.get_world_size(group_by_name(group))
    return [
        x.new_empty((x.shape[0], x.shape[1] // size, x.shape[2] * size // r, x.shape[3]))
        for x, r in zip(xs, replicas, strict=True)
    ]


def _setup(ctx, inputs, output):
    ctx.group, ctx.replicas = inputs[1], inputs[2]


def _scatter_backward(ctx, grads):
    return _gather_heads(list(grads), ctx.group, ctx.replicas), None, None


def _gather_backward(ctx, grads):
    return _scatter_heads(list(grads), ctx.group, ctx.replicas), None, None


_scatter_heads = autograd_op(_scatter_heads_op, _scatter_backward, _setup)
_gather_heads = autograd_op(_gather_heads_op, _gather_backward, _setup)


def scatter_heads(xs: list[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    """Each (B, s, H, D) of `xs` -> (B, P s, H / P, D): the group's whole sequence, this
    rank's heads (one all-to-all each, differentiable; H checked by the caller)."""
    return _scatter_heads(list(xs), group_name(group), [1] * len(xs))


def gather_heads(xs: list[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    """The inverse of `scatter_heads`: (B, P s, h, D) -> (B, s, P h, D)."""
    return _gather_heads(list(xs), group_name(group), [1] * len(xs))


# --- attention over exchanged heads ----------------------------------------------------


def head_parallel(q, k, v, group: dist.ProcessGroup, attend, *, return_lse: bool):
    """``attend(q, k, v) -> (out, lse)`` over the whole sequence and this rank's heads,
    between the two exchanges over `group` (heads already checked by `check_heads`)."""
    size = dist.get_world_size(group)
    replicas = check_heads(q.shape[2], k.shape[2], size, "head exchange")
    name = group_name(group)
    q, k, v = _scatter_heads([q, k, v], name, [1, replicas, replicas])
    out, lse = attend(q, k, v)  # (B, S, Hq/P, D), (B, Hq/P, S)
    if not return_lse:
        return _gather_heads([out], name, [1])[0]
    out, lse = _gather_heads([out, lse.transpose(1, 2)[..., None]], name, [1, 1])
    return out, lse[..., 0].transpose(1, 2).contiguous()  # (B, Hq, S/P)


def ulysses_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    cu_seqlens: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
):
    """Attention over a sequence sharded contiguously on `group` (Ulysses: all-to-all
    over heads; see the module doc).

    q (B, S/P, Hq, D), k (B, S/P, Hkv, D), v (B, S/P, Hkv, Dv): rank r's tokens [r S/P,
    (r+1) S/P) (``fp.shard_sequence(x, group, layout="contiguous")``). Returns this
    rank's tokens of ``flash_attn`` on the whole sequence, (B, S/P, Hq, Dv), and with
    ``return_lse`` their
    LSE (B, Hq, S/P) float32 (float64 for float64 q). `window`, `softcap`, `sinks` (Hq,),
    `deterministic` and `cu_seqlens` (int32, the documents of the whole packed stream of
    S tokens, B = 1) as in `flash_attn` and `flash_attn_varlen`. Hq must divide by P;
    Hkv must divide by P or divide P (KV heads are then replicated, and their gradients
    summed).
    Differentiable. With ``group=None`` or one rank this is `flash_attn`.
    """
    check_shards(q, k, v, "ulysses_attn")
    check_sinks(sinks, q, "ulysses_attn")
    mask = AttentionMask(causal, window, softcap, softmax_scale, sinks)
    pg = resolve_group(group)
    size = group_size(pg)
    check_heads(q.shape[2], k.shape[2], size, "ulysses_attn")
    # the values too (in eager): the exchange comes before the attention op reads them
    check_packed(
        q, cu_seqlens, q.shape[1] * size, "ulysses_attn", values=not torch.compiler.is_compiling()
    )

    def whole(q, k, v):  # the whole sequence, this rank's heads
        return masked_flash_attn(q, k, v, mask, cu_seqlens, deterministic)

    with_lse = return_lse or sinks is not None  # else the LSE is never exchanged back
    if size == 1:
        out, lse = whole(q, k, v)
    elif with_lse:
        out, lse = head_parallel(q, k, v, pg, whole, return_lse=True)
    else:
        return head_parallel(q, k, v, pg, whole, return_lse=False)
    out, lse = apply_sinks(out, lse, mask)  # once per whole row, after the exchange back
    return (out, lse) if return_lse else out
