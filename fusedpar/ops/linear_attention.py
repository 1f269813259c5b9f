"""`gated_delta_rule`: the custom op ``fusedpar::gated_delta_rule`` (with its backward op
and autograd registered through ``torch.library``) over the gated delta rule's launchers
(`fusedpar.kernels.linear_attention`), and the public function with
flash-linear-attention's ``chunk_gated_delta_rule`` signature.

Per value head (reading key head ``j // (Hv / Hk)``), state S (K, V) in fp32:

| step  | math                                                                      |
| ----- | ------------------------------------------------------------------------- |
| decay | ``S <- exp(g_t) S`` (g (B, T, Hv): a scalar; (B, T, Hv, K): S's rows)     |
| delta | ``S <- S + beta_t k_t (v_t - S^T k_t)^T``                                 |
| read  | ``o_t = S^T (scale q_t)``                                                 |

Gradients reach q, k, v, g, beta and the initial state, from o and the final state. The
backward recomputes the chunk states: the op saves its inputs only (so selective
checkpointing keeps the recurrence's inputs, never its states).
"""

import torch
from torch import Tensor

from fusedpar.comm import Group, group_rank, group_size, resolve_group
from fusedpar.kernels.common import accumulator
from fusedpar.kernels.linear_attention import (
    check_gated_delta_inputs,
    gated_delta_backward,
    gated_delta_forward,
    l2norm_reference,
)
from fusedpar.ops.linear_attention_cp import (
    context_parallel_gated_delta,
    head_parallel_gated_delta,
)
from fusedpar.ops.registration import asked, autograd_op, direct_op
from fusedpar.ops.sequence import check_crossing_groups
from fusedpar.ops.spans import Spans

# --- custom ops: fusedpar::gated_delta_rule and its backward -----------------------------
# No argument has a default (the dispatcher leaves out one given at its default). The
# op always returns the final state (N, Hv, K, V): the public function drops it unless
# asked. cu_seqlens' values are read inside the op: a compiled graph never sees the read.


def _documents(q: Tensor, cu_seqlens: Tensor | None) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


@torch.library.custom_op("fusedpar::gated_delta_rule", mutates_args=())
def _gated_delta_rule_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor]:
    return gated_delta_forward(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )


@_gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale):
    B, T, _, K = q.shape
    Hv, V = v.shape[-2:]
    N = _documents(q, cu_seqlens)
    return v.new_empty((B, T, Hv, V)), q.new_empty((N, Hv, K, V), dtype=accumulator(q.dtype))


@torch.library.custom_op("fusedpar::gated_delta_rule_backward", mutates_args=())
def _gated_delta_rule_backward_op(
    do: Tensor,
    dfinal: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # an op returns tensors only: no initial state, an empty dinit (None again in
    # `_backward`)
    grads = gated_delta_backward(
        do,
        dfinal,
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
    )
    dinit = grads[5] if initial_state is not None else q.new_empty((0,))
    return (*grads[:5], dinit)


@_gated_delta_rule_backward_op.register_fake
def _(do, dfinal, q, k, v, g, beta, initial_state, cu_seqlens, scale):
    dinit = (
        q.new_empty((0,)) if initial_state is None else initial_state.new_empty(initial_state.shape)
    )
    return (*(t.new_empty(t.shape) for t in (q, k, v, g, beta)), dinit)


def _setup(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.scale = scale
    ctx.needs = [t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state)]
    # an unused output's gradient comes as None, not zeros: no final state's gradient
    # skips its term
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dfinal):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    if do is None:  # only the final state was used
        do = torch.zeros(v.shape, dtype=v.dtype, device=v.device)  # o's shape
    grads = _gated_delta_rule_backward(
        do, dfinal, q, k, v, g, beta, initial_state, cu_seqlens, ctx.scale
    )
    return (*asked(grads, ctx.needs), None, None)


_gated_delta_rule_backward = direct_op(_gated_delta_rule_backward_op)
_gated_delta_rule = autograd_op(_gated_delta_rule_op, _backward, _setup)


def l2norm_heads(x: Tensor) -> Tensor:
    """``x * rsqrt(sum(x^2) + 1e-6)`` per head, in fp32 (float64 for float64), rounded
    once to x's dtype; autograd differentiates it."""
    return l2norm_reference(x.to(accumulator(x.dtype))).to(x.dtype)


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    group: Group = None,
    layout: str = "zigzag",
    ulysses_group: Group = None,
) -> tuple[Tensor, Tensor | None]:
    """The gated delta rule (Gated DeltaNet; KDA with a per-channel g), chunked: the
    signature of flash-linear-attention's ``chunk_gated_delta_rule``, which Hugging
    Face's Qwen3-Next and Qwen3.5 call.

    q, k (B, T, Hk, K); v (B, T, Hv, V), Hv a multiple of Hk (GVA: v-head j reads
    k-head j // (Hv / Hk), never repeated in memory); K, V <= 256, not necessarily
    equal; fp16, bf16 or fp32 (q, k, v one dtype), or float64 throughout on torch's
    implementation. g (B, T, Hv) or (B, T, Hv, K): log decays (<= 0), any float dtype;
    beta (B, T, Hv), any sign and size (OLMo Hybrid's reach 2). ``scale`` defaults to
    ``K ** -0.5``. With `use_qk_l2norm_in_kernel` q and k are first normalized per head,
    ``x * rsqrt(sum(x^2) + 1e-6)``. `initial_state` (N, Hv, K, V): the state before the
    first token, N = B, or with `cu_seqlens` (int32 (N + 1,), the documents of a packed
    stream, B = 1; the state restarts at every document) one per document.

    Returns ``(o, final_state)``: o (B, T, Hv, V) in v's dtype; final_state (N, Hv, K,
    V) fp32 (float64 for float64) when `output_final_state`, else None. Gradients for
    q, k, v, g, beta and initial_state, from both outputs.

    With a context-parallel `group` (size > 1), q, k, v, g and beta are this rank's shard
    of the sequence as ``fusedpar.shard_sequence(x, group, layout=layout)`` gives it, and
    o is this rank's shard of the single-device result (`fusedpar.ops.linear_attention_cp`).
    `initial_state`, `cu_seqlens` (the whole packed stream's documents) and the final
    state are the sequence's own, the same on every rank. With `ulysses_group` too (or
    alone), the shard is `fusedpar.shard_sequence`'s with that `ulysses_group`: the heads
    go over it by all-to-all (Hk divisible by its size) and the summaries over `group`.
    """
    K = q.shape[-1] if isinstance(q, Tensor) and q.dim() else 1
    scale = K**-0.5 if scale is None else scale
    check_gated_delta_inputs(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    ring, ulysses = group_size(group), group_size(ulysses_group)
    if ring > 1:  # the layout's spans, before any exchange
        Spans(group_rank(group), ring, layout, q.shape[1] * ulysses)
        check_crossing_groups(group, ulysses_group, "gated_delta_rule")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_heads(q), l2norm_heads(k)

    def whole(inputs, initial_state):  # this rank's heads, its ring rank's share
        if ring > 1:
            return context_parallel_gated_delta(
                inputs,
                scale=float(scale),
                initial_state=initial_state,
                cu_seqlens=cu_seqlens,
                want_final=output_final_state,
                group=resolve_group(group),
                layout=layout,
            )
        o, final = _gated_delta_rule(*inputs, initial_state, cu_seqlens, float(scale))
        return o, (final if output_final_state else None)

    if ulysses > 1:
        return head_parallel_gated_delta(
            (q, k, v, g, beta), initial_state, resolve_group(ulysses_group), whole
        )
    return whole((q, k, v, g, beta), initial_state)
