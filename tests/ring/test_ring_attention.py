"""fp.ring_attn and the sequence helpers against full-sequence attention, at W = 2 and 4;
the virtual ring (the same loops over W ranks simulated on one device) at W = 2..4.

Every rank builds the full q, k, v and upstream gradients from the seed, shards them,
runs the ring, and checks its shard of the output, LSE and every gradient against the
float64 reference (tolerance rule of DESIGN) and against single-device `flash_attn`.
"""

import re

import pytest
import torch
import torch.distributed as dist
from fusedpar.kernels.attention import AttentionMask, attention_reference, merge_attention
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fusedpar as fp
from fusedpar.ops import ring_attention
from fusedpar.ops.ring_transport import VirtualRing
from fusedpar.ops.virtual_ring import virtual_ring_attn
from fusedpar.testing import assert_close, exception_of
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds
from tests.attention.helpers import attention_grads, force_split, torch_results
from tests.ring.helpers import check_sharded_attention

WORLD = dist.group.WORLD


def _run_ring(p):
    layout = p["layout"]
    tokens = p["chunk"] * (2 if layout == "zigzag" else 1)  # per rank
    check_sharded_attention(dict(p, tokens=tokens, Hq=p["Hkv"] * p["group"]), WORLD, None, layout)
    return True


@given(
    world_size=st.sampled_from([2, 4]),
    B=st.integers(1, 2),
    chunk=st.integers(1, 9),
    Hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    D=st.sampled_from([8, 16, 40, 64]),
    causal=st.booleans(),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    dtype=cpu_dtypes(),
    seed=seeds(),
    Dv=st.sampled_from([None, None, 8, 24]),
)
@example(
    world_size=4,
    B=1,
    chunk=1,
    Hkv=1,
    group=4,
    D=16,
    causal=True,
    layout="zigzag",
    dtype=torch.float32,
    seed=0,
    Dv=None,
)  # one token per chunk, MQA
@example(
    world_size=2,
    B=2,
    chunk=7,
    Hkv=2,
    group=2,
    D=40,
    causal=True,
    layout="contiguous",
    dtype=torch.float16,
    seed=1,
    Dv=24,
)  # V narrower than Q and K
def test_ring_attn_matches_full_attention(world, world_size, **p):
    assert all(world(world_size).run(_run_ring, p))


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_ring_on_triton_kernels(world, triton_kernels, deterministic):
    """The first example with fusedpar's Triton kernels (the interpreter here) on every
    rank: the ring's merge and accumulate modes of the kernels, inside the ring; its
    backward fused (the interpreter's pick) or, deterministic, split; V narrower than Q
    and K (the kernels' HEAD_DIM_V)."""
    p = dict(
        B=2,
        chunk=3,
        Hkv=1,
        group=2,
        D=16,
        causal=True,
        layout="zigzag",
        dtype=torch.float32,
        seed=4,
        deterministic=deterministic,
        Dv=8,
    )
    assert all(world(4).run(_run_ring, p))


def _run_no_key_rows_and_single_rank_equality(layout):
    """Rows with nothing to see never produce NaN; and a world of one is flash_attn."""
    q = randn((1, 8, 2, 16), torch.float32, 0)
    k, v = randn((1, 8, 1, 16), torch.float32, 1), randn((1, 8, 1, 16), torch.float32, 2)
    out = fp.ring_attn(q, k, v, WORLD, causal=True, layout=layout)
    return bool(torch.isfinite(out).all())


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_outputs_are_finite(world, layout):
    assert all(world(4).run(_run_no_key_rows_and_single_rank_equality, layout))


@pytest.mark.parametrize("causal", [False, True])
def test_one_rank_is_flash_attn(world, causal):
    q = randn((2, 6, 4, 16), torch.float32, 0)
    k, v = randn((2, 6, 2, 16), torch.float32, 1), randn((2, 6, 2, 16), torch.float32, 2)
    expected = fp.flash_attn(q, k, v, causal=causal)
    assert torch.equal(fp.ring_attn(q, k, v, None, causal=causal), expected)
    assert torch.equal(world(1).run(_ring_on_world, q, k, v, causal)[0], expected)


def _ring_on_world(q, k, v, causal):
    return fp.ring_attn(q, k, v, WORLD, causal=causal)


# --- sequence helpers -----------------------------------------------------------------


def _run_helpers(layout, seq_len):
    rank, size = dist.get_rank(), dist.get_world_size()
    chunk = seq_len // (2 * size if layout == "zigzag" else size)

    def owned(r):
        return [r, 2 * size - 1 - r] if layout == "zigzag" else [r]

    x = torch.arange(seq_len * 3, dtype=torch.float32).view(1, seq_len, 3).requires_grad_()
    local = fp.shard_sequence(x, WORLD, layout=layout)
    positions = fp.sequence_positions(seq_len, WORLD, layout=layout)
    expected = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in owned(rank)])
    full = fp.gather_sequence(local, WORLD, layout=layout)
    # rank r's loss weighs its tokens by r + 1; shard's backward gathers, so every rank
    # gets the full gradient: r + 1 at the positions rank r holds
    (local * (rank + 1)).sum().backward()
    per_position = torch.empty(seq_len)
    for r in range(size):
        for c in owned(r):
            per_position[c * chunk : (c + 1) * chunk] = r + 1
    return (
        torch.equal(positions, expected)
        and torch.equal(local[0, :, 0], positions.float() * 3)
        and torch.equal(full, x.detach())
        and torch.equal(x.grad[0, :, 0], per_position)
    )


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_gather_positions_agree(world, world_size, layout):
    assert all(world(world_size).run(_run_helpers, layout, 8 * world_size))


def _run_gather_backward(layout):
    local = torch.randn(1, 4, 2, requires_grad=True)
    full = fp.gather_sequence(local, WORLD, layout=layout)
    grad = torch.arange(full.numel(), dtype=torch.float32).view_as(full)
    full.backward(grad)
    return torch.equal(local.grad, fp.shard_sequence(grad, WORLD, layout=layout))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_gather_backward_keeps_the_local_part(world, layout):
    assert all(world(2).run(_run_gather_backward, layout))


def test_helpers_without_a_group_are_identities():
    x = torch.randn(2, 5, 3)
    assert fp.shard_sequence(x, None) is x and fp.gather_sequence(x, None) is x
    assert torch.equal(fp.sequence_positions(5, None), torch.arange(5))


# --- the merge kernel ---------------------------------------------------------------------


def check_merge(B, S, H, D, block_dtype, device="cpu"):
    """merge_attention against a float64 merge: symmetric, exact where one side is
    empty (LSE -inf), 0 and -inf where both are, never NaN."""
    oa = randn((B, S, H, D), torch.float32, 0).to(device)
    ob = randn((B, S, H, D), block_dtype, 1).to(device)
    la, lb = (randn((B, H, S), torch.float32, i).to(device) for i in (2, 3))
    la[0, 0, :2] = float("-inf")  # side a empty on two rows
    lb[0, 0, 1:3] = float("-inf")  # side b empty on two rows: row 1 empty on both
    oa[0, :2, 0] = 0
    ob[0, 1:3, 0] = 0

    def merged(o1, l1, o2, l2):
        out = torch.full((B, S + 2, H, D), float("nan"), device=device)[:, 1:-1]  # strided
        out.copy_(o1)
        lse = l1.clone()
        merge_attention(out, lse, o2, l2)
        return out, lse

    out_ab, lse_ab = merged(oa, la, ob, lb)
    out_ba, lse_ba = merged(ob.float(), lb, oa, la)
    torch.testing.assert_close(out_ab, out_ba, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_ab, lse_ba, rtol=0, atol=0)
    # float64 reference
    l64 = torch.logaddexp(la.double(), lb.double())
    w_a = torch.exp(la.double() - l64).nan_to_num(0).transpose(1, 2)[..., None]
    w_b = torch.exp(lb.double() - l64).nan_to_num(0).transpose(1, 2)[..., None]
    o64 = oa.double() * w_a + ob.double() * w_b
    torch.testing.assert_close(out_ab.double(), o64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse_ab.double(), l64, rtol=1e-6, atol=1e-6)
    # one side empty: the other passes through exactly; both empty: 0 and -inf
    assert torch.equal(out_ab[0, 0, 0], ob[0, 0, 0].float())
    assert torch.equal(lse_ab[0, 0, 0], lb[0, 0, 0])
    assert torch.equal(out_ab[0, 2, 0], oa[0, 2, 0]) and torch.equal(lse_ab[0, 0, 2], la[0, 0, 2])
    assert torch.equal(out_ab[0, 1, 0], torch.zeros(D, device=device))
    assert lse_ab[0, 0, 1] == float("-inf")
    assert not torch.isnan(out_ab).any()


def test_merge_is_exact_symmetric_and_nan_free():
    check_merge(2, 5, 3, 24, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("block_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_merge_gpu(block_dtype):
    check_merge(2, 4099, 8, 128, block_dtype, device="cuda")


# --- the virtual ring: the ring's loops over W ranks on one device ----------------------


def check_virtual_ring(
    W, B, chunk, Hkv, group, D, causal, layout, dtype, seed, device="cpu", split_below=None, Dv=None
):
    """virtual_ring_attn against float64 full attention: output, LSE, every gradient,
    with the loops' own buffers (and the GQA split's partials) poisoned with NaN first.
    Inputs are strided windows of longer sequences."""
    S = chunk * (2 * W if layout == "zigzag" else W)
    Hq = Hkv * group

    def strided(shape, offset):
        full = randn((shape[0], shape[1] + 2, *shape[2:]), dtype, seed + offset)
        return full.to(device)[:, 2:]

    Dv = D if Dv is None else Dv
    q, k, v = strided((B, S, Hq, D), 0), strided((B, S, Hkv, D), 1), strided((B, S, Hkv, Dv), 2)
    dout = randn((B, S, Hq, Dv), dtype, seed + 3).to(device)
    dlse = randn((B, Hq, S), torch.float32, seed + 4).to(device)

    def nan_fresh(shape, device, dtype=torch.float32):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ring_attention, "_fresh", nan_fresh)
        force_split(mp, split_below)

        def ring(*t):
            return virtual_ring_attn(*t, W, causal=causal, layout=layout, return_lse=True)

        got = attention_grads(ring, (q, k, v), dout, dlse)
    ref = attention_grads(
        lambda *t: attention_reference(*t, AttentionMask(causal)),
        [t.double() for t in (q, k, v)],
        dout,
        dlse,
    )
    same = torch_results((q, k, v), dout, dlse, ref, causal)
    for name, g, r, t in zip(("out", "lse", "dq", "dk", "dv"), got, ref, same, strict=True):
        assert g.dtype == (torch.float32 if name == "lse" else dtype), name
        length = max(D, Dv)
        assert_close(g, r, t, name=name, sum_length=length if name.startswith("d") else None)


# The interpreter runs a ring's W * W blocks x 3 kernels program by program (about 30 ms
# each on 2 cores): one batch, at most 4 query heads, and fewer examples keep this ~20 s.
@settings(max_examples=4)
@given(
    W=st.integers(2, 4),
    chunk=st.integers(1, 7),
    heads=st.sampled_from([(1, 1), (1, 2), (1, 3), (2, 2)]),
    D=st.sampled_from([8, 16, 40]),
    causal=st.booleans(),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    dtype=cpu_dtypes(),
    seed=seeds(),
    split_below=st.sampled_from([None, 10**6]),
    Dv=st.sampled_from([None, 8]),
)
@example(
    W=4,
    chunk=3,
    heads=(1, 3),
    D=16,
    causal=True,
    layout="zigzag",
    dtype=torch.float32,
    seed=0,
    split_below=10**6,
    Dv=8,
)  # MQA, split dK/dV, V narrower
@example(
    W=3,
    chunk=5,
    heads=(2, 2),
    D=40,
    causal=True,
    layout="contiguous",
    dtype=torch.float16,
    seed=1,
    split_below=None,
    Dv=None,
)  # hidden blocks
def test_virtual_ring_matches_full_attention(
    triton_kernels, W, chunk, heads, D, causal, layout, dtype, seed, split_below, Dv
):
    check_virtual_ring(
        W, 1, chunk, *heads, D, causal, layout, dtype, seed, split_below=split_below, Dv=Dv
    )


def test_virtual_ring_batches():
    check_virtual_ring(2, 2, 3, 1, 2, 16, True, "zigzag", torch.float32, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "W, layout, causal",
    [
        (2, "zigzag", True),
        (4, "zigzag", True),
        (8, "zigzag", True),
        (4, "contiguous", True),
        (4, "zigzag", False),
    ],
)
def test_virtual_ring_gpu(W, layout, causal, dtype):
    """4096 tokens, 8 query heads over 2 KV heads, D = 128 (the default GQA split)."""
    chunk = 4096 // (2 * W if layout == "zigzag" else W)
    check_virtual_ring(W, 1, chunk, 2, 4, 128, causal, layout, dtype, seed=5, device="cuda")


def test_virtual_ring_one_rank_is_flash_attn():
    q = randn((2, 7, 4, 16), torch.float32, 0)
    k, v = randn((2, 7, 2, 16), torch.float32, 1), randn((2, 7, 2, 16), torch.float32, 2)
    for causal in (False, True):
        assert torch.equal(
            virtual_ring_attn(q, k, v, 1, causal=causal), fp.flash_attn(q, k, v, causal=causal)
        )


def test_virtual_ring_transport():
    ring = VirtualRing(3)
    sent = [[torch.full((2,), float(r))] for r in range(3)]
    received = ring.send_recv(sent)
    sent[0][0].fill_(7)  # a send is a copy: later writes do not travel
    assert ring.wait() is received
    assert [t[0].tolist() for t in received] == [[2.0, 2.0], [0.0, 0.0], [1.0, 1.0]]
    with pytest.raises(RuntimeError, match="no send_recv"):
        ring.wait()
    ring.send_recv(sent)
    with pytest.raises(RuntimeError, match="before wait"):
        ring.send_recv(sent)


@pytest.mark.parametrize(
    "shapes, world_size, layout, match",
    [
        (((1, 12, 2, 8), (1, 12, 2, 8)), 0, "zigzag", "world_size must be an int >= 1, got 0"),
        (((1, 12, 2, 8), (1, 12, 2, 8)), 4, "zigzag", "12 must be divisible by 8"),
        (((1, 12, 2, 8), (1, 10, 2, 8)), 2, "zigzag", "12 tokens, k and v have 10"),
        (((1, 3, 2, 8), (1, 3, 2, 8)), 4, "contiguous", "3 tokens cannot fill the 4 chunks"),
        (((1, 12, 2, 8), (1, 12, 2, 8)), 2, "spiral", "spiral"),
    ],
)
def test_virtual_ring_bad_input(shapes, world_size, layout, match):
    q, k = torch.ones(shapes[0]), torch.ones(shapes[1])
    with pytest.raises(ValueError, match=match):
        virtual_ring_attn(q, k, k, world_size, layout=layout)


# --- bad input ----------------------------------------------------------------------------


def _run_bad(case):
    rank = dist.get_rank()
    S = {"odd zigzag": 3, "ranks disagree": 4 + 2 * rank}.get(case, 4)
    q = torch.ones(1, S, 2, 8)
    k = torch.ones(1, S + (1 if case == "q/k lengths" else 0), 2, 8)
    layout = "spiral" if case == "layout" else "zigzag"
    fp.ring_attn(q, k, k, WORLD, causal=True, layout=layout)


@pytest.mark.parametrize(
    "case, match",
    [
        ("odd zigzag", r"2W = 4.*3 tokens"),
        ("layout", "spiral"),
        ("q/k lengths", "4 local tokens.*5"),
        ("ranks disagree", "disagree"),
    ],
)
def test_bad_input_fails_on_every_rank(world, case, match):
    for e in world(2).run(exception_of, _run_bad, case):
        assert isinstance(e, ValueError) and re.search(match, str(e)), repr(e)


def test_helper_bad_lengths():
    with pytest.raises(ValueError, match="layout"):
        fp.sequence_positions(8, None, layout="spiral")


# --- the ring benchmark's GPU part, run on CPU --------------------------------------------


def test_the_ring_benchmarks_gpu_part_runs_on_cpu(monkeypatch):
    """The virtual ring against flash_attn through the benchmark's own code (tiny shapes,
    fp32, the interpreter, timers replaced): rows, ratios and the torch block's merge."""
    import bench.ring_attention as bench

    monkeypatch.setattr(bench, "GPU_SHAPE", {"batch": 1, "heads": 2, "kv_heads": 1, "head_dim": 16})
    monkeypatch.setattr(bench, "GPU_WORLDS", (2,))
    monkeypatch.setattr(bench, "GPU_SEQ_LENS", (4, 8))
    monkeypatch.setattr(bench, "GPU_DTYPE", torch.float32)
    monkeypatch.setenv("BENCH_QUICK", "1")  # the last length only
    monkeypatch.setattr(bench, "time_ms", lambda fn, **kw: (fn(), 2.0)[1])
    rows = bench.gpu_virtual_ring(device="cpu")
    assert [(r["seq_len"], r["causal"], r["world"]) for r in rows] == [
        (8, False, 1),
        (8, False, 2),
        (8, True, 1),
        (8, True, 2),
    ]
    assert all(r["fwd_vs_flash"] == r["fwd_bwd_vs_flash"] == 1.0 for r in rows if r["world"] > 1)
    # the CPU part's torch block merges like the kernel's epilogue
    q, k, v = (randn((1, 6, 2, 8), torch.float32, i) for i in range(3))
    # key 0 is visible to every row; the rest, bottom-right aligned, is the causal part
    out, lse = bench.torch_attend(q, k[:, :1], v[:, :1], AttentionMask())
    bench.torch_attend(
        q, k[:, 1:], v[:, 1:], AttentionMask(causal=True), out=out, lse=lse, merge=True
    )
    full = attention_reference(q, k, v, AttentionMask(causal=True))
    torch.testing.assert_close((out, lse), full, rtol=1e-5, atol=1e-6)
