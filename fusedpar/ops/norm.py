"""RMSNorm as differentiable ops: `rms_norm`, and `rms_norm_gated` (the gated norm
after Gated DeltaNet's recurrence: ``weight * rmsnorm(x) * act(z)``).

| op         | forward                                         | saved for the backward   |
| ---------- | ----------------------------------------------- | ------------------------ |
| `rms_norm` | ``y = x * rstd * (offset + weight)``, fp32 inside | x, and rstd (fp32, one  |
|            |                                                 | per row); not y nor x/rms |
| ``rope=``  | then y's RoPE rotation, before one rounding      | and the tables           |
| `rms_norm_gated` | y times ``act(z)`` (silu or sigmoid), one rounding | and z             |

The backward (`fusedpar.kernels.rms_norm.rms_norm_backward`) recomputes the normalized
rows from x and rstd; the weight's gradient is summed without atomics (the same bits
on every run). Both directions are ``torch.library`` custom ops, so a model using them
compiles as one graph.
"""

import torch
from torch import Tensor

from fusedpar.kernels import rms_norm as kernels
from fusedpar.kernels.common import accumulator
from fusedpar.ops.registration import asked, autograd_op, direct_op


def _rope(cos: Tensor | None, sin: Tensor | None):
    return None if cos is None else (cos, sin)


@torch.library.custom_op("fusedpar::rms_norm", mutates_args=())
def _rms_norm_op(
    x: Tensor, weight: Tensor, eps: float, offset: float, cos: Tensor | None, sin: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(y (x's shape and dtype), rstd (x.shape[:-1]) float32, float64 for float64 x); y
    rotated by cos, sin where given."""
    return kernels.rms_norm(x, weight, eps, offset, _rope(cos, sin))


@_rms_norm_op.register_fake
def _(x, weight, eps, offset, cos, sin):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=accumulator(x.dtype))


@torch.library.custom_op("fusedpar::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    rstd: Tensor,
    eps: float,
    offset: float,
    cos: Tensor | None,
    sin: Tensor | None,
    need_x: bool,
    need_weight: bool,
) -> tuple[Tensor, Tensor]:
    """(dx, dweight); a gradient not asked for comes back as an empty (0,) tensor."""
    dx, dw = kernels.rms_norm_backward(
        dy,
        x,
        weight,
        rstd,
        offset,
        eps=eps,
        need_x=need_x,
        need_weight=need_weight,
        rope=_rope(cos, sin),
    )
    return (x.new_empty(0) if dx is None else dx, weight.new_empty(0) if dw is None else dw)


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd, eps, offset, cos, sin, need_x, need_weight):
    return (
        x.new_empty(x.shape if need_x else 0),
        weight.new_empty(weight.shape if need_weight else 0),
    )


def _setup(ctx, inputs, output):
    x, weight, eps, offset, cos, sin = inputs
    ctx.options = (eps, offset, x.requires_grad, weight.requires_grad)
    ctx.save_for_backward(x, weight, output[1], cos, sin)


def _backward(ctx, dy, _):
    x, weight, rstd, cos, sin = ctx.saved_tensors
    eps, offset, need_x, need_weight = ctx.options
    dx, dw = _rms_norm_backward(dy, x, weight, rstd, eps, offset, cos, sin, need_x, need_weight)
    return (dx if need_x else None), (dw if need_weight else None), None, None, None, None


_rms_norm_backward = direct_op(_rms_norm_backward_op)
_rms_norm = autograd_op(_rms_norm_op, _backward, _setup)  # the bodies, in plain eager


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float = 1e-5,
    *,
    offset: float = 0.0,
    rope: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * (offset + weight)``: x (..., D) any float dtype
    and strides; weight (D,); the result in x's dtype, computed in fp32 and rounded once.
    ``offset=1.0`` is Gemma's RMSNorm (its weight starts at zero). Saves x and one fp32
    per row for the backward. float64 x (torch's implementation): all of it in float64.

    ``rope=(cos, sin)`` (S, r/2) float32 (float64 for float64 x), x (S, ..., D): the
    result rotated as `fusedpar.ops.attention.rope` rotates (pairs i, i + r/2 of a row
    at position s by the angles of row s, the last D - r dims passing), before its one
    rounding: a q/k head norm and RoPE in one launch each way. The tables take no
    gradient."""
    kernels.check_inputs(x, weight)
    if rope is not None:
        kernels.check_rope(x, rope)
        if rope[0].requires_grad or rope[1].requires_grad:
            raise ValueError(
                "rms_norm: rope's tables take no gradient here; rotate with "
                "fusedpar.nn.attention_parts.apply_rope for tables that need "
                "one"
            )
    cos, sin = rope if rope is not None else (None, None)
    y, _ = _rms_norm(x, weight, float(eps), float(offset), cos, sin)
    return y


@torch.library.custom_op("fusedpar::rms_norm_gated", mutates_args=())
def _rms_norm_gated_op(
    x: Tensor, z: Tensor, weight: Tensor, eps: float, gate: str
) -> tuple[Tensor, Tensor]:
    """(y (x's shape and dtype), rstd (x.shape[:-1]) float32, float64 for float64 x)."""
    return kernels.rms_norm_gated(x, z, weight, eps, gate)


@_rms_norm_gated_op.register_fake
def _(x, z, weight, eps, gate):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=accumulator(x.dtype))


@torch.library.custom_op("fusedpar::rms_norm_gated_backward", mutates_args=())
def _rms_norm_gated_backward_op(
    dy: Tensor,
    x: Tensor,
    z: Tensor,
    weight: Tensor,
    rstd: Tensor,
    eps: float,
    gate: str,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dz, dweight); a gradient not asked for comes back as an empty (0,) tensor."""
    grads = kernels.rms_norm_gated_backward(dy, x, z, weight, rstd, eps=eps, gate=gate, needs=needs)
    return tuple(x.new_empty(0) if g is None else g for g in grads)


@_rms_norm_gated_backward_op.register_fake
def _(dy, x, z, weight, rstd, eps, gate, needs):
    return tuple(
        t.new_empty(t.shape if need else 0) for t, need in zip((x, z, weight), needs, strict=True)
    )


def _gated_setup(ctx, inputs, output):
    x, z, weight, eps, gate = inputs
    ctx.options = (eps, gate)
    ctx.needs = [x.requires_grad, z.requires_grad, weight.requires_grad]
    ctx.save_for_backward(x, z, weight, output[1])


def _gated_backward(ctx, dy, _):
    x, z, weight, rstd = ctx.saved_tensors
    eps, gate = ctx.options
    grads = _rms_norm_gated_backward(dy, x, z, weight, rstd, eps, gate, ctx.needs)
    return *asked(grads, ctx.needs), None, None


_rms_norm_gated_backward = direct_op(_rms_norm_gated_backward_op)
_rms_norm_gated = autograd_op(_rms_norm_gated_op, _gated_backward, _gated_setup)


def rms_norm_gated(
    x: Tensor, z: Tensor, weight: Tensor, *, eps: float, gate: str = "silu"
) -> Tensor:
    """``weight * x / sqrt(mean(x^2, -1) + eps) * act(z)``, act ``gate``: "silu" (Gated
    DeltaNet's output norm) or "sigmoid" (Kimi's). x, z (..., D) any float dtype and
    strides, z of x's shape; weight (D,), shared by every head when the rows are
    (B, T, H, D) heads. The result in x's dtype, computed in fp32 (statistics
    included) and rounded once; one kernel each way, the backward recomputing the
    normalized rows from x and one fp32 rstd per row. Gradients reach x, z and weight."""
    kernels.check_gate(x, z, weight, gate)
    y, _ = _rms_norm_gated(x, z, weight, float(eps), gate)
    return y
