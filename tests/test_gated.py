"""fusedpar.kernels.gated (a dense MLP's act(gate) * up, forward and backward) against
float64: each activation, odd sizes, strided inputs, fp32 and fp16; the layer's path
through it, and an activation with no kernel through autograd, said once."""

import functools

import pytest
import torch
from fusedpar.kernels.gated import ACTIVATIONS, gated, gated_backward, gated_reference
from hypothesis import example, given
from hypothesis import strategies as st
from torch.nn import functional as F

from fusedpar.ops.linear import gated_down, kernel_activation
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds

# Triton's kernels unless a test runs on each implementation (`each_implementation`).
pytestmark = pytest.mark.usefixtures("triton_kernels")


@given(
    rows=st.integers(1, 9), N=st.integers(1, 40), dtype=cpu_dtypes(), seed=seeds(),
    strided=st.booleans(), activation=st.sampled_from(ACTIVATIONS),
)  # fmt: skip
@example(rows=3, N=37, dtype=torch.float16, seed=0, strided=True, activation="gelu_tanh")
def test_gated_matches_float64(rows, N, dtype, seed, strided, activation, each_implementation):
    """h, dgate and dup: elementwise, so no sum amplifies rounding (no sum_length)."""
    # (strided: a column slice of a wider (rows, 2N + 3) tensor, as a fused gate/up is)
    wide = randn((2, rows, 2 * N + 3), dtype, seed, scale=2.0)
    gate, up = (wide[:, :, 1 : N + 1], wide[:, :, N + 3 :]) if strided else (wide[:, :, :N],) * 2
    up = up if strided else randn(gate.shape, dtype, seed + 1)
    gate = gate if strided else gate.contiguous()
    dh = randn(gate.shape, dtype, seed + 2)
    h = gated(gate, up, activation)
    dgate, dup = gated_backward(dh, gate, up, activation)
    refs = []
    for dt in (torch.float64, dtype):  # the oracle, then PyTorch's own error in dtype
        g, u = (t.detach().to(dt).requires_grad_() for t in (gate, up))
        out = gated_reference(g, u, activation)
        out.backward(dh.to(dt))
        refs.append((out.detach(), g.grad, u.grad))
    for name, got, ref, same in zip(("h", "dgate", "dup"), (h, dgate, dup), *refs, strict=True):
        assert got.dtype == dtype and got.shape == gate.shape
        assert_close(got, ref, same, name=f"{name} ({activation})")


def test_the_layer_takes_the_kernel_for_its_activations():
    tanh_gelu = functools.partial(F.gelu, approximate="tanh")
    named = {F.silu: "silu", torch.nn.SiLU(): "silu", F.gelu: "gelu", tanh_gelu: "gelu_tanh",
             torch.nn.GELU(approximate="tanh"): "gelu_tanh", torch.nn.GELU(): "gelu"}  # fmt: skip
    assert all(kernel_activation(a) == name for a, name in named.items())


@pytest.mark.parametrize(
    "activation", [F.silu, lambda g: torch.tanh(g) * g], ids=["silu", "custom"]
)
def test_gated_down_with_and_without_a_kernel(activation, recwarn):
    """`gated_down` at one rank against float64, every gradient; an activation with no
    kernel runs through autograd and says so, once."""
    gate, up = (randn((5, 2, 12), torch.float32, i).requires_grad_() for i in (0, 1))
    weight = randn((7, 12), torch.float32, 2).requires_grad_()
    dy = randn((5, 2, 7), torch.float32, 3)
    for _ in range(2):
        y = gated_down(gate, up, weight, None, activation=activation, sequence_parallel=False)
    y.backward(dy)
    refs = []
    for dt in (torch.float64, torch.float32):
        g, u, w = (t.detach().to(dt).requires_grad_() for t in (gate, up, weight))
        out = F.linear(activation(g) * u, w)
        out.backward(dy.to(dt))
        refs.append((out.detach(), g.grad, u.grad, w.grad))
    got = (y, gate.grad, up.grad, weight.grad)
    for name, g, ref, same in zip(("y", "dgate", "dup", "dweight"), got, *refs, strict=True):
        # the dots: y's over the 12 hidden features, dh's over the 7 outputs, dweight's
        # over the 10 tokens
        assert_close(g, ref, same, name=name, sum_length={"y": 12, "dweight": 10}.get(name, 7))
    said = [w for w in recwarn if "no fused kernel" in str(w.message)]
    assert len(said) == (0 if activation is F.silu else 1)


@pytest.mark.parametrize(
    "gate, up, activation, error, match",
    [((2, 3), (2, 4), "silu", ValueError, "must share a shape"),
     ((2, 3), (2, 3), "relu", ValueError, "activation must be one of"),
     ((2, 3), (2, 3), "silu", TypeError, "gate is torch.float32")],
)  # fmt: skip
def test_bad_input_is_named(gate, up, activation, error, match):
    dtype = torch.float16 if error is TypeError else torch.float32
    with pytest.raises(error, match=match):
        gated(torch.zeros(gate), torch.zeros(up, dtype=dtype), activation)
