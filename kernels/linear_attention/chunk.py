"""PLACEHOLDER (helper E1's branch): the chunked gated delta rule's Triton launchers are
helper E2's (issue #55); this file stands in for E2's chunk.py until the lead merges it.
The launchers keep the signatures `fusedpar.kernels.linear_attention.launch` calls."""


def chunk_gated_delta_forward(q, k, v, g, beta, *, scale, initial_state, cu_seqlens):
    """``(o, final_state)`` of the Triton kernels (not here yet: see the module doc)."""
    raise NotImplementedError(
        "the gated delta rule's Triton kernels are not on this branch: use the torch "
        "implementation (FUSEDPAR_IMPL=torch, or 'auto' on a CPU)"
    )


def chunk_gated_delta_backward(do, dfinal, q, k, v, g, beta, *, scale, initial_state, cu_seqlens):
    """``(dq, dk, dv, dg, dbeta, dinit)`` of the Triton kernels (not here yet)."""
    raise NotImplementedError(
        "the gated delta rule's Triton kernels are not on this branch: use the torch "
        "implementation (FUSEDPAR_IMPL=torch, or 'auto' on a CPU)"
    )
