"""RMSNorm, forward and backward: a row kernel each, fp32 inside, no atomics.

Rows are the last dim of x (..., D); ``w' = offset + weight`` (offset 0: Llama's
RMSNorm; 1: Gemma's, whose weight starts at zero).

| function            | computes                                                           |
| ------------------- | ------------------------------------------------------------------ |
| `rms_norm`          | ``y = x * rstd * w'``, ``rstd = 1 / sqrt(mean(x^2) + eps)`` (fp32) |
| `rms_norm_backward` | ``dx = rstd * (g - x * rstd^2 * mean(g * x))``, ``g = dy * w'``;   |
|                     | ``dweight = sum_rows dy * x * rstd``                               |
| ``rope=(cos, sin)`` | the forward rotates y (`fusedpar.kernels.rope`'s pairs ``i``,      |
|                     | ``i + r/2``) before storing it; the backward rotates dy back first |
| `rms_norm_gated`    | y times ``act(z)`` (GATE: silu or sigmoid); its backward stores    |
| (and `_backward`)   | ``dz = dy * x * rstd * w' * act'(z)``, then takes ``dy * act(z)``  |

The backward reads x, rstd (one fp32 per row) and eps, not the normalized rows; with
D = 1 its bracket is ``g * eps * rstd^2`` (the general form would cancel in fp32). The
weight's gradient: each program sums its rows into its own row of a (programs, D) fp32
buffer, which the launcher sums in a fixed order (the same bits each run). The torch
implementation and the float64 references close the file. Why: docs/elementwise.md.
"""

import math

import torch
import triton
import triton.language as tl
from fusedpar.kernels import common, impl, tuning
from fusedpar.kernels.common import (
    check_float_dtype,
    check_launchable,
    is_interpreted,
    sm_count,
)
from fusedpar.kernels.rope import check_tables, rope_torch
from fusedpar.kernels.tuning import bucket

# A program holds whole rows (BLOCK_D = D rounded up to a power of two): one read of x
# per pass. Past this width a row would not fit a program's registers.
MAX_D = 65536
# Elements a program holds per step (rows x BLOCK_D): the forward 4 rows of 4096 at
# Llama 8B's width; the backward, with twice the live tensors (x, dy, their products and
# the weight gradient's partial row), one (4 rows: 245 registers per thread on sm_90).
ROW_TILE_ELEMENTS = {"forward": 16384, "backward": 4096}
# The gates of `rms_norm_gated`: Gated DeltaNet's output norm (silu) and Kimi's (sigmoid).
GATES = ("silu", "sigmoid")
# Backward programs per SM: each keeps one fp32 partial row of the weight's gradient.
PROGRAMS_PER_SM = 2
# The interpreter runs programs one after another: few rows per step and a few programs,
# so tiny shapes still cross row blocks and several partial sums.
INTERPRETER_ROWS = 2
INTERPRETER_PROGRAMS = 3


def row_config(D: int, interpreted: bool, direction: str = "forward") -> dict:
    """Rows per step and the row width of a program, and its warps: the whole row, and
    as many rows as make ROW_TILE_ELEMENTS[direction] (at least 1); 16 elements of each
    tensor per thread in the backward, up to 64 in the forward."""
    block_d = common.next_power_of_2(max(D, 1))
    if interpreted:
        return dict(BLOCK_ROWS=INTERPRETER_ROWS, BLOCK_D=block_d, num_warps=4)
    rows = max(1, min(16, ROW_TILE_ELEMENTS[direction] // block_d))
    per_thread = 16 if direction == "backward" else 64
    warps = min(16, max(4, rows * block_d // (32 * per_thread)))
    return dict(BLOCK_ROWS=rows, BLOCK_D=block_d, num_warps=warps)


@triton.jit
def _partner(cols, HALF):
    """The dim each dim of a row turns with under RoPE: i + HALF in the first half, i -
    HALF in the second, itself past the rotated 2 * HALF."""
    return tl.where(cols < HALF, cols + HALF, tl.where(cols < 2 * HALF, cols - HALF, cols))


@triton.jit
def _angles(cos_ptr, sin_ptr, stride_cs, stride_cd, stride_ss, stride_sd, rows, row_mask, cols,
            HALF, rows_per_position):  # fmt: skip
    """(BLOCK_ROWS, BLOCK_D) cos and signed sin of each row's position and dim, so that
    ``y' = y * cos + partner(y) * sin``: sin negated on the first half; 1 and 0 past the
    rotated dims."""
    position = (rows // rows_per_position).to(tl.int64)[:, None]
    rotated = row_mask[:, None] & (cols < 2 * HALF)[None, :]
    j = tl.where(cols < HALF, cols, cols - HALF)[None, :]
    c = tl.load(cos_ptr + position * stride_cs + j * stride_cd, mask=rotated, other=1.0)
    sn = tl.load(sin_ptr + position * stride_ss + j * stride_sd, mask=rotated, other=0.0)
    return c, tl.where((cols < HALF)[None, :], -sn, sn)


@triton.jit
def _gate(z, GATE: tl.constexpr):
    """``(act(z), act'(z))`` in fp32, act one of `GATES`."""
    s = tl.sigmoid(z)
    if GATE == "silu":
        return z * s, s * (1.0 + z * (1.0 - s))
    return s, s * (1.0 - s)


@triton.jit
def _rms_norm_fwd_kernel(
    # pointers (cos, sin: read with ROTARY only; z with GATE only)
    x_ptr, w_ptr, y_ptr, rstd_ptr, cos_ptr, sin_ptr, z_ptr,
    # strides
    stride_xm, stride_xd, stride_ym, stride_yd, stride_cs, stride_cd, stride_ss, stride_sd,
    stride_zm, stride_zd,
    # sizes and scalars
    M, D, HALF, rows_per_position, eps, offset,
    # meta-parameters
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ROTARY: tl.constexpr, GATE: tl.constexpr,
):  # fmt: skip
    """y[m] = x[m] * rstd[m] * (offset + w), rstd[m] = rsqrt(mean(x[m]^2) + eps), fp32;
    with ROTARY, y[m] rotated by the angles of position m // rows_per_position; with a
    GATE, y[m] times act(z[m])."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols[None, :] < D)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :] * stride_xd, mask=mask,
                other=0.0).to(tl.float32)  # fmt: skip
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32) + offset
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
    y = x * rstd[:, None] * w[None, :]
    if ROTARY:
        partner = _partner(cols, HALF)
        x_partner = tl.load(x_ptr + rows64[:, None] * stride_xm + partner[None, :] * stride_xd,
                            mask=mask, other=0.0).to(tl.float32)  # fmt: skip
        w_partner = tl.load(w_ptr + partner, mask=cols < D, other=0.0).to(tl.float32) + offset
        cos, sin = _angles(cos_ptr, sin_ptr, stride_cs, stride_cd, stride_ss, stride_sd, rows,
                           row_mask, cols, HALF, rows_per_position)  # fmt: skip
        y = y * cos + x_partner * rstd[:, None] * w_partner[None, :] * sin
    if GATE != "none":
        z = tl.load(z_ptr + rows64[:, None] * stride_zm + cols[None, :] * stride_zd, mask=mask,
                    other=0.0).to(tl.float32)  # fmt: skip
        y = y * _gate(z, GATE)[0]
    tl.store(y_ptr + rows64[:, None] * stride_ym + cols[None, :] * stride_yd,
             y.to(y_ptr.dtype.element_ty), mask=mask)  # fmt: skip
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_bwd_kernel(
    # pointers (cos, sin: read with ROTARY only; z, dz with GATE only)
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, cos_ptr, sin_ptr, z_ptr, dz_ptr,
    # strides
    stride_dym, stride_dyd, stride_xm, stride_xd, stride_dxm, stride_dxd,
    stride_cs, stride_cd, stride_ss, stride_sd, stride_zm, stride_zd, stride_dzm, stride_dzd,
    # sizes and scalars
    M, D, HALF, rows_per_position, eps, offset, rows_per_program,
    # meta-parameters
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ROTARY: tl.constexpr, GATE: tl.constexpr,
):  # fmt: skip
    """dx for rows [pid * rows_per_program, ...) (rows_per_program a multiple of
    BLOCK_ROWS), and that range's sum of dy * x * rstd into row pid of dw_partial (D);
    with ROTARY, dy is first rotated back by the angles of its rows' positions; with a
    GATE, dz = dy * normed * act'(z) is stored and dy becomes dy * act(z)."""
    one_feature = D == 1  # the bracket is g * eps * rstd^2 (the module doc)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for start in range(first, last, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < last
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :] * stride_xd, mask=mask,
                    other=0.0).to(tl.float32)  # fmt: skip
        dy = tl.load(dy_ptr + rows64[:, None] * stride_dym + cols[None, :] * stride_dyd,
                     mask=mask, other=0.0).to(tl.float32)  # fmt: skip
        if ROTARY:
            partner = _partner(cols, HALF)
            dy_partner = tl.load(dy_ptr + rows64[:, None] * stride_dym
                                 + partner[None, :] * stride_dyd, mask=mask,
                                 other=0.0).to(tl.float32)  # fmt: skip
            cos, sin = _angles(cos_ptr, sin_ptr, stride_cs, stride_cd, stride_ss, stride_sd,
                               rows, row_mask, cols, HALF, rows_per_position)  # fmt: skip
            dy = dy * cos - dy_partner * sin
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        xhat = x * rstd[:, None]
        if GATE != "none":  # y = normed * act(z): dz, then the normed rows' gradient
            z = tl.load(z_ptr + rows64[:, None] * stride_zm + cols[None, :] * stride_zd,
                        mask=mask, other=0.0).to(tl.float32)  # fmt: skip
            act, slope = _gate(z, GATE)
            tl.store(dz_ptr + rows64[:, None] * stride_dzm + cols[None, :] * stride_dzd,
                     (dy * xhat * w[None, :] * slope).to(dz_ptr.dtype.element_ty),
                     mask=mask)  # fmt: skip
            dy = dy * act
        g = dy * w[None, :]
        c = tl.sum(g * xhat, 1) / D
        bracket = tl.where(one_feature, g * (eps * rstd * rstd)[:, None], g - xhat * c[:, None])
        dx = bracket * rstd[:, None]
        tl.store(dx_ptr + rows64[:, None] * stride_dxm + cols[None, :] * stride_dxd,
                 dx.to(dx_ptr.dtype.element_ty), mask=mask)  # fmt: skip
        dw += tl.sum(dy * xhat, 0)
    tl.store(dw_partial_ptr + pid.to(tl.int64) * D + cols, dw, mask=col_mask)


# --- launchers -------------------------------------------------------------------------


def _rows(name: str, t: torch.Tensor, D: int) -> torch.Tensor:
    """t (..., D) as (M, D): a view where the leading dims flatten, else a copy."""
    if t.shape[-1] != D:
        raise ValueError(f"{name} must be (..., {D}), got {tuple(t.shape)}")
    return t.reshape(-1, D)


def check_inputs(x: torch.Tensor, weight: torch.Tensor) -> int:
    """The checks of `rms_norm` (and its backward); returns D. float64 x runs on the
    torch implementation alone, computed in float64: its rstd, weight gradient and RoPE
    tables are float64 where they are fp32 for the other dtypes
    (`fusedpar.kernels.common.accumulator`); a float64 weight goes with float64 x only."""
    check_float_dtype("x", x)
    check_float_dtype("weight", weight, common.FLOAT_DTYPES if x.dtype == torch.float64
                      else impl.KERNEL_DTYPES)  # fmt: skip
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: x (..., D) and weight (D,) must agree on D, got x "
                         f"{tuple(x.shape)} and weight {tuple(weight.shape)}")  # fmt: skip
    D = weight.shape[0]
    if D > MAX_D:
        raise ValueError(f"rms_norm: rows of {D} features, over the {MAX_D} a program holds")
    if x.device != weight.device:
        raise ValueError(f"rms_norm: x is on {x.device} but weight on {weight.device}")
    return D


def check_rope(x: torch.Tensor, rope) -> int:
    """For ``rope=(cos, sin)``: ValueError/TypeError naming the sizes unless x is (S, ...,
    D) and cos, sin (S, r/2) float32 on x's device with r <= D; the rows per position."""
    if x.dim() < 2:
        raise ValueError(f"rms_norm: rope= takes x (S, ..., D), got {tuple(x.shape)}")
    check_tables("rms_norm", *rope, x.shape[0], x.shape[-1], x.device, x.dtype)
    return math.prod(x.shape[1:-1])  # (no aten op: x[0] would be one)


def check_gate(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, gate: str) -> int:
    """The checks of `rms_norm_gated`: `check_inputs`', z of x's shape (any float dtype,
    x's device), gate one of `GATES`; returns D."""
    D = check_inputs(x, weight)
    check_float_dtype("z", z, common.FLOAT_DTYPES if x.dtype == torch.float64
                      else impl.KERNEL_DTYPES)  # fmt: skip
    if gate not in GATES:
        raise ValueError(f"rms_norm_gated: gate must be one of {GATES}, got {gate!r}")
    if z.shape != x.shape:
        raise ValueError(f"rms_norm_gated: z {tuple(z.shape)} must be x's shape {tuple(x.shape)}")
    if z.device != x.device:
        raise ValueError(f"rms_norm_gated: x is on {x.device} but z on {z.device}")
    return D


def _tables(rope, x2d: torch.Tensor) -> tuple:
    """The kernels' (cos, sin), their strides and HALF; without rope, x stands for the
    tables (never read) and HALF is 0."""
    cos, sin = rope if rope is not None else (x2d, x2d)
    return (cos, sin), (*cos.stride(), *sin.stride()), cos.shape[1] if rope is not None else 0


def rms_norm(x, weight, eps: float = 1e-5, offset: float = 0.0, rope=None):
    """``(y, rstd)``: y (..., D) in x's dtype, ``x * rstd * (offset + weight)`` computed in
    fp32 and rounded once; rstd (x.shape[:-1]) float32, ``1 / sqrt(mean(x^2) + eps)``
    (float64 x: computed in float64, rstd float64).
    x any float dtype and strides; weight (D,) any float dtype. ``rope=(cos, sin)``: y
    rotated (the module doc) before it is rounded, x (S, ..., D)."""
    D = check_inputs(x, weight)
    per_position = check_rope(x, rope) if rope is not None else 1
    return _forward(x, weight, D, eps, offset, rope, per_position, None)


def rms_norm_gated(x, z, weight, eps: float, gate: str = "silu"):
    """``(y, rstd)`` of `rms_norm` (offset 0) with y multiplied by ``act(z)`` before its
    one rounding, act `gate` ("silu" or "sigmoid"); z x's shape, any float dtype."""
    D = check_gate(x, z, weight, gate)
    return _forward(x, weight, D, eps, 0.0, None, 1, (_rows("z", z, D), gate))


def _forward(x, weight, D, eps, offset, rope, per_position, gate):
    """The forward launch; `gate`: None or (z (M, D), act)."""
    x2d = _rows("x", x, D)
    M = x2d.shape[0]
    y = torch.empty((M, D), dtype=x.dtype, device=x.device)
    rstd = torch.empty((M,), dtype=common.accumulator(x.dtype), device=x.device)
    run_torch = lambda: rms_norm_torch(x2d, weight, eps, offset, y, rstd, rope, per_position, gate)  # noqa: E731
    if impl.runs_torch(x):
        run_torch()
    elif y.numel():
        check_launchable(_rms_norm_fwd_kernel, x, weight)
        config = row_config(D, is_interpreted(_rms_norm_fwd_kernel))
        grid = (common.cdiv(M, config["BLOCK_ROWS"]),)
        tables, table_strides, half = _tables(rope, x2d)
        z2d, act = gate if gate is not None else (x2d, "none")
        args = (x2d, weight, y, rstd, *tables, z2d, *x2d.stride(), *y.stride(), *table_strides,
                *z2d.stride(), M, D, half, per_position, float(eps), float(offset))  # fmt: skip
        key = (bucket(M), D, half, act, str(x.dtype), str(weight.dtype), str(z2d.dtype))
        tuning.run_tile_or_torch(_rms_norm_fwd_kernel, config, lambda _: grid, args,
                                  {"ROTARY": rope is not None, "GATE": act}, key, x,
                                  run_torch)  # fmt: skip
    return y.view(x.shape), rstd.view(x.shape[:-1])


def backward_programs(M: int, block_rows: int, device: torch.device, interpreted: bool) -> int:
    """How many backward programs (and partial rows of the weight's gradient): enough to
    fill the GPU, never more than there are row blocks."""
    cuda = device.type == "cuda" and not interpreted
    most = PROGRAMS_PER_SM * sm_count(device) if cuda else INTERPRETER_PROGRAMS
    return max(1, min(most, common.cdiv(M, block_rows)))


def rms_norm_backward(dy, x, weight, rstd, offset: float = 0.0, *, eps: float, need_x=True,
                      need_weight=True, rope=None):  # fmt: skip
    """``(dx, dweight)`` of `rms_norm` from dy (x's shape), x, weight, the forward's rstd,
    eps and rope: dx in x's dtype, dweight (D,) in weight's (None where not asked for).
    The weight's gradient sums per-program fp32 partial rows in a fixed order (no
    atomics)."""
    D = check_inputs(x, weight)
    per_position = check_rope(x, rope) if rope is not None else 1
    dx, dw = _backward(dy, x, weight, rstd, D, offset, eps, rope, per_position, None)
    return dx if need_x else None, dw.to(weight.dtype) if need_weight else None


def rms_norm_gated_backward(dy, x, z, weight, rstd, *, eps: float, gate: str = "silu",
                            needs=(True, True, True)):  # fmt: skip
    """``(dx, dz, dweight)`` of `rms_norm_gated`, each in its input's dtype, None where
    `needs` (x, z, weight) says no; the weight's gradient as `rms_norm_backward`'s."""
    D = check_gate(x, z, weight, gate)
    z2d = _rows("z", z, D)
    dz = torch.empty(z2d.shape, dtype=z.dtype, device=z.device)
    dx, dw = _backward(dy, x, weight, rstd, D, 0.0, eps, None, 1, (z2d, gate, dz))
    grads = (dx, dz.view(z.shape), dw.to(weight.dtype))
    return tuple(g if need else None for g, need in zip(grads, needs, strict=True))


def _backward(dy, x, weight, rstd, D, offset, eps, rope, per_position, gate):
    """The backward launch: (dx (x's shape), dweight (D,) fp32); `gate`: None, or (z
    (M, D), act, dz (M, D)), dz written."""
    x2d, dy2d = _rows("x", x, D), _rows("dy", dy, D)
    M = x2d.shape[0]
    if dy2d.shape != x2d.shape or rstd.numel() != M:
        raise ValueError(f"rms_norm_backward: dy {tuple(dy.shape)} and rstd {tuple(rstd.shape)} "
                         f"must match x {tuple(x.shape)}")  # fmt: skip
    if rstd.dtype != common.accumulator(x.dtype):
        raise TypeError(f"rms_norm_backward: rstd must be {common.accumulator(x.dtype)} for "
                        f"{x.dtype} x, got {rstd.dtype}")  # fmt: skip
    rstd = rstd.reshape(M)
    dx = torch.empty((M, D), dtype=x.dtype, device=x.device)
    torch_args = (dy2d, x2d, weight, rstd, eps, offset, dx, rope, per_position, gate)
    if impl.runs_torch(x):
        dw = rms_norm_backward_torch(*torch_args)
    else:
        check_launchable(_rms_norm_bwd_kernel, dy, x, weight, rstd)
        interpreted = is_interpreted(_rms_norm_bwd_kernel)
        config = row_config(D, interpreted, "backward")
        block = config["BLOCK_ROWS"]
        programs = backward_programs(M, block, x.device, interpreted)
        per_program = common.cdiv(common.cdiv(M, programs), block) * block
        partial = torch.zeros((programs, D), dtype=torch.float32, device=x.device)

        def torch_run():  # its weight gradient as the first partial row, the others 0
            partial.zero_()
            partial[0] = rms_norm_backward_torch(*torch_args)

        if M:
            tables, table_strides, half = _tables(rope, x2d)
            z2d, act, dz = gate if gate is not None else (x2d, "none", dx)
            args = (dy2d, x2d, weight, rstd, dx, partial, *tables, z2d, dz, *dy2d.stride(),
                    *x2d.stride(), *dx.stride(), *table_strides, *z2d.stride(), *dz.stride(), M,
                    D, half, per_position, float(eps), float(offset), per_program)  # fmt: skip
            key = (bucket(M), D, half, act, str(x.dtype), str(weight.dtype), str(dy.dtype),
                   str(z2d.dtype))  # fmt: skip
            tuning.run_tile_or_torch(_rms_norm_bwd_kernel, config, lambda _: (programs,), args,
                                      {"ROTARY": rope is not None, "GATE": act}, key, x,
                                      torch_run)  # fmt: skip
        dw = partial.sum(0)
    return dx.view(x.shape), dw


# --- torch implementation and reference ------------------------------------------------


def _by_position(t2d, rows_per_position: int):
    """(M, D) rows as `fusedpar.kernels.rope`'s (1, S, rows a position, D): a view of a
    contiguous t2d (one written into), else a copy (one only read)."""
    return t2d.reshape(1, -1, rows_per_position, t2d.shape[1])


def gate_torch(z, act: str):
    """``(act(z), act'(z))``, act one of `GATES`, in z's dtype."""
    s = torch.sigmoid(z)
    if act == "silu":
        return z * s, s * (1 + z * (1 - s))
    return s, s * (1 - s)


def rms_norm_torch(x2d, weight, eps, offset, y, rstd, rope=None, rows_per_position=1,
                   gate=None) -> None:  # fmt: skip
    """`rms_norm`'s contract in PyTorch, into y and rstd: fp32 inside (rstd's dtype:
    float64 for float64 x), rounded once; `gate`: (z, act), y times act(z)."""
    xf = x2d.to(rstd.dtype)
    rstd.copy_(torch.rsqrt(xf.square().mean(-1) + eps))
    normed = xf * rstd[:, None] * (weight.to(rstd.dtype) + offset)
    if gate is not None:
        normed = normed * gate_torch(gate[0].to(rstd.dtype), gate[1])[0]
    if rope is None:
        y.copy_(normed)
    else:  # rope's rows (1, S, rows a position, D): rotated into y, rounded once
        rope_torch(_by_position(normed, rows_per_position), *rope, False,
                   _by_position(y, rows_per_position))  # fmt: skip


def rms_norm_backward_torch(dy2d, x2d, weight, rstd, eps, offset, dx, rope=None,
                            rows_per_position=1, gate=None):  # fmt: skip
    """`rms_norm_backward`'s contract in PyTorch: dx into `dx`; returns dweight in fp32
    (rstd's dtype: float64 for float64 x); `gate`: (z, act, dz), dz written."""
    wide = rstd.dtype
    xhat = x2d.to(wide) * rstd[:, None]
    dyf = dy2d.to(wide)
    if rope is not None:  # turned back in place, in a contiguous fp32 copy of dy
        dyf = dy2d.to(wide, memory_format=torch.contiguous_format, copy=True)
        rope_torch(_by_position(dyf, rows_per_position), *rope, True,
                   _by_position(dyf, rows_per_position))  # fmt: skip
    w = weight.to(wide) + offset
    if gate is not None:  # y = normed * act(z): dz, then the normed rows' gradient
        z, act, dz = gate
        a, slope = gate_torch(z.to(wide), act)
        dz.copy_(dyf * xhat * w * slope)
        dyf = dyf * a
    g = dyf * w
    if x2d.shape[1] == 1:  # the bracket without cancelling (the module doc)
        bracket = g * (eps * rstd * rstd)[:, None]
    else:
        bracket = g - xhat * (g * xhat).mean(-1, keepdim=True)
    dx.copy_(bracket * rstd[:, None])
    return (dyf * xhat).sum(0)


def rms_norm_gated_reference(x, z, weight, eps: float, gate: str = "silu"):
    """``weight * rmsnorm(x) * act(z)`` in x's dtype (float64 in: the oracle),
    differentiable by autograd."""
    act = torch.nn.functional.silu if gate == "silu" else torch.sigmoid
    return rms_norm_reference(x, weight, eps) * act(z.to(x.dtype))


def rms_norm_reference(x, weight, eps: float = 1e-5, offset: float = 0.0, rope=None):
    """RMSNorm in x's dtype (float64 in: the oracle), then the rotation of ``rope=(cos,
    sin)`` (x (S, ..., D)), differentiable by autograd."""
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    y = x * rstd * (weight.to(x.dtype) + offset)
    if rope is None:
        return y
    broadcast = (x.shape[0], *[1] * (x.dim() - 2), -1)  # (S, 1, ..., r/2)
    c, s = (t.to(x.dtype).reshape(broadcast) for t in rope)
    half = c.shape[-1]
    y1, y2 = y[..., :half], y[..., half : 2 * half]
    return torch.cat([y1 * c - y2 * s, y2 * c + y1 * s, y[..., 2 * half :]], dim=-1)
