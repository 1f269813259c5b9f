"""Flash attention backward: ``delta``, then dK/dV and dQ, recomputing P from the LSE.

Shapes and conventions are those of `fusedpar.kernels.attention.forward`. With
``S = scale * Q K^T`` (masked) and ``P = exp(S - LSE)``:

| kernel  | grid                      | computes                                          |
| ------- | ------------------------- | ------------------------------------------------- |
| delta   | (Sq blocks, B, Hq)        | ``delta = rowsum(dO * O)`` in fp32                |
| dkdv    | (Skv blocks, B, Hkv * split) | ``dV = P^T dO``, ``dK = scale * dS^T Q``       |
| dq      | (Sq blocks, B, Hq)        | ``dQ = scale * dS K``                             |

with ``dS = P * (dO V^T - delta)``. A dkdv program sums over the query heads of its
GQA group itself, so each gradient is a sum in a fixed order: no atomics, and results
are deterministic. When the (Skv blocks, B, Hkv) grid is too small to fill the GPU (few
KV heads, short KV), the group is split over ``split`` programs per KV head (see
`gqa_split`): each writes an fp32 partial over its slice of the group, and the partials
are summed afterwards in a fixed order (still deterministic; the review cites
FlashAttention's ``mha_bwd``, which sums per-query-head dK/dV over the group likewise).
"""

import functools

import torch
import triton
import triton.language as tl
from fusedpar.kernels import impl
from fusedpar.kernels.attention import torch_impl
from fusedpar.kernels.attention.forward import (
    load_rows,
    scores,
    store_tile,
    tile_configs,
    tile_source,
)
from fusedpar.kernels.attention.mask import (
    NO_MASK,
    AttentionMask,
    block_ranges,
    load_intervals,
    scalar_intervals,
)
from fusedpar.kernels.attention.plan import (
    NEW_GRADIENTS,
    NO_SOURCES,
    Gradients,
    gradient_buffer,
    launch,
    plan_backward,
    torch_alternatives,
    torch_backward,
    write_delta,
)
from fusedpar.kernels.common import (
    cdiv,
    ensure_tma_allocator,
    sm_count,
)
from fusedpar.kernels.tuning import LAUNCH, Launch

# Split a GQA group over programs when the dK/dV grid has fewer programs than this (two
# waves of the GPU's SMs keep every SM busy through the tail). None: 2 x the SM count
# on a GPU, never in the interpreter (it runs programs one at a time); tests set it.
SPLIT_BELOW_PROGRAMS: int | None = None


# Checked by the resource gate as the forward's tiles are (attention/forward.py). BLOCK_M
# is the query block and BLOCK_N the key block in both kernels; each program keeps its
# own rows' tiles and accumulators in registers, and Hopper's wgmma needs 64 of them per
# warpgroup, so the two kernels tune over different lists.
#
# dK/dV: a program holds K, V, dK and dV of BLOCK_N keys and steps through the queries
# BLOCK_M at a time (the Triton tutorial's layout). 128 keys with 8 warps give each
# warpgroup 64 keys, so every wgmma is 64 x BLOCK_M or 64 x D: at D=128, 128x32 runs
# 64x32 and 64x128 HGMMA in 237 registers (64-query steps spill 64 B; on the pointer
# path 3 stages spill 8 B and 32x64 with 4 warps 96 B; at D=64, 32x32 spills 8 B with
# soft-capping); the earlier 16-query tiles ran 32 of their 34 HGMMA at 64x8, about 4.8x
# the instructions per key-query pair. At D=256 no wgmma tile fits the registers (32x64
# with 8 warps spills 336 B, with 4 warps 1.1 KB and serializes): 16x32 and 32x32 with 8
# warps run on mma.sync without spills.
DKDV_TILES = {
    (64, "16-bit"): [(64, 128, 3, 8), (32, 128, 3, 8), (64, 64, 3, 4), (32, 64, 3, 4),
                     (32, 32, 2, 4, {"softcap"})],
    (128, "16-bit"): [(32, 128, 2, 8), (32, 128, 3, 8, {"pointer"}), (32, 64, 2, 4, {"pointer"}),
                      (16, 32, 2, 8)],
    (256, "16-bit"): [(16, 32, 2, 8), (32, 32, 2, 8)],
    # fp32's full-precision dots are FMA loops: 8 warps keep the small tiles unspilled
    # (32x32 with 4 warps spills 850-1050 B, 16x32 at D=256 1.3 KB).
    (64, "fp32"): [(32, 32, 2, 8)],
    (128, "fp32"): [(16, 32, 2, 8)],
    (256, "fp32"): [(16, 32, 2, 8)],
}  # fmt: skip
# dQ: a program holds Q, dO and dQ of BLOCK_M queries: the forward's sizes fit, with 128
# rows for 8 warps (a 64-row tile over 8 warps splits each wgmma's N over the two
# warpgroups, and ptxas serializes it: C7515). At D=128, 128x128 runs 454 instructions
# per 128 keys (128x64: 600) but spills with soft-capping (72 B) or on the pointer path
# (48 B).
_DQ_TILES = {
    (64, "16-bit"): [(128, 128, 3, 8), (128, 64, 3, 8), (64, 64, 3, 4), (32, 64, 3, 4),
                     (32, 32, 2, 4)],
    (128, "16-bit"): [(128, 128, 2, 8, {"softcap", "pointer"}), (128, 64, 3, 8), (128, 32, 3, 8),
                      (64, 64, 3, 4), (64, 32, 3, 4), (32, 32, 2, 4)],
    (256, "16-bit"): [(128, 32, 2, 8), (32, 64, 2, 8), (32, 32, 2, 8)],
    # MLA's (192, 128): 128x64 holds Q, dQ (256 wide) and dO (128) in 232 registers, no
    # spill: 342 instructions per 128 x 64 pair against 128x32's 264 per 128 x 32
    (256, "16-bit", 128): [(128, 64, 2, 8), (128, 32, 2, 8), (32, 64, 2, 8), (32, 32, 2, 8)],
    **{key: tiles for key, tiles in DKDV_TILES.items() if key[1] == "fp32"},
}  # fmt: skip


def backward_configs(head_dim: int, dtype: torch.dtype, modes: frozenset = frozenset(),
                     v_dim: int | None = None) -> list[triton.Config]:  # fmt: skip
    """dK/dV tiles at this head dim (and V's) and dtype: few keys per program, as each
    holds four (BLOCK_N, D) tiles."""
    return tile_configs(DKDV_TILES, head_dim, dtype, modes, v_dim)


def dq_configs(head_dim: int, dtype: torch.dtype, modes: frozenset = frozenset(),
               v_dim: int | None = None) -> list[triton.Config]:  # fmt: skip
    """dQ tiles at this head dim (and V's) and dtype: 64 to 128 queries per program
    (wgmma)."""
    return tile_configs(_DQ_TILES, head_dim, dtype, modes, v_dim)


# --- kernels --------------------------------------------------------------------------


@triton.jit
def _load_row_stats(lse_ptrs, delta_ptrs, mask, LOAD_DELTA: tl.constexpr = True):
    """LSE (to base 2) and delta of some rows (delta 0 without LOAD_DELTA). A row that
    saw no key has LSE -inf; it becomes +inf so that exp2(S - LSE) is 0 there rather
    than NaN."""
    lse = tl.load(lse_ptrs, mask=mask, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # log2(e)
    delta = tl.zeros_like(lse)
    if LOAD_DELTA:
        delta = tl.load(delta_ptrs, mask=mask, other=0.0)
    return lse2, delta


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, q_src, do_src, stride_qs, stride_dos, lse_ptr, delta_ptr, stride_ls,
    d_mask, dv_mask, q_lo, q_hi, start, mid_lo, mid_hi, end, Sq, qk_scale, cap_in,
    dq_dst, stride_dqs, sm_scale,
    SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    DQ: tl.constexpr, DQ_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Add query blocks [start, end) into dK, dV of one KV block (transposed: rows are
    keys). Blocks outside [mid_lo, mid_hi) are masked, under a per-block branch (one
    loop, as the forward's): there key n is seen by queries [q_lo[n], q_hi[n]) only.
    Rows and intervals are int32, pointer offsets int64 (as in the forward). With DQ,
    each query block's ``scale * dS K`` is also added into the fp32 dQ at `dq_dst`
    (`add_rows`): the fifth GEMM, where the split backward recomputes S and dP."""
    for start_m in range(start, end, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + tl.arange(0, BLOCK_M)
        q = load_rows(q_src, start_m, stride_qs, d_mask, Sq, TMA, BLOCK_M)
        do = load_rows(do_src, start_m, stride_dos, dv_mask, Sq, TMA, BLOCK_M)
        rows64 = rows.to(tl.int64)
        lse2, delta = _load_row_stats(lse_ptr + rows64 * stride_ls, delta_ptr + rows64, rows < Sq)
        qk_t, t = scores(tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION), qk_scale,
                         cap_in, SOFTCAP)  # (N, M)  # fmt: skip
        p_t = tl.math.exp2(qk_t - lse2[None, :])
        if (start_m < mid_lo) | (start_m >= mid_hi):
            seen = (rows[None, :] >= q_lo[:, None]) & (rows[None, :] < q_hi[:, None])
            p_t = tl.where(seen, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:  # through s = softcap * tanh(raw / softcap): times 1 - tanh^2
            ds_t = ds_t * (1.0 - t * t)
        if DQ:  # the scale goes in here, for dK and dQ alike (no multiply of dQ's tile)
            ds_t = ds_t * sm_scale
        ds_t = ds_t.to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=INPUT_PRECISION)
        if DQ:  # (M, D): this key block's share of the query block's dQ
            dq = tl.dot(tl.trans(ds_t), k, input_precision=INPUT_PRECISION)
            add_rows(dq_dst, dq, start_m, stride_dqs, d_mask, Sq, DQ_TMA, BLOCK_M)
    return dk, dv


@triton.jit
def add_rows(dst, x, start, stride, d_mask, n, TMA: tl.constexpr, BLOCK: tl.constexpr):
    """Atomically add the fp32 tile `x` to rows [start, start + BLOCK) of an (n, D)
    matrix: through a TMA descriptor, one bulk reduce-add (rows past n dropped), or
    per element at pointers to its row 0 (`tile_source`), rows below n and `d_mask`."""
    if TMA:
        dst.atomic_add([start, 0], x)
    else:
        rows = start + tl.arange(0, BLOCK)
        mask = d_mask[None, :] & (rows[:, None] < n)
        tl.atomic_add(dst + start.to(tl.int64) * stride, x, mask=mask, sem="relaxed")


@triton.jit
def _attn_bwd_dkdv_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_ptr, q_lo_ptr,
    q_hi_ptr,
    # strides
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_lb, stride_lh, stride_ls,
    stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    stride_ib,
    # sizes
    Sq, Skv, Hq, GROUP, SPLIT, qk_scale, cap_in, sm_scale, shift, left, right,
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, INTERVALS: tl.constexpr,
    SOFTCAP: tl.constexpr, ACCUMULATE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, OUT_TMA: tl.constexpr, DQ: tl.constexpr, DQ_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One KV block of one KV head: loops over the query heads that read it (all GROUP
    of them, or its slice of the group when SPLIT > 1) and their query blocks, so dK/dV
    are summed in a fixed order, with no atomics. Output head ``pid_h``: the KV head, or
    with SPLIT > 1 the partial ``h_kv * SPLIT + slice`` of an (B, Skv, Hkv * SPLIT, D)
    buffer. With DQ (the fused backward) it also adds every query block's dQ share into
    the fp32 (B, Sq, Hq, D) `dq_ptr` (atomics: dQ's sum order is not fixed)."""
    # grid (KV blocks, B, Hkv * SPLIT), first block first (causal: it sees the most
    # queries), 64-bit offsets as the forward's
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_h = tl.program_id(2).to(tl.int64)
    h_kv = pid_h // SPLIT
    per_program = tl.cdiv(GROUP, SPLIT)
    g_lo = (pid_h % SPLIT) * per_program
    g_hi = tl.minimum(g_lo + per_program, GROUP)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_mask = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV).to(tl.int64)  # V's, dO's and dV's columns
    dv_mask = offs_dv < HEAD_DIM_V
    kv_mask = (offs_n < Skv)[:, None] & d_mask[None, :]
    v_mask = (offs_n < Skv)[:, None] & dv_mask[None, :]

    # The queries [q_lo, q_hi) that see each key (`mask`), and the query blocks
    # they give (the forward's ranges, from the key side). Rows past Sq and keys past
    # Skv load as zeros and add nothing to the stored rows.
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if INTERVALS:
        q_lo, q_hi = load_intervals(q_lo_ptr + b * stride_ib, q_hi_ptr + b * stride_ib, keys,
                                    keys < Skv, Sq)  # fmt: skip
    else:
        q_lo, q_hi = scalar_intervals(keys, -shift, right, left, Sq)
    start, mid_lo, mid_hi, end = block_ranges(q_lo, q_hi, keys < Skv, BLOCK_M)
    if DQ:  # keys past Skv (zeros) still score, exp(-LSE): where that overflows, its dS
        # times their zero K rows would put NaN in dQ. They get no query, and a partial
        # last block runs masked throughout (its stored dK/dV rows never held them).
        q_hi = tl.where(keys < Skv, q_hi, q_lo)
        if (pid_n + 1) * BLOCK_N > Skv:
            mid_hi = mid_lo

    k = tl.load(k_ptr + b * stride_kb + h_kv * stride_kh + offs_n[:, None] * stride_ks
                + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)  # fmt: skip
    v = tl.load(v_ptr + b * stride_vb + h_kv * stride_vh + offs_n[:, None] * stride_vs
                + offs_dv[None, :] * stride_vd, mask=v_mask, other=0.0)  # fmt: skip
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    for g in range(g_lo, g_hi):
        h = h_kv * GROUP + g
        q_src = tile_source(q_ptr + b * stride_qb + h * stride_qh, Sq, stride_qs, stride_qd,
                            HEAD_DIM, TMA, BLOCK_M, BLOCK_D)  # fmt: skip
        do_src = tile_source(do_ptr + b * stride_dob + h * stride_doh, Sq, stride_dos,
                             stride_dod, HEAD_DIM_V, TMA, BLOCK_M, BLOCK_DV)  # fmt: skip
        dq_dst = dq_ptr
        if DQ:
            dq_dst = tile_source(dq_ptr + b * stride_dqb + h * stride_dqh, Sq, stride_dqs,
                                 stride_dqd, HEAD_DIM, DQ_TMA, BLOCK_M, BLOCK_D)  # fmt: skip
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, q_src, do_src, stride_qs, stride_dos,
            lse_ptr + b * stride_lb + h * stride_lh, delta_ptr + (b * Hq + h) * Sq, stride_ls,
            d_mask, dv_mask, q_lo, q_hi, start, mid_lo, mid_hi, end, Sq, qk_scale, cap_in,
            dq_dst, stride_dqs, sm_scale, SOFTCAP, INPUT_PRECISION, TMA, DQ, DQ_TMA, BLOCK_M,
        )  # fmt: skip

    if ACCUMULATE:  # a block no query sees adds nothing: leave it alone
        kv_mask = kv_mask & (keys * 0 + start < end)[:, None]
        v_mask = v_mask & (keys * 0 + start < end)[:, None]
    dv_out = dv_ptr + b * stride_dvb + pid_h * stride_dvh
    dk_out = dk_ptr + b * stride_dkb + pid_h * stride_dkh
    store_tile(dv_out, dv, pid_n * BLOCK_N, offs_n, offs_dv, stride_dvs, stride_dvd, v_mask,
                Skv, HEAD_DIM_V, ACCUMULATE, OUT_TMA, BLOCK_N, BLOCK_DV)  # fmt: skip
    if not DQ:  # (the fused kernel scaled dS already)
        dk = dk * sm_scale
    store_tile(dk_out, dk, pid_n * BLOCK_N, offs_n, offs_d, stride_dks,
                stride_dkd, kv_mask, Skv, HEAD_DIM, ACCUMULATE, OUT_TMA, BLOCK_N,
                BLOCK_D)  # fmt: skip


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs,
    d_mask, dv_mask, lo, hi, start, mid_lo, mid_hi, end, Skv, qk_scale, cap_in,
    SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Add KV blocks [start, end) into dQ of one query block; blocks outside [mid_lo,
    mid_hi) are masked, under a per-block branch (one loop, as the forward's)."""
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = load_rows(k_src, start_n, stride_ks, d_mask, Skv, TMA, BLOCK_N)
        v = load_rows(v_src, start_n, stride_vs, dv_mask, Skv, TMA, BLOCK_N)
        qk, t = scores(tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION), qk_scale,
                       cap_in, SOFTCAP)  # fmt: skip
        p = tl.math.exp2(qk - lse2[:, None])
        if (start_n < mid_lo) | (start_n >= mid_hi):
            kv_rows = start_n + tl.arange(0, BLOCK_N)
            visible = (kv_rows[None, :] >= lo[:, None]) & (kv_rows[None, :] < hi[:, None])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, kv_lo_ptr, kv_hi_ptr,
    o_ptr, dlse_ptr,
    # strides
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_lb, stride_lh, stride_ls,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_dlb, stride_dlh, stride_dls,
    stride_ib,
    # sizes
    Sq, Skv, Hq, GROUP, qk_scale, cap_in, sm_scale, shift, left, right,
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, INTERVALS: tl.constexpr,
    SOFTCAP: tl.constexpr, ACCUMULATE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, DELTA: tl.constexpr, DLSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dQ of one query block. With DELTA it first makes the block's delta, ``rowsum(dO *
    O)`` (minus dLSE with DLSE), from the O rows it loads once, and stores it for the
    dK/dV launch after it: the separate delta launch and pass are gone."""
    # grid (query blocks, B, Hq), last block first and 64-bit offsets, as the forward's
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    h_kv = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_mask = offs_d < HEAD_DIM
    row_mask = (offs_m < Sq)[:, None] & d_mask[None, :]
    offs_dv = tl.arange(0, BLOCK_DV).to(tl.int64)  # dO's, O's and V's columns
    dv_mask = offs_dv < HEAD_DIM_V
    row_mask_v = (offs_m < Sq)[:, None] & dv_mask[None, :]
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if INTERVALS:  # the forward's key ranges
        lo, hi = load_intervals(kv_lo_ptr + b * stride_ib, kv_hi_ptr + b * stride_ib, rows,
                                rows < Sq, Skv)  # fmt: skip
    else:
        lo, hi = scalar_intervals(rows, shift, left, right, Skv)
    start, mid_lo, mid_hi, end = block_ranges(lo, hi, offs_m < Sq, BLOCK_N)

    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs
                + offs_d[None, :] * stride_qd, mask=row_mask, other=0.0)  # fmt: skip
    do = tl.load(do_ptr + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos
                 + offs_dv[None, :] * stride_dod, mask=row_mask_v, other=0.0)  # fmt: skip
    lse_ptrs = lse_ptr + b * stride_lb + h * stride_lh + offs_m * stride_ls
    delta_ptrs = delta_ptr + (b * Hq + h) * Sq + offs_m
    if DELTA:
        o = tl.load(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os
                    + offs_dv[None, :] * stride_od, mask=row_mask_v, other=0.0)  # fmt: skip
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        if DLSE:  # d(LSE_i)/d(S_ij) = P_ij: the LSE's gradient folds into delta
            delta -= tl.load(dlse_ptr + b * stride_dlb + h * stride_dlh + offs_m * stride_dls,
                             mask=offs_m < Sq, other=0.0)  # fmt: skip
        tl.store(delta_ptrs, delta, mask=offs_m < Sq)
        lse2, _ = _load_row_stats(lse_ptrs, delta_ptrs, offs_m < Sq, False)
    else:
        lse2, delta = _load_row_stats(lse_ptrs, delta_ptrs, offs_m < Sq)
    k_src = tile_source(k_ptr + b * stride_kb + h_kv * stride_kh, Skv, stride_ks, stride_kd,
                        HEAD_DIM, TMA, BLOCK_N, BLOCK_D)  # fmt: skip
    v_src = tile_source(v_ptr + b * stride_vb + h_kv * stride_vh, Skv, stride_vs, stride_vd,
                        HEAD_DIM_V, TMA, BLOCK_N, BLOCK_DV)  # fmt: skip

    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    dq = _bwd_dq_inner(
        dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, d_mask, dv_mask, lo, hi,
        start, mid_lo, mid_hi, end, Skv, qk_scale, cap_in, SOFTCAP, INPUT_PRECISION, TMA,
        BLOCK_N,
    )  # fmt: skip
    dq = dq * sm_scale
    dq_ptrs = (dq_ptr + b * stride_dqb + h * stride_dqh
               + offs_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd)  # fmt: skip
    if ACCUMULATE:
        dq += tl.load(dq_ptrs, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(dq_ptrs, dq.to(dq_ptr.dtype.element_ty), mask=row_mask)


# --- launchers ---


@functools.cache
def _largest_key_block(head_dim: int, dtype: torch.dtype) -> int:
    return max(c.kwargs["BLOCK_N"] for c in backward_configs(head_dim, dtype))


def gqa_split(B: int, Skv: int, Hkv: int, group: int, q: torch.Tensor,
              head_dim: int | None = None) -> int:  # fmt: skip
    """How many programs share the query heads of one KV head's dK/dV (1: no split).

    Split when the grid ``cdiv(Skv, BLOCK_N) * B * Hkv`` (BLOCK_N: the largest key block
    of the dK/dV tiles at `head_dim`, default q's, i.e. the fewest programs) is below
    `SPLIT_BELOW_PROGRAMS` (two waves of SMs by default; queried when first needed, never
    at import), into as many slices as fill that, at most one query head each."""
    head_dim = q.shape[-1] if head_dim is None else head_dim
    below = SPLIT_BELOW_PROGRAMS
    if below is None:
        below = 2 * sm_count(q.device) if q.device.type == "cuda" else 0
    programs = max(1, cdiv(Skv, _largest_key_block(head_dim, q.dtype)) * B * Hkv)
    if group == 1 or programs >= below:
        return 1
    split = min(group, cdiv(below, programs))
    return cdiv(group, cdiv(group, split))  # no slice left without a head


def partials(shape, device: torch.device) -> torch.Tensor:
    """The fp32 per-slice dK or dV of a split group (every element is written; tests
    poison it through this function)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def delta_buffer(shape, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    """The fp32 (B, Hq, Sq) buffer the dQ kernel makes delta in, for the dK/dV launches
    after it (every element written first; tests poison it through this function);
    `dtype`: the LSE's (float64 for float64 q)."""
    return torch.empty(shape, dtype=dtype, device=device)


def contiguous_delta(delta):
    if not isinstance(delta, torch.Tensor):
        raise TypeError(f"delta must be a (B, Hq, Sq) float32 tensor, got {type(delta).__name__}")
    return delta.contiguous()  # the kernels index it as (B, Hq, Sq) contiguous


def attention_backward_dkdv(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    mask: AttentionMask = NO_MASK,
    *,
    grads: Gradients = NEW_GRADIENTS,
    launch_as: Launch = LAUNCH,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(dk, dv)`` (B, Skv, Hkv, D) and (B, Skv, Hkv, Dv) of one attention block; arguments as in
    `attention_backward` (``delta`` required). Writes fresh values, or adds into
    ``grads.dk`` and ``grads.dv`` with ``grads.accumulate``. Under GQA with a small grid
    the group is split (`gqa_split`): fp32 partials, then a fixed-order sum into dk, dv.
    Checked and planned once per call signature (`plan.BackwardPlan`)."""
    if impl.runs_torch(q):
        return torch_backward("dkdv", (dout, q, k, v, lse, delta), mask, grads, launch_as)
    inputs = (dout, q, k, v, lse, contiguous_delta(delta))
    plan, tensors = plan_backward("dkdv", _attn_bwd_dkdv_kernel,
                                  functools.partial(group_split, q, k, v), SPLIT_BELOW_PROGRAMS,
                                  inputs, mask, grads, launch_as)  # fmt: skip
    dk, dv = (gradient_buffer(g, like, plan.grad_dtype, launch_as.tune_only)
              for g, like in ((grads.dk, k), (grads.dv, v)))  # fmt: skip
    B, Skv, Hkv, _ = k.shape
    if B * Hkv * Skv == 0:  # with Sq == 0 the kernel writes zeros: no query, no gradient
        return None if launch_as.tune_only else (dk, dv)

    def torch_run():
        torch_impl.backward_dkdv(*inputs, plan.scores, dk, dv, plan.accumulate)

    launch_dkdv(plan, tensors, backward_configs, inputs, (dk, dv), launch_as,
                torch_run=torch_run if plan.torch_candidate else None)  # fmt: skip
    return None if launch_as.tune_only else (dk, dv)


def group_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """`gqa_split` of a dK/dV launch over q's heads and k's (tiles of the wider of D and
    Dv)."""
    return gqa_split(*k.shape[:3], q.shape[2] // k.shape[2], q, max(q.shape[-1], v.shape[-1]))


def launch_dkdv(plan, tensors, configs, inputs, outs, launch_as: Launch, restore=(),
                torch_run=None) -> None:  # fmt: skip
    """The dK/dV kernel as `plan` has it (`plan_backward`; `tensors`: the mask's lo, hi
    and batch stride) on `inputs` (dout, q, k, v, lse, delta), into `outs` (dk, dv), or
    under the GQA split into fp32 partials summed into them after, in order; with the
    fused backward's fp32 dQ sums as a third of `outs` (plan kind "fused") it adds dQ
    there too. `restore`: what else the kernel adds into (tuning puts it back; dk and dv
    are added when the plan accumulates into them)."""
    dout, q, k, v, lse, delta = inputs
    dk, dv, *dq_sums = outs
    (B, Skv, Hkv, D), Dv, split, meta = k.shape, v.shape[-1], plan.split, plan.meta
    out_k, out_v = dk, dv
    if split > 1:
        out_k, out_v = (partials((B, Skv, Hkv * split, d), q.device) for d in (D, Dv))
    if meta["TMA"] or meta["OUT_TMA"] or meta["DQ_TMA"]:
        ensure_tma_allocator(q.device)  # per thread: autograd's backward runs on its own
    lo, hi, batch_stride = tensors
    args = (q, k, v, dout, lse, delta, out_k, out_v, *(dq_sums or [q]), lo, hi, *plan.strides,
            batch_stride, *plan.scalars)  # fmt: skip

    def grid(tile):
        return (cdiv(Skv, tile["BLOCK_N"]), B, Hkv * split)

    tune_only = launch_as.tune_only
    restore = [] if tune_only else [*restore, *([dk, dv] if meta["ACCUMULATE"] else [])]
    launch(_attn_bwd_dkdv_kernel, configs, grid, args, plan, launch_as=launch_as,
           restore=restore, torch_runs=torch_alternatives(torch_run))  # fmt: skip
    if split > 1 and not tune_only:
        sum_slices((dk, dv), (out_k, out_v), split, plan.accumulate)


def sum_slices(grads, parts, split: int, accumulate: bool) -> None:
    """Each group's `split` fp32 slices (B, Skv, Hkv * split, D or Dv) summed in order
    (torch.sum: no atomics) into `grads` (B, Skv, Hkv, D or Dv), or added to them with
    `accumulate`."""
    for final, part in zip(grads, parts, strict=True):
        summed = part.unflatten(2, (final.shape[2], split)).sum(3)
        if accumulate:
            final.add_(summed)
        else:
            final.copy_(summed)


def attention_backward_dq(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    mask: AttentionMask = NO_MASK,
    *,
    grads: Gradients = NEW_GRADIENTS,
    launch_as: Launch = LAUNCH,
    delta_from: tuple = NO_SOURCES,
) -> torch.Tensor | None:
    """``dq`` (B, Sq, Hq, D) of one attention block; arguments as in `attention_backward`.
    Writes fresh values, or adds into ``grads.dq`` with ``grads.accumulate``. With
    `delta_from` ``(out, dlse)`` (dlse None: 0) the kernel makes ``delta = rowsum(dO * O)
    - dLSE`` itself and writes it into `delta` (a (B, Hq, Sq) fp32 buffer), for a dK/dV
    call after it; without, it reads `delta`. Checked and planned once per call
    signature."""
    out, dlse = delta_from
    if dlse is not None and out is None:
        raise ValueError("attention_backward_dq: dlse folds into the delta made from `out`: "
                         "give out too, or subtract it from a precomputed delta")  # fmt: skip
    if impl.runs_torch(q):
        return torch_backward("dq", (dout, q, k, v, lse, delta), mask, grads, launch_as,
                              delta_from)  # fmt: skip
    inputs = (dout, q, k, v, lse, contiguous_delta(delta))
    plan, (lo, hi, batch_stride) = plan_backward("dq", _attn_bwd_dq_kernel, None, None, inputs,
                                                 mask, grads, launch_as, delta_from)  # fmt: skip
    tune_only = launch_as.tune_only
    dq = gradient_buffer(grads.dq, q, plan.grad_dtype, tune_only)
    B, Sq, Hq, _ = q.shape
    if B * Hq * Sq == 0:
        return None if tune_only else dq
    delta = inputs[-1]
    args = (q, k, v, dout, lse, delta, dq, lo, hi, q if out is None else out,
            lse if dlse is None else dlse, *plan.strides, batch_stride,
            *plan.scalars)  # fmt: skip

    def grid(tile):
        return (cdiv(Sq, tile["BLOCK_M"]), B, Hq)

    def torch_run():
        if out is not None:
            write_delta(delta, dout, out, dlse)
        torch_impl.backward_dq(*inputs, plan.scores, dq, plan.accumulate)

    launch(_attn_bwd_dq_kernel, dq_configs, grid, args, plan, launch_as=launch_as,
           restore=[dq] if plan.accumulate and not tune_only else [],
           torch_runs=torch_alternatives(torch_run if plan.torch_candidate else None))  # fmt: skip
    return None if tune_only else dq
