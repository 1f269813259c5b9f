"""The attention kernels' contract in plain, differentiable PyTorch: the references the
tests compare with in float64, beside the kernels (`forward`, `backward`).

| function                       | computes                                              |
| ------------------------------ | ----------------------------------------------------- |
| `attention_reference`          | ``(out, lse)``, rows with no key: 0 and -inf          |
| `attention_backward_reference` | dQ, dK, dV by the kernels' formula (P from the LSE)   |

Both take the kernels' `AttentionMask` for causality, the window, the scale, the cap
and (the forward) the sinks; the mask itself is `mask.visible_reference`: a dense
boolean matrix built independently of the intervals the kernels take. Packed documents
come as that matrix (`visible`), never as ``mask.intervals``.
"""

import torch
from fusedpar.kernels.attention.mask import NO_MASK, AttentionMask, resolve_scale, visible_reference


def reference_scores(q, k, v, mask: AttentionMask, visible=None):
    """The references' shared start: ``S = scale * Q K^T`` (B, Hq, Sq, Skv), soft-capped,
    with the mask as -inf, K and V repeated to Hq heads, and the scale. The mask:
    `visible` (Sq, Skv) boolean (packed documents; ``mask.intervals`` is then not
    read), else ``mask.causal`` and ``mask.window``."""
    (_, Sq, Hq, D), (_, Skv, Hkv, _) = q.shape, k.shape
    if mask.intervals is not None and visible is None:  # (with `visible`: not read)
        raise ValueError("the references take packed documents as `visible`, a dense "
                         "mask built apart from the kernels' mask.intervals")  # fmt: skip
    scale = resolve_scale(mask.softmax_scale, D)
    k = k.repeat_interleave(Hq // Hkv, dim=2)
    v = v.repeat_interleave(Hq // Hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if mask.softcap:
        s = mask.softcap * torch.tanh(s / mask.softcap)
    if visible is None:
        one = torch.tensor([0, Sq]), torch.tensor([0, Skv])
        visible = visible_reference(*one, causal=mask.causal, window=mask.window)
    return s.masked_fill(~visible.to(q.device), float("-inf")), k, v, scale


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask = NO_MASK,
    visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same contract in plain, differentiable PyTorch, in q's dtype (float64 in ->
    the oracle). Returns ``(out, lse)``; rows that see no key give 0 and -inf, and their
    gradients are 0, not NaN. `visible`: a dense (Sq, Skv) mask instead of ``mask.causal``
    and ``mask.window`` (`mask.visible_reference` of packed documents). ``mask.sinks``
    (Hq,): one more logit per head in every row's softmax denominator, with no value
    (gpt-oss's attention sinks): a row that sees no key gives 0 and LSE = its sink."""
    (B, Sq, Hq, _), Skv = q.shape, k.shape[1]
    s, _, v, _ = reference_scores(q, k, v, mask, visible)
    if mask.sinks is not None:  # an extra key column: its logit, no value
        sink = mask.sinks.to(s.dtype)[None, :, None, None].expand(B, Hq, Sq, 1)
        s = torch.cat([s, sink], dim=-1)
    m = s.amax(-1, keepdim=True) if s.shape[-1] else s.new_full((B, Hq, Sq, 1), float("-inf"))
    m = torch.where(torch.isinf(m), 0.0, m).detach()  # softmax is shift-invariant
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True)
    empty = denom == 0
    p = e / torch.where(empty, 1.0, denom)
    lse = torch.where(empty, float("-inf"), torch.log(torch.where(empty, 1.0, denom)) + m)
    out = torch.einsum("bhqk,bkhd->bqhd", p[..., :Skv], v)
    return out, lse.squeeze(-1)


def attention_backward_reference(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: AttentionMask = NO_MASK,
    *,
    visible: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' backward formula in plain PyTorch, in q's dtype: P from the LSE and
    ``delta = rowsum(dO * O) - dLSE`` from the forward's output (`mask` and `visible` as
    in `attention_reference`; sinks are folded in by the LSE).

    Autograd through `attention_reference` computes ``P * (dP - rowsum(P * dP))``, where
    the two dP terms cancel exactly; here, as in the kernels (and FlashAttention), delta
    comes from the rounded O and cancels dP only to rounding. The fp32 tests use both
    as PyTorch's own error in the tolerance rule. `dout` is in q's dtype; the LSE is
    rounded to it (the kernels keep it in fp32).
    """
    Hkv, group = k.shape[2], q.shape[2] // k.shape[2]
    s, k, v, scale = reference_scores(q, k, v, mask, visible)
    lse = lse.to(q.dtype)[..., None]
    p = torch.where(torch.isneginf(lse), 0.0, torch.exp(s - lse))  # rows with no key: 0
    delta = (dout * out).sum(-1).transpose(1, 2)  # (B, Hq, Sq)
    if dlse is not None:
        delta = delta - dlse.to(delta.dtype)
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", dout, v) - delta[..., None])
    if mask.softcap:  # s = softcap * tanh(raw / softcap): d s / d raw = 1 - tanh^2
        raw = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
        ds = ds * (1 - torch.tanh(raw / mask.softcap) ** 2)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    return dq, *(g.unflatten(2, (Hkv, group)).sum(3) for g in (dk, dv))
