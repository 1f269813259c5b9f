"""The gated delta rule under context parallelism, exact, on the attention's layouts
(zigzag or contiguous, `fusedpar.ops.spans`): each rank runs its own spans and learns the
state entering each from a summary of every span before it, never their tokens.

A span maps the state entering it affinely, ``S -> M S + E``: M (K, K) the product of its
tokens' ``(I - beta k k^T) diag(exp g)``, E (K, V) the state it reaches from zero. One
call of the single-device op on v and zero columns, from the document's state and I,
gives ``[E, M]`` as its final state and, as its output's last K columns, how the entering
state reaches each output (``o_t = o0_t + Q_t^T S``).

| pass     | local                           | across ranks    | then                         |
| -------- | ------------------------------- | --------------- | ---------------------------- |
| forward  | o0, Q; ``[E, M]`` per span      | all-gather E, M | ``S_c = M S_{c-1} + E``      |
| backward | ``D = Q^T do (+ M^T dfinal)``   | all-gather D    | ``dS_c = D_c + M_c^T dS_c+1``|

then the single-device backward from the true entering state and leaving gradient. Maps
and folds stay in fp32 (float64 for float64); a span where a document starts passes no
state through (its M is zero).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from fusedpar.comm import (
    gather_from_region,
    group_size,
    split_to_region,
)
from fusedpar.kernels.common import TensorCache, accumulator
from fusedpar.kernels.linear_attention import (
    MAX_HEAD_DIM,
    gated_delta_backward,
    gated_delta_forward,
)
from fusedpar.ops.span_exchange import Exchange
from fusedpar.ops.spans import SpanDocuments, Spans
from fusedpar.ops.ulysses import gather_heads, scatter_heads


@dataclass(frozen=True)
class Piece:
    """A document's tokens in one of this rank's spans: ``[begin, end)`` of the local
    stream (the rank's tokens as one packed row), `row` its place in the span's rows
    (the batch row without documents, 0 with them)."""

    doc: int
    slot: int
    row: int
    begin: int
    end: int
    carries_in: bool  # the first piece of a span a document crosses into
    carries_out: bool  # the last piece of a span whose document crosses out
    ends_document: bool


@dataclass(frozen=True)
class SpanPlan:
    """This rank's pieces and the spans' shape in global order: `carries[c]` says whether a
    state enters span c from before it; every span has `rows` exits (B, or 1 with
    documents)."""

    spans: Spans
    pieces: tuple[Piece, ...]
    carries: tuple[bool, ...]
    rows: int
    documents: int  # N: final states / initial states
    packed: bool
    empty: tuple[int, ...] = ()  # documents of no token: their final state is their initial

    @property
    def bounds(self) -> list[int]:
        return [p.begin for p in self.pieces] + [self.pieces[-1].end]


def plan_spans(spans: Spans, batch: int, cu_seqlens: Tensor | None) -> SpanPlan:
    """The plan for `batch` rows of this rank's `spans` (a host read of `cu_seqlens`)."""
    C, L = spans.count, spans.span_len
    if cu_seqlens is None:  # every span continues the sequence; span 0 from initial_state
        slots = len(spans.mine)
        pieces = tuple(
            Piece(
                b, slot, b, (b * slots + slot) * L, (b * slots + slot + 1) * L, True, out, not out
            )
            for b in range(batch)
            for slot, span in enumerate(spans.mine)
            for out in [span < C - 1]  # crosses into the next span
        )
        return SpanPlan(spans, pieces, (True,) * C, batch, batch, False)
    documents = SpanDocuments(spans, tuple(cu_seqlens.tolist()))
    carries = tuple(documents.carries_in(c) for c in range(C))
    pieces = []
    for slot, span in enumerate(spans.mine):
        found = documents.pieces(span)
        for i, (doc, begin, end) in enumerate(found):
            last = i == len(found) - 1
            crosses_out = last and span + 1 < C and carries[span + 1]
            carries_in = i == 0 and carries[span]
            piece = Piece(
                doc,
                slot,
                0,
                slot * L + begin,
                slot * L + end,
                carries_in,
                crosses_out,
                not crosses_out,
            )
            pieces.append(piece)
    bounds = documents.bounds
    empty = tuple(d for d in range(len(bounds) - 1) if bounds[d + 1] == bounds[d])
    return SpanPlan(spans, tuple(pieces), carries, 1, len(bounds) - 1, True, empty)


def _run(stream, scale: float, cu_seqlens: Tensor, parts) -> list[tuple[Tensor, Tensor]]:
    """The single-device op over the local stream ``(q, k, g, beta)`` for each ``(v,
    initial)`` of `parts`: one call on their columns side by side where the kernels take
    the width (<= MAX_HEAD_DIM), else one call each. ``(o, final)`` per part."""
    q, k, g, beta = stream
    width = sum(v.shape[-1] for v, _ in parts)
    calls = [parts] if width <= MAX_HEAD_DIM else [[part] for part in parts]
    found = []
    for call in calls:
        v = torch.cat([v for v, _ in call], -1)
        initial = torch.cat([rows for _, rows in call], -1)
        o, final = gated_delta_forward(
            q, k, v, g, beta, scale=scale, initial_state=initial, cu_seqlens=cu_seqlens
        )
        split = [part_v.shape[-1] for part_v, _ in call]
        found += zip(o.split(split, -1), final.split(split, -1), strict=True)
    return found


def _reach(v_like: Tensor, plan: SpanPlan, K: int) -> list:
    """The part for `_run` that gives ``(Q, M)``: how the state carried into a piece
    reaches each of its outputs and its end (zero columns from I; from zero where none
    is carried)."""
    Hv = v_like.shape[-2]
    eye = torch.eye(K, dtype=accumulator(v_like.dtype), device=v_like.device).expand(Hv, K, K)
    rows_m = torch.stack([eye * p.carries_in for p in plan.pieces])  # (P, Hv, K, K)
    return [(v_like.new_zeros((*v_like.shape[:-1], K)), rows_m)]


@dataclass(frozen=True)
class _Setup:
    plan: SpanPlan
    cu_seqlens: Tensor  # the local stream's pieces, int32
    scale: float
    exchange: Exchange
    want_final: bool


def _stream(tensors, B: int, T: int) -> list[Tensor]:
    """(B, T, ...) -> the local stream (1, B T, ...): row b's pieces at b T.."""
    return [t.reshape(1, B * T, *t.shape[2:]) for t in tensors]


def _gather_spans(per_slot: Tensor, plan: SpanPlan, exchange: Exchange) -> list[Tensor]:
    """Every span's entry of `per_slot` (slots, rows, ...), in global span order, from every
    rank: one all-gather."""
    gathered = exchange.gather(per_slot)
    slots = len(plan.spans.mine)
    return [
        gathered[rank * slots + slot]
        for rank, slot in map(plan.spans.owner, range(plan.spans.count))
    ]


def _per_slot(plan: SpanPlan, values: dict, like: Tensor) -> Tensor:
    """(slots, rows, ...) from `values` ((slot, row) -> tensor), zero elsewhere."""
    out = like.new_zeros((len(plan.spans.mine), plan.rows, *like.shape[1:]))
    for (slot, row), value in values.items():
        out[slot, row] = value
    return out


def _fold(plan: SpanPlan, spans: list[Tensor], initial: Tensor | None, V: int) -> Tensor:
    """The state entering every span, (C, rows, Hv, K, V), zero where none crosses in:
    ``S_c = M_{c-1} S_{c-1} + E_{c-1}`` in span order (`spans`: each one's ``[E | M]``);
    span 0 enters from `initial` without documents (with them, each document's own state
    enters at its start)."""
    zero = torch.zeros_like(spans[0][..., :V])
    entering = [initial if initial is not None and not plan.packed else zero]
    for c in range(1, plan.spans.count):
        E, M = spans[c - 1][..., :V], spans[c - 1][..., V:]
        entering.append(M @ entering[c - 1] + E if plan.carries[c] else zero)
    return torch.stack(entering)


def _unfold(plan: SpanPlan, spans_d: list[Tensor], maps: Tensor) -> Tensor:
    """The gradient of the state entering every span, (C, rows, Hv, K, V): ``dS_c = D_c +
    M_c^T dS_{c+1}`` in reverse span order (`spans_d`: each span's own D; `maps` (C, rows,
    Hv, K, K): each one's M, zero where no state passes through it)."""
    C = plan.spans.count
    found = [torch.zeros_like(spans_d[0])] * C
    for c in reversed(range(C)):
        if plan.carries[c]:
            through = c + 1 < C and plan.carries[c + 1]
            found[c] = spans_d[c] + (maps[c].transpose(-1, -2) @ found[c + 1] if through else 0)
    return torch.stack(found)


def _finals(plan: SpanPlan, spans, entering, final_v, final_m, initial_state, exchange) -> Tensor:
    """The final state of every sequence or document (N, Hv, K, V), on every rank: the
    last span's map without documents; with them, each document's from the rank where
    it ends (one all-reduce)."""
    V = final_v.shape[-1]
    if not plan.packed:
        return spans[-1][..., V:] @ entering[-1] + spans[-1][..., :V]
    ends = [(p.doc, i) for i, p in enumerate(plan.pieces) if p.ends_document]
    finals = _rows(plan.documents, ends, final_v, final_v[0])
    for i, p in enumerate(plan.pieces):  # at most one a span: its first piece
        if p.ends_document and p.carries_in:
            finals[p.doc] += final_m[i] @ entering[plan.spans.mine[p.slot], 0]
    exchange.sum(finals)
    for d in plan.empty:
        finals[d] = 0 if initial_state is None else initial_state[d]
    return finals


def _rows(count: int, pairs, source: Tensor | None, like: Tensor) -> Tensor:
    """(count, ...) zeros but for row i = source[j] of each ``(i, j)`` in `pairs`: one
    gather and one scatter, however many documents."""
    out = like.new_zeros((count, *like.shape))
    pairs = list(pairs)
    if source is None or not pairs:
        return out
    to, frm = (torch.tensor(x, device=out.device) for x in zip(*pairs, strict=True))
    return out.index_copy_(0, to, source.index_select(0, frm).to(out.dtype))


def _last_pieces(plan: SpanPlan) -> dict:
    """(slot, row) -> the index of that span row's last piece."""
    return {(p.slot, p.row): i for i, p in enumerate(plan.pieces)}


class _ContextParallelGatedDelta(torch.autograd.Function):
    """o and the final state of this rank's spans; the module doc's table."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, setup: _Setup):
        plan = setup.plan
        B, T, _, K = q.shape
        Hv, V = v.shape[-2:]
        wide = accumulator(q.dtype)
        stream = _stream((q, k, g, beta), B, T)
        (v_s,) = _stream((v,), B, T)

        # a piece that starts its document starts from the document's own state
        zero = torch.zeros((Hv, K, V), dtype=wide, device=q.device)
        starts = [(i, p.doc) for i, p in enumerate(plan.pieces) if not p.carries_in]
        rows_v = _rows(len(plan.pieces), starts, initial_state, zero)  # (P, Hv, K, V)
        parts = [(v_s, rows_v), *_reach(v_s, plan, K)]
        (o0, final_v), (reach, final_m) = _run(stream, setup.scale, setup.cu_seqlens, parts)
        maps = _per_slot(  # each span row's [E | M]: the map of its last piece
            plan,
            {key: torch.cat([final_v[i], final_m[i]], -1) for key, i in _last_pieces(plan).items()},
            torch.empty((1, Hv, K, V + K), dtype=wide, device=q.device),
        )
        spans = _gather_spans(maps, plan, setup.exchange)  # [E | M] of every span
        init = None if initial_state is None else initial_state.to(wide)
        entering = _fold(plan, spans, init, V)  # (C, rows, Hv, K, V)
        o = o0.to(wide)
        for p in plan.pieces:
            if p.carries_in:
                state = entering[plan.spans.mine[p.slot], p.row]  # (Hv, K, V)
                o[0, p.begin : p.end] += torch.einsum(
                    "thk,hkv->thv", reach[0, p.begin : p.end].to(wide), state
                )
        final = None
        if setup.want_final:
            final = _finals(plan, spans, entering, final_v, final_m, init, setup.exchange)
        ctx.setup = setup
        maps_m = torch.stack([s[..., V:] for s in spans])  # (C, rows, Hv, K, K)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, entering, maps_m)
        ctx.set_materialize_grads(False)
        return o.to(v.dtype).reshape(B, T, Hv, V), final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, initial_state, entering, maps_m = ctx.saved_tensors
        setup = ctx.setup
        plan = setup.plan
        B, T, _, K = q.shape
        Hv, V = v.shape[-2:]
        wide = accumulator(q.dtype)
        stream = _stream((q, k, g, beta), B, T)
        (v_s,) = _stream((v,), B, T)
        do = torch.zeros_like(v) if do is None else do
        (do_s,) = _stream((do,), B, T)
        dfinal = None if dfinal is None else dfinal.to(wide)
        # D: the carried state's gradient from this span's own outputs (and from the final
        # state of a document that ends in it), through Q and M recomputed
        ((reach, final_m),) = _run(
            stream,
            setup.scale,
            setup.cu_seqlens,
            _reach(v_s, plan, K),
        )
        own = {}
        for i, p in enumerate(plan.pieces):
            if p.carries_in:
                d = torch.einsum(
                    "thk,thv->hkv",
                    reach[0, p.begin : p.end].to(wide),
                    do_s[0, p.begin : p.end].to(wide),
                )
                if p.ends_document and dfinal is not None:
                    d = d + final_m[i].transpose(-1, -2) @ dfinal[p.doc]
                own[p.slot, p.row] = d
        like = torch.empty((1, Hv, K, V), dtype=wide, device=q.device)
        spans_d = _gather_spans(_per_slot(plan, own, like), plan, setup.exchange)
        dentering = _unfold(plan, spans_d, maps_m)  # (C, rows, Hv, K, V)
        # the single-device backward from the true entering state and leaving gradient
        P, rows = len(plan.pieces), plan.rows
        carried = [
            (i, plan.spans.mine[p.slot] * rows + p.row)
            for i, p in enumerate(plan.pieces)
            if p.carries_in
        ]
        starts = [(i, p.doc) for i, p in enumerate(plan.pieces) if not p.carries_in]
        rows_init = _rows(P, starts, initial_state, like[0])
        rows_init += _rows(P, carried, entering.flatten(0, 1), like[0])
        out = [
            (i, (plan.spans.mine[p.slot] + 1) * rows + p.row)
            for i, p in enumerate(plan.pieces)
            if p.carries_out
        ]
        ends = [(i, p.doc) for i, p in enumerate(plan.pieces) if p.ends_document]
        rows_dfinal = _rows(P, out, dentering.flatten(0, 1), like[0])
        rows_dfinal += _rows(P, ends, dfinal, like[0])
        *grads, dinit = gated_delta_backward(
            do_s,
            rows_dfinal,
            *stream[:2],
            v_s,
            *stream[2:],
            scale=setup.scale,
            initial_state=rows_init,
            cu_seqlens=setup.cu_seqlens,
        )
        grads = [d.reshape(t.shape) for d, t in zip(grads, (q, k, v, g, beta), strict=True)]
        dinitial = None
        if initial_state is not None and ctx.needs_input_grad[5]:
            dinitial = _initial_grad(plan, dentering, dinit, dfinal, setup.exchange).to(
                initial_state.dtype
            )
        return (*grads, dinitial, None)


def _initial_grad(plan: SpanPlan, dentering: Tensor, dinit: Tensor, dfinal, exchange) -> Tensor:
    """initial_state's gradient, whole on every rank (as for any input every rank holds):
    span 0's entering gradient without documents; with them, each document's from the
    rank where it starts (one all-reduce)."""
    if not plan.packed:
        return dentering[0]
    starts = [(p.doc, i) for i, p in enumerate(plan.pieces) if not p.carries_in]
    found = _rows(plan.documents, starts, dinit, dinit[0])  # where each document starts
    exchange.sum(found)
    for d in plan.empty:  # the final state is the initial one
        found[d] = 0 if dfinal is None else dfinal[d]
    return found


# (spans, B, device) and the packed documents -> (plan, the local pieces' cu_seqlens): a
# packed batch read once on the host, not once per layer and step
_PLANS = TensorCache(16)


def _planned(spans: Spans, B: int, cu_seqlens: Tensor | None, device):
    tensors = () if cu_seqlens is None else (cu_seqlens,)
    key = (spans, B, str(device))
    found = _PLANS.get(tensors, key)
    if found is None:
        plan = plan_spans(spans, B, cu_seqlens)
        found = plan, torch.tensor(plan.bounds, dtype=torch.int32, device=device)
        _PLANS.put(tensors, key, found)
    return found


def context_parallel_gated_delta(
    inputs, *, scale, initial_state, cu_seqlens, want_final, group, layout
):
    """`fusedpar.gated_delta_rule` over a context-parallel `group` (size > 1; or an
    `Exchange`): inputs (q, k, v, g, beta) this rank's shard under `layout`, checked by
    the caller."""
    q = inputs[0]
    B, T = q.shape[:2]
    if T == 0:
        raise ValueError(
            "gated_delta_rule: under context parallelism each rank needs tokens, got T = 0"
        )
    exchange = group if isinstance(group, Exchange) else Exchange(group)
    spans = exchange.spans(layout, T)
    plan, local = _planned(spans, B, cu_seqlens, q.device)
    setup = _Setup(plan, local, float(scale), exchange, want_final)
    return _ContextParallelGatedDelta.apply(*inputs, initial_state, setup)


def head_parallel_gated_delta(inputs, initial_state, ulysses_group, whole):
    """``whole(inputs, initial_state) -> (o, final)`` over the Ulysses group's whole
    sequence (its ring rank's share under a ring too) and this rank's heads, between two
    head exchanges (`fusedpar.ops.ulysses`): q, k (Hk / U heads), v, g, beta (Hv / U)
    and the initial state's heads in; o's heads and the final state's back."""
    q, k, v, g, beta = inputs
    Hk, Hv, U = q.shape[2], v.shape[2], group_size(ulysses_group)
    if Hk % U:
        raise ValueError(
            f"gated_delta_rule: the {Hk} q/k heads (and {Hv} v-heads) do not divide by the "
            f"Ulysses degree {U}"
        )
    per_channel = g.dim() == 4
    exchanged = scatter_heads(
        [q, k, v, g if per_channel else g[..., None], beta[..., None]], ulysses_group
    )
    q, k, v, g, beta = exchanged[:3] + [
        exchanged[3] if per_channel else exchanged[3][..., 0],
        exchanged[4][..., 0],
    ]
    if initial_state is not None:  # its gradient whole again on every rank
        initial_state = split_to_region(initial_state, ulysses_group, dim=1)
    o, final = whole((q, k, v, g, beta), initial_state)
    (o,) = gather_heads([o], ulysses_group)
    return o, None if final is None else gather_from_region(final, ulysses_group, dim=1)
