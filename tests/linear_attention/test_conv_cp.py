"""`fp.ops.causal_conv1d` under context parallelism (the halo) on 4 gloo ranks against
the single-device op: each rank's shard of y, the final states on every rank, its shard
of dx, and weight, bias and initial-state gradients summed over the ranks (each rank's
is its own tokens' share: `fp.distribute` / DDP reduce replicated parameters' gradients,
as the ring layers' tests sum them). Zigzag and contiguous, kernel widths 2 and 4, spans
of fewer tokens than W - 1 (halos from several spans and ranks, and from the rank's own
other span), packed documents that start at a span boundary, cross one and several
spans, and are 1 token long. Float64 on torch's implementation within 64 ulps of the
largest value (the same math: only the halo's gradient add, the per-rank partial sums
and SiLU's vector/scalar paths order the roundings differently; a wrong or missing halo
token is an O(1) error); fp32 on Triton's interpreter by the tolerance rule. The point-
to-point bytes are exactly the halo's, forward and back; full-graph torch.compile."""

import re

import pytest
import torch
import torch.distributed as dist
from fusedpar.kernels.linear_attention.conv1d import causal_conv1d_reference
from hypothesis import given
from hypothesis import strategies as st

import fusedpar as fp
from fusedpar.ops.spans import Spans
from fusedpar.testing import Collectives, assert_close, exception_of
from fusedpar.testing.strategies import randn, seeds
from fusedpar.testing.tolerance import assert_ulps

C = 5
NAMES = ("y", "final", "dx", "dweight", "dbias", "dinitial")


def _inputs(p, T):
    """The whole sequence's float64 x, weight, bias, initial states, dy, dfinal (exact in
    p["dtype"]), the same on every rank."""
    W, B, dtype, seed = p["W"], p["B"], p["dtype"], p["seed"]
    N = B if p.get("cu") is None else len(p["cu"]) - 1
    shapes = ((B, T, C), (C, W), (C,), (N, C, W - 1), (B, T, C), (N, C, W - 1))
    made = [randn(s, torch.float64, seed + i, exact_in=dtype) for i, s in enumerate(shapes)]
    if not p.get("bias", True):
        made[2] = None
    if not p.get("init", True):
        made[3] = None
    return made


def _run(x, weight, bias, init, dy, dfinal, p, **where):
    """(y, final, dx, dweight, dbias, dinitial) of the op (`reference`: the float64 loop)
    at the loss ``y . dy + final . dfinal``; an absent input's gradient is None, one
    that does not reach this rank zeros."""
    leaves = [
        t if t is None else t.detach().clone().requires_grad_() for t in (x, weight, bias, init)
    ]
    cu = None if p.get("cu") is None else torch.tensor(p["cu"], dtype=torch.int32)
    kw = dict(activation=p.get("activation", "silu"), cu_seqlens=cu)
    if where.pop("reference", False):
        y, final = causal_conv1d_reference(*leaves[:3], kw["activation"], cu, leaves[3], True)
    else:
        y, final = fp.ops.causal_conv1d(
            *leaves[:3], **kw, initial_states=leaves[3], output_final_states=True, **where
        )
    ((y * dy).sum() + (final * dfinal).sum()).backward()
    grads = [
        None if t is None else t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves
    ]
    return [y, final, *grads]


def _halo_bytes(p, T, me, size, itemsize):
    """The bytes rank `me` sends (= receives) over the forward and backward: its tokens
    in other ranks' halos, and back the gradients of its halo's tokens held elsewhere
    (counted here from the layout's chunks, not from `Spans`)."""
    chunks = 2 * size if p["layout"] == "zigzag" else size
    n = T // chunks

    def held(rank):
        return (rank, chunks - 1 - rank) if p["layout"] == "zigzag" else (rank,)

    tokens = 0
    for rank in range(size):
        for chunk in held(rank):
            for q in range(max(chunk * n - (p["W"] - 1), 0), chunk * n):
                owner = next(r for r in range(size) if q // n in held(r))
                tokens += (rank != me and owner == me) + (rank == me and owner != me)
    return tokens * p["B"] * C * itemsize


def _cp_case(p):
    """This rank's sharded run against the single-device op (float64 on torch's
    implementation: 64 ulps; else the tolerance rule against the float64 loop);
    returns True."""
    size, rank = dist.get_world_size(), dist.get_rank()
    T = p["T_local"] * size
    x, weight, bias, init, dy, dfinal = _inputs(p, T)
    dtype, layout = p["dtype"], p["layout"]

    def shard(t):
        return fp.shard_sequence(t, dist.group.WORLD, layout=layout)

    full = [t if t is None else t.to(dtype) for t in (x, weight, bias, init, dy, dfinal)]
    # the single-device op (fp32: the loop in fp32, the tolerance rule's PyTorch error)
    single = _run(*full, p, reference=dtype != torch.float64)
    local = [shard(full[0]), *full[1:4], shard(full[4]), full[5]]
    if p.get("strided"):  # x with no unit stride on C
        local[0] = local[0].transpose(1, 2).contiguous().transpose(1, 2)
    with Collectives() as seen:
        got = _run(*local, p, group=dist.group.WORLD, layout=layout)
    f64 = dtype == torch.float64
    ref = None if f64 else _run(x, weight, bias, init, dy, dfinal, p, reference=True)
    for i, name in enumerate(NAMES):
        if single[i] is None:
            assert got[i] is None, name
            continue
        mine = got[i].detach()
        if name.startswith("d") and name != "dx":  # this rank's share
            dist.all_reduce(mine := mine.clone())

        def mine_of(t, name=name):  # y and dx: this rank's shard
            return shard(t.detach()) if name in ("y", "dx") else t.detach()

        want = mine_of(single[i])
        assert mine.dtype == want.dtype and mine.shape == want.shape, name
        if f64:
            assert_ulps(mine, want, ulps=64, name=name)
        else:
            sums = T if name == "dweight" else None
            assert_close(mine, mine_of(ref[i]), want, name=name, sum_length=sums)
    assert torch.equal(got[1], single[1])  # final states: copies of the inputs
    halo = _halo_bytes(p, T, rank, size, dtype.itemsize)
    kinds = {kind for kind, _ in seen.counts}
    assert kinds <= {"send", "recv", "all_gather", "all_reduce"}, kinds
    assert seen.bytes["send", size] == halo and seen.bytes["recv", size] == halo, seen.bytes
    # the shapes' check (four int64 a rank, CPU only) and the final states' one sum
    assert seen.bytes["all_gather", size] == 4 * 8 * (size + 1), seen.bytes
    assert seen.bytes["all_reduce", size] == got[1].numel() * dtype.itemsize, seen.bytes
    return True


F64 = dict(dtype=torch.float64, seed=3)
CASES = {
    # 8 spans of 3; documents: [0, 3) ends at a span boundary, [3, 4) and [4, 5) one
    # token, [5, 11) crosses 2 boundaries, [11, 23) crosses 4, [23, 24) one token
    "zigzag-w4-packed": dict(layout="zigzag", W=4, B=1, T_local=6, cu=[0, 3, 4, 5, 11, 23, 24]),
    # 8 one-token spans, W - 1 = 3: halos from three spans, rank 3's second span (4)
    # reads its own first (3); documents of 1 token and one crossing 3 spans
    "zigzag-w4-short-spans": dict(layout="zigzag", W=4, B=1, T_local=2, cu=[0, 1, 2, 5, 8]),
    "zigzag-w4-short-spans-rows": dict(layout="zigzag", W=4, B=2, T_local=2, init=False),
    "zigzag-w2-packed": dict(
        layout="zigzag", W=2, B=1, T_local=4, cu=[0, 2, 3, 16], activation=None, bias=False
    ),
    "contiguous-w2-rows-strided": dict(layout="contiguous", W=2, B=2, T_local=5, strided=True),
    "contiguous-w4-short-spans": dict(layout="contiguous", W=4, B=1, T_local=1, cu=[0, 1, 4]),
    "contiguous-w4-packed": dict(layout="contiguous", W=4, B=1, T_local=7, cu=[0, 7, 8, 27, 28]),
}


@pytest.mark.parametrize("case", CASES)
def test_sharded_conv_matches_the_single_device_op(world, case):
    assert all(world(4).run(_cp_case, dict(CASES[case], **F64)))


@st.composite
def _shapes(draw):
    """A random sharded case: layout, W 2..4, 1 to 4 tokens a span, rows or packed
    documents (random cuts, empty documents too), with or without states and bias."""
    layout = draw(st.sampled_from(["zigzag", "contiguous"]))
    T_local = draw(st.integers(1, 4)) * (2 if layout == "zigzag" else 1)
    p = dict(
        layout=layout,
        W=draw(st.integers(2, 4)),
        T_local=T_local,
        init=draw(st.booleans()),
        bias=draw(st.booleans()),
        activation=draw(st.sampled_from(["silu", None])),
        seed=draw(seeds()),
    )
    if draw(st.booleans()):
        cuts = draw(st.lists(st.integers(0, 4 * T_local), max_size=5))
        return dict(p, B=1, cu=[0, *sorted(cuts), 4 * T_local])
    return dict(p, B=draw(st.integers(1, 2)))


@given(p=_shapes())
def test_sharded_conv_matches_on_random_shapes(world, p):
    assert all(world(4).run(_cp_case, dict(p, dtype=torch.float64)))


def test_sharded_conv_on_triton_kernels(world, triton_kernels):
    """fp32 on the interpreter's kernels: zigzag, W = 4, packed, spans of 3 tokens."""
    p = dict(CASES["zigzag-w4-packed"], dtype=torch.float32, seed=7)
    assert all(world(4).run(_cp_case, p))


def _compiled_and_eager():
    """The sharded conv (zigzag, packed, final states) compiled full-graph (aot_eager)
    and in eager: (loss, dx, dweight) of each."""
    x, weight = randn((1, 4, C), torch.float32, 1), randn((C, 4), torch.float32, 2)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)

    def loss(x, weight):
        y, final = fp.ops.causal_conv1d(
            x, weight, cu_seqlens=cu, output_final_states=True, group=dist.group.WORLD
        )
        return (y * y).sum() + final.sum()

    runs = []
    for fn in (torch.compile(loss, backend="aot_eager", fullgraph=True), loss):
        leaves = [t.clone().requires_grad_() for t in (x, weight)]
        value = fn(*leaves)
        value.backward()
        runs.append((value.detach(), *(t.grad for t in leaves)))
    return runs


def test_sharded_conv_compiles_full_graph(world):
    """No graph break (the halo is a custom op); the same bits as eager."""
    for compiled, eager in world(2).run(_compiled_and_eager):
        assert all(torch.equal(c, e) for c, e in zip(compiled, eager, strict=True))


def test_spans_locate():
    spans = Spans(rank=3, size=4, layout="zigzag", local_len=2)  # 8 one-token spans
    assert spans.locate(1, 4) == [(1, 0, 1), (2, 0, 1), (3, 0, 1)]
    assert spans.locate(-3, 0) == [] and spans.locate(7, 12) == [(7, 0, 1)]
    assert Spans(0, 2, "contiguous", 5).locate(3, 7) == [(0, 3, 5), (1, 0, 2)]


def _bad_inputs():
    """The messages each bad call raises on this rank (None: it did not raise)."""
    rank = dist.get_rank()
    x, w = torch.randn(1, 6, C, dtype=torch.float64), torch.randn(C, 4, dtype=torch.float64)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)

    def call(x=x, **kw):
        return exception_of(fp.ops.causal_conv1d, x, w, group=dist.group.WORLD, **kw)

    errors = [
        call(layout="ring"),
        call(x=x[:, :5]),  # 5 tokens: not two equal spans
        call(x=x[:, :5], layout="contiguous", cu_seqlens=cu),  # ends at 20, not 24
        call(x=x.expand(2, -1, -1), cu_seqlens=cu),
        call(cu_seqlens=cu, initial_states=torch.zeros(1, C, 3, dtype=torch.float64)),
        call(x=x[:, : 4 if rank == 0 else 6]),  # the ranks disagree
    ]
    return [None if e is None else (type(e), str(e)) for e in errors]


def test_bad_input_is_named_on_every_rank(world):
    results = world(4).run(_bad_inputs)
    assert all(r == results[0] or i == 0 for i, r in enumerate(results))
    expected = (
        (ValueError, "layout must be one of"),
        (ValueError, "two equal spans, but this rank holds 5 tokens"),
        (ValueError, "must end at the total length 20, got 24"),
        (ValueError, "B = 1"),
        (ValueError, r"must be \(N, C, W - 1\) = \(2, 5, 3\), got \(1, 5, 3\)"),
        (ValueError, "ranks disagree"),
    )
    for (kind, pattern), got in zip(expected, results[0], strict=True):
        assert got is not None and got[0] is kind, (pattern, got)
        assert re.search(pattern, got[1]), (pattern, got)
