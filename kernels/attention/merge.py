"""Merge two attention partials through their LSE, in place; and the backward's delta.

Results of softmax attention over disjoint key sets combine exactly into the union's
(`merge_partials`: the forward's epilogue under ``merge=True``, and `merge_attention`):

    lse = log(exp(lse_a) + exp(lse_b))
    o   = (o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse))

computed around ``max(lse_a, lse_b)``; symmetric, a side with ``lse = -inf`` drops out
exactly, two empty sides give 0 and ``-inf``, never NaN.

| tensor          | shape        | dtype                        |
| --------------- | ------------ | ---------------------------- |
| out (updated)   | (B, S, H, D) | fp32, any strides            |
| lse (updated)   | (B, H, S)    | fp32, any strides            |
| block_out       | (B, S, H, D) | any float dtype, any strides |
| block_lse       | (B, H, S)    | fp32                         |

`attention_delta`: ``delta = rowsum(dO * O) - dLSE``, for the fused backward and the ring
ranks whose own block is skipped. Who calls which, and why: docs/attention.md.
"""

import torch
import triton
import triton.language as tl
from fusedpar.kernels import common, impl
from fusedpar.kernels.attention import torch_impl
from fusedpar.kernels.attention.plan import interpreter_blocks, strides
from fusedpar.kernels.common import (
    cdiv,
    check_launchable,
    device_guard,
    is_interpreted,
    next_power_of_2,
)

# One program merges BLOCK_S rows of one (batch, head): rows are D-wide, so 64 rows keep
# a (64, 256) fp32 tile at most in registers.
BLOCK_S = 64


@triton.jit
def merge_partials(o_a, lse_a, o_b, lse_b):
    """The merged ``(o, lse)`` of two partials: o (rows, D) fp32, lse (rows,) natural
    log. Shared by `_merge_kernel` and the forward kernel's MERGE epilogue."""
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)  # both empty: weights exp(-inf) = 0, no NaN
    w_a = tl.exp(lse_a - m)
    w_b = tl.exp(lse_b - m)
    total = w_a + w_b
    empty = total == 0.0
    total = tl.where(empty, 1.0, total)
    o = (o_a * w_a[:, None] + o_b * w_b[:, None]) / total[:, None]
    return o, tl.where(empty, float("-inf"), m + tl.log(total))


@triton.jit
def _merge_kernel(
    # pointers
    out_ptr, lse_ptr, blk_ptr, blk_lse_ptr,
    # strides
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_xb, stride_xs, stride_xh, stride_xd,
    stride_yb, stride_yh, stride_ys,
    # sizes
    S,
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    pid_s = tl.program_id(0)  # grid (row blocks, B, H); 64-bit offsets
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    rows = offs_s < S
    mask = rows[:, None] & (offs_d[None, :] < HEAD_DIM)

    lse_ptrs = lse_ptr + b * stride_lb + h * stride_lh + offs_s * stride_ls
    lse_a = tl.load(lse_ptrs, mask=rows, other=float("-inf"))
    lse_b = tl.load(blk_lse_ptr + b * stride_yb + h * stride_yh + offs_s * stride_ys,
                    mask=rows, other=float("-inf"))  # fmt: skip
    o_ptrs = (out_ptr + b * stride_ob + h * stride_oh
              + offs_s[:, None] * stride_os + offs_d[None, :] * stride_od)  # fmt: skip
    o_a = tl.load(o_ptrs, mask=mask, other=0.0)
    o_b = tl.load(blk_ptr + b * stride_xb + h * stride_xh + offs_s[:, None] * stride_xs
                  + offs_d[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)  # fmt: skip
    o, lse = merge_partials(o_a, lse_a, o_b, lse_b)
    tl.store(o_ptrs, o, mask=mask)
    tl.store(lse_ptrs, lse, mask=rows)


def merge_attention(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold ``(block_out, block_lse)`` into ``(out, lse)``, in place (see the module doc).
    float64 partials (block_out float64) merge on torch's implementation, out and the
    LSEs float64 then (`fusedpar.kernels.common.accumulator`)."""
    if out.dim() != 4 or block_out.shape != out.shape:
        raise ValueError(f"out and block_out must be one (B, S, H, D) shape, got "
                         f"{tuple(out.shape)} and {tuple(block_out.shape)}")  # fmt: skip
    B, S, H, D = out.shape
    wide = common.accumulator(block_out.dtype)
    for name, t in (("lse", lse), ("block_lse", block_lse)):
        if t.shape != (B, H, S) or t.dtype != wide:
            raise ValueError(
                f"{name} must be {wide} ({B}, {H}, {S}), got {t.dtype} {tuple(t.shape)}"
            )
    if out.dtype != wide:
        raise TypeError(f"out accumulates in {wide}, got {out.dtype}")
    if impl.runs_torch(out):
        torch_impl.merge(out, lse, block_out, block_lse)
        return
    check_launchable(_merge_kernel, out, lse, block_out, block_lse)
    if out.numel() == 0:
        return
    block_s = (
        BLOCK_S if not is_interpreted(_merge_kernel) else min(BLOCK_S, max(16, next_power_of_2(S)))
    )
    with device_guard(out):
        _merge_kernel[(cdiv(S, block_s), B, H)](
            out, lse, block_out, block_lse,
            *out.stride(), *lse.stride(), *block_out.stride(), *block_lse.stride(),
            S, HEAD_DIM=D, BLOCK_D=max(16, next_power_of_2(D)), BLOCK_S=block_s,
        )  # fmt: skip


# --- delta ------------------------------------------------------------------------------


@triton.jit
def _bwd_delta_kernel(
    o_ptr, do_ptr, dlse_ptr, delta_ptr,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_db, stride_ds, stride_dh, stride_dd,
    stride_dlb, stride_dlh, stride_dls,
    Sq, Hq,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DLSE: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """delta[b, h, i] = sum_d dO * O (minus dLSE with DLSE), in fp32; written contiguous
    (B, Hq, Sq)."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = (offs_m[:, None] < Sq) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os
                + offs_d[None, :] * stride_od, mask=mask, other=0.0)  # fmt: skip
    do = tl.load(do_ptr + b * stride_db + h * stride_dh + offs_m[:, None] * stride_ds
                 + offs_d[None, :] * stride_dd, mask=mask, other=0.0)  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if DLSE:
        delta -= tl.load(dlse_ptr + b * stride_dlb + h * stride_dlh + offs_m * stride_dls,
                         mask=offs_m < Sq, other=0.0)  # fmt: skip
    tl.store(delta_ptr + (b * Hq + h) * Sq + offs_m, delta, mask=offs_m < Sq)


def attention_delta(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None = None,
                    delta: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``delta = rowsum(dO * O) - dLSE`` (`dlse` None: 0): (B, Hq, Sq) fp32 (float64 for
    float64 dO), contiguous; into `delta` when given (a contiguous buffer of that shape)."""
    if out.shape != dout.shape or out.dim() != 4:
        raise ValueError(f"out and dout must be one (B, S, H, D) shape, got "
                         f"{tuple(out.shape)} and {tuple(dout.shape)}")  # fmt: skip
    B, Sq, Hq, D = out.shape
    if dlse is not None and tuple(dlse.shape) != (B, Hq, Sq):
        raise ValueError(f"dlse must be (B, Hq, Sq) = {(B, Hq, Sq)}, got {tuple(dlse.shape)}")
    if impl.runs_torch(out):
        made = torch_impl.delta(out, dout)
        made = made if dlse is None else made - dlse
        return made if delta is None else delta.copy_(made)
    if delta is None:
        delta = torch.empty((B, Hq, Sq), dtype=torch.float32, device=out.device)
    check_launchable(_bwd_delta_kernel, out, dout, delta)
    if delta.numel() == 0:
        return delta
    block_m = 64 if not is_interpreted(_bwd_delta_kernel) else interpreter_blocks(Sq, 1)["BLOCK_M"]
    with device_guard(out):
        _bwd_delta_kernel[(cdiv(Sq, block_m), B, Hq)](
            out, dout, out if dlse is None else dlse, delta, *strides(out), *strides(dout),
            *(strides(dlse) if dlse is not None else (0, 0, 0)), Sq, Hq,
            HEAD_DIM=D, BLOCK_D=max(16, next_power_of_2(D)), DLSE=dlse is not None,
            BLOCK_M=block_m,
        )  # fmt: skip
    return delta
