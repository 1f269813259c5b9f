"""`fp.ops.rms_norm_gated` (``weight * rmsnorm(x) * act(z)``, Gated DeltaNet's and Kimi's
output norm) on both implementations against float64: forward, dx, dz, dweight; odd
widths, heads sharing the weight, strided inputs, fp32 and fp16, each gate; torch.compile
full-graph; bad input named."""

import pytest
import torch
from fusedpar.kernels.rms_norm import rms_norm_gated_reference
from hypothesis import example, given
from hypothesis import strategies as st

import fusedpar as fp
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds


def _inputs(shape, dtype, seed, strided):
    """x, z (..., D): strided ones are slices of a wider last dim (a fused projection's)."""
    if strided:
        both = randn((*shape[:-1], 2 * shape[-1] + 1), dtype, seed)
        return both[..., : shape[-1]], both[..., shape[-1] + 1 :]
    return randn(shape, dtype, seed), randn(shape, dtype, seed + 1)


@given(
    rows=st.integers(1, 9),
    heads=st.integers(1, 3),
    D=st.integers(1, 40),
    dtype=cpu_dtypes(),
    gate=st.sampled_from(["silu", "sigmoid"]),
    seed=seeds(),
    strided=st.booleans(),
)
@example(rows=5, heads=3, D=13, dtype=torch.float16, gate="silu", seed=0, strided=True)
@example(rows=1, heads=1, D=1, dtype=torch.float32, gate="sigmoid", seed=1, strided=False)
def test_matches_float64(rows, heads, D, dtype, gate, seed, strided, each_implementation):
    _check(rows, heads, D, dtype, gate, seed, strided)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("gate", ["silu", "sigmoid"])
def test_matches_float64_on_a_gpu(dtype, gate, triton_kernels):
    """Compiled, bf16 included, at Qwen3.5's value heads (32 of 128) and an odd width."""
    _check(300, 32, 128, dtype, gate, 0, True, "cuda")
    _check(100, 3, 1000, dtype, gate, 1, True, "cuda")


def _check(rows, heads, D, dtype, gate, seed, strided, device="cpu"):
    x, z = (t.to(device) for t in _inputs((rows, heads, D), dtype, seed, strided))
    weight = (randn((D,), dtype, seed + 2, scale=0.5) + 1.0).to(device)
    dy = randn(x.shape, dtype, seed + 3).to(x.device)
    leaves = [t.detach().clone().requires_grad_() for t in (x, z, weight)]
    y = fp.ops.rms_norm_gated(*leaves, eps=1e-6, gate=gate)
    y.backward(dy)
    results = []
    for dt in (torch.float64, dtype):  # the oracle, then PyTorch's own error in dtype
        ref_leaves = [t.detach().to(dt).requires_grad_() for t in (x, z, weight)]
        out = rms_norm_gated_reference(*ref_leaves, 1e-6, gate)
        out.backward(dy.to(dt))
        results.append((out.detach(), *(t.grad for t in ref_leaves)))
    assert y.dtype == dtype and y.shape == x.shape
    names = ("y", "dx", "dz", "dweight")
    outs, sums = (y, *(t.grad for t in leaves)), (None, D, None, rows * heads)
    for name, out, ref, ref_t, n in zip(names, outs, *results, sums, strict=True):
        assert_close(out, ref, ref_t, name=name, sum_length=n)


def test_some_gradients_and_no_grad(each_implementation):
    x, z = _inputs((4, 2, 8), torch.float32, 0, False)
    weight = randn((8,), torch.float32, 2).requires_grad_()
    y = fp.ops.rms_norm_gated(x, z.requires_grad_(), weight, eps=1e-5, gate="sigmoid")
    y.sum().backward()
    assert x.grad is None and z.grad.shape == z.shape and weight.grad.shape == (8,)
    with torch.no_grad():
        assert fp.ops.rms_norm_gated(x, z, weight, eps=1e-5).shape == x.shape


def test_compiles_full_graph(triton_kernels):
    """One graph (no break), the same values and gradients as eager."""
    x, z = (randn((3, 2, 16), torch.float32, s).requires_grad_() for s in (0, 1))
    weight = randn((16,), torch.float32, 2).requires_grad_()

    def f(x, z, weight):
        return fp.ops.rms_norm_gated(x, z, weight, eps=1e-6, gate="silu").square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    grads = [torch.autograd.grad(fn(x, z, weight), (x, z, weight)) for fn in (f, compiled)]
    for eager, comp in zip(*grads, strict=True):
        assert torch.equal(eager, comp)


@pytest.mark.parametrize(
    "x, z, weight, gate, error, match",
    [
        (torch.ones(3, 8), torch.ones(3, 7), torch.ones(8), "silu", ValueError, r"z \(3, 7\)"),
        (torch.ones(3, 8), torch.ones(3, 8), torch.ones(7), "silu", ValueError, r"weight \(7,\)"),
        (torch.ones(3, 8), torch.ones(3, 8), torch.ones(8), "gelu", ValueError, "'gelu'"),
        (torch.ones(3, 8), torch.ones(3, 8).int(), torch.ones(8), "silu", TypeError, "int32"),
    ],
)
def test_bad_input_is_named(x, z, weight, gate, error, match):
    with pytest.raises(error, match=match):
        fp.ops.rms_norm_gated(x, z, weight, eps=1e-6, gate=gate)
