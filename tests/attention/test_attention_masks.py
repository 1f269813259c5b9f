"""Masks in global coordinates: sliding windows, soft-capping and packed documents in
`fp.flash_attn` and `fp.flash_attn_varlen`, against a float64 reference whose mask is
a dense ``same_document & causal & in_window`` matrix (`visible_reference`, built
independently of the kernels' intervals), forward and every gradient, with the
tolerance rule of DESIGN; `flash_attn_varlen` also against a loop of `flash_attn` over
the documents. Block skipping is checked by poisoning the keys a window excludes with
NaN: a kernel that read them, even masked, would give NaN.
"""

import pytest
import torch
from fusedpar.kernels.attention import AttentionMask, attention_reference, visible_reference
from fusedpar.kernels.common import TensorCache
from hypothesis import example, given
from hypothesis import strategies as st

import fusedpar as fp
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds
from tests.attention.helpers import attention_grads, check_attention, torch_results

# Triton's kernels unless a test runs on each implementation (`each_implementation`).
pytestmark = pytest.mark.usefixtures("triton_kernels")

# window sides: -1 (unbounded), 0, 1, shorter than a block, longer than any sequence here
SIDES = st.sampled_from([-1, 0, 1, 3, 17, 500])
SOFTCAPS = st.sampled_from([0.0, 0.0, 0.5, 4.0])  # 0 (no cap) half the time


@given(
    B=st.integers(1, 2),
    Sq=st.integers(1, 70),
    Skv=st.integers(1, 70),
    Hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    D=st.sampled_from([8, 16, 40, 64]),
    causal=st.booleans(),
    left=SIDES,
    right=SIDES,
    softcap=SOFTCAPS,
    dtype=cpu_dtypes(),
    seed=seeds(),
)
@example(
    B=1,
    Sq=64,
    Skv=64,
    Hkv=1,
    group=2,
    D=16,
    causal=True,
    left=0,
    right=-1,
    softcap=0.0,
    dtype=torch.float32,
    seed=0,
)  # window 0: the diagonal only
@example(
    B=2,
    Sq=33,
    Skv=70,
    Hkv=2,
    group=1,
    D=40,
    causal=False,
    left=3,
    right=1,
    softcap=4.0,
    dtype=torch.float16,
    seed=1,
)  # a band, bottom-right aligned, capped
@example(
    B=1,
    Sq=70,
    Skv=20,
    Hkv=1,
    group=3,
    D=8,
    causal=True,
    left=1,
    right=-1,
    softcap=0.5,
    dtype=torch.float32,
    seed=2,
)  # Sq > Skv: rows with no key
def test_window_and_softcap_match_float64(
    B, Sq, Skv, Hkv, group, D, causal, left, right, softcap, dtype, seed, each_implementation
):
    check_attention(
        B, Sq, Skv, Hkv * group, Hkv, D, causal, dtype, seed, window=(left, right), softcap=softcap
    )


def test_a_window_longer_than_the_sequence_is_plain_causal(each_implementation):
    q, k, v = (randn((1, 40, 2, 16), torch.float32, i) for i in range(3))
    plain = fp.flash_attn(q, k, v, causal=True)
    assert torch.equal(fp.flash_attn(q, k, v, causal=True, window=(40, 0)), plain)
    assert torch.equal(fp.flash_attn(q, k, v, causal=True, window=(-1, 5)), plain)


# --- packed documents ---------------------------------------------------------------------

LENGTHS = st.lists(st.integers(0, 30), min_size=1, max_size=5).filter(lambda ls: sum(ls) > 0)


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def check_varlen(lengths_q, lengths_k, Hq, Hkv, D, causal, window, softcap, dtype, seed):
    cu_q, cu_k = cu_of(lengths_q), cu_of(lengths_k)
    Tq, Tk = sum(lengths_q), sum(lengths_k)
    q = randn((Tq, Hq, D), dtype, seed)
    k, v = randn((Tk, Hkv, D), dtype, seed + 1), randn((Tk, Hkv, D), dtype, seed + 2)
    dout, dlse = randn((1, Tq, Hq, D), dtype, seed + 3), randn((1, Hq, Tq), torch.float32, seed + 4)
    mask = dict(causal=causal, window=window, softcap=softcap)

    def ours(q, k, v):
        out, lse = fp.flash_attn_varlen(q[0], k[0], v[0], cu_q, cu_k, return_lse=True, **mask)
        assert out.shape == (Tq, Hq, D) and lse.shape == (Hq, Tq)
        return out[None], lse[None]

    visible = visible_reference(cu_q, cu_k, causal=causal, window=window)
    packed = [t[None] for t in (q, k, v)]
    got = attention_grads(ours, packed, dout, dlse)
    ref = attention_grads(
        lambda *t: attention_reference(*t, AttentionMask(softcap=softcap), visible),
        [t.double() for t in packed],
        dout,
        dlse,
    )
    same = torch_results(packed, dout, dlse, ref, softcap=softcap, visible=visible)
    for name, g, r, t in zip(("out", "lse", "dq", "dk", "dv"), got, ref, same, strict=True):
        assert_close(g, r, t, name=name, sum_length=D if name.startswith("d") else None)
    return got


def per_document(lengths_q, lengths_k, q, k, v, **mask):
    """`flash_attn` on each document alone, concatenated (rows of a document with no keys
    give 0, as in the packed call)."""
    outs, start_q, start_k = [], 0, 0
    for lq, lk in zip(lengths_q, lengths_k, strict=True):
        piece = [
            q[:, start_q : start_q + lq],
            k[:, start_k : start_k + lk],
            v[:, start_k : start_k + lk],
        ]
        if lq:
            outs.append(fp.flash_attn(*piece, **mask) if lk else torch.zeros_like(piece[0]))
        start_q, start_k = start_q + lq, start_k + lk
    return torch.cat(outs, dim=1)


@st.composite
def documents(draw):
    """Query lengths per document, and key lengths: the same, or drawn too (then a
    document's queries align bottom-right to its keys)."""
    lengths = draw(LENGTHS)
    if not draw(st.booleans()):
        return lengths, lengths
    same_count = st.lists(st.integers(0, 30), min_size=len(lengths), max_size=len(lengths))
    return lengths, draw(same_count.filter(lambda ls: sum(ls) > 0))


@given(
    docs=documents(),
    Hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    D=st.sampled_from([8, 16, 40]),
    causal=st.booleans(),
    left=SIDES,
    right=SIDES,
    softcap=SOFTCAPS,
    dtype=cpu_dtypes(),
    seed=seeds(),
)
# zero-length and one-token documents
@example(
    docs=([5, 0, 37, 1, 20],) * 2,
    Hkv=1,
    group=2,
    D=16,
    causal=True,
    left=-1,
    right=-1,
    softcap=0.0,
    dtype=torch.float32,
    seed=0,
)
def test_varlen_matches_float64_and_a_loop_over_documents(
    docs, Hkv, group, D, causal, left, right, softcap, dtype, seed, each_implementation
):
    lengths, lengths_k = docs
    mask = dict(causal=causal, window=(left, right), softcap=softcap)
    got = check_varlen(lengths, lengths_k, Hkv * group, Hkv, D, dtype=dtype, seed=seed, **mask)
    q = randn((1, sum(lengths), Hkv * group, D), dtype, seed)
    k = randn((1, sum(lengths_k), Hkv, D), dtype, seed + 1)
    v = randn((1, sum(lengths_k), Hkv, D), dtype, seed + 2)
    loop = per_document(lengths, lengths_k, q, k, v, **mask)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got[0], loop, rtol=tol, atol=tol)


def test_max_seqlen_is_never_read():
    q, k, v = (randn((12, 2, 8), torch.float32, i) for i in range(3))
    cu = cu_of([5, 7])
    expected = fp.flash_attn_varlen(q, k, v, cu, causal=True)
    assert torch.equal(
        fp.flash_attn_varlen(q, k, v, cu, max_seqlen_q=1, max_seqlen_k=1, causal=True), expected
    )


def test_rows_whose_keys_start_in_a_later_block_keep_their_scale(each_implementation):
    """A document starting inside a query block (rows 64..127, the second starting at
    100): its rows see nothing in the first key block visited (0..63), then scores far
    below 0. The running max must not stand in as 0 for them (p = e^-30 underflows fp16
    in the P V product and the output would vanish)."""
    cu = cu_of([100, 28])
    q = randn((128, 1, 16), torch.float16, 0, scale=1.5)
    k = (-q).clone()  # the diagonal scores -|q|^2, about -36
    v = randn((128, 1, 16), torch.float16, 2)
    out = fp.flash_attn_varlen(q, k, v, cu, causal=True, softmax_scale=1.0)
    visible = visible_reference(cu, cu, causal=True, window=(-1, -1))
    unit = AttentionMask(softmax_scale=1.0)
    ref, _ = attention_reference(*(t[None].double() for t in (q, k, v)), unit, visible)
    same, _ = attention_reference(*(t[None] for t in (q, k, v)), unit, visible)
    assert_close(out[None], ref, same, name="out")


# --- block skipping -----------------------------------------------------------------------


def test_a_window_reads_only_the_blocks_it_sees():
    """64 queries at the end of 512 keys (bottom-right: query i at key 448 + i) with a
    window of 8 see keys 440..511. Keys 0..383 (six of the interpreter's 64-key blocks)
    are NaN: forward, dQ and dK/dV stay finite and exact, so no kernel read them; the
    gradient of a key no query sees is 0. A window of w touches O(w) keys, not O(S)."""
    q = randn((1, 64, 2, 16), torch.float32, 0)
    k, v = randn((1, 512, 1, 16), torch.float32, 1), randn((1, 512, 1, 16), torch.float32, 2)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[:, :384] = float("nan")
    poisoned_v[:, :384] = float("nan")
    dout = randn((1, 64, 2, 16), torch.float32, 3)
    inputs = [t.clone().requires_grad_() for t in (q, poisoned_k, poisoned_v)]
    out = fp.flash_attn(*inputs, causal=True, window=(8, 0))
    (out * dout).sum().backward()
    clean = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = fp.flash_attn(*clean, causal=True, window=(8, 0))
    (expected * dout).sum().backward()
    assert torch.equal(out, expected)
    for got, want in zip(inputs, clean, strict=True):
        assert torch.isfinite(got.grad).all()
        assert torch.equal(got.grad, want.grad)
    assert not inputs[1].grad[:, :440].any() and not inputs[2].grad[:, :440].any()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the NaN documents' own rows
def test_documents_read_only_their_own_blocks():
    """The same for packed documents: a 64-token document after 448 tokens of others,
    which are NaN, gives the same result as the document alone."""
    tokens = [randn((512, 2, 16), torch.float32, i) for i in range(3)]
    for t in tokens:
        t[:384] = float("nan")
    cu = cu_of([448, 64])
    out = fp.flash_attn_varlen(*tokens, cu, causal=True)
    alone = fp.flash_attn(*(t[None, 448:] for t in tokens), causal=True)[0]
    assert torch.equal(out[448:], alone)


# --- bad input ----------------------------------------------------------------------------


def _qkv(T=6):
    return [randn((T, 2, 8), torch.float32, i) for i in range(3)]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"window": (-2, 0)}, ValueError, r"-1 \(unbounded\) or >= 0"),
        ({"window": (3,)}, TypeError, "a pair"),
        ({"window": (1.5, 0)}, TypeError, "ints"),
        ({"softcap": -1.0}, ValueError, "softcap must be >= 0 and finite"),
        ({"softcap": float("nan")}, ValueError, "softcap must be >= 0 and finite"),
        ({"softcap": float("inf")}, ValueError, "softcap must be >= 0 and finite"),
    ],
)
def test_bad_window_or_softcap(kwargs, error, match):
    q, k, v = (t[None] for t in _qkv())
    with pytest.raises(error, match=match):
        fp.flash_attn(q, k, v, **kwargs)
    with pytest.raises(error, match=match):
        fp.flash_attn_varlen(*_qkv(), cu_of([6]), **kwargs)


@pytest.mark.parametrize(
    "cu, error, match",
    [
        (torch.tensor([0, 6]), TypeError, "must be int32"),
        (torch.tensor([1, 6], dtype=torch.int32), ValueError, "start at 0"),
        (torch.tensor([0, 4, 2, 6], dtype=torch.int32), ValueError, "not decrease"),
        (torch.tensor([0, 5], dtype=torch.int32), ValueError, "end at the total length 6"),
        (torch.tensor([[0, 6]], dtype=torch.int32), ValueError, "1-D"),
    ],
)
def test_bad_cu_seqlens(cu, error, match):
    with pytest.raises(error, match=match):
        fp.flash_attn_varlen(*_qkv(), cu)
    with pytest.raises(error, match=match):
        fp.sequence_positions(6, None, cu_seqlens=cu)


def test_varlen_shapes_and_document_counts():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"packed \(T, H, D\)"):
        fp.flash_attn_varlen(q[None], k, v, cu_of([6]))
    with pytest.raises(ValueError, match="describe 1 and 2 documents"):
        fp.flash_attn_varlen(q, k, v, cu_of([6]), cu_of([3, 3]))


def test_positions_restart_in_every_document():
    cu = cu_of([3, 0, 4, 1])
    assert fp.sequence_positions(8, None, cu_seqlens=cu).tolist() == [0, 1, 2, 0, 1, 2, 3, 0]


def test_packed_masks_are_built_once_per_cu_seqlens(monkeypatch):
    """A model's layers pass the same cu_seqlens forward and backward: the values are read
    (a host sync on a GPU) and the intervals built once for them. A tensor written in
    place, or a new one, builds anew; the results are those of a fresh build."""
    import fusedpar.ops.attention as ops

    calls = {"built": 0, "checked": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += kwargs.get("values", True)  # (the values' reads: the shapes' are free)
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(ops, "packed_intervals", counted("built", ops.packed_intervals))
    monkeypatch.setattr(ops, "check_cu_seqlens", counted("checked", ops.check_cu_seqlens))
    monkeypatch.setattr(ops, "_PACKED", TensorCache(8))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(20, 2, 16, generator=gen, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)

    def run(cu_seqlens):
        out = fp.flash_attn_varlen(q, k, v, cu_seqlens, causal=True)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        return out.detach(), grads

    first = run(cu)
    assert calls == {"built": 1, "checked": 2}  # forward; the backward took the same
    again = run(cu)
    assert calls == {"built": 1, "checked": 2} and torch.equal(first[0], again[0])
    cu.copy_(torch.tensor([0, 12, 20], dtype=torch.int32))  # written in place: built anew
    moved = run(cu)
    assert calls == {"built": 2, "checked": 4} and not torch.equal(moved[0], first[0])
    fresh = run(torch.tensor([0, 12, 20], dtype=torch.int32))  # a new tensor: built anew
    assert calls["built"] == 3 and torch.equal(fresh[0], moved[0])
    assert all(torch.equal(a, b) for a, b in zip(fresh[1], moved[1], strict=True))


def test_the_widest_query_chunks_run_first():
    """`query_order` over 128-row chunks of a stream whose first document is the longest:
    the chunk that ends it (and straddles two more) sees the widest key span, the first
    chunk less, the last chunk (a short document) least. The forward gives bitwise the
    same in that order, last rows first (no order) and any other (each program writes
    only its own rows); with the interpreter's 64-row tiles a chunk is 2 programs, and
    the last chunk's second (rows 448 to 511) writes nothing."""
    import dataclasses

    from fusedpar.kernels.attention import AttentionMask, attention_forward, packed_intervals

    cu = torch.tensor([0, 300, 340, 400], dtype=torch.int32)
    packed = packed_intervals(cu, cu, 400, 400, causal=True, window=(-1, -1))
    # widths: rows 0-127 see keys [0, 128); 128-255 [0, 256); 256-383 [0, 384); 384-399 [340, 400)
    assert packed.q_order.tolist() == [2, 1, 0, 3]
    q, k, v = (randn((1, 400, 2, 16), torch.float32, i) for i in range(3))
    results = [
        attention_forward(
            q, k, v, AttentionMask(intervals=dataclasses.replace(packed, q_order=order))
        )
        for order in (packed.q_order, None, torch.tensor([3, 0, 2, 1], dtype=torch.int32))
    ]
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    bad = dataclasses.replace(packed, q_order=packed.q_order[:3])
    with pytest.raises(ValueError, match=r"q_order must be contiguous int32 \(4,\)"):
        attention_forward(q, k, v, AttentionMask(intervals=bad))


def test_every_forward_tile_splits_an_order_chunk():
    """The forward maps a program to a chunk of ORDER_CHUNK rows and a block in it:
    every tile's BLOCK_M must divide the chunk."""
    from fusedpar.kernels.attention import INTERPRETER_MAX_BLOCK, ORDER_CHUNK, forward_configs

    for D in (64, 128, 256):
        for dtype in (torch.bfloat16, torch.float32):
            for modes in (frozenset(), frozenset({"pointer", "softcap"})):
                for config in forward_configs(D, dtype, modes):
                    assert ORDER_CHUNK % config.kwargs["BLOCK_M"] == 0, (D, dtype, config)
    assert ORDER_CHUNK % INTERPRETER_MAX_BLOCK == 0


def test_causal_reads_any_truthy_value_but_not_a_tensor():
    # as before the mask existed: `causal=1` is causal, `causal=0` is not
    assert AttentionMask(causal=1).causal is True and AttentionMask(causal=0).causal is False
    q, k, v = (randn((1, 9, 2, 8), torch.float32, seed=i) for i in range(3))
    assert torch.equal(fp.flash_attn(q, k, v, causal=1), fp.flash_attn(q, k, v, causal=True))
    with pytest.raises(TypeError, match="Python bool, not a tensor"):
        AttentionMask(causal=torch.tensor(True))
