"""Helpers of the tests in this folder (moved from test_attention.py)."""

import torch
import torch.nn.functional as F
from fusedpar.kernels.attention import (
    AttentionMask,
    attention_backward_reference,
    attention_reference,
)
from fusedpar.kernels.attention import backward as backward_kernels
from torch import nn

import fusedpar as fp
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import randn


def _inputs(B, Sq, Skv, Hq, Hkv, D, dtype, seed, layout, Dv=None):
    """q, k, v in one of three layouts: contiguous, slices of a fused QKV projection
    (strided heads), or windows of a longer sequence (strided sequence); v of head dim
    `Dv` (None: D)."""
    Dv = D if Dv is None else Dv
    if layout == "fused-qkv":
        assert Sq == Skv and Dv == D
        qkv = randn((B, Sq, Hq + 2 * Hkv, D), dtype, seed)
        return qkv[:, :, :Hq], qkv[:, :, Hq : Hq + Hkv], qkv[:, :, Hq + Hkv :]
    pad = 3 if layout == "seq-window" else 0
    q = randn((B, Sq + pad, Hq, D), dtype, seed)[:, pad:]
    k = randn((B, Skv + pad, Hkv, D), dtype, seed + 1)[:, :Skv]
    v = randn((B, Skv + 2 * pad, Hkv, Dv), dtype, seed + 2)[:, pad : pad + Skv]
    return q, k, v


def _differentiable_copy(t):
    """A copy of `t` with its strides (a view keeps being a view: `clone` would make a
    strided input contiguous and the kernels would never see the strides)."""
    if t._base is None:
        return t.detach().clone().requires_grad_()
    base = t._base.detach().clone().requires_grad_()
    assert base.stride() == t._base.stride()
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def attention_grads(fn, inputs, dout, dlse):
    """fn(*inputs) -> (out, lse); backward of <out, dout> + <lse, dlse> (finite lse only).
    Returns [out, lse, *input grads]; strided inputs stay strided. Shared with the ring
    attention tests."""
    copies = [_differentiable_copy(t) for t in inputs]
    out, lse = fn(*copies)
    finite = torch.isfinite(lse)
    loss = (out * dout.to(out.dtype)).sum() + (
        torch.where(finite, lse, 0) * dlse.to(lse.dtype)
    ).sum()
    grads = torch.autograd.grad(loss, copies)
    return [out.detach(), lse.detach(), *grads]


def reference_of(mask=None, visible=None, **keywords):
    """`attention_reference` as a function of (q, k, v): under `mask` (an
    `AttentionMask`), or one of flash_attn's `keywords` (causal, softmax_scale, window,
    softcap, sinks); `visible`: packed documents' dense mask."""
    mask = AttentionMask(**keywords) if mask is None else mask
    return lambda *t: attention_reference(*t, mask, visible)


def torch_results(inputs, dout, dlse, ref, causal=False, scale=None, **mask):
    """PyTorch's own [out, lse, dq, dk, dv] in the inputs' dtype: the yardstick of the
    tolerance rule. In fp32 each gradient is the worse (against the float64 `ref`) of
    autograd through the reference and the kernels' own formula in PyTorch: delta from
    the rounded O cancels dP only to rounding, where autograd cancels exactly. Against
    autograd alone, 14% of random fp32 examples with Skv <= 2 failed. In fp16 and bf16
    the formula would round P, dS and delta where the kernels keep fp32, so autograd
    alone is the yardstick there. `mask`: window, softcap or visible, as the references
    take them. Shared with the ring attention and mask tests."""
    visible = mask.pop("visible", None)
    mask = AttentionMask(causal, softmax_scale=scale, **mask)
    same = attention_grads(reference_of(mask, visible), inputs, dout, dlse)
    if same[0].dtype != torch.float32:
        return same
    formula = attention_backward_reference(
        dout.to(same[0].dtype),
        *inputs,
        *same[:2],
        mask,
        visible=visible,
        dlse=torch.where(torch.isfinite(same[1]), dlse.to(torch.float32), 0),
    )

    def error(t, r):
        return (t.double() - r.double()).nan_to_num(posinf=0, neginf=0).abs().max().item()

    grads = zip(same[2:], formula, ref[2:], strict=True)
    return same[:2] + [max(a, b, key=lambda t: error(t, r)) for a, b, r in grads]


def check_attention(
    B, Sq, Skv, Hq, Hkv, D, causal, dtype, seed, layout="contiguous", scale=None, Dv=None, **mask
):
    """`mask`: window and softcap, as `flash_attn` takes them; `Dv`: V's head dim (None:
    D)."""
    q, k, v = _inputs(B, Sq, Skv, Hq, Hkv, D, dtype, seed, layout, Dv)
    dout = randn((B, Sq, Hq, v.shape[-1]), dtype, seed + 3)
    dlse = randn((B, Hq, Sq), torch.float32, seed + 4)

    def ours(q, k, v):
        return fp.flash_attn(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, **mask)

    def reference(q, k, v):
        return attention_reference(q, k, v, AttentionMask(causal, softmax_scale=scale, **mask))

    got = attention_grads(ours, (q, k, v), dout, dlse)
    ref = attention_grads(reference, [t.double() for t in (q, k, v)], dout, dlse)
    torch_same_dtype = torch_results((q, k, v), dout, dlse, ref, causal, scale, **mask)
    for name, g, r, t in zip(
        ("out", "lse", "dq", "dk", "dv"), got, ref, torch_same_dtype, strict=True
    ):
        assert g.dtype == (torch.float32 if name == "lse" else dtype), name
        # S and dP are dots of length D and Dv, their rounding amplified by exp and dP - delta
        length = max(D, v.shape[-1])
        assert_close(g, r, t, name=name, sum_length=length if name.startswith("d") else None)


def poisoned(shape, device, dtype=torch.float32, pad=1):
    """A NaN-filled strided view of `shape` (padded along dim 1): an element the kernel
    should write but does not stays NaN and fails the comparison."""
    padded = (shape[0], shape[1] + 2 * pad, *shape[2:])
    return torch.full(padded, float("nan"), dtype=dtype, device=device)[:, pad : pad + shape[1]]


def force_split(mp, split_below):
    """Set the GQA split threshold (None: the default, no split on CPU) and poison the
    split's partials and the delta that dQ's kernel makes with NaN."""

    def nan_buffer(shape, device, dtype=torch.float32):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    mp.setattr(backward_kernels, "SPLIT_BELOW_PROGRAMS", split_below)
    mp.setattr(backward_kernels, "partials", nan_buffer)
    mp.setattr(backward_kernels, "delta_buffer", nan_buffer)


D_MODEL, HEADS, KV_HEADS, HEAD_DIM, SEQ, BATCH = 32, 4, 2, 16, 16, 2


# Gemma 3's query_pre_attn_scalar ** -0.5 beside its q/k norms (a scale folded into q's
# weights would be undone by the q norm)
GEMMA_SCALE = 24**-0.5


def scaled_rope(positions):
    """A rotary variant (linear scaling by 4), in Hugging Face's layout: (1, S, hd), the
    angles twice."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = positions.double()[:, None] * inv_freq[None, :] / 4
    angles = torch.cat([angles, angles], dim=-1)[None]
    return angles.cos(), angles.sin()


class DenseAttention(nn.Module):
    """The single-device module: biases, head dim 16, q/k norms, scaled RoPE, GQA."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(D_MODEL, HEADS * HEAD_DIM)
        self.k = nn.Linear(D_MODEL, KV_HEADS * HEAD_DIM)
        self.v = nn.Linear(D_MODEL, KV_HEADS * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, D_MODEL)
        self.q_norm, self.k_norm = nn.RMSNorm(HEAD_DIM, eps=1e-6), nn.RMSNorm(HEAD_DIM, eps=1e-6)
        with torch.no_grad():
            self.q_norm.weight.uniform_(0.5, 1.5)
            self.k_norm.weight.uniform_(0.5, 1.5)

    def forward(self, x):  # (B, S, d)
        B, S, _ = x.shape
        q = self.q_norm(self.q(x).view(B, S, HEADS, HEAD_DIM))
        k = self.k_norm(self.k(x).view(B, S, KV_HEADS, HEAD_DIM))
        cos, sin = (t[0, :, None, :].to(x.dtype) for t in scaled_rope(torch.arange(S)))

        def rotate(t):  # Hugging Face's rotate_half convention
            half = HEAD_DIM // 2
            return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin

        q, k = rotate(q).transpose(1, 2), rotate(k).transpose(1, 2)
        v = self.v(x).view(B, S, KV_HEADS, HEAD_DIM).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True, scale=GEMMA_SCALE
        )
        return self.o(out.transpose(1, 2).reshape(B, S, -1))
