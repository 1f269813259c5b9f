"""fusedpar.kernels.rope (rotary embeddings, forward and backward) against float64:
full and partial rotary, strided views of a fused QKV projection, fp32 and fp16, odd
sizes, both implementations; tables that need a gradient take the PyTorch formula."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from fusedpar.nn.attention_parts import apply_rope, rope_tables
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
    B=st.integers(1, 2), S=st.integers(1, 9), H=st.integers(1, 5),
    hd=st.sampled_from([8, 16, 24]), partial=st.booleans(), fused=st.booleans(),
    dtype=cpu_dtypes(), seed=seeds(),
)  # fmt: skip
@example(B=2, S=7, H=5, hd=24, partial=True, fused=True, dtype=torch.float16, seed=0)
def test_rope_matches_float64(B, S, H, hd, partial, fused, dtype, seed, each_implementation):
    """Output and dx: elementwise (two products a sum), so no sum_length."""
    rotary = hd // 2 if partial else hd
    rotary -= rotary % 2
    # fused: this head range of a (B, S, 2H + 1, hd) projection, a strided view
    full = randn((B, S, 2 * H + 1 if fused else H, hd), dtype, seed)
    x = (full[:, :, 1 : H + 1] if fused else full).detach().requires_grad_()
    cos, sin = rope_tables(torch.arange(S) * 3 + 1, rotary, 10000.0)
    dy = randn((B, S, H, hd), dtype, seed + 1)
    y = apply_rope(x, cos, sin)
    y.backward(dy)
    refs = []
    for dt in (torch.float64, dtype):  # the oracle, then PyTorch's own error in dtype
        xr = x.detach().to(dt).requires_grad_()
        out = _formula(xr, cos, sin)
        out.backward(dy.to(dt))
        refs.append((out.detach(), xr.grad))
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert_close(y, refs[0][0], refs[1][0], name="y")
    assert_close(x.grad, refs[0][1], refs[1][1], name="dx")


def test_tables_that_need_a_gradient_get_it():
    x = randn((1, 4, 2, 8), torch.float32, 0)
    cos, sin = (t.clone().requires_grad_() for t in rope_tables(torch.arange(4), 8, 100.0))
    apply_rope(x, cos, sin).sum().backward()
    assert cos.grad is not None and sin.grad is not None


@pytest.mark.parametrize(
    "x, table, error, match",
    [((1, 4, 2, 8), (3, 4), ValueError, "cos and sin must be"),
     ((1, 4, 2, 8), (4, 5), ValueError, "over the head dim"),
     ((4, 2, 8), (4, 4), ValueError, "x must be")],
)  # fmt: skip
def test_bad_input_is_named(x, table, error, match):
    from fusedpar.ops.attention import rope

    with pytest.raises(error, match=match):
        rope(torch.zeros(x), torch.zeros(table), torch.zeros(table))
