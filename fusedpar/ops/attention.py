"""`flash_attn`: the autograd Function over the flash-attention kernels.

| input   | shape            | gradient                                      |
| ------- | ---------------- | --------------------------------------------- |
| q       | (B, Sq, Hq, D)   | ``dQ = scale * dS K``                         |
| k, v    | (B, Skv, Hkv, D) | ``dK = scale * dS^T Q``, ``dV = P^T dO``      |

summed over the query heads of each GQA group, with
``dS = P * (dO V^T - rowsum(dO * O) + dLSE)``: a gradient flowing into the returned
LSE is folded into the same backward pass.
"""

import torch

from fusedpar.kernels.attention import attention_forward, check_attention_inputs
from fusedpar.kernels.attention_backward import attention_backward, attention_delta


class FlashAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale):
        out, lse = attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale = causal, softmax_scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        delta = attention_delta(out, dout)
        if dlse is not None:  # d(LSE_i)/d(S_ij) = P_ij: the same shape as the dO term
            delta = delta - dlse
        dq, dk, dv = attention_backward(
            dout, q, k, v, lse, causal=ctx.causal, softmax_scale=ctx.softmax_scale, delta=delta
        )
        return dq, dk, dv, None, None


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
):
    """Scaled dot-product attention, flash-style: ``softmax(q k^T * scale) v``.

    q (B, Sq, Hq, D); k, v (B, Skv, Hkv, D) with Hq a multiple of Hkv (GQA/MQA: KV is
    read in place, never repeated); D a multiple of 8 up to 256; fp16, bf16 or fp32; any
    strides (views into a fused QKV projection are read without copies).

    ``causal`` aligns the mask bottom-right: query i sees keys ``j <= i + Skv - Sq``. A
    row that sees no key returns 0 (LSE -inf, zero gradients). ``softmax_scale``
    defaults to ``1 / sqrt(D)``. Returns ``out`` (B, Sq, Hq, D), or ``(out, lse)`` with
    lse (B, Hq, Sq) float32 in natural log when ``return_lse``.
    """
    check_attention_inputs(q, k, v)
    out, lse = FlashAttnFunction.apply(q, k, v, causal, softmax_scale)
    return (out, lse) if return_lse else out
