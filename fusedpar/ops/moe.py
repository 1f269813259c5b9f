"""Mixture of experts: routing, dispatch, grouped expert SwiGLU, combine, and the
all-to-alls of expert parallelism.

Shapes on each of W expert-parallel ranks (T local tokens, k slots, E experts, E/W local):

| step                    | tensor                                  |
| ----------------------- | --------------------------------------- |
| router (fp32)           | logits (T, E); weights, ids (T, k)      |
| dispatch metadata       | counts (E,); order (T*k,); pos (T, k)   |
| to the experts' ranks   | all_to_all: P -> R rows, source-major   |
| local experts (SwiGLU)  | rows read expert-major through an index |
| back, and combine       | all_to_all: R -> P; y (T, d)            |

Forward and backward of the differentiable pieces (``h1, h3 = x[rows[p]] @ w1[e].T,
w3[e].T``; ``a = silu(h1) * h3``):

| piece          | forward                               | backward                              |
| -------------- | ------------------------------------- | ------------------------------------- |
| `ExpertSwiGLU` | ``a`` and ``[h1, h3]``: one GEMM;     | ``da = dout w2[e]``, its epilogue     |
|                | ``out[p] = a[p] @ w2[e].T``           | giving ``dh1, dh3`` and ``a``;        |
|                |                                       | ``dx[r] = sum_(p reads r) dh1 w1[e] + |
|                |                                       | dh3 w3[e]``; ``dw1, dw3 = dh1_e^T x_e, |
|                |                                       | dh3_e^T x_e``; ``dw2 = dout_e^T a_e`` |
| `PermuteRows`  | ``out[p] = src[idx[p]]``              | ``dsrc[r] = sum_(p reads r) dout[p]`` |
| `Combine`      | ``y[t] = sum_j w[t,j] out[pos[t,j]]`` | ``dout[p] = w[t,j] dy[t]``            |
|                |                                       | ``dw[t,j] = <dy[t], out[pos[t,j]]>``  |

"sum over p that read r" runs through the combine kernel in a fixed order (no atomics):
two runs give bitwise-equal outputs and gradients. At EP = 1 nothing here reads a count
back to the host: pairs dropped by a capacity limit sit past ``counts.sum()`` in the
full-length order, and no kernel touches those rows.
"""

import math

import torch

from fusedpar import comm
from fusedpar.kernels.moe import (
    dispatch_metadata,
    expert_counts,
    grouped_matmul,
    grouped_swiglu,
    grouped_swiglu_backward,
    grouped_swiglu_input_grad,
    grouped_weight_grad,
)
from fusedpar.kernels.moe_permute import combine, combine_weight_grad, gather_rows

SCORES = ("softmax", "sigmoid")


# --- differentiable pieces ----------------------------------------------------------------


class ExpertSwiGLU(torch.autograd.Function):
    """``out[p] = w2[e] @ (silu(w1[e] @ x[rows[p]]) * (w3[e] @ x[rows[p]]))`` for the rows
    p of expert e (rows None: x is in expert order); `reduce_pos` (R, j) lists the rows p
    that read each row of x (-1 for none), for summing dx back.

    Saved for the backward: h1 and h3 (P, 2h, in x's dtype), not a = silu(h1) * h3: the
    backward's first GEMM (``da = dout w2[e]``) loads h1 and h3 in its epilogue anyway to
    form dh1 and dh3, and writes a there for w2's gradient, bit for bit the forward's
    (both round h1 and h3 first). Recomputing h1 and h3 instead would cost a second
    gate/up GEMM, 2/3 of the experts' forward FLOPs; saving a as well would add half
    again to the activations kept per layer.
    """

    @staticmethod
    def forward(ctx, x, w1, w3, w2, counts, rows, reduce_pos):
        a, h13 = grouped_swiglu(x, w1, w3, counts, rows)
        ctx.save_for_backward(x, w1, w3, w2, counts, rows, reduce_pos, h13)
        return grouped_matmul(a, w2, counts)

    @staticmethod
    def backward(ctx, d_out):
        x, w1, w3, w2, counts, rows, reduce_pos, h13 = ctx.saved_tensors
        need_x, need_w1, need_w3, need_w2 = ctx.needs_input_grad[:4]
        d_h13, a = grouped_swiglu_backward(d_out, w2, h13, counts)
        dx = dw1 = dw3 = dw2 = None
        if need_x:
            d_rows = grouped_swiglu_input_grad(d_h13, w1, w3, counts)
            dx = d_rows if rows is None else combine(d_rows, reduce_pos, out_dtype=x.dtype)
        if need_w1 or need_w3:
            dw1, dw3 = grouped_weight_grad(d_h13, x, counts, rows, out_dtype=w1.dtype, split=True)
        if need_w2:
            dw2 = grouped_weight_grad(d_out, a, counts, out_dtype=w2.dtype)
        return dx, dw1, dw3, dw2, None, None, None


def expert_swiglu(x, w1, w3, w2, counts, rows, reduce_pos):
    """`ExpertSwiGLU`, or its forward alone (h1, h3 not stored) where no gradient is
    needed: a Function's ``needs_input_grad`` stays True under ``torch.no_grad()``."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w1, w3, w2)):
        return ExpertSwiGLU.apply(x, w1, w3, w2, counts, rows, reduce_pos)
    a, _ = grouped_swiglu(x, w1, w3, counts, rows, save_hidden=False)
    return grouped_matmul(a, w2, counts)


class PermuteRows(torch.autograd.Function):
    """``out[p] = src[idx[p]]``; `reduce_pos` (R, j): the rows p that read each src row."""

    @staticmethod
    def forward(ctx, src, idx, reduce_pos):
        ctx.save_for_backward(reduce_pos)
        return gather_rows(src, idx)

    @staticmethod
    def backward(ctx, dout):
        (reduce_pos,) = ctx.saved_tensors
        return combine(dout, reduce_pos, out_dtype=dout.dtype), None, None


class Combine(torch.autograd.Function):
    """``y[t] = sum_j weight[t, j] * out[pos[t, j]]``; `order`: the pair of each row (out's
    rows are its first ones: all T*k at EP = 1, the kept ones at EP > 1)."""

    @staticmethod
    def forward(ctx, out, weight, pos, order):
        ctx.save_for_backward(out, weight, pos, order)
        return combine(out, pos, weight, out_dtype=out.dtype)

    @staticmethod
    def backward(ctx, dy):
        out, weight, pos, order = ctx.saved_tensors
        top_k = pos.shape[1]
        d_out = d_weight = None
        if ctx.needs_input_grad[0]:
            pairs = order[: out.shape[0]]
            scale = weight.detach().reshape(-1)[pairs].float()
            d_out = gather_rows(dy, pairs // top_k, scale, out_dtype=out.dtype)
        if ctx.needs_input_grad[1]:
            d_weight = combine_weight_grad(dy, out, pos).to(weight.dtype)
        return d_out, d_weight, None, None


# --- routing -------------------------------------------------------------------------------


def route(x, router_weight, top_k, score, norm_topk_prob, expert_bias=None):
    """Router math in fp32. Returns (weights (T, k) fp32, ids (T, k), probs (T, E), logits).

    softmax: probabilities over experts, top-k of them. sigmoid: independent scores;
    `expert_bias` (E,) shifts the selection only (DeepSeek-V3's aux-loss-free balancing),
    never the weights. ``norm_topk_prob`` rescales the k weights to sum to 1.
    """
    logits = x.float() @ router_weight.float().T
    probs = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    select = probs if expert_bias is None or score == "softmax" else probs + expert_bias.float()
    ids = select.detach().topk(top_k, dim=-1).indices
    weights = probs.gather(1, ids)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids, probs, logits


def capacity_mask(ids, weights, num_experts: int, capacity_factor: float):
    """Keep at most ``ceil(capacity_factor * T * k / E)`` pairs per expert: its
    highest-weighted ones (ties: the lower pair index). Returns keep (T, k) bool."""
    T, top_k = ids.shape
    capacity = math.ceil(capacity_factor * T * top_k / num_experts)
    flat_e, flat_w = ids.reshape(-1), weights.detach().reshape(-1)
    by_weight = torch.argsort(-flat_w, stable=True)
    order = by_weight[torch.argsort(flat_e[by_weight], stable=True)]
    counts = expert_counts(flat_e, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(order.numel(), device=ids.device) - starts[flat_e[order]]
    keep = torch.empty_like(flat_e, dtype=torch.bool)
    keep[order] = rank_in_expert < capacity
    return keep.view(T, top_k)


def aux_losses(probs, logits, ids, score, aux_loss_coef, z_loss_coef):
    """Switch load balancing ``coef * E * sum_e f_e P_e`` (f_e: share of the k*T routed
    slots taken by e; P_e: mean router probability of e, sigmoid scores normalized per
    token) plus the z-loss ``coef * mean(logsumexp(logits)^2)``. fp32; 0 with no token."""
    T, E = probs.shape
    if T == 0:
        return probs.new_zeros(())
    f = expert_counts(ids, E).float() / ids.numel()
    p = probs if score == "softmax" else probs / probs.sum(-1, keepdim=True)
    loss = aux_loss_coef * E * (f * p.mean(0)).sum()
    if z_loss_coef:
        loss = loss + z_loss_coef * torch.logsumexp(logits, -1).square().mean()
    return loss


# --- experts and dispatch ----------------------------------------------------------------------


def _regroup_index(recv_counts: torch.Tensor, total: int) -> torch.Tensor:
    """Rows received source-major (source s, then expert e) in expert-major order: the
    source-major row of each expert-major position. recv_counts (W, E_loc); `total`, their
    sum, is already on the host (no device sync here)."""
    flat = recv_counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(recv_counts)
    em_counts, em_starts = recv_counts.T.reshape(-1), starts.T.reshape(-1)
    block_of = torch.repeat_interleave(torch.arange(em_counts.numel(), device=flat.device),
                                       em_counts, output_size=total)  # fmt: skip
    em_offsets = torch.cumsum(em_counts, 0) - em_counts
    within = torch.arange(total, device=flat.device) - em_offsets[block_of]
    return em_starts[block_of] + within


def moe_dispatch_combine(x, weights, ids, keep, w1, w3, w2, num_experts, group):
    """Send the routed pairs to their experts (EP: all-to-all), run them, and combine.

    x (T, d); weights, ids, keep (T, k); w1, w3 (E_loc, h, d); w2 (E_loc, d, h).
    Returns y (T, d) and the local counts per expert (E,) after capacity.
    """
    counts, order, pos = dispatch_metadata(ids, num_experts, keep)
    top_k = ids.shape[1]
    pg = comm.resolve_group(group)
    size = comm.group_size(pg)
    if size == 1:  # the gather is fused into the gate/up GEMM: no permuted copy of x
        out = expert_swiglu(x, w1, w3, w2, counts, order // top_k, pos)
        return Combine.apply(out, weights, pos, order), counts
    send_counts = counts.view(size, num_experts // size)
    recv_counts = comm.all_to_all(send_counts, pg)  # row s: what s sends to my experts
    # The one host sync of the layer: all_to_all_single takes its variable split sizes
    # as host integers. Inherent without fixed-capacity send buffers.
    send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    kept = order[: sum(send_splits)]  # the dropped pairs sort last
    x_send = PermuteRows.apply(x, kept // top_k, pos)
    x_recv = comm.all_to_all(x_send, pg, recv_splits, send_splits)
    regroup = _regroup_index(recv_counts, sum(recv_splits))
    inverse = torch.empty_like(regroup)
    inverse[regroup] = torch.arange(regroup.numel(), device=regroup.device)
    out = expert_swiglu(x_recv, w1, w3, w2, recv_counts.sum(0), regroup, inverse.view(-1, 1))
    out = PermuteRows.apply(out, inverse, regroup.view(-1, 1))  # back to source-major
    out = comm.all_to_all(out, pg, send_splits, recv_splits)
    return Combine.apply(out, weights, pos, order), counts


# --- reference -------------------------------------------------------------------------------


def moe_reference(x, router_weight, w1, w2, w3, *, top_k, score="softmax",
                  norm_topk_prob=True, capacity_factor=None, expert_bias=None,
                  aux_loss_coef=0.01, z_loss_coef=0.0, shared=None,
                  shared_gate=None):  # fmt: skip
    """The whole layer as a naive loop over tokens and experts, in x's dtype (float64 in ->
    the oracle; the router in at least fp32, as the layer's). Full (unsharded) stacks;
    `shared` (w1 (hs, d), w2 (d, hs), w3 (hs, d)): a shared expert every token goes
    through, scaled by ``sigmoid(x @ shared_gate.T)`` if given (1, d). Returns (y (T, d),
    aux_loss)."""
    T, E = x.shape[0], router_weight.shape[0]
    router_dtype = torch.promote_types(x.dtype, torch.float32)
    logits = x.to(router_dtype) @ router_weight.to(router_dtype).T
    probs = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    select = probs if expert_bias is None or score == "softmax" else probs + expert_bias
    ids = select.detach().topk(top_k, dim=-1).indices
    weights = probs.gather(1, ids)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    kept = [[True] * top_k for _ in range(T)]
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * T * top_k / E)
        for e in range(E):
            pairs = [(t, j) for t in range(T) for j in range(top_k) if ids[t, j] == e]
            pairs.sort(key=lambda tj: (-float(weights[tj].detach()), tj[0] * top_k + tj[1]))
            for t, j in pairs[capacity:]:
                kept[t][j] = False
    rows = []
    for t in range(T):
        y_t = x.new_zeros(x.shape[1])
        for j in range(top_k):
            if kept[t][j]:
                e = int(ids[t, j])
                hidden = torch.nn.functional.silu(w1[e] @ x[t]) * (w3[e] @ x[t])
                y_t = y_t + weights[t, j].to(x.dtype) * (w2[e] @ hidden)
        rows.append(y_t)
    y = torch.stack(rows) if rows else x.new_zeros((0, x.shape[1]))
    if shared is not None:
        s1, s2, s3 = shared
        out = (torch.nn.functional.silu(x @ s1.T) * (x @ s3.T)) @ s2.T
        y = y + (out if shared_gate is None else torch.sigmoid(x @ shared_gate.T) * out)
    return y, aux_losses(probs, logits, ids, score, aux_loss_coef, z_loss_coef)
