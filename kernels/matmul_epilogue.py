"""The epilogues of `fusedpar.kernels.matmul`'s kernel: what a tile does with its fp32
accumulator before C is written. Every one rounds once.

| epilogue          | writes                                                          |
| ----------------- | --------------------------------------------------------------- |
| `epilogue`        | ``C = rope(acc (+ bias)) (+ C)``: bias, heads turned (RoPE), C added |
| `gated_epilogue`  | gate, up (two accumulators, biases) and ``act(gate) * up``      |
| `gated_grad_epilogue` | from dh and the saved gate, up: dgate, dup (and h again)    |

C goes through a TMA descriptor (`output_target`, two column halves: the staged tile is
half as large) or through masked pointers.
"""

import triton
import triton.language as tl
from fusedpar.kernels.gated import _activation


@triton.jit
def output_target(ptr, M, N, stride_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A TMA descriptor of a row-major (M, N) output, stored in two column halves."""
    return tl.make_tensor_descriptor(ptr, shape=[M, N], strides=[stride_m, 1],
                                     block_shape=[BLOCK_M, BLOCK_N // 2])  # fmt: skip


@triton.jit
def _store_half(c_desc, c_ptr, acc, start_m, start_n, ACCUMULATE: tl.constexpr):
    if ACCUMULATE:
        acc += c_desc.load([start_m, start_n]).to(tl.float32)
    c_desc.store([start_m, start_n], acc.to(c_ptr.dtype.element_ty))


@triton.jit
def _rotate_heads(acc, cos_ptr, sin_ptr, start_m, M, rope_first_row, rope_rows_per_position,
                  stride_cos, stride_sin, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):  # fmt: skip
    """The tile's heads (2 * HALF columns each, whole in it) rotated by their rows'
    angles: each pair (i, i + HALF) of a head as `fusedpar.kernels.rope` turns it. The
    halves are split in registers (a thread holds columns c and c + HALF alike, as in the
    C_TMA split below); the tables' rows are read once a tile."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    position = (rope_first_row + offs_m.to(tl.int64)) // rope_rows_per_position
    i = tl.arange(0, HALF)
    in_rows = (offs_m < M)[:, None]
    c = tl.load(cos_ptr + position[:, None] * stride_cos + i[None, :], mask=in_rows, other=0.0)
    s = tl.load(sin_ptr + position[:, None] * stride_sin + i[None, :], mask=in_rows, other=0.0)
    c, s = c[:, None, :], s[:, None, :]  # (BLOCK_M, 1, HALF): one row for every head
    heads = tl.reshape(acc, (BLOCK_M, BLOCK_N // (2 * HALF), 2, HALF))
    x1, x2 = tl.split(tl.permute(heads, (0, 1, 3, 2)))  # (BLOCK_M, heads, HALF) each
    rotated = tl.join(x1 * c - x2 * s, x2 * c + x1 * s)
    return tl.reshape(tl.permute(rotated, (0, 1, 3, 2)), (BLOCK_M, BLOCK_N))


@triton.jit
def epilogue(acc, c_ptr, c_desc, bias_ptr, cos_ptr, sin_ptr, start_m, start_n, M, N,
              stride_cm, stride_cn, stride_bias, stride_cos, stride_sin, rope_first_row,
              rope_rows_per_position, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
              C_TMA: tl.constexpr, ROPE_HALF: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):  # fmt: skip
    """``C = rope(acc (+ bias)) (+ C)`` for one tile, rounded once (ROPE_HALF > 0: the
    heads rotated, `_rotate_heads`). Through a TMA descriptor (edges clipped by it) C
    goes in two column halves, so the tile staged in shared memory is half as large (the
    Triton tutorial's epilogue subtiling: 128x128 adding into fp32 needed 257 KiB whole,
    over an H100's 227); else through masked pointers."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if ROPE_HALF > 0:
        acc = _rotate_heads(acc, cos_ptr, sin_ptr, start_m, M, rope_first_row,
                            rope_rows_per_position, stride_cos, stride_sin, ROPE_HALF,
                            BLOCK_M, BLOCK_N)  # fmt: skip
    _store_tile(acc, c_ptr, c_desc, start_m, start_n, M, N, stride_cm, stride_cn, ACCUMULATE,
                C_TMA, BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit
def _store_tile(acc, c_ptr, c_desc, start_m, start_n, M, N, stride_cm, stride_cn,
                ACCUMULATE: tl.constexpr, C_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """``C (+)= acc`` for one tile, rounded once to C's dtype."""
    if C_TMA:
        left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        _store_half(c_desc, c_ptr, left, start_m, start_n, ACCUMULATE)
        _store_half(c_desc, c_ptr, right, start_m, start_n + BLOCK_N // 2, ACCUMULATE)
    else:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        c_ptrs = (c_ptr + offs_m[:, None].to(tl.int64) * stride_cm
                  + offs_n[None, :].to(tl.int64) * stride_cn)  # fmt: skip
        c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if ACCUMULATE:
            acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def gated_epilogue(g, u, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, bias_ptr, bias2_ptr,
                    start_m, start_n, M, N, stride_cm, stride_cn, stride_bias,
                    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, C_TMA: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """gate = g (+ bias), up = u (+ bias2), each rounded to C's dtype as the two GEMMs
    would store them, and ``h = act(gate) * up`` from those rounded values, as
    `fusedpar.kernels.gated` computes it: the three tiles of a dense gated MLP's first
    projection, with no pass of their own for h. Column half by column half, so only
    half of each temporary is live beside the two accumulators (whole, 128x128 tiles
    spilled 16-64 B with gelu_tanh or through pointers)."""
    HALF: tl.constexpr = BLOCK_N // 2
    g_left, g_right = tl.split(tl.permute(tl.reshape(g, (BLOCK_M, 2, HALF)), (0, 2, 1)))
    u_left, u_right = tl.split(tl.permute(tl.reshape(u, (BLOCK_M, 2, HALF)), (0, 2, 1)))
    _gated_half(g_left, u_left, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, bias_ptr,
                bias2_ptr, start_m, start_n, M, N, stride_cm, stride_cn, stride_bias,
                ACTIVATION, HAS_BIAS, C_TMA, BLOCK_M, HALF)  # fmt: skip
    _gated_half(g_right, u_right, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, bias_ptr,
                bias2_ptr, start_m, start_n + HALF, M, N, stride_cm, stride_cn, stride_bias,
                ACTIVATION, HAS_BIAS, C_TMA, BLOCK_M, HALF)  # fmt: skip


@triton.jit
def _gated_half(g, u, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, bias_ptr, bias2_ptr,
                start_m, start_n, M, N, stride_cm, stride_cn, stride_bias,
                ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, C_TMA: tl.constexpr,
                BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):  # fmt: skip
    """`gated_epilogue` of the WIDTH columns from start_n (a half of the tile)."""
    offs_n = start_n + tl.arange(0, WIDTH)
    if HAS_BIAS:
        g += tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0).to(
            tl.float32)[None, :]  # fmt: skip
        u += tl.load(bias2_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0).to(
            tl.float32)[None, :]  # fmt: skip
    out_ty = c_ptr.dtype.element_ty
    g = g.to(out_ty)
    u = u.to(out_ty)
    a, _ = _activation(g.to(tl.float32), ACTIVATION)
    h = (a * u.to(tl.float32)).to(out_ty)
    _store_halves(g, u, h, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, start_m, start_n, M,
                  N, stride_cm, stride_cn, True, C_TMA, BLOCK_M, WIDTH)  # fmt: skip


@triton.jit
def gated_grad_epilogue(acc, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, g_ptr, u_ptr,
                        start_m, start_n, M, N, stride_cm, stride_cn, stride_gm, stride_gn,
                        ACTIVATION: tl.constexpr, STORE_H: tl.constexpr, C_TMA: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """acc is dh: rounded to C's dtype (as `matmul` would store it), then with the saved
    gate and up tiles ``dgate = dh * up * act'(gate)`` (into C), ``dup = dh * act(gate)``
    (c2) and with STORE_H ``h = act(gate) * up`` (h), as `fusedpar.kernels.gated`
    computes them from a stored dh: a dense gated MLP's hidden gradient with no pass of
    its own. Column half by column half, as `gated_epilogue`."""
    HALF: tl.constexpr = BLOCK_N // 2
    left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
    _gated_grad_half(left, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, g_ptr, u_ptr, start_m,
                     start_n, M, N, stride_cm, stride_cn, stride_gm, stride_gn, ACTIVATION,
                     STORE_H, C_TMA, BLOCK_M, HALF)  # fmt: skip
    _gated_grad_half(right, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, g_ptr, u_ptr,
                     start_m, start_n + HALF, M, N, stride_cm, stride_cn, stride_gm, stride_gn,
                     ACTIVATION, STORE_H, C_TMA, BLOCK_M, HALF)  # fmt: skip


@triton.jit
def _gated_grad_half(dh, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, g_ptr, u_ptr, start_m,
                     start_n, M, N, stride_cm, stride_cn, stride_gm, stride_gn,
                     ACTIVATION: tl.constexpr, STORE_H: tl.constexpr, C_TMA: tl.constexpr,
                     BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):  # fmt: skip
    """`gated_grad_epilogue` of the WIDTH columns from start_n (a half of the tile)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, WIDTH)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    at = offs_m[:, None].to(tl.int64) * stride_gm + offs_n[None, :].to(tl.int64) * stride_gn
    g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
    out_ty = c_ptr.dtype.element_ty
    dh = dh.to(out_ty).to(tl.float32)
    a, slope = _activation(g, ACTIVATION)
    dup = (dh * a).to(out_ty)
    dgate = (dh * u * slope).to(out_ty)
    h = dup  # (not stored without STORE_H)
    if STORE_H:
        h = (a * u).to(out_ty)
    _store_halves(dgate, dup, h, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, start_m,
                  start_n, M, N, stride_cm, stride_cn, STORE_H, C_TMA, BLOCK_M, WIDTH)  # fmt: skip


@triton.jit
def _store_halves(first, second, h, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, start_m,
                  start_n, M, N, stride_cm, stride_cn, STORE_H: tl.constexpr,
                  C_TMA: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):  # fmt: skip
    """Three (BLOCK_M, WIDTH) tiles of C's strides at (start_m, start_n): C, c2 and (with
    STORE_H) h, through their descriptors or masked pointers."""
    if C_TMA:
        c_desc.store([start_m, start_n], first)
        c2_desc.store([start_m, start_n], second)
        if STORE_H:
            h_desc.store([start_m, start_n], h)
    else:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = start_n + tl.arange(0, WIDTH)
        at = offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(c_ptr + at, first, mask=mask)
        tl.store(c2_ptr + at, second, mask=mask)
        if STORE_H:
            tl.store(h_ptr + at, h, mask=mask)
