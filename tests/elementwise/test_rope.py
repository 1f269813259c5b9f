"""fusedpar.kernels.rope (rotary embeddings, forward and backward) against float64:
full and partial rotary, strided views of a fused QKV projection, fp32 and fp16, odd
sizes, both implementations; tables that need a gradient take the PyTorch formula."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from fusedpar.nn.attention_parts import apply_rope, apply_rope_qk, rope_tables
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds

# Triton's kernels unless a test runs on each implementation (`each_implementation`).
pytestmark = pytest.mark.usefixtures("triton_kernels")


def _formula(x, cos, sin):
    """The rotation in plain PyTorch, in x's dtype (float64 in: the oracle)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    c, s = cos.to(x.dtype)[None, :, None], sin.to(x.dtype)[None, :, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half :]], -1)


@given(
    B=st.integers(1, 2),
    S=st.integers(1, 9),
    H=st.integers(1, 5),
    hd=st.sampled_from([8, 16, 24]),
    partial=st.booleans(),
    fused=st.booleans(),
    pair=st.booleans(),
    dtype=cpu_dtypes(),
    seed=seeds(),
)
@example(B=2, S=7, H=5, hd=24, partial=True, fused=True, pair=True, dtype=torch.float16, seed=0)
def test_rope_matches_float64(B, S, H, hd, partial, fused, pair, dtype, seed, each_implementation):
    """Output and dx: elementwise (two products a sum), so no sum_length. `pair`: q and
    k (max(1, H // 2) heads) in one launch each way (`apply_rope_qk`)."""
    rotary = hd // 2 if partial else hd
    rotary -= rotary % 2
    # fused: q, k head ranges of a (B, S, 2H + 1, hd) projection, strided views
    Hk = max(1, H // 2)
    full = randn((B, S, 2 * H + 1 if fused else H, hd), dtype, seed)
    x = (full[:, :, 1 : H + 1] if fused else full).detach().requires_grad_()
    other = full[:, :, H + 1 : H + 1 + Hk] if fused else randn((B, S, Hk, hd), dtype, seed + 2)
    xs = [x, other.detach().requires_grad_()] if pair else [x]
    cos, sin = rope_tables(torch.arange(S) * 3 + 1, rotary, 10000.0)
    dys = [randn(t.shape, dtype, seed + 3 + i) for i, t in enumerate(xs)]
    ys = apply_rope_qk(*xs, cos, sin) if pair else [apply_rope(x, cos, sin)]
    torch.autograd.backward(ys, dys)
    for i, (t, y, dy) in enumerate(zip(xs, ys, dys, strict=True)):
        refs = []
        for dt in (torch.float64, dtype):  # the oracle, then PyTorch's own error in dtype
            xr = t.detach().to(dt).requires_grad_()
            out = _formula(xr, cos, sin)
            out.backward(dy.to(dt))
            refs.append((out.detach(), xr.grad))
        assert y.dtype == dtype and y.shape == t.shape and y.is_contiguous()
        assert_close(y, refs[0][0], refs[1][0], name=f"y{i}")
        assert_close(t.grad, refs[0][1], refs[1][1], name=f"dx{i}")


def test_a_pair_with_one_output_used_gives_the_other_a_zero_gradient(each_implementation):
    q, k = (randn((1, 3, h, 8), torch.float32, h).requires_grad_() for h in (2, 1))
    cos, sin = rope_tables(torch.arange(3), 8, 100.0)
    rotated_q, _ = apply_rope_qk(q, k, cos, sin)
    rotated_q.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k)) and q.grad.abs().sum() > 0


def test_tables_that_need_a_gradient_get_it():
    x = randn((1, 4, 2, 8), torch.float32, 0)
    cos, sin = (t.clone().requires_grad_() for t in rope_tables(torch.arange(4), 8, 100.0))
    apply_rope(x, cos, sin).sum().backward()
    assert cos.grad is not None and sin.grad is not None


@pytest.mark.parametrize(
    "x, table, error, match",
    [
        ((1, 4, 2, 8), (3, 4), ValueError, "cos and sin must be"),
        ((1, 4, 2, 8), (4, 5), ValueError, "over the head dim"),
        ((4, 2, 8), (4, 4), ValueError, "x must be"),
    ],
)
def test_bad_input_is_named(x, table, error, match):
    from fusedpar.ops.attention import rope

    with pytest.raises(error, match=match):
        rope(torch.zeros(x), torch.zeros(table), torch.zeros(table))


def test_a_bad_pair_is_named():
    from fusedpar.kernels.rope import rope_pair

    table = torch.zeros(4, 4)
    with pytest.raises(ValueError, match=r"second tensor must be \(1, 4, H2, 8\)"):
        rope_pair(torch.zeros(1, 4, 2, 8), torch.zeros(1, 3, 2, 8), table, table)
    rope_pair(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 1, 8), table, table)  # planned
    with pytest.raises(ValueError, match="one dtype and device"):  # not the plan's: checked
        rope_pair(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 1, 8).half(), table, table)
