"""The fused attention backward (`fusedpar.kernels.attention.backward_fused`): dK, dV and
dQ from one kernel, against float64 and beside the split backward, in the modes the
split one has (GQA and its split, fp32 gradients added into as the ring does, windows,
soft-capping, packed documents, both read paths); which of the two runs (`deterministic`,
PyTorch's flag, the tuner); the tiles a miscompiling Triton leaves out."""

import pytest
import torch
from fusedpar.kernels import tuning
from fusedpar.kernels.attention import (
    AttentionMask,
    Gradients,
    attention_delta,
    attention_forward,
    fused_configs,
    packed_intervals,
    transposed_dot_miscompiles,
    visible_reference,
)
from fusedpar.kernels.attention import backward as split_kernels
from fusedpar.kernels.attention import backward_fused as backwards
from hypothesis import given
from hypothesis import strategies as st

import fusedpar as fp
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds
from tests.attention.helpers import (
    attention_grads,
    force_split,
    poisoned,
    reference_of,
    torch_results,
)

pytestmark = pytest.mark.usefixtures("triton_kernels")


def _mask(kind, S, seed, device):
    """(kernel mask arguments, reference mask arguments) of one mask kind."""
    if kind == "causal":
        return {"causal": True}, {"causal": True}
    if kind == "window-softcap":
        window = (seed % 7 + 1, seed % 3)
        return {"window": window, "softcap": 5.0}, {"window": window, "softcap": 5.0}
    lengths = [S // 3, 0, S - S // 3 - 2, 2]  # packed documents, one empty
    cu = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    mask = dict(causal=True, window=(-1, -1))
    return (
        {"intervals": packed_intervals(cu, cu, S, S, **mask)},
        {"visible": visible_reference(cu, cu, **mask)},
    )


def check_fused(B, S, Hkv, group, D, kind, dtype, seed, split_below, device="cpu", Dv=None):
    """The fused backward against float64: fresh gradients (from out and dLSE, into
    NaN-poisoned strided buffers of q's dtype) and fp32 gradients added into (the ring's
    mode), with the GQA split forced (`split_below`) or not; v of head dim `Dv` (None:
    D)."""
    B = 1 if kind == "packed" else B
    Dv = D if Dv is None else Dv
    q = randn((B, S, Hkv * group, D), dtype, seed).to(device)
    k = randn((B, S, Hkv, D), dtype, seed + 1).to(device)
    v = randn((B, S, Hkv, Dv), dtype, seed + 2).to(device)
    dout = randn((*q.shape[:3], Dv), dtype, seed + 3).to(device)
    mask, ref_mask = _mask(kind, S, seed, device)
    mask = AttentionMask(**mask)
    out, lse = attention_forward(q, k, v, mask)
    dlse = randn(lse.shape, torch.float32, seed + 4).to(device)
    dlse = torch.where(torch.isfinite(lse), dlse, 0)
    ref = attention_grads(reference_of(**ref_mask), [t.double() for t in (q, k, v)], dout, dlse)
    same = torch_results((q, k, v), dout, dlse, ref, **ref_mask)
    with pytest.MonkeyPatch.context() as mp:
        force_split(mp, split_below)
        made = [poisoned(t.shape, device, dtype) for t in (q, k, v)]
        backwards.attention_backward_fused(
            dout,
            q,
            k,
            v,
            lse,
            split_kernels.delta_buffer(lse.shape, device),
            mask,
            grads=Gradients(*made),
            delta_from=(out, dlse),
        )
        start = [
            randn(t.shape, torch.float32, seed + 5 + i).to(device) for i, t in enumerate((q, k, v))
        ]
        added = [t.clone() for t in start]
        delta = attention_delta(out, dout, dlse)
        backwards.attention_backward_fused(
            dout,
            q,
            k,
            v,
            lse,
            delta,
            mask,
            grads=Gradients(*added, accumulate=True),
        )
    for name, m, a, s0, r, t in zip(
        ("dq", "dk", "dv"), made, added, start, ref[2:], same[2:], strict=True
    ):
        assert_close(m, r, t, name=f"{name} fused", sum_length=max(D, Dv))
        assert_close((a - s0).to(dtype), r, t, name=f"{name} fused, added", sum_length=max(D, Dv))


@given(
    B=st.integers(1, 2),
    S=st.integers(5, 40),
    Hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    D=st.sampled_from([8, 16, 40]),
    kind=st.sampled_from(["causal", "window-softcap", "packed"]),
    dtype=cpu_dtypes(),
    seed=seeds(),
    split_below=st.sampled_from([None, 10**6]),
    Dv=st.sampled_from([None, None, 8, 24]),
)
def test_fused_backward_matches_float64(B, S, Hkv, group, D, kind, dtype, seed, split_below, Dv):
    check_fused(B, S, Hkv, group, D, kind, dtype, seed, split_below, Dv=Dv)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["causal", "window-softcap", "packed"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_backward_gpu(kind, D, dtype):
    """The same at a GPU's sizes: GQA 8 over 2 heads, the split forced at D = 128."""
    check_fused(2, 1537, 2, 4, D, kind, dtype, 0, 10**6 if D == 128 else None, "cuda")


# (the interpreter's numpy warns of the overflow in elements the masks then drop, and of
# the split kernel's NaN in key rows past Skv, which its store drops)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype, q_scale", [(torch.float16, 4.0), (torch.float32, 30.0)], ids=str)
def test_keys_past_the_end_add_nothing_to_dq(dtype, q_scale):
    """Rows whose every score is far below 0 (LSE -13 in fp16, -116 in fp32) against a
    partial last key block, unmasked: the zero-filled keys past Skv score 0, exp(-LSE)
    overflows there, and dQ must not take inf x 0 (NaN) from them."""
    q = q_scale * torch.ones(1, 16, 1, 16).to(dtype)
    k = (randn((1, 20, 1, 16), torch.float32, 1) * 0.1 - 1).to(dtype)
    v, dout = randn((1, 20, 1, 16), dtype, 2), randn((1, 16, 1, 16), dtype, 3)
    out, lse = attention_forward(q, k, v)
    assert lse.max() < -12
    fused = backwards.attention_backward(dout, q, k, v, lse, delta_from=(out, None))
    split = backwards.attention_backward(
        dout, q, k, v, lse, delta_from=(out, None), grads=Gradients(deterministic=True)
    )
    for name, f, s in zip(("dq", "dk", "dv"), fused, split, strict=True):
        assert torch.isfinite(f).all(), name
        torch.testing.assert_close(f, s, msg=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_fused_and_split_agree_into_every_kind_of_buffer(dtype):
    """New gradients, the caller's in q's dtype (dQ summed in fp32 scratch, then written
    or added) and in fp32 (summed in place): the fused backward and the split one."""
    q = randn((2, 29, 4, 16), dtype, 0)
    k, v = (randn((2, 29, 2, 16), dtype, i) for i in (1, 2))
    dout = randn(q.shape, dtype, 3)
    causal = AttentionMask(causal=True)
    out, lse = attention_forward(q, k, v, causal)
    for wide in (dtype, torch.float32):
        start = [randn(t.shape, wide, 4 + i) for i, t in enumerate((q, k, v))]
        for accumulate in (False, True):
            results = []
            for deterministic in (False, True):
                given = [t.clone() for t in start]
                got = backwards.attention_backward(
                    dout,
                    q,
                    k,
                    v,
                    lse,
                    causal,
                    delta_from=(out, None),
                    grads=Gradients(*given, accumulate=accumulate, deterministic=deterministic),
                )
                assert all(g is t for g, t in zip(got, given, strict=True))
                results.append(got)
            for name, f, s in zip(("dq", "dk", "dv"), *results, strict=True):
                # the sums differ in order only: a rounding of the buffer's dtype apart
                tol = 2 * torch.finfo(wide).eps * (1 + s.abs().max().item())
                torch.testing.assert_close(
                    f, s, atol=tol, rtol=0, msg=f"{name} {wide} accumulate={accumulate}"
                )
    fresh = backwards.attention_backward(dout, q, k, v, lse, causal, delta_from=(out, None))
    assert [g.dtype for g in fresh] == [dtype] * 3


def _runs(monkeypatch) -> list:
    """Which backward each call runs: "fused" or "split" per call, in order."""
    seen = []
    for name, label in (("attention_backward_fused", "fused"), ("attention_backward_dq", "split")):
        real = getattr(backwards, name)
        monkeypatch.setattr(
            backwards, name, lambda *a, _r=real, _l=label, **kw: seen.append(_l) or _r(*a, **kw)
        )
    return seen


def test_deterministic_runs_the_split_backward(monkeypatch):
    """``deterministic=True`` on the public ops, or PyTorch's flag, runs the split
    backward; otherwise the tuner's pick (here, in the interpreter: the fused one), and
    a forced pick of the tuner ``attention_backward`` runs either."""
    seen = _runs(monkeypatch)
    q = randn((1, 13, 2, 8), torch.float32, 0).requires_grad_()
    k, v = (randn((1, 13, 1, 8), torch.float32, i).requires_grad_() for i in (1, 2))

    def step(**kw):
        fp.flash_attn(q, k, v, causal=True, **kw).sum().backward()

    step()
    step(deterministic=True)
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        step()
    finally:
        torch.use_deterministic_algorithms(saved)
    with tuning.forced("attention_backward", backwards.SPLIT):
        step()
    with tuning.forced("attention_backward", backwards.FUSED):
        step()
    assert seen == ["fused", "split", "split", "split", "fused"]
    cu = torch.tensor([0, 5, 13], dtype=torch.int32)
    fp.flash_attn_varlen(q[0], k[0], v[0], cu, causal=True, deterministic=True).sum().backward()
    assert seen[-1] == "split"


def test_the_split_backward_is_bitwise_repeatable():
    """The deterministic path sums every gradient in a fixed order: two runs agree to
    the bit (the fused one promises that of dK and dV only)."""
    q = randn((1, 21, 6, 16), torch.float32, 0)
    k, v = (randn((1, 21, 1, 16), torch.float32, i) for i in (1, 2))
    dout = randn(q.shape, torch.float32, 3)
    causal = AttentionMask(causal=True)
    out, lse = attention_forward(q, k, v, causal)
    split = Gradients(deterministic=True)
    runs = [
        backwards.attention_backward(
            dout, q, k, v, lse, causal, delta_from=(out, None), grads=split
        )
        for _ in range(2)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_bad_input_is_refused_before_any_launch():
    q = torch.ones(1, 4, 2, 8, dtype=torch.float16)
    lse = torch.empty(1, 2, 4)
    with pytest.raises(ValueError, match="give out too"):
        backwards.attention_backward_fused(q, q, q, q, lse, lse, delta_from=(None, lse))
    with pytest.raises(ValueError, match="adds into dq, dk and dv"):
        backwards.attention_backward(
            q, q, q, q, lse, delta=lse, grads=Gradients(dq=q, accumulate=True)
        )
    with pytest.raises(ValueError, match=r"out must be \(1, 4, 2, 8\)"):
        backwards.attention_backward(q, q, q, q, lse, delta_from=(q[..., :4], None))


def test_a_miscompiling_triton_loses_the_64_wide_fused_tiles():
    assert [
        transposed_dot_miscompiles(v)
        for v in ("3.3.1", "3.4.0", "3.6.0", "3.7.0", "3.7.1", "3.9.0")
    ] == [False, True, True, True, False, False]
    for D in (64, 128):
        every = fused_configs(D, torch.bfloat16, version="3.9.0")
        kept = fused_configs(D, torch.bfloat16, version="3.6.0")
        assert any(64 in (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in every)
        assert kept == [c for c in every if 64 not in (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"])]
        assert kept  # a tile is always left
