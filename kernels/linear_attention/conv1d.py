"""Depthwise causal conv1d (Gated DeltaNet's short convolution), forward and backward.

x (B, T, C) sequence-major, weight (C, W) with W <= MAX_WIDTH, per channel c:
``y[t] = act(bias[c] + sum_j weight[c, j] * x[t - (W - 1) + j])``, act SiLU or none,
computed in fp32 and rounded once. A position before its sequence's first token (with
`cu_seqlens`, B = 1: its document's) reads `initial_states` (N, C, W - 1), the W - 1
inputs before it, oldest first (zeros if none given); N = B or the documents.
`final_states` (N, C, W - 1) are the last W - 1 positions of ``[initial_states ; x]``
of each sequence: what the next call takes to continue it (Dao's causal-conv1d layout;
a document shorter than W - 1 keeps the older entries of its initial states, zeros
without). Gradients reach x, weight, bias and initial_states, from y and final_states.

| kernel                | grid                      | does                                   |
| --------------------- | ------------------------- | -------------------------------------- |
| `_conv1d_fwd_kernel`  | token blocks x channels   | y                                      |
| `_conv1d_bwd_kernel`  | programs x channels       | dx; per-program weight/bias partials   |
| `_conv1d_edge_kernel` | documents x channels      | final_states, or initial_states' grad  |

The backward recomputes the pre-activations (W^2 tap loads a tile, cached); a token
finds its document by a binary search of cu_seqlens. torch's implementation: `conv1d_torch`.
"""

import torch
import triton
import triton.language as tl
from fusedpar.kernels import common, impl, tuning
from fusedpar.kernels.attention.mask import check_cu_seqlens
from fusedpar.kernels.common import check_float_dtype, check_launchable, is_interpreted, sm_count
from fusedpar.kernels.linear_attention.conv1d_torch import (
    causal_conv1d_backward_torch,
    causal_conv1d_torch,
)
from fusedpar.kernels.linear_attention.conv1d_torch import (  # the tests' oracle, beside
    causal_conv1d_reference as causal_conv1d_reference,  # the kernels (re-exported)
)
from fusedpar.kernels.tuning import bucket

# The widest kernel: the taps unroll (W^2 + W loads a tile in the backward); the models
# use 4 (causal-conv1d's kernels take 2 to 4).
MAX_WIDTH = 4
ACTIVATIONS = ("silu", None)
# A program's tile, tokens x channels, and its warps: the forward's 32 x 64 at 4 warps
# (16 elements a thread); the backward's W^2 unrolled taps keep many loads and three
# pointer tiles (x, initial states, dy) in flight: 16 x 64 at 8 warps, 200 registers
# with every flag (sm_90, bf16; 32 x 64 at 4 spilled 912 B, 64 x 128 the forward 1.2 KB).
TILES = {"forward": (32, 64, 4), "backward": (16, 64, 8)}
# Backward programs per SM: each keeps one fp32 partial of the weight's gradient.
PROGRAMS_PER_SM = 2
# The interpreter runs programs one after another: tiny tiles, so that small shapes
# cross token and channel blocks and several partial sums.
INTERPRETER_TILE = dict(BLOCK_T=16, BLOCK_C=16)


def tile_config(interpreted: bool, direction: str = "forward") -> dict:
    """The fixed tile (tokens x channels) and warps of the kernels of `direction` (the
    edge kernel takes the forward's channels)."""
    if interpreted:
        return dict(INTERPRETER_TILE, num_warps=1)
    block_t, block_c, warps = TILES[direction]
    return dict(BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps)


@triton.jit
def _span(cu_ptr, g, T, N, steps, PACKED: tl.constexpr):
    """For flattened tokens g (b * T + t): (row, doc, start, end), start and end in t's
    coordinates; packed (B = 1), the document is the last n with cu[n] <= t."""
    if PACKED:
        lo = tl.zeros_like(g)
        hi = lo + (N - 1)
        for _ in range(steps):
            mid = (lo + hi + 1) // 2
            up = tl.load(cu_ptr + mid) <= g
            lo = tl.where(up, mid, lo)
            hi = tl.where(up, hi, mid - 1)
        return tl.zeros_like(g), lo, tl.load(cu_ptr + lo), tl.load(cu_ptr + lo + 1)
    b = g // T
    return b, b, tl.zeros_like(g), tl.zeros_like(g) + T


@triton.jit
def _window(x_ptr, init_ptr, sx_b, sx_t, sx_c, si_n, si_c, si_w, row, t, start, doc, cols,
            W: tl.constexpr):  # fmt: skip
    """For tokens t of sequence `row` (document `doc` from `start`), (BLOCK_T, BLOCK_C)
    pointers to their first tap's input, t - (W - 1), in x and in initial_states (entry
    t - start there), and t - start: tap j adds j to the three."""
    offs = row.to(tl.int64) * sx_b + (t - (W - 1)).to(tl.int64) * sx_t
    d = t - start
    init_offs = doc.to(tl.int64) * si_n + d * si_w
    return (x_ptr + offs[:, None] + cols[None, :] * sx_c,
            init_ptr + init_offs[:, None] + cols[None, :] * si_c, d)  # fmt: skip


@triton.jit
def _tap(xp, ip, d, mask, j, sx_t, si_w, W: tl.constexpr, HAS_INIT: tl.constexpr):
    """(BLOCK_T, BLOCK_C) fp32: tap j's input (`_window`'s pointers): x inside the
    document, initial_states before it (zero without them)."""
    inside = d >= W - 1 - j
    v = tl.load(xp + j * sx_t, mask=mask & inside[:, None], other=0.0).to(tl.float32)
    if HAS_INIT:
        v += tl.load(ip + j * si_w, mask=mask & (d < W - 1 - j)[:, None],
                     other=0.0).to(tl.float32)  # fmt: skip
    return v


@triton.jit
def _pre(xp, ip, d, wp, bias_ptr, sx_t, si_w, sw_w, cols, c_mask, mask, W: tl.constexpr,
         HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr):  # fmt: skip
    """The pre-activation ``bias + sum_j w[:, j] x[t - (W - 1) + j]`` (fp32); wp: the
    weight's channel pointers."""
    acc = tl.zeros(mask.shape, dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(W):
        wj = tl.load(wp + j * sw_w, mask=c_mask, other=0.0).to(tl.float32)
        acc += wj[None, :] * _tap(xp, ip, d, mask, j, sx_t, si_w, W, HAS_INIT)
    return acc


@triton.jit
def _dpre(pre, dy, SILU: tl.constexpr):
    """The pre-activation's gradient from the output's (fp32)."""
    if SILU:
        s = tl.sigmoid(pre)
        dy = dy * s * (1.0 + pre * (1.0 - s))
    return dy


@triton.jit
def _conv1d_fwd_kernel(
    # pointers (bias, initial states, cu_seqlens: read only where their flags say)
    x_ptr, w_ptr, bias_ptr, init_ptr, cu_ptr, y_ptr,
    # strides
    sx_b, sx_t, sx_c, sw_c, sw_w, si_n, si_c, si_w, sy_b, sy_t, sy_c,
    # sizes
    T, C, M, N, steps,
    # meta-parameters
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_INIT: tl.constexpr, PACKED: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    """y for BLOCK_T of the M = B * T flattened tokens and BLOCK_C channels."""
    g = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = cols < C
    mask = (g < M)[:, None] & c_mask[None, :]
    row, doc, start, _ = _span(cu_ptr, g, T, N, steps, PACKED)
    t = g - row * T
    xp, ip, d = _window(x_ptr, init_ptr, sx_b, sx_t, sx_c, si_n, si_c, si_w, row, t, start, doc,
                        cols, W)  # fmt: skip
    acc = _pre(xp, ip, d, w_ptr + cols * sw_c, bias_ptr, sx_t, si_w, sw_w, cols, c_mask, mask, W,
               HAS_BIAS, HAS_INIT)  # fmt: skip
    if SILU:
        acc = acc * tl.sigmoid(acc)
    offs = row.to(tl.int64) * sy_b + t.to(tl.int64) * sy_t
    tl.store(y_ptr + offs[:, None] + cols[None, :] * sy_c, acc.to(y_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


@triton.jit
def _conv1d_bwd_kernel(
    # pointers (bias, initial states, cu_seqlens, dfinal: read only where flags say)
    dy_ptr, x_ptr, w_ptr, bias_ptr, init_ptr, cu_ptr, dfinal_ptr, dx_ptr, dw_ptr, db_ptr,
    # strides
    sdy_b, sdy_t, sdy_c, sx_b, sx_t, sx_c, sw_c, sw_w, si_n, si_c, si_w, sf_n, sf_c, sf_w,
    sdx_b, sdx_t, sdx_c,
    # sizes
    T, C, M, N, steps, tokens_per_program,
    # meta-parameters
    W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, PACKED: tl.constexpr, SILU: tl.constexpr,
    HAS_DFINAL: tl.constexpr,
):  # fmt: skip
    """dx for the flattened tokens [pid * tokens_per_program, ...) and BLOCK_C channels
    (``dx[p] = sum_k w[:, W-1-k] dpre[p + k]`` within p's document, plus dfinal where p is
    one of its last W - 1); that range's weight and bias gradients into row pid of the
    (programs, W, C) and (programs, C) fp32 partials."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = cols < C
    wp = w_ptr + cols * sw_c
    taps = tl.arange(0, BLOCK_W)  # W rounded up to a power of two
    dw = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)
    db = tl.zeros((BLOCK_C,), dtype=tl.float32)
    first = pid * tokens_per_program
    last = tl.minimum(first + tokens_per_program, M)
    for block in range(first, last, BLOCK_T):
        g = block + tl.arange(0, BLOCK_T)
        mask = (g < last)[:, None] & c_mask[None, :]
        row, doc, start, end = _span(cu_ptr, g, T, N, steps, PACKED)
        t = g - row * T
        xp, ip, d = _window(x_ptr, init_ptr, sx_b, sx_t, sx_c, si_n, si_c, si_w, row, t, start,
                            doc, cols, W)  # fmt: skip
        offs = row.to(tl.int64) * sdy_b + t.to(tl.int64) * sdy_t
        dyp = dy_ptr + offs[:, None] + cols[None, :] * sdy_c
        dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for k in tl.static_range(W):  # the outputs at t + k read x[t] through tap W-1-k
            later = mask & (t + k < end)[:, None]
            pre = _pre(xp + k * sx_t, ip + k * si_w, d + k, wp, bias_ptr, sx_t, si_w, sw_w, cols,
                       c_mask, later, W, HAS_BIAS, HAS_INIT)  # fmt: skip
            dy = tl.load(dyp + k * sdy_t, mask=later, other=0.0).to(tl.float32)
            dpre = _dpre(pre, dy, SILU)
            wk = tl.load(wp + (W - 1 - k) * sw_w, mask=c_mask, other=0.0).to(tl.float32)
            dx += wk[None, :] * dpre
            if k == 0:  # this block's own outputs: the weight's and bias's gradients
                db += tl.sum(dpre, 0)
                for j in tl.static_range(W):
                    x_j = _tap(xp, ip, d, mask, j, sx_t, si_w, W, HAS_INIT)
                    dw += tl.where(taps[:, None] == j, tl.sum(dpre * x_j, 0)[None, :], 0.0)
        if HAS_DFINAL:  # final_states[doc, :, f] is x at end - (W - 1) + f
            f = t - (end - (W - 1))
            offs = doc.to(tl.int64) * sf_n + f * sf_w
            dx += tl.load(dfinal_ptr + offs[:, None] + cols[None, :] * sf_c,
                          mask=mask & (f >= 0)[:, None], other=0.0).to(tl.float32)  # fmt: skip
        offs = row.to(tl.int64) * sdx_b + t.to(tl.int64) * sdx_t
        tl.store(dx_ptr + offs[:, None] + cols[None, :] * sdx_c,
                 dx.to(dx_ptr.dtype.element_ty), mask=mask)  # fmt: skip
    base = pid.to(tl.int64) * W * C
    tl.store(dw_ptr + base + taps[:, None] * C + cols[None, :], dw,
             mask=(taps < W)[:, None] & c_mask[None, :])  # fmt: skip
    tl.store(db_ptr + pid.to(tl.int64) * C + cols, db, mask=c_mask)


@triton.jit
def _conv1d_edge_kernel(
    # pointers (BACKWARD: dy, bias, dfinal read; initial states' gradient written to out)
    x_ptr, w_ptr, bias_ptr, init_ptr, cu_ptr, dy_ptr, dfinal_ptr, out_ptr,
    # strides
    sx_b, sx_t, sx_c, sw_c, sw_w, si_n, si_c, si_w, sdy_b, sdy_t, sdy_c, sf_n, sf_c, sf_w,
    so_n, so_c, so_w,
    # sizes
    T, C,
    # meta-parameters
    W: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_INIT: tl.constexpr, PACKED: tl.constexpr, SILU: tl.constexpr, HAS_DFINAL: tl.constexpr,
    BACKWARD: tl.constexpr,
):  # fmt: skip
    """Of sequence (or document) n, BLOCK_C channels, its W - 1 state entries r: forward,
    final_states[n, :, r] (the position end - (W - 1) + r of [initial ; x]); backward,
    initial_states' gradient ``sum_{j <= r} w[:, j] dpre[start + r - j]`` (the outputs
    reading entry r) plus dfinal's where the document is shorter than W - 1."""
    n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = cols < C
    r = tl.arange(0, BLOCK_S)
    if PACKED:
        row, start, end = 0, tl.load(cu_ptr + n), tl.load(cu_ptr + n + 1)
    else:
        row, start, end = n, 0, T
    rows, docs = tl.zeros_like(r) + row, tl.zeros_like(r) + n
    mask = (r < W - 1)[:, None] & c_mask[None, :]
    if BACKWARD:  # the outputs at start + r - j read entry r through tap j (j <= r)
        xp, ip, d = _window(x_ptr, init_ptr, sx_b, sx_t, sx_c, si_n, si_c, si_w, rows,
                            start + r, start, docs, cols, W)  # fmt: skip
        offs = rows.to(tl.int64) * sdy_b + (start + r).to(tl.int64) * sdy_t
        dyp = dy_ptr + offs[:, None] + cols[None, :] * sdy_c
        wp = w_ptr + cols * sw_c
        acc = tl.zeros((BLOCK_S, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(W):
            later = mask & ((r >= j) & (start + r - j < end))[:, None]
            pre = _pre(xp - j * sx_t, ip - j * si_w, d - j, wp, bias_ptr, sx_t, si_w, sw_w, cols,
                       c_mask, later, W, HAS_BIAS, HAS_INIT)  # fmt: skip
            dy = tl.load(dyp - j * sdy_t, mask=later, other=0.0).to(tl.float32)
            wj = tl.load(wp + j * sw_w, mask=c_mask, other=0.0).to(tl.float32)
            acc += wj[None, :] * _dpre(pre, dy, SILU)
        if HAS_DFINAL:  # entry r is final_states' r - (end - start) when that is >= 0
            f = r - (end - start)
            offs = n.to(tl.int64) * sf_n + f * sf_w
            acc += tl.load(dfinal_ptr + offs[:, None] + cols[None, :] * sf_c,
                           mask=mask & (f >= 0)[:, None], other=0.0).to(tl.float32)  # fmt: skip
    else:  # tap W - 1 of the token at end - (W - 1) + r reads that very position
        xp, ip, d = _window(x_ptr, init_ptr, sx_b, sx_t, sx_c, si_n, si_c, si_w, rows,
                            end - (W - 1) + r, start, docs, cols, W)  # fmt: skip
        acc = _tap(xp, ip, d, mask, W - 1, sx_t, si_w, W, HAS_INIT)
    offs = n.to(tl.int64) * so_n + r * so_w
    tl.store(out_ptr + offs[:, None] + cols[None, :] * so_c, acc.to(out_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


# --- launchers -------------------------------------------------------------------------


def check_inputs(x, weight, bias=None, activation="silu", cu_seqlens=None,
                 initial_states=None, *, values=True) -> int:  # fmt: skip
    """ValueError/TypeError naming the sizes unless x (B, T, C), weight (C, W) with
    1 <= W <= MAX_WIDTH, bias (C,), initial_states (N, C, W - 1) in x's dtype, cu_seqlens
    int32 (N + 1,) with B = 1, all on x's device; returns N. The cu_seqlens' values are
    read with `values`, on a CPU only (on a GPU that would be a host sync)."""
    check_float_dtype("x", x)
    check_float_dtype("weight", weight)
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation must be 'silu' or None, got {activation!r}")
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"causal_conv1d: x (B, T, C) and weight (C, W) must agree on C, got "
                         f"x {tuple(x.shape)} and weight {tuple(weight.shape)}")  # fmt: skip
    B, T, C = x.shape
    W = weight.shape[1]
    if not 1 <= W <= MAX_WIDTH:
        raise ValueError(f"causal_conv1d: kernel width {W} (weight {tuple(weight.shape)}) "
                         f"is outside 1..{MAX_WIDTH}")  # fmt: skip
    if bias is not None:
        check_float_dtype("bias", bias)
        if bias.shape != (C,):
            raise ValueError(f"causal_conv1d: bias must be ({C},), got {tuple(bias.shape)}")
    N = B
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, T, values=values and x.device.type == "cpu")
        if B != 1:
            raise ValueError(f"causal_conv1d: with cu_seqlens the documents are packed into "
                             f"one sequence (B = 1), got x {tuple(x.shape)}")  # fmt: skip
        N = cu_seqlens.shape[0] - 1
    if initial_states is not None:
        if initial_states.shape != (N, C, W - 1):
            raise ValueError(f"causal_conv1d: initial_states must be (N, C, W - 1) = "
                             f"({N}, {C}, {W - 1}), got {tuple(initial_states.shape)}")  # fmt: skip
        if initial_states.dtype != x.dtype:
            raise TypeError(f"causal_conv1d: initial_states must be x's {x.dtype}, got "
                            f"{initial_states.dtype}")  # fmt: skip
    others = (weight, bias, cu_seqlens, initial_states)
    if any(t is not None and t.device != x.device for t in others):
        devices = sorted({str(t.device) for t in (x, *others) if t is not None})
        raise ValueError(f"causal_conv1d: all tensors must be on one device, got {devices}")
    return N


def _flags(bias, initial_states, cu_seqlens, activation, dfinal=None) -> dict:
    return {"HAS_BIAS": bias is not None, "HAS_INIT": initial_states is not None,
            "PACKED": cu_seqlens is not None, "SILU": activation == "silu",
            **({} if dfinal is False else {"HAS_DFINAL": dfinal is not None})}  # fmt: skip


def _documents(cu_seqlens, N: int) -> tuple:
    """The kernels' (N, steps of the binary search over the N documents' starts)."""
    return N, (N - 1).bit_length() if cu_seqlens is not None else 0


def _stand_in(t, x):
    """A tensor the kernels are given for an absent one (never read), and its strides
    padded to three."""
    t = x if t is None else t
    return t, (*t.stride(), 0, 0, 0)[:3]


def causal_conv1d(x, weight, bias=None, activation="silu", cu_seqlens=None,
                  initial_states=None, output_final_states=False):  # fmt: skip
    """``(y, final_states)``: y (B, T, C) in x's dtype, final_states (N, C, W - 1) in x's
    dtype or None (the module doc). x, weight, bias any strides."""
    N = check_inputs(x, weight, bias, activation, cu_seqlens, initial_states)
    B, T, C = x.shape
    W = weight.shape[1]
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    final = x.new_empty((N, C, W - 1)) if output_final_states else None
    args = (x, weight, bias, activation, cu_seqlens, initial_states, y, final)
    if impl.runs_torch(x):
        causal_conv1d_torch(*args)
        return y, final
    check_launchable(_conv1d_fwd_kernel, x, weight)
    config = tile_config(is_interpreted(_conv1d_fwd_kernel))
    N, steps = _documents(cu_seqlens, N)
    init, init_strides = _stand_in(initial_states, x)
    bias_, cu = _stand_in(bias, x)[0], x if cu_seqlens is None else cu_seqlens
    flags = _flags(bias, initial_states, cu_seqlens, activation, dfinal=False)
    M = B * T
    if M and C:
        grid = lambda tile: (common.cdiv(M, tile["BLOCK_T"]), common.cdiv(C, tile["BLOCK_C"]))  # noqa: E731
        fwd_args = (x, weight, bias_, init, cu, y, *x.stride(), *weight.stride(), *init_strides,
                    *y.stride(), T, C, M, N, steps)  # fmt: skip
        key = (bucket(M), C, W, *flags.values(), str(x.dtype), str(weight.dtype))
        tuning.run_tile_or_torch(_conv1d_fwd_kernel, config, grid, fwd_args, {"W": W, **flags},
                                  key, x, lambda: causal_conv1d_torch(*args))  # fmt: skip
    if final is not None and final.numel():
        _edges(x, weight, bias, cu, initial_states, None, None, final, flags, W)
    return y, final


def _edges(x, weight, bias, cu, initial_states, dy, dfinal, out, flags, W):
    """`_conv1d_edge_kernel` into `out` (N, C, W - 1): final_states, or with dy the
    initial states' gradient."""
    N, C = out.shape[:2]
    tile = tile_config(is_interpreted(_conv1d_edge_kernel))
    init, init_strides = _stand_in(initial_states, x)
    dy_, dy_strides = _stand_in(dy, x)
    dfinal_, dfinal_strides = _stand_in(dfinal, x)
    grid = (N, common.cdiv(C, tile["BLOCK_C"]))
    meta = dict(flags, HAS_DFINAL=dfinal is not None, BACKWARD=dy is not None)
    with common.device_guard(x):
        _conv1d_edge_kernel[grid](
            x, weight, _stand_in(bias, x)[0], init, cu, dy_, dfinal_, out, *x.stride(),
            *weight.stride(), *init_strides, *dy_strides, *dfinal_strides, *out.stride(),
            x.shape[1], C, W=W, BLOCK_S=common.next_power_of_2(W - 1),
            BLOCK_C=tile["BLOCK_C"], num_warps=tile["num_warps"], **meta,
        )  # fmt: skip


def backward_programs(M: int, block_t: int, c_blocks: int, device, interpreted: bool) -> int:
    """Backward programs along the tokens (each one partial of the weight's gradient):
    enough, with the channel blocks, to fill the GPU; never more than token blocks."""
    cuda = device.type == "cuda" and not interpreted
    most = common.cdiv(PROGRAMS_PER_SM * sm_count(device), c_blocks) if cuda else 3
    return max(1, min(most, common.cdiv(M, block_t)))


def causal_conv1d_backward(dy, dfinal, x, weight, bias=None, activation="silu",
                           cu_seqlens=None, initial_states=None, needs=(True,) * 4):  # fmt: skip
    """``(dx, dweight, dbias, dinitial_states)`` of `causal_conv1d` from dy (x's shape)
    and dfinal (final_states' gradient, or None); each in its input's dtype, None where
    `needs` (x, weight, bias, initial_states) says no or the input is absent. The
    weight's and bias's gradients sum fp32 per-program partials in a fixed order."""
    N = check_inputs(x, weight, bias, activation, cu_seqlens, initial_states)
    B, T, C = x.shape
    W = weight.shape[1]
    if dy.shape != x.shape or (dfinal is not None and dfinal.shape != (N, C, W - 1)):
        raise ValueError(f"causal_conv1d_backward: dy {tuple(dy.shape)} must be x's "
                         f"{tuple(x.shape)}, dfinal ({N}, {C}, {W - 1})")  # fmt: skip
    args = (dy, dfinal, x, weight, bias, activation, cu_seqlens, initial_states)
    if impl.runs_torch(x):
        grads = causal_conv1d_backward_torch(*args)
    else:
        check_launchable(_conv1d_bwd_kernel, dy, x, weight)
        grads = _backward_kernels(*args)
    present = (x, weight, bias, initial_states)
    return tuple(g if need and p is not None else None
                 for g, need, p in zip(grads, needs, present, strict=True))  # fmt: skip


def _backward_kernels(dy, dfinal, x, weight, bias, activation, cu_seqlens, initial_states):
    B, T, C = x.shape
    W, M = weight.shape[1], B * T
    interpreted = is_interpreted(_conv1d_bwd_kernel)
    config = tile_config(interpreted, "backward")
    c_blocks = common.cdiv(C, config["BLOCK_C"])
    programs = backward_programs(M, config["BLOCK_T"], c_blocks, x.device, interpreted)
    per_program = common.cdiv(common.cdiv(M, programs), config["BLOCK_T"]) * config["BLOCK_T"]
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dw = torch.zeros((programs, W, C), dtype=torch.float32, device=x.device)
    db = torch.zeros((programs, C), dtype=torch.float32, device=x.device)
    N, steps = _documents(cu_seqlens, B if cu_seqlens is None else cu_seqlens.shape[0] - 1)
    flags = _flags(bias, initial_states, cu_seqlens, activation, dfinal)
    cu = x if cu_seqlens is None else cu_seqlens
    torch_args = (dy, dfinal, x, weight, bias, activation, cu_seqlens, initial_states)

    def torch_run():  # its gradients as the first partial rows, the others 0
        dw.zero_(), db.zero_()
        dx_t, dw_t, db_t, _ = causal_conv1d_backward_torch(*torch_args, accumulate=True)
        dx.copy_(dx_t), dw[0].copy_(dw_t.T), db[0].copy_(db_t)

    if M and C:
        init, init_strides = _stand_in(initial_states, x)
        dfinal_, dfinal_strides = _stand_in(dfinal, x)
        args = (dy, x, weight, _stand_in(bias, x)[0], init, cu, dfinal_, dx, dw, db, *dy.stride(),
                *x.stride(), *weight.stride(), *init_strides, *dfinal_strides, *dx.stride(), T,
                C, M, N, steps, per_program)  # fmt: skip
        key = (bucket(M), C, W, *flags.values(), str(x.dtype), str(weight.dtype))
        meta = {"W": W, "BLOCK_W": common.next_power_of_2(W), **flags}
        tuning.run_tile_or_torch(_conv1d_bwd_kernel, config, lambda _: (programs, c_blocks),
                                  args, meta, key, x, torch_run)  # fmt: skip
    dinit = None
    if initial_states is not None and initial_states.numel():
        dinit = x.new_empty(initial_states.shape)
        _edges(x, weight, bias, cu, initial_states, dy, dfinal, dinit, flags, W)
    elif initial_states is not None:
        dinit = x.new_zeros(initial_states.shape)
    dweight = dw.sum(0).T.contiguous().to(weight.dtype)
    dbias = db.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias, dinit
