"""The MoE kernels' contract in plain, differentiable PyTorch, in the inputs' dtype
(float64 in -> the oracle): the references the tests compare `fusedpar.kernels.moe`'s
grouped GEMMs with, and the layer's (`fusedpar.ops.moe.moe_reference`) activation.

| function                   | computes                                                  |
| -------------------------- | --------------------------------------------------------- |
| `swiglu_reference`         | the experts' activation, as Hugging Face writes it        |
| `grouped_matmul_reference` | `grouped_matmul` as a loop over experts                   |
| `expert_swiglu_reference`  | the experts' whole SwiGLU, biases included                |

The permute/combine and weight-gradient references close their kernels' modules
(`moe_permute`, `moe_weight_grad`).
"""

import torch
from fusedpar.kernels import moe_torch
from fusedpar.kernels.moe import SILU, SWIGLU_ALPHA, SWIGLU_LIMIT


def swiglu_reference(g, u, activation="silu", alpha=SWIGLU_ALPHA, limit=SWIGLU_LIMIT,
                     passes=None):  # fmt: skip
    """The experts' activation in plain (differentiable) PyTorch, in the inputs' dtype:
    ``silu(g) * u``, or ``"clamped_swiglu"`` as Hugging Face's GptOssExperts writes it.
    `passes`: None, or (g's, u's) masks of where the clamps let the value through, a
    low-precision run's own decisions: within its rounding of a bound the two sides'
    gradients differ by a whole term, so a float64 oracle follows them there."""
    if activation == "silu":
        return torch.nn.functional.silu(g) * u
    if passes is None:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    else:  # (a clamped value is the bound: no gradient)
        g = torch.where(passes[0], g, limit)
        u = torch.where(passes[1], u, u.detach().clamp(min=-limit, max=limit))
    return (u + 1) * (g * torch.sigmoid(g * alpha))


def grouped_matmul_reference(x, w, counts, rows=None, transpose_w=False, bias=None):
    """`grouped_matmul` as a loop over experts; rows past ``counts.sum()`` are left out."""
    xs = x if rows is None else x[rows]
    slices = moe_torch.expert_slices(counts)
    outs = [xs[s] @ (w[e] if transpose_w else w[e].T) + (0 if bias is None else bias[e])
            for e, s in enumerate(slices)]  # fmt: skip
    return torch.cat(outs) if outs else xs.new_empty((0, w.shape[2 if transpose_w else 1]))


def expert_swiglu_reference(x, experts, counts, rows=None, *, act=SILU, passes=None):
    """``w2[e] @ act(w1[e] @ x + b1[e], w3[e] @ x + b3[e]) + b2[e]`` per expert
    (differentiable): `experts` the stacks (w1, w3, w2, b1, b3, b2), biases None or all
    given (`fusedpar.ops.moe.Experts`); `act` a `fusedpar.kernels.moe.Swiglu`; `passes`
    as `swiglu_reference`'s, in expert order. Returns the kept rows, (counts.sum(), d)."""
    w1, w3, w2, b1, b3, b2 = experts
    h1 = grouped_matmul_reference(x, w1, counts, rows, bias=b1)
    h3 = grouped_matmul_reference(x, w3, counts, rows, bias=b3)
    a = swiglu_reference(h1, h3, *act, passes)
    return grouped_matmul_reference(a, w2, counts, bias=b2)
