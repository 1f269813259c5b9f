"""Tiled GEMM with strided operands: ``C = A @ B (+ bias)`` or ``C += A @ B (+ bias)``,
optionally with C's heads rotated (RoPE) or a gated activation in the epilogue.

| tensor | shape  | dtype                          | strides   |
| ------ | ------ | ------------------------------ | --------- |
| A      | (M, K) | fp16, bf16 or fp32             | any       |
| B      | (K, N) | A's                            | any       |
| bias   | (N,)   | A's or fp32                    | any       |
| C      | (M, N) | A's or fp32                    | any       |

Any strides: a transposed weight (``weight.T``) is read in place, and C can be a slice
of a larger buffer (a chunk's rows of an all-gathered output). Products accumulate in
fp32 and are rounded once; ``accumulate=True`` adds the old C in fp32 before that
rounding (reduce-scatter partials, weight gradients in an fp32 buffer).
``rope=RowRotation(cos, sin, ...)`` turns C's heads before the rounding
(`rope_epilogue_fits`); ``gated=`` ends a dense gated MLP's GEMMs in the activation
(`GatedProduct`) or its gradient (`GatedGrad`), launched by `fusedpar.kernels.matmul_gated`.
Beside it: the epilogues `matmul_epilogue`, the checks and per-call plan `matmul_plan`,
the torch implementation and the reference `matmul_torch`. Schedules, tiles and machine
code: docs/matmul.md.
"""

import functools

import torch
import triton
import triton.language as tl
from fusedpar.kernels import impl, tuning
from fusedpar.kernels.common import (
    check_launchable,
    device_guard,
    ensure_tma_allocator,
    fp32_dot_precision,
    is_interpreted,
    next_power_of_2,
    sm_count,
    tma_paths,
)
from fusedpar.kernels.matmul_epilogue import epilogue, gated_epilogue, output_target
from fusedpar.kernels.matmul_plan import (
    MAX_PLANS,
    PLANS,
    GatedGrad,
    GatedProduct,
    Plan,
    RowRotation,
    check_gated,
    check_gated_epilogue,
    check_operands,
    check_rope,
    check_rope_rows,
    gated_tensors,
    signature,
)
from fusedpar.kernels.matmul_torch import cublas_computes, matmul_torch
from fusedpar.kernels.tuning import LAUNCH, Launch, bucket

# Row blocks that share one column of B tiles in L2 (the Triton tutorial's grouped order).
GROUP_M = 8
# The interpreter runs one program at a time in numpy: fewer, larger tiles are faster, and
# 64 keeps the per-program arrays small on 2 cores.
INTERPRETER_MAX_BLOCK = 64
# The K step of every tile, GPU and interpreter alike (see `matmul_configs`).
BLOCK_K = 64


# BLOCK_M, BLOCK_N, num_stages, num_warps. Every tile passes the resource gate (its report:
# docs/generated/resources.md; tests/test_compile_gate.py): it fits an H100's shared memory
# and, in fp16/bf16, does not spill. Adding into an fp32 C loads a (BLOCK_M, BLOCK_N) fp32
# tile in the epilogue: 128x256 and 256x128 with 8 warps then spill 96-192 B, and
# 128x128 with 4 warps 96 B, so those are left out of the accumulating list.
_TILES_16BIT = [
    (128, 256, 3, 8), (256, 128, 3, 8), (128, 128, 4, 8), (128, 128, 3, 4), (128, 64, 4, 4),
    (64, 128, 4, 4), (64, 64, 4, 4), (128, 32, 4, 4), (64, 32, 5, 2), (32, 64, 5, 2),
    (32, 32, 4, 2),
]  # fmt: skip
_SPILL_WHEN_ACCUMULATING = {(128, 256, 3, 8), (256, 128, 3, 8), (128, 128, 3, 4)}
# Rotating heads in the epilogue (`_rotate_heads`) holds the tables' rows beside the
# accumulator: 256x128 with 8 warps and 128x128 with 4 warps then spill 136-472 B (hd
# 64-256), so a rotating GEMM leaves them out. 128x256 holds heads of 64 (216-252
# registers, no spill, triton 3.6 and 3.9, C through TMA or pointers); heads of 128 spill
# 160 B (3.9) or 104 B (3.6, 3 local accesses an iteration).
_SPILL_WHEN_ROTATING = {(256, 128, 3, 8), (128, 128, 3, 4)}
_WIDEST_HEAD_ROTATED = {(128, 256, 3, 8): 64}

# A gated GEMM (`gated_matmul`, read through pointers: see `_plan`) holds two
# accumulators, each a tile of the width: the same three tiles spill 528-1048 B;
# 128x128 with 8 warps stays at 255 registers with its epilogue taken column half by
# column half (whole, 64 B spilled).
_SPILL_WHEN_GATED = _SPILL_WHEN_ACCUMULATING
# A gated gradient ("backward") loads the saved gate and up beside dh: the same three
# tiles spill 192-600 B (silu, gelu_tanh; TMA or pointers); 128x128 with 8 warps holds
# it in 173-212 registers. The product ("product") loads the gate beside up: every tile
# holds it fed from TMA (128x256: 240-254 registers), while through pointers the same
# three spill 16 B.
_SPILL_WHEN_GATED_GRAD = _SPILL_WHEN_ACCUMULATING
_SPILL_WHEN_PRODUCT = {True: set(), False: _SPILL_WHEN_ACCUMULATING}  # by TMA
# fp32 runs as FMA loops at full precision (PyTorch's default) and through TF32 wgmma
# otherwise; these tiles serve both. 128x256 and 128x128x4 in fp32 need 256-288 KB of
# shared memory (over an H100's 227 KB), and 128x128 with 4 warps as FMA spills over
# 1 KB and takes 13 s to build (review F1).
_TILES_FP32 = [(128, 64, 3, 8), (64, 64, 3, 8), (64, 64, 4, 4), (32, 32, 3, 4)]


def matmul_configs(dtype: torch.dtype, accumulate: bool, head_dim: int = 0,
                   gated: str = "", tma: bool = True) -> list[triton.Config]:  # fmt: skip
    """Tiles the tuner tries on a GPU for A's dtype, whether C is added into, the heads a
    rotating epilogue turns (`head_dim`: the tiles whose columns hold whole heads, 0: no
    rotation), and a gated epilogue (`gated`: "forward", a gated GEMM's two
    accumulators; "product", the up GEMM writing the product, whose tiles depend on the
    schedule, `tma`; "backward", a gated gradient's), pruned for small problems by
    `_prune_configs`.

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
        tiles = [t for t in tiles if t[1] % head_dim == 0 and t not in _SPILL_WHEN_ROTATING
                 and head_dim <= _WIDEST_HEAD_ROTATED.get(t, head_dim)]  # fmt: skip
    if gated:
        spill = {"forward": _SPILL_WHEN_GATED, "product": _SPILL_WHEN_PRODUCT[tma],
                 "backward": _SPILL_WHEN_GATED_GRAD}[gated]  # fmt: skip
        tiles = [t for t in tiles if t not in spill]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": BLOCK_K}, num_stages=s, num_warps=w)
        for bm, bn, s, w in tiles
    ]


@functools.cache  # asked by every QKV projection's forward: the tiles are built once
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
def _matmul_kernel(
    # pointers (b2, bias2: a gated GEMM's up weight and bias; c2, h: its up and product,
    # or a gated gradient's dup and product; g, u: the stored gate and up it reads)
    a_ptr, b_ptr, c_ptr, bias_ptr, cos_ptr, sin_ptr, b2_ptr, bias2_ptr, c2_ptr, h_ptr, g_ptr,
    u_ptr,
    # strides
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    stride_cos, stride_sin, stride_gm, stride_gn,
    # sizes
    M, N, K, rope_rows_per_position, rope_first_row,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    ROPE_HALF: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_H: tl.constexpr,
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
    C's heads of 2 * ROPE_HALF columns are rotated in the epilogue. GATED (with its
    ACTIVATION): `gated_epilogue`'s mode. "forward" (a gated GEMM, pointer schedule
    only) multiplies a second B (b2, the up weight, B's strides) against the same A tiles
    into a second accumulator; "product" and "backward" have one."""
    FORWARD: tl.constexpr = GATED == "forward"
    TWO_OUT: tl.constexpr = FORWARD or GATED == "backward"  # c2 written: up, or dup
    tl.static_assert(not (TMA and FORWARD), "a gated GEMM reads through pointers (see _plan)")
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if C_TMA:
        c_desc = output_target(c_ptr, M, N, stride_cm, BLOCK_M, BLOCK_N)
        c2_desc = output_target(c2_ptr, M, N, stride_cm, BLOCK_M, BLOCK_N) if TWO_OUT else None
        h_desc = output_target(h_ptr, M, N, stride_cm, BLOCK_M, BLOCK_N) if STORE_H else None
    else:
        c_desc = None
        c2_desc = None
        h_desc = None
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
            if GATED != "":
                gated_epilogue(acc, acc, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, g_ptr,
                               u_ptr, bias_ptr, bias_ptr, start_m, start_n, M, N, stride_cm,
                               stride_cn, stride_gm, stride_gn, stride_bias, GATED, ACTIVATION,
                               HAS_BIAS, STORE_H, C_TMA, BLOCK_M, BLOCK_N)  # fmt: skip
            else:
                epilogue(acc, c_ptr, c_desc, bias_ptr, cos_ptr, sin_ptr, start_m, start_n, M,
                         N, stride_cm, stride_cn, stride_bias, stride_cos, stride_sin,
                         rope_first_row, rope_rows_per_position, HAS_BIAS, ACCUMULATE, C_TMA,
                         ROPE_HALF, BLOCK_M, BLOCK_N)  # fmt: skip
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
        b_offsets = offs_k[:, None] * stride_bk + cols_b[None, :] * stride_bn
        b_ptrs = b_ptr + b_offsets
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = acc  # (a second accumulator for "forward" only)
        if FORWARD:
            b2_ptrs = b2_ptr + b_offsets
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_mask = offs_k < K - k * BLOCK_K  # (EVEN_K: all true, not applied)
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            if FORWARD:
                if EVEN_K:
                    b2 = tl.load(b2_ptrs)
                else:
                    b2 = tl.load(b2_ptrs, mask=k_mask[:, None], other=0.0)
                acc2 = tl.dot(a, b2, acc2, input_precision=INPUT_PRECISION)
                b2_ptrs += BLOCK_K * stride_bk
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        start_m, start_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        if GATED != "":
            gated_epilogue(acc, acc2, c_ptr, c_desc, c2_ptr, c2_desc, h_ptr, h_desc, g_ptr, u_ptr,
                           bias_ptr, bias2_ptr, start_m, start_n, M, N, stride_cm, stride_cn,
                           stride_gm, stride_gn, stride_bias, GATED, ACTIVATION, HAS_BIAS,
                           STORE_H, C_TMA, BLOCK_M, BLOCK_N)  # fmt: skip
        else:
            epilogue(acc, c_ptr, c_desc, bias_ptr, cos_ptr, sin_ptr, start_m, start_n, M, N,
                     stride_cm, stride_cn, stride_bias, stride_cos, stride_sin, rope_first_row,
                     rope_rows_per_position, HAS_BIAS, ACCUMULATE, C_TMA, ROPE_HALF, BLOCK_M,
                     BLOCK_N)  # fmt: skip


def _candidates(M: int, N: int, interpreted: bool, dtype, accumulate, head_dim: int = 0,
                gated: str = "", tma: bool = True) -> list[triton.Config]:  # fmt: skip
    """The tiles to try; with `head_dim` (a rotating epilogue), those holding whole heads;
    `gated`: those with room for its epilogue (`matmul_configs`)."""
    if interpreted:
        block_m, block_n = _interpreter_block(M), max(_interpreter_block(N), head_dim)
        return [triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": BLOCK_K})]
    return _prune_configs(matmul_configs(dtype, accumulate, head_dim, gated, tma), M, N)


def _interpreter_block(size: int) -> int:
    return min(INTERPRETER_MAX_BLOCK, max(16, next_power_of_2(size)))


def _plan(a, b, bias, out, accumulate, out_dtype, tune_only, rope, second=None,
          gated: GatedProduct | GatedGrad | None = None) -> Plan:  # fmt: skip
    """The call's plan, checked and made on the first call of its signature. Raises
    ValueError/TypeError naming the sizes for operands the kernel cannot take. `second`:
    (b2, bias2, activation) of `gated_matmul`; `gated`: a gated epilogue's tensors."""
    key_of_call = signature(a, b, bias, out, accumulate, out_dtype, tune_only, rope, second,
                            gated)  # fmt: skip
    plan = PLANS.get(key_of_call)
    if plan is not None:
        return plan
    check_operands(a, b, bias, out, accumulate and not tune_only, out_dtype)
    if rope is not None:
        check_rope(a, b, rope, accumulate, rope_epilogue_fits)
    if second is not None:
        check_gated(b, bias, *second)
    if gated is not None:
        check_gated_epilogue(a, b, out, bias, accumulate, gated)
    tables = () if rope is None else (rope.cos, rope.sin)
    up = () if second is None else second[:2]
    gated_parts = () if gated is None else gated_tensors(gated)
    check_launchable(_matmul_kernel, *(t for t in (a, b, bias, out, *tables, *up, *gated_parts)
                                       if t is not None))  # fmt: skip
    (M, K), N = a.shape, b.shape[1]
    c_dtype = out.dtype if out is not None else out_dtype or a.dtype
    # tuning writes a scratch C of its own; a gated epilogue's, the C its outputs stride as
    out = None if tune_only and gated is None else out
    precision = fp32_dot_precision() if a.dtype == torch.float32 else "tf32"
    head_dim = 0 if rope is None else 2 * rope.cos.shape[1]
    mode, activation, store_h = "", "", second is not None
    if second is not None:
        mode, activation = "forward", second[2]
    elif gated is not None:
        mode = "backward" if isinstance(gated, GatedGrad) else "product"
        activation, store_h = gated.activation, gated_parts[3] is not None
    key = (bucket(M), N, K, str(a.dtype), str(c_dtype), bias is not None and str(bias.dtype),
           accumulate, precision, head_dim, mode, activation, store_h)  # fmt: skip
    # a new C is (M, N) row-major (the descriptor takes C row-major)
    c_strides = out.stride() if out is not None else (N, 1)
    c_probe = out if out is not None else torch.empty((min(M, 1), N), dtype=c_dtype,
                                                      device=a.device)  # fmt: skip
    # a gated epilogue's outputs go through descriptors too (theirs are C's strides)
    outputs = (c_probe, *(t for t in gated_parts[2:] if t is not None))
    tma, c_tma = tma_paths((a, b, *up[:1]), outputs if c_strides[1] == 1 else ())
    # Two accumulators fed from TMA: ptxas serialized the wgmma (C7515, a wait after each
    # of the 8 HGMMA an iteration, every gated tile); fed through pointers, it does not.
    tma = tma and second is None
    meta = dict(HAS_BIAS=bias is not None, ACCUMULATE=accumulate, INPUT_PRECISION=precision,
                EVEN_K=K % BLOCK_K == 0, TMA=tma, A_T=tma and a.stride(1) != 1,
                B_T=tma and b.stride(1) != 1, C_TMA=c_tma, GROUP_M=GROUP_M,
                ROPE_HALF=head_dim // 2, GATED=mode, ACTIVATION=activation,
                STORE_H=store_h)  # fmt: skip
    table_strides = (0, 0) if rope is None else (rope.cos.stride(0), rope.sin.stride(0))
    saved_strides = (0, 0) if gated is None else gated.gate.stride()
    scalars = (*a.stride(), *b.stride(), *c_strides, bias.stride(0) if bias is not None else 0,
               *table_strides, *saved_strides, M, N, K,
               1 if rope is None else rope.rows_per_position)  # fmt: skip
    programs = sm_count(a.device) if a.device.type == "cuda" and tma else None
    if len(PLANS) >= MAX_PLANS:
        PLANS.clear()
    plan = PLANS[key_of_call] = Plan(M, N, K, c_dtype, a.device, key, scalars, meta, programs)
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
    gated: GatedProduct | GatedGrad | None = None,
    launch_as: Launch = LAUNCH,
) -> torch.Tensor | None:
    """``C = A @ B (+ bias)``, or ``C += A @ B (+ bias)`` with ``accumulate=True``; with
    `rope`, C's heads rotated at their rows' positions before C is rounded
    (`RowRotation`; not with ``accumulate``); with `gated`, C is a gated MLP's up and the
    product is written beside it (`GatedProduct`), or A @ B is its dh and C its dgate
    (`GatedGrad`; `fusedpar.kernels.matmul_gated` allocates their outputs).

    a (M, K), b (K, N), bias (N,), out (M, N): any strides, no copies. ``out`` defaults to
    a new tensor of ``out_dtype`` (A's dtype unless given: A's or float32). Returns C.

    The tile is tuned per (M bucket, N, K, dtypes, flags); `launch_as` (`Launch`): its
    ``agreement`` makes the ranks of a group pick the same one, and ``tune_only`` only
    makes the pick (on scratch buffers, nothing written, returns None; a gated epilogue
    writes its given outputs, which the call that follows writes again): the TP rings do
    so before their loops.
    """
    tune_only = launch_as.tune_only
    request = impl.requested()
    # (an explicit "triton" request of a kernel dtype runs the kernels: no call to decide it)
    if (request != "triton" or a.dtype == torch.float64) and impl.runs_torch(a, request):
        check_operands(a, b, bias, out, accumulate and not tune_only, out_dtype)
        if rope is not None:
            check_rope(a, b, rope, accumulate, rope_epilogue_fits)
            check_rope_rows(a.shape[0], rope)
        if gated is not None:
            check_gated_epilogue(a, b, out, bias, accumulate, gated)
        if tune_only:
            return None
        c_dtype = out.dtype if out is not None else out_dtype or a.dtype
        out = (
            torch.empty((a.shape[0], b.shape[1]), dtype=c_dtype, device=a.device)
            if out is None
            else out
        )
        matmul_torch(a, b, bias, out, accumulate, rope, gated)
        return out
    plan = _plan(a, b, bias, out, accumulate, out_dtype, tune_only, rope, None, gated)
    if launch_as.plain:
        done = launch_planned(plan, request, a, b, bias, out, rope, gated)
        if done is not None:
            return done
    M, N, key, meta = plan.M, plan.N, plan.key, plan.meta
    first_row = 0
    if rope is not None:
        check_rope_rows(M, rope)
        first_row = rope.first_row
    tuner = tuning.tuner("matmul")
    if tune_only:
        if M == 0 or N == 0 or tuner.has(key, launch_as.agreement):
            return None
        if gated is None:
            out = torch.zeros((M, N), dtype=plan.c_dtype, device=a.device)  # scratch
    elif out is None:
        out = torch.empty((M, N), dtype=plan.c_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if meta["TMA"] or meta["C_TMA"]:
        ensure_tma_allocator(a.device)  # per thread: autograd's backward runs on its own
    args = _arguments(plan, a, b, bias, out, rope, first_row, gated=gated)

    def launch(config):
        if isinstance(config, impl.Torch):
            matmul_torch(a, b, bias, out, accumulate, rope, gated)
            return
        grid, kwargs = plan.launch_arguments(config)
        _matmul_kernel[grid](*args, **kwargs)

    def candidates():
        cublas = cublas_computes(a, bias, plan.c_dtype, accumulate, rope)
        tiles = _candidates(bucket(M), N, is_interpreted(_matmul_kernel), a.dtype, accumulate,
                            meta["ROPE_HALF"] * 2, meta["GATED"], meta["TMA"])  # fmt: skip
        return tiles + ([impl.TORCH] if cublas and impl.tunes_torch() else [])

    with device_guard(a):
        config = tuner.run(key, candidates, launch, device=a.device,
                           restore=[out] if accumulate else [],
                           launch_as=launch_as)  # fmt: skip
    if launch_as.plain and not isinstance(config, impl.Torch):
        grid, kwargs = plan.launch_arguments(config)
        scope = tuning.local_scope(key, request)
        plan.settled[request] = tuning.Settled.of(_matmul_kernel, config, scope, grid, kwargs,
                                                   len(args))  # fmt: skip
    return None if tune_only else out


def launch_planned(plan: Plan, request: str, a, b, bias=None, out=None, rope=None,
                   gated=None) -> torch.Tensor | None:  # fmt: skip
    """`matmul`'s call with these operands (no agreement, not ``tune_only``), whose
    `plan` it is, launched once the pick for the implementation `request` is settled
    (`tuning.Settled`: no tuner, nothing rebuilt): C (`out`, or a new one). None where
    no pick is settled (the first call, a forced config, a frozen loop): `matmul` then
    runs the call."""
    settled = plan.settled.get(request)
    if settled is None or tuning.kept("matmul", settled.scope) is not settled.config:
        return None
    first_row = 0
    if rope is not None:
        check_rope_rows(plan.M, rope)
        first_row = rope.first_row
    if out is None:
        out = torch.empty(plan.shape, dtype=plan.c_dtype, device=plan.device)
    if a.is_cuda and (plan.meta["TMA"] or plan.meta["C_TMA"]):
        ensure_tma_allocator(a.device)  # per thread: autograd's backward runs on its own
    settled.launch(_matmul_kernel, _arguments(plan, a, b, bias, out, rope, first_row, gated=gated))
    return out


def _arguments(plan: Plan, a, b, bias, out, rope, first_row, second=(),
               gated: GatedProduct | GatedGrad | None = None) -> tuple:  # fmt: skip
    """The kernel's positional arguments (a pointer not used: C's, never read). `second`:
    b2, bias2, c2, h of `gated_matmul`; `gated`: a gated epilogue's tensors."""
    if gated is None and not second:  # (most calls: fewer steps)
        cos, sin = (out, out) if rope is None else (rope.cos, rope.sin)
        return (a, b, out, out if bias is None else bias, cos, sin, out, out, out, out, out, out,
                *plan.scalars, first_row)  # fmt: skip
    cos, sin = (out, out) if rope is None else (rope.cos, rope.sin)
    b2, bias2, c2, h = second or (out,) * 4
    g = u = out
    if gated is not None:
        g, u, c2, h = gated_tensors(gated)
    return (a, b, out, bias if bias is not None else out, cos, sin, b2,
            out if bias2 is None else bias2, out if c2 is None else c2, out if h is None else h,
            g, out if u is None else u, *plan.scalars, first_row)  # fmt: skip
