"""MoE routing, forward and backward: one row kernel each, fp32, from the router's logits.

A program holds whole rows of the logits (T, E): a token's scores, top-k and weights come
from one read of its row, in place of PyTorch's softmax, topk, gather, sum and division
(and their backwards), each an op (host time) and a pass over (T, E) (GPU time).

| function               | computes                                                       |
| ---------------------- | -------------------------------------------------------------- |
| `route_top_k`          | ``probs = softmax(logits)`` or ``sigmoid(logits)`` (T, E);     |
|                        | ``ids`` (T, k) int32: the k largest of ``probs`` (``+ bias``,  |
|                        | sigmoid only), largest first, the lower expert on a tie; with  |
|                        | ``groups=(n, m)`` among the m of n expert groups whose two     |
|                        | best selection scores sum highest (DeepSeek-V3's);             |
|                        | ``weights = probs[ids]`` (T, k), renormalized to sum to 1 with |
|                        | ``norm`` (top-1: exactly 1, whose gradient is exactly 0)       |
| `route_top_k_backward` | ``dlogits`` from ``dweights`` (T, k) and ``dprobs`` (T, E),    |
|                        | either absent: the chain rule in autograd's order              |

The torch implementation and the float64 reference close the file; on CUDA under
``FUSEDPAR_IMPL=auto`` the tuner times each kernel's fixed tile against torch's.
"""

import torch
import triton
import triton.language as tl
from fusedpar.kernels import common, impl, tuning
from fusedpar.kernels.common import check_launchable, is_interpreted
from fusedpar.kernels.tuning import bucket

SCORES = ("softmax", "sigmoid")
# A program holds whole rows: 1024 experts is 4x DeepSeek-V3's 256.
MAX_EXPERTS = 1024
# Elements of (rows x BLOCK_E) a program holds: 32 tokens of 128 experts; the backward
# keeps four such tiles live (probs, their gradient, the scatter's mask, the product).
ROW_TILE_ELEMENTS = 4096
# The interpreter runs programs one after another: two rows each, so tiny shapes still
# cross row blocks.
INTERPRETER_ROWS = 2


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every output of this module is allocated here (tests fill it with NaN first)."""
    return torch.empty(shape, dtype=dtype, device=device)


def row_config(E: int, interpreted: bool, grouped: bool = False) -> dict:
    """Rows of a program (ROW_TILE_ELEMENTS over the row width, 1 to 64) and its warps:
    8 for group-limited routing, whose group scores and masks keep more tiles live (4
    warps spilled 184 B at 256 experts)."""
    block_e = max(16, common.next_power_of_2(E))
    if interpreted:
        return dict(BLOCK_ROWS=INTERPRETER_ROWS, BLOCK_E=block_e, num_warps=4)
    rows = max(1, min(64, ROW_TILE_ELEMENTS // block_e))
    return dict(BLOCK_ROWS=rows, BLOCK_E=block_e, num_warps=8 if grouped else 4)


@triton.jit
def _row_block(T, E, BLOCK_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's rows (int64), the expert columns and top-k slots, and the masks."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_E)
    row_mask, col_mask = rows < T, cols < E
    mask = row_mask[:, None] & col_mask[None, :]
    return rows.to(tl.int64), cols, tl.arange(0, BLOCK_K), row_mask, col_mask, mask


@triton.jit
def _keep_best_groups(select, cols, group_size, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                      BLOCK_G: tl.constexpr):  # fmt: skip
    """`select` (rows, BLOCK_E) with every expert outside its row's TOPK_GROUP best groups
    at -inf: N_GROUP groups of `group_size` consecutive experts, a group scored by the
    sum of its two largest entries (Hugging Face's DeepSeek-V3 and GLM-4.5 routers)."""
    group_of = cols // group_size
    gcols = tl.arange(0, BLOCK_G)
    gscore = tl.full((select.shape[0], BLOCK_G), float("-inf"), tl.float32)
    for g in tl.static_range(N_GROUP):
        s = tl.where(group_of[None, :] == g, select, float("-inf"))
        first = tl.argmax(s, 1, tie_break_left=True)
        second = tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), s), 1)
        gscore = tl.where(gcols[None, :] == g, (tl.max(s, 1) + second)[:, None], gscore)
    kept = tl.zeros((select.shape[0], BLOCK_G), dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.argmax(gscore, 1, tie_break_left=True)
        hit = gcols[None, :] == best[:, None]
        kept = tl.where(hit, 1, kept)
        gscore = tl.where(hit, float("-inf"), gscore)
    keep = tl.zeros(select.shape, dtype=tl.int32)
    for g in tl.static_range(N_GROUP):
        kept_g = tl.sum(tl.where(gcols[None, :] == g, kept, 0), 1)  # (rows,) 0 or 1
        keep = tl.where(group_of[None, :] == g, kept_g[:, None], keep)
    return tl.where(keep > 0, select, float("-inf"))


@triton.jit
def _route_fwd_kernel(
    # pointers
    logits_ptr, bias_ptr, probs_ptr, weights_ptr, ids_ptr,
    # strides (probs, weights and ids are contiguous)
    stride_lt, stride_le,
    # sizes
    T, E,
    # meta-parameters
    TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
):  # fmt: skip
    """probs, then the top-k of probs (+ bias) by repeated argmax (among the kept groups'
    experts with N_GROUP > 1), and their weights."""
    rows64, cols, slots, row_mask, col_mask, mask = _row_block(T, E, BLOCK_ROWS, BLOCK_E, BLOCK_K)
    x = tl.load(logits_ptr + rows64[:, None] * stride_lt + cols[None, :] * stride_le,
                mask=mask, other=0.0)  # fmt: skip
    if SOFTMAX:
        x = tl.where(col_mask[None, :], x, float("-inf"))  # padding columns weigh 0
        e = tl.exp(x - tl.max(x, 1)[:, None])
        p = e / tl.sum(e, 1)[:, None]
    else:
        p = tl.sigmoid(x)
    tl.store(probs_ptr + rows64[:, None] * E + cols[None, :], p, mask=mask)
    select = p
    if HAS_BIAS:
        select += tl.load(bias_ptr + cols, mask=col_mask, other=0.0)[None, :]
    select = tl.where(col_mask[None, :], select, float("-inf"))
    if N_GROUP > 1:
        select = _keep_best_groups(select, cols, E // N_GROUP, N_GROUP, TOPK_GROUP, BLOCK_G)
    ids = tl.zeros((BLOCK_ROWS, BLOCK_K), dtype=tl.int32)
    picked = tl.zeros((BLOCK_ROWS, BLOCK_K), dtype=tl.float32)
    for j in range(TOP_K):
        # (a row of NaN logits from a diverged step compares false everywhere: its
        # argmax may name a padding column, which the dispatch would index with)
        best = tl.minimum(tl.argmax(select, 1, tie_break_left=True), E - 1)  # (BLOCK_ROWS,)
        hit = cols[None, :] == best[:, None]
        slot = slots[None, :] == j
        ids = tl.where(slot, best[:, None], ids)
        picked = tl.where(slot, tl.sum(tl.where(hit, p, 0.0), 1)[:, None], picked)
        select = tl.where(hit, float("-inf"), select)
    weights = picked
    if NORM:
        if TOP_K == 1:
            weights = tl.full((BLOCK_ROWS, BLOCK_K), 1.0, tl.float32)
        else:
            weights = picked / tl.sum(picked, 1)[:, None]
    out_mask = row_mask[:, None] & (slots[None, :] < TOP_K)
    out = rows64[:, None] * TOP_K + slots[None, :]
    tl.store(weights_ptr + out, weights, mask=out_mask)
    tl.store(ids_ptr + out, ids, mask=out_mask)


@triton.jit
def _route_bwd_kernel(
    # pointers
    probs_ptr, ids_ptr, d_weights_ptr, d_probs_ptr, d_logits_ptr,
    # strides (probs, ids and d_logits are contiguous)
    stride_dwt, stride_dwk, stride_dpt, stride_dpe,
    # sizes
    T, E,
    # meta-parameters
    TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, NORM: tl.constexpr,
    HAS_D_WEIGHTS: tl.constexpr, HAS_D_PROBS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """dprobs += the weights' gradient scattered to the chosen experts; then dlogits."""
    rows64, cols, slots, row_mask, col_mask, mask = _row_block(T, E, BLOCK_ROWS, BLOCK_E, BLOCK_K)
    p = tl.load(probs_ptr + rows64[:, None] * E + cols[None, :], mask=mask, other=0.0)
    if HAS_D_PROBS:
        dp = tl.load(d_probs_ptr + rows64[:, None] * stride_dpt + cols[None, :] * stride_dpe,
                     mask=mask, other=0.0)  # fmt: skip
    else:
        dp = tl.zeros((BLOCK_ROWS, BLOCK_E), dtype=tl.float32)
    if HAS_D_WEIGHTS and not (NORM and TOP_K == 1):  # (top-1 renormalized: a constant 1)
        slot_mask = row_mask[:, None] & (slots[None, :] < TOP_K)
        ids = tl.load(ids_ptr + rows64[:, None] * TOP_K + slots[None, :], mask=slot_mask,
                      other=-1)  # fmt: skip
        dw = tl.load(d_weights_ptr + rows64[:, None] * stride_dwt + slots[None, :] * stride_dwk,
                     mask=slot_mask, other=0.0)  # fmt: skip
        d_picked = dw
        if NORM:  # w = a / s, s = sum(a): da_j = dw_j / s - sum_l(dw_l a_l / s^2)
            picked = tl.zeros((BLOCK_ROWS, BLOCK_K), dtype=tl.float32)
            for j in range(TOP_K):
                slot = slots[None, :] == j
                best = tl.sum(tl.where(slot, ids, 0), 1)
                value = tl.sum(tl.where(cols[None, :] == best[:, None], p, 0.0), 1)
                picked = tl.where(slot, value[:, None], picked)
            s = tl.where(row_mask, tl.sum(picked, 1), 1.0)  # (rows past T: no 0 / 0)
            d_sum = tl.sum(-dw * picked / (s * s)[:, None], 1)
            d_picked = dw / s[:, None] + d_sum[:, None]
        for j in range(TOP_K):
            slot = slots[None, :] == j
            best = tl.sum(tl.where(slot, ids, 0), 1)
            d_j = tl.sum(tl.where(slot, d_picked, 0.0), 1)
            dp += tl.where(cols[None, :] == best[:, None], d_j[:, None], 0.0)
    dl = p * (dp - tl.sum(dp * p, 1)[:, None]) if SOFTMAX else dp * (1.0 - p) * p
    tl.store(d_logits_ptr + rows64[:, None] * E + cols[None, :], dl, mask=mask)


# --- launchers ---------------------------------------------------------------------------


# A float64 model routes from float64 logits (`fusedpar.kernels.common.accumulator`):
# torch's implementation alone, every fp32 of the launchers below float64 then.
ROUTER_DTYPES = (torch.float32, torch.float64)


def check_route(logits: torch.Tensor, top_k: int, score: str, bias, groups=(1, 1)) -> None:
    if logits.dim() != 2 or logits.dtype not in ROUTER_DTYPES:
        raise ValueError(f"route_top_k: logits must be (T, E) float32 (or float64), got "
                         f"{logits.dtype} {tuple(logits.shape)}")  # fmt: skip
    E = logits.shape[1]
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"route_top_k: {E} experts, outside the 1 to {MAX_EXPERTS} a row "
                         f"program holds")  # fmt: skip
    if not 1 <= top_k <= E:
        raise ValueError(f"route_top_k: top_k ({top_k}) must be between 1 and E ({E})")
    if score not in SCORES:
        raise ValueError(f"route_top_k: score must be one of {SCORES}, got {score!r}")
    if bias is not None and (bias.shape != (E,) or bias.dtype != logits.dtype):
        raise ValueError(f"route_top_k: bias must be ({E},) {logits.dtype} (the logits'), got "
                         f"{bias.dtype} {tuple(bias.shape)}")  # fmt: skip
    check_groups(E, top_k, *groups)


def check_groups(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """Group-limited routing's sizes: n_group groups of at least 2 experts (a group
    scores by its two best), topk_group of them kept, holding at least top_k experts."""
    if n_group == 1 and topk_group == 1:
        return
    size = num_experts // n_group if n_group > 0 else 0
    if n_group < 1 or num_experts % n_group or size < 2:
        raise ValueError(f"route_top_k: {num_experts} experts do not split into n_group="
                         f"{n_group} groups of 2 or more")  # fmt: skip
    if not 1 <= topk_group <= n_group or topk_group * size < top_k:
        raise ValueError(f"route_top_k: topk_group={topk_group} of {n_group} groups of {size} "
                         f"experts cannot hold top_k={top_k}")  # fmt: skip


def route_top_k(logits, top_k: int, score: str = "softmax", norm: bool = True, bias=None,
                groups: tuple[int, int] = (1, 1)):  # fmt: skip
    """``(weights (T, k) fp32, ids (T, k) int32, probs (T, E) fp32)`` from the router's
    logits (T, E) fp32 (see the module doc); `bias` (E,) fp32 or None shifts a sigmoid
    router's selection only (DeepSeek-V3's aux-loss-free balancing); ``groups=(n_group,
    topk_group)`` limits it to the best groups (`check_groups`). (float64 logits:
    float64 for every fp32 here, on torch's implementation.)"""
    check_route(logits, top_k, score, bias, groups)
    T, E = logits.shape
    device = logits.device
    probs = _empty((T, E), logits.dtype, device)
    weights = _empty((T, top_k), logits.dtype, device)
    ids = _empty((T, top_k), torch.int32, device)
    use_bias = bias is not None and score == "sigmoid"

    def run_torch():
        route_top_k_torch(logits, top_k, score, norm, bias if use_bias else None, weights,
                          ids, probs, groups)  # fmt: skip

    if impl.runs_torch(logits):
        run_torch()
    elif T:
        check_launchable(_route_fwd_kernel, logits, *([bias] if use_bias else []))
        config = row_config(E, is_interpreted(_route_fwd_kernel), groups[0] > 1)
        grid = (common.cdiv(T, config["BLOCK_ROWS"]),)
        args = (logits, bias if use_bias else probs, probs, weights, ids, *logits.stride(), T, E)
        meta = dict(TOP_K=top_k, SOFTMAX=score == "softmax", NORM=bool(norm), HAS_BIAS=use_bias,
                    N_GROUP=groups[0], TOPK_GROUP=groups[1],
                    BLOCK_K=common.next_power_of_2(top_k),
                    BLOCK_G=common.next_power_of_2(groups[0]))  # fmt: skip
        key = (bucket(T), E, top_k, score, bool(norm), use_bias, tuple(groups))
        tuning.run_tile_or_torch(_route_fwd_kernel, config, lambda _: grid, args, meta, key,
                                  logits, run_torch)  # fmt: skip
    return weights, ids, probs


def route_top_k_backward(d_weights, d_probs, probs, ids, score: str = "softmax",
                         norm: bool = True):  # fmt: skip
    """``dlogits`` (T, E) fp32 of `route_top_k` from the gradients of its weights (T, k)
    and probs (T, E) (fp32, float64 for float64 probs; None for a gradient that did not
    flow) and its probs and ids."""
    if probs.dim() != 2 or probs.dtype not in ROUTER_DTYPES or not probs.is_contiguous():
        raise ValueError(f"route_top_k_backward: probs must be contiguous (T, E) float32 (the "
                         f"forward's), got {probs.dtype} {tuple(probs.shape)}")  # fmt: skip
    T, E = probs.shape
    if ids.dim() != 2 or ids.shape[0] != T or ids.dtype != torch.int32 or not ids.is_contiguous():
        raise ValueError(f"route_top_k_backward: ids must be contiguous ({T}, k) int32 (the "
                         f"forward's), got {ids.dtype} {tuple(ids.shape)}")  # fmt: skip
    top_k = ids.shape[1]
    for name, g, shape in (("d_weights", d_weights, (T, top_k)), ("d_probs", d_probs, (T, E))):
        if g is not None and (tuple(g.shape) != shape or g.dtype != probs.dtype):
            wide = str(probs.dtype).removeprefix("torch.")
            raise ValueError(f"route_top_k_backward: {name} must be {shape} {wide}, got "
                             f"{g.dtype} {tuple(g.shape)}")  # fmt: skip
    d_logits = _empty((T, E), probs.dtype, probs.device)

    def run_torch():
        route_top_k_backward_torch(d_weights, d_probs, probs, ids, score, norm, d_logits)

    if impl.runs_torch(probs):
        run_torch()
    elif T:
        given = [g for g in (d_weights, d_probs) if g is not None]
        check_launchable(_route_bwd_kernel, probs, ids, *given)
        config = row_config(E, is_interpreted(_route_bwd_kernel))
        grid = (common.cdiv(T, config["BLOCK_ROWS"]),)
        dw = probs if d_weights is None else d_weights  # (not read: a pointer to pass)
        dp = probs if d_probs is None else d_probs
        args = (probs, ids, dw, dp, d_logits, *dw.stride(), *dp.stride(), T, E)
        meta = dict(TOP_K=top_k, SOFTMAX=score == "softmax", NORM=bool(norm),
                    HAS_D_WEIGHTS=d_weights is not None, HAS_D_PROBS=d_probs is not None,
                    BLOCK_K=common.next_power_of_2(top_k))  # fmt: skip
        key = (bucket(T), E, top_k, *meta.values())
        tuning.run_tile_or_torch(_route_bwd_kernel, config, lambda _: grid, args, meta, key,
                                  probs, run_torch)  # fmt: skip
    return d_logits


# --- torch implementation and reference ----------------------------------------------------


def route_top_k_torch(logits, top_k, score, norm, bias, weights, ids, probs,
                      groups=(1, 1)) -> None:  # fmt: skip
    """`route_top_k`'s contract in PyTorch, into weights, ids and probs: the reference's
    math, with a renormalized top-1 weight exactly 1 (p / p would be 0 / 0 at p = 0)."""
    one = norm and top_k == 1
    picked, chosen, scores = route_reference(logits, top_k, score, norm and not one, bias,
                                             groups)  # fmt: skip
    probs.copy_(scores)
    ids.copy_(chosen)
    if one:
        weights.fill_(1.0)
    else:
        weights.copy_(picked)


def route_top_k_backward_torch(d_weights, d_probs, probs, ids, score, norm, d_logits) -> None:
    """`route_top_k_backward`'s contract in PyTorch, into d_logits."""
    dp = torch.zeros_like(probs) if d_probs is None else d_probs.clone()
    top_k = ids.shape[1]
    if d_weights is not None and not (norm and top_k == 1):
        index = ids.long()
        d_picked = d_weights
        if norm:
            picked = probs.gather(1, index)
            s = picked.sum(-1, keepdim=True)
            d_picked = d_weights / s + (-d_weights * picked / (s * s)).sum(-1, keepdim=True)
        dp.scatter_add_(1, index, d_picked)
    if score == "softmax":
        d_logits.copy_(probs * (dp - (dp * probs).sum(-1, keepdim=True)))
    else:
        d_logits.copy_(dp * (1 - probs) * probs)


def route_reference(logits, top_k: int, score: str = "softmax", norm: bool = True, bias=None,
                    groups: tuple[int, int] = (1, 1)):  # fmt: skip
    """``(weights, ids, probs)`` in logits' dtype (float64 in: the oracle), differentiable
    by autograd; ids int64 (torch.topk's). `groups`: as Hugging Face's DeepSeek-V3 router
    keeps them (the rest of the experts at -inf for the choice)."""
    probs = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    select = probs if bias is None or score == "softmax" else probs + bias.to(probs.dtype)
    select = select.detach()
    n_group, topk_group = groups
    if n_group > 1:
        T, E = select.shape
        by_group = select.view(T, n_group, E // n_group)
        best = by_group.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
        kept = torch.zeros_like(by_group[..., 0], dtype=torch.bool).scatter_(1, best, True)
        select = select.masked_fill(~kept.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = select.topk(top_k, dim=-1).indices
    weights = probs.gather(1, ids)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids, probs
