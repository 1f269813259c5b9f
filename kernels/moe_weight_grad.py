"""The MoE experts' weight gradients: ``dw[e] = sum_{p in e} dy[p]^T x[rows[p]]`` per
expert (0 if it has no row), and, asked, the bias's ``db[e] = sum_{p in e} dy[p]``.

Rows follow `fusedpar.kernels.moe`'s expert-major order (the same `offsets`); with
``split`` one launch takes both halves of the fused gate/up's dy. Each output tile sums
its expert's rows in `WGRAD_BLOCK_M` steps, in order, inside one program: no atomics, and
the bits do not depend on the tile the tuner picks. Accumulation is fp32. The
plain-PyTorch references close the file.
"""

import torch
import triton
import triton.language as tl
from fusedpar.kernels import common, impl, moe_torch, tuning
from fusedpar.kernels.common import check_launchable, device_guard, is_interpreted
from fusedpar.kernels.moe import _check_grouped, _dot_precision, _prune
from fusedpar.kernels.moe_permute import _empty, _fit, offsets
from fusedpar.kernels.tuning import bucket

# The weight gradient sums over an expert's rows in chunks of this many, one for every
# config, so no pick changes the order of a sum (as `moe.BLOCK_K` for the GEMMs). 64
# with a 128 x 128 output tile is the review's prediction (P8), unmeasured.
WGRAD_BLOCK_M = 64


def weight_grad_configs() -> list[triton.Config]:
    """Output tiles (N x K) of the weight gradient; the row step is `WGRAD_BLOCK_M`."""
    tiles = [(128, 128, 3, 8), (128, 128, 4, 4), (128, 64, 4, 4), (64, 128, 4, 4), (64, 64, 4, 4)]
    return [
        triton.Config(
            {"BLOCK_M": WGRAD_BLOCK_M, "BLOCK_N": bn, "BLOCK_K": bk}, num_stages=s, num_warps=w
        )  # fmt: skip
        for bn, bk, s, w in tiles
    ]


def _weight_grad_candidates(N: int, K: int) -> list[triton.Config]:
    if is_interpreted(_grouped_weight_grad_kernel):
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": _fit(N, 64), "BLOCK_K": _fit(K, 64)})]
    return _prune(weight_grad_configs(), N, K, "BLOCK_N", "BLOCK_K")


# --- kernel ---------------------------------------------------------------------------


@triton.jit
def _grouped_weight_grad_kernel(
    # pointers
    dy_ptr, x_ptr, dw_ptr, dv_ptr, db_ptr, dbv_ptr, rows_ptr, offsets_ptr,
    # strides
    stride_dym, stride_dyn, stride_xm, stride_xk, stride_we, stride_wn, stride_wk,
    # sizes
    N, K,
    # meta-parameters
    HAS_ROWS: tl.constexpr, SPLIT: tl.constexpr, BIAS_GRAD: tl.constexpr,
    BIAS_BLOCK_M: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_N, BLOCK_K) tile of ``dw[e] = sum_{p in e} dy[p]^T x[rows[p]]``, over
    the expert's rows in BLOCK_M steps. With SPLIT, dy is (P, 2N) and its columns N..
    give dv (the fused gate/up's two weight gradients in one launch, one gather of x).
    With BIAS_GRAD the programs of the first K tile then also write the bias gradient
    ``db[e] = sum_{p in e} dy[p]`` (dbv from the columns N.. with SPLIT), (E, N)
    contiguous, after their own tile: the GEMM loop is the same with or without it.

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
    if BIAS_GRAD:  # noqa: SIM102 (a constexpr test alone: the code goes when it is off)
        if pid_k == 0:
            # dy^T times a block of ones: the tensor-core sums of dw (db is dw for an x
            # column of ones), 16 rows per MMA step in order, fp32, no atomics: the
            # bits depend on the tile no more than dw's do. BIAS_BLOCK_M rows per iteration:
            # the same sum as BLOCK_M's (a row step is whole MMA steps), half the MMA
            # of the GEMM loop's iteration. The expert's dy rows were just read by this
            # program and its neighbours: mostly from L2.
            ones = tl.full((BIAS_BLOCK_M, 16), 1.0, dy_ptr.dtype.element_ty)
            acc_b = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
            for start in range(row_start, row_end, BIAS_BLOCK_M):
                offs_m = start + tl.arange(0, BIAS_BLOCK_M)
                row_mask = offs_m < row_end
                dy_ptrs = (dy_ptr + offs_m.to(tl.int64)[:, None] * stride_dym
                           + dy_cols[None, :] * stride_dyn)  # fmt: skip
                dy = tl.load(dy_ptrs, mask=row_mask[:, None] & n_mask[None, :], other=0.0)
                acc_b = tl.dot(tl.trans(dy), ones, acc_b, input_precision=INPUT_PRECISION)
            first = tl.arange(0, 16)[None, :] == 0
            db = tl.sum(tl.where(first, acc_b, 0.0), 1)  # column 0 (the others are equal)
            b_out = db_ptr
            if SPLIT and half == 1:
                b_out = dbv_ptr
            tl.store(b_out + e.to(tl.int64) * N + offs_n, db.to(b_out.dtype.element_ty),
                     mask=n_mask)  # fmt: skip


# --- launcher -------------------------------------------------------------------------


def grouped_weight_grad(dy, x, counts, rows=None, *, out_dtype=None, split=False,
                        bias_grad=False):  # fmt: skip
    """``dw[e] = sum_{p in e} dy[p]^T x[rows[p]]``: (E, N, K), zero for an empty expert.

    dy (P, N) in expert order; x (R, K); counts (E,) int64; rows (P,) int32/64 or None (then
    R = P). With `split`, dy is (P, 2N) and the result is the pair ``(dw, dv)`` of
    (E, N, K) from its two column halves (the fused gate/up's weights), in one launch.
    With `bias_grad`, the biases' gradients follow the weights': ``db[e] = sum_{p in e}
    dy[p]`` (E, N) (``(dw, db)``, or ``(dw, dv, db, dbv)`` with `split`), summed in fp32
    by the same launch, zero for an empty expert.
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
    if bias_grad and K == 0:  # the kernel's first K tile sums the biases: there is none
        raise ValueError("grouped_weight_grad: bias_grad needs x with columns, got "
                         f"{tuple(x.shape)}")  # fmt: skip
    halves = 2 if split else 1
    dtype = out_dtype or x.dtype
    outs = [_empty((E, N, K), dtype, x.device) for _ in range(halves)]
    bias_outs = [_empty((E, N), dtype, x.device) for _ in range(halves if bias_grad else 0)]

    def result():
        return (*outs, *bias_outs) if split or bias_grad else outs[0]

    if impl.runs_torch(x):
        moe_torch.grouped_weight_grad(dy, x, counts, rows, outs, bias_outs)
        return result()
    check_launchable(_grouped_weight_grad_kernel, dy, x)
    if outs[0].numel() == 0:
        return result()
    expert_starts = offsets(counts)
    biases = bias_outs or [outs[0]]  # unused without bias_grad
    args = (dy, x, outs[0], outs[-1], biases[0], biases[-1],
            expert_starts if rows is None else rows, expert_starts, *dy.stride(), *x.stride(),
            *outs[0].stride(), N, K)  # fmt: skip
    meta = dict(HAS_ROWS=rows is not None, SPLIT=split, BIAS_GRAD=bias_grad,
                BIAS_BLOCK_M=WGRAD_BLOCK_M // 2,
                INPUT_PRECISION=_dot_precision(x.dtype))  # fmt: skip

    def launch(config, kwargs=None):
        tiles = common.cdiv(N, config.kwargs["BLOCK_N"]) * common.cdiv(K, config.kwargs["BLOCK_K"])
        kwargs = kwargs or {**meta, **config.all_kwargs()}
        _grouped_weight_grad_kernel[(E * tiles * halves,)](*args, **kwargs)

    # the key holds every flag of `meta`: a settled pick's keywords serve the whole key
    key = (split, bias_grad, N, K, bucket(common.cdiv(P, E)), str(x.dtype), str(dtype),
           rows is not None, meta["INPUT_PRECISION"])  # fmt: skip
    tuner, settled = tuning.tuner("grouped_weight_grad"), _SETTLED.get(key)
    with device_guard(x):
        if settled is not None and tuner.settled(key) is settled[0]:
            launch(*settled)  # the pick made: its keywords kept
            return result()
        config = tuner.run(key, lambda: _weight_grad_candidates(N, K), launch, device=x.device)
    if len(_SETTLED) >= 4096:
        _SETTLED.clear()
    _SETTLED[key] = (config, {**meta, **config.all_kwargs()})
    return result()


# the tuner's key -> (its settled pick, the launch's keywords for it)
_SETTLED: dict[tuple, tuple] = {}


# --- references (plain PyTorch, in the inputs' dtype: float64 in -> the oracle) -----------


def grouped_weight_grad_reference(dy, x, counts, rows=None):
    """`grouped_weight_grad` as a loop: (E, N, K), zeros for an empty expert."""
    xs = x if rows is None else x[rows]
    return torch.stack([dy[s].T @ xs[s] for s in moe_torch.expert_slices(counts)])


def expert_sums_reference(dy, counts):
    """`grouped_weight_grad`'s bias gradient as a loop: (E, N), zeros for an empty expert."""
    return torch.stack([dy[s].sum(0) for s in moe_torch.expert_slices(counts)])
