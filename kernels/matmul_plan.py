"""`fusedpar.kernels.matmul`'s plan: its operands' checks (the GEMM's, a rotating
epilogue's, a gated GEMM's and a gated gradient's), worked out on the first call of a
signature (shapes, strides, dtypes, alignment, flags) with the launch parameters and
looked up by later calls (host time a GEMM call, launch stubbed: 24 -> 10 -> 8 µs); and
what the epilogues are given: `RowRotation` (RoPE), `GatedProduct` and `GatedGrad` (a
gated MLP's activation and its gradient)."""

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import triton
from fusedpar.kernels import common
from fusedpar.kernels.common import accumulator, cdiv, check_float_dtype
from fusedpar.kernels.gated import ACTIVATIONS


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


class GatedProduct(NamedTuple):
    """What `matmul` needs to end a dense gated MLP's up projection with its activation:
    C = A @ B (+ bias) is up, rounded to C's dtype, and the epilogue also writes ``hidden
    = act(gate) * up`` from it and the gate projection's stored output (M, N), as
    `fusedpar.kernels.gated.gated` computes it: the product with no pass of its own.
    hidden has C's strides."""

    gate: torch.Tensor
    hidden: torch.Tensor
    activation: str


class GatedGrad(NamedTuple):
    """What `matmul` needs to end a dense gated MLP's hidden gradient in its epilogue:
    C = A @ B is dh, rounded to C's dtype as `matmul` would store it, and from it and the
    forward's saved gate and up (M, N) the epilogue writes ``dgate = dh * up * act'(gate)``
    into C and ``dup = dh * act(gate)`` into `up_grad`, and with `hidden` ``h = act(gate)
    * up`` again (the down weight's gradient needs it), as `fusedpar.kernels.gated.
    gated_backward` does from a stored dh. up_grad and hidden have C's strides; gate and
    up share theirs."""

    gate: torch.Tensor
    up: torch.Tensor
    up_grad: torch.Tensor
    hidden: torch.Tensor | None
    activation: str


def check_operands(a, b, bias, out, accumulate, out_dtype):
    """ValueError/TypeError naming the sizes for operands `matmul` cannot take."""
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
    out_dtypes = (a.dtype, accumulator(a.dtype))  # fp32 partials; float64 for float64
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


def check_rope(a, b, rope: RowRotation, accumulate, fits) -> None:
    """ValueError/TypeError for a rotation the epilogue cannot apply; `fits`:
    `rope_epilogue_fits` (dtype, head dim -> bool)."""
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
    if not fits(a.dtype, head_dim) or N % head_dim:
        raise ValueError(f"rope: heads of {head_dim} (2 * cos.shape[1]) must be a power of 2 "
                         f"the {a.dtype} tiles hold whole, dividing N = {N}")  # fmt: skip
    if accumulate:
        raise ValueError("rope: a rotated C is written, not added into (accumulate=True)")
    if not isinstance(per_position, int) or per_position < 1:
        raise ValueError(f"rope: rows_per_position must be a positive int, got {per_position!r}")
    if not a.device == cos.device == sin.device:
        raise ValueError(f"rope: A and the tables on {a.device}, {cos.device}, {sin.device}")


def check_gated(b, bias, b2, bias2, activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated_matmul: activation must be one of {ACTIVATIONS}, got "
                         f"{activation!r}")  # fmt: skip
    if b2.shape != b.shape or b2.stride() != b.stride() or b2.dtype != b.dtype:
        raise ValueError(f"gated_matmul: the up operand must be {tuple(b.shape)} {b.dtype} "
                         f"with strides {b.stride()} as the gate's, got {tuple(b2.shape)} "
                         f"{b2.dtype} {b2.stride()}")  # fmt: skip
    if (bias is None) != (bias2 is None):
        raise ValueError("gated_matmul: both biases or neither")
    if bias is not None and (bias2.shape != bias.shape or bias2.stride() != bias.stride()
                             or bias2.dtype != bias.dtype):  # fmt: skip
        raise ValueError(f"gated_matmul: the up bias must be {tuple(bias.shape)} "
                         f"{bias.dtype} as the gate's, got {tuple(bias2.shape)} "
                         f"{bias2.dtype}")  # fmt: skip


def gated_tensors(gated: GatedProduct | GatedGrad) -> tuple:
    """(gate, up, c2, hidden) as the kernel reads and writes them: the saved gate and up,
    the second output (dup) and the product; None where the epilogue has none."""
    if isinstance(gated, GatedGrad):
        return gated.gate, gated.up, gated.up_grad, gated.hidden
    return gated.gate, None, None, gated.hidden


def check_gated_epilogue(a, b, out, bias, accumulate, gated) -> None:
    """ValueError/TypeError for a `GatedProduct` or `GatedGrad` the epilogue cannot
    write."""
    what = type(gated).__name__
    grad = isinstance(gated, GatedGrad)
    if gated.activation not in ACTIVATIONS:
        raise ValueError(f"{what}: activation must be one of {ACTIVATIONS}, got "
                         f"{gated.activation!r}")  # fmt: skip
    if out is None or accumulate or (grad and bias is not None):
        raise ValueError(f"{what}: C is given as `out`, not added into"
                         + (", with no bias" if grad else ""))  # fmt: skip
    gate, up, second, hidden = gated_tensors(gated)
    saved = [t for t in (gate, up) if t is not None]
    outputs = [t for t in (second, hidden) if t is not None]
    shape = (a.shape[0], b.shape[1])
    if any(t.shape != shape for t in saved):
        raise ValueError(f"{what}: gate and up must be (M, N) = {shape}, got "
                         f"{[tuple(t.shape) for t in saved]}")  # fmt: skip
    if any(t.stride() != gate.stride() for t in saved):
        raise ValueError(f"{what}: gate and up must share strides, got "
                         f"{[t.stride() for t in saved]}")  # fmt: skip
    for t in outputs:
        if t.shape != shape or t.stride() != out.stride():
            raise ValueError(f"{what}: its outputs must be (M, N) = {shape} with C's strides "
                             f"{out.stride()}, got {tuple(t.shape)} {t.stride()}")  # fmt: skip
    for t in (*saved, out, *outputs):
        if t.dtype != a.dtype or t.device != a.device:
            raise TypeError(f"{what}: the saved and written tensors must be A's {a.dtype} on "
                            f"{a.device}, got {t.dtype} on {t.device}")  # fmt: skip


def check_rope_rows(M: int, rope: RowRotation) -> None:
    """Every row's position inside the tables (a call's rows may start anywhere)."""
    if rope.first_row < 0 or (M and (rope.first_row + M - 1) // rope.rows_per_position
                              >= rope.cos.shape[0]):  # fmt: skip
        raise ValueError(f"rope: rows {rope.first_row}..{rope.first_row + M - 1} at "
                         f"{rope.rows_per_position} a position pass the tables' "
                         f"{rope.cos.shape[0]} positions")  # fmt: skip


@dataclass
class Plan:
    """What `matmul` works out once per call signature (shapes, strides, dtypes, flags,
    alignment): the operands checked, the tuner's key and the launch's meta. A later
    call with the same signature only looks it up, and once the tuner's pick is settled
    launches with the grid and keywords kept for it (host time a call, launch stubbed:
    24 -> 10 -> 8 µs)."""

    M: int
    N: int
    K: int
    c_dtype: torch.dtype
    device: torch.device
    key: tuple
    scalars: tuple  # the kernel's strides and sizes (all but the rotation's first row)
    meta: dict  # its constexprs
    programs: int | None  # SMs (a persistent TMA grid), None in the interpreter
    # per implementation asked for, the pick and its launch once launched (`tuning.Settled`)
    settled: dict = field(default_factory=dict)

    def __post_init__(self):
        self.shape = (self.M, self.N)  # a new C's

    def launch_arguments(self, config: triton.Config) -> tuple[tuple, dict]:
        """The grid and keyword arguments of a launch with `config`."""
        tiles = cdiv(self.M, config.kwargs["BLOCK_M"]) * cdiv(self.N, config.kwargs["BLOCK_N"])
        grid = (tiles if self.programs is None else min(tiles, self.programs),)
        return grid, {**self.meta, **config.all_kwargs()}


PLANS: dict[tuple, Plan] = {}
MAX_PLANS = 4096  # a property test's many shapes: start over rather than grow


def layout(t: torch.Tensor | None) -> tuple | None:
    """What a key holds of a tensor: shape, strides, dtype, device and 16-byte alignment
    (None for none)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def signature(a, b, bias, out, accumulate, out_dtype, tune_only, rope, second, gated) -> tuple:
    # alignment decides TMA; the fp32 precision decides fp32's dot (read for fp32 only);
    # a rotation's first row is an argument of each launch. A call with none of the
    # optional operands (most of them) has the short key: fewer reads, a cheaper hash.
    dtype = a.dtype
    key = (
        a.shape, a.stride(), b.shape, b.stride(), dtype, b.dtype, a.device, a.data_ptr() % 16,
        b.data_ptr() % 16, accumulate, out_dtype, tune_only,
        dtype == torch.float32 and torch.get_float32_matmul_precision(),
        common.tma_compatible,  # the TMA rule in force (tests swap it for the pointer path)
    )  # fmt: skip
    if bias is None and out is None and rope is None and second is None and gated is None:
        return key
    if gated is not None:
        g, u, c2, h = gated_tensors(gated)
        gated = (type(gated), gated.activation, layout(g), layout(u), layout(c2), layout(h))
    return (
        key,
        bias is not None and (bias.shape, bias.stride(), bias.dtype),
        out is not None and (out.shape, out.stride(), out.dtype, out.data_ptr() % 16),
        rope is not None and (rope.cos.shape, rope.cos.stride(), rope.sin.shape,
                              rope.sin.stride(), rope.cos.dtype, rope.sin.dtype,
                              rope.cos.device, rope.sin.device, rope.rows_per_position),
        second is not None and (second[0].shape, second[0].stride(), second[0].dtype,
                                second[0].device, second[0].data_ptr() % 16,
                                second[1] is not None and (second[1].shape, second[1].stride(),
                                                           second[1].dtype), second[2]),
        gated,
    )  # fmt: skip
