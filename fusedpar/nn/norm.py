"""`RMSNorm`: fusedpar's `rms_norm` op as a layer."""

import torch
from torch import nn

from fusedpar.local_params import forward_params
from fusedpar.ops.norm import rms_norm


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2, -1) + eps) * (offset + weight)`` over the last dim.

    A drop-in for Llama-style RMSNorm modules: one parameter, `weight` (dim,), so the
    same state_dict; ``offset=1.0`` gives Gemma's (scaled by ``1 + weight``; the weight
    then starts at zero, else at one). The result has x's dtype, computed in fp32 and
    rounded once, whatever the weight's dtype. Kept for the backward: x and one fp32
    per row (`fusedpar.ops.norm`), not the normalized x.

    Like every parameter not split over a group, `weight` gets the gradient of this
    rank's tokens; `fusedpar.distribute` sums it over the ranks that hold other tokens.
    """

    READS_FORWARD_PARAMS = True  # through `fusedpar.local_params.forward_params`: no hooks

    def __init__(
        self, dim: int, eps: float = 1e-5, *, offset: float = 0.0, device=None, dtype=None
    ):
        super().__init__()
        self.dim, self.eps, self.offset = dim, eps, float(offset)
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """``offset + weight`` starts at one."""
        with torch.no_grad():
            self.weight.fill_(1.0 - self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one op: after fusedpar.distribute it swaps the DTensor weight in its own node
        weight = forward_params(self, x)["weight"]
        return rms_norm(x, weight, self.eps, offset=self.offset)

    def extra_repr(self) -> str:
        offset = f", offset={self.offset}" if self.offset else ""
        return f"{self.dim}, eps={self.eps}{offset}"
