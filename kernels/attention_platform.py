"""PyTorch's own fused attention ops as candidates of fusedpar's attention launchers.

SDPA's flash and cuDNN backends, called through the aten ops that return the LSE (their
shapes, dtypes and returns are those of torch's meta registrations and
``native_functions.yaml``), for the calls they compute exactly. The tuner times them
beside the Triton tiles under ``FUSEDPAR_IMPL=auto`` and keeps the fastest; one that
raises (a shape or layout the op refuses) is never picked.

| candidate  | aten ops (and their ``_backward``)     | LSE returned  | heads          | D      |
| ---------- | -------------------------------------- | ------------- | -------------- | ------ |
| sdpa-flash | ``_scaled_dot_product_flash_attention`` | (B, H, Sq)    | Hkv divides Hq | <= 256 |
| sdpa-cudnn | ``_scaled_dot_product_cudnn_attention`` | (B, H, Sq, 1) | Hq == Hkv      | <= 128 |

What they compute exactly: 16-bit q, k, v on CUDA; no soft-capping; no mask, or causal
with Sq == Skv (their causal mask is aligned top-left, ours bottom-right: the two agree
only there), so every row sees a key. The forward writes out in q's dtype, fresh (a
ring step merging into fp32 partials is not theirs); the backward writes new gradients
in q's dtype and takes no LSE gradient (theirs makes delta from out alone). Their
tensors are (B, H, S, D): ours (B, S, H, D) transposed, not copied. Both ops are
non-deterministic in dQ (atomics), so a ``deterministic`` backward never takes them.
"""

import torch
from fusedpar.kernels import _impl
from fusedpar.kernels.attention_mask import UNBOUNDED

FLASH = _impl.Torch("sdpa-flash")
CUDNN = _impl.Torch("sdpa-cudnn")


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
