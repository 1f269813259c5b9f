"""Plain-torch stand-ins for the three ops `fusedpar.nn.GatedDeltaNet` calls, until
their kernels land (issue #55 items 1-3): the same signatures, differentiable by
autograd. TO DELETE at the merge: `fusedpar.nn.gated_deltanet` imports these three
names from here, in one place, and then imports them from the real ops instead.

| stand-in                 | the op it stands for               | computed by            |
| ------------------------ | ---------------------------------- | ---------------------- |
| `gated_delta_rule`       | `fp.gated_delta_rule`              | the token-loop oracle  |
| `causal_conv1d`          | `fp.ops.causal_conv1d`             | F.conv1d per document  |
| `rms_norm_gated`         | `fp.ops.rms_norm_gated`            | torch, stats in fp32   |
"""

import torch
import torch.nn.functional as F

from fusedpar.kernels.linear_attention import gated_delta_rule_reference

GATES = {"silu": F.silu, "sigmoid": torch.sigmoid}


def gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=False,
):
    """``(o, final_state)``: o (B, T, Hv, V) in v's dtype, final_state (N, Hv, K, V) fp32
    or None; the math of `fp.gated_delta_rule`, by the float64 oracle's token loop in fp32
    (float64 for float64 inputs)."""
    work = torch.float64 if v.dtype == torch.float64 else torch.float32
    o, final = gated_delta_rule_reference(
        q.to(work),
        k.to(work),
        v.to(work),
        g.to(work),
        beta.to(work),
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        l2norm=use_qk_l2norm_in_kernel,
    )
    return o.to(v.dtype), None if final is None else final.float()


def causal_conv1d(
    x,
    weight,
    bias=None,
    *,
    activation="silu",
    cu_seqlens=None,
    initial_states=None,
    output_final_states=False,
):
    """``(y, None)``: the depthwise causal conv of x (B, T, C) by weight (C, W), y_t
    reading x_{t-W+1..t} of its own document (zero before its start), then SiLU."""
    if initial_states is not None or output_final_states:
        raise NotImplementedError("the stand-in causal_conv1d keeps no states")
    B, T, C = x.shape
    W = weight.shape[1]
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        part = x[:, start:end].transpose(1, 2)  # (B, C, T_doc)
        out = F.conv1d(part, weight.unsqueeze(1), bias, padding=W - 1, groups=C)
        pieces.append(out[..., : end - start])
    y = torch.cat(pieces, dim=-1).transpose(1, 2)  # (B, T, C)
    return (F.silu(y) if activation == "silu" else y), None


def rms_norm_gated(x, z, weight, *, eps, gate="silu"):
    """``weight * rmsnorm(x) * gate(z)`` over the last dim, statistics in fp32 (float64
    for float64 x)."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xw = x.to(work)
    normed = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(work) * normed * GATES[gate](z.to(work))).to(x.dtype)
