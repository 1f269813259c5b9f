"""A gated MLP on one rank as one op: ``fusedpar::gated_mlp``.

Shapes: x (..., d); gate and up weights (h, d); down (d, h); biases (h,), (h,), (d,).

| direction | computes                                                                   |
| --------- | -------------------------------------------------------------------------- |
| forward   | ``gate = x Wg^T + bg``, ``up = x Wu^T + bu`` ending in ``h = act(gate) * up``  |
|           | (`gated_up_matmul`), ``y = h Wd^T + bd``                                     |
| backward  | ``dh = dy Wd`` ending in dgate, dup and h again (`gated_grad_matmul`);      |
|           | ``dWd = dy^T h``, ``dx = dgate Wg + dup Wu`` (fp32 sum, rounded once),      |
|           | ``[dWg; dWu] = [dgate | dup]^T x`` (one GEMM), the biases' row sums         |

Saved for the backward: x, gate and up (tokens, h), as the tensor-parallel path saves
them. The math is that path's at one rank (`fusedpar.ops.linear`'s `all_gather_matmul`
into `fusedpar.ops.gated_down`), computed by the same GEMM helpers; as one op it is one
``autograd.Function`` a layer instead of two and their list plumbing: `ParallelSwiGLU`
takes it when its group has one rank (TP 1: data, context or pipeline parallelism only)
and its activation has a kernel (host time: bench/host_overhead.py).
"""

import torch
from torch import Tensor

from fusedpar.kernels import gated as gated_kernels
from fusedpar.kernels.matmul_gated import gated_grad_matmul, gated_up_matmul
from fusedpar.kernels.matmul_sequence import GemmSequence, layout, state
from fusedpar.ops.registration import autograd_op, direct_op, flat, row_sum
from fusedpar.ops.tp_schedules import matmuls_reduce_scatter


@torch.library.custom_op("fusedpar::gated_mlp", mutates_args=())
def _gated_mlp_op(
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    biases: list[Tensor],
    activation: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(y (x's shape), gate, up (tokens, h): kept for the backward). `biases`: none, or
    (bg, bu, bd)."""
    bg, bu, bd = biases or (None, None, None)
    gemm = GemmSequence(
        (
            "gated_mlp",
            layout(x),
            *map(layout, (gate_weight, up_weight, down_weight, *biases)),
            activation,
            *state(),
        )
    )
    # The gate GEMM, then the up GEMM ending in the product (reading the gate it wrote):
    # each on the TMA schedule, and the product with no pass of its own. (`gated_matmul`
    # would be one launch, but on the pointer schedule: TMA serialized its wgmma.)
    x2d = flat(x)
    gate = gemm(x2d, gate_weight.t(), bias=bg)
    up, hidden = gated_up_matmul(
        x2d, up_weight.t(), gate, bias=bu, activation=activation, gemm=gemm
    )
    y = gemm(hidden, down_weight.t(), bias=bd)
    gemm.close()
    return y.view(*x.shape[:-1], y.shape[1]), gate, up


@_gated_mlp_op.register_fake
def _(x, gate_weight, up_weight, down_weight, biases, activation):
    hidden = (x.shape[:-1].numel(), gate_weight.shape[0])
    return (
        x.new_empty((*x.shape[:-1], down_weight.shape[0])),
        x.new_empty(hidden),
        x.new_empty(hidden),
    )


@torch.library.custom_op("fusedpar::gated_mlp_backward", mutates_args=())
def _gated_mlp_backward_op(
    dy: Tensor,
    x: Tensor,
    gate: Tensor,
    up: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    activation: str,
    needs: list[bool],
) -> list[Tensor]:
    """[dx, dW, dWd, db, dbd], `needs` the flags of (x, Wg, Wu, Wd, bg, bu, bd) (the
    biases' may be left out: none). dW: [dWg; dWu] (2h, d) when both are asked for (one
    GEMM), the one asked for (h, d), or empty; db likewise [dbg; dbu] (2h,) if either
    is. An op's outputs may not alias one another: the caller splits them."""
    x_, wg, wu, wd, bg, bu, bd = [*needs, *[False] * (7 - len(needs))]
    gemm = GemmSequence(
        (
            "gated_mlp_backward",
            *map(layout, (dy, x, gate, up, gate_weight, up_weight, down_weight)),
            activation,
            *needs,
            *state(),
        )
    )
    dy2d, gate, up = flat(dy), flat(gate), flat(up)
    dx = dw = dwd = db = dbd = hidden = None
    if x_ or wg or wu or bg or bu:
        # dh's GEMM ends in dgate, dup and (for the down weight) the product again: dh is
        # never stored (`gated_grad_matmul`)
        both, hidden = gated_grad_matmul(
            dy2d, down_weight, gate, up, activation=activation, hidden=wd, gemm=gemm
        )
        dgate, dup = both.chunk(2, 1)
        if x_:  # the fp32 sum of both products, rounded once
            pairs = [(dgate, gate_weight), (dup, up_weight)]
            dx = matmuls_reduce_scatter(pairs, None, 1, x.dtype, gemm=gemm).view(x.shape)
        if wg or wu:  # [dWg; dWu] in one GEMM, or the one asked for
            dw = gemm((both if wg and wu else dgate if wg else dup).t(), flat(x))
        if bg or bu:
            db = row_sum(both, gate_weight.dtype)
    if wd:
        if hidden is None:
            hidden = gated_kernels.gated(gate, up, activation)
        dwd = gemm(dy2d.t(), hidden)
    gemm.close()
    if bd:
        dbd = row_sum(dy2d, down_weight.dtype)
    grads = [dx, dw, dwd, db, dbd]
    if any(g is None for g in grads):  # empty for those not asked for, in the fake's dtypes
        like = (x, gate_weight, down_weight, gate_weight, down_weight)
        grads = [t.new_empty(0) if g is None else g for g, t in zip(grads, like, strict=True)]
    return grads


@_gated_mlp_backward_op.register_fake
def _(dy, x, gate, up, gate_weight, up_weight, down_weight, activation, needs):
    x_, wg, wu, wd, bg, bu, bd = [*needs, *[False] * (7 - len(needs))]
    h, d = gate_weight.shape
    return [
        x.new_empty(x.shape if x_ else 0),
        gate_weight.new_empty(((wg + wu) * h, d) if wg or wu else 0),
        down_weight.new_empty(down_weight.shape if wd else 0),
        gate_weight.new_empty(2 * h if bg or bu else 0),
        down_weight.new_empty(d if bd else 0),
    ]


def _setup(ctx, inputs, output):
    x, gate_weight, up_weight, down_weight, biases, activation = inputs
    ctx.needs = [t.requires_grad for t in (x, gate_weight, up_weight, down_weight, *biases)]
    ctx.activation = activation
    ctx.set_materialize_grads(False)  # gate and up take no gradient: no zeros made for them
    ctx.save_for_backward(x, output[1], output[2], gate_weight, up_weight, down_weight)


def _backward(ctx, dy, _gate, _up):
    x, gate, up, *weights = ctx.saved_tensors
    if dy is None:  # (only gate or up was used, which the layer never returns)
        dy = x.new_zeros((*x.shape[:-1], weights[2].shape[0]))
    dx, dw, dwd, db, dbd = _gated_mlp_backward(dy, x, gate, up, *weights, ctx.activation, ctx.needs)
    x_, wg, wu, wd, *biases = ctx.needs
    # [dWg; dWu] and [dbg; dbu] split in one call each (`_gated_mlp_backward_op`)
    dwg, dwu = dw.chunk(2) if wg and wu else (dw if wg else None, dw if wu else None)
    grads = [dx if x_ else None, dwg, dwu, dwd if wd else None]
    if biases:  # (bg, bu, bd)
        bg, bu, bd = biases
        dbg, dbu = db.chunk(2) if bg or bu else (None, None)  # (2h,) if either
        grads.append([dbg if bg else None, dbu if bu else None, dbd if bd else None])
    else:
        grads.append([])
    return *grads, None


_gated_mlp_backward = direct_op(_gated_mlp_backward_op)
_gated_mlp = autograd_op(_gated_mlp_op, _backward, _setup)


def gated_mlp(
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    biases=(),
    *,
    activation: str,
) -> Tensor:
    """``down(act(gate(x)) * up(x))`` on one rank (the module doc's table); `biases`:
    () or (bg, bu, bd); `activation` one of `fusedpar.kernels.gated.ACTIVATIONS`. The
    caller (`ParallelSwiGLU`) has checked the shapes."""
    y, _, _ = _gated_mlp(x, gate_weight, up_weight, down_weight, list(biases), activation)
    return y
