"""`add_aux_loss`: an auxiliary loss's gradient started where the loss arises.

    y, aux = moe(x)
    y = fp.nn.add_aux_loss(y, aux)    # y unchanged; aux's backward runs with y's

A MoE layer's load-balancing loss is computed in the layer, but the loss the user
differentiates is computed at the end of the model; under pipeline parallelism they are
on different ranks, and only the hidden state passes between them. `add_aux_loss`
returns `y` as it is and, when `y`'s gradient arrives in the backward, gives `aux` the
gradient 1: the router gets ``d aux / d router`` as if ``aux`` had been added to the
final loss, and no loss crosses a stage. (torchtitan and DeepSeek's models do the same.)

| forward          | backward                                   |
| ---------------- | ------------------------------------------ |
| ``out = y``      | ``dy = d out``; ``d aux = 1`` (its shape)  |

The schedules' gradient scaling applies to it as to the rest: under a mean over
microbatches, each microbatch's auxiliary loss counts 1 / M, as its main loss does.
"""

import torch


class _AddAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, aux):
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        d_aux = None
        if ctx.needs_input_grad[1]:
            d_aux = torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=dy.device)
        return dy, d_aux


def add_aux_loss(y: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """`y`, through which `aux` (any shape, usually a scalar) gets the gradient 1 in the
    backward: the same gradients as adding ``aux.sum()`` to the loss. An `aux` that
    needs no gradient (coefficients 0, or no grad mode) returns `y` itself."""
    if not isinstance(aux, torch.Tensor) or not aux.requires_grad:
        return y
    return _AddAuxLoss.apply(y, aux)
