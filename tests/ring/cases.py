"""Context parallelism (ring attention, its masks, Ulysses): its opcheck cases
(`opcheck_cases`; tests/test_compile.py runs them)."""

import torch
import torch.distributed as dist

import fusedpar as fp
from tests.support.opcheck import leaf

# --- opcheck cases (tests/test_compile.py runs them on 2 ranks) ---


def opcheck_cases(group: str) -> list:
    """(op, args) for the custom ops of the ring's attention (forward, backward, packed)
    and Ulysses' head all-to-alls: small and random, float inputs requiring grad (the
    autograd registration is exercised); `group`: the ranks'."""
    ops = torch.ops.fusedpar
    W = dist.get_world_size()
    q, k, v = leaf(1, 8, 4, 16), leaf(1, 8, 2, 16), leaf(1, 8, 2, 16)
    causal = fp.AttentionMask(causal=True).flat()
    opts = ([], causal, False)
    out, lse = ops.flash_attn(q, k, v, *opts)
    ring_opts = (group, "zigzag", causal, False)
    ring_out, ring_lse = ops.ring_attn(q, k, v, *ring_opts, None)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    # the layer's layout: (S, B, H, D) projections viewed as (B, S, H, D), not contiguous
    qt, kt, vt = (leaf(8, 2, h, 16).transpose(0, 1) for h in (4, 2, 2))
    out_t, lse_t = ops.flash_attn(qt, kt, vt, *opts)
    return [
        (ops.ring_attn, (q, k, v, *ring_opts, None)),
        (ops.ring_attn, (qt, kt, vt, *ring_opts, None)),
        (
            ops.ring_attn_backward,
            (
                torch.randn_like(out_t),
                torch.randn_like(lse_t),
                [qt, kt, vt, out_t, lse_t],
                *ring_opts,
                None,
            ),
        ),
        (ops.ring_attn, (q, k, v, *ring_opts, torch.tensor([0, 5, 16], dtype=torch.int32))),
        (ops.ring_attn_backward, (dout, dlse, [q, k, v, ring_out, ring_lse], *ring_opts, None)),
        # Ulysses: q, k, v (strided, KV replicated W times) and the LSE's (B, S, H, 1) view
        (ops.scatter_heads, ([qt, kt[:, :, :1], vt[:, :, :1]], group, [1, W, W])),
        (ops.scatter_heads, ([q, k], group, [1, 1])),
        (ops.gather_heads, ([leaf(1, 8 * W, 2, 16), leaf(1, 8 * W, 1, 16)], group, [1, W])),
        (ops.gather_heads, ([leaf(2, 2, 8 * W).transpose(1, 2)[..., None]], group, [1])),
    ]
