"""The attention launchers' torch implementation, and PyTorch's own kernels as candidates.

The launchers call these when the torch implementation is chosen (`fusedpar.kernels.impl`):
the same arguments, buffers and contract (masks as key intervals, soft-capping, the
ring's fp32 partials merged and gradients added). Scores are one fp32 (Sq, Skv) matrix
per head (float64 for float64 inputs): memory grows with Sq * Skv (`CUDA_SCORES_LIMIT`).

| function        | computes                                                          |
| --------------- | ----------------------------------------------------------------- |
| `forward`       | ``out, lse`` of ``softmax(S) V``, or merged into the given fp32   |
| `backward_dq`   | ``dQ = scale * dS K`` (written, or added)                         |
| `backward_dkdv` | ``dK = scale * dS^T Q``, ``dV = P^T dO``, summed over a GQA group |
| `delta`         | ``rowsum(dO * O)``; `merge`: ``merge_attention``'s               |

with ``P = exp(S - LSE)``, ``dS = P * (dO V^T - delta)`` (times ``1 - tanh^2`` capped).
Then SDPA's flash and cuDNN kernels (`FLASH`, `CUDNN`: the aten ops that return the LSE)
as the tuner's candidates (`forward_candidates`, `backward_candidates`) for the calls
they compute exactly (16-bit on CUDA, no softcap, no mask or causal with Sq == Skv), on
(B, H, S, D) views of ours. Their rules: docs/attention.md, "Two implementations".
"""

from dataclasses import dataclass

import torch
from fusedpar.kernels import impl
from fusedpar.kernels.attention.mask import (
    UNBOUNDED,
    AttentionMask,
    Intervals,
    resolve_scale,
    scalar_bounds,
)
from fusedpar.kernels.common import accumulator

# The largest (B * Hq * Sq * Skv) scores a CUDA launch may form in torch: 2**26 fp32
# (256 MiB with the exp and the mask). Past it only Triton's kernels are candidates.
CUDA_SCORES_LIMIT = 2**26


def capable_on_cuda(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the torch implementation may be timed on a CUDA launch of these shapes."""
    (B, Sq, Hq, _), Skv = q.shape, k.shape[1]
    return B * Hq * Sq * Skv <= CUDA_SCORES_LIMIT


def visible(Sq: int, Skv: int, bounds, intervals: Intervals | None, device) -> torch.Tensor:
    """The mask as a dense (1 or B, Sq, Skv) boolean: query i sees keys [lo_i, hi_i),
    from the scalar mode's ``bounds = (shift, left, right)`` or the tensor mode's
    `intervals` (the kernels' two modes, `mask`)."""
    j = torch.arange(Skv, device=device)
    if intervals is not None:
        lo, hi = intervals.kv_lo.long(), intervals.kv_hi.long()  # (1 or B, Sq)
    else:
        shift, left, right = bounds
        i = torch.arange(Sq, device=device, dtype=torch.int64)[None]
        lo = i + shift - min(left, UNBOUNDED)
        hi = i + shift + min(right, UNBOUNDED) + 1
    lo, hi = lo.clamp(0, Skv), hi.clamp(0, Skv)
    return (j >= lo[..., None]) & (j < hi[..., None])


@dataclass(frozen=True)
class Scores:
    """How a call scores and masks: ``scale``, ``softcap`` (0: none), and the mask as
    the kernels take it, the scalar mode's ``bounds`` or the tensor mode's `intervals`."""

    scale: float
    softcap: float
    bounds: tuple[int, int, int]
    intervals: Intervals | None

    @staticmethod
    def of_mask(mask: AttentionMask, Sq: int, Skv: int, D: int) -> "Scores":
        """A mask's scores for (Sq, Skv) rows of head dim D."""
        bounds = scalar_bounds(mask.causal, mask.window, Sq, Skv)
        return Scores(resolve_scale(mask.softmax_scale, D), mask.softcap, bounds, mask.intervals)

    def of(self, q, k):
        """``(S, t)``: S (B, Hkv, G, Sq, Skv) fp32 (float64 for float64 q) scores masked
        to -inf, and the tanh of a capped score (None when not capped). q (B, Sq, Hq, D)
        reads KV head h // G."""
        B, Sq, Hq, D = q.shape
        Hkv, Skv = k.shape[2], k.shape[1]
        wide = accumulator(q.dtype)
        qf = q.to(wide).reshape(B, Sq, Hkv, Hq // Hkv, D)
        s = torch.einsum("bqhgd,bkhd->bhgqk", qf, k.to(wide)) * self.scale
        t = None
        if self.softcap:
            t = torch.tanh(s / self.softcap)
            s = self.softcap * t
        mask = visible(Sq, Skv, self.bounds, self.intervals, q.device)
        return s.masked_fill(~mask[:, None, None], float("-inf")), t


def merge(out, lse, block_out, block_lse) -> None:
    """Fold ``(block_out, block_lse)`` into the fp32 (float64) ``(out, lse)`` in place,
    around the larger LSE: a side with LSE -inf drops out, two empty sides give 0 and -inf."""
    m = torch.maximum(lse, block_lse)
    m = torch.where(m == float("-inf"), 0.0, m)
    w_a, w_b = torch.exp(lse - m), torch.exp(block_lse - m)
    total = w_a + w_b
    empty = total == 0
    total = torch.where(empty, 1.0, total)

    def rows(w):  # (B, H, S) -> (B, S, H, 1), out's layout
        return w.transpose(1, 2)[..., None]

    out.copy_((out * rows(w_a) + block_out.to(out.dtype) * rows(w_b)) / rows(total))
    lse.copy_(torch.where(empty, float("-inf"), m + torch.log(total)))


@impl.cpu_path  # its host read (is a mask needed at all?) reads host memory
def _forward_fused_cpu(q, k, v, scores: Scores):
    """``(out, lse)`` in fp32 (float64 for float64 q) through PyTorch's fused CPU
    attention (flash-style, no (Sq, Skv) matrix in memory), which takes the mask as an
    additive one, or as ``is_causal`` where ours is the same causal mask (Sq == Skv: both
    alignments agree). fp32 inputs (16-bit ones widened exactly), so a ring's partials
    stay fp32; KV heads repeated for GQA; rows that see no key get output 0 and LSE
    -inf."""
    B, Sq, Hq, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    wide = accumulator(q.dtype)
    kf, vf = k.to(wide), v.to(wide)
    if Hq != Hkv:
        kf, vf = (t.repeat_interleave(Hq // Hkv, dim=2) for t in (kf, vf))
    mask = visible(Sq, Skv, scores.bounds, scores.intervals, q.device)
    causal = scores.intervals is None and scores.bounds == (0, UNBOUNDED, 0)
    additive = None
    if not causal and not bool(mask.all()):
        additive = torch.zeros(mask.shape, dtype=wide, device=q.device)
        additive = additive.masked_fill(~mask, float("-inf"))[:, None]  # (1 or B, 1, Sq, Skv)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.to(wide).transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2), is_causal=causal,
        attn_mask=additive, scale=scores.scale,
    )  # fmt: skip
    seen = mask.any(-1)[:, None]  # (1 or B, 1, Sq)
    lse = torch.where(seen, lse, float("-inf"))
    out = torch.where(seen.transpose(1, 2)[..., None], out.transpose(1, 2), 0.0)
    return out, lse


def forward(q, k, v, scores: Scores, out, lse, merge_into: bool) -> None:
    """Attention of q over k, v into `out` (B, Sq, Hq, Dv) and `lse` (B, Hq, Sq), or with
    `merge_into` merged into what they hold (fp32 partials of a ring). Without capping,
    on a CPU, through PyTorch's fused attention (`_forward_fused_cpu`; it takes V of Q's
    head dim only); else the scores as one matrix."""
    (B, Sq, Hq, D), Dv = q.shape, v.shape[-1]
    wide = accumulator(q.dtype)
    if k.shape[1] == 0:  # no key: output 0, LSE -inf (or nothing to merge)
        block_out = q.new_zeros((B, Sq, Hq, Dv), dtype=wide)
        block_lse = q.new_full((B, Hq, Sq), float("-inf"), dtype=wide)
    elif q.device.type == "cpu" and not scores.softcap and Dv == D:
        block_out, block_lse = _forward_fused_cpu(q, k, v, scores)
    else:
        s, _ = scores.of(q, k)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), 0.0, m)
        e = torch.exp(s - m)
        total = e.sum(-1, keepdim=True)
        empty = total == 0
        p = e / torch.where(empty, 1.0, total)
        vf = v.to(wide)
        block_out = torch.einsum("bhgqk,bkhd->bqhgd", p, vf).reshape(B, Sq, Hq, Dv)
        block_lse = torch.where(empty, float("-inf"), torch.log(torch.where(empty, 1.0, total))
                                + m).reshape(B, Hq, Sq)  # fmt: skip
    if merge_into:
        merge(out, lse, block_out, block_lse)
    else:
        out.copy_(block_out)
        lse.copy_(block_lse)


def _probabilities(q, k, lse, scores: Scores):
    """``(P, t)``: P = exp(S - LSE) (B, Hkv, G, Sq, Skv) as S, 0 where masked or where a
    row saw no key (LSE -inf); t as in `Scores.of`."""
    B, Sq, Hq, _ = q.shape
    Hkv = k.shape[2]
    s, t = scores.of(q, k)
    lse = lse.reshape(B, Hkv, Hq // Hkv, Sq, 1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse))
    return torch.where(torch.isinf(lse) | torch.isinf(s), 0.0, p), t


def _grad_scores(dout, q, k, v, lse, delta, scores: Scores):
    """``(dS, P, dO)``: dS = P * (dO V^T - delta), times 1 - tanh^2 when capped."""
    B, Sq, Hq, _ = q.shape
    Hkv = k.shape[2]
    p, t = _probabilities(q, k, lse, scores)
    wide = p.dtype
    dof = dout.to(wide).reshape(B, Sq, Hkv, Hq // Hkv, dout.shape[-1])  # (dO: V's head dim)
    dp = torch.einsum("bqhgd,bkhd->bhgqk", dof, v.to(wide))
    ds = p * (dp - delta.to(wide).reshape(B, Hkv, Hq // Hkv, Sq, 1))
    if t is not None:
        ds = ds * (1 - t * t)
    return ds, p, dof


def _write(buf, value, accumulate: bool) -> None:
    if accumulate:
        buf.copy_(buf.to(value.dtype) + value)
    else:
        buf.copy_(value)


def backward_dq(dout, q, k, v, lse, delta, scores: Scores, dq, accumulate) -> None:
    """dQ (B, Sq, Hq, D) into `dq`, or added to it."""
    if k.shape[1] == 0:
        if not accumulate:
            dq.zero_()
        return
    ds, _, _ = _grad_scores(dout, q, k, v, lse, delta, scores)
    dq_new = torch.einsum("bhgqk,bkhd->bqhgd", ds, k.to(ds.dtype)).reshape(q.shape)
    _write(dq, dq_new * scores.scale, accumulate)


def backward_dkdv(dout, q, k, v, lse, delta, scores: Scores, dk, dv, accumulate) -> None:
    """dK (B, Skv, Hkv, D) and dV (B, Skv, Hkv, Dv), summed over each KV head's query
    heads, into `dk`, `dv`, or added to them."""
    if q.shape[1] == 0 or k.shape[1] == 0:
        if not accumulate:
            dk.zero_()
            dv.zero_()
        return
    ds, p, dof = _grad_scores(dout, q, k, v, lse, delta, scores)
    B, Sq, Hq, D = q.shape
    qf = q.to(ds.dtype).reshape(B, Sq, k.shape[2], Hq // k.shape[2], D)
    _write(dk, torch.einsum("bhgqk,bqhgd->bkhd", ds, qf) * scores.scale, accumulate)
    _write(dv, torch.einsum("bhgqk,bqhgd->bkhd", p, dof), accumulate)


def delta(out, dout) -> torch.Tensor:
    """``rowsum(dO * O)``: (B, Hq, Sq) fp32 (float64 for float64 dO), contiguous."""
    wide = accumulator(dout.dtype)
    return (out.to(wide) * dout.to(wide)).sum(-1).transpose(1, 2).contiguous()


# --- PyTorch's own kernels as candidates ------------------------------------------------


FLASH = impl.Torch("sdpa-flash")
CUDNN = impl.Torch("sdpa-cudnn")


def _causal(q, k, scores) -> bool | None:
    """``is_causal`` for the platform ops, or None where they cannot compute the call
    (on a "meta" device too: tests check the calls' shapes and arguments on CPU)."""
    if scores.softcap or scores.intervals is not None or q.device.type not in ("cuda", "meta"):
        return None
    if q.dtype not in (torch.float16, torch.bfloat16) or 0 in (q.shape[1], k.shape[1]):
        return None
    shift, left, right = scores.bounds
    if left != UNBOUNDED:
        return None
    if right == UNBOUNDED:
        return False
    return True if right == 0 and shift == 0 else None


def _ops(q, k, v) -> list:
    (_, _, Hq, D), Hkv = q.shape, k.shape[2]
    if v.shape[-1] != D:  # neither takes V of another head dim (FlashAttention-2 does not)
        return []
    found = [FLASH] if D <= 256 and Hq % Hkv == 0 else []
    return found + ([CUDNN] if D <= 128 and Hq == Hkv else [])


def _heads_first(*tensors):
    return [t.transpose(1, 2) for t in tensors]  # (B, S, H, D) -> (B, H, S, D), a view


def forward_candidates(q, k, v, scores, out, lse, merge: bool) -> dict:
    """``{candidate: run()}`` of the platform forwards that compute this call exactly,
    each writing `out` (B, Sq, Hq, D) and `lse` (B, Hq, Sq) as the kernel would."""
    causal = _causal(q, k, scores)
    if causal is None or merge or out.dtype != q.dtype:
        return {}
    qt, kt, vt = _heads_first(q, k, v)

    def flash():
        o, m = torch.ops.aten._scaled_dot_product_flash_attention(
            qt, kt, vt, 0.0, causal, False, scale=scores.scale)[:2]  # fmt: skip
        out.copy_(o.transpose(1, 2))
        lse.copy_(m)

    def cudnn():
        o, m = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qt, kt, vt, None, True, 0.0, causal, False, scale=scores.scale)[:2]  # fmt: skip
        out.copy_(o.transpose(1, 2))
        lse.copy_(m.reshape(lse.shape))

    runs = {FLASH: flash, CUDNN: cudnn}
    return {name: runs[name] for name in _ops(q, k, v)}


def backward_candidates(dout, q, k, v, out, lse, scores, grads, dlse, accumulate) -> dict:
    """``{candidate: run()}`` of the platform backwards that compute this call exactly,
    each writing `grads` (dq, dk, dv in q's dtype)."""
    causal = _causal(q, k, scores)
    if causal is None or dlse is not None or accumulate or out is None:
        return {}
    if any(g.dtype != q.dtype for g in grads):
        return {}
    B, Sq, Hq, _ = q.shape
    Skv = k.shape[1]
    dot, qt, kt, vt, ot = _heads_first(dout, q, k, v, out)

    def write(computed):
        for g, c in zip(grads, computed, strict=True):
            g.copy_(c.transpose(1, 2))

    def flash():  # no dropout: the philox state is never read
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        write(torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dot, qt, kt, vt, ot, lse, None, None, Sq, Skv, 0.0, causal, seed, offset,
            scale=scores.scale))  # fmt: skip

    def cudnn():
        seed = torch.empty((), dtype=torch.long, device=q.device)
        write(torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dot, qt, kt, vt, ot, lse.reshape(B, Hq, Sq, 1), seed, seed, None, None, None, Sq,
            Skv, 0.0, causal, scale=scores.scale))  # fmt: skip

    runs = {FLASH: flash, CUDNN: cudnn}
    return {name: runs[name] for name in _ops(q, k, v)}
