"""Helpers of the gated delta rule's tests: inputs the recurrence keeps bounded (unit
keys, beta in (0, 2), gates from near 0 to very negative), strided layouts, and every
gradient of a run."""

import torch
import torch.nn.functional as F
from fusedpar.kernels.linear_attention import gated_delta_rule_reference

from fusedpar.testing.strategies import randn

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _placed(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`t`'s values (B, T, ...) in a tensor of `layout`: "contiguous"; "time-major" a
    (T, B, ...) tensor's transpose; "sliced" the first columns of a wider last dim."""
    if layout == "time-major":
        out = t.new_empty((t.shape[1], t.shape[0], *t.shape[2:])).transpose(0, 1)
    elif layout == "sliced":
        out = t.new_empty((*t.shape[:-1], t.shape[-1] + 3))[..., : t.shape[-1]]
    else:
        return t.contiguous()
    out.copy_(t)
    return out


def gdn_inputs(
    B,
    T,
    Hk,
    group,
    K,
    V,
    *,
    dtype,
    seed,
    per_channel=False,
    documents=None,
    initial=True,
    layout="contiguous",
    exact_in=None,
) -> dict:
    """q, k, v, g, beta, initial_state and cu_seqlens of one example: k of unit norm per
    head (so that beta in (0, 2) keeps every step's ``I - beta k k^T`` a contraction); g
    mixing gates near 0 (long memory) with very negative ones (down to -20);
    `documents`: their lengths (B = 1, one initial state each). `exact_in`: values
    rounded to that dtype first (a float64 reference then sees the op's very inputs)."""
    Hv = Hk * group
    wide = torch.float64
    gen = torch.Generator().manual_seed(seed)
    shape = (B, T, Hv, K) if per_channel else (B, T, Hv)
    deep = torch.rand(shape, generator=gen, dtype=wide) < 0.3
    depth = torch.where(deep, 20.0, 0.01)  # -20..0 for 30%, -0.01..0 for the rest
    N = B if documents is None else len(documents)
    values = {
        "q": randn((B, T, Hk, K), wide, seed + 1),
        "k": F.normalize(randn((B, T, Hk, K), wide, seed + 2), dim=-1),
        "v": randn((B, T, Hv, V), wide, seed + 3),
        "g": -torch.rand(shape, generator=gen, dtype=wide) * depth,
        "beta": 2 * torch.rand((B, T, Hv), generator=gen, dtype=wide),
        "initial_state": randn((N, Hv, K, V), wide, seed + 4) if initial else None,
    }
    out = {}
    for name, t in values.items():
        if t is not None:
            t = t.to(exact_in or dtype).to(dtype)
            t = t if name == "initial_state" else _placed(t, layout)
        out[name] = t
    out["cu_seqlens"] = None
    if documents is not None:
        bounds = [0, *torch.tensor(documents).cumsum(0).tolist()]
        out["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
    return out


def differentiable_copy(t):
    """A leaf copy of `t` that keeps its strides (a view stays a view of a leaf)."""
    if t._base is None:
        return t.detach().clone().requires_grad_()
    base = t._base.detach().clone().requires_grad_()
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def run_with_grads(fn, inputs: dict, do, dfinal, **options) -> list:
    """``[o, final_state, dq, dk, dv, dg, dbeta, dinit]`` of ``fn(q, k, v, g, beta,
    initial_state=..., cu_seqlens=..., output_final_state=True, **options)`` and of
    the loss ``<o, do> + <final_state, dfinal>`` (dfinal None: o's term only). A
    gradient not reached (no initial state) is None."""
    leaves = {n: differentiable_copy(inputs[n]) for n in NAMES if inputs[n] is not None}
    o, final = fn(
        *(leaves[n] for n in NAMES[:5]),
        initial_state=leaves.get("initial_state"),
        cu_seqlens=inputs["cu_seqlens"],
        output_final_state=True,
        **options,
    )
    loss = (o * do.to(o.dtype)).sum()
    if dfinal is not None:
        loss = loss + (final * dfinal.to(final.dtype)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    found = dict(zip(leaves, grads, strict=True))
    return [o.detach(), final.detach(), *(found.get(n) for n in NAMES)]


def reference(
    q,
    k,
    v,
    g,
    beta,
    *,
    initial_state=None,
    cu_seqlens=None,
    output_final_state=True,
    use_qk_l2norm_in_kernel=False,
    scale=None,
):
    """`gated_delta_rule_reference` under `fp.gated_delta_rule`'s keywords."""
    return gated_delta_rule_reference(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        l2norm=use_qk_l2norm_in_kernel,
    )


RESULT_NAMES = ("o", "final_state", *(f"d{n}" for n in NAMES))
