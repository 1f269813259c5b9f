"""RMSNorm as a differentiable op: `rms_norm`.

| op         | forward                                         | saved for the backward   |
| ---------- | ----------------------------------------------- | ------------------------ |
| `rms_norm` | ``y = x * rstd * (offset + weight)``, fp32 inside | x, and rstd (fp32, one  |
|            |                                                 | per row); not y nor x/rms |

The backward (`fusedpar.kernels.rms_norm.rms_norm_backward`) recomputes the normalized
rows from x and rstd; the weight's gradient is summed without atomics (the same bits
on every run). Both directions are ``torch.library`` custom ops, so a model using them
compiles as one graph.
"""

import torch
from torch import Tensor

from fusedpar.kernels import rms_norm as kernels
from fusedpar.ops.registration import autograd_op, direct_op


@torch.library.custom_op("fusedpar::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Tensor, eps: float, offset: float) -> tuple[Tensor, Tensor]:
    """(y (x's shape and dtype), rstd (x.shape[:-1]) float32)."""
    return kernels.rms_norm(x, weight, eps, offset)


@_rms_norm_op.register_fake
def _(x, weight, eps, offset):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("fusedpar::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, eps: float,
                          offset: float, need_x: bool,
                          need_weight: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(dx, dweight); a gradient not asked for comes back as an empty (0,) tensor."""
    dx, dw = kernels.rms_norm_backward(dy, x, weight, rstd, offset, eps=eps, need_x=need_x,
                                       need_weight=need_weight)  # fmt: skip
    return (x.new_empty(0) if dx is None else dx, weight.new_empty(0) if dw is None else dw)


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd, eps, offset, need_x, need_weight):
    return (x.new_empty(x.shape if need_x else 0),
            weight.new_empty(weight.shape if need_weight else 0))  # fmt: skip


def _setup(ctx, inputs, output):
    x, weight, eps, offset = inputs
    ctx.options = (eps, offset, x.requires_grad, weight.requires_grad)
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy, _):
    x, weight, rstd = ctx.saved_tensors
    eps, offset, need_x, need_weight = ctx.options
    dx, dw = _rms_norm_backward(dy, x, weight, rstd, eps, offset, need_x, need_weight)
    return (dx if need_x else None), (dw if need_weight else None), None, None


_rms_norm_backward = direct_op(_rms_norm_backward_op)
_rms_norm = autograd_op(_rms_norm_op, _backward, _setup)  # the bodies, in plain eager


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-5, *, offset: float = 0.0) -> Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * (offset + weight)``: x (..., D) any float dtype
    and strides; weight (D,); the result in x's dtype, computed in fp32 and rounded once.
    ``offset=1.0`` is Gemma's RMSNorm (its weight starts at zero). Saves x and one fp32
    per row for the backward."""
    kernels._check(x, weight)
    y, _ = _rms_norm(x, weight, float(eps), float(offset))
    return y
