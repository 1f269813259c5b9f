"""Mixture-of-experts token dispatch: metadata and the grouped expert GEMMs.

Routing sends each of T tokens to k experts: P = T * k (token, slot) pairs. The pairs are
put in a stable expert-major order; expert e owns the rows ``offsets[e]:offsets[e + 1]``
of that order, and the pairs a capacity limit drops sort last, past ``offsets[E]``: no
kernel reads or writes those rows (their values are unspecified), so no count has to
reach the host.

| function                    | computes                                                 |
| --------------------------- | -------------------------------------------------------- |
| `dispatch_metadata`         | counts (E,), order (P,), pos (T, k) (-1: dropped)        |
| `grouped_matmul`            | ``y[p] = x[rows[p]] @ w[e].T`` (the gather in the loads) |
| `grouped_swiglu`            | ``a[p] = silu(h1[p]) * h3[p]``, ``h1, h3 = x[rows[p]] @  |
|                             | w1[e].T, w3[e].T``: one gather of x, one product whose   |
|                             | tiles take half their columns from each weight           |
| `grouped_swiglu_backward`   | ``dh1, dh3`` from ``da = d_out[p] @ w2[e]`` and the saved |
|                             | h1, h3; a again (for w2's gradient)                      |
| `grouped_swiglu_input_grad` | ``dx[p] = dh1[p] @ w1[e] + dh3[p] @ w3[e]``              |
| `grouped_weight_grad`       | ``dw[e] = sum_{p in e} dy[p]^T x[rows[p]]`` (0 if empty) |

Permute and combine (`gather_rows`, `combine`, `combine_weight_grad`) live in
`fusedpar.kernels.moe_permute`. Every sum runs in a fixed order inside one program: no
floating-point atomics, so results are bitwise reproducible, and they do not depend on
the tile the tuner picks (see `BLOCK_K`, `WGRAD_BLOCK_M`). Accumulation is fp32. A
plain-PyTorch reference of each kernel closes the file.
"""

import torch
import triton
import triton.language as tl
from fusedpar.kernels import _impl, _tuning, moe_torch
from fusedpar.kernels._common import (
    check_float_dtype,
    check_launchable,
    device_guard,
    fp32_dot_precision,
    is_interpreted,
)
from fusedpar.kernels._tuning import bucket
from fusedpar.kernels.matmul import tile_of
from fusedpar.kernels.moe_permute import _check_index, _empty, _fit

# The K step of every grouped GEMM tile. Each output sums its K products in BLOCK_K
# chunks, in order; with one BLOCK_K for every config no pick changes the order of any
# sum, so results do not depend on the tuning (a gpu test forces each config and compares
# the bits; unverified until the first GPU run). Each expert runs on one EP rank, so the
# ranks tune on their own: no agreement collective.
BLOCK_K = 64
# The weight gradient sums over an expert's rows in chunks of this many: fixed for the
# same reason. 64 with a 128 x 128 output tile is the review's prediction (P8), unmeasured.
WGRAD_BLOCK_M = 64
# Row blocks that walk the same column blocks together, so their x tiles and the
# expert's weight tiles stay in L2 (the Triton tutorial's grouped order; P7).
GROUP_M = 8


def grouped_matmul_configs(mode: str = "plain") -> list[triton.Config]:
    """Tiles the tuner tries on a GPU for a mode of `_launch_gemm`, pruned to the rows per
    expert and N of a call.

    128-row tiles with 8 warps feed Hopper's wgmma; 64- and 32-row tiles serve experts
    with few rows (decode, many experts). The fused gate/up tile's BLOCK_N spans both
    weights (half its columns from w1, half from w3: one wgmma 2x as wide), in the
    shapes of vLLM's H100 entries for its fused w13: 128x256 with 8 warps for many rows
    per expert, down to 16-row tiles for few. The SwiGLU's backward holds da, g and u in
    its epilogue: the full-width tiles and 128x64 with 4 warps spill there (464-5480 B,
    resource gate), so it takes half-width 8-warp ones.
    """
    tiles = {
        # BLOCK_M, BLOCK_N, num_stages, num_warps
        "gate_up": [(128, 256, 4, 8), (128, 128, 3, 8), (64, 128, 4, 4), (32, 128, 4, 4),
                    (16, 64, 4, 4)],
        "swiglu_grad": [(128, 64, 3, 8), (128, 64, 4, 8), (64, 128, 3, 8), (64, 64, 4, 4),
                        (32, 64, 4, 4)],
    }.get(mode, [(128, 128, 3, 8), (128, 128, 4, 4), (128, 64, 4, 4), (64, 128, 4, 4),
                 (64, 64, 4, 4), (32, 64, 4, 4)])  # fmt: skip
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": BLOCK_K}, num_stages=s, num_warps=w)
        for bm, bn, s, w in tiles
    ]


def weight_grad_configs() -> list[triton.Config]:
    """Output tiles (N x K) of the weight gradient; the row step is `WGRAD_BLOCK_M`."""
    tiles = [(128, 128, 3, 8), (128, 128, 4, 4), (128, 64, 4, 4), (64, 128, 4, 4), (64, 64, 4, 4)]
    return [
        triton.Config(
            {"BLOCK_M": WGRAD_BLOCK_M, "BLOCK_N": bn, "BLOCK_K": bk}, num_stages=s, num_warps=w
        )  # fmt: skip
        for bn, bk, s, w in tiles
    ]


def _prune(configs, m: int, n: int, m_key="BLOCK_M", n_key="BLOCK_N"):
    """Drop tiles larger than the problem (m x n; they only waste lanes); keep at least one."""
    limit_m, limit_n = max(32, bucket(m)), max(32, bucket(n))
    kept = [c for c in configs if c.kwargs[m_key] <= limit_m and c.kwargs[n_key] <= limit_n]
    return kept or [min(configs, key=lambda c: c.kwargs[m_key] * c.kwargs[n_key])]


def _gemm_candidates(mode: str, rows_per_expert: int, N: int) -> list[triton.Config]:
    """The tiles for a call. The gate/up tile spans both weights: BLOCK_N is 2x the
    output columns it writes."""
    width = 2 * N if mode == "gate_up" else N
    if is_interpreted(_grouped_matmul_kernel):  # one small tile: fast, and crosses edges
        block_n = 2 * _fit(N, 32) if mode == "gate_up" else _fit(N, 64)
        return [triton.Config({"BLOCK_M": _fit(rows_per_expert, 32), "BLOCK_N": block_n,
                               "BLOCK_K": BLOCK_K})]  # fmt: skip
    return _prune(grouped_matmul_configs(mode), rows_per_expert, width)


def _weight_grad_candidates(N: int, K: int) -> list[triton.Config]:
    if is_interpreted(_grouped_weight_grad_kernel):
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": _fit(N, 64), "BLOCK_K": _fit(K, 64)})]
    return _prune(weight_grad_configs(), N, K, "BLOCK_N", "BLOCK_K")


# --- metadata ------------------------------------------------------------------------


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many entries of `ids` (any shape, values in [0, num_experts)) name each expert:
    (num_experts,) int64. A scatter-add, not `torch.bincount`, which reads the largest id
    back to the host on CUDA (a sync); integer adds are exact, so atomics do not matter."""
    flat = ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def dispatch_metadata(expert_ids: torch.Tensor, num_experts: int, keep: torch.Tensor | None = None):
    """Counts per expert and the stable expert-major order of the (token, slot) pairs.

    expert_ids (T, k) int; keep (T, k) bool or None (all kept). Returns ``counts`` (E,)
    int64 (kept pairs), ``order`` (T*k,) int64 (flat pair indices t * k + j, expert-major,
    by pair index within an expert, the dropped pairs last) and ``pos`` (T, k) int64, each
    pair's row in that order or -1 if dropped. No host sync: `order` keeps its full length
    and the kernels stop at ``offsets[E] = counts.sum()`` on the device.
    """
    flat = expert_ids.reshape(-1).to(torch.int64)
    if keep is not None:
        flat = torch.where(keep.reshape(-1), flat, num_experts)  # dropped pairs sort last
    counts = expert_counts(flat, num_experts + 1)[:num_experts]
    order = torch.argsort(flat, stable=True)
    pos = torch.empty_like(flat)
    pos[order] = torch.arange(flat.numel(), device=flat.device)
    if keep is not None:
        pos = torch.where(keep.reshape(-1), pos, -1)
    return counts, order, pos.view(expert_ids.shape)


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0))


# --- grouped GEMMs ----------------------------------------------------------------------


@triton.jit
def _k_loop(
    acc, x_ptrs, w_ptrs, row_mask, n_mask, K, stride_xk, w_step_k,
    EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """acc += x @ w over K; `w_step_k` is the weight tile's K stride (per column: the
    fused gate/up tile takes its columns from two tensors)."""
    offs_k = tl.arange(0, BLOCK_K)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x_mask = row_mask[:, None]
            w_mask = n_mask[None, :]
        else:
            k_mask = offs_k < K - k * BLOCK_K
            x_mask = row_mask[:, None] & k_mask[None, :]
            w_mask = k_mask[:, None] & n_mask[None, :]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        acc = tl.dot(x, tl.load(w_ptrs, mask=w_mask, other=0.0), acc,
                     input_precision=INPUT_PRECISION)  # fmt: skip
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * w_step_k
    return acc


@triton.jit
def _silu_mul(g, u):
    """silu(g) * u in fp32; the forward and the backward's recompute share it, bit for bit."""
    return g * tl.sigmoid(g) * u


@triton.jit
def _grouped_matmul_kernel(
    # pointers
    x_ptr, w_ptr, v_ptr, y_ptr, h_ptr, dh_ptr, rows_ptr, offsets_ptr, block_offsets_ptr,
    # strides
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_ve, stride_vn, stride_vk,
    stride_ym, stride_yn, stride_hm, stride_hn, stride_dhm, stride_dhn,
    # sizes
    N, K, E,
    # meta-parameters
    HAS_ROWS: tl.constexpr, GATE_UP: tl.constexpr, STORE_HIDDEN: tl.constexpr,
    SWIGLU_GRAD: tl.constexpr, SECOND_K: tl.constexpr, EVEN_K: tl.constexpr,
    E_PAD: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M, BLOCK_N) tile of ``acc = x[rows[p]] @ w[e].T`` for the rows p of one
    expert e, then by flag:

    | flag        | inputs                     | writes                                    |
    | ----------- | -------------------------- | ----------------------------------------- |
    | (none)      | x (R, K), w (E, N, K)      | y = acc                                   |
    | GATE_UP     | v (E, N, K): the up weight | y = silu(g) u; h = [g, u] if STORE_HIDDEN |
    |             | (one product over both)    |                                           |
    | SWIGLU_GRAD | acc = da; h = [g, u]       | dh = [da u silu'(g), da silu(g)]; y = silu(g) u |
    | SECOND_K    | x (P, 2K), v (E, N, K)     | y = x[:, :K] @ w[e].T + x[:, K:] @ v[e].T |

    Row block m of the concatenated per-expert blocks (`block_offsets`: the cumulative
    count of BLOCK_M blocks per expert) is found from the program id; programs past the
    last block exit, so the grid may be an upper bound known without a host sync.
    """
    # GATE_UP: each tile's BLOCK_N columns are OUT_N of w (g) then the same OUT_N of v
    # (u): one wgmma twice as wide as two dots over the same x tile (x read from shared
    # memory once per step, not twice), split in the epilogue.
    if GATE_UP:
        OUT_N: tl.constexpr = BLOCK_N // 2
    else:
        OUT_N: tl.constexpr = BLOCK_N
    # Grouped order (P7): GROUP_M row blocks walk the column blocks together, so a row
    # block's x tile is read from HBM once, not once per column block.
    num_pid_n = tl.cdiv(N, OUT_N)
    pid_m, pid_n = tile_of(tl.program_id(0), tl.num_programs(0) // num_pid_n, num_pid_n, GROUP_M)

    experts = tl.arange(0, E_PAD)
    ends = tl.load(block_offsets_ptr + 1 + experts, mask=experts < E, other=2**31 - 1)
    e = tl.sum((ends <= pid_m).to(tl.int32), 0)
    if e >= E:
        return
    first_block = tl.load(block_offsets_ptr + e)
    row_start = tl.load(offsets_ptr + e) + (pid_m - first_block) * BLOCK_M
    row_end = tl.load(offsets_ptr + e + 1)
    offs_m = row_start + tl.arange(0, BLOCK_M)  # int64: rows in expert order
    row_mask = offs_m < row_end
    src_rows = tl.load(rows_ptr + offs_m, mask=row_mask, other=0) if HAS_ROWS else offs_m
    offs_n = pid_n * OUT_N + tl.arange(0, OUT_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + src_rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_base = w_ptr + e.to(tl.int64) * stride_we
    v_base = v_ptr + e.to(tl.int64) * stride_ve
    if GATE_UP:
        cols = tl.arange(0, BLOCK_N)
        up = cols >= OUT_N
        col_n = (pid_n * OUT_N + cols % OUT_N).to(tl.int64)
        v_tile = v_base + col_n[None, :] * stride_vn + offs_k[:, None] * stride_vk
        w_tile = w_base + col_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        w_ptrs = tl.where(up[None, :], v_tile, w_tile)
        w_step_k = tl.where(up, stride_vk, stride_wk)[None, :]
        w_mask = col_n < N
    else:
        w_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
        w_step_k = stride_wk
        w_mask = n_mask
    v_ptrs = v_base + offs_n[None, :].to(tl.int64) * stride_vn + offs_k[:, None] * stride_vk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _k_loop(acc, x_ptrs, w_ptrs, row_mask, w_mask, K, stride_xk, w_step_k, EVEN_K,
                  INPUT_PRECISION, BLOCK_K)  # fmt: skip
    if SECOND_K:  # the columns K.. of x against v, into the same accumulator
        acc = _k_loop(acc, x_ptrs + K * stride_xk, v_ptrs, row_mask, n_mask, K, stride_xk,
                      stride_vk, EVEN_K, INPUT_PRECISION, BLOCK_K)  # fmt: skip

    out_dtype = y_ptr.dtype.element_ty
    mask = row_mask[:, None] & n_mask[None, :]
    rows64 = offs_m.to(tl.int64)[:, None]
    if GATE_UP:
        # g and u are rounded to the output dtype first, as PyTorch's h1 and h3 would be;
        # the backward recomputes a from these rounded values and gets the same bits.
        g, u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, OUT_N)), (0, 2, 1)))
        g = g.to(out_dtype)
        u = u.to(out_dtype)
        if STORE_HIDDEN:
            h_ptrs = h_ptr + rows64 * stride_hm + offs_n[None, :] * stride_hn
            tl.store(h_ptrs, g, mask=mask)
            tl.store(h_ptrs + N * stride_hn, u, mask=mask)
        acc = _silu_mul(g.to(tl.float32), u.to(tl.float32))
    if SWIGLU_GRAD:  # acc is da = d_out @ w2[e]; d silu(g) / dg = s (1 + g (1 - s))
        h_ptrs = h_ptr + rows64 * stride_hm + offs_n[None, :] * stride_hn
        g = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptrs + N * stride_hn, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        dh_ptrs = dh_ptr + rows64 * stride_dhm + offs_n[None, :] * stride_dhn
        dh_dtype = dh_ptr.dtype.element_ty
        tl.store(dh_ptrs, (acc * u * s * (1.0 + g * (1.0 - s))).to(dh_dtype), mask=mask)
        tl.store(dh_ptrs + N * stride_dhn, (acc * g * s).to(dh_dtype), mask=mask)
        acc = _silu_mul(g, u)
    tl.store(y_ptr + rows64 * stride_ym + offs_n[None, :] * stride_yn, acc.to(out_dtype),
             mask=mask)  # fmt: skip


@triton.jit
def _grouped_weight_grad_kernel(
    # pointers
    dy_ptr, x_ptr, dw_ptr, dv_ptr, rows_ptr, offsets_ptr,
    # strides
    stride_dym, stride_dyn, stride_xm, stride_xk, stride_we, stride_wn, stride_wk,
    # sizes
    N, K,
    # meta-parameters
    HAS_ROWS: tl.constexpr, SPLIT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_N, BLOCK_K) tile of ``dw[e] = sum_{p in e} dy[p]^T x[rows[p]]``, over
    the expert's rows in BLOCK_M steps. With SPLIT, dy is (P, 2N) and its columns N..
    give dv (the fused gate/up's two weight gradients in one launch, one gather of x).

    The expert is the slowest grid axis and the K tiles of one (expert, N tile) are
    adjacent (P8, scattermoe's grouped XtY): the programs running together share the
    expert's dy and x rows in L2 instead of streaming them once per tile.
    """
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_expert = tiles_k * tiles_n * (2 if SPLIT else 1)
    e = pid // per_expert
    pid_n = (pid % per_expert) // tiles_k
    pid_k = pid % tiles_k
    half = pid_n // tiles_n  # 1: the dv half of a SPLIT launch
    offs_n = (pid_n - half * tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    k_mask = offs_k < K
    dy_cols = (half * N + offs_n).to(tl.int64)  # 64-bit: a transposed dy or x has long
    x_cols = offs_k.to(tl.int64)  # column strides
    row_start = tl.load(offsets_ptr + e)
    row_end = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(row_start, row_end, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        row_mask = offs_m < row_end
        src_rows = tl.load(rows_ptr + offs_m, mask=row_mask, other=0) if HAS_ROWS else offs_m
        dy_ptrs = dy_ptr + offs_m.to(tl.int64)[:, None] * stride_dym + dy_cols[None, :] * stride_dyn
        dy = tl.load(dy_ptrs, mask=row_mask[:, None] & n_mask[None, :], other=0.0)
        x_ptrs = x_ptr + src_rows.to(tl.int64)[:, None] * stride_xm + x_cols[None, :] * stride_xk
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(tl.trans(dy), x, acc, input_precision=INPUT_PRECISION)
    out_ptr = dw_ptr
    if SPLIT and half == 1:
        out_ptr = dv_ptr
    out_ptrs = (out_ptr + e.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
                + offs_k[None, :] * stride_wk)  # fmt: skip
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


# --- launchers -------------------------------------------------------------------------


def _dot_precision(dtype: torch.dtype) -> str:
    return fp32_dot_precision() if dtype == torch.float32 else "tf32"


def _check_grouped(what, kernel, x, counts, rows, P, **weights):
    """x 2-D float; each weight ``name=(w, (N, K))`` is (E, N, K) in x's dtype, E =
    len(counts); counts (E,) int64; rows (P,) int64 or None; one device. Returns E."""
    if x.dim() != 2:
        raise ValueError(f"{what}: x must be 2-D, got {tuple(x.shape)}")
    check_float_dtype("x", x)
    if counts.dim() != 1 or counts.dtype != torch.int64:
        raise ValueError(f"{what}: counts must be int64 (E,), got {counts.dtype} "
                         f"{tuple(counts.shape)}")  # fmt: skip
    E = counts.shape[0]
    for name, (w, shape) in weights.items():
        if tuple(w.shape) != (E, *shape):
            raise ValueError(f"{what}: {name} must be {(E, *shape)} for x {tuple(x.shape)} and "
                             f"{E} experts, got {tuple(w.shape)}")  # fmt: skip
        if w.dtype != x.dtype:
            raise TypeError(f"{what}: x is {x.dtype} but {name} is {w.dtype}")
    _check_index("rows", rows, P, x.device)
    devices = {t.device for t in (x, counts, *(w for w, _ in weights.values()))}
    if len(devices) > 1:
        raise ValueError(f"{what}: all tensors must be on one device, got "
                         f"{sorted(map(str, devices))}")  # fmt: skip
    if not _impl.runs_torch(x.device):
        check_launchable(kernel, x, counts, *(w for w, _ in weights.values()))
    return E


def _weight_strides(w, transpose):
    """(expert, n, k) strides of w read as (E, N, K), or as (E, K, N) with `transpose`."""
    return (w.stride(0), w.stride(2), w.stride(1)) if transpose else tuple(w.stride())


def _launch_gemm(mode, x, w, y, counts, rows, N, K, *, w_strides, v=None, v_strides=None,
                 h=None, dh=None):  # fmt: skip
    """Tune (per mode, N, K, rows-per-expert bucket, dtypes) and launch the grouped GEMM.
    The grid depends on BLOCK_M (blocks never straddle two experts), so each config
    builds its own block offsets; its size is an upper bound, cdiv(P, BLOCK_M) + E row
    blocks, so no count is read back to the host."""
    P, E = y.shape[0], counts.shape[0]
    if P == 0 or N == 0:
        return
    offsets = _offsets(counts)
    block_offsets = {}
    args = (x, w, w if v is None else v, y, y if h is None else h, y if dh is None else dh,
            offsets if rows is None else rows, offsets)  # fmt: skip
    strides = (*x.stride(), *w_strides, *(v_strides or w_strides), *y.stride(),
               *(h.stride() if h is not None else (0, 0)),
               *(dh.stride() if dh is not None else (0, 0)))  # fmt: skip
    meta = dict(HAS_ROWS=rows is not None, GATE_UP=mode == "gate_up",
                STORE_HIDDEN=mode == "gate_up" and h is not None,
                SWIGLU_GRAD=mode == "swiglu_grad", SECOND_K=mode == "second_k",
                EVEN_K=K % BLOCK_K == 0, E_PAD=triton.next_power_of_2(E + 1),
                INPUT_PRECISION=_dot_precision(x.dtype), GROUP_M=GROUP_M)  # fmt: skip

    def launch(config):
        bm = config.kwargs["BLOCK_M"]
        if bm not in block_offsets:
            block_offsets[bm] = _offsets((counts + bm - 1) // bm)
        out_n = config.kwargs["BLOCK_N"] // (2 if mode == "gate_up" else 1)
        grid = ((triton.cdiv(P, bm) + E) * triton.cdiv(N, out_n),)
        _grouped_matmul_kernel[grid](*args, block_offsets[bm], *strides, N, K, E, **meta,
                                     **config.all_kwargs())  # fmt: skip

    per_expert = triton.cdiv(P, max(E, 1))
    key = (mode, meta["STORE_HIDDEN"], N, K, bucket(per_expert), str(x.dtype), str(y.dtype),
           rows is not None, meta["INPUT_PRECISION"])  # fmt: skip
    with device_guard(x):
        _tuning.tuner("grouped_matmul").run(
            key, lambda: _gemm_candidates(mode, per_expert, N), launch, device=x.device
        )


def grouped_matmul(x, w, counts, rows=None, *, out_dtype=None, transpose_w=False):
    """``y[p] = x[rows[p]] @ w[e].T`` (``@ w[e]`` with `transpose_w`) over expert groups.

    x (R, K) any strides; w (E, N, K) (or (E, K, N) with `transpose_w`); counts (E,)
    int64, summing to at most P; rows (P,) int64 or None (x is already in expert order,
    P = R). Returns y (P, N) in `out_dtype` (x's by default), rows in expert order; rows
    past ``counts.sum()`` are left unwritten.
    """
    if w.dim() != 3:
        raise ValueError(f"grouped_matmul: w must be (E, N, K), got {tuple(w.shape)}")
    N = w.shape[2] if transpose_w else w.shape[1]
    K = x.shape[-1]
    P = x.shape[0] if rows is None else rows.shape[0]
    _check_grouped("grouped_matmul", _grouped_matmul_kernel, x, counts, rows, P,
                   w=(w, (K, N) if transpose_w else (N, K)))  # fmt: skip
    y = _empty((P, N), out_dtype or x.dtype, x.device)
    if _impl.runs_torch(x.device):
        moe_torch.grouped_matmul(x, w, counts, rows, y, transpose_w)
        return y
    _launch_gemm("plain", x, w, y, counts, rows, N, K, w_strides=_weight_strides(w, transpose_w))
    return y


def grouped_swiglu(x, w1, w3, counts, rows=None, *, save_hidden=True):
    """The experts' gate and up projections as one grouped GEMM with the SwiGLU in its
    epilogue: ``a[p] = silu(h1[p]) * h3[p]``, ``h1 = x[rows[p]] @ w1[e].T``, ``h3 = x[rows[p]]
    @ w3[e].T``. Each x tile is gathered once for both weights.

    x (R, d); w1, w3 (E, h, d); counts, rows as in `grouped_matmul`. Returns ``(a, h13)``:
    a (P, h) and, with `save_hidden`, h13 (P, 2h) = [h1 | h3] in x's dtype (what the
    backward needs), else None. a is computed from h1 and h3 rounded to x's dtype, as
    PyTorch's ``silu(h1) * h3`` would be, so `grouped_swiglu_backward` recomputes it
    bit for bit.
    """
    h, d = w1.shape[1:] if w1.dim() == 3 else (0, x.shape[-1])
    P = x.shape[0] if rows is None else rows.shape[0]
    _check_grouped("grouped_swiglu", _grouped_matmul_kernel, x, counts, rows, P,
                   w1=(w1, (h, x.shape[-1])), w3=(w3, (h, x.shape[-1])))  # fmt: skip
    a = _empty((P, h), x.dtype, x.device)
    h13 = _empty((P, 2 * h), x.dtype, x.device) if save_hidden else None
    if _impl.runs_torch(x.device):
        moe_torch.grouped_swiglu(x, w1, w3, counts, rows, a, h13)
        return a, h13
    _launch_gemm("gate_up", x, w1, a, counts, rows, h, d, w_strides=tuple(w1.stride()), v=w3,
                 v_strides=tuple(w3.stride()), h=h13)  # fmt: skip
    return a, h13


def grouped_swiglu_backward(d_out, w2, h13, counts):
    """From the gradient of the experts' outputs, the gradients of h1 and h3, and a again.

    d_out (P, d) in expert order; w2 (E, d, h); h13 (P, 2h) from `grouped_swiglu`.
    Returns ``(d_h13, a)``: d_h13 (P, 2h) = [dh1 | dh3] with ``da = d_out[p] @ w2[e]``,
    ``dh1 = da * h3 * silu'(h1)``, ``dh3 = da * silu(h1)``, and a (P, h) = silu(h1) * h3
    (for w2's gradient), all in d_out's dtype, from one grouped GEMM.
    """
    d = w2.shape[1] if w2.dim() == 3 else -1
    P, h = d_out.shape[0], h13.shape[-1] // 2
    if h13.shape != (P, 2 * h) or h13.dtype != d_out.dtype:
        raise ValueError(f"grouped_swiglu_backward: h13 must be {d_out.dtype} ({P}, 2h) "
                         f"for d_out {tuple(d_out.shape)}, got {h13.dtype} "
                         f"{tuple(h13.shape)}")  # fmt: skip
    _check_grouped("grouped_swiglu_backward", _grouped_matmul_kernel, d_out, counts, None, P,
                   w2=(w2, (d_out.shape[-1], h)))  # fmt: skip
    a = _empty((P, h), d_out.dtype, d_out.device)
    d_h13 = _empty((P, 2 * h), d_out.dtype, d_out.device)
    if _impl.runs_torch(d_out.device):
        moe_torch.grouped_swiglu_backward(d_out, w2, h13, counts, d_h13, a)
        return d_h13, a
    _launch_gemm("swiglu_grad", d_out, w2, a, counts, None, h, d,
                 w_strides=_weight_strides(w2, True), h=h13, dh=d_h13)  # fmt: skip
    return d_h13, a


def grouped_swiglu_input_grad(d_h13, w1, w3, counts):
    """``dx[p] = dh1[p] @ w1[e] + dh3[p] @ w3[e]``: (P, d), one grouped GEMM over both
    halves of d_h13 (P, 2h) = [dh1 | dh3]; w1, w3 (E, h, d). Rows in expert order (sum
    them back onto tokens with `combine`)."""
    d = w1.shape[-1]
    h = d_h13.shape[-1] // 2
    if d_h13.shape[-1] % 2:
        raise ValueError(f"grouped_swiglu_input_grad: d_h13 must be (P, 2h), got "
                         f"{tuple(d_h13.shape)}")  # fmt: skip
    _check_grouped("grouped_swiglu_input_grad", _grouped_matmul_kernel, d_h13, counts, None,
                   d_h13.shape[0], w1=(w1, (h, d)), w3=(w3, (h, d)))  # fmt: skip
    dx = _empty((d_h13.shape[0], d), d_h13.dtype, d_h13.device)
    if _impl.runs_torch(dx.device):
        moe_torch.grouped_swiglu_input_grad(d_h13, w1, w3, counts, dx)
        return dx
    _launch_gemm("second_k", d_h13, w1, dx, counts, None, d, h,
                 w_strides=_weight_strides(w1, True), v=w3,
                 v_strides=_weight_strides(w3, True))  # fmt: skip
    return dx


def grouped_weight_grad(dy, x, counts, rows=None, *, out_dtype=None, split=False):
    """``dw[e] = sum_{p in e} dy[p]^T x[rows[p]]``: (E, N, K), zero for an empty expert.

    dy (P, N) in expert order; x (R, K); counts (E,) int64; rows (P,) int64 or None (then
    R = P). With `split`, dy is (P, 2N) and the result is the pair ``(dw, dv)`` of
    (E, N, K) from its two column halves (the fused gate/up's weights), in one launch.
    """
    if dy.dim() != 2 or (split and dy.shape[1] % 2) or dy.dtype != x.dtype:
        shape = "(P, 2N)" if split else "(P, N)"
        raise ValueError(f"grouped_weight_grad: dy must be {x.dtype} {shape}, got {dy.dtype} "
                         f"{tuple(dy.shape)}")  # fmt: skip
    if rows is None and x.shape[0] != dy.shape[0]:
        raise ValueError(f"grouped_weight_grad: without rows x must have dy's {dy.shape[0]} "
                         f"rows, got {tuple(x.shape)}")  # fmt: skip
    P, N = dy.shape[0], dy.shape[1] // (2 if split else 1)
    E = _check_grouped("grouped_weight_grad", _grouped_weight_grad_kernel, x, counts, rows, P)
    K = x.shape[1]
    outs = [_empty((E, N, K), out_dtype or x.dtype, x.device) for _ in range(2 if split else 1)]
    if _impl.runs_torch(x.device):
        moe_torch.grouped_weight_grad(dy, x, counts, rows, outs)
        return tuple(outs) if split else outs[0]
    check_launchable(_grouped_weight_grad_kernel, dy, x)
    if outs[0].numel() == 0:
        return tuple(outs) if split else outs[0]
    offsets = _offsets(counts)
    args = (dy, x, outs[0], outs[-1], offsets if rows is None else rows, offsets,
            *dy.stride(), *x.stride(), *outs[0].stride(), N, K)  # fmt: skip
    meta = dict(HAS_ROWS=rows is not None, SPLIT=split, INPUT_PRECISION=_dot_precision(x.dtype))

    def launch(config):
        tiles = triton.cdiv(N, config.kwargs["BLOCK_N"]) * triton.cdiv(K, config.kwargs["BLOCK_K"])
        _grouped_weight_grad_kernel[(E * tiles * len(outs),)](*args, **meta, **config.all_kwargs())

    key = (split, N, K, bucket(triton.cdiv(P, E)), str(x.dtype), str(outs[0].dtype),
           rows is not None, meta["INPUT_PRECISION"])  # fmt: skip
    with device_guard(x):
        _tuning.tuner("grouped_weight_grad").run(
            key, lambda: _weight_grad_candidates(N, K), launch, device=x.device
        )
    return tuple(outs) if split else outs[0]


# --- references (plain PyTorch, in the inputs' dtype: float64 in -> the oracle) -----------


def grouped_matmul_reference(x, w, counts, rows=None, transpose_w=False):
    """`grouped_matmul` as a loop over experts; rows past ``counts.sum()`` are left out."""
    xs = x if rows is None else x[rows]
    slices = moe_torch.expert_slices(counts)
    outs = [xs[s] @ (w[e] if transpose_w else w[e].T) for e, s in enumerate(slices)]
    return torch.cat(outs) if outs else xs.new_empty((0, w.shape[2 if transpose_w else 1]))


def expert_swiglu_reference(x, w1, w3, w2, counts, rows=None):
    """``w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))`` per expert (differentiable): the kept
    rows, (counts.sum(), d)."""
    h1 = grouped_matmul_reference(x, w1, counts, rows)
    h3 = grouped_matmul_reference(x, w3, counts, rows)
    return grouped_matmul_reference(torch.nn.functional.silu(h1) * h3, w2, counts)


def grouped_weight_grad_reference(dy, x, counts, rows=None):
    """`grouped_weight_grad` as a loop: (E, N, K), zeros for an empty expert."""
    xs = x if rows is None else x[rows]
    return torch.stack([dy[s].T @ xs[s] for s in moe_torch.expert_slices(counts)])
