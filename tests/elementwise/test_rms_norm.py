"""fusedpar.kernels.rms_norm (forward and backward, with and without RoPE after it) and
`fp.nn.RMSNorm` against float64: odd widths, strided inputs, fp32 and fp16, random
weights, Gemma's offset, partial rotary; the weight's gradient the same bits on every run;
bad input named."""

import pytest
import torch
from fusedpar.kernels.rms_norm import rms_norm_backward, rms_norm_reference
from hypothesis import example, given
from hypothesis import strategies as st

import fusedpar as fp
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds

# Triton's kernels unless a test runs on each implementation (`each_implementation`).
pytestmark = pytest.mark.usefixtures("triton_kernels")


def _input(shape, dtype, seed, strided):
    """x (rows, D); strided ones are a transposed view with a gap between rows."""
    rows, D = shape
    if strided:
        return randn((D + 3, rows), dtype, seed)[:D].T
    return randn(shape, dtype, seed)


@given(
    rows=st.integers(1, 40),
    D=st.integers(1, 100),
    dtype=cpu_dtypes(),
    seed=seeds(),
    strided=st.booleans(),
    offset=st.sampled_from([0.0, 1.0]),
    weight_fp32=st.booleans(),
    lead=st.sampled_from([(), (2,)]),
)
@example(
    rows=1, D=1, dtype=torch.float32, seed=0, strided=False, offset=0.0, weight_fp32=False, lead=()
)
@example(
    rows=33,
    D=67,
    dtype=torch.float16,
    seed=1,
    strided=True,
    offset=1.0,
    weight_fp32=False,
    lead=(2,),
)
# one feature, x^2 >> eps: dx's bracket 1 - xhat^2 cancelled to 3.7x PyTorch's error (CI)
@example(
    rows=29,
    D=1,
    dtype=torch.float32,
    seed=36524,
    strided=False,
    offset=1.0,
    weight_fp32=False,
    lead=(),
)
def test_rms_norm_matches_float64(
    rows, D, dtype, seed, strided, offset, weight_fp32, lead, each_implementation
):
    _check_against_float64(rows, D, dtype, seed, strided, offset, weight_fp32, lead)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("D", [4096, 8192, 1000])
def test_rms_norm_matches_float64_on_a_gpu(dtype, D):
    """Compiled, bf16 included, at model widths (and an odd one), strided."""
    _check_against_float64(300, D, dtype, 0, True, 0.0, False, (2,), device="cuda")


def _check_against_float64(rows, D, dtype, seed, strided, offset, weight_fp32, lead, device="cpu"):
    x = _input((rows * (lead[0] if lead else 1), D), dtype, seed, strided).to(device)
    x = x.reshape(*lead, rows, D) if lead else x
    w_dtype = torch.float32 if weight_fp32 else dtype
    weight = (randn((D,), w_dtype, seed + 1, scale=0.5) + 0.2).to(device)
    _check_norm(x, weight, offset, seed)


def _check_norm(x, weight, offset, seed, rope=None):
    """fp.rms_norm's y, dx and dweight (with `rope`'s rotation) against float64."""
    dtype, D, eps = x.dtype, x.shape[-1], 1e-5
    dy = randn(x.shape, dtype, seed + 2).to(x.device)
    x_ = x.detach().clone().requires_grad_()
    w_ = weight.clone().requires_grad_()
    y = fp.rms_norm(x_, w_, eps, offset=offset, rope=rope)
    y.backward(dy)

    grads = []
    for dt in (torch.float64, dtype):  # the oracle, then PyTorch's own error in dtype
        xr = x.detach().to(dt).requires_grad_()
        wr = weight.to(dt).requires_grad_()
        out = rms_norm_reference(xr, wr, eps, offset, rope)
        out.backward(dy.to(dt))
        grads.append((out.detach(), xr.grad, wr.grad))
    (ref, dx_ref, dw_ref), (ref_t, dx_t, dw_t) = grads
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, ref, ref_t, name="y")
    assert_close(x_.grad, dx_ref, dx_t, name="dx", sum_length=D)
    assert w_.grad.dtype == weight.dtype
    assert_close(w_.grad.to(dtype), dw_ref, dw_t, name="dweight", sum_length=x.numel() // D)


@given(
    S=st.integers(1, 9),
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    D=st.integers(2, 40),
    rotated=st.floats(0.0, 1.0),
    dtype=cpu_dtypes(),
    seed=seeds(),
    batch_first=st.booleans(),
    offset=st.sampled_from([0.0, 1.0]),
)
@example(
    S=5, B=2, H=3, D=16, rotated=1.0, dtype=torch.float16, seed=0, batch_first=True, offset=0.0
)
@example(
    S=3, B=1, H=2, D=13, rotated=0.5, dtype=torch.float32, seed=1, batch_first=False, offset=1.0
)
def test_rms_norm_with_rope_matches_float64(
    S, B, H, D, rotated, dtype, seed, batch_first, offset, each_implementation
):
    """A q/k head norm with RoPE after it (``rope=``): x (S, B, H, hd) as attention's
    projection gives it, or a transposed view of a batch-first one (rows that do not
    flatten: copied); the first r = 2 * half <= hd dims rotate, the rest pass."""
    half = max(1, round(rotated * (D // 2)))
    angles = randn((S, half), torch.float32, seed + 3, scale=3.0)
    rope = (angles.cos(), angles.sin())
    shape = (B, S, H, D) if batch_first else (S, B, H, D)
    x = randn(shape, dtype, seed)
    x = x.transpose(0, 1) if batch_first else x
    weight = randn((D,), dtype, seed + 1, scale=0.5) + 0.2
    _check_norm(x, weight, offset, seed, rope)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rotary", [128, 64])
def test_head_norm_with_rope_on_a_gpu(dtype, rotary):
    """Compiled: a q/k head norm of Llama's heads (hd 128) turned by RoPE, all or half of
    each head, over a (S, B, H, hd) projection."""
    S, B, H, hd = 300, 2, 8, 128
    angles = randn((S, rotary // 2), torch.float32, 3, scale=3.0).cuda()
    x = randn((S, B, H, hd), dtype, 0).cuda()
    weight = (randn((hd,), dtype, 1, scale=0.5) + 0.2).cuda()
    _check_norm(x, weight, 0.0, 0, (angles.cos(), angles.sin()))


def test_rope_without_a_position_dim_first_is_named():
    x, weight = torch.ones(4, 3, 8), torch.ones(8)
    with pytest.raises(ValueError, match=r"\(S=4, r/2\).*\(3, 2\)"):
        fp.rms_norm(x, weight, rope=(torch.ones(3, 2), torch.ones(3, 2)))
    with pytest.raises(ValueError, match="10 rotated dims, over the head dim 8"):
        fp.rms_norm(x, weight, rope=(torch.ones(4, 5), torch.ones(4, 5)))
    with pytest.raises(TypeError, match="float32"):
        fp.rms_norm(x, weight, rope=(torch.ones(4, 2).double(), torch.ones(4, 2).double()))
    with pytest.raises(ValueError, match="no gradient"):
        fp.rms_norm(x, weight, rope=(torch.ones(4, 2, requires_grad=True), torch.ones(4, 2)))


def test_weight_gradient_is_deterministic_and_rstd_is_one_per_row(each_implementation):
    """Two backwards give the same bits (per-program partial rows summed in order, no
    atomics); the backward takes x and the fp32 rstd only."""
    x, weight = randn((37, 24), torch.float16, 0), randn((24,), torch.float16, 1)
    dy = randn((37, 24), torch.float16, 2)
    y, rstd = fp.kernels.rms_norm.rms_norm(x, weight)
    assert rstd.shape == (37,) and rstd.dtype == torch.float32
    first = rms_norm_backward(dy, x, weight, rstd, eps=1e-5)
    second = rms_norm_backward(dy, x, weight, rstd, eps=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    dx, dw = rms_norm_backward(dy, x, weight, rstd, eps=1e-5, need_x=False)
    assert dx is None and torch.equal(dw, first[1])


def test_zero_rows_and_no_grad(each_implementation):
    weight = randn((8,), torch.float32, 0).requires_grad_()
    x = torch.empty((0, 8), requires_grad=True)
    y = fp.rms_norm(x, weight)
    y.sum().backward()
    assert y.shape == (0, 8) and torch.equal(weight.grad, torch.zeros(8))
    with torch.no_grad():
        assert fp.rms_norm(randn((3, 8), torch.float32, 1), weight).shape == (3, 8)


def test_layer_is_a_drop_in_for_the_example_norm():
    """The same state_dict as a Llama-style RMSNorm (one `weight`); ``offset + weight``
    starts at one; the output equals the float64 reference within the rule."""
    norm = fp.nn.RMSNorm(16, eps=1e-6)
    dense = torch.nn.RMSNorm(16, eps=1e-6)
    assert norm.state_dict().keys() == dense.state_dict().keys()
    with torch.no_grad():
        dense.weight.copy_(randn((16,), torch.float32, 0))
    norm.load_state_dict(dense.state_dict())
    x = randn((5, 16), torch.float32, 1)
    ref = rms_norm_reference(x.double(), dense.weight.double(), 1e-6)
    assert_close(norm(x), ref, dense(x).detach())
    gemma = fp.nn.RMSNorm(16, offset=1.0)
    assert torch.equal(gemma.weight, torch.zeros(16)) and "offset=1.0" in repr(gemma)


@pytest.mark.parametrize(
    "x, weight, error, match",
    [
        (torch.ones(3, 8), torch.ones(7), ValueError, r"x \(3, 8\) and weight \(7,\)"),
        (torch.ones(3, 8), torch.ones(8, 1), ValueError, r"weight \(8, 1\)"),
        (torch.ones(3, 8, dtype=torch.int32), torch.ones(8), TypeError, "int32"),
        (torch.ones(1, 70000), torch.ones(70000), ValueError, "70000 features"),
    ],
)
def test_bad_input_is_named(x, weight, error, match):
    with pytest.raises(error, match=match):
        fp.rms_norm(x, weight)


def test_the_kernels_are_tuned_against_torch(monkeypatch):
    """On CUDA under ``auto`` each kernel's tile and the torch implementation are timed
    per key (here on the CPU, the tuner's path forced): the interpreter loses, and the
    results are the torch implementation's bits."""
    from fusedpar.kernels import impl, tuning
    from fusedpar.kernels.rms_norm import rms_norm

    x, weight = randn((9, 40), torch.float16, 0), randn((40,), torch.float16, 1)
    dy = randn((9, 40), torch.float16, 2)

    def run():
        y, rstd = rms_norm(x, weight, 1e-5, 1.0)
        return (y, rstd, *rms_norm_backward(dy, x, weight, rstd, 1.0, eps=1e-5))

    with fp.implementation("torch"):
        expected = run()
    tuning.forget_picks()
    monkeypatch.setattr(impl, "runs_torch", lambda device: False)
    with fp.implementation("auto"):
        tuned = run()
    assert all(torch.equal(a, b) for a, b in zip(tuned, expected, strict=True))
    picks = tuning.all_picks()
    for kernel in ("_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel"):
        assert list(picks[kernel].values()) == [{"implementation": "torch"}]
