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

import fusedpar as fp
from fusedpar.ops.gated_down import gated_down, kernel_activation
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds

# Triton's kernels unless a test runs on each implementation (`each_implementation`).
pytestmark = pytest.mark.usefixtures("triton_kernels")


@given(
    rows=st.integers(1, 9),
    N=st.integers(1, 40),
    dtype=cpu_dtypes(),
    seed=seeds(),
    strided=st.booleans(),
    activation=st.sampled_from(ACTIVATIONS),
)
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
    named = {
        F.silu: "silu",
        torch.nn.SiLU(): "silu",
        F.gelu: "gelu",
        tanh_gelu: "gelu_tanh",
        torch.nn.GELU(approximate="tanh"): "gelu_tanh",
        torch.nn.GELU(): "gelu",
    }
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
    [
        ((2, 3), (2, 4), "silu", ValueError, "must share a shape"),
        ((2, 3), (2, 3), "relu", ValueError, "activation must be one of"),
        ((2, 3), (2, 3), "silu", TypeError, "gate is torch.float32"),
    ],
)
def test_bad_input_is_named(gate, up, activation, error, match):
    dtype = torch.float16 if error is TypeError else torch.float32
    with pytest.raises(error, match=match):
        gated(torch.zeros(gate), torch.zeros(up, dtype=dtype), activation)


@given(
    T=st.integers(1, 7),
    d=st.integers(1, 12),
    h=st.integers(1, 20),
    bias=st.booleans(),
    activation=st.sampled_from(ACTIVATIONS),
    dtype=cpu_dtypes(),
    seed=seeds(),
    frozen=st.sampled_from(
        [
            (),
            ("x",),
            ("up_weight",),
            ("gate_weight", "up_weight"),
            ("down_weight",),
            ("x", "gate_weight", "down_weight"),
        ]
    ),
)
@example(
    T=5,
    d=9,
    h=13,
    bias=True,
    activation="gelu_tanh",
    dtype=torch.float16,
    seed=0,
    frozen=("gate_weight",),
)
@example(
    T=3, d=4, h=5, bias=True, activation="silu", dtype=torch.float32, seed=1, frozen=("up_bias",)
)  # the bias gradients split apart: one of them asked for
@example(
    T=3,
    d=4,
    h=5,
    bias=True,
    activation="silu",
    dtype=torch.float32,
    seed=2,
    frozen=("gate_bias", "up_weight", "down_bias"),
)
def test_one_rank_swiglu_is_one_op_and_matches_float64(
    T, d, h, bias, activation, dtype, seed, frozen, each_implementation
):
    """`ParallelSwiGLU` on one rank (`fusedpar::gated_mlp`) against the dense MLP in
    float64: output and every gradient asked for, with biases re-drawn (never zero) and
    some inputs frozen (their gradients not asked for)."""
    act = {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    }[activation]
    layer = fp.nn.ParallelSwiGLU(d, h, bias=bias, activation=act, dtype=dtype)
    with torch.no_grad():
        for i, p in enumerate(layer.parameters()):
            p.copy_(randn(p.shape, dtype, seed + 1 + i))
    x = randn((T, 2, d), dtype, seed).requires_grad_("x" not in frozen)
    for name in frozen:
        if name != "x":
            getattr(layer, name).requires_grad_(False)
    dy = randn((T, 2, d), dtype, seed + 9)
    y = layer(x)
    y.backward(dy)
    names = [n for n, p in layer.named_parameters() if p.requires_grad]
    got = [y] + ([] if "x" in frozen else [x.grad]) + [layer.get_parameter(n).grad for n in names]
    refs = []
    for dt in (torch.float64, dtype):  # the oracle, then PyTorch's own error in dtype
        params = {
            n: p.detach().to(dt).requires_grad_(p.requires_grad)
            for n, p in layer.named_parameters()
        }
        xr = x.detach().to(dt).requires_grad_(x.requires_grad)
        bg, bu, bd = (params.get(f"{n}_bias") for n in ("gate", "up", "down"))
        gate, up = F.linear(xr, params["gate_weight"], bg), F.linear(xr, params["up_weight"], bu)
        hidden = act(gate) * up
        out = F.linear(hidden, params["down_weight"], bd)
        out.backward(dy.to(dt))
        grads = [] if "x" in frozen else [xr.grad]
        refs.append([out.detach(), *grads, *(params[n].grad for n in names)])
    labels = ["y"] + ([] if "x" in frozen else ["dx"]) + [f"d {n}" for n in names]
    for label, g, r64, r in zip(labels, got, *refs, strict=True):
        # dots: y over h, dx over h, the weights' over the 2T tokens
        length = 2 * T if label.startswith("d ") else h
        assert_close(g, r64, r, name=f"{label} ({activation})", sum_length=length)


def test_one_rank_swiglu_names_bad_input():
    layer = fp.nn.ParallelSwiGLU(6, 8)
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 6\), got \(3, 5\)"):
        layer(torch.zeros(3, 5))
    with pytest.raises(TypeError, match="x is torch.float16 but the weights are torch.float32"):
        layer(torch.zeros(3, 6, dtype=torch.float16))
