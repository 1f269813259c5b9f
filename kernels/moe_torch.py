"""The MoE launchers' torch implementation: `fusedpar.kernels.moe` and `moe_permute`'s
contracts in PyTorch, called when the torch implementation is chosen
(`fusedpar.kernels.impl`).

The same outputs as the kernels': products summed in fp32 (biases added there) and
rounded once, g and u rounded to the activations' dtype before the activation (so the
backward recomputes ``a`` bit for bit from the saved h13), rows past ``counts.sum()``
left unwritten, empty experts' weight and bias gradients zero, combine sums in slot
order in fp32. float64 inputs (this implementation's alone) are computed in float64:
every fp32 here is ``accumulator(dtype)`` (`fusedpar.kernels.common`). The grouped GEMMs
loop over the experts, reading the counts on the host: no host sync on a CPU, one on a
GPU, where this implementation runs only when asked for (``FUSEDPAR_IMPL=torch``).
"""

import torch
from fusedpar.kernels import impl
from fusedpar.kernels.common import accumulator


@impl.cpu_path  # on a GPU this runs only when asked for (FUSEDPAR_IMPL=torch): a sync there
def expert_slices(counts) -> list[slice]:
    """Each expert's rows in expert order, empty ones too (the counts read on the host;
    the references loop with it as well)."""
    ends = torch.cumsum(counts, 0).tolist()
    return [slice(end - c, end) for c, end in zip(counts.tolist(), ends, strict=True)]


def _groups(counts):
    """``(expert, rows)`` of every expert with rows, in expert order."""
    return [(e, s) for e, s in enumerate(expert_slices(counts)) if s.stop > s.start]


def _fp32(t):
    """t in fp32 (16-bit values widened exactly), float64 as it is."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def grouped_products(x, w, counts, rows=None, transpose_w=False, bias=None):
    """``(rows, x[rows[p]] @ w[e].T + bias[e])`` per expert with rows, in fp32 (products
    of 16-bit operands exactly: they fit fp32)."""
    for e, s in _groups(counts):
        xs = x[s] if rows is None else x[rows[s]]
        we = w[e] if transpose_w else w[e].T
        prod = _fp32(xs) @ _fp32(we)
        yield s, prod if bias is None else prod + _fp32(bias[e])


def grouped_matmul(x, w, counts, rows, y, transpose_w, bias=None) -> None:
    for s, prod in grouped_products(x, w, counts, rows, transpose_w, bias):
        y[s] = prod


GROUPED_MM = impl.Torch("grouped_mm")  # a tuner candidate of the grouped GEMM


def grouped_mm_run(x, w, counts, rows, bias, y, transpose_w):
    """``run()`` writing `fusedpar.kernels.moe.grouped_matmul`'s y through
    ``torch._grouped_mm`` where that op's rules hold (its meta registration in torch):
    bf16 x, w and y; x in expert order (no rows) and row-major, w read as (E, K, N)
    column-major, every stride and both bases multiples of 16 bytes; no bias (it takes
    none). None elsewhere. The same sums as the kernel's (fp32, rounded once); rows past
    ``counts.sum()`` get what the op leaves there. The offsets are made on the device:
    no host sync."""
    b = w if transpose_w else w.transpose(1, 2)  # (E, K, N)
    if rows is not None or bias is not None or {x.dtype, w.dtype, y.dtype} != {torch.bfloat16}:
        return None
    if x.stride(-1) != 1 or b.stride(1) != 1 or (x.data_ptr() | b.data_ptr()) % 16:
        return None
    if any(stride % 8 for stride in (x.stride(0), b.stride(0), b.stride(2))):  # 16 bytes
        return None

    def run():
        ends = torch.cumsum(counts, 0, dtype=torch.int32)
        y.copy_(torch._grouped_mm(x, b, offs=ends))

    return run


def _swiglu(g, u, act):
    """The kernels' `_swiglu` in fp32: silu(g) * u, or gpt-oss's clamped SwiGLU (`act`: a
    `fusedpar.kernels.moe.Swiglu`)."""
    activation, alpha, limit = act
    if activation == "silu":
        return g * torch.sigmoid(g) * u
    g = g.clamp(max=limit)
    return g * torch.sigmoid(alpha * g) * (u.clamp(-limit, limit) + 1.0)


def _swiglu_grad(da, g, u, act):
    """The kernels' `_swiglu_grad`: (dg, du) from da, in fp32."""
    activation, alpha, limit = act
    if activation == "silu":
        sig = torch.sigmoid(g)
        return da * u * sig * (1.0 + g * (1.0 - sig)), da * g * sig
    gc, uc = g.clamp(max=limit), u.clamp(-limit, limit)
    sig = torch.sigmoid(alpha * gc)
    dg = torch.where(g <= limit, da * (uc + 1.0) * sig * (1.0 + alpha * gc * (1.0 - sig)), 0.0)
    du = torch.where((u >= -limit) & (u <= limit), da * gc * sig, 0.0)
    return dg, du


def _wide(*ts):
    """fp32 (float64 for float64), contiguous copies: torch's CPU elementwise ops round
    differently on strided and contiguous inputs (vectorized or not), and the forward's a
    must equal the backward's recomputed a bit for bit."""
    return (t.to(accumulator(t.dtype), memory_format=torch.contiguous_format, copy=True)
            for t in ts)  # fmt: skip


def grouped_swiglu(x, w1, w3, counts, rows, a, h13, bias, act) -> None:
    h = w1.shape[1]
    b1, b3 = bias or (None, None)
    for (s, g), (_, u) in zip(grouped_products(x, w1, counts, rows, bias=b1),
                              grouped_products(x, w3, counts, rows, bias=b3),
                              strict=True):  # fmt: skip
        g, u = g.to(x.dtype), u.to(x.dtype)  # as PyTorch's h1 and h3 would be
        if h13 is not None:
            h13[s, :h], h13[s, h:] = g, u
        a[s] = _swiglu(*_wide(g, u), act)


def grouped_swiglu_backward(d_out, w2, h13, counts, d_h13, a, act) -> None:
    h = h13.shape[1] // 2
    for s, da in grouped_products(d_out, w2, counts, transpose_w=True):
        g, u = _wide(h13[s, :h], h13[s, h:])
        d_h13[s, :h], d_h13[s, h:] = _swiglu_grad(da, g, u, act)
        a[s] = _swiglu(g, u, act)


def grouped_swiglu_input_grad(d_h13, w1, w3, counts, dx) -> None:
    h = w1.shape[1]
    for e, s in _groups(counts):
        dh = _fp32(d_h13[s])
        dx[s] = dh[:, :h] @ _fp32(w1[e]) + dh[:, h:] @ _fp32(w3[e])


def grouped_weight_grad(dy, x, counts, rows, outs, bias_outs=()) -> None:
    """``dw[e] = dy[p]^T x[rows[p]]`` over each expert's rows into `outs` (one, or two
    for the halves of dy's columns), and ``db[e] = sum_p dy[p]`` (fp32) into `bias_outs`
    (none, or one per half), zero for an empty expert."""
    N = outs[0].shape[1]
    for out in (*outs, *bias_outs):
        out.zero_()
    for e, s in _groups(counts):
        xs = _fp32(x[s] if rows is None else x[rows[s]])
        for half, out in enumerate(outs):
            dy_e = _fp32(dy[s, half * N : (half + 1) * N])
            out[e] = dy_e.T @ xs
            if bias_outs:
                bias_outs[half][e] = dy_e.sum(0)


def gather_rows(src, idx, scale, out) -> None:
    vals = src[idx]
    if scale is not None:
        vals = _fp32(vals) * scale[:, None]
    out.copy_(vals)


def combine(src, pos, weight, y) -> None:
    """``y[t] = sum_j weight[t, j] * src[pos[t, j]]``, slots in order, in fp32 (float64
    for float64 src)."""
    acc = torch.zeros(y.shape, dtype=accumulator(src.dtype), device=y.device)
    if src.shape[0] == 0:  # every slot is -1: nothing to read
        y.zero_()
        return
    for j in range(pos.shape[1]):
        live = pos[:, j] >= 0  # a skipped slot reads nothing (rows past the kept ones are
        # unspecified: where, not a product with 0, which would keep a NaN)
        vals = torch.where(live[:, None], _fp32(src[pos[:, j].clamp(min=0)]), 0.0)
        if weight is not None:
            vals = vals * weight[:, j, None].to(acc.dtype)
        acc += vals
    y.copy_(acc)


def combine_weight_grad(dy, src, pos, dw) -> None:
    """``dw[t, j] = <dy[t], src[pos[t, j]]>`` in fp32, 0 where pos is -1."""
    dyf = _fp32(dy)
    if src.shape[0] == 0:  # every slot is -1
        dw.zero_()
        return
    for j in range(pos.shape[1]):
        live = pos[:, j] >= 0
        dw[:, j] = torch.where(live, (dyf * _fp32(src[pos[:, j].clamp(min=0)])).sum(1), 0.0)
