"""Mixture-of-experts: the grouped expert GEMMs over tokens dispatched to experts.

Each of T tokens goes to k experts: P = T * k (token, slot) pairs in a stable expert-major
order; expert e owns rows ``offsets[e]:offsets[e + 1]``; pairs a capacity limit drops sort
last, past ``offsets[E]``, where no kernel reads or writes (no count reaches the host).

| function                    | computes                                                        |
| --------------------------- | --------------------------------------------------------------- |
| `grouped_matmul`            | ``y[p] = x[rows[p]] @ w[e].T (+ b[e])`` (the gather in the      |
|                             | loads, the bias in the epilogue)                                |
| `grouped_swiglu`            | ``a = act(h1, h3)`` (`ACTIVATIONS`), h1 and h3 being            |
|                             | ``x[rows[p]] @ w1[e].T, w3[e].T (+ b1[e], b3[e])``, one product |
| `grouped_swiglu_backward`   | ``dh1, dh3`` from ``da = d_out[p] @ w2[e]`` and the saved h1,   |
|                             | h3; a again (for w2's gradient)                                 |
| `grouped_swiglu_input_grad` | ``dx[p] = dh1[p] @ w1[e] + dh3[p] @ w3[e]``                     |

The weights' gradients are `fusedpar.kernels.moe_weight_grad`'s; the metadata, permute and
combine `fusedpar.kernels.moe_permute`'s. Sums accumulate in fp32 in a fixed order inside
one program (no atomics: bitwise reproducible, whatever tile the tuner picks: `BLOCK_K`);
references in `fusedpar.kernels.moe_reference`. Layout and why: docs/expert_parallel.md.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from fusedpar.kernels import common, impl, moe_torch, tuning
from fusedpar.kernels.common import (
    check_float_dtype,
    check_launchable,
    device_guard,
    fp32_dot_precision,
    is_interpreted,
)
from fusedpar.kernels.matmul import tile_of
from fusedpar.kernels.moe_permute import _check_index, _empty, _fit, offsets
from fusedpar.kernels.tuning import bucket

# The K step of every grouped GEMM tile. Each output sums its K products in BLOCK_K
# chunks, in order; with one BLOCK_K for every config no pick changes the order of any
# sum, so results do not depend on the tuning (a gpu test forces each config and compares
# the bits; unverified until the first GPU run). Each expert runs on one EP rank, so the
# ranks tune on their own: no agreement collective.
BLOCK_K = 64
# Row blocks that walk the same column blocks together, so their x tiles and the
# expert's weight tiles stay in L2 (the Triton tutorial's grouped order; P7).
GROUP_M = 8


# The experts' activations (`_swiglu`): SwiGLU, ``silu(g) * u``, and gpt-oss's clamped
# SwiGLU, ``(u' + 1) * g' * sigmoid(alpha * g')`` with ``g' = min(g, limit)``,
# ``u' = clamp(u, -limit, limit)``; alpha and limit default to gpt-oss's.
ACTIVATIONS = ("silu", "clamped_swiglu")
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def check_activation(activation: str, alpha: float, limit: float) -> None:
    """ValueError unless `activation` is one of `ACTIVATIONS` and alpha, limit are
    positive finite numbers."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, value in (("swiglu_alpha", alpha), ("swiglu_limit", limit)):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (math.isfinite(value) and value > 0)
        ):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")


class Swiglu(NamedTuple):
    """The experts' activation as one value, from the layer down to the kernel's flags:
    `kind` one of `ACTIVATIONS`, and the clamped SwiGLU's `alpha` and `limit` (the
    launchers check it: `check_activation`)."""

    kind: str = "silu"
    alpha: float = SWIGLU_ALPHA
    limit: float = SWIGLU_LIMIT


SILU = Swiglu()


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
def _swiglu(g, u, alpha, limit, CLAMPED: tl.constexpr):
    """The experts' activation in fp32; the forward and the backward's recompute share it,
    bit for bit: ``silu(g) * u``, or with CLAMPED gpt-oss's ``g' sigmoid(alpha g') (u' +
    1)``, ``g' = min(g, limit)``, ``u' = clamp(u, -limit, limit)``."""
    if CLAMPED:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        a = g * tl.sigmoid(alpha * g) * (u + 1.0)
    else:
        a = g * tl.sigmoid(g) * u
    return a


@triton.jit
def _swiglu_grad(da, g, u, alpha, limit, CLAMPED: tl.constexpr):
    """``(dg, du)`` of `_swiglu` from ``da``. silu: ``d silu(g) / dg = s (1 + g (1 - s))``,
    s = sigmoid(g). CLAMPED, with s = sigmoid(alpha g'): ``dg = da (u' + 1) s (1 + alpha
    g' (1 - s))`` where g <= limit, ``du = da g' s`` where -limit <= u <= limit, 0
    elsewhere (torch.clamp's convention: a value on a bound passes the gradient).

    The clamps' masks go into two copies of da first, so g and u die before g', u' and s
    are formed: the backward's epilogue holds da, g and u at once and sits at 255
    registers; masking the products at the end spilled 16-48 B (resource gate)."""
    if CLAMPED:
        da_g = tl.where(g <= limit, da, 0.0)
        da_u = tl.where((u >= -limit) & (u <= limit), da, 0.0)
        g = tl.minimum(g, limit)
        u1 = tl.minimum(tl.maximum(u, -limit), limit) + 1.0
        s = tl.sigmoid(alpha * g)
        dg = da_g * u1 * s * (1.0 + alpha * g * (1.0 - s))
        du = da_u * g * s
    else:
        s = tl.sigmoid(g)
        dg = da * u * s * (1.0 + g * (1.0 - s))
        du = da * g * s
    return dg, du


@triton.jit
def _grouped_matmul_kernel(
    # pointers
    x_ptr, w_ptr, v_ptr, y_ptr, h_ptr, dh_ptr, b_ptr, bv_ptr, rows_ptr, offsets_ptr,
    block_offsets_ptr,
    # strides
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_ve, stride_vn, stride_vk,
    stride_ym, stride_yn, stride_hm, stride_hn, stride_dhm, stride_dhn,
    # sizes, and the clamped SwiGLU's alpha and limit
    N, K, E, alpha, limit,
    # meta-parameters
    HAS_ROWS: tl.constexpr, GATE_UP: tl.constexpr, STORE_HIDDEN: tl.constexpr,
    SWIGLU_GRAD: tl.constexpr, SECOND_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    CLAMPED: tl.constexpr, EVEN_K: tl.constexpr,
    E_PAD: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M, BLOCK_N) tile of ``acc = x[rows[p]] @ w[e].T`` for the rows p of one
    expert e, then by flag:

    | flag        | inputs                     | writes                                    |
    | ----------- | -------------------------- | ----------------------------------------- |
    | (none)      | x (R, K), w (E, N, K)      | y = acc                                   |
    | GATE_UP     | v (E, N, K): the up weight | y = act(g, u); h = [g, u] if STORE_HIDDEN |
    |             | (one product over both)    |                                           |
    | SWIGLU_GRAD | acc = da; h = [g, u]       | dh = [dg, du] (`_swiglu_grad`); y = act(g, u) |
    | SECOND_K    | x (P, 2K), v (E, N, K)     | y = x[:, :K] @ w[e].T + x[:, K:] @ v[e].T |

    HAS_BIAS (with none or GATE_UP): ``acc += b[e]`` (b (E, N) contiguous; GATE_UP: g gets
    b[e], u gets bv[e]) in fp32 before anything is rounded. act is `_swiglu`: silu(g) u,
    or with CLAMPED gpt-oss's clamped SwiGLU (runtime `alpha`, `limit`).

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
    if HAS_BIAS:  # b[e] in fp32, before any rounding (a gate/up tile: b[e] | bv[e])
        bias_row = e.to(tl.int64) * N
        if GATE_UP:
            b_ptrs = tl.where(up, bv_ptr + bias_row + col_n, b_ptr + bias_row + col_n)
            b_mask = col_n < N
        else:
            b_ptrs = b_ptr + bias_row + offs_n
            b_mask = n_mask
        acc += tl.load(b_ptrs, mask=b_mask, other=0.0).to(tl.float32)[None, :]

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
        acc = _swiglu(g.to(tl.float32), u.to(tl.float32), alpha, limit, CLAMPED)
    if SWIGLU_GRAD:  # acc is da = d_out @ w2[e]
        h_ptrs = h_ptr + rows64 * stride_hm + offs_n[None, :] * stride_hn
        g = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptrs + N * stride_hn, mask=mask, other=0.0).to(tl.float32)
        dg, du = _swiglu_grad(acc, g, u, alpha, limit, CLAMPED)
        dh_ptrs = dh_ptr + rows64 * stride_dhm + offs_n[None, :] * stride_dhn
        dh_dtype = dh_ptr.dtype.element_ty
        tl.store(dh_ptrs, dg.to(dh_dtype), mask=mask)
        tl.store(dh_ptrs + N * stride_dhn, du.to(dh_dtype), mask=mask)
        acc = _swiglu(g, u, alpha, limit, CLAMPED)
    tl.store(y_ptr + rows64 * stride_ym + offs_n[None, :] * stride_yn, acc.to(out_dtype),
             mask=mask)  # fmt: skip


# --- launchers -------------------------------------------------------------------------


def _dot_precision(dtype: torch.dtype) -> str:
    return fp32_dot_precision() if dtype == torch.float32 else "tf32"


def _check_grouped(what, kernel, x, counts, rows, P, **weights):
    """x 2-D float; each weight ``name=(w, (N, K))`` is (E, N, K) in x's dtype, E =
    len(counts); counts (E,) int64; rows (P,) int32/64 or None; one device. Returns E."""
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
    tensors = (x, counts, *(w for w, _ in weights.values()))
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"{what}: all tensors must be on one device, got "
                         f"{sorted({str(t.device) for t in tensors})}")  # fmt: skip
    if not impl.runs_torch(x):
        check_launchable(kernel, x)  # one device: checked above
    return E


def _weight_strides(w, transpose):
    """(expert, n, k) strides of w read as (E, N, K), or as (E, K, N) with `transpose`."""
    return (w.stride(0), w.stride(2), w.stride(1)) if transpose else tuple(w.stride())


class _GemmCall(NamedTuple):
    """A grouped GEMM's kind of call, one value from a launcher to its plan: `mode` (the
    kernel's flags: ``"plain"``, ``"gate_up"``, ``"swiglu_grad"``, ``"second_k"``), the
    N output columns over K, whether the weights are read as (E, K, N) (`transpose`),
    and the SwiGLU's activation (gate_up, swiglu_grad)."""

    mode: str
    N: int
    K: int
    transpose: bool = False
    act: Swiglu = SILU


@dataclass
class _GemmPlan:
    """What a grouped GEMM launch works out on its signature's first call (~5 µs of a
    launch's ~20 on the host), and once the tuner's pick is settled the launch's grid
    and keywords for it."""

    strides: tuple
    meta: dict
    scalars: tuple  # N, K, E, alpha, limit
    key: tuple  # the tuner's
    per_expert: int  # rows per expert, rounded up
    settled: tuple | None = None  # (the pick, its grid, its keywords)

    def launch_arguments(self, config, P: int, out_split: int) -> tuple[tuple, dict]:
        N, E = self.scalars[0], self.scalars[2]
        bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"] // out_split
        grid = ((common.cdiv(P, bm) + E) * common.cdiv(N, bn),)
        return grid, {**self.meta, **config.all_kwargs()}


# (call, layouts, sizes, flags) -> its plan
_GEMM_PLANS: dict[tuple, _GemmPlan] = {}


def _gemm_plan(call: _GemmCall, x, weights, y, hidden, E, has_rows, has_bias) -> _GemmPlan:
    """`call`'s plan for these operands: `weights` (w,) or (w, v), `hidden` (h, dh)."""
    (mode, N, K, transpose, act), (h, dh) = call, hidden
    w_strides = tuple(_weight_strides(w, transpose) for w in weights)
    signature = (call, x.stride(), x.dtype, w_strides, y.shape, y.stride(), y.dtype,
                 h is not None and h.stride(), dh is not None and dh.stride(), E, has_rows,
                 has_bias, torch.get_float32_matmul_precision())  # fmt: skip
    plan = _GEMM_PLANS.get(signature)
    if plan is not None:
        return plan
    strides = (*x.stride(), *w_strides[0], *w_strides[-1], *y.stride(),
               *(h.stride() if h is not None else (0, 0)),
               *(dh.stride() if dh is not None else (0, 0)))  # fmt: skip
    meta = dict(HAS_ROWS=has_rows, GATE_UP=mode == "gate_up",
                STORE_HIDDEN=mode == "gate_up" and h is not None,
                SWIGLU_GRAD=mode == "swiglu_grad", SECOND_K=mode == "second_k",
                HAS_BIAS=has_bias, CLAMPED=act.kind == "clamped_swiglu",
                EVEN_K=K % BLOCK_K == 0, E_PAD=common.next_power_of_2(E + 1),
                INPUT_PRECISION=_dot_precision(x.dtype), GROUP_M=GROUP_M)  # fmt: skip
    per_expert = common.cdiv(y.shape[0], max(E, 1))
    key = (mode, meta["STORE_HIDDEN"], has_bias, meta["CLAMPED"], N, K, bucket(per_expert),
           str(x.dtype), str(y.dtype), has_rows, meta["INPUT_PRECISION"])  # fmt: skip
    if len(_GEMM_PLANS) >= 4096:  # a property test's many shapes: start over
        _GEMM_PLANS.clear()
    plan = _GEMM_PLANS[signature] = _GemmPlan(strides, meta,
                                              (N, K, E, float(act.alpha), float(act.limit)),
                                              key, per_expert)  # fmt: skip
    return plan


def _launch_gemm(call: _GemmCall, x, weights, y, counts, rows=None, *, hidden=(None, None),
                 bias=(), grouped_mm=None):  # fmt: skip
    """Tune (per mode, N, K, rows-per-expert bucket, dtypes, bias, activation) and launch
    the grouped GEMM `call` of x against `weights`, (w,) or (w, v) (v: the up weight of
    gate/up, the second K half's of second_k), into y. `hidden`: (h, dh), the saved
    [g | u] (gate_up writes it, swiglu_grad reads it) and swiglu_grad's [dg | du], or
    None. `bias`: () or the (E, N) bias of w (and of v: gate/up). The grid depends on
    BLOCK_M (blocks never straddle two experts), so each config builds its own block
    offsets; its size is an upper bound, cdiv(P, BLOCK_M) + E row blocks, so no count is
    read back to the host. `grouped_mm`: ``torch._grouped_mm``'s run of the same call
    (`moe_torch.grouped_mm_run`), a candidate too under ``FUSEDPAR_IMPL=auto`` (whether
    there is one is part of the key)."""
    P, E, N = y.shape[0], counts.shape[0], call.N
    if P == 0 or N == 0:
        return
    plan = _gemm_plan(call, x, weights, y, hidden, E, rows is not None, bool(bias))
    expert_starts = offsets(counts)
    bias = tuple(b.contiguous() for b in bias)  # the kernel reads b[e, n] at e * N + n
    args = (x, weights[0], weights[-1], y, *(y if t is None else t for t in hidden),
            *(bias * 2 if len(bias) == 1 else bias or (y, y)),
            expert_starts if rows is None else rows, expert_starts)  # fmt: skip
    out_split = 2 if call.mode == "gate_up" else 1
    tuner = tuning.tuner("grouped_matmul")
    key = plan.key if grouped_mm is None else (*plan.key, "grouped_mm")

    def launch(config, grid=None, kwargs=None):
        if isinstance(config, impl.Torch):
            grouped_mm()
            return
        if grid is None:
            grid, kwargs = plan.launch_arguments(config, P, out_split)
        _grouped_matmul_kernel[grid](*args, offsets(counts, config.kwargs["BLOCK_M"]),
                                     *plan.strides, *plan.scalars, **kwargs)  # fmt: skip

    def candidates():
        torch_ops = [moe_torch.GROUPED_MM] if grouped_mm and impl.tunes_torch() else []
        return _gemm_candidates(call.mode, plan.per_expert, N) + torch_ops

    settled = plan.settled
    with device_guard(x):
        if settled is not None and tuner.settled(key) is settled[0]:
            launch(*settled)  # the pick made: launch with its kept grid and keywords
            return
        config = tuner.run(key, candidates, launch, device=x.device)
    if not isinstance(config, impl.Torch):
        plan.settled = (config, *plan.launch_arguments(config, P, out_split))


def grouped_matmul(x, w, counts, rows=None, *, bias=None, out_dtype=None, transpose_w=False):
    """``y[p] = x[rows[p]] @ w[e].T + bias[e]`` (``@ w[e]`` with `transpose_w`) over expert
    groups.

    x (R, K) any strides; w (E, N, K) (or (E, K, N) with `transpose_w`); bias (E, N) in
    x's dtype or None, added in fp32 before the result is rounded; counts (E,) int64,
    summing to at most P; rows (P,) int32/64 or None (x is already in expert order, P = R).
    Returns y (P, N) in `out_dtype` (x's by default), rows in expert order; rows past
    ``counts.sum()`` are left unwritten by the kernel (where the tuner picked
    ``torch._grouped_mm``, a candidate on CUDA under ``FUSEDPAR_IMPL=auto``, they hold
    what that op leaves there).
    """
    if w.dim() != 3:
        raise ValueError(f"grouped_matmul: w must be (E, N, K), got {tuple(w.shape)}")
    N = w.shape[2] if transpose_w else w.shape[1]
    K = x.shape[-1]
    P = x.shape[0] if rows is None else rows.shape[0]
    biases = {} if bias is None else {"bias": (bias, (N,))}
    _check_grouped("grouped_matmul", _grouped_matmul_kernel, x, counts, rows, P,
                   w=(w, (K, N) if transpose_w else (N, K)), **biases)  # fmt: skip
    y = _empty((P, N), out_dtype or x.dtype, x.device)
    if impl.runs_torch(x):
        moe_torch.grouped_matmul(x, w, counts, rows, y, transpose_w, bias)
        return y
    run = None
    if x.device.type == "cuda":  # torch's grouped GEMM, where its rules hold
        run = moe_torch.grouped_mm_run(x, w, counts, rows, bias, y, transpose_w)
    _launch_gemm(_GemmCall("plain", N, K, transpose_w), x, (w,), y, counts, rows,
                 bias=() if bias is None else (bias,), grouped_mm=run)  # fmt: skip
    return y


def grouped_swiglu(x, w1, w3, counts, rows=None, *, bias=None, activation="silu",
                   alpha=SWIGLU_ALPHA, limit=SWIGLU_LIMIT, save_hidden=True):  # fmt: skip
    """The experts' gate and up projections as one grouped GEMM with the activation in
    its epilogue: ``a[p] = act(h1[p], h3[p])``, ``h1 = x[rows[p]] @ w1[e].T + b1[e]``,
    ``h3 = x[rows[p]] @ w3[e].T + b3[e]``. Each x tile is gathered once for both weights.

    x (R, d); w1, w3 (E, h, d); bias None or (b1, b3), each (E, h) in x's dtype, added in
    fp32 before h1 and h3 are rounded; counts, rows as in `grouped_matmul`. act
    (`activation`): ``"silu"``, ``silu(h1) * h3``, or ``"clamped_swiglu"`` (gpt-oss),
    ``(u' + 1) * g' * sigmoid(alpha * g')`` with ``g' = min(h1, limit)``, ``u' =
    clamp(h3, -limit, limit)``. Returns ``(a, h13)``: a (P, h) and, with `save_hidden`,
    h13 (P, 2h) = [h1 | h3] in x's dtype (before the clamp: what the backward needs),
    else None. a is computed from h1 and h3 rounded to x's dtype, as PyTorch's would be,
    so `grouped_swiglu_backward` recomputes it bit for bit.
    """
    check_activation(activation, alpha, limit)
    act = Swiglu(activation, alpha, limit)
    h, d = w1.shape[1:] if w1.dim() == 3 else (0, x.shape[-1])
    P = x.shape[0] if rows is None else rows.shape[0]
    biases = {} if bias is None else {"b1": (bias[0], (h,)), "b3": (bias[1], (h,))}
    _check_grouped("grouped_swiglu", _grouped_matmul_kernel, x, counts, rows, P,
                   w1=(w1, (h, x.shape[-1])), w3=(w3, (h, x.shape[-1])), **biases)  # fmt: skip
    a = _empty((P, h), x.dtype, x.device)
    h13 = _empty((P, 2 * h), x.dtype, x.device) if save_hidden else None
    if impl.runs_torch(x):
        moe_torch.grouped_swiglu(x, w1, w3, counts, rows, a, h13, bias, act)
        return a, h13
    _launch_gemm(_GemmCall("gate_up", h, d, act=act), x, (w1, w3), a, counts, rows,
                 hidden=(h13, None), bias=tuple(bias or ()))  # fmt: skip
    return a, h13


def grouped_swiglu_backward(d_out, w2, h13, counts, *, activation="silu", alpha=SWIGLU_ALPHA,
                            limit=SWIGLU_LIMIT):  # fmt: skip
    """From the gradient of the experts' outputs, the gradients of h1 and h3, and a again.

    d_out (P, d) in expert order; w2 (E, d, h); h13 (P, 2h) from `grouped_swiglu` (with
    the same `activation`, alpha and limit). Returns ``(d_h13, a)``: d_h13 (P, 2h) =
    [dh1 | dh3] with ``da = d_out[p] @ w2[e]``, for silu ``dh1 = da * h3 * silu'(h1)``,
    ``dh3 = da * silu(h1)`` (for the clamped SwiGLU, zero where the clamp held h1 or h3:
    torch.clamp's gradient, which passes on the bounds), and a (P, h) (for w2's
    gradient), all in d_out's dtype, from one grouped GEMM.
    """
    check_activation(activation, alpha, limit)
    act = Swiglu(activation, alpha, limit)
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
    if impl.runs_torch(d_out):
        moe_torch.grouped_swiglu_backward(d_out, w2, h13, counts, d_h13, a, act)
        return d_h13, a
    _launch_gemm(_GemmCall("swiglu_grad", h, d, True, act), d_out, (w2,), a, counts,
                 hidden=(h13, d_h13))  # fmt: skip
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
    if impl.runs_torch(dx):
        moe_torch.grouped_swiglu_input_grad(d_h13, w1, w3, counts, dx)
        return dx
    _launch_gemm(_GemmCall("second_k", d, h, True), d_h13, (w1, w3), dx, counts)
    return dx
