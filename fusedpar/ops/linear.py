"""Sequence-parallel tensor parallelism: GEMMs whose all-gather or reduce-scatter travels
a ring in chunks, each chunk's transfer overlapping the GEMM of the one before it.

Shapes on each of W ranks (T tokens in all, dim 0 sharded, any dims between):

| op                        | x                | weight        | result             |
| ------------------------- | ---------------- | ------------- | ------------------ |
| `all_gather_matmul`       | (T/W, ..., K)    | (N_loc, K)    | (T, ..., N_loc)    |
| `matmul_reduce_scatter`   | (T, ..., K_loc)  | (N, K_loc)    | (T/W, ..., N)      |

| op                      | forward                | backward                            |
| ----------------------- | ---------------------- | ----------------------------------- |
| `all_gather_matmul`     | ``Y = g(X) @ W^T + b`` | ``dX = rs(dY @ W)``, pipelined      |
|                         |                        | ``dW = dY^T @ g(X)``, ``db = sum dY`` |
| `matmul_reduce_scatter` | ``Y = rs(X @ W^T) + b`` | ``dX = g(dY) @ W``, pipelined      |
|                         |                        | ``dW = g(dY)^T @ X``, ``db = sum dY`` |

g = all-gather, rs = reduce-scatter, both on dim 0; the row op's db sums this rank's
rows only (the layers all-reduce it). The backward of `all_gather_matmul`
re-gathers X while it computes dX; that of `matmul_reduce_scatter` gets g(dY) from the
same ring that feeds the dX GEMMs.

The ring order is that of PyTorch async-TP and Flux: the all-gather multiplies the local
chunk first while the next arrives, each GEMM writing straight into its rows of the
output; the reduce-scatter computes the partial bound for one rank while the previous
partial travels, adds in fp32, and rounds once at the end (the bias after the sum).
"""

import functools
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

from fusedpar.comm import (
    Group,
    Ring,
    active_group,
    all_gather_async,
    group_by_name,
    group_name,
    group_size,
    tuning_agreement,
)
from fusedpar.kernels import gated as gated_kernels
from fusedpar.kernels._tuning import frozen
from fusedpar.kernels.matmul import matmul
from fusedpar.ops.registration import autograd_op, direct_op

DEFAULT_CHUNKS_PER_RANK = 1  # one ring message per rank and step, as in async-TP


def _pieces(rows: int, chunks: int) -> list[tuple[int, int]]:
    """Cut `rows` into `chunks` near-equal [start, stop) ranges, dropping empty ones."""
    bounds = [rows * i // chunks for i in range(chunks + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def gather_matmuls(x, operands, biases, pg, chunks, gemm=matmul, ring=None):
    """``gather(x) @ operand + bias`` for each operand, one ring all-gather for all.

    x (n, K) this rank's rows; operands [(K, N_i)]; biases [(N_i,) or None]. Returns the
    outputs [(W*n, N_i)] and the gathered x (W*n, K). Step s multiplies the rows of rank
    r - s while those of rank r - s - 1 arrive (received straight into their place).
    `gemm` has `matmul`'s signature; `ring` replaces ``Ring(pg)`` (the benchmark injects
    a stand-in). The GEMMs are tuned before the first transfer, agreed over `pg`.
    """
    if ring is None and group_size(pg) == 1:  # one rank: plain GEMMs, nothing to gather
        outs = [gemm(x, op, bias=bias, out_dtype=x.dtype)
                for op, bias in zip(operands, biases, strict=True)]  # fmt: skip
        return outs, x
    ring = Ring(pg) if ring is None else ring
    size, rank = ring.size, ring.rank
    n, K = x.shape
    gathered = x.new_empty((size * n, K))
    gathered[rank * n : (rank + 1) * n].copy_(x)
    outs = [x.new_empty((size * n, op.shape[1])) for op in operands]
    agreement = tuning_agreement(pg, x.device)
    for a, b in _pieces(n, chunks):  # the loop's GEMM shapes, picked before it starts
        for op, bias in zip(operands, biases, strict=True):
            gemm(x[a:b], op, bias=bias, out_dtype=x.dtype, agreement=agreement, tune_only=True)
    with frozen("the all-gather ring", agreement):
        for step in range(size):
            src, incoming = (rank - step) % size, (rank - step - 1) % size
            for a, b in _pieces(n, chunks):
                rows = slice(src * n + a, src * n + b)
                if step + 1 < size:
                    arriving = gathered[incoming * n + a : incoming * n + b]
                    ring.send_recv(gathered[rows], out=arriving)
                for out, op, bias in zip(outs, operands, biases, strict=True):
                    gemm(gathered[rows], op, out=out[rows], bias=bias, agreement=agreement)
                if step + 1 < size:
                    ring.wait()
    return outs, gathered


def matmuls_reduce_scatter(pairs, pg, chunks, out_dtype, bias=None, gemm=matmul, ring=None):
    """This rank's rows of ``sum_ranks sum_i A_i @ B_i`` (+ bias), by a ring reduce-scatter.

    pairs [(A_i (W*m, K_i), B_i (K_i, N))]. At step s rank r computes its fp32 partial for
    rank r - s - 1 while the running sum for that rank arrives from r - 1, adds it, and
    passes it on; after W - 1 steps it holds its own sum. Returns (m, N) in `out_dtype`.
    `gemm` and `ring` as in `gather_matmuls`.
    """
    if ring is None and group_size(pg) == 1:  # one rank: the fp32 sum, rounded once
        if len(pairs) == 1:  # the GEMM's epilogue adds the bias in fp32 and rounds
            return gemm(*pairs[0], bias=bias, out_dtype=out_dtype)
        total = gemm(*pairs[0], out_dtype=torch.float32)
        for A, B in pairs[1:]:
            gemm(A, B, out=total, accumulate=True)
        return (total if bias is None else total + bias.float()).to(out_dtype)
    ring = Ring(pg) if ring is None else ring
    size, rank = ring.size, ring.rank
    rows, N = pairs[0][0].shape[0] // size, pairs[0][1].shape[1]
    device = pairs[0][0].device
    out = torch.empty((rows, N), dtype=out_dtype, device=device)
    running = {}
    agreement = tuning_agreement(pg, device)
    for a, b in _pieces(rows, chunks):  # the loop's GEMM shapes, picked before it starts
        for i, (A, B) in enumerate(pairs):
            gemm(A[a:b], B, out_dtype=torch.float32, accumulate=i > 0, agreement=agreement,
                 tune_only=True)  # fmt: skip
    with frozen("the reduce-scatter ring", agreement):
        for step in range(size):
            dest = (rank - step - 1) % size
            for a, b in _pieces(rows, chunks):
                partial = torch.empty((b - a, N), dtype=torch.float32, device=device)
                if step > 0:
                    ring.send_recv(running[a])  # the sum for rank dest - 1 goes on
                for i, (A, B) in enumerate(pairs):
                    gemm(A[dest * rows + a : dest * rows + b], B, out=partial, accumulate=i > 0,
                         agreement=agreement)  # fmt: skip
                if step > 0:
                    partial += ring.wait()  # the sum for `dest` so far, from rank - 1
                running[a] = partial
    for a, b in _pieces(rows, chunks):
        out[a:b] = running[a] if bias is None else running[a] + bias.float()  # rounded once
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(tokens, features) of `t`: itself when 2-D (a view costs ~1 µs of host time)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _row_sum(dy2d: torch.Tensor, dtype) -> torch.Tensor:
    return dy2d.sum(0, dtype=torch.float32).to(dtype)


def _spread(present: list, has: list[bool]) -> list:
    """One entry per flag: the next of `present` where True, None where False."""
    it = iter(present)
    return [next(it) if flag else None for flag in has]


def _asked(grads, needs) -> list:
    """The backward ops return an empty tensor for a gradient not asked for: None here.
    Decided by the flags, never by the tensor's size (unbacked under torch.compile)."""
    return [g if need else None for g, need in zip(grads, needs, strict=True)]


# --- custom ops: fusedpar::all_gather_matmul, fusedpar::matmul_reduce_scatter ------------
# The group crosses the op boundary by name (`fusedpar.comm.group_name`). A gradient not
# asked for comes back from a backward op as an empty (0,) tensor: ops return tensors.


@torch.library.custom_op("fusedpar::all_gather_matmul", mutates_args=())
def _all_gather_matmul_op(x: Tensor, weights: list[Tensor], biases: list[Tensor],
                          has_bias: list[bool], group: str, chunks: int,
                          save_gathered: bool) -> tuple[list[Tensor], Tensor]:  # fmt: skip
    """The outputs (T, ..., N_i) and, when `save_gathered` (`save_gathered_input`), the
    gathered x (T * rows, K) for the backward (else an empty tensor: it re-gathers). `biases`:
    those of the weights with ``has_bias`` (a list of optional tensors would not carry
    gradients through ``torch.library``'s autograd)."""
    pg = group_by_name(group)
    biases = _spread(biases, has_bias)
    outs, gathered = gather_matmuls(_flat(x), [w.t() for w in weights], biases, pg, chunks)
    lead = (group_size(pg) * x.shape[0], *x.shape[1:-1])
    # Not kept: an empty tensor, so that nothing (selective checkpointing caches every
    # output of this op) holds W times the input until the backward.
    # (one rank: x itself, which an op may not return; the backward takes x)
    kept = gathered if save_gathered and group_size(pg) > 1 else x.new_empty(0)
    return [out.view(*lead, out.shape[1]) for out in outs], kept


@_all_gather_matmul_op.register_fake
def _(x, weights, biases, has_bias, group, chunks, save_gathered):
    size = group_size(group_by_name(group))
    lead = (size * x.shape[0], *x.shape[1:-1])
    outs = [x.new_empty((*lead, w.shape[0])) for w in weights]
    kept = save_gathered and size > 1
    return outs, x.new_empty((size * _flat(x).shape[0], x.shape[-1]) if kept else 0)


@torch.library.custom_op("fusedpar::all_gather_matmul_backward", mutates_args=())
def _all_gather_matmul_backward_op(
    grads: list[Tensor], x: Tensor, gathered: Tensor | None, weights: list[Tensor], group: str,
    chunks: int, needs_x: bool, needs_w: list[bool], needs_b: list[bool],
) -> tuple[Tensor, list[Tensor], list[Tensor]]:  # fmt: skip
    """dX (reduce-scattered, pipelined), each weight's gradient, and each bias's (needs_b:
    one per weight, False where it has none)."""
    pg = group_by_name(group)
    dys = [_flat(g) for g in grads]
    regather = None
    if group_size(pg) == 1:
        gathered = _flat(x)  # one rank: its rows are all there are
    elif gathered is None and any(needs_w):
        regather = all_gather_async(_flat(x), pg)  # runs while dX is computed
    dx = x.new_empty(0)
    if needs_x:
        pairs = list(zip(dys, weights, strict=True))
        dx = matmuls_reduce_scatter(pairs, pg, chunks, x.dtype).view(x.shape)
    if regather is not None:
        gathered = regather.wait()
    dws = [matmul(dy.t(), gathered) if need else w.new_empty(0)
           for dy, w, need in zip(dys, weights, needs_w, strict=True)]  # fmt: skip
    dbs = [_row_sum(dy, w.dtype) if need else w.new_empty(0)
           for dy, w, need in zip(dys, weights, needs_b, strict=True)]  # fmt: skip
    return dx, dws, dbs


@_all_gather_matmul_backward_op.register_fake
def _(grads, x, gathered, weights, group, chunks, needs_x, needs_w, needs_b):
    dx = x.new_empty(x.shape if needs_x else 0)  # fresh, contiguous: the real op's layout
    dws = [w.new_empty(w.shape if n else 0)
           for w, n in zip(weights, needs_w, strict=True)]  # fmt: skip
    dbs = [w.new_empty(w.shape[0] if n else 0) for w, n in zip(weights, needs_b, strict=True)]
    return dx, dws, dbs


def _all_gather_matmul_setup(ctx, inputs, output):
    x, weights, biases, has_bias, group, chunks, save_gathered = inputs
    needs_b = [b is not None and b.requires_grad for b in _spread(biases, has_bias)]
    ctx.options = (group, chunks, x.requires_grad, [w.requires_grad for w in weights], needs_b)
    ctx.has_bias = has_bias
    gathered = output[1] if save_gathered else None
    ctx.save_for_backward(x, gathered, *weights)


def _all_gather_matmul_grads(ctx, grads, _):
    x, gathered, *weights = ctx.saved_tensors
    dx, dws, dbs = _all_gather_matmul_backward(grads, x, gathered, weights, *ctx.options)
    _, _, needs_x, needs_w, needs_b = ctx.options
    dbs = [db for db, has in zip(_asked(dbs, needs_b), ctx.has_bias, strict=True) if has]
    return (dx if needs_x else None, _asked(dws, needs_w), dbs, None, None, None, None)


@torch.library.custom_op("fusedpar::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter_op(x: Tensor, weight: Tensor, bias: Tensor | None, group: str,
                              chunks: int) -> Tensor:  # fmt: skip
    pg = group_by_name(group)
    y = matmuls_reduce_scatter([(_flat(x), weight.t())], pg, chunks, x.dtype, bias)
    return y.view(x.shape[0] // group_size(pg), *x.shape[1:-1], weight.shape[0])


@_matmul_reduce_scatter_op.register_fake
def _(x, weight, bias, group, chunks):
    size = group_size(group_by_name(group))
    return x.new_empty((x.shape[0] // size, *x.shape[1:-1], weight.shape[0]))


@torch.library.custom_op("fusedpar::matmul_reduce_scatter_backward", mutates_args=())
def _matmul_reduce_scatter_backward_op(dy: Tensor, x: Tensor, weight: Tensor, group: str,
                                       chunks: int, needs_x: bool, needs_w: bool,
                                       needs_b: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """dX from the all-gather ring of dY that also gathers dY for dW."""
    pg = group_by_name(group)
    dy2d = _flat(dy)
    operands = [weight] if needs_x else []
    outs, dy_full = gather_matmuls(dy2d, operands, [None] * len(operands), pg, chunks)
    dx = outs[0].view(x.shape) if needs_x else x.new_empty(0)
    dw = matmul(dy_full.t(), _flat(x)) if needs_w else weight.new_empty(0)
    db = _row_sum(dy2d, weight.dtype) if needs_b else weight.new_empty(0)
    return dx, dw, db


@_matmul_reduce_scatter_backward_op.register_fake
def _(dy, x, weight, group, chunks, needs_x, needs_w, needs_b):
    return (x.new_empty(x.shape if needs_x else 0),  # fresh, contiguous: the real op's layout
            weight.new_empty(weight.shape if needs_w else 0),
            weight.new_empty(weight.shape[0] if needs_b else 0))  # fmt: skip


def _matmul_reduce_scatter_setup(ctx, inputs, output):
    x, weight, bias, group, chunks = inputs
    ctx.options = (group, chunks, x.requires_grad, weight.requires_grad,
                   bias is not None and bias.requires_grad)  # fmt: skip
    ctx.save_for_backward(x, weight)


def _matmul_reduce_scatter_grads(ctx, dy):
    x, weight = ctx.saved_tensors
    grads = _matmul_reduce_scatter_backward(dy, x, weight, *ctx.options)
    return *_asked(grads, ctx.options[2:]), None, None


_all_gather_matmul_backward = direct_op(_all_gather_matmul_backward_op)
_matmul_reduce_scatter_backward = direct_op(_matmul_reduce_scatter_backward_op)
_matmul_reduce_scatter_forward = direct_op(_matmul_reduce_scatter_op)  # inside _GatedDown
_all_gather_matmul = autograd_op(_all_gather_matmul_op, _all_gather_matmul_grads,
                                 _all_gather_matmul_setup)  # fmt: skip
_matmul_reduce_scatter = autograd_op(_matmul_reduce_scatter_op, _matmul_reduce_scatter_grads,
                                     _matmul_reduce_scatter_setup)  # fmt: skip


def _check_chunks(chunks: int) -> None:
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks_per_rank must be a positive int, got {chunks!r}")


def _check_linear(x, weight, bias, what, k_dim=-1):
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


def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor | Sequence[torch.Tensor],
    group: Group,
    *,
    bias: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    chunks_per_rank: int = DEFAULT_CHUNKS_PER_RANK,
    save_gathered_input: bool = False,
):
    """``all_gather(x, dim 0) @ weight.T (+ bias)``, pipelined around the ring.

    x (T/W, ..., K): this rank's tokens. weight (N_loc, K), or a list of them: one gather
    feeds every GEMM (fused QKV, gate/up) and a list of (T, ..., N_i) comes back. bias
    (N_loc,), or a list aligned with the weights (entries may be None). The backward
    re-gathers x while it computes dX, unless ``save_gathered_input`` keeps the gathered
    copy from the forward (memory for one all-gather less). ``chunks_per_rank`` cuts each
    rank's rows into that many ring messages. With ``group=None`` this is a plain GEMM.
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
    present = [b for b in biases if b is not None]
    has_bias = [b is not None for b in biases]
    outs, _ = _all_gather_matmul(x, weights, present, has_bias, group_name(pg),
                                    chunks_per_rank, save_gathered_input)  # fmt: skip
    return list(outs) if many else outs[0]


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Group,
    *,
    bias: torch.Tensor | None = None,
    chunks_per_rank: int = DEFAULT_CHUNKS_PER_RANK,
) -> torch.Tensor:
    """``reduce_scatter(x @ weight.T, dim 0) (+ bias)``, pipelined around the ring.

    x (T, ..., K_loc): every token, this rank's slice of the features; weight (N, K_loc);
    bias (N,), added once after the sum. Returns this rank's tokens (T/W, ..., N). Partial
    sums travel in fp32 and are rounded once. With ``group=None`` this is a plain GEMM.
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
    return _matmul_reduce_scatter(x, weight, bias, group_name(pg), chunks_per_rank)


# --- custom ops: fusedpar::gated and its backward (inside _GatedDown) -------------------


@torch.library.custom_op("fusedpar::gated", mutates_args=())
def _gated_op(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    return gated_kernels.gated(gate, up, activation)


@_gated_op.register_fake
def _(gate, up, activation):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("fusedpar::gated_backward", mutates_args=())
def _gated_backward_op(dh: Tensor, gate: Tensor, up: Tensor,
                       activation: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    return gated_kernels.gated_backward(dh, gate, up, activation)


@_gated_backward_op.register_fake
def _(dh, gate, up, activation):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


_gated = direct_op(_gated_op)
_gated_backward = direct_op(_gated_backward_op)


_WITHOUT_KERNEL: set[str] = set()  # the activations said to have no kernel


def kernel_activation(activation) -> str | None:
    """The fused kernel's name for `activation` (`fusedpar.kernels.gated.ACTIVATIONS`):
    ``F.silu``, ``F.gelu`` and ``gelu(approximate="tanh")``, as functions, partials or
    ``nn.SiLU``/``nn.GELU`` modules. None for any other (it runs through autograd, with
    one warning per activation)."""
    if activation is F.silu or isinstance(activation, torch.nn.SiLU):
        return "silu"
    approximate = None
    if activation is F.gelu:
        approximate = "none"
    elif isinstance(activation, torch.nn.GELU):
        approximate = activation.approximate
    elif (isinstance(activation, functools.partial) and activation.func is F.gelu
          and not activation.args and set(activation.keywords) <= {"approximate"}):  # fmt: skip
        approximate = activation.keywords.get("approximate", "none")
    name = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    if name is None and repr(activation) not in _WITHOUT_KERNEL:
        _WITHOUT_KERNEL.add(repr(activation))
        warnings.warn(f"gated_down: no fused kernel for activation {activation!r} (there is "
                      f"one for silu, gelu and gelu tanh): act(gate) * up and its gradient "
                      f"run through autograd", stacklevel=3)  # fmt: skip
    return name


def _product_vjp(activation, gate, up):
    """``activation(gate) * up`` and its vjp, for an activation with no fused kernel. In
    eager through autograd (about 3x less host time than ``torch.func.vjp``: 34 against
    108 µs at (32, 64)), which a compiled backward does not trace; there
    ``torch.func.vjp``."""
    if torch.compiler.is_compiling():
        return torch.func.vjp(lambda g, u: activation(g) * u, gate, up)
    with torch.enable_grad():
        g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
        product = activation(g) * u
    return product.detach(), lambda d: torch.autograd.grad(product, (g, u), d)


class _GatedDown(torch.autograd.Function):
    """``down(act(gate) * up)`` saving gate and up only: the backward recomputes the
    product (for the down weight's gradient), then dgate and dup in one pass
    (`fusedpar.kernels.gated`; through autograd for an activation with no kernel)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, activation, group, chunks):
        # (float64, a reference model's dtype, has no kernel: autograd's path is exact)
        name = kernel_activation(activation) if gate.dtype != torch.float64 else None
        hidden = _gated(gate, up, name) if name else activation(gate) * up
        if group is None:  # a plain GEMM (classic TP: the caller all-reduces)
            y = torch.nn.functional.linear(hidden, weight, bias)
        else:
            y = _matmul_reduce_scatter_forward(hidden, weight, bias, group, chunks)
        ctx.options = (activation, name, group, chunks, bias is not None)
        ctx.save_for_backward(gate, up, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up, weight = ctx.saved_tensors
        activation, name, group, chunks, has_bias = ctx.options
        needs_g, needs_u, needs_w, needs_b = ctx.needs_input_grad[:4]
        if name:
            hidden = _gated(gate, up, name)
        else:
            hidden, vjp = _product_vjp(activation, gate, up)
        if group is None:
            dh = dy @ weight
            dw = _flat(dy).t() @ _flat(hidden) if needs_w else None
            db = _row_sum(_flat(dy), weight.dtype) if needs_b and has_bias else None
        else:
            dh, dw, db = _matmul_reduce_scatter_backward(
                dy, hidden, weight, group, chunks, True, needs_w, needs_b and has_bias
            )
            dw, db = dw if needs_w else None, db if needs_b and has_bias else None
        dgate = dup = None
        if needs_g or needs_u:
            dgate, dup = _gated_backward(dh, gate, up, name) if name else vjp(dh)
        return dgate, dup, dw, db, None, None, None


def gated_down(gate, up, weight, group, *, activation, bias=None, sequence_parallel=True,
               chunks_per_rank: int = DEFAULT_CHUNKS_PER_RANK) -> torch.Tensor:  # fmt: skip
    """``down(activation(gate) * up)`` (+ bias): with `sequence_parallel` the down GEMM's
    output reduce-scattered over `group` as in `matmul_reduce_scatter`, else this rank's
    partial (T, ..., N), to be all-reduced by the caller. gate, up (T, ..., K_loc);
    weight (N, K_loc); `activation` any differentiable elementwise function.

    Saved for the backward: gate and up, not ``activation(gate)`` nor the product, which
    the backward recomputes (one elementwise pass) for the down weight's gradient and the
    gate's and up's."""
    if gate.shape != up.shape:
        raise ValueError(f"gated_down: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    if gate.dim() < 2:
        raise ValueError(f"gated_down: gate must be (T, ..., K), got {tuple(gate.shape)}")
    _check_linear(gate, weight, bias, "gated_down")
    _check_chunks(chunks_per_rank)
    name = None
    if sequence_parallel:
        pg = active_group(group)
        size = group_size(pg)
        if gate.shape[0] % size:
            raise ValueError(f"gated_down: dim 0 of gate (shape {tuple(gate.shape)}) has "
                             f"{gate.shape[0]} tokens, not divisible by the group size "
                             f"{size}")  # fmt: skip
        name = group_name(pg)
    return _GatedDown.apply(gate, up, weight, bias, activation, name, chunks_per_rank)
