"""The gated delta rule as a token loop: the float64 oracle of the kernels and of torch's
chunked implementation (``fusedpar.kernels.linear_attention``).

Per value head h (reading key head ``h // (Hv / Hk)``), state S (K, V), for t = 1..T:

| step     | math                                                      |
| -------- | --------------------------------------------------------- |
| decay    | ``S <- exp(g_t) S`` (g (Hv,): a scalar; g (Hv, K): rows)  |
| delta    | ``S <- S + beta_t k_t (v_t - S^T k_t)^T``                 |
| read     | ``o_t = S^T (scale q_t)``                                 |

q, k (B, T, Hk, K); v (B, T, Hv, V); g (B, T, Hv) or (B, T, Hv, K), log decays <= 0;
beta (B, T, Hv), any sign and size (OLMo Hybrid's reach 2). With ``l2norm``, q and k are
first normalized per head: ``x * rsqrt(sum(x^2) + 1e-6)``. With `cu_seqlens` (B = 1) the
state restarts at every document; `initial_state` and the final state hold one (Hv, K, V)
per sequence (B) or document. Computed in the inputs' dtype (float64 for the oracle).
"""

import torch

L2NORM_EPS = 1e-6  # Hugging Face's and flash-linear-attention's


def l2norm_reference(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)


def gated_delta_rule_reference(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, l2norm=False,
):  # fmt: skip
    """``(o, final_state)``: o (B, T, Hv, V) in the computation's dtype (q's, promoted
    with the others'), final_state (N, Hv, K, V) or None, N = B or the documents."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[-2:]
    dtype = torch.promote_types(torch.promote_types(q.dtype, v.dtype), g.dtype)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if l2norm:
        q, k = l2norm_reference(q), l2norm_reference(k)
    q = q * (K**-0.5 if scale is None else scale)
    group = Hv // Hk
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)  # (B, T, Hv, K)
    if g.dim() == 3:
        g = g[..., None].expand(B, T, Hv, K)
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        bounds = cu_seqlens.tolist()
        spans = [(0, start, end) for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    o = v.new_zeros((B, T, Hv, V))
    finals = []
    for n, (b, start, end) in enumerate(spans):
        S = v.new_zeros((Hv, K, V)) if initial_state is None else initial_state[n].to(dtype)
        for t in range(start, end):
            S = S * g[b, t].exp()[..., None]
            seen = torch.einsum("hkv,hk->hv", S, k[b, t])
            S = S + beta[b, t][:, None, None] * k[b, t][..., None] * (v[b, t] - seen)[:, None]
            o[b, t] = torch.einsum("hkv,hk->hv", S, q[b, t])
        finals.append(S)
    return o, (torch.stack(finals) if output_final_state else None)
