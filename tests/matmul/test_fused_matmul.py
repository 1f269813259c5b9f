"""The fused schedule (``overlap="fused"``) on CPU: its kernels in Triton's interpreter
with the flags set before the launch (`fusedpar.kernels.matmul_fused`), and the ops'
fused path over gloo with a loopback transport in place of symmetric memory (which
needs NCCL): every gradient against float64 at W = 2 and 4. The copy engine, the waits
while data lands, the watchdog and CUDA graphs are the GPU tier's (tests/matmul/test_fused_gpu.py).
"""

import warnings

import pytest
import torch
import torch.distributed as dist
import triton
from fusedpar.kernels import matmul_fused as mf
from fusedpar.kernels import tuning
from fusedpar.kernels.matmul import matmul

import fusedpar as fp
from fusedpar import symmetric
from fusedpar.testing.tolerance import assert_close

WORLD = dist.group.WORLD
TILE = triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64})  # the interpreter's


def _plain(a, b, bias=None, out_dtype=None):
    """`matmul` (Triton's) at the fused kernel's interpreter tile."""
    with fp.implementation("triton"), tuning.forced("matmul", TILE):
        return matmul(a, b, bias=bias, out_dtype=out_dtype)


def _tiles(trace: torch.Tensor, per_chunk: int, programs: int) -> list[list[int]]:
    """Each program's tiles in the order it took them (the chunk: tile // per_chunk)."""
    rows = trace.view(programs, -1)
    return [[int(t) for t in row if t >= 0] for row in rows]


@pytest.mark.parametrize("W, dtype", [(3, torch.float32), (4, torch.float16)])  # (the pointer
def test_gathered_matmuls_equal_the_plain_gemm_bitwise_in_arrival_order(dtype, W):  # and TMA reads)
    gen = torch.Generator().manual_seed(W)
    m, K, Ns = 20, 72, (40, 24, 8)  # a chunk not a tile's multiple, K not BLOCK_K's
    gathered = torch.randn(W * m, K, generator=gen).to(dtype)
    weights = [torch.randn(n, K, generator=gen).to(dtype) for n in Ns]
    biases = [torch.randn(Ns[0], generator=gen).to(dtype), None, torch.randn(Ns[2]).float()]
    flags = torch.ones(W, dtype=torch.int32)
    per_chunk = 1 * (2 + 1 + 1)  # one row block of 32; column blocks 2 + 1 + 1
    for rank in range(W):
        trace = torch.full((3 * W * per_chunk,), -1, dtype=torch.int32)
        signals = mf.Signals(flags, rank, W, trace=trace)
        outs = mf.gathered_matmuls(gathered, [w.t() for w in weights], biases, signals, programs=3)
        for out, w, b in zip(outs, weights, biases, strict=True):
            # chunk by chunk: a tile of the fused kernel ends at its chunk's last row
            ref = torch.cat([_plain(gathered[c * m : (c + 1) * m], w.t(), b) for c in range(W)])
            assert out.dtype == dtype and torch.equal(out, ref)
        programs = _tiles(trace, per_chunk, 3)
        assert sorted(t for p in programs for t in p) == list(range(W * per_chunk))
        for tiles in programs:  # own chunk first, then rank + 1, rank + 2, ...
            slots = [(t // per_chunk - rank) % W for t in tiles]
            assert slots == sorted(slots), (rank, tiles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_partial_matmuls_count_each_chunk_and_start_after_this_rank(dtype):
    gen = torch.Generator().manual_seed(1)
    W, m, N = 3, 12, 40
    pairs = [
        (
            torch.randn(W * m, k, generator=gen).to(dtype),
            torch.randn(N, k, generator=gen).to(dtype).t(),
        )
        for k in (72, 16)
    ]
    for rank in range(W):
        counts = torch.zeros(W, dtype=torch.int32)
        trace = torch.full((2 * W * 2,), -1, dtype=torch.int32)
        P = mf.partial_matmuls(pairs[:1], mf.Signals(counts, rank, W, trace=trace), programs=2)
        assert torch.equal(P, _plain(*pairs[0], out_dtype=torch.float32))
        assert counts.tolist() == [2] * W  # 1 x 2 tiles a chunk, each counted once
        for tiles in _tiles(trace, 2, 2):  # rank + 1 first, this rank's own last
            slots = [(t // 2 - rank - 1) % W for t in tiles]
            assert slots == sorted(slots)
        zeros = torch.zeros(W, dtype=torch.int32)
        both = mf.partial_matmuls(pairs, mf.Signals(zeros, rank, W), out_dtype=torch.float16)
        exact = sum(a.double() @ b.double() for a, b in pairs)
        assert both.dtype == torch.float16
        torch.testing.assert_close(
            both.double(), exact, atol=2e-2 * exact.abs().max().item(), rtol=0
        )


def test_sum_partials_adds_in_rank_order_and_rounds_once():
    gen = torch.Generator().manual_seed(2)
    W, m, N = 4, 9, 130  # N past one 128-column tile
    received = torch.randn(W, m, N, generator=gen)
    own = torch.randn(m, N, generator=gen)
    bias = torch.randn(N, generator=gen).half()
    for rank in range(W):
        got = mf.sum_partials(
            own, received, torch.ones(W, dtype=torch.int32), rank, torch.float16, bias
        )
        total = torch.zeros(m, N)
        for s in range(W):
            total += own if s == rank else received[s]
        assert torch.equal(got, (total + bias.float()).half())


def test_bad_input_is_refused_naming_the_sizes():
    x, w = torch.randn(8, 16), torch.randn(16, 8)
    ones = torch.ones(2, dtype=torch.int32)
    cases = [
        (
            lambda: mf.gathered_matmuls(
                x, [w], [None], mf.Signals(torch.tensor([1, 0], dtype=torch.int32), 0, 2)
            ),
            r"flags \[1\] are not set: in Triton's interpreter",
        ),
        (
            lambda: mf.gathered_matmuls(x, [w], [None], mf.Signals(ones.long(), 0, 2)),
            "must be int32",
        ),
        (
            lambda: mf.gathered_matmuls(x, [w] * 4, [None] * 4, mf.Signals(ones, 0, 2)),
            "1 to 3 weights",
        ),
        (
            lambda: mf.gathered_matmuls(
                x, [w], [None], mf.Signals(torch.ones(3, dtype=torch.int32), 0, 3)
            ),
            r"rows divisible by world = 3",
        ),
        (
            lambda: mf.gathered_matmuls(x, [w], [None], mf.Signals(ones, 2, 2)),
            r"rank must be in \[0, 2\)",
        ),
        (
            lambda: mf.gathered_matmuls(x, [torch.randn(8, 8)], [None], mf.Signals(ones, 0, 2)),
            r"weight 0 must be \(16, N\)",
        ),
        (
            lambda: mf.gathered_matmuls(x, [w], [None], mf.Signals(ones, 0, 2, wait_s=0)),
            "wait_s must be",
        ),
        (
            lambda: mf.partial_matmuls([(x, w), (x[:4], w)], mf.Signals(ones, 0, 2)),
            "pair 1 must be",
        ),
        (
            lambda: mf.sum_partials(
                torch.randn(3, 4), torch.randn(2, 3, 5), ones, 0, torch.float32
            ),
            r"own must be \(3, 5\)",
        ),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_wait_seconds_reads_the_variable(monkeypatch):
    monkeypatch.setenv("FUSEDPAR_WAIT_S", "2.5")
    assert symmetric.wait_seconds() == 2.5
    monkeypatch.setenv("FUSEDPAR_WAIT_S", "soon")
    with pytest.raises(ValueError, match="FUSEDPAR_WAIT_S must be a number"):
        symmetric.wait_seconds()
    monkeypatch.delenv("FUSEDPAR_WAIT_S")
    assert symmetric.wait_seconds() == 30.0


# --- the ops' fused path over gloo, symmetric memory replaced by a loopback -------------


class _LoopbackGather:
    """`symmetric.Gather`'s interface: every chunk there (and flagged) at `start`."""

    def __init__(self, pg, rows, K, dtype, device):
        self.pg, self.rank, self.world = pg, dist.get_rank(pg), dist.get_world_size(pg)
        self.flags, self.status = torch.zeros(self.world, dtype=torch.int32), None

    def start(self, x, gathered):
        dist.all_gather_into_tensor(gathered, x.contiguous(), group=self.pg)
        self.flags.fill_(1)
        return gathered

    def finish(self):
        self.flags.zero_()


class _LoopbackScatter:
    """`symmetric.Scatter`'s interface: the partials exchanged after the GEMM counted
    every tile of every chunk."""

    def __init__(self, pg, rows, N, dtype, device):
        self.pg, self.rank, self.world = pg, dist.get_rank(pg), dist.get_world_size(pg)
        self.N, self.dtype = N, dtype
        self.counts = torch.zeros(self.world, dtype=torch.int32)

    def run(self, pairs, out_dtype, bias, tiles, gemm):
        m, W = pairs[0][0].shape[0] // self.world, self.world
        partials = torch.empty((W * m, self.N), dtype=self.dtype)
        self.counts.zero_()
        gemm(partials, self.counts)
        assert self.counts.tolist() == [tiles] * W
        received = torch.empty_like(partials)
        dist.all_to_all_single(received, partials, group=self.pg)
        return mf.sum_partials(
            partials[self.rank * m : (self.rank + 1) * m],
            received.view(W, m, self.N),
            torch.ones(W, dtype=torch.int32),
            self.rank,
            out_dtype,
            bias,
        )


def _fused_layers(dtype, reduce_dtype):
    """`_check_fused_layers` with symmetric memory replaced by the loopback, put back after
    (the ranks serve other tests, which expect "fused" refused on gloo)."""
    saved = symmetric.unavailable, symmetric.Gather, symmetric.Scatter
    symmetric.unavailable = lambda pg: None
    symmetric.Gather, symmetric.Scatter = _LoopbackGather, _LoopbackScatter
    try:
        return _check_fused_layers(dtype, reduce_dtype)
    finally:
        symmetric.unavailable, symmetric.Gather, symmetric.Scatter = saved
        symmetric._TRANSPORTS.clear()


def _check_fused_layers(dtype, reduce_dtype):
    """A column GEMM of three weights (QKV) and a row GEMM, fused, with every gradient,
    against float64 within twice the serial schedule's error in the same dtypes (each
    rank checks its own shards)."""
    rank, W = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(11)
    T, K, Ns, N2 = 6 * W, 24, (16, 8, 8), 20
    X = torch.randn(T, K, generator=gen)
    Ws = [torch.randn(n * W, K, generator=gen) / 4 for n in Ns]
    Bs = [torch.randn(n * W, generator=gen) for n in Ns]
    W2 = torch.randn(N2, sum(Ns) * W, generator=gen) / 4
    B2 = torch.randn(N2, generator=gen)
    mine = slice(rank * T // W, (rank + 1) * T // W)

    def shard(t, n):  # this rank's rows of a column weight
        return t[rank * n : (rank + 1) * n]

    def run(x, ws, bs, w2, b2, overlap, reduce_dtype):
        outs = fp.all_gather_matmul(x, ws, WORLD, bias=bs, overlap=overlap)
        h = torch.cat(outs, dim=-1)
        return fp.matmul_reduce_scatter(
            h, w2, WORLD, bias=b2, overlap=overlap, reduce_dtype=reduce_dtype
        )

    leaves = [
        X[mine],
        *[shard(w, n) for w, n in zip(Ws, Ns, strict=True)],
        *[shard(b, n) for b, n in zip(Bs, Ns, strict=True)],
    ]
    cols = torch.cat(
        [
            torch.arange(o * W + rank * n, o * W + (rank + 1) * n)
            for o, n in zip((0, Ns[0], Ns[0] + Ns[1]), Ns, strict=True)
        ]
    )
    leaves += [W2[:, cols], B2]
    results = {}
    # the fused schedule, the serial one in the same dtypes (the error it may have twice
    # of), and float64 (partials not rounded)
    for run_as, overlap, kind, rd in (
        ("fused", "fused", dtype, reduce_dtype),
        ("peer", "serial", dtype, reduce_dtype),
        ("ref", "serial", torch.float64, None),
    ):
        args = [t.detach().to(kind).contiguous().requires_grad_() for t in leaves]
        x, ws, bs, w2, b2 = args[0], args[1:4], args[4:7], args[7], args[8]
        y = run(x, ws, bs, w2, b2, overlap, rd)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(rank)).to(kind)
        y.backward(dy)
        results[run_as] = [y.detach(), *[a.grad for a in args]]
    names = ["y", "dx", "dwq", "dwk", "dwv", "dbq", "dbk", "dbv", "dw2", "db2"]
    for name, got, peer, ref in zip(
        names, results["fused"], results["peer"], results["ref"], strict=True
    ):
        assert got.dtype == dtype
        assert_close(got, ref, peer, name=name, sum_length=K)
    return True


@pytest.mark.parametrize(
    "W, dtype, reduce_dtype",
    [
        (4, torch.float16, None),
        (2, torch.float32, torch.float16),
    ],
)
def test_fused_ops_match_float64_every_gradient(world, W, dtype, reduce_dtype):
    assert all(world(W).run(_fused_layers, dtype, reduce_dtype))


class _StaleGather(_LoopbackGather):
    """A transport whose last chunk is read before it landed (zeros): what a missing
    fence would do."""

    def start(self, x, gathered):
        super().start(x, gathered)
        gathered[-x.shape[0] :] = 0
        return gathered


def _auto_with_fused(stale):
    """ "auto" measured (switched on) with "fused" a candidate, through the loopback (or a
    transport that reads a chunk too early): the pick per key, and every warning."""
    import warnings

    from fusedpar.kernels import tuning

    from fusedpar.ops import overlap

    saved = (
        symmetric.unavailable,
        symmetric.Gather,
        symmetric.Scatter,
        overlap.measures,
        overlap.AUTO_CANDIDATES,
    )
    symmetric.unavailable, overlap.measures = (lambda pg: None), (lambda device: True)
    overlap.AUTO_CANDIDATES = ("serial", "ring", "fused")  # (not yet by default)
    symmetric.Gather = _StaleGather if stale else _LoopbackGather
    symmetric.Scatter = _LoopbackScatter
    symmetric._WARNED.clear()
    try:
        rank, W = dist.get_rank(), dist.get_world_size()
        gen = torch.Generator().manual_seed(4)
        X, w = torch.randn(9 * W, 40, generator=gen), torch.randn(24, 40, generator=gen)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = fp.all_gather_matmul(X[9 * rank : 9 * (rank + 1)], w, WORLD, overlap="auto")
        torch.testing.assert_close(y.double(), X.double() @ w.double().T, rtol=1e-5, atol=1e-5)
        timings = {
            key: times
            for (_, key), times in tuning.tuner("tp_schedule").timings.items()
            if key[:4] == ("all_gather_matmul", W, 16, 40)
        }
        picks = {
            key: c.kwargs["overlap"]
            for (_, key), c in tuning.tuner("tp_schedule").picks.items()
            if key in timings
        }
        return list(picks.values()), list(timings.values()), [str(c.message) for c in caught]
    finally:
        (
            symmetric.unavailable,
            symmetric.Gather,
            symmetric.Scatter,
            overlap.measures,
            overlap.AUTO_CANDIDATES,
        ) = saved
        symmetric._TRANSPORTS.clear()
        tuning.tuner("tp_schedule").picks.clear()


def test_auto_measures_fused_and_leaves_out_a_wrong_one(world):
    for picks, timings, warned in world(2).run(_auto_with_fused, False):
        assert len(picks) == 1 and picks[0] in ("serial", "ring", "fused")
        assert len(timings[0]) == 3 and all(t < float("inf") for t in timings[0])
        assert not any("left 'fused' out" in w for w in warned)
    for picks, timings, warned in world(2).run(_auto_with_fused, True):
        assert picks[0] != "fused" and timings[0][2] == float("inf")
        assert any("'auto' left 'fused' out for all_gather_matmul" in w for w in warned), warned


def _fused_swiglu():
    """ParallelSwiGLU (gate/up one launch; its down projection's backward, a gated
    epilogue's GEMM on the gathered rows, written into the layer's buffer) fused against
    serial, output and every gradient."""
    saved = symmetric.unavailable, symmetric.Gather, symmetric.Scatter
    symmetric.unavailable = lambda pg: None
    symmetric.Gather, symmetric.Scatter = _LoopbackGather, _LoopbackScatter
    try:
        rank = dist.get_rank()
        results = {}
        for overlap in ("fused", "serial"):
            torch.manual_seed(0)
            layer = fp.nn.ParallelSwiGLU(16, 48, WORLD, bias=True, overlap=overlap)
            with torch.no_grad():
                for p in layer.parameters():
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
            x = torch.randn(
                5, 16, generator=torch.Generator().manual_seed(rank), requires_grad=True
            )
            symmetric._WARNED.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                y = layer(x)
                y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(9 + rank)))
            results[overlap] = [y.detach(), x.grad, *[p.grad for p in layer.parameters()]]
            results[overlap + " warned"] = [str(c.message) for c in caught]
        for got, ref in zip(results["fused"], results["serial"], strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        return len(results["fused"]), results["fused warned"]
    finally:
        symmetric.unavailable, symmetric.Gather, symmetric.Scatter = saved
        symmetric._TRANSPORTS.clear()


def test_fused_gated_mlp_matches_serial_every_gradient(world):
    for n, warned in world(2).run(_fused_swiglu):
        assert n >= 5  # y, dx and the parameters' gradients
        # the down projection's backward took the fused gather and its epilogue GEMM
        assert any("a GEMM with an epilogue runs after the gather" in w for w in warned)
