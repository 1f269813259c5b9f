"""The short convolution under context parallelism: each span's halo (the W - 1 inputs
before it) from whichever ranks hold them, point to point, and its gradient sent back.

A rank's shard x (B, T_local, C) holds its spans (`fusedpar.ops.spans`). `local_inputs`
turns it into one packed call of the single-device conv: the shard as one stream of
local documents, each with initial states. A span's first document, where it began
before the span, starts from the halo (the tokens inside the document; before its start
the document's own initial states, or zeros); a document starting in the span starts
from its own initial states. `final_states` gives the single-device final states on
every rank. The routes depend on the shapes alone (`halo_plan`): the halo always
travels whole, and cu_seqlens' values are read on the device only (no host sync).

    zigzag, 4 ranks, 1-token spans, W = 4: span 4 (rank 3's second) reads spans 1, 2, 3
    span   0 1 2 3 | 4 5 6 7        halo of span 4: span 1 from rank 1, span 2 from
    rank   0 1 2 3 | 3 2 1 0        rank 2, span 3 from rank 3 itself (a local copy)
"""

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from fusedpar.ops.registration import autograd_op, direct_op
from fusedpar.ops.span_exchange import exchange_of
from fusedpar.ops.spans import Spans

# The halo's messages between two ranks, apart from the ring's (tags 0 and 1).
HALO_TAG = 5


@dataclass(frozen=True)
class HaloPlan:
    """This rank's halo (B, slots x (W - 1), C): entry ``slot * (W - 1) + k`` is global
    position ``start(span) - (W - 1) + k`` (zero where that is before the sequence).
    Runs of consecutive positions: ``copies`` (entry, local row, n) from this rank's own
    shard; ``receives[peer]`` (entry, n) and ``sends[peer]`` (local row, n), in the order
    the message packs them."""

    spans: Spans
    history: int  # W - 1
    copies: tuple[tuple[int, int, int], ...]
    receives: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
    sends: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]


@functools.cache
def halo_plan(spans: Spans, history: int) -> HaloPlan:
    """Every rank's halo, walked in the same order on every rank: what this rank copies,
    receives (its own halo's entries held elsewhere) and sends (its rows in another's)."""
    copies, receives, sends = [], {}, {}
    me, n = spans.rank, spans.span_len
    for rank in range(spans.ranks):
        for slot, span in enumerate(spans.of_rank(rank)):
            first = spans.start(span) - history  # the halo's entry 0
            for held, lo, hi in spans.locate(first, spans.start(span)):
                owner, owner_slot = spans.owner(held)
                entry, row = slot * history + spans.start(held) + lo - first, owner_slot * n + lo
                if rank == me and owner == me:
                    copies.append((entry, row, hi - lo))
                elif rank == me:
                    receives.setdefault(owner, []).append((entry, hi - lo))
                elif owner == me:
                    sends.setdefault(rank, []).append((row, hi - lo))
    return HaloPlan(
        spans,
        history,
        tuple(copies),
        tuple((peer, tuple(runs)) for peer, runs in sorted(receives.items())),
        tuple((peer, tuple(runs)) for peer, runs in sorted(sends.items())),
    )


def _count(runs) -> int:
    return sum(r[-1] for r in runs)


def _exchange(exchange, outgoing: dict[int, Tensor], incoming: dict[int, Tensor]) -> None:
    """Post every send and receive at once (one batch) and wait for them; peers are
    ranks of `exchange` (`fusedpar.ops.span_exchange`)."""
    ops = [dist.P2POp(dist.isend, t, *exchange.peer(p), HALO_TAG) for p, t in outgoing.items()]
    ops += [dist.P2POp(dist.irecv, t, *exchange.peer(p), HALO_TAG) for p, t in incoming.items()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _rows(x: Tensor, runs) -> Tensor:
    """x's rows (dim 1) of `runs` ((row, n) pairs), one after another, contiguous."""
    return torch.cat([x[:, row : row + count] for row, count in runs], 1).contiguous()


def _gather(x: Tensor, plan: HaloPlan, exchange) -> Tensor:
    """x (B, T_local, C) -> the halo (B, spans x (W - 1), C), zeros before position 0."""
    B, _, C = x.shape
    halo = x.new_zeros((B, len(plan.spans.mine) * plan.history, C))
    for entry, row, count in plan.copies:
        halo[:, entry : entry + count] = x[:, row : row + count]
    outgoing = {peer: _rows(x, runs) for peer, runs in plan.sends}
    incoming = {peer: x.new_empty((B, _count(runs), C)) for peer, runs in plan.receives}
    _exchange(exchange, outgoing, incoming)
    for peer, runs in plan.receives:
        at = 0
        for entry, count in runs:
            halo[:, entry : entry + count] = incoming[peer][:, at : at + count]
            at += count
    return halo


def _scatter(grad: Tensor, plan: HaloPlan, exchange, local_len: int) -> Tensor:
    """The halo's gradient -> dx (B, T_local, C): each entry's to its owner, added to
    its row (a row in two halos, spans shorter than W - 1, gets both)."""
    B, _, C = grad.shape
    outgoing = {peer: _rows(grad, runs) for peer, runs in plan.receives}
    incoming = {peer: grad.new_empty((B, _count(runs), C)) for peer, runs in plan.sends}
    _exchange(exchange, outgoing, incoming)
    dx = grad.new_zeros((B, local_len, C))
    for entry, row, count in plan.copies:
        dx[:, row : row + count] += grad[:, entry : entry + count]
    for peer, runs in plan.sends:
        at = 0
        for row, count in runs:
            dx[:, row : row + count] += incoming[peer][:, at : at + count]
            at += count
    return dx


def _plan(group: str, ulysses: str, layout: str, local_len: int, history: int):
    """(the halo's plan, the exchange) of the groups named (`Exchange.names`)."""
    exchange = exchange_of(group, ulysses)
    return halo_plan(exchange.spans(layout, local_len), history), exchange


@torch.library.custom_op("fusedpar::conv_halo", mutates_args=())
def _conv_halo_op(x: Tensor, group: str, ulysses: str, layout: str, history: int) -> Tensor:
    """x (B, T_local, C), this rank's shard -> its halo (B, spans x history, C); the ranks
    of `group`, or of `group` x `ulysses` (the hybrid layout) where that is not ""."""
    plan, exchange = _plan(group, ulysses, layout, x.shape[1], history)
    # the routes assume every rank's shapes: one tiny all-gather on CPU, none on GPUs
    exchange.check_same([*x.shape, history], "causal_conv1d: x, W - 1", x.device)
    return _gather(x, plan, exchange)


@_conv_halo_op.register_fake
def _(x, group, ulysses, layout, history):
    spans = 2 if layout == "zigzag" else 1
    return x.new_empty((x.shape[0], spans * history, x.shape[2]))


@torch.library.custom_op("fusedpar::conv_halo_backward", mutates_args=())
def _conv_halo_backward_op(
    grad: Tensor, group: str, ulysses: str, layout: str, local_len: int
) -> Tensor:
    """The halo's gradient (B, spans x history, C) -> dx (B, local_len, C)."""
    history = grad.shape[1] // (2 if layout == "zigzag" else 1)
    return _scatter(grad, *_plan(group, ulysses, layout, local_len, history), local_len)


@_conv_halo_backward_op.register_fake
def _(grad, group, ulysses, layout, local_len):
    return grad.new_empty((grad.shape[0], local_len, grad.shape[2]))


def _setup(ctx, inputs, output):
    x, group, ulysses, layout, _ = inputs
    ctx.meta = (group, ulysses, layout, x.shape[1])


def _backward(ctx, grad):
    return _halo_backward(grad, *ctx.meta), None, None, None, None


_halo_backward = direct_op(_conv_halo_backward_op)
_halo = autograd_op(_conv_halo_op, _backward, _setup)  # the bodies, in plain eager


def halo(x: Tensor, exchange, layout: str, history: int) -> Tensor:
    """This rank's halo (B, spans x (W - 1), C) (`HaloPlan`; zeros before position 0),
    differentiable: an entry's gradient goes back to the rank holding it, into its dx."""
    return _halo(x, *exchange.names, layout, history)


def local_inputs(x: Tensor, spans: Spans, halo_: Tensor, cu_seqlens, initial_states):
    """``(x (1, B x T_local, C), cu_seqlens, initial_states)``: this rank's shard as one
    packed stream for the single-device conv. Its documents: without `cu_seqlens` one a
    (row, span), starting from the halo (before position 0, the row's own initial
    states or zeros); with them (B = 1) every global document clipped to each span
    (most of them empty there; an empty one between the spans), a document that began
    before the span starting from its tokens in the halo, earlier positions from its
    own initial states (or zeros)."""
    B, T, C = x.shape
    h, n, S = halo_.shape[1] // len(spans.mine), len(spans.mine), spans.span_len
    starts = [spans.start(s) for s in spans.mine]
    halos = halo_.view(B, n, h, C)
    if cu_seqlens is None:
        pieces = []
        for i, st in enumerate(starts):
            piece = halos[:, i]  # (B, h, C); zeros before the sequence
            if initial_states is not None and st < h:  # the row's own before position 0
                own = initial_states.transpose(1, 2)[:, st:]
                piece = torch.cat([own, piece[:, h - st :]], 1)
            pieces.append(piece)
        init = torch.stack(pieces, 1).reshape(B * n, h, C).transpose(1, 2)
        cu = torch.arange(B * n + 1, device=x.device, dtype=torch.int32) * S
        return x.reshape(1, B * T, C), cu, init
    cu = cu_seqlens.long()
    first = cu[:-1, None]  # (N, 1): each document's start
    cus, inits = [], []
    for i, st in enumerate(starts):
        q = torch.arange(st - h, st, device=x.device)  # (h,) the halo's positions
        began_before = first < st  # (N, 1)
        token = began_before & (q >= first)  # (N, h)
        if initial_states is not None:  # entry k of its own: position start - (h - k)
            k = torch.where(began_before, q - first + h, torch.arange(h, device=x.device))
            own = initial_states.transpose(1, 2).gather(
                1, k.clamp(0, h - 1)[..., None].expand(-1, -1, C)
            )  # (N, h, C)
        else:
            own = x.new_zeros(())
        inits.append(torch.where(token[..., None], halos[0, i], own))
        cus.append((cu - st).clamp(0, S) + i * S)
    if n == 2:  # the empty document between the spans (S to S) starts from zeros
        inits.insert(1, x.new_zeros((1, h, C)))
    init = torch.cat(inits).transpose(1, 2)
    return x, torch.cat(cus).to(torch.int32), init


def final_states(x: Tensor, spans: Spans, history: int, cu_seqlens, initial_states, exchange):
    """The single-device final states (N, C, W - 1), on every rank: each rank puts in
    the entries it holds (rank 0 those from the initial states, of a document shorter
    than W - 1), one all-reduce adds them. Its backward is the identity (Megatron's
    reduce_from_region: the final states are one replicated value, their gradient
    counted once), each rank's gradient flowing to its own entries."""
    from_init = spans.rank == 0 and initial_states is not None
    h, S, (B, T, C) = history, spans.span_len, x.shape
    if cu_seqlens is None:
        end = spans.seq_len
        parts = x.new_zeros((B, h, C))
        for span, lo, hi in spans.locate(end - h, end):
            owner, slot = spans.owner(span)
            if owner == spans.rank:
                entry = spans.start(span) + lo - (end - h)
                parts[:, entry : entry + hi - lo] = x[:, slot * S + lo : slot * S + hi]
        if from_init and end < h:
            parts[:, : h - end] = initial_states.transpose(1, 2)[:, end:]
    else:
        cu = cu_seqlens.long()
        first, q = cu[:-1, None], cu[1:, None] - h + torch.arange(h, device=x.device)  # (N, h)
        token = q >= first
        parts = x.new_zeros((*q.shape, C))
        for i, span in enumerate(spans.mine if T else ()):  # (no rows: none held)
            st = spans.start(span)
            here = (token & (q >= st) & (q < st + S))[..., None]
            parts = torch.where(here, x[0, (q - st + i * S).clamp(0, max(T - 1, 0))], parts)
        if from_init:
            own = initial_states.transpose(1, 2).gather(
                1, (q - first + h).clamp(0, h - 1)[..., None].expand(-1, -1, C)
            )
            parts = torch.where(token[..., None], parts, own)
    return exchange.reduce(parts).transpose(1, 2).contiguous()
