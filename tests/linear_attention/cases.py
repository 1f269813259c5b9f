"""The linear-attention family's cases: the opcheck cases of its custom ops
(`opcheck_cases`, run by tests/test_compile.py). The compile-gate cases of its Triton
kernels (`GATE_CASES`) come with the kernels, in functions of their own."""

import torch

from tests.support.opcheck import leaf

# --- opcheck cases (tests/test_compile.py runs them on 2 ranks) ---


def _gdn_leaves(B, T, Hk, Hv, K, V, *, per_channel=False):
    """q, k, v, g, beta of the op, small and random, requiring grad: unit keys, gates
    <= 0 and beta in (0, 2)."""
    q = leaf(B, T, Hk, K)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, K), dim=-1).requires_grad_()
    v = leaf(B, T, Hv, V)
    g = (-torch.rand((B, T, Hv, K) if per_channel else (B, T, Hv)) * 3).requires_grad_()
    beta = (2 * torch.rand(B, T, Hv)).requires_grad_()
    return q, k, v, g, beta


def opcheck_cases(group: str) -> list:
    """(op, args) for ``fusedpar::gated_delta_rule`` and its backward: two sequences past
    a chunk (GVA, K != V) with an initial state; packed documents with a per-channel gate
    and no initial state; the backward with and without the final state's gradient.
    `group` is unused (the ops do not communicate)."""
    ops = torch.ops.fusedpar
    batched = (*_gdn_leaves(2, 70, 1, 2, 8, 4), leaf(2, 2, 8, 4), None, 0.5)
    cu = torch.tensor([0, 5, 5, 20], dtype=torch.int32)
    packed = (*_gdn_leaves(1, 20, 2, 2, 4, 8, per_channel=True), None, cu, 0.25)
    o, final = ops.gated_delta_rule(*batched)
    o_packed, _ = ops.gated_delta_rule(*packed)
    return [
        (ops.gated_delta_rule, batched),
        (ops.gated_delta_rule, packed),
        (ops.gated_delta_rule_backward, (torch.randn_like(o), torch.randn_like(final), *batched)),
        (ops.gated_delta_rule_backward, (torch.randn_like(o_packed), None, *packed)),
    ]
