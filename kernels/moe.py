"""Mixture-of-experts token dispatch: metadata, grouped expert GEMMs, permute, combine.

Routing sends each of T tokens to k experts: P = T * k (token, slot) pairs. The pairs are
put in a stable expert-major order; expert e owns the rows
``offsets[e]:offsets[e + 1]`` of that order.

| function                | computes                                                      |
| ----------------------- | ------------------------------------------------------------- |
| `dispatch_metadata`     | counts (E,), order (P_kept,), pos (T, k) (-1: dropped)        |
| `grouped_matmul`        | ``y[p] = x[rows[p]] @ w[e(p)].T`` (the gather fused into the loads) |
| `grouped_weight_grad`   | ``dw[e] = sum_{p in e} dy[p]^T x[rows[p]]`` (0 for an empty expert) |
| `gather_rows`           | ``out[p] = src[idx[p]] (* scale[p])``                         |
| `combine`               | ``y[t] = sum_j w[t, j] * src[pos[t, j]]`` (j in order; pos -1 skipped) |
| `combine_weight_grad`   | ``dw[t, j] = <dy[t], src[pos[t, j]]>``                        |

Every sum runs in a fixed order inside one program: no atomics, so results are
bitwise reproducible. Accumulation is fp32.
"""

import torch
import triton
import triton.language as tl
from fusedpar.kernels._common import (
    check_float_dtype,
    check_launchable,
    device_guard,
    fp32_dot_precision,
    is_interpreted,
)


def gemm_tiles(interpreted: bool) -> dict:
    """The grouped GEMM's tile. Fixed rather than autotuned: the grid is sized from
    BLOCK_M before launch (blocks never straddle two experts). 128x128x64 with 8 warps
    feeds Hopper's wgmma; the interpreter wants few, small programs."""
    if interpreted:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=1)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


ROW_BLOCK = 16  # rows per program of the permute/combine kernels (they are bandwidth-bound)
COL_BLOCK = 128  # columns per program of the same


# --- metadata ------------------------------------------------------------------------


def dispatch_metadata(expert_ids: torch.Tensor, num_experts: int, keep: torch.Tensor | None = None):
    """Counts per expert and the stable expert-major order of the kept (token, slot) pairs.

    expert_ids (T, k) int; keep (T, k) bool or None (all kept). Returns ``counts`` (E,)
    int64, ``order`` (P_kept,) int64 (flat pair indices t * k + j, expert-major, by pair
    index within an expert) and ``pos`` (T, k) int64, each pair's row in that order or -1.
    Deterministic: a stable sort, no atomics.
    """
    flat = expert_ids.reshape(-1).to(torch.int64)
    if keep is not None:
        flat = torch.where(keep.reshape(-1), flat, num_experts)  # dropped pairs sort last
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    kept = int(counts.sum())
    order = torch.argsort(flat, stable=True)[:kept]
    pos = torch.full_like(flat, -1)
    pos[order] = torch.arange(kept, device=flat.device)
    return counts, order, pos.view(expert_ids.shape)


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0))


# --- grouped GEMM ----------------------------------------------------------------------


@triton.jit
def _grouped_matmul_kernel(
    # pointers
    x_ptr, w_ptr, y_ptr, rows_ptr, offsets_ptr, block_offsets_ptr,
    # strides
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_ym, stride_yn,
    # sizes
    N, K, E,
    # meta-parameters
    HAS_ROWS: tl.constexpr, E_PAD: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """y[p] = x[rows[p]] @ w[e].T for the rows p of expert e; one (BLOCK_M, BLOCK_N) tile.
    Program m handles block m of the concatenated per-expert blocks (block_offsets is the
    cumulative count of BLOCK_M blocks per expert); programs past the last block exit."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    experts = tl.arange(0, E_PAD)
    ends = tl.load(block_offsets_ptr + 1 + experts, mask=experts < E, other=2**31 - 1)
    e = tl.sum((ends <= pid_m).to(tl.int32), 0)
    if e >= E:
        return
    first_block = tl.load(block_offsets_ptr + e)
    row_start = tl.load(offsets_ptr + e) + (pid_m - first_block) * BLOCK_M
    row_end = tl.load(offsets_ptr + e + 1)
    offs_m = row_start + tl.arange(0, BLOCK_M)
    row_mask = offs_m < row_end
    src_rows = tl.load(rows_ptr + offs_m, mask=row_mask, other=0) if HAS_ROWS else offs_m
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + src_rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = (w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
              + offs_k[:, None] * stride_wk)  # fmt: skip
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_n[None, :] < N))


@triton.jit
def _grouped_weight_grad_kernel(
    # pointers
    dy_ptr, x_ptr, dw_ptr, rows_ptr, offsets_ptr,
    # strides
    stride_dym, stride_dyn, stride_xm, stride_xk, stride_we, stride_wn, stride_wk,
    # sizes
    N, K,
    # meta-parameters
    HAS_ROWS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """dw[e] tile (BLOCK_N, BLOCK_K) = sum over expert e's rows of dy[p]^T x[rows[p]]."""
    e = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    row_start = tl.load(offsets_ptr + e)
    row_end = tl.load(offsets_ptr + e + 1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(row_start, row_end, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        row_mask = offs_m < row_end
        src_rows = tl.load(rows_ptr + offs_m, mask=row_mask, other=0) if HAS_ROWS else offs_m
        dy_ptrs = dy_ptr + offs_m.to(tl.int64)[:, None] * stride_dym + offs_n[None, :] * stride_dyn
        dy = tl.load(dy_ptrs, mask=row_mask[:, None] & (offs_n[None, :] < N), other=0.0)
        x_ptrs = x_ptr + src_rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
        x = tl.load(x_ptrs, mask=row_mask[:, None] & (offs_k[None, :] < K), other=0.0)
        acc = tl.dot(tl.trans(dy), x, acc, input_precision=INPUT_PRECISION)
    dw_ptrs = (dw_ptr + e.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
               + offs_k[None, :] * stride_wk)  # fmt: skip
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty),
             mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))  # fmt: skip


# --- permute and combine ------------------------------------------------------------------


@triton.jit
def _gather_rows_kernel(
    src_ptr, idx_ptr, scale_ptr, out_ptr,
    stride_sm, stride_sd, stride_om, stride_od,
    P, D,
    HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out[p] = src[idx[p]] (* scale[p])."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = offs_m < P
    mask = rows[:, None] & (offs_d[None, :] < D)
    src_rows = tl.load(idx_ptr + offs_m, mask=rows, other=0).to(tl.int64)
    vals = tl.load(src_ptr + src_rows[:, None] * stride_sm + offs_d[None, :] * stride_sd, mask=mask)
    if HAS_SCALE:
        vals = vals.to(tl.float32) * tl.load(scale_ptr + offs_m, mask=rows, other=0.0)[:, None]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :] * stride_od,
             vals.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip


@triton.jit
def _combine_kernel(
    src_ptr, pos_ptr, weight_ptr, y_ptr,
    stride_sm, stride_sd, stride_ym, stride_yd,
    T, D, TOP_K,
    HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """y[t] = sum_j w[t, j] * src[pos[t, j]], j = 0..TOP_K-1 in order, pos -1 skipped."""
    offs_t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tokens = offs_t < T
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for j in range(TOP_K):
        pos = tl.load(pos_ptr + offs_t.to(tl.int64) * TOP_K + j, mask=tokens, other=-1)
        live = pos >= 0
        mask = live[:, None] & (offs_d[None, :] < D)
        src_ptrs = src_ptr + pos.to(tl.int64)[:, None] * stride_sm + offs_d[None, :] * stride_sd
        vals = tl.load(src_ptrs, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + offs_t.to(tl.int64) * TOP_K + j, mask=tokens, other=0.0)
            vals *= w[:, None]
        acc += vals
    y_ptrs = y_ptr + offs_t.to(tl.int64)[:, None] * stride_ym + offs_d[None, :] * stride_yd
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=tokens[:, None] & (offs_d[None, :] < D))


@triton.jit
def _combine_weight_grad_kernel(
    dy_ptr, src_ptr, pos_ptr, dw_ptr,
    stride_dym, stride_dyd, stride_sm, stride_sd,
    T, D, TOP_K,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dw[t, j] = <dy[t], src[pos[t, j]]> (0 where pos is -1), summed over D in order."""
    offs_t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = offs_t < T
    for j in range(TOP_K):
        pos = tl.load(pos_ptr + offs_t.to(tl.int64) * TOP_K + j, mask=tokens, other=-1)
        live = pos >= 0
        acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_mask = offs_d[None, :] < D
            dy_ptrs = (
                dy_ptr + offs_t.to(tl.int64)[:, None] * stride_dym + offs_d[None, :] * stride_dyd
            )
            dy = tl.load(dy_ptrs, mask=tokens[:, None] & d_mask, other=0.0).to(tl.float32)
            src_ptrs = src_ptr + pos.to(tl.int64)[:, None] * stride_sm + offs_d[None, :] * stride_sd
            src = tl.load(src_ptrs, mask=live[:, None] & d_mask, other=0.0).to(tl.float32)
            acc += tl.sum(dy * src, 1)
        tl.store(dw_ptr + offs_t.to(tl.int64) * TOP_K + j, acc, mask=tokens)


# --- launchers -------------------------------------------------------------------------


def _dot_precision(dtype: torch.dtype) -> str:
    return fp32_dot_precision() if dtype == torch.float32 else "tf32"


def _check_rows(name, rows, count, device):
    if rows is None:
        return
    if rows.dim() != 1 or rows.shape[0] != count or rows.dtype != torch.int64:
        raise ValueError(f"{name} must be int64 ({count},), got {rows.dtype} {tuple(rows.shape)}")
    if rows.device != device:
        raise ValueError(f"{name} is on {rows.device}, the data on {device}")


def grouped_matmul(x, w, counts, rows=None, *, out_dtype=None, transpose_w=False):
    """``y[p] = x[rows[p]] @ w[e].T`` (``@ w[e]`` with `transpose_w`) over expert groups.

    x (R, K) any strides; w (E, N, K) (or (E, K, N) with `transpose_w`); counts (E,)
    int64, summing to P; rows (P,) int64 or None (x is already in expert order, P = R).
    Returns y (P, N) in `out_dtype` (x's by default), rows in expert order.
    """
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_matmul takes x (R, K) and w (E, N, K), got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")  # fmt: skip
    E = w.shape[0]
    N, K = (w.shape[2], w.shape[1]) if transpose_w else (w.shape[1], w.shape[2])
    if x.shape[1] != K:
        raise ValueError(f"x has K={x.shape[1]}, the experts' weights K={K} ({tuple(w.shape)})")
    check_float_dtype("x", x)
    if w.dtype != x.dtype:
        raise TypeError(f"x is {x.dtype} but w is {w.dtype}")
    if counts.shape != (E,):
        raise ValueError(f"counts must be ({E},), got {tuple(counts.shape)}")
    P = x.shape[0] if rows is None else rows.shape[0]
    _check_rows("rows", rows, P, x.device)
    check_launchable(_grouped_matmul_kernel, x, w, counts)
    y = torch.empty((P, N), dtype=out_dtype or x.dtype, device=x.device)
    if P == 0 or N == 0:
        return y
    tiles = gemm_tiles(is_interpreted(_grouped_matmul_kernel))
    block_m = tiles["BLOCK_M"]
    offsets = _offsets(counts)
    block_offsets = _offsets((counts + block_m - 1) // block_m)  # blocks per expert
    stride_wn, stride_wk = (w.stride(2), w.stride(1)) if transpose_w else (w.stride(1), w.stride(2))
    grid = (triton.cdiv(P, block_m) + E, triton.cdiv(N, tiles["BLOCK_N"]))  # >= the blocks needed
    with device_guard(x):
        _grouped_matmul_kernel[grid](
            x, w, y, rows if rows is not None else offsets, offsets, block_offsets,
            x.stride(0), x.stride(1), w.stride(0), stride_wn, stride_wk, y.stride(0), y.stride(1),
            N, K, E,
            HAS_ROWS=rows is not None, E_PAD=triton.next_power_of_2(E + 1),
            INPUT_PRECISION=_dot_precision(x.dtype), **tiles,
        )  # fmt: skip
    return y


def grouped_weight_grad(dy, x, counts, rows=None, *, out_dtype=None):
    """``dw[e] = sum_{p in e} dy[p]^T x[rows[p]]``: (E, N, K). Zero for an empty expert."""
    P, N = dy.shape
    K = x.shape[1]
    E = counts.shape[0]
    _check_rows("rows", rows, P, x.device)
    check_launchable(_grouped_weight_grad_kernel, dy, x, counts)
    dw = torch.empty((E, N, K), dtype=out_dtype or x.dtype, device=x.device)
    if dw.numel() == 0:
        return dw
    tiles = gemm_tiles(is_interpreted(_grouped_weight_grad_kernel))
    grid = (E, triton.cdiv(N, tiles["BLOCK_N"]), triton.cdiv(K, tiles["BLOCK_K"]))
    with device_guard(x):
        _grouped_weight_grad_kernel[grid](
            dy, x, dw, rows if rows is not None else counts, _offsets(counts),
            dy.stride(0), dy.stride(1), x.stride(0), x.stride(1), *dw.stride(),
            N, K,
            HAS_ROWS=rows is not None, INPUT_PRECISION=_dot_precision(x.dtype), **tiles,
        )  # fmt: skip
    return dw


def _row_grid(rows: int, cols: int):
    block_d = min(COL_BLOCK, max(16, triton.next_power_of_2(cols)))
    return (triton.cdiv(rows, ROW_BLOCK), triton.cdiv(cols, block_d)), block_d


def gather_rows(src, idx, scale=None, *, out_dtype=None):
    """``out[p] = src[idx[p]] (* scale[p])``: (P, D) from src (R, D), idx (P,) int64."""
    P, D = idx.shape[0], src.shape[1]
    _check_rows("idx", idx, P, src.device)
    check_launchable(_gather_rows_kernel, src, idx)
    out = torch.empty((P, D), dtype=out_dtype or src.dtype, device=src.device)
    if out.numel() == 0:
        return out
    grid, block_d = _row_grid(P, D)
    with device_guard(src):
        _gather_rows_kernel[grid](
            src, idx, scale if scale is not None else idx, out,
            src.stride(0), src.stride(1), out.stride(0), out.stride(1), P, D,
            HAS_SCALE=scale is not None, BLOCK_M=ROW_BLOCK, BLOCK_D=block_d,
        )  # fmt: skip
    return out


def combine(src, pos, weight=None, *, out_dtype=None):
    """``y[t] = sum_j weight[t, j] * src[pos[t, j]]``: (T, D) from src (P, D), pos (T, k)
    int64 (-1: skipped), weight (T, k) float32 or None (all ones)."""
    T, top_k = pos.shape
    D = src.shape[1]
    check_launchable(_combine_kernel, src, pos)
    y = torch.empty((T, D), dtype=out_dtype or src.dtype, device=src.device)
    if y.numel() == 0:
        return y
    pos = pos.contiguous()
    weight = None if weight is None else weight.float().contiguous()
    grid, block_d = _row_grid(T, D)
    with device_guard(src):
        _combine_kernel[grid](
            src, pos, weight if weight is not None else pos, y,
            src.stride(0), src.stride(1), y.stride(0), y.stride(1), T, D, top_k,
            HAS_WEIGHT=weight is not None, BLOCK_M=ROW_BLOCK, BLOCK_D=block_d,
        )  # fmt: skip
    return y


def combine_weight_grad(dy, src, pos):
    """``dw[t, j] = <dy[t], src[pos[t, j]]>`` (0 where pos is -1): (T, k) float32."""
    T, top_k = pos.shape
    check_launchable(_combine_weight_grad_kernel, dy, src, pos)
    dw = torch.empty((T, top_k), dtype=torch.float32, device=dy.device)
    if dw.numel() == 0:
        return dw
    _, block_d = _row_grid(T, dy.shape[1])
    with device_guard(dy):
        _combine_weight_grad_kernel[(triton.cdiv(T, ROW_BLOCK),)](
            dy, src, pos.contiguous(), dw,
            dy.stride(0), dy.stride(1), src.stride(0), src.stride(1), T, dy.shape[1], top_k,
            BLOCK_M=ROW_BLOCK, BLOCK_D=block_d,
        )  # fmt: skip
    return dw


# --- reference -------------------------------------------------------------------------


def grouped_matmul_reference(x, w, counts, rows=None, transpose_w=False):
    """`grouped_matmul` in plain PyTorch: a loop over experts."""
    xs = x if rows is None else x[rows]
    outs, start = [], 0
    for e, c in enumerate(counts.tolist()):
        we = w[e] if transpose_w else w[e].T
        outs.append(xs[start : start + c] @ we)
        start += c
    return torch.cat(outs) if outs else xs.new_empty((0, w.shape[1]))
