"""Sequence-parallel tensor parallelism: GEMMs whose all-gather or reduce-scatter travels
a ring in chunks, each chunk's transfer overlapping the GEMM of the one before it.

| op (W ranks)            | x               | weight     | result          | backward            |
| ----------------------- | --------------- | ---------- | --------------- | ------------------- |
| `all_gather_matmul`     | (T/W, ..., K)   | (N_loc, K) | (T, ..., N_loc) | ``dX = rs(dY @ W)`` |
| `matmul_reduce_scatter` | (T, ..., K_loc) | (N, K_loc) | (T/W, ..., N)   | ``dX = g(dY) @ W``  |

g = all-gather, rs = reduce-scatter, on dim 0; ``Y = g(X) @ W^T + b`` and ``Y = rs(X @
W^T) + b``, the reduce-scatter's partials added in fp32 (float64 for float64) and
rounded once. ``overlap=`` (or ``FUSEDPAR_OVERLAP``, read at the call;
`resolve_overlap`) picks the schedule (`fusedpar.ops.tp_schedules`):

| overlap    | runs                                                                     |
| ---------- | ------------------------------------------------------------------------ |
| ``serial`` | one collective, one GEMM (inside the ops: 0 chunks per rank)             |
| ``ring``   | the pipelined ring, PyTorch async-TP's and Flux's order (its chunks)     |
| ``fused``  | one persistent GEMM taking chunks as the copy engine lands them          |
|            | (`fusedpar.ops.linear_fused`; -1); NCCL groups only                      |
| ``auto``   | measured per shape on a GPU, else a rule (`fusedpar.ops.overlap`)        |
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from fusedpar.comm import (
    Group,
    active_group,
    all_gather_async,
    group_by_name,
    group_name,
    group_size,
)
from fusedpar.kernels import rope as rope_kernels
from fusedpar.kernels.common import accumulator, check_float_dtype
from fusedpar.kernels.matmul import RowRotation, matmul, rope_epilogue_fits
from fusedpar.ops.overlap import FUSED, ring_chunks
from fusedpar.ops.registration import asked, autograd_op, direct_op, flat, row_sum, spread
from fusedpar.ops.tp_schedules import gather_matmuls, matmuls_reduce_scatter

DEFAULT_CHUNKS_PER_RANK = 1  # one ring message per rank and step, as in async-TP


# --- custom ops: fusedpar::all_gather_matmul, fusedpar::matmul_reduce_scatter ------------
# The group crosses the op boundary by name (`fusedpar.comm.group_name`). A gradient not
# asked for comes back from a backward op as an empty (0,) tensor: ops return tensors.


def _heads(t: Tensor, head_dim: int) -> Tensor:
    """t (T, ..., N) as (B, T, N / head_dim, head_dim), B the dims between (a view: the
    layout `fusedpar.kernels.rope` takes, positions along T)."""
    between = math.prod(t.shape[1:-1])  # (not -1: a rank may have no tokens)
    return t.view(t.shape[0], between, t.shape[-1] // head_dim, head_dim).transpose(0, 1)


def _rotate_outputs(
    ts: list[Tensor], rope: list[Tensor], head_dim: int, inverse: bool, outs: list[Tensor]
) -> None:
    """`fusedpar.kernels.rope` of the (T, ..., N) tensors `ts` into `outs` (in place where
    they are `ts`), two at a time (q and k in one launch)."""
    cos, sin = rope
    for i in range(0, len(ts), 2):
        pair = [_heads(t, head_dim) for t in ts[i : i + 2]]
        into = [_heads(t, head_dim) for t in outs[i : i + 2]]
        if len(pair) == 2:
            rope_kernels.rope_pair(*pair, cos, sin, inverse, outs=into)
        else:
            rope_kernels.rope(pair[0], cos, sin, inverse, out=into[0])


class GatherOptions(NamedTuple):
    """The all-gather GEMM ops' options, which cross the op boundary as one ``int[]``
    (`ints`; `of` reads it back): the ring's `chunks` (`ring_chunks`), the heads'
    `head_dim` (0: no rope) and per weight whether its output is rotated (`rotate`); the
    forward's `save_gathered` (`save_gathered_input`); the backward's gradients asked for
    (`needs_x`; per weight `needs_w`, and `needs_b`: False where it has no bias)."""

    chunks: int
    head_dim: int
    rotate: tuple[bool, ...]
    save_gathered: bool = False
    needs_x: bool = False
    needs_w: tuple[bool, ...] = ()
    needs_b: tuple[bool, ...] = ()

    def ints(self) -> list[int]:
        """[chunks, head_dim, save_gathered, needs_x, *rotate, *needs_w, *needs_b]."""
        flags = (self.save_gathered, self.needs_x, *self.rotate, *self.needs_w, *self.needs_b)
        return [self.chunks, self.head_dim, *(1 if f else 0 for f in flags)]

    @staticmethod
    def of(ints: list[int], weights: int) -> "GatherOptions":
        """The options `ints` holds, for an op of `weights` weights."""
        chunks, head_dim, save, needs_x, *flags = ints
        flags = tuple(bool(f) for f in flags)
        per = [flags[i * weights : (i + 1) * weights] for i in range(3)]
        return GatherOptions(chunks, head_dim, per[0], bool(save), bool(needs_x), *per[1:])


@torch.library.custom_op("fusedpar::all_gather_matmul", mutates_args=())
def _all_gather_matmul_op(
    x: Tensor,
    weights: list[Tensor],
    biases: list[Tensor],
    has_bias: list[bool],
    group: str,
    options: list[int],
    rope: list[Tensor],
    reduce_dtype: torch.dtype | None,
) -> tuple[list[Tensor], Tensor]:
    """The outputs (T, ..., N_i) and, when ``save_gathered`` (`GatherOptions`, as
    `options`), the gathered x (T * rows, K) for the backward (else an empty tensor: it
    re-gathers). `biases`: those of the weights with ``has_bias`` (a list of optional
    tensors would not carry gradients through ``torch.library``'s autograd). `rope`: none,
    or the tables cos, sin (T, r/2) that turn the outputs flagged in ``rotate``, heads of
    ``head_dim``: in the GEMMs' epilogue where it fits (`rope_epilogue_fits`, full
    rotary), else in place after. `reduce_dtype`: the backward's (its dX reduce-scatter's
    partials)."""
    pg = group_by_name(group)
    biases = spread(biases, has_bias)
    o = GatherOptions.of(options, len(weights))
    full = bool(rope) and 2 * rope[0].shape[1] == o.head_dim
    # (the fused schedule's GEMM has no rotating epilogue: it rotates after)
    in_epilogue = full and rope_epilogue_fits(x.dtype, o.head_dim) and o.chunks != FUSED
    rotations = None
    if in_epilogue:  # rows in (T, ...) order: the dims between share a position
        rotation = RowRotation(*rope, rows_per_position=max(1, math.prod(x.shape[1:-1])))
        rotations = [rotation if r else None for r in o.rotate]
    outs, gathered = gather_matmuls(
        flat(x), [w.t() for w in weights], biases, pg, o.chunks, epilogues=rotations
    )
    lead = (group_size(pg) * x.shape[0], *x.shape[1:-1])
    outs = [out.view(*lead, out.shape[1]) for out in outs]
    if rope and not in_epilogue:
        turned = [out for out, r in zip(outs, o.rotate, strict=True) if r]
        _rotate_outputs(turned, rope, o.head_dim, False, turned)
    # Not kept: an empty tensor, so that nothing (selective checkpointing caches every
    # output of this op) holds W times the input until the backward.
    # (one rank: x itself, which an op may not return; the backward takes x)
    kept = gathered if o.save_gathered and group_size(pg) > 1 else x.new_empty(0)
    return outs, kept


@_all_gather_matmul_op.register_fake
def _(x, weights, biases, has_bias, group, options, rope, reduce_dtype):
    size = group_size(group_by_name(group))
    lead = (size * x.shape[0], *x.shape[1:-1])
    outs = [x.new_empty((*lead, w.shape[0])) for w in weights]
    kept = GatherOptions.of(options, len(weights)).save_gathered and size > 1
    return outs, x.new_empty((size * flat(x).shape[0], x.shape[-1]) if kept else 0)


@torch.library.custom_op("fusedpar::all_gather_matmul_backward", mutates_args=())
def _all_gather_matmul_backward_op(
    grads: list[Tensor],
    x: Tensor,
    gathered: Tensor | None,
    weights: list[Tensor],
    group: str,
    options: list[int],
    rope: list[Tensor],
    reduce_dtype: torch.dtype | None,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """dX (reduce-scattered, pipelined), each weight's gradient, and each bias's, as
    `options` (`GatherOptions`) asks. The gradients of rotated outputs are turned back
    first (the rotation's transpose), into new (T, ..., N) buffers whose rows the GEMMs
    read flat."""
    pg = group_by_name(group)
    o = GatherOptions.of(options, len(weights))
    if rope:
        turned = [g for g, r in zip(grads, o.rotate, strict=True) if r]
        back = [torch.empty(g.shape, dtype=g.dtype, device=g.device) for g in turned]
        _rotate_outputs(turned, rope, o.head_dim, True, back)
        unturned = iter(back)
        grads = [next(unturned) if r else g for g, r in zip(grads, o.rotate, strict=True)]
    dys = [flat(g) for g in grads]
    regather = None
    if group_size(pg) == 1:
        gathered = flat(x)  # one rank: its rows are all there are
    elif gathered is None and any(o.needs_w):
        regather = all_gather_async(flat(x), pg)  # runs while dX is computed
    dx = x.new_empty(0)
    if o.needs_x:
        pairs = list(zip(dys, weights, strict=True))
        dx = matmuls_reduce_scatter(pairs, pg, o.chunks, x.dtype, reduce_dtype=reduce_dtype)
        dx = dx.view(x.shape)
    if regather is not None:
        gathered = regather.wait()
    dws = [
        matmul(dy.t(), gathered) if need else w.new_empty(0)
        for dy, w, need in zip(dys, weights, o.needs_w, strict=True)
    ]
    dbs = [
        row_sum(dy, w.dtype) if need else w.new_empty(0)
        for dy, w, need in zip(dys, weights, o.needs_b, strict=True)
    ]
    return dx, dws, dbs


@_all_gather_matmul_backward_op.register_fake
def _(grads, x, gathered, weights, group, options, rope, reduce_dtype):
    o = GatherOptions.of(options, len(weights))
    dx = x.new_empty(x.shape if o.needs_x else 0)  # fresh, contiguous: the real op's layout
    dws = [w.new_empty(w.shape if n else 0) for w, n in zip(weights, o.needs_w, strict=True)]
    dbs = [w.new_empty(w.shape[0] if n else 0) for w, n in zip(weights, o.needs_b, strict=True)]
    return dx, dws, dbs


def _all_gather_matmul_setup(ctx, inputs, output):
    x, weights, biases, has_bias, group, options, rope, reduce_dtype = inputs
    o = GatherOptions.of(options, len(weights))
    needs_b = tuple(b is not None and b.requires_grad for b in spread(biases, has_bias))
    needs_w = tuple(w.requires_grad for w in weights)
    ctx.options = o._replace(needs_x=x.requires_grad, needs_w=needs_w, needs_b=needs_b)
    ctx.group, ctx.has_bias, ctx.reduce_dtype = group, has_bias, reduce_dtype  # (dX's partials')
    gathered = output[1] if o.save_gathered else None
    ctx.save_for_backward(x, gathered, *rope, *weights)


def _all_gather_matmul_grads(ctx, grads, _):
    x, gathered, *rest = ctx.saved_tensors
    rope, weights = rest[: len(rest) - len(ctx.has_bias)], rest[len(rest) - len(ctx.has_bias) :]
    o = ctx.options
    dx, dws, dbs = _all_gather_matmul_backward(
        grads, x, gathered, weights, ctx.group, o.ints(), rope, ctx.reduce_dtype
    )
    dbs = [db for db, has in zip(asked(dbs, o.needs_b), ctx.has_bias, strict=True) if has]
    dx = dx if o.needs_x else None
    return dx, asked(dws, o.needs_w), dbs, None, None, None, [None] * len(rope), None


@torch.library.custom_op("fusedpar::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    group: str,
    chunks: int,
    reduce_dtype: torch.dtype | None,
) -> Tensor:
    pg = group_by_name(group)
    y = matmuls_reduce_scatter(
        [(flat(x), weight.t())], pg, chunks, x.dtype, bias, reduce_dtype=reduce_dtype
    )
    return y.view(x.shape[0] // group_size(pg), *x.shape[1:-1], weight.shape[0])


@_matmul_reduce_scatter_op.register_fake
def _(x, weight, bias, group, chunks, reduce_dtype):
    size = group_size(group_by_name(group))
    return x.new_empty((x.shape[0] // size, *x.shape[1:-1], weight.shape[0]))


@torch.library.custom_op("fusedpar::matmul_reduce_scatter_backward", mutates_args=())
def _matmul_reduce_scatter_backward_op(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    group: str,
    chunks: int,
    needs_x: bool,
    needs_w: bool,
    needs_b: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """dX from the all-gather ring of dY that also gathers dY for dW."""
    pg = group_by_name(group)
    dy2d = flat(dy)
    operands = [weight] if needs_x else []
    outs, dy_full = gather_matmuls(dy2d, operands, [None] * len(operands), pg, chunks)
    dx = outs[0].view(x.shape) if needs_x else x.new_empty(0)
    dw = matmul(dy_full.t(), flat(x)) if needs_w else weight.new_empty(0)
    db = row_sum(dy2d, weight.dtype) if needs_b else weight.new_empty(0)
    return dx, dw, db


@_matmul_reduce_scatter_backward_op.register_fake
def _(dy, x, weight, group, chunks, needs_x, needs_w, needs_b):
    return (
        x.new_empty(x.shape if needs_x else 0),  # fresh, contiguous: the real op's layout
        weight.new_empty(weight.shape if needs_w else 0),
        weight.new_empty(weight.shape[0] if needs_b else 0),
    )


def _matmul_reduce_scatter_setup(ctx, inputs, output):
    x, weight, bias, group, chunks, _ = inputs  # (reduce_dtype: the forward's only)
    ctx.options = (
        group,
        chunks,
        x.requires_grad,
        weight.requires_grad,
        bias is not None and bias.requires_grad,
    )
    ctx.save_for_backward(x, weight)


def _matmul_reduce_scatter_grads(ctx, dy):
    x, weight = ctx.saved_tensors
    grads = _matmul_reduce_scatter_backward(dy, x, weight, *ctx.options)
    return *asked(grads, ctx.options[2:]), None, None, None


_all_gather_matmul_backward = direct_op(_all_gather_matmul_backward_op)
_matmul_reduce_scatter_backward = direct_op(_matmul_reduce_scatter_backward_op)
_matmul_reduce_scatter_forward = direct_op(_matmul_reduce_scatter_op)  # inside _GatedDown
_all_gather_matmul = autograd_op(
    _all_gather_matmul_op, _all_gather_matmul_grads, _all_gather_matmul_setup
)
_matmul_reduce_scatter = autograd_op(
    _matmul_reduce_scatter_op, _matmul_reduce_scatter_grads, _matmul_reduce_scatter_setup
)


def _check_chunks(chunks: int) -> None:
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks_per_rank must be a positive int, got {chunks!r}")


def _check_reduce_dtype(reduce_dtype, what: str) -> None:
    if reduce_dtype is not None and not (
        isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point
    ):
        raise TypeError(
            f"{what}: reduce_dtype must be None or a floating torch.dtype, got {reduce_dtype!r}"
        )


def check_reduce_dtype(reduce_dtype):
    """`reduce_dtype` as a layer keeps it (None, or a floating dtype)."""
    _check_reduce_dtype(reduce_dtype, "reduce_dtype")
    return reduce_dtype


def _check_linear(x, weight, bias, what, k_dim=-1):
    check_float_dtype(f"{what}: x", x)  # (float64 under FUSEDPAR_IMPL=triton: refused here)
    if weight.dim() != 2:
        raise ValueError(f"{what}: weight must be 2-D (N, K), got {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[k_dim]:
        raise ValueError(
            f"{what}: x has K={x.shape[k_dim]} (shape {tuple(x.shape)}), weight has "
            f"K={weight.shape[1]} (shape {tuple(weight.shape)})"
        )
    if weight.dtype != x.dtype:
        raise TypeError(f"{what}: x is {x.dtype} but weight is {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"{what}: x is on {x.device} but weight on {weight.device}")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{what}: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"{what}: x is {x.dtype} but bias is {bias.dtype}")


def _check_rope(x, weights, rope, rotate, head_dim, size) -> tuple[list, list, int]:
    """`all_gather_matmul`'s rotary arguments as its op takes them: [cos, sin] (or []),
    a flag per weight, the head dim (0: none)."""
    if rope is None:
        if rotate is not None or head_dim is not None:
            raise ValueError("all_gather_matmul: rotate and head_dim go with rope=(cos, sin)")
        return [], [False] * len(weights), 0
    cos, sin = rope
    tokens = size * x.shape[0]
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != tokens:
        raise ValueError(
            f"all_gather_matmul: rope's cos and sin must be (T={tokens}, r/2), "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    wide = accumulator(x.dtype)  # float64 tables for float64 x
    if cos.dtype != wide or sin.dtype != wide:
        raise TypeError(
            f"all_gather_matmul: rope's tables must be {wide} for {x.dtype} x, "
            f"got {cos.dtype} and {sin.dtype}"
        )
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(
            "all_gather_matmul: rope's tables take no gradient here (for "
            "that, turn q and k with `fusedpar.nn.attention.apply_rope`)"
        )
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(
            f"all_gather_matmul: x on {x.device}, rope's tables on {cos.device} and {sin.device}"
        )
    head_dim = 2 * cos.shape[1] if head_dim is None else head_dim
    rotate = [True] * len(weights) if rotate is None else [bool(r) for r in rotate]
    if len(rotate) != len(weights):
        raise ValueError(
            f"all_gather_matmul: {len(weights)} weights but {len(rotate)} rotate flags"
        )
    if not (0 < 2 * cos.shape[1] <= head_dim):
        raise ValueError(
            f"all_gather_matmul: {2 * cos.shape[1]} rotated dims (2 * "
            f"cos.shape[1]) in heads of head_dim={head_dim}"
        )
    for w, r in zip(weights, rotate, strict=True):
        if r and w.shape[0] % head_dim:
            raise ValueError(
                f"all_gather_matmul: a rotated output of {w.shape[0]} features "
                f"is not whole heads of head_dim={head_dim}"
            )
    return [cos.contiguous(), sin.contiguous()], rotate, head_dim


def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor | Sequence[torch.Tensor],
    group: Group,
    *,
    bias: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    chunks_per_rank: int = DEFAULT_CHUNKS_PER_RANK,
    save_gathered_input: bool = False,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    rotate: Sequence[bool] | None = None,
    head_dim: int | None = None,
    overlap: str | None = None,
    reduce_dtype: torch.dtype | None = None,
):
    """``all_gather(x, dim 0) @ weight.T (+ bias)``, pipelined around the ring.

    x (T/W, ..., K): this rank's tokens. weight (N_loc, K), or a list of them: one gather
    feeds every GEMM (fused QKV, gate/up) and a list of (T, ..., N_i) comes back. bias
    (N_loc,), or a list aligned with the weights (entries may be None). The backward
    re-gathers x while it computes dX, unless ``save_gathered_input`` keeps the gathered
    copy from the forward (memory for one all-gather less). ``chunks_per_rank`` cuts each
    rank's rows into that many ring messages. With ``group=None`` this is a plain GEMM.

    ``rope=(cos, sin)``: tables (T, r/2) fp32 (float64 for float64 x; no gradient) at the
    positions of the outputs' dim 0; the outputs flagged in ``rotate`` (default: all)
    come back with their heads of ``head_dim`` (default r) turned as
    `fusedpar.nn.apply_rope` turns them (q and k of a QKV projection: ``rotate=[True,
    True, False]``). With full rotary (r =
    head_dim) and heads the GEMM's tiles hold whole (`fusedpar.kernels.matmul.
    rope_epilogue_fits`: 16-bit up to 128, fp32 up to 64) the rotation is the GEMMs'
    epilogue, rounded once with the product; otherwise one launch after the ring turns
    them in place. The backward turns their gradients back first.

    ``overlap``: the schedule, forward and backward ("auto", "serial", "ring", "fused"; None:
    ``FUSEDPAR_OVERLAP``, else "auto"; the module doc); ``chunks_per_rank`` is the ring's.
    ``reduce_dtype`` (e.g. torch.bfloat16, as Megatron reduces): the dtype the backward's
    dX partials travel in (None: fp32; `matmuls_reduce_scatter`).
    """
    many = isinstance(weight, (list, tuple))
    weights = list(weight) if many else [weight]
    if not many:
        biases = [bias]
    elif isinstance(bias, torch.Tensor):
        raise ValueError("with a list of weights, pass bias as a list (None entries allowed)")
    else:
        biases = [None] * len(weights) if bias is None else list(bias)
    if not weights or len(biases) != len(weights):
        raise ValueError(f"{len(weights)} weights but {len(biases)} biases")
    if x.dim() < 2:
        raise ValueError(f"all_gather_matmul: x must be (T/W, ..., K), got {tuple(x.shape)}")
    for w, b in zip(weights, biases, strict=True):
        _check_linear(x, w, b, "all_gather_matmul")
    _check_chunks(chunks_per_rank)
    pg = active_group(group)  # a group of one: a plain GEMM, no collective
    tables, flags, head_dim = _check_rope(x, weights, rope, rotate, head_dim, group_size(pg))
    present = [b for b in biases if b is not None]
    has_bias = [b is not None for b in biases]
    _check_reduce_dtype(reduce_dtype, "all_gather_matmul")
    chunks = ring_chunks(overlap, pg, chunks_per_rank)
    options = GatherOptions(chunks, head_dim, tuple(flags), save_gathered=save_gathered_input)
    outs, _ = _all_gather_matmul(
        x, weights, present, has_bias, group_name(pg), options.ints(), tables, reduce_dtype
    )
    return list(outs) if many else outs[0]


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Group,
    *,
    bias: torch.Tensor | None = None,
    chunks_per_rank: int = DEFAULT_CHUNKS_PER_RANK,
    overlap: str | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``reduce_scatter(x @ weight.T, dim 0) (+ bias)``, pipelined around the ring.

    x (T, ..., K_loc): every token, this rank's slice of the features; weight (N, K_loc);
    bias (N,), added once after the sum. Returns this rank's tokens (T/W, ..., N). Partial
    sums travel in fp32 (float64 for float64 x) and are rounded once. With ``group=None``
    this is a plain GEMM. ``overlap`` as in `all_gather_matmul`; ``reduce_dtype``: the
    dtype the partial sums travel in (None: fp32; e.g. torch.bfloat16 halves the bytes).
    """
    if x.dim() < 2:
        raise ValueError(f"matmul_reduce_scatter: x must be (T, ..., K), got {tuple(x.shape)}")
    _check_linear(x, weight, bias, "matmul_reduce_scatter")
    _check_chunks(chunks_per_rank)
    pg = active_group(group)  # a group of one: a plain GEMM, no collective
    size = group_size(pg)
    if x.shape[0] % size:
        raise ValueError(
            f"matmul_reduce_scatter: dim 0 of x (shape {tuple(x.shape)}) has {x.shape[0]} "
            f"tokens, not divisible by the group size {size}"
        )
    _check_reduce_dtype(reduce_dtype, "matmul_reduce_scatter")
    chunks = ring_chunks(overlap, pg, chunks_per_rank)
    return _matmul_reduce_scatter(x, weight, bias, group_name(pg), chunks, reduce_dtype)
