"""Packed documents, sliding windows and soft-capping across the ring: `fp.ring_attn` at
W = 2 and 4, zigzag and contiguous, against the float64 reference over the whole packed
stream and single-device `flash_attn_varlen`; documents of any length (0, 1, not
dividing by 2W, one spanning every rank), no padding. Ring steps that no query can see
launch nothing; `ParallelAttention(sliding_window=, softcap=)` with packed documents
has Hugging Face's meaning of the window, under CP too."""

import pytest
import torch
import torch.distributed as dist
from fusedpar.kernels.attention import (
    AttentionMask,
    attention_forward,
    attention_reference,
    visible_reference,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fusedpar as fp
from fusedpar.ops import ring_attention, ring_masks
from fusedpar.ops.ring_transport import VirtualRing
from fusedpar.ops.sequence import _shard
from fusedpar.testing import assert_close, exception_of
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds
from tests.attention.helpers import attention_grads, torch_results

WORLD = dist.group.WORLD


def _cu(lengths):
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def _run_packed_ring(p):
    layout, dtype = p["layout"], p["dtype"]
    cu = _cu(p["lengths"])
    T, Hq, Hkv, D = int(cu[-1]), p["Hkv"] * p["group"], p["Hkv"], p["D"]
    mask = dict(causal=p["causal"], window=p["window"], softcap=p["softcap"])
    exact = {"exact_in": dtype}
    q = randn((1, T, Hq, D), torch.float64, p["seed"], **exact)
    k, v = (randn((1, T, Hkv, D), torch.float64, p["seed"] + i, **exact) for i in (1, 2))
    dout = randn((1, T, Hq, D), torch.float64, p["seed"] + 3, **exact)
    dlse = randn((1, Hq, T), torch.float64, p["seed"] + 4, exact_in=torch.float32)

    def shard(t, dim=1):
        return fp.shard_sequence(t, WORLD, dim=dim, layout=layout)

    def ring(*t):
        return fp.ring_attn(*t, WORLD, layout=layout, cu_seqlens=cu, return_lse=True, **mask)

    got = attention_grads(
        ring, [shard(t).to(dtype) for t in (q, k, v)], shard(dout), shard(dlse, dim=2)
    )
    visible = visible_reference(cu, cu, causal=p["causal"], window=p["window"])
    ref = attention_grads(
        lambda *t: attention_reference(*t, AttentionMask(softcap=p["softcap"]), visible),
        (q, k, v),
        dout,
        dlse,
    )
    full = [t.to(dtype) for t in (q, k, v)]
    same = torch_results(full, dout, dlse, ref, softcap=p["softcap"], visible=visible)

    def varlen(*t):
        out, lse = fp.flash_attn_varlen(*(x[0] for x in t), cu, return_lse=True, **mask)
        return out[None], lse[None]

    single = attention_grads(varlen, full, dout, dlse)
    close = 1e-4 if dtype == torch.float32 else 1e-2  # the same sums in another order
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        dim = 2 if name == "lse" else 1
        r, t, s = shard(ref[i], dim), shard(same[i], dim), shard(single[i], dim)
        assert_close(got[i], r, t, name=name, sum_length=D if name.startswith("d") else None)
        torch.testing.assert_close(got[i], s, rtol=close, atol=close)
    return True


@st.composite
def packed(draw):
    """A world size, a layout and documents filling whole chunks: lengths of 0, 1, and
    ones that do not divide by 2W; one of them may span every rank."""
    size = draw(st.sampled_from([2, 4]))
    layout = draw(st.sampled_from(["zigzag", "contiguous"]))
    chunks = 2 * size if layout == "zigzag" else size
    total = chunks * draw(st.integers(1, 6))
    cuts = sorted(draw(st.lists(st.integers(0, total), max_size=4)))
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    return size, layout, lengths


# W * W blocks x 3 kernels in the interpreter, program by program: few examples.
@settings(max_examples=6)
@given(
    setup=packed(),
    Hkv=st.integers(1, 2),
    group=st.integers(1, 2),
    D=st.sampled_from([8, 16]),
    causal=st.booleans(),
    left=st.sampled_from([-1, 0, 1, 3, 9, 100]),
    right=st.sampled_from([-1, 0, 2]),
    softcap=st.sampled_from([0.0, 2.0]),
    dtype=cpu_dtypes(),
    seed=seeds(),
)
# one document spanning all four ranks, a window spanning several chunks
@example(
    setup=(4, "zigzag", [3, 0, 29]),
    Hkv=1,
    group=2,
    D=16,
    causal=True,
    left=9,
    right=-1,
    softcap=0.0,
    dtype=torch.float32,
    seed=0,
)
@example(
    setup=(2, "contiguous", [1, 5, 6]),
    Hkv=2,
    group=1,
    D=8,
    causal=False,
    left=1,
    right=2,
    softcap=2.0,
    dtype=torch.float16,
    seed=1,
)
def test_packed_ring_matches_the_whole_stream(world, setup, causal, left, right, **p):
    size, layout, lengths = setup
    p.update(layout=layout, lengths=lengths, causal=causal, window=(left, right))
    assert all(world(size).run(_run_packed_ring, p))


# --- skipped steps ------------------------------------------------------------------------


def _launches(W, layout, chunk, **mask):
    """Blocks each rank computes in the ring's forward loop (tuning launches aside)."""
    S = chunk * (2 * W if layout == "zigzag" else W)
    q = randn((1, S, 1, 8), torch.float32, 0)
    shards = [_shard(q, r, W, 1, layout) for r in range(W)]
    masks = ring_masks.ring_masks(range(W), W, layout, S // W, "cpu", fp.AttentionMask(**mask))
    counts = [0] * W

    def counting(q_rank, *args, **kw):
        if not kw["launch_as"].tune_only:
            counts[next(i for i, s in enumerate(shards) if s is q_rank)] += 1
        return attention_forward(q_rank, *args, **kw)

    ring_attention.forward_schedule(
        shards,
        shards,
        shards,
        VirtualRing(W),
        masks,
        attend=counting,
    )
    return counts


def test_a_window_computes_only_the_steps_it_reaches():
    """W = 8: a causal window shorter than a chunk reaches only the previous chunk, so
    each rank computes at most 2 of its 8 steps (contiguous) or 3 (zigzag: two chunks
    each); without the window, causal zigzag computes every step."""
    assert _launches(8, "contiguous", 4, causal=True, window=(3, 0)) == [1] + [2] * 7
    assert max(_launches(8, "zigzag", 4, causal=True, window=(3, 0))) <= 3
    assert _launches(8, "zigzag", 4, causal=True, window=(-1, -1)) == [8] * 8
    # a window of two chunks reaches two steps back
    assert _launches(8, "contiguous", 4, causal=True, window=(8, 0)) == [1, 2] + [3] * 6


# --- bad input ----------------------------------------------------------------------------


def _bad_ring_input(case):
    q = randn((2 if case == "batch" else 1, 4, 2, 8), torch.float32, dist.get_rank())
    cu = {"batch": _cu([8]), "end": _cu([7]), "dtype": torch.tensor([0, 8])}[case]
    fp.ring_attn(q, q, q, WORLD, causal=True, cu_seqlens=cu)


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("batch", ValueError, "one batch row"),
        ("end", ValueError, "end at the total length 8"),
        ("dtype", TypeError, "int32"),
    ],
)
def test_bad_packed_input_fails_on_every_rank(world, case, error, match):
    raised = world(2).run(exception_of, _bad_ring_input, case)
    assert all(isinstance(e, error) and match in str(e) for e in raised), raised


# --- the layer ----------------------------------------------------------------------------

D_MODEL, HEADS, KV_HEADS, WINDOW, SOFTCAP = 32, 4, 2, 5, 3.0
LENGTHS = [3, 9, 0, 12]  # 24 tokens: zigzag over 2 ranks is 4 chunks of 6


def _layer(cp_group):
    torch.manual_seed(0)
    return fp.nn.ParallelAttention(
        D_MODEL, HEADS, KV_HEADS, sliding_window=WINDOW, softcap=SOFTCAP, cp_group=cp_group
    )


def _dense_packed(layer, x, cu):
    """The layer's math in plain float64: RoPE positions restarting per document, and
    Hugging Face's sliding window (key j visible to query i when i - W < j <= i). (Its
    float64 rotation runs on torch's implementation, whatever the caller asked for:
    Triton's kernels refuse float64.)"""
    T, hd, x = x.shape[0], layer.head_dim, x.double()
    q, k, v = (
        torch.nn.functional.linear(x[:, 0], w.double()).view(T, -1, hd)
        for w in (layer.q_weight, layer.k_weight, layer.v_weight)
    )
    positions = fp.sequence_positions(T, None, cu_seqlens=cu)
    cos, sin = fp.nn.attention.rope_tables(positions, hd, layer.rope_theta, torch.float64)
    with fp.implementation("torch"):
        q, k = (fp.nn.attention.apply_rope(t[None], cos, sin) for t in (q, k))
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    doc = torch.searchsorted(cu.long(), torch.arange(T), right=True)
    visible = (doc[:, None] == doc[None, :]) & (j <= i) & (j > i - WINDOW)
    out, _ = attention_reference(q, k, v[None], AttentionMask(softcap=SOFTCAP), visible)
    return torch.nn.functional.linear(out.reshape(T, 1, -1), layer.o_weight.double())


def _run_layer(x, cu):
    layer = _layer(WORLD)
    with torch.no_grad():
        local = fp.shard_sequence(x, WORLD, dim=0)
        return fp.gather_sequence(layer(local, cu_seqlens=cu), WORLD, dim=0)


def test_layer_window_softcap_and_documents(world, triton_kernels):
    """HF's sliding_window=W is window (W - 1, 0); documents restart RoPE. One process
    against the dense float64 math, then CP = 2 against one process."""
    cu = _cu(LENGTHS)
    x = torch.randn(24, 1, D_MODEL)
    layer = _layer(None)
    assert layer.window == (WINDOW - 1, 0)
    with torch.no_grad():
        single = layer(x, cu_seqlens=cu)
        dense = _dense_packed(layer, x, cu)
    torch.testing.assert_close(single.double(), dense, rtol=1e-5, atol=1e-5)
    for got in world(2).run(_run_layer, x, cu):
        torch.testing.assert_close(got, single, rtol=1e-5, atol=1e-5)


def test_layer_refuses_bad_options():
    with pytest.raises(ValueError, match="W >= 1"):
        fp.nn.ParallelAttention(D_MODEL, HEADS, sliding_window=0)
    with pytest.raises(ValueError, match="causal=False"):
        fp.nn.ParallelAttention(D_MODEL, HEADS, sliding_window=4, causal=False)
    with pytest.raises(ValueError, match="softcap must be > 0"):
        fp.nn.ParallelAttention(D_MODEL, HEADS, softcap=-1.0)
    layer = fp.nn.ParallelAttention(D_MODEL, HEADS)
    with pytest.raises(ValueError, match="got batch 2"):
        layer(torch.randn(4, 2, D_MODEL), cu_seqlens=_cu([4]))
