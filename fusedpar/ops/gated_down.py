"""The gated MLP's down projection under tensor parallelism: ``down(act(gate) * up)``
with the product recomputed in the backward, its down GEMM the row-parallel ring of
`fusedpar.ops.linear` (or a plain GEMM whose partial the caller all-reduces).

| direction | computes                                                                     |
| --------- | ---------------------------------------------------------------------------- |
| forward   | ``h = act(gate) * up`` (`fusedpar.kernels.gated`), ``y = rs(h @ W^T) + b``     |
| backward  | ``dh = g(dy) @ W``, each chunk's GEMM ending in dgate, dup and h again         |
|           | (`GatedGrad`: dh never stored), then ``dW = g(dy)^T @ h``                     |

Saved: gate and up only. An activation with no kernel runs through autograd: h again,
dh, then the product's vjp.
"""

import functools
import warnings

import torch
from torch import Tensor
from torch.nn import functional as F

from fusedpar.comm import active_group, group_by_name, group_name, group_size
from fusedpar.kernels import gated as gated_kernels
from fusedpar.kernels.matmul import GatedGrad, matmul
from fusedpar.ops.linear import (
    DEFAULT_CHUNKS_PER_RANK,
    _check_chunks,
    _check_linear,
    _check_reduce_dtype,
    _matmul_reduce_scatter_backward,
    _matmul_reduce_scatter_forward,
)
from fusedpar.ops.overlap import ring_chunks
from fusedpar.ops.registration import direct_op, flat, row_sum
from fusedpar.ops.tp_schedules import gather_matmuls

# --- custom ops: fusedpar::gated and the backward (inside _GatedDown) -------------------


@torch.library.custom_op("fusedpar::gated", mutates_args=())
def _gated_op(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    return gated_kernels.gated(gate, up, activation)


@_gated_op.register_fake
def _(gate, up, activation):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("fusedpar::gated_down_backward", mutates_args=())
def _gated_down_backward_op(
    dy: Tensor,
    gate: Tensor,
    up: Tensor,
    weight: Tensor,
    activation: str,
    group: str,
    chunks: int,
    needs: list[bool],
) -> list[Tensor]:
    """[[dgate | dup] (T, ..., 2K_loc), dW, db], each empty when `needs` (gate or up,
    weight, bias) does not ask for it: dh's GEMMs (those of the all-gather ring of dy
    under `group`; "": the plain GEMM of classic TP) end in dgate, dup and, for dW, h
    (`GatedGrad`), and ``dW = g(dy)^T @ h``. One buffer holds [dgate | dup | h], so no
    op output aliases another: the caller splits [dgate | dup]."""
    needs_gu, needs_w, needs_b = needs
    pg = group_by_name(group) if group else None
    dy2d, gate2d, up2d = flat(dy), flat(gate), flat(up)
    if up2d.stride() != gate2d.stride():  # the epilogue reads both with one set of strides
        gate2d, up2d = gate2d.contiguous(), up2d.contiguous()
    M, K = gate2d.shape
    dy_full, hidden, grads = dy2d, None, gate.new_empty(0)
    if needs_gu:
        buffer = gate.new_empty((M, (3 if needs_w else 2) * K))
        hidden = buffer[:, 2 * K :] if needs_w else None
        grad = GatedGrad(gate2d, up2d, buffer[:, K : 2 * K], hidden, activation)
        if pg is None:
            matmul(dy2d, weight, out=buffer[:, :K], gated=grad)
        else:
            _, dy_full = gather_matmuls(
                dy2d, [weight], [None], pg, chunks, epilogues=[grad], outs=[buffer[:, :K]]
            )
        grads = buffer[:, : 2 * K].view(*gate.shape[:-1], 2 * K)
    elif needs_w:  # h alone; under SP, dy's rows gathered with no GEMM
        hidden = gated_kernels.gated(gate2d, up2d, activation)
        if pg is not None:
            _, dy_full = gather_matmuls(dy2d, [], [], pg, chunks)
    dw = matmul(dy_full.t(), hidden) if needs_w else weight.new_empty(0)
    db = row_sum(dy2d, weight.dtype) if needs_b else weight.new_empty(0)
    return [grads, dw, db]


@_gated_down_backward_op.register_fake
def _(dy, gate, up, weight, activation, group, chunks, needs):
    needs_gu, needs_w, needs_b = needs
    K = gate.shape[-1]
    grads = gate.new_empty(0)
    if needs_gu:  # [dgate | dup] of a [dgate | dup | h] buffer with needs_w: the real layout
        grads = gate.new_empty((*gate.shape[:-1], (3 if needs_w else 2) * K))[..., : 2 * K]
    return [
        grads,
        weight.new_empty(weight.shape if needs_w else 0),
        weight.new_empty(weight.shape[0] if needs_b else 0),
    ]


_gated = direct_op(_gated_op)
_gated_down_backward = direct_op(_gated_down_backward_op)


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
    elif (
        isinstance(activation, functools.partial)
        and activation.func is F.gelu
        and not activation.args
        and set(activation.keywords) <= {"approximate"}
    ):
        approximate = activation.keywords.get("approximate", "none")
    name = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    # (said in an eager call: a warning inside a compiled graph is a graph break)
    quiet = torch.compiler.is_compiling() or repr(activation) in _WITHOUT_KERNEL
    if name is None and not quiet:
        _WITHOUT_KERNEL.add(repr(activation))
        warnings.warn(
            f"gated_down: no fused kernel for activation {activation!r} (there is "
            f"one for silu, gelu and gelu tanh): act(gate) * up and its gradient "
            f"run through autograd",
            stacklevel=3,
        )
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
    """``down(act(gate) * up)`` saving gate and up only: the backward's dh GEMMs end in
    dgate, dup and the product again (for the down weight's gradient); through autograd
    for an activation with no kernel."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, activation, group, chunks, reduce_dtype):
        name = kernel_activation(activation)
        hidden = _gated(gate, up, name) if name else activation(gate) * up
        if group is None:  # a plain GEMM (classic TP: the caller all-reduces)
            y = torch.nn.functional.linear(hidden, weight, bias)
        else:
            y = _matmul_reduce_scatter_forward(hidden, weight, bias, group, chunks, reduce_dtype)
        ctx.options = (activation, name, group, chunks, bias is not None)
        ctx.save_for_backward(gate, up, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up, weight = ctx.saved_tensors
        activation, name, group, chunks, has_bias = ctx.options
        needs_g, needs_u, needs_w, needs_b = ctx.needs_input_grad[:4]
        needs_b = needs_b and has_bias
        if name:  # dh's GEMMs end in dgate, dup and h (`_gated_down_backward_op`)
            needs = [needs_g or needs_u, needs_w, needs_b]
            grads, dw, db = _gated_down_backward(
                dy, gate, up, weight, name, group or "", chunks, needs
            )
            K = gate.shape[-1]
            dgate, dup = (grads[..., :K], grads[..., K:]) if needs[0] else (None, None)
            return (
                dgate,
                dup,
                dw if needs_w else None,
                db if needs_b else None,
                None,
                None,
                None,
                None,
            )
        hidden, vjp = _product_vjp(activation, gate, up)
        if group is None:
            dh = dy @ weight
            dw = flat(dy).t() @ flat(hidden) if needs_w else None
            db = row_sum(flat(dy), weight.dtype) if needs_b else None
        else:
            dh, dw, db = _matmul_reduce_scatter_backward(
                dy, hidden, weight, group, chunks, True, needs_w, needs_b
            )
            dw, db = dw if needs_w else None, db if needs_b else None
        dgate, dup = vjp(dh) if needs_g or needs_u else (None, None)
        return dgate, dup, dw, db, None, None, None, None


def gated_down(
    gate,
    up,
    weight,
    group,
    *,
    activation,
    bias=None,
    sequence_parallel=True,
    chunks_per_rank: int = DEFAULT_CHUNKS_PER_RANK,
    overlap: str | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``down(activation(gate) * up)`` (+ bias): with `sequence_parallel` the down GEMM's
    output reduce-scattered over `group` as in `matmul_reduce_scatter`, else this rank's
    partial (T, ..., N), to be all-reduced by the caller. gate, up (T, ..., K_loc);
    weight (N, K_loc); `activation` any differentiable elementwise function.

    Saved for the backward: gate and up, not ``activation(gate)`` nor the product, which
    the backward recomputes (one elementwise pass) for the down weight's gradient and the
    gate's and up's. ``overlap`` and ``reduce_dtype`` (the reduce-scatter's partials'
    dtype) as in `fusedpar.ops.linear.matmul_reduce_scatter`."""
    if gate.shape != up.shape:
        raise ValueError(f"gated_down: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    if gate.dim() < 2:
        raise ValueError(f"gated_down: gate must be (T, ..., K), got {tuple(gate.shape)}")
    _check_linear(gate, weight, bias, "gated_down")
    _check_chunks(chunks_per_rank)
    _check_reduce_dtype(reduce_dtype, "gated_down")
    name, chunks = None, chunks_per_rank
    if sequence_parallel:
        pg = active_group(group)
        size = group_size(pg)
        if gate.shape[0] % size:
            raise ValueError(
                f"gated_down: dim 0 of gate (shape {tuple(gate.shape)}) has "
                f"{gate.shape[0]} tokens, not divisible by the group size "
                f"{size}"
            )
        name, chunks = group_name(pg), ring_chunks(overlap, pg, chunks_per_rank)
    return _GatedDown.apply(gate, up, weight, bias, activation, name, chunks, reduce_dtype)
