"""Linear attention (the gated delta rule of Gated DeltaNet and Kimi's KDA): the Triton
kernels, their launchers, torch's chunked implementation and the float64 references, as
one subpackage (``fusedpar.kernels.linear_attention``; docs/linear_attention.md).

| module       | holds                                                                   |
| ------------ | ----------------------------------------------------------------------- |
| `launch`     | the launchers every caller uses: checks, then torch or Triton           |
| `chunk`      | the chunked Triton forward (WY form per chunk, the state over chunks)   |
| `chunk_backward` | the Triton backward (chunk states recomputed, dS in reverse)        |
| `conv1d`     | the short causal convolution before the recurrence (`causal_conv1d`)    |
| `conv1d_torch` | the convolution's torch implementation and its reference            |
| `torch_impl` | torch's chunked implementation (WY/UT form), the CPU default            |
| `reference`  | the token loop (`gated_delta_rule_reference`): the float64 oracle       |
"""

from fusedpar.kernels.linear_attention.launch import (
    MAX_HEAD_DIM,
    check_gated_delta_inputs,
    gated_delta_backward,
    gated_delta_forward,
)
from fusedpar.kernels.linear_attention.reference import (
    gated_delta_rule_reference,
    l2norm_reference,
)

__all__ = [
    "MAX_HEAD_DIM",
    "check_gated_delta_inputs",
    "gated_delta_backward",
    "gated_delta_forward",
    "gated_delta_rule_reference",
    "l2norm_reference",
]
