"""MoE routing: the router's logits, the top-k choice and its weights, capacity, and the
auxiliary losses. Router math is fp32 (float64 for a float64 model: torch's
implementation, `fusedpar.kernels.common.accumulator`).

| piece               | forward                                 | backward                       |
| ------------------- | --------------------------------------- | ------------------------------ |
| `_RouterLogits`     | ``logits = x @ router_weight.T`` (fp32) | dx, dw in fp32, rounded once   |
| `moe_route`         | probs, the top-k ids and their weights: | dlogits from dweights and      |
|                     | one row kernel                          | dprobs: one row kernel         |
| `capacity_mask`     | which pairs an expert's capacity keeps  | (no gradient)                  |
| `aux_losses`        | Switch load balancing + z-loss          | autograd                       |
| `sequence_aux_loss` | DeepSeek-V3's, per sequence; the counts | from the forward's counts: the |
|                     | (B, E) summed over its ranks            | recompute runs no collective   |

``fusedpar::moe_route`` is the op `fusedpar.checkpoint_policy` saves by default: a
recompute never re-routes a token (a near tie could break the other way).
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from fusedpar import comm
from fusedpar.kernels.common import accumulator
from fusedpar.kernels.moe_permute import expert_counts
from fusedpar.kernels.moe_route import SCORES, route_top_k, route_top_k_backward
from fusedpar.ops.registration import autograd_op, direct_op
from fusedpar.recompute import is_recomputing

__all__ = [
    "AUX_LOSSES",
    "SCORES",
    "aux_losses",
    "capacity_mask",
    "fold_groups",
    "route",
    "sequence_aux_loss",
    "sequence_choices",
]

AUX_LOSSES = ("switch", "sequence")  # `MoESpec.aux_loss`: Switch's, DeepSeek-V3's


class _RouterLogits(torch.autograd.Function):
    """``x.float() @ router_weight.float().T``, the same numbers as autograd gives that
    expression, but saving x and the router weight as they are: in 16-bit training the
    fp32 copies autograd would keep (T x d and E x d, twice the bytes of x) are made
    again in the backward instead. (float64 x: all of it in float64.)"""

    @staticmethod
    def forward(ctx, x, router_weight):
        ctx.save_for_backward(x, router_weight)
        wide = accumulator(x.dtype)
        return F.linear(_cast(x, wide), _cast(router_weight, wide))

    @staticmethod
    def backward(ctx, d_logits):
        x, router_weight = ctx.saved_tensors
        wide = d_logits.dtype
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _cast(d_logits @ _cast(router_weight, wide), x.dtype)
        if ctx.needs_input_grad[1]:
            dw = _cast(d_logits.T @ _cast(x, wide), router_weight.dtype)
        return dx, dw


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)  # (a no-op `.to` is still an aten op)


@torch.library.custom_op("fusedpar::moe_route", mutates_args=())
def _route_op(
    logits: Tensor,
    bias: Tensor | None,
    top_k: int,
    score: str,
    norm: bool,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[Tensor, Tensor, Tensor]:
    """(weights (T, k) fp32, ids (T, k) int32, probs (T, E) fp32) of logits (T, E) fp32
    (float64 logits: float64 for each fp32): `fusedpar.kernels.moe_route.route_top_k`."""
    return route_top_k(logits, top_k, score, norm, bias, (n_group, topk_group))


@_route_op.register_fake
def _(logits, bias, top_k, score, norm, n_group=1, topk_group=1):
    T, E = logits.shape
    return (
        logits.new_empty((T, top_k)),
        logits.new_empty((T, top_k), dtype=torch.int32),
        logits.new_empty((T, E)),
    )


@torch.library.custom_op("fusedpar::moe_route_backward", mutates_args=())
def _route_backward_op(
    d_weights: Tensor | None,
    d_probs: Tensor | None,
    probs: Tensor,
    ids: Tensor,
    score: str,
    norm: bool,
) -> Tensor:
    """dlogits (T, E) in probs' dtype (fp32, or float64); a gradient that did not flow is
    None."""
    return route_top_k_backward(d_weights, d_probs, probs, ids, score, norm)


@_route_backward_op.register_fake
def _(d_weights, d_probs, probs, ids, score, norm):
    return probs.new_empty(probs.shape)


def _route_setup(ctx, inputs, output):
    score, norm = inputs[3:5]
    ctx.options = (score, norm)
    ctx.set_materialize_grads(False)  # an output's gradient that did not flow stays None
    ctx.save_for_backward(output[2], output[1])


def _route_backward(ctx, d_weights, _, d_probs):
    probs, ids = ctx.saved_tensors
    d_logits = None
    if d_weights is not None or d_probs is not None:
        d_logits = _route_backward_call(d_weights, d_probs, probs, ids, *ctx.options)
    return d_logits, None, None, None, None, None, None


_route_backward_call = direct_op(_route_backward_op)
_route = autograd_op(_route_op, _route_backward, _route_setup)


def route(
    x,
    router_weight,
    top_k,
    score,
    norm_topk_prob,
    expert_bias=None,
    router_bias=None,
    groups=(1, 1),
    scaling=1.0,
):
    """Router math in fp32 (float64 for float64 x). Returns (weights (T, k) fp32, ids (T,
    k) int32, probs (T, E), logits).

    ``logits = x @ router_weight.T + router_bias`` (`router_bias` (E,) or None: a
    trainable bias, gpt-oss's, in the logits, so in the selection and the weights alike).
    softmax: probabilities over experts, top-k of them (with ``norm_topk_prob``: the
    softmax of the k chosen logits, gpt-oss's router). sigmoid: independent scores;
    `expert_bias` (E,) shifts the selection only (DeepSeek-V3's aux-loss-free balancing),
    never the weights. ``norm_topk_prob`` rescales the k weights to sum to 1: at top-1
    the weight is 1, exactly, with gradient exactly 0 (the division's backward would
    subtract two terms of size 1/p, whose rounding a small p amplifies), and the router
    still takes a gradient on every rank (zeros on a rank with no token, as the other
    ranks' reductions expect). ``groups=(n_group, topk_group)``: the choice among the
    experts of the topk_group best of n_group groups (DeepSeek-V3's); ``scaling``: the
    weights times it, after any renormalization (its ``routed_scaling_factor``).
    """
    logits = _RouterLogits.apply(x, router_weight)
    if router_bias is not None:
        logits = logits + _cast(router_bias, logits.dtype)
    bias = None if expert_bias is None or score != "sigmoid" else _cast(expert_bias, logits.dtype)
    weights, ids, probs = _route(logits, bias, top_k, score, bool(norm_topk_prob), *groups)
    if scaling != 1.0:
        weights = weights * scaling
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


def aux_losses(probs, logits, ids, score, aux_loss_coef, z_loss_coef, counts=None):
    """Switch load balancing ``coef * E * sum_e f_e P_e`` (f_e: share of the k*T routed
    slots taken by e; P_e: mean router probability of e, sigmoid scores normalized per
    token) plus the z-loss ``coef * mean(logsumexp(logits)^2)``. In probs' dtype (fp32,
    or float64); 0 with no token.
    `counts`: ``expert_counts(ids, E)`` where the caller has them."""
    T, E = probs.shape
    if T == 0:
        return probs.new_zeros(())
    counts = expert_counts(ids, E) if counts is None else counts
    p = probs if score == "softmax" else probs / probs.sum(-1, keepdim=True)
    loss = (counts.to(p.dtype) * p.mean(0)).sum() * (aux_loss_coef * E / ids.numel())
    if z_loss_coef:
        loss = loss + _z_loss(logits, z_loss_coef)
    return loss


def _z_loss(logits, z_loss_coef):
    return z_loss_coef * torch.logsumexp(logits, -1).square().mean()


def sequence_choices(ids: Tensor, batch: int, num_experts: int) -> Tensor:
    """(B, E) int64: each sequence's (token, slot) choices per expert; ids (B*S, k), the
    tokens sequence-major (x (B, S, d) flattened). A scatter-add: no host sync."""
    T, top_k = ids.shape
    counts = ids.new_zeros((batch, num_experts), dtype=torch.int64)
    if T:
        per_sequence = ids.reshape(batch, T // batch * top_k).long()  # (B, S*k)
        counts.scatter_add_(1, per_sequence, torch.ones_like(per_sequence))
    return counts


def fold_groups(groups) -> tuple:
    """The groups of more than one rank among `groups`, as few as they can be: 1-D
    slices of one DeviceMesh flattened into one (torch caches it by name; it makes a
    process group at the first call, which every rank of the mesh makes alike, as
    `fusedpar.ParallelDims.groups` does for ``ep``); process groups as they are."""
    active = tuple(g for g in groups if comm.group_size(g) > 1)
    if len(active) < 2 or not all(isinstance(g, DeviceMesh) and g.ndim == 1 for g in active):
        return active
    root = active[0]._get_root_mesh()
    names = [g.mesh_dim_names[0] if g.mesh_dim_names else None for g in active]
    if any(g._get_root_mesh() is not root for g in active) or not all(
        name in (root.mesh_dim_names or ()) for name in names
    ):
        return active  # (slices of other meshes, or already flattened ones)
    names.sort(key=root.mesh_dim_names.index)
    return (root[tuple(names)]._flatten(),)


class _SequenceBalance(torch.autograd.Function):
    """``sum(p_sum * weight)``, its gradient ``weight`` (B, E) kept on the graph's node as
    an attribute, not a saved tensor: activation checkpointing (``use_reentrant=False``)
    refills saved tensors from its recompute, but runs the backward of the forward's
    node, so the gradient reads the counts the forward reduced, and the recompute needs
    no collective. ``stand_in``: a recompute's weight, made without the collective: its
    node's backward runs only under reentrant checkpointing, which is refused there."""

    @staticmethod
    def forward(ctx, p_sum, weight, stand_in):
        ctx.weight, ctx.stand_in = weight, stand_in
        return (p_sum * weight).sum()

    @staticmethod
    def backward(ctx, grad):
        if ctx.stand_in:
            raise RuntimeError(
                "MoE aux_loss='sequence' under reentrant activation checkpointing: its "
                "recompute runs no collective of the sequences' counts. Checkpoint with "
                "use_reentrant=False"
            )
        return grad * ctx.weight, None, None


def sequence_aux_loss(probs, logits, ids, sequences: tuple, groups, coefs, score: str):
    """DeepSeek-V3's sequence-wise balance loss (report eq. 17-20), averaged over the
    batch's sequences, plus the z-loss over this rank's tokens; `coefs` (alpha,
    z_loss_coef). probs, logits (B*S, E) and ids (B*S, k) of x (B, S, d), `sequences`
    (B, S); `groups`: those over which each sequence's tokens are split (`fold_groups`'s).
    Per sequence b, ``f_e = E / (k T_b) * choices_e`` over all its T_b tokens (the
    counts (B, E) summed over `groups`, no gradient), ``P_e = 1/T_b * sum_t s'_e,t``
    (s' the scores normalized per token), ``L_b = alpha * sum_e f_e P_e``. Returns this
    rank's share: its tokens' part of each P_e over the GLOBAL T_b; the shares over
    `groups` sum to ``mean_b L_b``, and so do their gradients. In a recompute
    (`fusedpar.recompute.is_recomputing`) no collective runs: see `_SequenceBalance`;
    with alpha 0, none at all."""
    alpha, z_loss_coef = coefs
    batch, seq_len = sequences
    E, top_k = probs.shape[1], ids.shape[1]
    if not alpha:  # (the same on every rank: no collective skipped by one alone)
        return _z_loss(logits, z_loss_coef) if z_loss_coef and batch * seq_len else 0 * probs.sum()
    with torch.no_grad():
        counts = sequence_choices(ids, batch, E)  # (B, E)
        recompute = is_recomputing()
        if not recompute:
            for group in groups:
                dist.all_reduce(counts, group=comm.resolve_group(group))
        counts = counts.to(probs.dtype)
        choices = counts.sum(-1, keepdim=True)  # (B, 1): k * T_b
        # L_b's share = alpha * sum_e E/(k T_b) c_e * (1/T_b) p_sum_e, T_b = choices / k
        weight = counts * (alpha * E * top_k / max(batch, 1)) / choices.clamp_min(1).square()
    p = probs if score == "softmax" else probs / probs.sum(-1, keepdim=True)
    p_sum = p.reshape(batch, seq_len, E).sum(1)  # (B, E): this rank's tokens of each sequence
    # (with no group the recompute's counts are the forward's: nothing stands in)
    loss = _SequenceBalance.apply(p_sum, weight, recompute and bool(groups))
    if z_loss_coef and logits.shape[0]:
        loss = loss + _z_loss(logits, z_loss_coef)
    return loss
