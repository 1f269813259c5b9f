"""The gated MLP's down projection under tensor parallelism: ``down(act(gate) * up)``
with the product recomputed in the backward, its down GEMM the row-parallel ring of
`fusedpar.ops.linear` (or a plain GEMM whose partial the caller all-reduces).

| direction | computes                                                                     |
| --------- | ---------------------------------------------------------------------------- |
| forward   | ``h = act(gate) * up`` (`fusedpar.kernels.gated`), ``y = rs(h @ W^T) + b``     |
| backward  | h again, ``dh = g(dy) @ W``, ``dW = g(dy)^T @ h``; dgate, dup in one pass      |

Saved: gate and up only. An activation with no kernel runs through autograd.
"""

import functools
import warnings

import torch
from torch import Tensor
from torch.nn import functional as F

from fusedpar.comm import active_group, group_name, group_size
from fusedpar.kernels import gated as gated_kernels
from fusedpar.ops.linear import (
    DEFAULT_CHUNKS_PER_RANK,
    _check_chunks,
    _check_linear,
    _flat,
    _matmul_reduce_scatter_backward,
    _matmul_reduce_scatter_forward,
    _row_sum,
)
from fusedpar.ops.registration import direct_op

# --- custom ops: fusedpar::gated and its backward (inside _GatedDown) -------------------


@torch.library.custom_op("fusedpar::gated", mutates_args=())
def _gated_op(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    return gated_kernels.gated(gate, up, activation)


@_gated_op.register_fake
def _(gate, up, activation):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("fusedpar::gated_backward", mutates_args=())
def _gated_backward_op(dh: Tensor, gate: Tensor, up: Tensor,
                       activation: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    return gated_kernels.gated_backward(dh, gate, up, activation)


@_gated_backward_op.register_fake
def _(dh, gate, up, activation):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


_gated = direct_op(_gated_op)
_gated_backward = direct_op(_gated_backward_op)


_WITHOUT_KERNEL: set[str] = set()  # the activations said to have no kernel


def kernel_activation(activation) -> str | None:
    """The fused kernel's name for `activation` (`fusedpar.kernels.gated.ACTIVATIONS`):
    ``F.silu``, ``F.gelu`` and ``gelu(approximate="tanh")``, as functions, partials or
    ``nn.SiLU``/``nn.GELU`` modules. None for any other (it runs through autograd, with
    one warning per activation)."""
    if activation is F.silu or isinstance(activation, torch.nn.SiLU):
        return "silu"
    approximate = None
    if activation is F.gelu:
        approximate = "none"
    elif isinstance(activation, torch.nn.GELU):
        approximate = activation.approximate
    elif (isinstance(activation, functools.partial) and activation.func is F.gelu
          and not activation.args and set(activation.keywords) <= {"approximate"}):  # fmt: skip
        approximate = activation.keywords.get("approximate", "none")
    name = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    if name is None and repr(activation) not in _WITHOUT_KERNEL:
        _WITHOUT_KERNEL.add(repr(activation))
        warnings.warn(f"gated_down: no fused kernel for activation {activation!r} (there is "
                      f"one for silu, gelu and gelu tanh): act(gate) * up and its gradient "
                      f"run through autograd", stacklevel=3)  # fmt: skip
    return name


def _product_vjp(activation, gate, up):
    """``activation(gate) * up`` and its vjp, for an activation with no fused kernel. In
    eager through autograd (about 3x less host time than ``torch.func.vjp``: 34 against
    108 µs at (32, 64)), which a compiled backward does not trace; there
    ``torch.func.vjp``."""
    if torch.compiler.is_compiling():
        return torch.func.vjp(lambda g, u: activation(g) * u, gate, up)
    with torch.enable_grad():
        g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
        product = activation(g) * u
    return product.detach(), lambda d: torch.autograd.grad(product, (g, u), d)


class _GatedDown(torch.autograd.Function):
    """``down(act(gate) * up)`` saving gate and up only: the backward recomputes the
    product (for the down weight's gradient), then dgate and dup in one pass
    (`fusedpar.kernels.gated`; through autograd for an activation with no kernel)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, activation, group, chunks):
        # (float64, a reference model's dtype, has no kernel: autograd's path is exact)
        name = kernel_activation(activation) if gate.dtype != torch.float64 else None
        hidden = _gated(gate, up, name) if name else activation(gate) * up
        if group is None:  # a plain GEMM (classic TP: the caller all-reduces)
            y = torch.nn.functional.linear(hidden, weight, bias)
        else:
            y = _matmul_reduce_scatter_forward(hidden, weight, bias, group, chunks)
        ctx.options = (activation, name, group, chunks, bias is not None)
        ctx.save_for_backward(gate, up, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up, weight = ctx.saved_tensors
        activation, name, group, chunks, has_bias = ctx.options
        needs_g, needs_u, needs_w, needs_b = ctx.needs_input_grad[:4]
        if name:
            hidden = _gated(gate, up, name)
        else:
            hidden, vjp = _product_vjp(activation, gate, up)
        if group is None:
            dh = dy @ weight
            dw = _flat(dy).t() @ _flat(hidden) if needs_w else None
            db = _row_sum(_flat(dy), weight.dtype) if needs_b and has_bias else None
        else:
            dh, dw, db = _matmul_reduce_scatter_backward(
                dy, hidden, weight, group, chunks, True, needs_w, needs_b and has_bias
            )
            dw, db = dw if needs_w else None, db if needs_b and has_bias else None
        dgate = dup = None
        if needs_g or needs_u:
            dgate, dup = _gated_backward(dh, gate, up, name) if name else vjp(dh)
        return dgate, dup, dw, db, None, None, None


def gated_down(gate, up, weight, group, *, activation, bias=None, sequence_parallel=True,
               chunks_per_rank: int = DEFAULT_CHUNKS_PER_RANK) -> torch.Tensor:  # fmt: skip
    """``down(activation(gate) * up)`` (+ bias): with `sequence_parallel` the down GEMM's
    output reduce-scattered over `group` as in `matmul_reduce_scatter`, else this rank's
    partial (T, ..., N), to be all-reduced by the caller. gate, up (T, ..., K_loc);
    weight (N, K_loc); `activation` any differentiable elementwise function.

    Saved for the backward: gate and up, not ``activation(gate)`` nor the product, which
    the backward recomputes (one elementwise pass) for the down weight's gradient and the
    gate's and up's."""
    if gate.shape != up.shape:
        raise ValueError(f"gated_down: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    if gate.dim() < 2:
        raise ValueError(f"gated_down: gate must be (T, ..., K), got {tuple(gate.shape)}")
    _check_linear(gate, weight, bias, "gated_down")
    _check_chunks(chunks_per_rank)
    name = None
    if sequence_parallel:
        pg = active_group(group)
        size = group_size(pg)
        if gate.shape[0] % size:
            raise ValueError(f"gated_down: dim 0 of gate (shape {tuple(gate.shape)}) has "
                             f"{gate.shape[0]} tokens, not divisible by the group size "
                             f"{size}")  # fmt: skip
        name = group_name(pg)
    return _GatedDown.apply(gate, up, weight, bias, activation, name, chunks_per_rank)
