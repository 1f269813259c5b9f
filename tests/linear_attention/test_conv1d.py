"""`fp.ops.causal_conv1d` on both implementations against the float64 loop: y, final
states and the gradients of x, weight, bias and initial states (from y and the final
states); odd sizes, T = 1, 3, 65, every width up to 4, packed documents (each alone equals
the packed run), continuation by final states, strided inputs, fp32 and fp16;
torch.compile full-graph; bad input named."""

import pytest
import torch
from fusedpar.kernels.linear_attention.conv1d import causal_conv1d_reference
from hypothesis import example, given
from hypothesis import strategies as st

import fusedpar as fp
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds

NAMES = ("x", "weight", "bias", "initial_states")


def _x(B, T, C, dtype, seed, strided):
    """x (B, T, C); strided: a (B, C, T) tensor's transpose (no unit stride on C)."""
    if strided:
        return randn((B, C, T), dtype, seed).transpose(1, 2)
    return randn((B, T, C), dtype, seed)


def _check(x, weight, bias, initial_states, cu_seqlens, activation, final, seed):
    """The op's outputs and gradients against the float64 loop (the tolerance rule,
    PyTorch's error: the loop in x's dtype); returns them."""
    dtype, N = x.dtype, x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    C, W = weight.shape
    dy = randn(x.shape, dtype, seed + 10).to(x.device)
    dfinal = randn((N, C, W - 1), dtype, seed + 11).to(x.device)
    inputs = (x, weight, bias, initial_states)
    runs = []
    for dt, op in ((None, fp.ops.causal_conv1d), (torch.float64, None), (dtype, None)):
        leaves = [
            None if t is None else t.detach().to(dt or t.dtype).requires_grad_() for t in inputs
        ]
        if op is None:
            y, fin = causal_conv1d_reference(*leaves[:3], activation, cu_seqlens, leaves[3], final)
        else:
            kw = dict(activation=activation, cu_seqlens=cu_seqlens, output_final_states=final)
            y, fin = op(*leaves[:3], initial_states=leaves[3], **kw)
        loss = (y * dy.to(y.dtype)).sum() + (0 if fin is None else (fin * dfinal.to(y.dtype)).sum())
        loss.backward()
        runs.append((y, fin, *(None if t is None else t.grad for t in leaves)))
    (out, ref, ref_t), sums = runs, (None, None, W, x.shape[0] * x.shape[1], x.shape[1], W)
    for name, o, r, r_t, n in zip(("y", "final", *NAMES), out, ref, ref_t, sums, strict=True):
        if r is None:
            assert o is None, name
            continue
        assert o.dtype == r_t.dtype, name
        assert_close(o, r, r_t.detach(), name=name, sum_length=n)
    return out


@given(
    B=st.integers(1, 2),
    T=st.sampled_from([1, 3, 65]) | st.integers(1, 20),
    C=st.integers(1, 19),
    W=st.integers(1, 4),
    dtype=cpu_dtypes(),
    seed=seeds(),
    strided=st.booleans(),
    bias=st.booleans(),
    activation=st.sampled_from(["silu", None]),
    initial=st.booleans(),
    final=st.booleans(),
)
@example(
    B=2,
    T=65,
    C=13,
    W=4,
    dtype=torch.float16,
    seed=0,
    strided=True,
    bias=True,
    activation="silu",
    initial=True,
    final=True,
)
@example(
    B=1,
    T=1,
    C=3,
    W=4,
    dtype=torch.float32,
    seed=1,
    strided=False,
    bias=False,
    activation=None,
    initial=True,
    final=True,
)
def test_matches_float64(
    B, T, C, W, dtype, seed, strided, bias, activation, initial, final, each_implementation
):
    x = _x(B, T, C, dtype, seed, strided)
    weight = randn((W, C), dtype, seed + 1, scale=0.5).T  # (C, W), channels strided
    b = randn((C,), dtype, seed + 2) if bias else None
    init = randn((B, W - 1, C), dtype, seed + 3).transpose(1, 2) if initial else None
    if not strided:
        weight, init = weight.contiguous(), None if init is None else init.contiguous()
    _check(x, weight, b, init, None, activation, final, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("states", [False, True])
def test_matches_float64_on_a_gpu(dtype, states, triton_kernels):
    """Compiled, bf16 included, at a model's width (Qwen3.5's q|k|v: 8192 channels, and
    an odd one), strided, packed with states."""
    for C in (8192, 1000):
        x = _x(1, 700, C, dtype, 0, True).cuda()
        weight, bias = randn((C, 4), dtype, 1).cuda(), randn((C,), dtype, 2).cuda()
        cu = torch.tensor([0, 1, 64, 699, 700], dtype=torch.int32).cuda() if states else None
        init = randn((4 if states else 1, C, 3), dtype, 3).cuda() if states else None
        _check(x, weight, bias if states else None, init, cu, "silu", states, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_packed_documents_each_alone(dtype, each_implementation):
    """Documents of 1, 3, 0 and 62 tokens packed: against float64, and each document run
    alone (with its own initial states) gives its slice of y and of every gradient, its
    final states, the same bits; the weight's gradients sum over the documents."""
    lengths, C, W, seed = [1, 3, 0, 62], 11, 4, 7
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = _x(1, sum(lengths), C, dtype, seed, True)
    weight, bias = randn((C, W), dtype, seed + 1), randn((C,), dtype, seed + 2)
    init = randn((len(lengths), C, W - 1), dtype, seed + 3)
    y, final, dx, dw, db, dinit = _check(x, weight, bias, init, cu, "silu", True, seed)
    dy, dfinal = randn(x.shape, dtype, seed + 10), randn(final.shape, dtype, seed + 11)
    sums = [torch.zeros(C, W, dtype=torch.float64), torch.zeros(C, dtype=torch.float64)]
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        leaves = [
            t.detach().clone().requires_grad_() for t in (x[:, s:e], weight, bias, init[n : n + 1])
        ]
        y_n, final_n = fp.ops.causal_conv1d(
            *leaves[:3], initial_states=leaves[3], output_final_states=True
        )
        ((y_n * dy[:, s:e]).sum() + (final_n * dfinal[n : n + 1]).sum()).backward()
        assert torch.equal(y_n, y[:, s:e]) and torch.equal(final_n, final[n : n + 1])
        assert torch.equal(leaves[0].grad, dx[:, s:e]) and torch.equal(
            leaves[3].grad, dinit[n : n + 1]
        )
        sums[0] += leaves[1].grad.double()
        sums[1] += leaves[2].grad.double()
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(dw.double(), sums[0], rtol=tol, atol=tol)
    torch.testing.assert_close(db.double(), sums[1], rtol=tol, atol=tol)


def test_final_states_continue_the_sequence(each_implementation):
    """Cutting a sequence anywhere (even into pieces shorter than W - 1) and passing each
    piece's final states on as the next one's initial states gives the whole run's y."""
    x, weight = randn((2, 9, 5), torch.float32, 0), randn((5, 4), torch.float32, 1)
    whole, whole_final = fp.ops.causal_conv1d(x, weight, output_final_states=True)
    pieces, states = [], None
    for s, e in ((0, 1), (1, 3), (3, 4), (4, 9)):
        y, states = fp.ops.causal_conv1d(
            x[:, s:e], weight, initial_states=states, output_final_states=True
        )
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=0, atol=1e-6)
    assert torch.equal(states, whole_final) and torch.equal(states, x[:, -3:].transpose(1, 2))


def test_compiles_full_graph(triton_kernels):
    """One graph (no break) with packed documents and states; eager's values and
    gradients."""
    x = randn((1, 10, 6), torch.float32, 0).requires_grad_()
    weight, bias = randn((6, 4), torch.float32, 1).requires_grad_(), randn((6,), torch.float32, 2)
    init = randn((3, 6, 3), torch.float32, 3).requires_grad_()
    cu = torch.tensor([0, 2, 9, 10], dtype=torch.int32)

    def f(x, weight, init):
        y, final = fp.ops.causal_conv1d(
            x, weight, bias, cu_seqlens=cu, initial_states=init, output_final_states=True
        )
        return y.square().sum() + final.sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    grads = [torch.autograd.grad(fn(x, weight, init), (x, weight, init)) for fn in (f, compiled)]
    for eager, comp in zip(*grads, strict=True):
        assert torch.equal(eager, comp)


CU = torch.tensor([0, 2, 5], dtype=torch.int32)


@pytest.mark.parametrize(
    "x, weight, kwargs, error, match",
    [
        (
            torch.ones(2, 5, 3),
            torch.ones(4, 4),
            {},
            ValueError,
            r"x \(2, 5, 3\) and weight \(4, 4\)",
        ),
        (torch.ones(5, 3), torch.ones(3, 4), {}, ValueError, r"x \(5, 3\)"),
        (torch.ones(1, 5, 3), torch.ones(3, 5), {}, ValueError, "width 5"),
        (torch.ones(1, 5, 3), torch.ones(3, 4), {"bias": torch.ones(4)}, ValueError, r"\(3,\)"),
        (torch.ones(1, 5, 3), torch.ones(3, 4), {"activation": "relu"}, ValueError, "'relu'"),
        (torch.ones(2, 5, 3), torch.ones(3, 4), {"cu_seqlens": CU}, ValueError, "B = 1"),
        (torch.ones(1, 5, 3), torch.ones(3, 4), {"cu_seqlens": CU.long()}, TypeError, "int32"),
        (torch.ones(1, 6, 3), torch.ones(3, 4), {"cu_seqlens": CU}, ValueError, "total length 6"),
        (
            torch.ones(1, 5, 3),
            torch.ones(3, 4),
            {"cu_seqlens": CU, "initial_states": torch.ones(1, 3, 3)},
            ValueError,
            r"\(2, 3, 3\), got \(1, 3, 3\)",
        ),
        (
            torch.ones(1, 5, 3),
            torch.ones(3, 4),
            {"initial_states": torch.ones(1, 3, 3).half()},
            TypeError,
            "float16",
        ),
        (torch.ones(1, 5, 3).int(), torch.ones(3, 4), {}, TypeError, "int32"),
    ],
)
def test_bad_input_is_named(x, weight, kwargs, error, match):
    with pytest.raises(error, match=match):
        fp.ops.causal_conv1d(x, weight, **kwargs)
