"""The epilogues of `fusedpar.kernels.matmul`'s kernel: what a tile does with its fp32
accumulator before C is written. Every one rounds once.

| epilogue          | writes                                                          |
| ----------------- | --------------------------------------------------------------- |
| `epilogue`        | ``C = rope(acc (+ bias)) (+ C)``: bias, heads turned (RoPE), C added |
| `gated_epilogue`  | a gated MLP's: gate, up (two accumulators) and ``act(gate) * up``; |
|                   | up and the product (the gate read); or from dh and the saved gate |
|                   | and up, dgate, dup (and the product again)                     |

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
def gated_epilogue(acc, acc2, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, g_ptr, u_ptr,
                   bias_ptr, bias2_ptr, start_m, start_n, M, N, stride_cm, stride_cn, stride_gm,
                   stride_gn, stride_bias, GATED: tl.constexpr, ACTIVATION: tl.constexpr,
                   HAS_BIAS: tl.constexpr, STORE_H: tl.constexpr, C_TMA: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """A dense gated MLP's tiles, h = act(gate) * up, each rounded to C's dtype as a GEMM
    would store it and computed from the rounded values, as `fusedpar.kernels.gated` does
    (the module doc's table; g, u: the stored gate and up, C's dtype; c2, h: C's strides):

    - "forward": acc (+ bias) is gate and acc2 (+ bias2) up: C, c2 and h written;
    - "product": acc (+ bias) is up, the gate is read from g: C and h written;
    - "backward": acc is dh, gate and up are read from g and u: ``dgate = dh * up *
      act'(gate)`` into C, ``dup = dh * act(gate)`` into c2 and with STORE_H h again.

    Column half by column half, so only half of each temporary is live beside the
    accumulators (whole, 128x128 tiles with two accumulators spilled 16-64 B)."""
    HALF: tl.constexpr = BLOCK_N // 2
    left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
    left2, right2 = left, right  # (acc2 is read by "forward" only)
    if GATED == "forward":
        left2, right2 = tl.split(tl.permute(tl.reshape(acc2, (BLOCK_M, 2, HALF)), (0, 2, 1)))
    _gated_half(left, left2, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, g_ptr, u_ptr,
                bias_ptr, bias2_ptr, start_m, start_n, M, N, stride_cm, stride_cn, stride_gm,
                stride_gn, stride_bias, GATED, ACTIVATION, HAS_BIAS, STORE_H, C_TMA, BLOCK_M,
                HALF)  # fmt: skip
    _gated_half(right, right2, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, g_ptr, u_ptr,
                bias_ptr, bias2_ptr, start_m, start_n + HALF, M, N, stride_cm, stride_cn,
                stride_gm, stride_gn, stride_bias, GATED, ACTIVATION, HAS_BIAS, STORE_H, C_TMA,
                BLOCK_M, HALF)  # fmt: skip


@triton.jit
def _gated_half(x, x2, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, g_ptr, u_ptr, bias_ptr,
                bias2_ptr, start_m, start_n, M, N, stride_cm, stride_cn, stride_gm, stride_gn,
                stride_bias, GATED: tl.constexpr, ACTIVATION: tl.constexpr,
                HAS_BIAS: tl.constexpr, STORE_H: tl.constexpr, C_TMA: tl.constexpr,
                BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):  # fmt: skip
    """`gated_epilogue` of the WIDTH columns from start_n (a half of the tile)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, WIDTH)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    saved = offs_m[:, None].to(tl.int64) * stride_gm + offs_n[None, :].to(tl.int64) * stride_gn
    out_ty = c_ptr.dtype.element_ty
    if GATED == "backward":
        g = tl.load(g_ptr + saved, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + saved, mask=mask, other=0.0).to(tl.float32)
        dh = x.to(out_ty).to(tl.float32)
        a, slope = _activation(g, ACTIVATION)
        _store_part((dh * u * slope).to(out_ty), c_ptr, c_desc, start_m, start_n, M, N,
                    stride_cm, stride_cn, C_TMA, BLOCK_M, WIDTH)  # fmt: skip
        _store_part((dh * a).to(out_ty), c2_ptr, c2_desc, start_m, start_n, M, N, stride_cm,
                    stride_cn, C_TMA, BLOCK_M, WIDTH)  # fmt: skip
    else:
        if HAS_BIAS:
            x += tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0).to(
                tl.float32)[None, :]  # fmt: skip
        if GATED == "forward":  # x: gate, x2: up
            if HAS_BIAS:
                x2 += tl.load(bias2_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0).to(
                    tl.float32)[None, :]  # fmt: skip
            g = x.to(out_ty)
            u = x2.to(out_ty)
            _store_part(g, c_ptr, c_desc, start_m, start_n, M, N, stride_cm, stride_cn, C_TMA,
                        BLOCK_M, WIDTH)  # fmt: skip
            _store_part(u, c2_ptr, c2_desc, start_m, start_n, M, N, stride_cm, stride_cn,
                        C_TMA, BLOCK_M, WIDTH)  # fmt: skip
        else:  # "product", x: up
            u = x.to(out_ty)
            _store_part(u, c_ptr, c_desc, start_m, start_n, M, N, stride_cm, stride_cn, C_TMA,
                        BLOCK_M, WIDTH)  # fmt: skip
            g = tl.load(g_ptr + saved, mask=mask, other=0.0)
        a, _ = _activation(g.to(tl.float32), ACTIVATION)
        u = u.to(tl.float32)
    if STORE_H:
        _store_part((a * u).to(out_ty), h_ptr, h_desc, start_m, start_n, M, N, stride_cm,
                    stride_cn, C_TMA, BLOCK_M, WIDTH)  # fmt: skip


@triton.jit
def _store_part(x, ptr, desc, start_m, start_n, M, N, stride_m, stride_n, C_TMA: tl.constexpr,
                BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):  # fmt: skip
    """A (BLOCK_M, WIDTH) tile at (start_m, start_n) of an output of C's strides, through
    its descriptor or masked pointers."""
    if C_TMA:
        desc.store([start_m, start_n], x)
    else:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = start_n + tl.arange(0, WIDTH)
        at = offs_m[:, None].to(tl.int64) * stride_m + offs_n[None, :].to(tl.int64) * stride_n
        tl.store(ptr + at, x, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
