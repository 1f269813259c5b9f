"""Helpers of the tests in this folder (moved from test_moe_kernels.py)."""

import contextlib

import torch
from fusedpar.kernels import moe as moe_kernels
from fusedpar.kernels import moe_permute, moe_route, moe_weight_grad
from fusedpar.kernels.moe_permute import (
    dispatch_metadata,
)

from fusedpar.testing.strategies import randn


@contextlib.contextmanager
def poisoned_outputs():
    """Every output the MoE kernels' launchers allocate starts as NaN while inside."""
    modules = (moe_kernels, moe_permute, moe_weight_grad, moe_route)
    real = [module._empty for module in modules]

    def nan_empty(shape, dtype, device):  # (integers: -1, an index out of range)
        return torch.full(
            shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device
        )

    for module in modules:
        module._empty = nan_empty
    try:
        yield
    finally:
        for module, empty in zip(modules, real, strict=True):
            module._empty = empty


def _kernel_problem(p, device):
    """Routing of T tokens to k of E experts (skewed popularity, `empty` experts never
    chosen, a random `drop` mask) and the operands of the experts' SwiGLU: with
    ``p["bias"]`` random biases (b1, b2, b3), with ``p["act"] == "clamped_swiglu"``
    gate and up weights and biases 5x larger, so the clamp at 7 bites."""
    T, k, E, d, h, dtype, seed = (p[n] for n in ("T", "k", "E", "d", "h", "dtype", "seed"))
    gen = torch.Generator().manual_seed(seed)
    popularity = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** p["skew"]
    popularity[E - p["empty"] :] = 0.0  # the last `empty` experts get no pair
    ids = torch.multinomial(popularity, max(T * k, 1), replacement=True, generator=gen)
    ids = ids[: T * k].view(T, k)
    keep = torch.rand(T, k, generator=gen) > 0.3 if p["drop"] else None
    counts, order, pos = dispatch_metadata(
        ids.to(device), E, None if keep is None else keep.to(device)
    )
    strided, act = p["strided"], p.get("act", "silu")
    big = 5.0 if act == "clamped_swiglu" else 1.0
    biases = [
        _operand((E, n), dtype, seed + 7 + i, device, strided, scale)
        for i, (n, scale) in enumerate(((h, big), (d, 1.0), (h, big)))
    ]
    return dict(
        counts=counts,
        order=order,
        pos=pos,
        rows=order // k,
        kept=int(counts.sum()),
        x=_operand((T, d), dtype, seed + 1, device, strided),
        w1=_operand((E, h, d), dtype, seed + 2, device, strided, big * d**-0.5),
        w3=_operand((E, h, d), dtype, seed + 3, device, strided, big * d**-0.5),
        w2=_operand((E, d, h), dtype, seed + 4, device, strided, h**-0.5),
        dy=_operand((T * k, d), dtype, seed + 5, device, strided),
        dh13=_operand((T * k, 2 * h), dtype, seed + 6, device, strided),
        b1=biases[0],
        b2=biases[1],
        b3=biases[2],
        bias=tuple(biases) if p.get("bias") else None,
        act={"activation": act},
    )


SMALL = dict(
    T=9,
    k=2,
    E=4,
    d=10,
    h=7,
    empty=1,
    skew=1.0,
    drop=True,
    strided=False,
    dtype=torch.float32,
    seed=0,
)


# gpt-oss's experts: biases and the clamped SwiGLU, strided, an empty expert, drops
GPT_OSS_KERNEL = dict(T=20, bias=True, act="clamped_swiglu", strided=True)


def _operand(shape, dtype, seed, device, strided, scale=1.0):
    """Random data; `strided`: a transposed view of the last two dims (no unit stride
    where a contiguous tensor has one)."""
    if not strided:
        return randn(shape, dtype, seed, scale=scale).to(device)
    flipped = (*shape[:-2], shape[-1], shape[-2])
    return randn(flipped, dtype, seed, scale=scale).to(device).transpose(-1, -2)
