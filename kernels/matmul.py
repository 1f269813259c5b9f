"""Tiled GEMM with strided operands: ``C = A @ B (+ bias)`` or ``C += A @ B (+ bias)``,
optionally with C's heads rotated (RoPE) in the epilogue.

| tensor | shape  | dtype                          | strides   |
| ------ | ------ | ------------------------------ | --------- |
| A      | (M, K) | fp16, bf16 or fp32             | any       |
| B      | (K, N) | A's                            | any       |
| bias   | (N,)   | A's or fp32                    | any       |
| C      | (M, N) | A's or fp32                    | any       |

Any strides means a transposed weight (``weight.T``) is read in place and C can be a
slice of a larger buffer (a chunk's rows of an all-gathered output). Products accumulate
in fp32 and are rounded once; with ``accumulate=True`` the old C is added in fp32 before
that rounding, which is how reduce-scatter partials and weight gradients build up in an
fp32 buffer.

``rope=RowRotation(cos, sin, ...)`` rotates each head of C (hd = 2 * cos.shape[1] columns)
by its row's angles before that rounding: a q or k projection leaves the GEMM with its
rotary embedding applied, one rounding instead of two and no pass of its own (the
tile then spans whole heads: `rope_epilogue_fits`).
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from fusedpar.kernels import _common, _impl, _tuning
from fusedpar.kernels._common import (
    cdiv,
    check_float_dtype,
    check_launchable,
    device_guard,
    ensure_tma_allocator,
    fp32_dot_precision,
    is_interpreted,
    next_power_of_2,
    sm_count,
    tma_paths,
)
from fusedpar.kernels._tuning import Agreement, bucket
from fusedpar.kernels.matmul_torch import cublas_computes, matmul_torch

# Row blocks that share one column of B tiles in L2 (the Triton tutorial's grouped order).
GROUP_M = 8
# The interpreter runs one program at a time in numpy: fewer, larger tiles are faster, and
# 64 keeps the per-program arrays small on 2 cores.
INTERPRETER_MAX_BLOCK = 64
# The K step of every tile, GPU and interpreter alike (see `matmul_configs`).
BLOCK_K = 64


# BLOCK_M, BLOCK_N, num_stages, num_warps. Every tile passes the resource gate
# (tests/test_compile_gate.py, docs/resources.md): it fits an H100's shared memory and,
# in fp16/bf16, does not spill. Adding into an fp32 C loads a (BLOCK_M, BLOCK_N) fp32
# tile in the epilogue: 128x256 and 256x128 with 8 warps then spill 96-192 B, and
# 128x128 with 4 warps 96 B, so those are left out of the accumulating list.
_TILES_16BIT = [
    (128, 256, 3, 8), (256, 128, 3, 8), (128, 128, 4, 8), (128, 128, 3, 4), (128, 64, 4, 4),
    (64, 128, 4, 4), (64, 64, 4, 4), (128, 32, 4, 4), (64, 32, 5, 2), (32, 64, 5, 2),
    (32, 32, 4, 2),
]  # fmt: skip
_SPILL_WHEN_ACCUMULATING = {(128, 256, 3, 8), (256, 128, 3, 8), (128, 128, 3, 4)}
# Rotating heads in the epilogue (`_rotate_heads`) holds the tables' rows beside the
# accumulator: the same three tiles then spill 80-472 B (hd 64-256; 128x256 at hd 64 is
# at 252 registers), so a rotating GEMM leaves them out too.
_SPILL_WHEN_ROTATING = _SPILL_WHEN_ACCUMULATING
# fp32 runs as FMA loops at full precision (PyTorch's default) and through TF32 wgmma
# otherwise; these tiles serve both. 128x256 and 128x128x4 in fp32 need 256-288 KB of
# shared memory (over an H100's 227 KB), and 128x128 with 4 warps as FMA spills over
# 1 KB and takes 13 s to build (review F1).
_TILES_FP32 = [(128, 64, 3, 8), (64, 64, 3, 8), (64, 64, 4, 4), (32, 32, 3, 4)]


def matmul_configs(dtype: torch.dtype, accumulate: bool, head_dim: int = 0) -> list[triton.Config]:
    """Tiles the tuner tries on a GPU for A's dtype, whether C is added into, and the
    heads a rotating epilogue turns (`head_dim`: the tiles whose columns hold whole
    heads, 0: no rotation), pruned for small problems by `_prune_configs`.

    Large tiles with 8 warps feed Hopper's wgmma; the small ones serve thin TP shards and
    decode-sized M. Every tile has the same BLOCK_K, so each output sums its K products in
    the same order whichever tile wins: the numbers do not depend on the tuning (a TP
    shard's GEMM equals the matching rows of the single-device GEMM, bit for bit).
    """
    if dtype == torch.float32:
        tiles = _TILES_FP32
    else:
        tiles = [t for t in _TILES_16BIT if not (accumulate and t in _SPILL_WHEN_ACCUMULATING)]
    if head_dim:
        tiles = [t for t in tiles if t[1] % head_dim == 0 and t not in _SPILL_WHEN_ROTATING]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": BLOCK_K}, num_stages=s, num_warps=w)
        for bm, bn, s, w in tiles
    ]


class RowRotation(NamedTuple):
    """The rotary embedding `matmul` applies to C in its epilogue. C's row m is at
    position ``(first_row + m) // rows_per_position`` of the tables cos, sin (P, hd/2)
    fp32 (rows in (S, B) order have ``rows_per_position = B``; a chunk of them starts at
    ``first_row``); every hd = 2 * cos.shape[1] columns of C are one head, whose pairs
    (i, i + hd/2) turn by the position's angles (full rotary: `fusedpar.kernels.rope`)."""

    cos: torch.Tensor
    sin: torch.Tensor
    rows_per_position: int = 1
    first_row: int = 0


def rope_epilogue_fits(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `matmul` can rotate heads of `head_dim` in its epilogue for A of `dtype`:
    a power of 2 that some tile's columns hold whole (16-bit: up to 128, fp32: up to
    64; 256 only in the tiles that spill rotating). Otherwise a caller rotates after the
    GEMM (`fusedpar.kernels.rope`)."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    power_of_2 = head_dim >= 2 and head_dim & (head_dim - 1) == 0
    return power_of_2 and bool(matmul_configs(dtype, False, head_dim))


def _prune_configs(configs, M: int, N: int):
    """Drop tiles larger than the problem (they only waste lanes); keep at least one."""
    limit_m = max(32, next_power_of_2(M))
    limit_n = max(32, next_power_of_2(N))
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= limit_m and c.kwargs["BLOCK_N"] <= limit_n]
    if kept:
        return kept
    return [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


@triton.jit
def tile_of(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile `tile`'s (row block, column block) in grouped order: GROUP_M consecutive row
    blocks walk the same column blocks, so the B tiles they share stay in L2."""
    pids_per_group = GROUP_M * num_pid_n
    first_pid_m = (tile // pids_per_group) * GROUP_M
    group_rows = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile % pids_per_group) % group_rows
    pid_n = (tile % pids_per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _operand_source(ptr, rows, cols, stride_r, TRANSPOSED: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):  # fmt: skip
    """A TMA descriptor of the (rows, cols) operand at `ptr`, over its contiguous axis:
    the columns (row stride `stride_r`), or with TRANSPOSED the rows (column stride
    `stride_r`: a weight read as ``w.T``)."""
    if TRANSPOSED:
        return tl.make_tensor_descriptor(ptr, shape=[cols, rows], strides=[stride_r, 1],
                                         block_shape=[BLOCK_C, BLOCK_R])  # fmt: skip
    else:
        return tl.make_tensor_descriptor(ptr, shape=[rows, cols], strides=[stride_r, 1],
                                         block_shape=[BLOCK_R, BLOCK_C])  # fmt: skip


@triton.jit
def _load_operand(desc, start_r, start_c, TRANSPOSED: tl.constexpr):
    """The tile at (start_r, start_c) of an `_operand_source` (zeros past the edges)."""
    if TRANSPOSED:
        return desc.load([start_c, start_r]).T
    else:
        return desc.load([start_r, start_c])


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
def _epilogue(acc, c_ptr, c_desc, bias_ptr, cos_ptr, sin_ptr, start_m, start_n, M, N,
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
    if C_TMA:
        left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        _store_half(c_desc, c_ptr, left, start_m, start_n, ACCUMULATE)
        _store_half(c_desc, c_ptr, right, start_m, start_n + BLOCK_N // 2, ACCUMULATE)
    else:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        c_ptrs = (c_ptr + offs_m[:, None].to(tl.int64) * stride_cm
                  + offs_n[None, :].to(tl.int64) * stride_cn)  # fmt: skip
        c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if ACCUMULATE:
            acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _matmul_kernel(
    # pointers
    a_ptr, b_ptr, c_ptr, bias_ptr, cos_ptr, sin_ptr,
    # strides
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    stride_cos, stride_sin,
    # sizes
    M, N, K, rope_rows_per_position, rope_first_row,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    ROPE_HALF: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    C_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """Two schedules. With TMA (aligned 16-bit operands), persistent: each program
    computes tiles ``pid, pid + programs, ...`` in grouped order (the grid is at most
    the SM count on a GPU), A and B read through descriptors over their contiguous axes
    (A_T: A is M-contiguous, B_T: B is K-contiguous, a weight read as ``w.T``), tiles
    and their K loops flattened into one pipelined loop (the Triton tutorial 09's
    schedule). Otherwise one tile per program through pointers advanced each K step.
    C_TMA: C is written (and read back when adding) through a descriptor. ROPE_HALF > 0:
    C's heads of 2 * ROPE_HALF columns are rotated in the epilogue."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if C_TMA:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                           block_shape=[BLOCK_M, BLOCK_N // 2])  # fmt: skip
    else:
        c_desc = None
    if TMA:
        a_desc = _operand_source(a_ptr, M, K, stride_ak if A_T else stride_am, A_T, BLOCK_M,
                                 BLOCK_K)  # fmt: skip
        b_desc = _operand_source(b_ptr, K, N, stride_bn if B_T else stride_bk, B_T, BLOCK_K,
                                 BLOCK_N)  # fmt: skip
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0),
                             flatten=True):  # fmt: skip
            pid_m, pid_n = tile_of(tile, num_pid_m, num_pid_n, GROUP_M)
            start_m, start_n = pid_m * BLOCK_M, pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(tl.cdiv(K, BLOCK_K)):
                a = _load_operand(a_desc, start_m, ki * BLOCK_K, A_T)
                b = _load_operand(b_desc, ki * BLOCK_K, start_n, B_T)
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            _epilogue(acc, c_ptr, c_desc, bias_ptr, cos_ptr, sin_ptr, start_m, start_n, M, N,
                      stride_cm, stride_cn, stride_bias, stride_cos, stride_sin, rope_first_row,
                      rope_rows_per_position, HAS_BIAS, ACCUMULATE, C_TMA, ROPE_HALF, BLOCK_M,
                      BLOCK_N)  # fmt: skip
    else:
        pid_m, pid_n = tile_of(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        # Rows and columns past the edge wrap onto valid ones, so the loads need no M/N
        # mask; only the store is masked. Row and column offsets are 64-bit: M *
        # stride_am or N * stride_bn can pass 2**31 (an LM head's weight read
        # transposed, say).
        rows_a = (offs_m % M).to(tl.int64)
        cols_b = (offs_n % N).to(tl.int64)
        a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols_b[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_left = K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        _epilogue(acc, c_ptr, c_desc, bias_ptr, cos_ptr, sin_ptr, pid_m * BLOCK_M,
                  pid_n * BLOCK_N, M, N, stride_cm, stride_cn, stride_bias, stride_cos,
                  stride_sin, rope_first_row, rope_rows_per_position, HAS_BIAS, ACCUMULATE,
                  C_TMA, ROPE_HALF, BLOCK_M, BLOCK_N)  # fmt: skip


def _candidates(M: int, N: int, interpreted: bool, dtype, accumulate,
                head_dim: int = 0) -> list[triton.Config]:  # fmt: skip
    """The tiles to try; with `head_dim` (a rotating epilogue), those holding whole heads."""
    if interpreted:
        block_m, block_n = _interpreter_block(M), max(_interpreter_block(N), head_dim)
        return [triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": BLOCK_K})]
    return _prune_configs(matmul_configs(dtype, accumulate, head_dim), M, N)


def _interpreter_block(size: int) -> int:
    return min(INTERPRETER_MAX_BLOCK, max(16, next_power_of_2(size)))


def _check_operands(a, b, bias, out, accumulate, out_dtype):
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"matmul takes 2-D A (M, K) and B (K, N), got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    (M, K), (K_b, N) = a.shape, b.shape
    if K_b != K:
        raise ValueError(
            f"inner sizes differ: A is (M, K) = {tuple(a.shape)}, B is (K, N) = {tuple(b.shape)}"
        )
    check_float_dtype("A", a)
    if b.dtype != a.dtype:
        raise TypeError(f"A and B must share a dtype, got {a.dtype} and {b.dtype}")
    out_dtypes = (a.dtype, torch.float32)
    if bias is not None:
        if bias.shape != (N,):
            raise ValueError(f"bias must be (N,) = ({N},), got {tuple(bias.shape)}")
        check_float_dtype("bias", bias, out_dtypes)
    if accumulate and out is None:
        raise ValueError("accumulate=True adds into `out`, so `out` must be given")
    if out is not None:
        if out.shape != (M, N):
            raise ValueError(f"out must be (M, N) = ({M}, {N}), got {tuple(out.shape)}")
        check_float_dtype("out", out, out_dtypes)
        if out_dtype is not None and out_dtype != out.dtype:
            raise TypeError(f"out_dtype={out_dtype} contradicts out.dtype={out.dtype}")
    elif out_dtype is not None and out_dtype not in out_dtypes:
        raise TypeError(f"out_dtype must be A's dtype ({a.dtype}) or float32, got {out_dtype}")


def _check_rope(a, b, rope: RowRotation, accumulate) -> None:
    cos, sin, per_position = rope.cos, rope.sin, rope.rows_per_position
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(f"rope: cos and sin must be (positions, hd/2), got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")  # fmt: skip
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"rope: cos and sin must be float32, got {cos.dtype} and {sin.dtype}")
    if cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(f"rope: the tables' rows must be contiguous, got strides "
                         f"{cos.stride()} and {sin.stride()}")  # fmt: skip
    head_dim, N = 2 * cos.shape[1], b.shape[1]
    if not rope_epilogue_fits(a.dtype, head_dim) or N % head_dim:
        raise ValueError(f"rope: heads of {head_dim} (2 * cos.shape[1]) must be a power of 2 "
                         f"the {a.dtype} tiles hold whole, dividing N = {N}")  # fmt: skip
    if accumulate:
        raise ValueError("rope: a rotated C is written, not added into (accumulate=True)")
    if not isinstance(per_position, int) or per_position < 1:
        raise ValueError(f"rope: rows_per_position must be a positive int, got {per_position!r}")
    if not a.device == cos.device == sin.device:
        raise ValueError(f"rope: A and the tables on {a.device}, {cos.device}, {sin.device}")


def _check_rope_rows(M: int, rope: RowRotation) -> None:
    """Every row's position inside the tables (a call's rows may start anywhere)."""
    if rope.first_row < 0 or (M and (rope.first_row + M - 1) // rope.rows_per_position
                              >= rope.cos.shape[0]):  # fmt: skip
        raise ValueError(f"rope: rows {rope.first_row}..{rope.first_row + M - 1} at "
                         f"{rope.rows_per_position} a position pass the tables' "
                         f"{rope.cos.shape[0]} positions")  # fmt: skip


@dataclass
class _Plan:
    """What `matmul` works out once per call signature (shapes, strides, dtypes, flags,
    alignment): the operands checked, the tuner's key and the launch's meta. A later
    call with the same signature only looks it up, and once the tuner's pick is settled
    launches with the grid and keywords kept for it (host time a call, launch stubbed:
    24 -> 10 -> 8 µs)."""

    M: int
    N: int
    K: int
    c_dtype: torch.dtype
    key: tuple
    scalars: tuple  # the kernel's strides and sizes (all but the rotation's first row)
    meta: dict  # its constexprs
    programs: int | None  # SMs (a persistent TMA grid), None in the interpreter
    settled: tuple | None = None  # (the pick, its grid, its keywords) once launched

    def launch_arguments(self, config: triton.Config) -> tuple[tuple, dict]:
        """The grid and keyword arguments of a launch with `config`."""
        tiles = cdiv(self.M, config.kwargs["BLOCK_M"]) * cdiv(self.N, config.kwargs["BLOCK_N"])
        grid = (tiles if self.programs is None else min(tiles, self.programs),)
        return grid, {**self.meta, **config.all_kwargs()}


_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096  # a property test's many shapes: start over rather than grow


def _signature(a, b, bias, out, accumulate, out_dtype, tune_only, rope) -> tuple:
    # alignment decides TMA; the fp32 precision decides the dot's; a rotation's first row
    # is an argument of each launch
    return (
        a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device,
        bias is not None and (bias.shape, bias.stride(), bias.dtype),
        out is not None and (out.shape, out.stride(), out.dtype, out.data_ptr() % 16),
        accumulate, out_dtype, tune_only, a.data_ptr() % 16, b.data_ptr() % 16,
        torch.get_float32_matmul_precision(),
        _common.tma_compatible,  # the TMA rule in force (tests swap it for the pointer path)
        rope is not None and (rope.cos.shape, rope.cos.stride(), rope.sin.shape,
                              rope.sin.stride(), rope.cos.dtype, rope.sin.dtype,
                              rope.cos.device, rope.sin.device, rope.rows_per_position),
    )  # fmt: skip


def _plan(a, b, bias, out, accumulate, out_dtype, tune_only, rope) -> _Plan:
    """The call's plan, checked and made on the first call of its signature. Raises
    ValueError/TypeError naming the sizes for operands the kernel cannot take."""
    signature = _signature(a, b, bias, out, accumulate, out_dtype, tune_only, rope)
    plan = _PLANS.get(signature)
    if plan is not None:
        return plan
    _check_operands(a, b, bias, out, accumulate and not tune_only, out_dtype)
    if rope is not None:
        _check_rope(a, b, rope, accumulate)
    tables = () if rope is None else (rope.cos, rope.sin)
    check_launchable(_matmul_kernel, *(t for t in (a, b, bias, out, *tables) if t is not None))
    (M, K), N = a.shape, b.shape[1]
    c_dtype = out.dtype if out is not None else out_dtype or a.dtype
    out = None if tune_only else out  # tuning writes a scratch C of its own
    precision = fp32_dot_precision() if a.dtype == torch.float32 else "tf32"
    head_dim = 0 if rope is None else 2 * rope.cos.shape[1]
    key = (bucket(M), N, K, str(a.dtype), str(c_dtype), bias is not None and str(bias.dtype),
           accumulate, precision, head_dim)  # fmt: skip
    # a new C is (M, N) row-major (the descriptor takes C row-major)
    c_strides = out.stride() if out is not None else (N, 1)
    c_probe = out if out is not None else torch.empty((min(M, 1), N), dtype=c_dtype,
                                                      device=a.device)  # fmt: skip
    tma, c_tma = tma_paths((a, b), (c_probe,) if c_strides[1] == 1 else ())
    meta = dict(HAS_BIAS=bias is not None, ACCUMULATE=accumulate, INPUT_PRECISION=precision,
                EVEN_K=K % BLOCK_K == 0, TMA=tma, A_T=tma and a.stride(1) != 1,
                B_T=tma and b.stride(1) != 1, C_TMA=c_tma, GROUP_M=GROUP_M,
                ROPE_HALF=head_dim // 2)  # fmt: skip
    table_strides = (0, 0) if rope is None else (rope.cos.stride(0), rope.sin.stride(0))
    scalars = (*a.stride(), *b.stride(), *c_strides, bias.stride(0) if bias is not None else 0,
               *table_strides, M, N, K, 1 if rope is None else rope.rows_per_position)  # fmt: skip
    programs = sm_count(a.device) if a.device.type == "cuda" and tma else None
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    plan = _PLANS[signature] = _Plan(M, N, K, c_dtype, key, scalars, meta, programs)
    return plan


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype | None = None,
    rope: RowRotation | None = None,
    agreement: Agreement | None = None,
    tune_only: bool = False,
) -> torch.Tensor | None:
    """``C = A @ B (+ bias)``, or ``C += A @ B (+ bias)`` with ``accumulate=True``; with
    `rope`, C's heads rotated at their rows' positions before C is rounded
    (`RowRotation`; not with ``accumulate``).

    a (M, K), b (K, N), bias (N,), out (M, N): any strides, no copies. ``out`` defaults to
    a new tensor of ``out_dtype`` (A's dtype unless given: A's or float32). Returns C.

    The tile is tuned per (M bucket, N, K, dtypes, flags); `agreement` makes the ranks
    of a group pick the same one, and ``tune_only`` only makes the pick (on scratch
    buffers, nothing written, returns None): the TP rings do so before their loops.
    """
    if _impl.runs_torch(a.device):
        _check_operands(a, b, bias, out, accumulate and not tune_only, out_dtype)
        if rope is not None:
            _check_rope(a, b, rope, accumulate)
            _check_rope_rows(a.shape[0], rope)
        if tune_only:
            return None
        c_dtype = out.dtype if out is not None else out_dtype or a.dtype
        out = (
            torch.empty((a.shape[0], b.shape[1]), dtype=c_dtype, device=a.device)
            if out is None
            else out
        )
        matmul_torch(a, b, bias, out, accumulate, rope)
        return out
    plan = _plan(a, b, bias, out, accumulate, out_dtype, tune_only, rope)
    M, N, key, meta = plan.M, plan.N, plan.key, plan.meta
    first_row = 0
    if rope is not None:
        _check_rope_rows(M, rope)
        first_row = rope.first_row
    tuner = _tuning.tuner("matmul")
    settled = plan.settled
    if (
        settled is not None
        and agreement is None
        and not tune_only
        and tuner.settled(key) is settled[0]
    ):
        out = torch.empty((M, N), dtype=plan.c_dtype, device=a.device) if out is None else out
        _launch_settled(plan, _arguments(plan, a, b, bias, out, rope, first_row), *settled[1:])
        return out
    if tune_only:
        if M == 0 or N == 0 or tuner.has(key, agreement):
            return None
        out = torch.zeros((M, N), dtype=plan.c_dtype, device=a.device)  # scratch
    elif out is None:
        out = torch.empty((M, N), dtype=plan.c_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if meta["TMA"] or meta["C_TMA"]:
        ensure_tma_allocator(a.device)  # per thread: autograd's backward runs on its own
    args = _arguments(plan, a, b, bias, out, rope, first_row)

    def launch(config):
        if isinstance(config, _impl.Torch):
            matmul_torch(a, b, bias, out, accumulate, rope)
            return
        grid, kwargs = plan.launch_arguments(config)
        _matmul_kernel[grid](*args, **kwargs)

    def candidates():
        cublas = cublas_computes(a, bias, plan.c_dtype, accumulate, rope)
        tiles = _candidates(bucket(M), N, is_interpreted(_matmul_kernel), a.dtype, accumulate,
                            meta["ROPE_HALF"] * 2)  # fmt: skip
        return tiles + ([_impl.TORCH] if cublas and _impl.tunes_torch() else [])

    with device_guard(a):
        config = tuner.run(key, candidates, launch, device=a.device,
                           restore=[out] if accumulate else [], agreement=agreement,
                           tune_only=tune_only)  # fmt: skip
    if not tune_only and agreement is None and not isinstance(config, _impl.Torch):
        plan.settled = (config, *plan.launch_arguments(config))
    return None if tune_only else out


def _arguments(plan: _Plan, a, b, bias, out, rope, first_row) -> tuple:
    """The kernel's positional arguments (a pointer not used: C's, never read)."""
    cos, sin = (out, out) if rope is None else (rope.cos, rope.sin)
    return (a, b, out, bias if bias is not None else out, cos, sin, *plan.scalars, first_row)


def _launch_settled(plan: _Plan, args, grid, kwargs) -> None:
    """A planned call's launch once its pick is settled: no tuner, nothing rebuilt."""
    if args[0].device.type != "cuda":  # the interpreter
        _matmul_kernel[grid](*args, **kwargs)
        return
    if plan.meta["TMA"] or plan.meta["C_TMA"]:
        ensure_tma_allocator(args[0].device)  # per thread: autograd's backward runs on its own
    with device_guard(args[0]):
        _matmul_kernel[grid](*args, **kwargs)
