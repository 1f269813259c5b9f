"""Mixture of experts: dispatch, grouped expert SwiGLU, combine, and the all-to-alls of
expert parallelism (the routing before them: `fusedpar.ops.moe_routing`).

Shapes on each of W expert-parallel ranks (T local tokens, k slots, E experts, E/W local):

| step                    | tensor                                  |
| ----------------------- | --------------------------------------- |
| router (fp32)           | logits (T, E); weights, ids (T, k)      |
| dispatch metadata       | counts (E,); order (T*k,); pos (T, k)   |
| to the experts' ranks   | all_to_all: P -> R rows, source-major   |
| local experts (SwiGLU)  | rows read expert-major through an index |
| back, and combine       | all_to_all: R -> P; y (T, d)            |

Differentiable pieces: `ExpertSwiGLU` (``out[p] = (silu(x[r] w1[e].T) * x[r] w3[e].T)
w2[e].T``, biases optional, or gpt-oss's clamped SwiGLU), `PermuteRows` (``out[p] =
src[idx[p]]``) and `Combine` (``y[t] = sum_j w[t,j] out[pos[t,j]]``). Every "sum over
the p that read r" runs through the combine kernel in a fixed order (no atomics): two
runs are bitwise equal. At EP = 1 nothing reads a count back to the host (pairs dropped
by capacity sit past ``counts.sum()``, untouched). float64: torch's implementation
throughout. The layer hands down `Experts`, `Routing`, `Swiglu`. docs/expert_parallel.md.
"""

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from fusedpar import comm
from fusedpar.kernels.common import accumulator
from fusedpar.kernels.moe import (
    SILU,
    Swiglu,
    grouped_matmul,
    grouped_swiglu,
    grouped_swiglu_backward,
    grouped_swiglu_input_grad,
)
from fusedpar.kernels.moe_permute import (
    combine,
    combine_weight_grad,
    dispatch_metadata,
    gather_rows,
    index_dtype,
)
from fusedpar.kernels.moe_reference import swiglu_reference
from fusedpar.kernels.moe_weight_grad import grouped_weight_grad
from fusedpar.ops.moe_routing import aux_losses
from fusedpar.ops.registration import asked, autograd_op, direct_op

if TYPE_CHECKING:  # (fusedpar.nn imports this module)
    from fusedpar.nn.specs import MoESpec

# --- custom ops: the differentiable pieces --------------------------------------------------
# Every kernel launch and collective of the layer sits inside a ``fusedpar::`` op, with a
# fake that gives its shapes and autograd registered through ``torch.library``; what is
# left between them is plain PyTorch, so the layer compiles as one graph. A gradient
# not asked for comes back from a backward op as an empty (0,) tensor.


class Experts(NamedTuple):
    """The experts' stacks as one value, from the layer down to the ops: w1, w3 (E, h, d)
    (gate, up), w2 (E, d, h) (down), and their biases b1, b3 (E, h), b2 (E, d), all or
    none. The ops take them as one ``list[Tensor]`` (`tensors`)."""

    w1: Tensor
    w3: Tensor
    w2: Tensor
    b1: Tensor | None = None
    b3: Tensor | None = None
    b2: Tensor | None = None

    def tensors(self) -> list[Tensor]:
        """[w1, w3, w2], then [b1, b3, b2] where there are biases: the ops' argument."""
        biases = self[3:]
        if all(b is None for b in biases):
            return list(self[:3])
        if any(b is None for b in biases):
            raise ValueError("expert biases must be all of (b1, b2, b3) or none")
        return list(self)


class Routing(NamedTuple):
    """The routing's outputs the dispatch takes: weights and ids (T, k) (`route`), and
    keep (T, k) bool (`capacity_mask`; None: dropless)."""

    weights: Tensor
    ids: Tensor
    keep: Tensor | None = None


def _act_args(act: Swiglu) -> tuple[str, list[float]]:
    """`act` as the ops take it: ``activation`` and ``swiglu`` = [alpha, limit]
    (`_act_keywords` reads it back)."""
    return act.kind, [float(act.alpha), float(act.limit)]


def _act_keywords(activation: str, swiglu: list[float]) -> dict:
    """The launchers' keywords of an op's ``activation`` and ``swiglu`` (`_act_args`)."""
    alpha, limit = swiglu
    return {"activation": activation, "alpha": alpha, "limit": limit}


@torch.library.custom_op("fusedpar::expert_swiglu", mutates_args=())
def _expert_swiglu_op(
    x: Tensor,
    experts: list[Tensor],
    counts: Tensor,
    rows: Tensor | None,
    reduce_pos: Tensor | None,
    save_hidden: bool,
    activation: str,
    swiglu: list[float],
) -> tuple[Tensor, Tensor]:
    """``out[p] = w2[e] @ act(w1[e] @ x[rows[p]] + b1[e], w3[e] @ x[rows[p]] + b3[e]) +
    b2[e]`` for the rows p of expert e (`experts`: [w1, w3, w2] or with the biases [w1,
    w3, w2, b1, b3, b2], `Experts.tensors`; rows None: x is in expert order; act:
    `activation`, ``"silu"`` (silu(h1) * h3) or ``"clamped_swiglu"`` (gpt-oss's, with
    `swiglu` = [alpha, limit])), and h13 = [h1 | h3] (P, 2h) for the backward (empty
    without `save_hidden`). `reduce_pos` (R, j) lists the rows p that read each row of x
    (-1 for none): the backward sums dx through it.

    Saved for the backward: h1 and h3 (P, 2h, in x's dtype, biases added, before any
    clamp), not a: the backward's first GEMM (``da = dout w2[e]``) loads h1 and h3 in its
    epilogue anyway to form dh1 and dh3, and writes a there for w2's gradient, bit for
    bit the forward's (both round h1 and h3 first). Recomputing h1 and h3 instead would
    cost a second gate/up GEMM, 2/3 of the experts' forward FLOPs; saving a as well would
    add half again to the activations kept per layer."""
    w1, w3, w2, *bias = experts
    b1, b3, b2 = bias or (None, None, None)
    act = _act_keywords(activation, swiglu)
    b13 = None if b1 is None else (b1, b3)
    a, h13 = grouped_swiglu(x, w1, w3, counts, rows, bias=b13, save_hidden=save_hidden, **act)
    out = grouped_matmul(a, w2, counts, bias=b2)
    return out, x.new_empty(0) if h13 is None else h13


@_expert_swiglu_op.register_fake
def _(x, experts, counts, rows, reduce_pos, save_hidden, activation, swiglu):
    P = x.shape[0] if rows is None else rows.shape[0]
    h13 = x.new_empty((P, 2 * experts[0].shape[1]) if save_hidden else 0)
    return x.new_empty((P, experts[2].shape[1])), h13


@torch.library.custom_op("fusedpar::expert_swiglu_backward", mutates_args=())
def _expert_swiglu_backward_op(
    d_out: Tensor,
    x: Tensor,
    experts: list[Tensor],
    counts: Tensor,
    rows: Tensor | None,
    reduce_pos: Tensor | None,
    h13: Tensor,
    needs: list[bool],
    activation: str,
    swiglu: list[float],
) -> list[Tensor]:
    """dx (summed over the rows p that read each row of x: `reduce_pos` (R, j), -1 for
    none), dw1, dw3, dw2, and the expert biases' db1, db3 (E, h), db2 (E, d) (`experts`
    as the forward's); `needs` says which (the others come back empty; the last three
    may be left out: no bias). The bias gradients come from the weight gradients'
    launches (per-expert sums of dh1, dh3 and d_out, fp32, no atomics): a bias asked for
    without its weight still runs them."""
    w1, w3, w2 = experts[:3]
    need_x, need_w1, need_w3, need_w2, need_b1, need_b3, need_b2 = _pad(needs)
    d_h13, a = grouped_swiglu_backward(d_out, w2, h13, counts, **_act_keywords(activation, swiglu))
    dx = dw1 = dw3 = dw2 = db1 = db3 = db2 = None
    if need_x:
        d_rows = grouped_swiglu_input_grad(d_h13, w1, w3, counts)
        dx = d_rows if rows is None else combine(d_rows, reduce_pos, out_dtype=x.dtype)
    if need_w1 or need_w3 or need_b1 or need_b3:
        grads = grouped_weight_grad(
            d_h13, x, counts, rows, out_dtype=w1.dtype, split=True, bias_grad=need_b1 or need_b3
        )
        dw1, dw3, *b13 = grads
        db1, db3 = b13 or (None, None)
    if need_w2 or need_b2:
        grads = grouped_weight_grad(d_out, a, counts, out_dtype=w2.dtype, bias_grad=need_b2)
        dw2, db2 = grads if need_b2 else (grads, None)
    grads = [dx, dw1, dw3, dw2, db1, db3, db2]  # those not asked for empty, as the fake's
    return [
        g if need else t.new_empty(0)
        for g, need, t in zip(grads, _pad(needs), _sources(x, experts), strict=True)
    ]


def _pad(needs) -> list[bool]:
    """`needs` for the 7 gradients (x, w1, w3, w2, b1, b3, b2): no bias, none asked."""
    return [*needs, *[False] * (7 - len(needs))]


def _sources(x, experts) -> tuple:
    """The tensor each of the 7 gradients is shaped as (a bias's, its weight where there
    is no bias): x, w1, w3, w2, b1, b3, b2."""
    return (x, *experts[:3], *(experts[3:] or experts[:3]))


@_expert_swiglu_backward_op.register_fake
def _(d_out, x, experts, counts, rows, reduce_pos, h13, needs, activation, swiglu):
    w1, w3, w2 = experts[:3]
    shapes = (x.shape, w1.shape, w3.shape, w2.shape, w1.shape[:2], w3.shape[:2], w2.shape[:2])
    # fresh, contiguous: the real layout
    return [
        t.new_empty(shape if need else 0)
        for t, shape, need in zip(_sources(x, experts), shapes, _pad(needs), strict=True)
    ]


def _expert_swiglu_setup(ctx, inputs, output):
    x, experts, counts, rows, reduce_pos, _, activation, swiglu = inputs
    ctx.needs = [t.requires_grad for t in (x, *experts)]
    ctx.act = (activation, swiglu)
    ctx.save_for_backward(x, counts, rows, reduce_pos, output[1], *experts)


def _expert_swiglu_backward(ctx, d_out, _):
    x, counts, rows, reduce_pos, h13, *experts = ctx.saved_tensors
    grads = _expert_swiglu_backward_call(
        d_out, x, experts, counts, rows, reduce_pos, h13, ctx.needs, *ctx.act
    )
    dx, *d_experts = asked(grads[: len(ctx.needs)], ctx.needs)
    return dx, d_experts, None, None, None, None, None, None


def expert_swiglu(x, experts: Experts, counts, rows, reduce_pos, act: Swiglu = SILU):
    """`fusedpar::expert_swiglu`'s output; `reduce_pos` (R, j) lists the rows p that read
    each row of x (-1 for none), for summing dx back; `experts` the stacks (and biases:
    all or none); `act` the activation. Where no gradient is needed (no grad mode, or
    nothing requires one) h1 and h3 are not stored."""
    tensors = experts.tensors()
    save = torch.is_grad_enabled() and any(t.requires_grad for t in (x, *tensors))
    out, _ = _expert_swiglu(x, tensors, counts, rows, reduce_pos, save, *_act_args(act))
    return out


@torch.library.custom_op("fusedpar::moe_permute", mutates_args=())
def _permute_op(src: Tensor, idx: Tensor, reduce_pos: Tensor) -> Tensor:
    """``out[p] = src[idx[p]]``; `reduce_pos` (R, j): the rows p that read each src row."""
    return gather_rows(src, idx)


@_permute_op.register_fake
def _(src, idx, reduce_pos):
    return src.new_empty((idx.shape[0], src.shape[1]))


@torch.library.custom_op("fusedpar::moe_permute_backward", mutates_args=())
def _permute_backward_op(d_out: Tensor, reduce_pos: Tensor) -> Tensor:
    """``dsrc[r] = sum_(p reads r) dout[p]``, in a fixed order (no atomics)."""
    return combine(d_out, reduce_pos, out_dtype=d_out.dtype)


@_permute_backward_op.register_fake
def _(d_out, reduce_pos):
    return d_out.new_empty((reduce_pos.shape[0], d_out.shape[1]))


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])


def _permute_backward(ctx, d_out):
    (reduce_pos,) = ctx.saved_tensors
    return _permute_backward_call(d_out, reduce_pos), None, None


@torch.library.custom_op("fusedpar::moe_combine", mutates_args=())
def _combine_op(out: Tensor, weight: Tensor, pos: Tensor, order: Tensor) -> Tensor:
    """``y[t] = sum_j weight[t, j] * out[pos[t, j]]`` (T, d); `order`: the pair of each row
    (out's rows are its first ones: all T*k at EP = 1, the kept ones at EP > 1)."""
    return combine(out, pos, weight, out_dtype=out.dtype)


@_combine_op.register_fake
def _(out, weight, pos, order):
    return out.new_empty((pos.shape[0], out.shape[1]))


@torch.library.custom_op("fusedpar::moe_combine_backward", mutates_args=())
def _combine_backward_op(
    dy: Tensor,
    out: Tensor,
    weight: Tensor,
    pos: Tensor,
    order: Tensor,
    need_out: bool,
    need_weight: bool,
) -> tuple[Tensor, Tensor]:
    """``dout[p] = w[t, j] dy[t]`` for the pair (t, j) of row p; ``dw[t, j] = <dy[t],
    out[pos[t, j]]>``."""
    d_out = d_weight = None
    if need_out:
        pairs = order[: out.shape[0]]
        scale = weight.reshape(-1)[pairs]
        wide = accumulator(out.dtype)  # fp32, float64 for float64
        scale = scale if scale.dtype == wide else scale.to(wide)
        d_out = gather_rows(dy, pairs // pos.shape[1], scale, out_dtype=out.dtype)
    if need_weight:
        d_weight = combine_weight_grad(dy, out, pos)
        d_weight = d_weight if d_weight.dtype == weight.dtype else d_weight.to(weight.dtype)
    return (
        out.new_empty(0) if d_out is None else d_out,
        weight.new_empty(0) if d_weight is None else d_weight,
    )


@_combine_backward_op.register_fake
def _(dy, out, weight, pos, order, need_out, need_weight):
    return (
        out.new_empty(out.shape if need_out else 0),
        weight.new_empty(weight.shape if need_weight else 0),
    )


def _combine_setup(ctx, inputs, output):
    out, weight, pos, order = inputs
    ctx.needs = (out.requires_grad, weight.requires_grad)
    ctx.save_for_backward(out, weight, pos, order)


def _combine_backward(ctx, dy):
    out, weight, pos, order = ctx.saved_tensors
    grads = _combine_backward_call(dy, out, weight.detach(), pos, order, *ctx.needs)
    return *asked(grads, ctx.needs), None, None


@torch.library.custom_op("fusedpar::moe_dispatch", mutates_args=())
def _dispatch_op(
    x: Tensor, order: Tensor, pos: Tensor, counts: Tensor, top_k: int, group: str
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Send each kept (token, slot) pair's row of x (T, d) to its expert's rank.

    Returns the rows received (R, d), source-major (source s, then expert e); the counts
    received (W, E_loc) (row s: what s sends to my experts); `regroup` (R,), the
    source-major row of each expert-major position, and its `inverse`; and the split
    sizes (2, W) int64 on the CPU (sent, received) for `moe_return` and the backward.
    R depends on the routing: the fake gives it an unbacked size."""
    pg = comm.group_by_name(group)
    size = dist.get_world_size(pg)
    send_counts = counts.view(size, -1)
    recv_counts = comm.plain_all_to_all(send_counts, pg, [1] * size, [1] * size)
    # The one host sync of the layer: all_to_all_single takes its variable split sizes
    # as host integers. Inherent without fixed-capacity send buffers.
    splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).cpu()
    send_splits, recv_splits = splits.tolist()
    kept = order[: sum(send_splits)]  # the dropped pairs sort last
    tokens = torch.div(kept, top_k, rounding_mode="floor")
    x_recv = comm.plain_all_to_all(gather_rows(x, tokens), pg, recv_splits, send_splits)
    regroup = _regroup_index(recv_counts, sum(recv_splits))
    inverse = torch.empty_like(regroup)
    inverse[regroup] = torch.arange(regroup.numel(), device=regroup.device, dtype=regroup.dtype)
    return x_recv, recv_counts, regroup, inverse, splits


@_dispatch_op.register_fake
def _(x, order, pos, counts, top_k, group):
    size = comm.group_size(comm.group_by_name(group))
    rows = torch.library.get_ctx().new_dynamic_size()
    index = torch.empty(rows, dtype=torch.int32, device=order.device)
    splits = torch.empty((2, size), dtype=torch.int64, device="cpu")
    return (
        x.new_empty((rows, x.shape[1])),
        counts.new_empty((size, counts.shape[0] // size)),
        index,
        torch.empty_like(index),
        splits,
    )


@torch.library.custom_op("fusedpar::moe_return", mutates_args=())
def _return_op(rows: Tensor, splits: Tensor, group: str, reverse: bool) -> Tensor:
    """The all-to-all of `moe_dispatch`'s rows with its `splits`: back to their sources
    (the expert outputs, ``reverse=False``), or out again (its gradient)."""
    sent, received = splits.tolist()
    if reverse:
        sent, received = received, sent
    return comm.plain_all_to_all(rows, comm.group_by_name(group), sent, received)


@_return_op.register_fake
def _(rows, splits, group, reverse):
    return rows.new_empty((torch.library.get_ctx().new_dynamic_size(), rows.shape[1]))


def _return_setup(ctx, inputs, output):
    _, splits, group, reverse = inputs
    ctx.save_for_backward(splits)
    ctx.options = (group, not reverse)


def _return_backward(ctx, d_rows):
    (splits,) = ctx.saved_tensors
    return _return(d_rows, splits, *ctx.options), None, None, None


def _dispatch_setup(ctx, inputs, output):
    x, order, pos, counts, top_k, group = inputs
    ctx.save_for_backward(pos, output[4])
    ctx.group = group


def _dispatch_backward(ctx, d_recv, *_):
    pos, splits = ctx.saved_tensors
    d_send = _return(d_recv, splits, ctx.group, False)  # back to the sending ranks
    return _permute_backward_call(d_send, pos), None, None, None, None, None


# what the layer calls (`fusedpar.ops.registration`: the bodies in plain eager)
_expert_swiglu_backward_call = direct_op(_expert_swiglu_backward_op)
_permute_backward_call = direct_op(_permute_backward_op)
_combine_backward_call = direct_op(_combine_backward_op)
_expert_swiglu = autograd_op(_expert_swiglu_op, _expert_swiglu_backward, _expert_swiglu_setup)
_permute = autograd_op(_permute_op, _permute_backward, _permute_setup)
_combine = autograd_op(_combine_op, _combine_backward, _combine_setup)
_dispatch = autograd_op(_dispatch_op, _dispatch_backward, _dispatch_setup)
_return = autograd_op(_return_op, _return_backward, _return_setup)
# --- experts and dispatch ----------------------------------------------------------------------


def _regroup_index(recv_counts: torch.Tensor, total: int) -> torch.Tensor:
    """Rows received source-major (source s, then expert e) in expert-major order: the
    source-major row of each expert-major position. recv_counts (W, E_loc); `total`, their
    sum, is already on the host (no device sync here)."""
    flat = recv_counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(recv_counts)
    em_counts, em_starts = recv_counts.T.reshape(-1), starts.T.reshape(-1)
    block_of = torch.repeat_interleave(
        torch.arange(em_counts.numel(), device=flat.device), em_counts, output_size=total
    )
    em_offsets = torch.cumsum(em_counts, 0) - em_counts
    within = torch.arange(total, device=flat.device) - em_offsets[block_of]
    # int32 like the other saved row indices: 2**31 rows received would be terabytes
    return (em_starts[block_of] + within).to(index_dtype(total))


def moe_dispatch_combine(x, routing: Routing, experts: Experts, num_experts, group, act=SILU):
    """Send the routed pairs to their experts (EP: all-to-all), run them, and combine.

    x (T, d); `routing` its weights, ids and keep (T, k); `experts` this rank's stacks,
    w1, w3 (E_loc, h, d), w2 (E_loc, d, h) and the biases (b1, b3 (E_loc, h), b2 (E_loc,
    d)) or none; `act` the experts' activation (`Swiglu`). Returns y (T, d) and the local
    counts per expert (E,) after capacity.
    """
    weights, ids, keep = routing
    counts, order, pos = dispatch_metadata(ids, num_experts, keep)
    top_k = ids.shape[1]
    pg = comm.resolve_group(group)
    if comm.group_size(pg) == 1:  # the gather is fused into the gate/up GEMM: no copy of x
        rows = torch.div(order, top_k, rounding_mode="floor")  # (the token of each pair)
        out = expert_swiglu(x, experts, counts, rows, pos, act)
        return _combine(out, weights, pos, order), counts
    name = comm.group_name(pg)
    x_recv, recv_counts, regroup, inverse, splits = _dispatch(x, order, pos, counts, top_k, name)
    out = expert_swiglu(x_recv, experts, recv_counts.sum(0), regroup, inverse.view(-1, 1), act)
    out = _permute(out, inverse, regroup.view(-1, 1))  # back to source-major
    out = _return(out, splits, name, False)
    return _combine(out, weights, pos, order), counts


# --- reference -------------------------------------------------------------------------------


def moe_reference(
    x,
    spec: "MoESpec",
    router_weight,
    experts: Experts,
    *,
    router_bias=None,
    expert_bias=None,
    shared=None,
    shared_gate=None,
    batched=False,
):
    """The whole layer as a naive loop over tokens and experts, in x's dtype (float64 in ->
    the oracle; the router in at least fp32, as the layer's). `spec` (`fusedpar.nn.
    MoESpec`) gives the routing (top_k, score, norm_topk_prob, capacity_factor), the losses'
    coefficients and the activation (not group-limited routing, a routed scaling nor
    aux_loss="sequence": ValueError); the tensors given decide the rest. Full (unsharded)
    stacks: router_weight (E, d); `experts` w1, w3 (E, h, d), w2 (E, d, h) and optionally
    the biases b1, b3 (E, h), b2 (E, d): expert e computes ``w2[e] @ act(w1[e] @ x + b1[e],
    w3[e] @ x + b3[e]) + b2[e]``, act ``silu(g) * u`` or, with
    ``activation="clamped_swiglu"``, gpt-oss's ``(u' + 1) * g' * sigmoid(alpha * g')`` (``g'
    = min(g, limit)``, ``u' = clamp(u, -limit, limit)``: the spec's swiglu_alpha,
    swiglu_limit); `router_bias` (E,): added to the logits; `expert_bias` (E,): the sigmoid
    router's selection bias; `shared` (w1 (hs, d), w2 (d, hs), w3 (hs, d)): a shared expert
    every token goes through, scaled by ``sigmoid(x @ shared_gate.T)`` if given (1, d).
    Returns (y (T, d), aux_loss). ``batched``: each expert's gate and up projections of
    every token as one matmul, ``x @ w1[e].T + b1[e]`` (the order a batched model sums in),
    not a token at a time: in fp32 another, equally valid rounding of the same math."""
    if (spec.n_group, spec.topk_group, spec.routed_scaling_factor) != (1, 1, 1.0):
        raise ValueError("moe_reference: no group-limited routing nor routed scaling")
    if spec.aux_loss != "switch":  # (its float64 loop: tests/moe/test_sequence_aux.py)
        raise ValueError(f"moe_reference: the Switch auxiliary loss only, not {spec.aux_loss!r}")
    top_k, score, capacity_factor = spec.top_k, spec.score, spec.capacity_factor
    w1, w3, w2, b1, b3, b2 = experts
    bias = b1 is not None
    T, E = x.shape[0], router_weight.shape[0]
    router_dtype = accumulator(x.dtype)
    logits = x.to(router_dtype) @ router_weight.to(router_dtype).T
    if router_bias is not None:
        logits = logits + router_bias.to(router_dtype)
    probs = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    select = probs if expert_bias is None or score == "softmax" else probs + expert_bias
    ids = select.detach().topk(top_k, dim=-1).indices
    weights = probs.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    kept = [[True] * top_k for _ in range(T)]
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * T * top_k / E)
        for e in range(E):
            pairs = [(t, j) for t in range(T) for j in range(top_k) if ids[t, j] == e]
            pairs.sort(key=lambda tj: (-float(weights[tj].detach()), tj[0] * top_k + tj[1]))
            for t, j in pairs[capacity:]:
                kept[t][j] = False
    every = {}  # batched: expert e's (G, U) (T, h), made once

    def projections(e, t):  # (g, u) of token t by expert e
        if batched:
            if e not in every:
                pairs = ((w1, b1), (w3, b3))
                every[e] = tuple(x @ w[e].T + (b[e] if bias else 0) for w, b in pairs)
            return every[e][0][t], every[e][1][t]
        return w1[e] @ x[t] + (b1[e] if bias else 0), w3[e] @ x[t] + (b3[e] if bias else 0)

    rows = []
    for t in range(T):
        y_t = x.new_zeros(x.shape[1])
        for j in range(top_k):
            if kept[t][j]:
                e = int(ids[t, j])
                g, u = projections(e, t)
                hidden = swiglu_reference(g, u, spec.activation, *spec.swiglu())
                out = w2[e] @ hidden + (b2[e] if bias else 0)
                y_t = y_t + weights[t, j].to(x.dtype) * out
        rows.append(y_t)
    y = torch.stack(rows) if rows else x.new_zeros((0, x.shape[1]))
    if shared is not None:
        s1, s2, s3 = shared
        out = (torch.nn.functional.silu(x @ s1.T) * (x @ s3.T)) @ s2.T
        y = y + (out if shared_gate is None else torch.sigmoid(x @ shared_gate.T) * out)
    return y, aux_losses(probs, logits, ids, score, spec.aux_loss_coef, spec.z_loss_coef)
