"""Linear attention (the gated delta rule of Gated DeltaNet and Kimi's KDA): the Triton
kernels, their launchers, torch's chunked implementation and the float64 references, as
one subpackage (``fusedpar.kernels.linear_attention``).

| module      | holds                                                               |
| ----------- | ------------------------------------------------------------------- |
| `reference` | the token loop (`gated_delta_rule_reference`): the float64 oracle   |
"""

from fusedpar.kernels.linear_attention.reference import (
    gated_delta_rule_reference,
    l2norm_reference,
)

__all__ = ["gated_delta_rule_reference", "l2norm_reference"]
