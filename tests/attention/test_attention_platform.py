"""PyTorch's own attention kernels as tuner candidates (`fusedpar.kernels.attention.torch_impl`):
which calls they are offered for, their calls' shapes and arguments (on the "meta" device,
where the aten ops run their shape functions), and on a GPU each against float64."""

import pytest
import torch
from fusedpar.kernels import tuning
from fusedpar.kernels.attention import (
    AttentionMask,
    attention_forward,
    attention_reference,
    mask_arguments,
)
from fusedpar.kernels.attention import backward_fused as backwards
from fusedpar.kernels.attention import torch_impl as platform

import fusedpar as fp
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import randn
from tests.attention.helpers import attention_grads, torch_results


def _scores(q, k, v=None, **mask):
    return mask_arguments(q, k, k if v is None else v, AttentionMask(**mask), "query")[-1]


def _meta(shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(
    "mask, Sq, Skv, Hkv, D, dtype, offered",
    [
        ({}, 64, 80, 4, 128, torch.bfloat16, ["sdpa-flash", "sdpa-cudnn"]),
        ({"causal": True}, 64, 64, 4, 64, torch.float16, ["sdpa-flash", "sdpa-cudnn"]),
        ({"causal": True}, 64, 80, 4, 64, torch.bfloat16, []),  # bottom-right != top-left
        ({"window": (15, 0)}, 64, 64, 4, 64, torch.bfloat16, []),
        ({"softcap": 30.0}, 64, 64, 4, 64, torch.bfloat16, []),
        ({}, 64, 64, 2, 64, torch.bfloat16, ["sdpa-flash"]),  # GQA: flash only
        ({}, 64, 64, 4, 256, torch.bfloat16, ["sdpa-flash"]),  # D > 128: flash only
        ({}, 64, 64, 4, 64, torch.float32, []),
    ],
)
def test_which_calls_are_offered(mask, Sq, Skv, Hkv, D, dtype, offered):
    q, out = _meta((2, Sq, 4, D), dtype), _meta((2, Sq, 4, D), dtype)
    k = v = _meta((2, Skv, Hkv, D), dtype)
    lse = _meta((2, 4, Sq), torch.float32)
    scores = _scores(q, k, **mask)
    found = platform.forward_candidates(q, k, v, scores, out, lse, merge=False)
    assert [c.name for c in found] == offered
    assert not platform.forward_candidates(q, k, v, scores, out.float(), lse, merge=True)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    back = platform.backward_candidates(out, q, k, v, out, lse, scores, grads, None, False)
    assert [c.name for c in back] == offered
    # an LSE gradient, added-into or fp32 gradients: none of theirs
    assert not platform.backward_candidates(out, q, k, v, out, lse, scores, grads, lse, False)
    assert not platform.backward_candidates(out, q, k, v, out, lse, scores, grads, None, True)
    wide = [torch.empty_like(t, dtype=torch.float32) for t in (q, k, v)]
    assert not platform.backward_candidates(out, q, k, v, out, lse, scores, wide, None, False)
    cpu = torch.empty(q.shape, dtype=dtype)
    assert not platform.forward_candidates(cpu, cpu, cpu, scores, cpu, lse, merge=False)


def test_none_is_offered_for_v_of_its_own_head_dim():
    """V narrower than Q and K (MLA): neither SDPA kernel computes it unpadded."""
    q, k = _meta((2, 64, 4, 128)), _meta((2, 64, 4, 128))
    v, out = _meta((2, 64, 4, 64)), _meta((2, 64, 4, 64))
    lse = _meta((2, 4, 64), torch.float32)
    scores = _scores(q, k, v)
    assert not platform.forward_candidates(q, k, v, scores, out, lse, merge=False)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    assert not platform.backward_candidates(out, q, k, v, out, lse, scores, grads, None, False)


@pytest.mark.parametrize("causal", [False, True])
def test_the_calls_take_our_layout(causal):
    """Every candidate runs on meta tensors: the aten ops accept the (B, H, S, D) views
    of our tensors and the arguments given, and what comes back fits our buffers."""
    q = _meta((2, 64, 4, 64)).transpose(1, 2).contiguous().transpose(1, 2)  # any strides
    k = v = _meta((2, 64, 4, 64))
    out, lse = _meta((2, 64, 4, 64)), _meta((2, 4, 64), torch.float32)
    scores = _scores(q, k, causal=causal)
    for run in platform.forward_candidates(q, k, v, scores, out, lse, merge=False).values():
        run()
    grads = [torch.empty_like(t) for t in (q, k, v)]
    for run in platform.backward_candidates(
        out, q, k, v, out, lse, scores, grads, None, False
    ).values():
        run()


def test_the_ops_pass_no_lse_gradient_when_the_lse_is_unused(monkeypatch, triton_kernels):
    """flash_attn's backward gets dlse None when its LSE took no gradient (PyTorch's
    kernels can then run it), and the LSE's gradient when it did."""
    seen = []
    real = backwards.attention_backward_fused
    monkeypatch.setattr(
        backwards,
        "attention_backward_fused",
        lambda *a, **kw: seen.append(kw["delta_from"][1]) or real(*a, **kw),
    )
    q = randn((1, 9, 2, 8), torch.float32, 0).requires_grad_()
    k, v = (randn((1, 9, 2, 8), torch.float32, i).requires_grad_() for i in (1, 2))
    fp.flash_attn(q, k, v).sum().backward()
    out, lse = fp.flash_attn(q, k, v, return_lse=True)
    lse.sum().backward()  # the LSE alone: dO is zeros
    assert seen[0] is None and seen[1] is not None


# --- the GPU tier: each candidate forced, against float64 --------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("candidate", [platform.FLASH, platform.CUDNN], ids=lambda c: c.name)
@pytest.mark.parametrize("Hkv", [8, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_platform_candidates_gpu(candidate, Hkv, causal):
    if candidate is platform.CUDNN and Hkv != 8:
        pytest.skip("cuDNN is offered for MHA only")
    q = randn((2, 1000, 8, 128), torch.bfloat16, 0).cuda()
    k, v = (randn((2, 1000, Hkv, 128), torch.bfloat16, i).cuda() for i in (1, 2))
    dout = randn(q.shape, torch.bfloat16, 3).cuda()
    no_dlse = torch.zeros((2, 8, 1000), device="cuda")
    with (
        fp.implementation("auto"),
        tuning.forced("_attn_fwd_kernel", candidate),
        tuning.forced("attention_backward", candidate),
    ):

        def attend(*t):  # the LSE takes no gradient: PyTorch's backward may run
            lse = attention_forward(*(x.detach() for x in t), AttentionMask(causal))[1]
            return fp.flash_attn(*t, causal=causal), lse

        got = attention_grads(attend, (q, k, v), dout, no_dlse)
    ref = attention_grads(
        lambda *t: attention_reference(*t, AttentionMask(causal)),
        [t.double() for t in (q, k, v)],
        dout,
        no_dlse,
    )
    same = torch_results((q, k, v), dout, no_dlse, ref, causal=causal)
    for name, g, r, t in zip(("out", "lse", "dq", "dk", "dv"), got, ref, same, strict=True):
        assert_close(
            g,
            r,
            t,
            name=f"{name} ({candidate.name})",
            sum_length=128 if name.startswith("d") else None,
        )
