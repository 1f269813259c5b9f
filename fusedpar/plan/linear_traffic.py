"""A GDN layer's collectives under context parallelism, one microbatch, forward or
backward, as `fusedpar.testing.Collectives` counts them (each all-gather its input and
output, each all-to-all both, each send and receive its tensor), for
`fusedpar.plan.traffic`: the conv's halo (point to point, its routes `conv_halo.halo_plan`'s
on `Spans`), the recurrence's span summaries (one all-gather each way; two on a ring x
Ulysses mesh) and, in the "ulysses" mode, the head exchanges (`ulysses.scatter_heads` of
q, k, v, b, a; `gather_heads` of o). On a CPU the halo and the exchanges add their shape
checks' small all-gathers. The mode: `linear_context.layer_mode`, as the layer picks it.
"""

from __future__ import annotations

from fusedpar.ops.conv_halo import halo_plan
from fusedpar.ops.spans import Spans
from fusedpar.plan.linear_context import LinearSizes, layer_mode

CONV_WIDTH_CHECK = 4  # the halo's shape check: x's three dims and W - 1, int64


def linear_context(ledger, spec, z, *, cpu_checks: bool, forward: bool, layout="zigzag"):
    """Add one GDN layer's CP collectives (`z`'s cp x ulysses > 1) to `ledger`;
    `z.span_rank` is the rank whose halo routes count (edges send fewer)."""
    sizes = LinearSizes.of(spec, z.tp)
    c, u, B, e = z.cp, z.ulysses, z.batch, z.e
    L = z.seq // (c * u)  # a sequence's tokens on this rank
    state = 8 if e == 8 else 4  # the summaries in fp32 (float64 for float64)
    K, V = sizes.K, sizes.V
    mode = layer_mode(sizes, c, u, L, layout)
    hk, hv, axes, rank = sizes.hk, sizes.hv, ("cp", "ulysses"), z.span_rank % (c * u)
    if mode == "ulysses":
        exchanged = [B * L * hk * K * e] * 2 + [B * L * hv * V * e] + [B * L * hv * e] * 2
        for size in [*exchanged, B * L * hv * V * e]:  # in, and o back
            ledger.add("all_to_all", ("ulysses",), 2 * size)
        if cpu_checks:  # the two exchanges' shapes (5 and 1 tensors of 4 dims)
            for values in (20, 4):
                ledger.add("all_gather", ("ulysses",), (u + 1) * values * 8)
        hk, hv, L, axes, rank = hk // u, hv // u, L * u, ("cp",), rank // u
        u = 1
    if c * u == 1:
        return
    spans = Spans(rank, c, layout, L, u)
    routes = halo_plan(spans, spec.linear_conv - 1)
    for channels in (hk * K, hk * K, hv * V):  # q's, k's and v's conv: each its own call
        _halo(ledger, routes, axes, B * channels * e, cpu_checks, forward)
    per_span = len(spans.mine) * B * hv * K * ((V + K) if forward else V) * state
    if u > 1:  # over Ulysses, then the ring: rank r U + u's order
        ledger.add("all_gather", ("ulysses",), (u + 1) * per_span)
        ledger.add("all_gather", ("cp",), (c + 1) * u * per_span)
    else:
        ledger.add("all_gather", axes, (c + 1) * per_span)


def _halo(ledger, plan, axes, row_bytes: int, cpu_checks: bool, forward: bool):
    """The conv's halo (`plan`: `halo_plan`'s routes): its rows of `row_bytes` each to and
    from the ranks holding them, the gradient back the other way."""
    sends, receives = (plan.sends, plan.receives) if forward else (plan.receives, plan.sends)
    for kind, messages in (("send", sends), ("recv", receives)):
        for _, runs in messages:
            ledger.add(kind, axes, sum(r[-1] for r in runs) * row_bytes)
    if cpu_checks and forward:
        for axis in axes if len(axes) == 1 else ("ulysses", "cp"):
            ledger.add("all_gather", (axis,), (ledger.size(axis) + 1) * CONV_WIDTH_CHECK * 8)
