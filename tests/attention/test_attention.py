"""fp.flash_attn against a float64 reference: output, LSE, dQ, dK, dV; and the kernels
in the modes the ring drives them (fp32 partials, merge epilogue, fresh and accumulating
gradients, the GQA split).

Tolerance (DESIGN): twice plain PyTorch's own error in the same dtype, plus a floor.
The LSE gets an upstream gradient too, so its backward path is checked with the rest.
"""

import math

import pytest
import torch
from fusedpar.kernels.attention import (
    AttentionMask,
    Gradients,
    attention_backward,
    attention_backward_dkdv,
    attention_backward_dq,
    attention_delta,
    attention_forward,
    attention_reference,
    gqa_split,
)
from fusedpar.kernels.attention import backward as backward_kernels
from hypothesis import example, given
from hypothesis import strategies as st

import fusedpar as fp
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds
from tests.attention.helpers import (
    attention_grads,
    check_attention,
    force_split,
    poisoned,
    torch_results,
)

HEAD_DIMS = [8, 16, 40, 64, 72, 96, 128, 256]
# V's head dim: Q/K's (None) half the time, else one of its own (MLA's V is narrower)
V_HEAD_DIMS = st.sampled_from([None, None, 8, 24, 64])
# The kernels' tests: Triton's kernels (the interpreter here) unless a test takes
# `each_implementation`, which runs it on the torch implementation too.
pytestmark = pytest.mark.usefixtures("triton_kernels")


@given(
    B=st.integers(1, 2),
    Sq=st.integers(1, 70),
    Skv=st.integers(1, 70),
    Hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    D=st.sampled_from(HEAD_DIMS),
    causal=st.booleans(),
    dtype=cpu_dtypes(),
    seed=seeds(),
    layout=st.sampled_from(["contiguous", "seq-window"]),
    Dv=V_HEAD_DIMS,
)
@example(
    B=1,
    Sq=1,
    Skv=33,
    Hkv=1,
    group=2,
    D=64,
    causal=True,
    dtype=torch.float32,
    seed=0,
    layout="contiguous",
    Dv=None,
)  # Sq = 1: a decoding step
@example(
    B=2,
    Sq=40,
    Skv=13,
    Hkv=2,
    group=1,
    D=16,
    causal=True,
    dtype=torch.float16,
    seed=1,
    layout="seq-window",
    Dv=None,
)  # Sq > Skv causal: 27 rows see no key
@example(
    B=1,
    Sq=19,
    Skv=1,
    Hkv=1,
    group=4,
    D=40,
    causal=False,
    dtype=torch.float32,
    seed=2,
    layout="contiguous",
    Dv=None,
)  # Skv = 1, MQA
@example(
    B=1,
    Sq=24,
    Skv=24,
    Hkv=1,
    group=2,
    D=256,
    causal=True,
    dtype=torch.float16,
    seed=3,
    layout="contiguous",
    Dv=None,
)  # the largest head dim
@example(
    B=1,
    Sq=21,
    Skv=21,
    Hkv=1,
    group=2,
    D=192,
    causal=True,
    dtype=torch.float16,
    seed=4,
    layout="seq-window",
    Dv=128,
)  # MLA's (192, 128)
@example(
    B=2,
    Sq=9,
    Skv=30,
    Hkv=2,
    group=2,
    D=128,
    causal=False,
    dtype=torch.float32,
    seed=5,
    layout="contiguous",
    Dv=64,
)
def test_flash_attn_matches_float64(
    B, Sq, Skv, Hkv, group, D, causal, dtype, seed, layout, Dv, each_implementation
):
    check_attention(B, Sq, Skv, Hkv * group, Hkv, D, causal, dtype, seed, layout, Dv=Dv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_fused_qkv_views_and_custom_scale(dtype, causal, each_implementation):
    check_attention(2, 37, 37, 4, 2, 72, causal, dtype, seed=5, layout="fused-qkv", scale=0.3)


def test_rows_that_see_no_key(each_implementation):
    q, k, v = (
        randn((1, s, 2, 16), torch.float32, i).requires_grad_() for i, s in enumerate((9, 4, 4))
    )
    out, lse = fp.flash_attn(q, k, v, causal=True, return_lse=True)
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    # bottom-right alignment: query i sees keys j <= i - 5, so rows 0..4 see nothing
    assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5]))
    assert torch.isneginf(lse[:, :, :5]).all() and torch.isfinite(lse[:, :, 5:]).all()
    assert torch.equal(q.grad[:, :5], torch.zeros_like(q.grad[:, :5]))
    for t in (out, lse[:, :, 5:], q.grad, k.grad, v.grad):
        assert not torch.isnan(t).any()


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = (randn((1, 5, 1, 24), torch.float32, i) for i in range(3))
    torch.testing.assert_close(
        fp.flash_attn(q, k, v), fp.flash_attn(q, k, v, softmax_scale=1 / math.sqrt(24))
    )


@pytest.mark.parametrize(
    "scale, error",
    [
        (-0.5, ValueError),
        (0.0, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (True, TypeError),
        ("0.1", TypeError),
    ],
)
def test_softmax_scale_must_be_positive_and_finite(scale, error):
    """The kernels fold the scale into the row maximum, ``max(s) * scale``: only a
    positive scale commutes with the maximum."""
    q = torch.ones((1, 4, 2, 8))
    for call in (
        lambda: fp.flash_attn(q, q, q, softmax_scale=scale),
        lambda: attention_forward(q, q, q, AttentionMask(softmax_scale=scale)),
    ):
        with pytest.raises(error, match="softmax_scale"):
            call()


@pytest.mark.parametrize(
    "shapes, dtypes, error, match",
    [
        (((2, 4, 2, 8), (2, 4, 2, 8), (2, 4, 2)), None, ValueError, r"v must be 4-D.*\(2, 4, 2\)"),
        (((2, 4, 2, 8), (3, 4, 2, 8), (3, 4, 2, 8)), None, ValueError, "B=2.*B=3"),
        (((2, 4, 2, 8), (2, 4, 2, 16), (2, 4, 2, 16)), None, ValueError, "D=8.*D=16"),
        (((2, 4, 2, 8), (2, 5, 2, 8), (2, 4, 2, 8)), None, ValueError, r"one \(B, S, H\)"),
        (((1, 4, 2, 16), (1, 4, 2, 16), (1, 4, 2, 12)), None, ValueError, "Dv=12"),
        (((1, 4, 3, 8), (1, 4, 2, 8), (1, 4, 2, 8)), None, ValueError, "Hq=3.*Hkv=2"),
        (((1, 4, 2, 12), (1, 4, 2, 12), (1, 4, 2, 12)), None, ValueError, "D=12"),
        (((1, 4, 2, 264), (1, 4, 2, 264), (1, 4, 2, 264)), None, ValueError, "D=264"),
        (((1, 4, 2, 8),) * 3, (torch.float32, torch.float16, torch.float32), TypeError, "dtype"),
        (((1, 4, 2, 8),) * 3, (torch.int64,) * 3, TypeError, "int64"),
    ],
)
def test_bad_input_is_a_clear_error(shapes, dtypes, error, match):
    dtypes = dtypes or (torch.float32,) * 3
    q, k, v = (torch.ones(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True))
    with pytest.raises(error, match=match):
        fp.flash_attn(q, k, v)


def force_pointer_path(monkeypatch):
    """The kernels' pointer path, as for inputs TMA cannot read (and on an A100)."""
    from fusedpar.kernels import common

    monkeypatch.setattr(common, "tma_compatible", lambda *tensors: False)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["tma", "pointer", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "B, S, Hq, Hkv, D, causal",
    [
        (2, 1024, 8, 2, 128, True),
        (1, 8192, 4, 2, 128, True),
        (1, 4096, 4, 4, 64, False),
        (1, 2048, 4, 1, 256, True),
    ],
)
def test_flash_attn_gpu(B, S, Hq, Hkv, D, causal, dtype, path, monkeypatch):
    """Both read paths of the kernels (the GPU twin of the bitwise CPU test), and the
    torch implementation."""
    if path == "pointer":
        force_pointer_path(monkeypatch)
    with fp.implementation("torch" if path == "torch" else "triton"):
        check_flash_attn_gpu(B, S, Hq, Hkv, D, causal, dtype)


def check_flash_attn_gpu(B, S, Hq, Hkv, D, causal, dtype, Dv=None):
    torch.manual_seed(0)
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=dtype)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype)
    v = torch.randn(B, S, Hkv, D if Dv is None else Dv, device="cuda", dtype=dtype)
    dout = torch.randn(B, S, Hq, v.shape[-1], device="cuda", dtype=dtype)
    dlse = torch.zeros(B, Hq, S, device="cuda")
    got = attention_grads(
        lambda *t: fp.flash_attn(*t, causal=causal, return_lse=True), (q, k, v), dout, dlse
    )
    ref = attention_grads(
        lambda *t: attention_reference(*t, AttentionMask(causal)),
        [t.double() for t in (q, k, v)],
        dout,
        dlse,
    )
    same = torch_results((q, k, v), dout, dlse, ref, causal)
    for name, g, r, t in zip(("out", "lse", "dq", "dk", "dv"), got, ref, same, strict=True):
        assert_close(g, r, t, name=name, sum_length=D if name.startswith("d") else None)


def test_soft_capping_approximates_tanh_only_in_compiled_bf16():
    """`tanh.approx.f32` (relative error about 2^-11) for bf16 in compiled kernels, whose
    scores bf16 rounds to 2^-8 anyway; the exact formula for fp16 and fp32 (which round
    a score to 2^-11 or finer) and in the interpreter (no PTX)."""
    from fusedpar.kernels.attention import SOFTCAP_APPROX, SOFTCAP_EXACT, softcap_mode

    assert softcap_mode(torch.bfloat16, 30.0, interpreted=False) == SOFTCAP_APPROX
    for dtype, interpreted in (
        (torch.float16, False),
        (torch.float32, False),
        (torch.bfloat16, True),
    ):
        assert softcap_mode(dtype, 30.0, interpreted) == SOFTCAP_EXACT
    assert softcap_mode(torch.bfloat16, 0.0, interpreted=False) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [5.0, 50.0])
@pytest.mark.parametrize("deterministic", [True, False])
def test_approximate_soft_capping_gpu(softcap, deterministic):
    """bf16 soft-capping through `tanh.approx.f32`, scores driven onto the cap (raw
    scores of standard deviation 0.75 * softcap), forward and both backwards, under the
    contract's rule: the approximation moves a score by at most |s| * 2^-11, an eighth of
    what PyTorch's bf16 scores are rounded by, so "twice PyTorch's own error" holds it.
    The split backward, and the tuner's pick (the fused kernel itself:
    test_attention_fused)."""
    torch.manual_seed(0)
    B, S, Hq, Hkv, D = 2, 1000, 4, 2, 128
    q = torch.randn(B, S, Hq, D, device="cuda") * (0.75 * softcap)
    q = q.to(torch.bfloat16)
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout, dlse = torch.randn_like(q), torch.randn(B, Hq, S, device="cuda")
    mask = {"causal": True, "softcap": softcap}
    with fp.implementation("triton"):
        got = attention_grads(
            lambda *t: fp.flash_attn(*t, **mask, return_lse=True, deterministic=deterministic),
            (q, k, v),
            dout,
            dlse,
        )
    ref = attention_grads(
        lambda *t: attention_reference(*t, AttentionMask(**mask)),
        [t.double() for t in (q, k, v)],
        dout,
        dlse,
    )
    same = torch_results((q, k, v), dout, dlse, ref, **mask)
    for name, g, r, t in zip(("out", "lse", "dq", "dk", "dv"), got, ref, same, strict=True):
        assert_close(g, r, t, name=name, sum_length=D if name.startswith("d") else None)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["tma", "pointer"])
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("D, Dv", [(192, 128), (128, 64)])
def test_head_dim_pairs_gpu(D, Dv, deterministic, path, monkeypatch):
    """V's head dim apart from Q/K's (DeepSeek's MLA: 192 and 128), bf16 causal GQA,
    both backwards and read paths, V never padded."""
    if path == "pointer":
        force_pointer_path(monkeypatch)
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        with fp.implementation("triton"):
            check_flash_attn_gpu(1, 2048, 16, 4, D, True, torch.bfloat16, Dv)
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("Sq, Skv", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(Sq, Skv, each_implementation):
    q = randn((1, Sq, 2, 8), torch.float32, 0).requires_grad_()
    k, v = (randn((1, Skv, 1, 8), torch.float32, i).requires_grad_() for i in (1, 2))
    out, lse = fp.flash_attn(q, k, v, return_lse=True)
    out.sum().backward()
    assert out.shape == q.shape and lse.shape == (1, 2, Sq)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    for t in (q, k, v):
        assert torch.equal(t.grad, torch.zeros_like(t))


@pytest.mark.gpu
def test_offsets_past_two_to_the_31():
    """K and V read through a sequence stride of 2**30 elements: 64-bit offsets."""
    stride = 2**30
    storage = torch.zeros(2 * stride + 64, dtype=torch.float16, device="cuda")
    kv = storage.as_strided((1, 3, 1, 16), (0, stride, 16, 1))
    kv.copy_(randn((1, 3, 1, 16), torch.float16, 0).cuda())
    q = randn((1, 1, 1, 16), torch.float16, 1).cuda()
    ref = attention_reference(q.double(), kv.double(), kv.double())[0]
    assert_close(fp.flash_attn(q, kv, kv), ref, attention_reference(q, kv, kv)[0])


# --- the ring's modes: fp32 partials, merge epilogue, fresh / accumulating gradients ---


def check_ring_modes(
    B,
    Sq,
    Skv,
    Hq,
    Hkv,
    D,
    causal,
    dtype,
    seed,
    device="cpu",
    split_below=None,
    first_keys=None,
    deterministic=False,
    Dv=None,
):
    """The kernels as the ring drives them, against float64 full attention:

    - forward: keys [0, s1) written as an fp32 partial into NaN-poisoned strided buffers,
      then keys [s1, Skv) merged into them in the epilogue (``merge=True``); with
      ``causal`` the first part is visible to every row (a ring's earlier block), and
      s1 = 0 merges into an empty partial (LSE -inf); Sq > Skv leaves rows with no key;
    - backward: dQ and dK/dV halves written fresh into NaN-poisoned fp32 buffers,
      `attention_backward` adding into random fp32 buffers (``accumulate``), and
      `attention_backward` from `out` and dLSE (delta made first) into poisoned
      buffers, fused or, with ``deterministic``, split (dQ's kernel makes delta);
    - both with the GQA split forced (``split_below``) or not; v of head dim `Dv`
      (None: D).
    """
    Dv = D if Dv is None else Dv

    def strided(shape, offset):
        return randn((shape[0], shape[1] + 3, *shape[2:]), dtype, seed + offset).to(device)[:, 3:]

    q, k = strided((B, Sq, Hq, D), 0), strided((B, Skv, Hkv, D), 1)
    v = strided((B, Skv, Hkv, Dv), 2)
    dout = randn((B, Sq, Hq, Dv), dtype, seed + 3).to(device)
    dlse = randn((B, Hq, Sq), torch.float32, seed + 4).to(device)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    visible_to_all = max(0, Skv - Sq + 1) if causal else Skv
    s1 = first_keys if first_keys is not None else seed % (visible_to_all + 1)

    out, lse = poisoned((B, Sq, Hq, Dv), device), poisoned((B, Hq, Sq + 1), device)[..., 1:]
    attention_forward(q, k[:, :s1], v[:, :s1], out=out, lse=lse)
    mask = AttentionMask(causal)
    attention_forward(q, k[:, s1:], v[:, s1:], mask, out=out, lse=lse, merge=True)
    ref = attention_grads(lambda *t: attention_reference(*t, mask), (q64, k64, v64), dout, dlse)
    same = torch_results((q, k, v), dout, dlse, ref, causal)
    assert out.dtype == torch.float32
    assert_close(out, ref[0], same[0], name="merged out")
    assert_close(lse, ref[1], same[1], name="merged lse")

    with pytest.MonkeyPatch.context() as mp:
        force_split(mp, split_below)
        o, saved_lse = attention_forward(q, k, v, mask)  # what flash_attn saves
        seen_dlse = torch.where(torch.isfinite(saved_lse), dlse, 0)
        delta = attention_delta(o, dout) - seen_dlse
        saved = (dout, q, k, v, saved_lse, delta)
        fresh = [poisoned(t.shape, device) for t in (q, k, v)]
        attention_backward_dq(*saved, mask, grads=Gradients(dq=fresh[0]))
        attention_backward_dkdv(*saved, mask, grads=Gradients(dk=fresh[1], dv=fresh[2]))
        start = [
            randn(t.shape, torch.float32, seed + 5 + i).to(device) for i, t in enumerate((q, k, v))
        ]
        added = [t.clone() for t in start]
        attention_backward(
            dout,
            q,
            k,
            v,
            saved_lse,
            mask,
            delta=delta,
            grads=Gradients(*added, accumulate=True, deterministic=deterministic),
        )
        made = [poisoned(t.shape, device) for t in (q, k, v)]  # delta made by dQ's kernel
        attention_backward(
            dout,
            q,
            k,
            v,
            saved_lse,
            mask,
            delta_from=(o, seen_dlse),
            grads=Gradients(*made, deterministic=deterministic),
        )
    for name, f, a, m, s0, r, t in zip(
        ("dq", "dk", "dv"), fresh, added, made, start, ref[2:], same[2:], strict=True
    ):
        assert f.dtype == a.dtype == torch.float32
        # held in fp32 for the ring's sums, judged in the inputs' dtype, as the gradients
        # of flash_attn are: from 16-bit inputs the kernels' dots take 16-bit operands
        # (dS, P), and an fp32 floor failed 1 example in a few thousand (0.00019 against
        # 0.00019 allowed: fp16, Sq=1, Skv=2, D=64)
        length = max(D, Dv)
        assert_close(f.to(dtype), r, t, name=f"{name} fresh", sum_length=length)
        assert_close((a - s0).to(dtype), r, t, name=f"{name} accumulated", sum_length=length)
        assert_close(m.to(dtype), r, t, name=f"{name} (delta made by dQ)", sum_length=length)


@given(
    B=st.integers(1, 2),
    Sq=st.integers(1, 40),
    Skv=st.integers(1, 40),
    Hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    D=st.sampled_from([8, 16, 40, 64]),
    causal=st.booleans(),
    dtype=cpu_dtypes(),
    seed=seeds(),
    split_below=st.sampled_from([None, 4, 10**6]),
    deterministic=st.booleans(),
    Dv=V_HEAD_DIMS,
)
# Sq > Skv: 24 rows see no key, merged into an empty partial (s1 = 0)
@example(
    B=1,
    Sq=37,
    Skv=13,
    Hkv=1,
    group=3,
    D=16,
    causal=True,
    dtype=torch.float32,
    seed=0,
    split_below=10**6,
    deterministic=False,
    Dv=None,
)
@example(
    B=2,
    Sq=17,
    Skv=33,
    Hkv=2,
    group=3,
    D=40,
    causal=True,
    dtype=torch.float16,
    seed=7,
    split_below=10**6,
    deterministic=True,
    Dv=24,
)  # V narrower, the GQA split
def test_ring_modes_match_float64(
    B,
    Sq,
    Skv,
    Hkv,
    group,
    D,
    causal,
    dtype,
    seed,
    split_below,
    deterministic,
    Dv,
    each_implementation,
):
    check_ring_modes(
        B,
        Sq,
        Skv,
        Hkv * group,
        Hkv,
        D,
        causal,
        dtype,
        seed,
        split_below=split_below,
        deterministic=deterministic,
        Dv=Dv,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "B, Sq, Skv, Hq, Hkv, D, causal",
    [
        (1, 1024, 1536, 8, 2, 128, True),
        (2, 2048, 2048, 32, 1, 128, True),
        (1, 1000, 777, 4, 4, 64, False),
    ],
)
def test_ring_modes_gpu(B, Sq, Skv, Hq, Hkv, D, causal, dtype):
    """The default threshold (two waves of SMs) splits the first two: 24 and 32 dK/dV
    programs of 128 keys (D = 128's largest key block) on an H100's 132 SMs."""
    check_ring_modes(B, Sq, Skv, Hq, Hkv, D, causal, dtype, seed=11, device="cuda")


def test_gqa_split_is_deterministic_and_needs_no_gpu_query(monkeypatch):
    def no_query(device):
        raise AssertionError("the SM count is queried only for CUDA tensors")

    monkeypatch.setattr(backward_kernels, "sm_count", no_query)
    q = torch.empty((1, 1, 1, 128), dtype=torch.bfloat16)  # D = 128: key blocks of 128 at most
    assert gqa_split(1, 8192, 1, 32, q) == 1  # the interpreter never splits by default
    monkeypatch.setattr(backward_kernels, "SPLIT_BELOW_PROGRAMS", 264)  # 2 x an H100's SMs
    # 64 programs of 128 keys: 5 slices of at most 7 query heads reach 264
    assert gqa_split(1, 8192, 1, 32, q) == 5
    assert gqa_split(1, 8192, 1, 1, q) == 1  # no group to split
    assert gqa_split(4, 8192, 8, 4, q) == 1  # 4096 programs: enough
    assert gqa_split(1, 100, 1, 3, q) == 3  # at most one query head per slice
    q, k, v = (randn((1, 21, h, 16), torch.float32, i) for i, h in enumerate((6, 1, 1)))
    dout = randn(q.shape, torch.float32, 3)
    causal = AttentionMask(causal=True)
    out, lse = attention_forward(q, k, v, causal)
    runs = [
        attention_backward(
            dout, q, k, v, lse, causal, delta_from=(out, None), grads=Gradients(deterministic=True)
        )
        for _ in range(2)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("D", [40, 64])
@pytest.mark.parametrize("mask", [{"causal": True}, {"window": (9, 3), "softcap": 5.0}])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "split"])
def test_tma_and_pointer_paths_agree_bitwise(monkeypatch, D, mask, deterministic):
    """16-bit K/V (forward, dQ) and Q/dO (dK/dV) are read through TMA descriptors where
    their alignment allows (`tma_compatible`), through pointers otherwise: the same
    numbers either way, bit for bit, with edges in every dimension (D=40: TMA's zero
    fill past the head dim, 21 and 35 rows: past the sequences); the fused backward and
    the split one."""
    from fusedpar.kernels.common import tma_compatible

    q, k, v = (
        randn((2, s, h, D), torch.float16, i)
        for i, (s, h) in enumerate(((21, 4), (35, 2), (35, 2)))
    )
    dout = randn(q.shape, torch.float16, 3)
    assert tma_compatible(q, k, v, dout)

    def run():
        out, lse = attention_forward(q, k, v, AttentionMask(**mask))
        return (
            out,
            lse,
            *attention_backward(
                dout,
                q,
                k,
                v,
                lse,
                AttentionMask(**mask),
                delta_from=(out, None),
                grads=Gradients(deterministic=deterministic),
            ),
        )

    with_tma = run()
    force_pointer_path(monkeypatch)
    for a, b in zip(with_tma, run(), strict=True):
        assert torch.equal(a, b)


def test_tma_needs_16_byte_alignment_and_a_unit_last_stride():
    from fusedpar.kernels.common import tma_compatible

    x = torch.empty((2, 64, 4, 72), dtype=torch.bfloat16)
    assert tma_compatible(x) and tma_compatible(x[:, 3:], x[:, :, 1:]) and tma_compatible(x.float())
    assert not tma_compatible(x[..., 1:])  # base 2 bytes past a 16-byte boundary
    assert not tma_compatible(x[..., :36].transpose(1, 3))  # last stride not 1
    odd = torch.empty((2, 64, 4, 76), dtype=torch.float16)[..., :72]  # rows 152 B apart
    assert not tma_compatible(odd)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda q: attention_forward(q, q, q, merge=True), ValueError, "give both"),
        (
            lambda q: attention_forward(
                q, q, q, out=torch.empty_like(q), lse=torch.empty(1, 2, 4), merge=True
            ),
            TypeError,
            "float32: out is torch.float16",
        ),
        (
            lambda q: attention_backward_dq(
                q,
                q,
                q,
                q,
                torch.empty(1, 2, 4),
                torch.empty(1, 2, 4),
                grads=Gradients(accumulate=True),
            ),
            ValueError,
            "adds into dq",
        ),
        (
            lambda q: attention_backward_dkdv(
                q, q, q, q, torch.empty(1, 2, 4), torch.empty(1, 2, 5)
            ),
            ValueError,
            r"delta must be \(1, 2, 4\)",
        ),
        (
            lambda q: attention_backward(
                q,
                q,
                q,
                q,
                torch.empty(1, 2, 4),
                delta_from=(None, torch.empty(1, 2, 4)),
                delta=torch.empty(1, 2, 4),
            ),
            ValueError,
            "dlse folds into",
        ),
        (
            lambda q: attention_backward_dq(
                q,
                q,
                q,
                q,
                torch.empty(1, 2, 4),
                torch.empty(1, 2, 4),
                delta_from=(None, torch.empty(1, 2, 4)),
            ),
            ValueError,
            "give out too",
        ),
        (
            lambda q: attention_backward(
                q, q, q, q, torch.empty(1, 2, 4), delta_from=(q[..., :4], None)
            ),
            ValueError,
            r"out must be \(1, 4, 2, 8\)",
        ),
    ],
)
def test_ring_mode_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.ones(1, 4, 2, 8, dtype=torch.float16))


def test_the_attention_benchmark_runs_on_cpu(monkeypatch, tmp_path):
    """bench/attention.py end to end on CPU (fp32, the interpreter, timers replaced): a
    multi-head and a GQA point, a packed-documents and a sliding-window point, the peer
    filter, a peer that cannot run recorded as missing, one not installed noted in its
    rows, and the tuner's picks in the results."""
    import json

    import bench.attention as bench
    from bench.common import results_folder

    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    monkeypatch.setenv("BENCH_PEERS", "sdpa-flash,fusedpar,fusedpar-prebuilt,sdpa-mask,flash-attn")
    monkeypatch.setattr(bench, "DTYPE", torch.float32)
    monkeypatch.setattr(bench, "TOKENS", 32)
    monkeypatch.setattr(bench, "points", lambda: [(16, True, 16, 2, 2), (16, False, 32, 4, 1)])
    masked = [("documents", 16, 40, 2, 2, (7, 16, 1, 16)), ("window", 16, 48, 4, 2, 8)]
    monkeypatch.setattr(bench, "masked_points", lambda: masked)
    monkeypatch.setattr(bench, "time_ms", lambda fn, **kw: (fn(), 1.0)[1])
    monkeypatch.setattr(bench, "environment", lambda: {"device": "cpu test"})
    monkeypatch.setattr(bench, "measured_ceilings", lambda: {"matmul_bf16_tflops": 1.0})
    bench.main(device="cpu")
    result = json.loads((results_folder() / "attention.json").read_text())
    rows = result["rows"]
    shapes = [
        (16, 2, 2, 2, None),
        (32, 1, 4, 1, None),
        (40, 1, 2, 2, "documents 7+16+1+16"),
        (48, 1, 4, 2, "window 8"),
    ]
    assert [(r["S"], r["B"], r["Hq"], r["Hkv"], r.get("mask"), r["pass_"]) for r in rows] == [
        (*shape, p) for shape in shapes for p in bench.PASSES
    ]
    fwd = rows[0]
    assert fwd["fusedpar"] == pytest.approx(4 * 2 * 2 * 16 * 16 * 16 * 0.5 / 1e9)
    assert result["meta"]["peers"] == "fusedpar,sdpa-flash,fusedpar-prebuilt,sdpa-mask,flash-attn"
    if fwd["sdpa-flash"] is None:  # no flash backend on CPU: recorded, the rest measured
        assert "sdpa-flash D=16 S=16" in result["meta"]["missing"]
    docs, window = rows[6], rows[9]
    pairs = {"documents": (7**2 + 16**2 + 1 + 16**2) / 2, "window": 48 * 8 - 8 * 8 / 2}
    for row, (Hq, kind) in ((docs, (2, "documents")), (window, (4, "window"))):
        assert row["fusedpar"] == pytest.approx(4 * Hq * 16 * pairs[kind] / 1e9)
        assert row["sdpa-mask"] == pytest.approx(row["fusedpar"])  # timers faked: equal
        assert "sdpa-flash" not in row  # the masked points compare their own peers
        if kind == "documents":  # the kernel alone, forward only (no autograd)
            assert row["fusedpar-prebuilt"] == pytest.approx(row["fusedpar"])
            assert rows[7]["fusedpar-prebuilt"] is None  # its backward: missing
        else:
            assert row["fusedpar-prebuilt"] is None and "documents point only" in row["note"]
        if row["flash-attn"] is None and "note" in row:  # not installed: noted, not missing
            assert "flash-attn: not importable" in row["note"]
            assert "flash-attn" not in result["meta"]["missing"]
    assert "mask" in (results_folder() / "attention.md").read_text()
    for point in masked:  # the peers compute one mask: ours against SDPA's dense mask
        _, D, T, Hq, Hkv, _ = point
        q, k, v = (randn((T, h, D), torch.float32, i) for i, h in enumerate((Hq, Hkv, Hkv)))
        ours = bench.make_masked_peer("fusedpar", point, "cpu")[1]
        sdpa = bench.make_masked_peer("sdpa-mask", point, "cpu")[1]
        got = ours(q, k, v) if point[0] == "documents" else ours(q[None], k[None], v[None])[0]
        want = sdpa(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)
        torch.testing.assert_close(got, want)
        if point[0] == "documents":
            prebuilt = bench.make_masked_peer("fusedpar-prebuilt", point, "cpu")[1]
            torch.testing.assert_close(prebuilt(q, k, v), want)
    assert "_attn_fwd_kernel" in result["meta"]["tuning_picks"]
    monkeypatch.setenv("BENCH_PEERS", "fusedpar,sdpa")
    with pytest.raises(ValueError, match="unknown peers \\['sdpa'\\]"):
        bench.selected_peers()


def test_the_gqa_split_adds_no_host_sync(monkeypatch):
    from fusedpar.testing.host_syncs import HostSyncs

    monkeypatch.setattr(backward_kernels, "SPLIT_BELOW_PROGRAMS", 10**6)
    q = randn((1, 19, 4, 16), torch.float32, 0).requires_grad_()
    k, v = (randn((1, 23, 1, 16), torch.float32, i).requires_grad_() for i in (1, 2))

    def step():
        fp.flash_attn(q, k, v, causal=True).sum().backward()

    step()  # warm-up: tuning
    with HostSyncs() as syncs:
        step()
    assert not syncs.found, syncs.report()


def _counted(monkeypatch, module, name) -> list:
    """`module.name` wrapped to record each call (one entry per call) in the list returned."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or real(*a))
    return calls


def test_a_forward_is_checked_and_planned_once_per_signature(monkeypatch):
    """The forward's checks and launch parameters are worked out on the first call of a
    signature (shapes, strides, dtypes, alignment, mask, flags) and looked up after; a
    call that differs in any of them is checked anew, and computes right."""
    from fusedpar.kernels.attention import forward as forward_kernels

    checks = _counted(monkeypatch, forward_kernels, "check_attention_inputs")
    monkeypatch.setattr(forward_kernels, "FORWARD_PLANS", {})
    q, k, v = (randn((1, 24, h, 16), torch.float32, i) for i, h in enumerate((4, 2, 2)))
    calls = [
        ({}, (q, k, v)),
        ({}, (q, k, v)),
        ({"causal": True}, (q, k, v)),
        ({"window": (5, 0)}, (q, k, v)),
        ({}, (q[:, 1:], k[:, 1:], v[:, 1:])),
        ({}, (q.half(), k.half(), v.half())),
    ]
    for mask, inputs in calls:
        out, _ = attention_forward(*inputs, AttentionMask(**mask))
        ref64, _ = attention_reference(*(t.double() for t in inputs), AttentionMask(**mask))
        ref, _ = attention_reference(*inputs, AttentionMask(**mask))
        assert_close(out, ref64, ref, name=str(mask))
    assert len(checks) == 5  # the second call was looked up


def test_a_backward_is_checked_and_planned_once_per_signature(monkeypatch):
    """dK/dV and dQ work out their checks and launch parameters on the first call of a
    signature and look them up after; a call that differs in shape, stride, dtype, mask,
    buffers or the GQA split is checked anew, and its gradients are right."""
    from fusedpar.kernels.attention import plan as plans

    checks = _counted(monkeypatch, plans, "check_backward_inputs")
    monkeypatch.setattr(plans, "BACKWARD_PLANS", {})
    q, k, v = (randn((1, 24, h, 16), torch.float32, i) for i, h in enumerate((4, 2, 2)))

    def grads(inputs, mask, split_below=None, given=False):
        monkeypatch.setattr(backward_kernels, "SPLIT_BELOW_PROGRAMS", split_below)
        q, k, v = inputs
        dout = randn(q.shape, q.dtype, 7)
        mask = AttentionMask(**mask)
        out, lse = attention_forward(q, k, v, mask)
        delta = attention_delta(out, dout)
        nan_buffers = {
            n: torch.full(t.shape, float("nan"))
            for n, t in zip(("dq", "dk", "dv"), (q, k, v), strict=True)
        }
        given = nan_buffers if given else {}
        dq = attention_backward_dq(dout, q, k, v, lse, delta, mask, grads=Gradients(**given))
        dk, dv = attention_backward_dkdv(dout, q, k, v, lse, delta, mask, grads=Gradients(**given))
        no_dlse = torch.zeros(lse.shape)
        ref64, ref = (
            attention_grads(lambda *t: attention_reference(*t, mask), ts, dout, no_dlse)
            for ts in ((t.double() for t in inputs), inputs)
        )
        for name, g, r64, r in zip(
            ("dq", "dk", "dv"), (dq, dk, dv), ref64[2:], ref[2:], strict=True
        ):
            assert_close(g, r64, r, name=f"{name} {mask}")

    calls = [
        ((q, k, v), {}),
        ((q, k, v), {}),
        ((q, k, v), {"causal": True}),
        ((q, k, v), {"window": (5, 0)}),
        ((q[:, 1:], k[:, 1:], v[:, 1:]), {}),
        ((q.half(), k.half(), v.half()), {}),
    ]
    for inputs, mask in calls:
        grads(inputs, mask)
    assert len(checks) == 2 * 5  # dQ's and dK/dV's: the second call was looked up
    grads((q, k, v), {}, split_below=10**6)  # dK/dV's GQA split: planned anew (dQ has none)
    grads((q, k, v), {}, given=True)  # the caller's buffers: planned anew
    grads((q, k, v), {}, given=True)
    assert len(checks) == 2 * 5 + 1 + 2
