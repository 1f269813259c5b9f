"""``delta = rowsum(dO * O) - dLSE``, the attention backward's per-row term: one kernel
and its launcher. The split backward's dQ kernel makes delta itself as it starts; this
launch serves the fused backward, which needs every row's delta before its first
program, and the ring's ranks whose own block is skipped."""

import torch
import triton
import triton.language as tl
from fusedpar.kernels import _impl, attention_torch
from fusedpar.kernels._common import (
    cdiv,
    check_launchable,
    device_guard,
    is_interpreted,
    next_power_of_2,
)
from fusedpar.kernels.attention import strides
from fusedpar.kernels.attention_launch import interpreter_blocks


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
    if _impl.runs_torch(out):
        made = attention_torch.delta(out, dout)
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
