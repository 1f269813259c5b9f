"""fusedpar.kernels.matmul against float64, with odd sizes, strides, slices, accumulation,
heads rotated in the epilogue and the gated MLP's GEMMs (`matmul_gated`)."""

import pytest
import torch
from fusedpar.kernels import matmul as matmul_module
from fusedpar.kernels.gated import (
    ACTIVATIONS,
    gated,
    gated_backward,
    gated_reference,
    gated_torch,
)
from fusedpar.kernels.matmul import RowRotation, matmul
from fusedpar.kernels.matmul_gated import gated_grad_matmul, gated_matmul, gated_up_matmul
from fusedpar.kernels.matmul_torch import matmul_reference
from hypothesis import example, given
from hypothesis import strategies as st

import fusedpar as fp
from fusedpar.nn.attention_parts import apply_rope, rope_tables
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds

# Triton's kernels unless a test runs on each implementation (`each_implementation`).
pytestmark = pytest.mark.usefixtures("triton_kernels")


def _operand(shape, dtype, seed, transposed):
    """A (rows, cols) operand; transposed ones are views of a (cols, rows) tensor."""
    if transposed:
        return randn(shape[::-1], dtype, seed).T
    return randn(shape, dtype, seed)


@given(
    M=st.integers(1, 80),
    N=st.integers(1, 80),
    K=st.integers(1, 80),
    dtype=cpu_dtypes(),
    seed=seeds(),
    a_t=st.booleans(),
    b_t=st.booleans(),
    bias=st.booleans(),
    mode=st.sampled_from(["new", "slice", "accumulate-fp32", "accumulate"]),
)
@example(M=1, N=1, K=1, dtype=torch.float32, seed=0, a_t=False, b_t=False, bias=True, mode="new")
@example(
    M=65,
    N=33,
    K=17,
    dtype=torch.float16,
    seed=1,
    a_t=True,
    b_t=True,
    bias=True,
    mode="accumulate-fp32",
)
@example(
    M=7, N=70, K=64, dtype=torch.float32, seed=2, a_t=False, b_t=True, bias=False, mode="slice"
)
def test_matmul_matches_float64(M, N, K, dtype, seed, a_t, b_t, bias, mode, each_implementation):
    a = _operand((M, K), dtype, seed, a_t)
    b = _operand((K, N), dtype, seed + 1, b_t)
    bias_t = randn((N,), dtype, seed + 2) if bias else None
    kwargs = {"bias": bias_t}
    if mode == "slice":  # write into a window of a larger buffer, strides untouched
        big = randn((M + 5, N + 7), dtype, seed + 3)
        kwargs["out"] = big[2 : 2 + M, 3 : 3 + N]
    elif mode.startswith("accumulate"):
        out_dtype = torch.float32 if mode == "accumulate-fp32" else dtype
        kwargs.update(out=randn((M, N), out_dtype, seed + 3), accumulate=True)
    before = kwargs["out"].clone() if "out" in kwargs else None

    ref = matmul_reference(
        a.double(),
        b.double(),
        bias=None if bias_t is None else bias_t.double(),
        out=before,
        accumulate=kwargs.get("accumulate", False),
    )
    expected_torch = matmul_reference(
        a, b, out=before, **{k: v for k, v in kwargs.items() if k != "out"}
    )
    c = matmul(a, b, **kwargs)

    assert_close(c, ref, expected_torch, name="C")
    if mode == "slice":
        assert c.data_ptr() == kwargs["out"].data_ptr()
        mask = torch.ones_like(big, dtype=torch.bool)
        mask[2 : 2 + M, 3 : 3 + N] = False
        assert torch.equal(big[mask], randn((M + 5, N + 7), dtype, seed + 3)[mask])  # rest intact


def _rotated(c, rope: RowRotation, head_dim):
    """The oracle of a rotating epilogue: c (M, N) as one sequence of M positions' heads,
    turned by `apply_rope` (the PyTorch formula in float64) with each row's table row."""
    M, N = c.shape
    positions = (rope.first_row + torch.arange(M)) // rope.rows_per_position
    heads = c.view(1, M, N // head_dim, head_dim)
    return apply_rope(heads, rope.cos[positions], rope.sin[positions]).view(M, N)


@given(
    M=st.integers(1, 40),
    K=st.integers(1, 40),
    heads=st.integers(1, 3),
    head_dim=st.sampled_from([2, 8, 16, 64]),
    per_position=st.integers(1, 3),
    first_row=st.integers(0, 5),
    dtype=cpu_dtypes(),
    seed=seeds(),
    b_t=st.booleans(),
    bias=st.booleans(),
    into_slice=st.booleans(),
)
@example(
    M=70,
    K=33,
    heads=2,
    head_dim=64,
    per_position=2,
    first_row=3,
    dtype=torch.float16,
    seed=0,
    b_t=True,
    bias=True,
    into_slice=True,
)
def test_rotating_epilogue_matches_float64(
    M,
    K,
    heads,
    head_dim,
    per_position,
    first_row,
    dtype,
    seed,
    b_t,
    bias,
    into_slice,
    each_implementation,
):
    """``rope=RowRotation(...)``: C's heads turned at their rows' positions (a chunk of a
    TP ring's (S, B) rows: `first_row`, B = `per_position`), one rounding, against the
    float64 product turned by the formula; elementwise after the product, so C's
    tolerance is the GEMM's."""
    N = heads * head_dim
    a, b = randn((M, K), dtype, seed), _operand((K, N), dtype, seed + 1, b_t)
    bias_t = randn((N,), dtype, seed + 2) if bias else None
    cos, sin = rope_tables(
        torch.arange((first_row + M - 1) // per_position + 1) * 3 + 1, head_dim, 10000.0
    )
    rope = RowRotation(cos, sin, per_position, first_row)
    out = randn((M + 2, N + 8), dtype, seed + 3)[1 : M + 1, 8:] if into_slice else None
    c = matmul(a, b, bias=bias_t, out=out, rope=rope)
    ref = _rotated(
        matmul_reference(a.double(), b.double(), bias=None if bias_t is None else bias_t.double()),
        rope,
        head_dim,
    )
    same = _rotated(
        matmul_reference(a.float(), b.float(), bias=None if bias_t is None else bias_t.float()),
        rope,
        head_dim,
    ).to(dtype)
    assert_close(c, ref, same, name="C")
    assert out is None or c.data_ptr() == out.data_ptr()


@given(
    M=st.integers(1, 40),
    N=st.integers(1, 40),
    K=st.integers(1, 40),
    dtype=cpu_dtypes(),
    seed=seeds(),
    w_t=st.booleans(),
    bias=st.booleans(),
    activation=st.sampled_from(ACTIVATIONS),
)
@example(M=65, N=33, K=70, dtype=torch.float16, seed=0, w_t=True, bias=True, activation="gelu_tanh")
def test_gated_matmul_is_two_gemms_and_the_activation(
    M, N, K, dtype, seed, w_t, bias, activation, each_implementation
):
    """`gated_matmul`'s gate and up are `matmul`'s bit for bit (the same K order) and h is
    `gated`'s of them, in one launch; gate and up against float64 too."""
    a = randn((M, K), dtype, seed)
    wg, wu = (_operand((K, N), dtype, seed + i, w_t) for i in (1, 2))  # weights read as w.T
    bg, bu = (randn((N,), dtype, seed + i) for i in (3, 4)) if bias else (None, None)
    gate, up, h = gated_matmul(a, wg, wu, bias=bg, bias2=bu, activation=activation)
    assert torch.equal(gate, matmul(a, wg, bias=bg)) and torch.equal(up, matmul(a, wu, bias=bu))
    assert torch.equal(h, gated(gate, up, activation))
    for got, w, b in ((gate, wg, bg), (up, wu, bu)):
        ref = matmul_reference(a.double(), w.double(), bias=None if b is None else b.double())
        assert_close(got, ref, matmul_reference(a, w, bias=b), name="gate/up")


@pytest.mark.parametrize(
    "up, biases, activation, match",
    [
        ((5, 8), (None, None), "silu", r"up operand must be \(3, 8\)"),
        ((3, 8, "t"), (None, None), "silu", "strides"),
        ((3, 8), (torch.ones(8), None), "silu", "both biases or neither"),
        ((3, 8), (None, None), "relu", "activation must be one of"),
    ],
)
def test_gated_matmul_names_bad_input(up, biases, activation, match, each_implementation):
    up_operand = torch.ones(8, 3).t() if up[-1] == "t" else torch.ones(up)
    with pytest.raises(ValueError, match=match):
        gated_matmul(
            torch.ones(4, 3),
            torch.ones(3, 8),
            up_operand,
            bias=biases[0],
            bias2=biases[1],
            activation=activation,
        )


@given(
    M=st.integers(1, 40),
    N=st.integers(1, 40),
    K=st.integers(1, 40),
    dtype=cpu_dtypes(),
    seed=seeds(),
    w_t=st.booleans(),
    bias=st.booleans(),
    strided=st.booleans(),
    activation=st.sampled_from(ACTIVATIONS),
)
@example(
    M=65,
    N=33,
    K=70,
    dtype=torch.float16,
    seed=0,
    w_t=True,
    bias=True,
    strided=True,
    activation="gelu_tanh",
)
def test_gated_up_matmul_is_the_gemm_and_the_product(
    M, N, K, dtype, seed, w_t, bias, strided, activation, each_implementation
):
    """`gated_up_matmul`'s up is `matmul`'s bit for bit and h is `gated`'s of the stored
    gate (a column slice of a wider buffer, or whole) and that up, in one launch; h
    against float64 too."""
    a = randn((M, K), dtype, seed)
    w_up = _operand((K, N), dtype, seed + 1, w_t)
    b_up = randn((N,), dtype, seed + 2) if bias else None
    gate = randn((M, N + 5), dtype, seed + 3)
    gate = gate[:, 2 : N + 2] if strided else gate[:, :N].contiguous()
    up, h = gated_up_matmul(a, w_up, gate, bias=b_up, activation=activation)
    assert torch.equal(up, matmul(a, w_up, bias=b_up))
    assert torch.equal(h, gated(gate, up, activation))
    ref = gated_reference(gate.double(), up.double(), activation)
    assert_close(h, ref, gated_reference(gate, up, activation), name="h")


def _gated_grad_oracle(dh, gate, up, activation):
    """(dgate | dup, h) of `fusedpar.kernels.gated`'s contract, computed in dh's dtype
    (float64 in: the oracle)."""
    M, N = gate.shape
    grads, h = (torch.empty((M, n), dtype=dh.dtype, device=dh.device) for n in (2 * N, N))
    gated_torch(activation, gate.to(dh.dtype), up.to(dh.dtype), dh, h, grads[:, :N], grads[:, N:])
    return grads, h


@given(
    M=st.integers(1, 40),
    N=st.integers(1, 40),
    K=st.integers(1, 40),
    dtype=cpu_dtypes(),
    seed=seeds(),
    w_t=st.booleans(),
    hidden=st.booleans(),
    strided=st.booleans(),
    activation=st.sampled_from(ACTIVATIONS),
)
@example(
    M=65,
    N=33,
    K=70,
    dtype=torch.float16,
    seed=0,
    w_t=True,
    hidden=True,
    strided=True,
    activation="gelu_tanh",
)
def test_gated_grad_matmul_is_the_gemm_and_the_activations_backward(
    M, N, K, dtype, seed, w_t, hidden, strided, activation, each_implementation
):
    """`gated_grad_matmul` is `matmul` (dh, rounded) then `gated_backward` bit for bit, in
    one launch, with the down weight read as stored or transposed and gate and up
    slices of wider rows; dgate, dup and h against float64 too."""
    dy = randn((M, K), dtype, seed)
    w_down = _operand((K, N), dtype, seed + 1, w_t)
    if strided:  # the forward's gate and up as column slices of one (M, 2N + 3) buffer
        saved = randn((M, 2 * N + 3), dtype, seed + 2)
        gate, up = saved[:, 1 : N + 1], saved[:, N + 3 :]
    else:
        gate, up = randn((M, N), dtype, seed + 2), randn((M, N), dtype, seed + 3)
    grads, h = gated_grad_matmul(dy, w_down, gate, up, activation=activation, hidden=hidden)
    unfused = gated_backward(matmul(dy, w_down), gate, up, activation, hidden=hidden, stacked=True)
    assert torch.equal(grads, unfused[0])
    assert (h is None) if not hidden else torch.equal(h, unfused[1])
    ref_grads, ref_h = _gated_grad_oracle(dy.double() @ w_down.double(), gate, up, activation)
    same_grads, same_h = _gated_grad_oracle(
        matmul_reference(dy, w_down).float(), gate, up, activation
    )
    assert_close(grads, ref_grads, same_grads.to(dtype), name="dgate | dup", sum_length=K)
    if hidden:
        assert_close(h, ref_h, same_h.to(dtype), name="h")


@pytest.mark.parametrize(
    "gate, activation, match",
    [
        ((4, 7), "silu", r"gate and up must be \(M, N\) = \(4, 8\)"),
        ((4, 8), "relu", "activation must be one of"),
        (torch.float64, "silu", "A's torch.float32"),
    ],
)
def test_gated_up_matmul_names_bad_input(gate, activation, match, each_implementation):
    gate = torch.ones(4, 8, dtype=gate) if isinstance(gate, torch.dtype) else torch.ones(gate)
    with pytest.raises((ValueError, TypeError), match=match):
        gated_up_matmul(torch.ones(4, 3), torch.ones(3, 8), gate, activation=activation)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"activation": "relu"}, "activation must be one of"),
        ({"gate": (5, 8)}, r"gate and up must be \(M, N\) = \(4, 8\)"),
        ({"up": "t"}, "share strides"),
        ({"up": torch.float64}, "A's torch.float32"),
    ],
)
def test_gated_grad_matmul_names_bad_input(change, match, each_implementation):
    gate, up = torch.ones(4, 8), torch.ones(4, 8)
    if "gate" in change:
        gate = torch.ones(change["gate"])
    if change.get("up") == "t":
        up = torch.ones(8, 4).t()
    elif "up" in change:
        up = up.to(change["up"])
    with pytest.raises((ValueError, TypeError), match=match):
        gated_grad_matmul(
            torch.ones(4, 3),
            torch.ones(3, 8),
            gate,
            up,
            activation=change.get("activation", "silu"),
        )


def test_out_dtype_fp32_and_empty_sizes(each_implementation):
    a, b = randn((9, 5), torch.float16, 0), randn((5, 11), torch.float16, 1)
    c = matmul(a, b, out_dtype=torch.float32)
    assert c.dtype == torch.float32
    assert_close(c, a.double() @ b.double(), (a @ b).float())
    assert matmul(a[:0], b).shape == (0, 11)
    bias = randn((11,), torch.float32, 2)
    assert torch.equal(
        matmul(a[:, :0], b[:0], bias=bias, out_dtype=torch.float32), bias.expand(9, 11)
    )


@pytest.mark.parametrize("a_t, b_t", [(False, True), (True, False), (False, False)])
@pytest.mark.parametrize("mode", ["bias", "accumulate-fp32", "slice", "rope"])
def test_tma_and_pointer_paths_agree_bitwise(monkeypatch, a_t, b_t, mode):
    """16-bit operands with 16-byte aligned strides are read through TMA descriptors
    over their contiguous axis (``w.T`` too), and C is written through one where it is
    aligned: the same bits as the pointer path, with edges in M, N and K (72 x 40 x 88
    against 64-wide tiles; "rope": 5 heads of 8 turned in the epilogue)."""
    from fusedpar.kernels import common

    M, N, K = 72, 40, 88
    a, b = _operand((M, K), torch.float16, 0, a_t), _operand((K, N), torch.float16, 1, b_t)
    assert common.tma_compatible(a, b)

    def run():
        if mode == "bias":
            return matmul(a, b, bias=randn((N,), torch.float16, 2))
        if mode == "accumulate-fp32":
            out = randn((M, N), torch.float32, 3)
            return matmul(a, b, out=out, accumulate=True)
        if mode == "rope":
            cos, sin = rope_tables(torch.arange(M // 2), 8, 100.0)
            return matmul(a, b, rope=RowRotation(cos, sin, rows_per_position=2))
        big = randn((M + 8, N + 8), torch.float16, 3)  # rows 96 B apart: C through TMA
        matmul(a, b, out=big[4 : 4 + M, 8:])
        return big

    with_tma = run()
    monkeypatch.setattr(common, "tma_compatible", lambda *tensors: False)
    assert torch.equal(with_tma, run())


def test_a_call_is_checked_and_planned_once_per_signature(monkeypatch, triton_kernels):
    """The checks and launch parameters of a call are worked out on the first call of its
    signature (shapes, strides, dtypes, alignment, flags) and looked up after; a call
    that differs in any of them is checked and planned anew, and computes right."""
    checks = []
    check = matmul_module.check_operands
    monkeypatch.setattr(matmul_module, "check_operands", lambda *a: checks.append(1) or check(*a))
    monkeypatch.setattr(matmul_module, "PLANS", {})
    a, b = randn((24, 40), torch.float32, 0), randn((40, 16), torch.float32, 1)
    for operands in [
        (a, b),
        (a, b),
        (a, b.t().contiguous().t()),
        (a[:, 8:], b[8:]),
        (a.half(), b.half()),
    ]:
        expected = matmul_reference(*(t.double() for t in operands))
        assert_close(matmul(*operands).double(), expected, matmul_reference(*operands).double())
    assert len(checks) == 4  # the second call was looked up
    with pytest.raises(ValueError, match=r"\(24, 40\).*\(24, 16\)"):
        matmul(a, a[:, :16])  # a new signature: checked, and refused


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((torch.ones(2, 3), torch.ones(4, 5)), {}, ValueError, r"\(2, 3\).*\(4, 5\)"),
        ((torch.ones(2, 3, 1), torch.ones(3, 5)), {}, ValueError, "2-D"),
        ((torch.ones(2, 3), torch.ones(3, 5, dtype=torch.float16)), {}, TypeError, "share a dtype"),
        (
            (torch.ones(2, 3, dtype=torch.int32), torch.ones(3, 2, dtype=torch.int32)),
            {},
            TypeError,
            "int32",
        ),
        ((torch.ones(2, 3), torch.ones(3, 5)), {"bias": torch.ones(4)}, ValueError, r"\(5,\)"),
        ((torch.ones(2, 3), torch.ones(3, 5)), {"out": torch.ones(5, 2)}, ValueError, r"\(2, 5\)"),
        ((torch.ones(2, 3), torch.ones(3, 5)), {"accumulate": True}, ValueError, "out"),
        (
            (torch.ones(2, 3), torch.ones(3, 5)),
            {"out_dtype": torch.float16},
            TypeError,
            "out_dtype",
        ),
    ],
)
def test_bad_input_is_a_clear_error(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        matmul(*args, **kwargs)


def _rotation(positions=4, half=4, dtype=torch.float32, **kwargs):
    cos, sin = rope_tables(torch.arange(positions), 2 * half, 100.0)
    return RowRotation(cos.to(dtype), sin.to(dtype), **kwargs)


@pytest.mark.parametrize(
    "n, rope, kwargs, error, match",
    [
        (16, _rotation(half=3), {}, ValueError, "power of 2"),  # heads of 6
        (12, _rotation(), {}, ValueError, "dividing N = 12"),
        (16, _rotation(dtype=torch.float64), {}, TypeError, "float32"),
        (16, RowRotation(torch.ones(4), torch.ones(4)), {}, ValueError, r"\(positions, hd/2\)"),
        (16, _rotation(rows_per_position=0), {}, ValueError, "rows_per_position"),
        (16, _rotation(first_row=1), {}, ValueError, r"rows 1\.\.4 .* 4 positions"),
        (16, _rotation(), {"accumulate": True, "out": torch.zeros(4, 16)}, ValueError, "added"),
        (
            16,
            RowRotation(*(t.t().contiguous().t() for t in rope_tables(torch.arange(4), 8, 1.0))),
            {},
            ValueError,
            "contiguous",
        ),
    ],
)
def test_a_bad_rotation_is_a_clear_error(n, rope, kwargs, error, match, each_implementation):
    with pytest.raises(error, match=match):
        matmul(torch.ones(4, 3), torch.ones(3, n), rope=rope, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["tma", "pointer", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("M, N, K", [(4096, 2048, 4096), (3000, 1792, 8192), (1, 14336, 4096)])
def test_matmul_gpu(dtype, M, N, K, path, monkeypatch):
    """Both schedules (the GPU twin of the bitwise CPU test; fp32 reads through
    pointers), and the torch implementation."""
    if path == "pointer":
        from fusedpar.kernels import common

        monkeypatch.setattr(common, "tma_compatible", lambda *tensors: False)
    with fp.implementation("torch" if path == "torch" else "triton"):
        check_matmul_gpu(dtype, M, N, K)


def check_matmul_gpu(dtype, M, N, K):
    a = randn((M, K), dtype, 0).cuda()
    w = randn((N, K), dtype, 1).cuda()  # a weight, read transposed in place
    bias = randn((N,), dtype, 2).cuda()
    c = matmul(a, w.T, bias=bias)
    ref = a.double() @ w.T.double() + bias.double()
    # fp32 dots of length K, whose rounding grows like sqrt(K): the kernel sums K in order,
    # BLOCK_K at a time, and at M = 1 cuBLAS's order happened to be more accurate (H100:
    # ours 5.0e-4 against 3.7e-4 allowed at K = 4096), so the floor grows with K.
    assert_close(c, ref, a @ w.T + bias, sum_length=K)
    before = randn((M, N), torch.float32, 3).cuda()
    acc = before.clone()
    matmul(a, w.T, out=acc, accumulate=True)
    expected = before.double() + a.double() @ w.T.double()
    assert_close(acc, expected, before + (a @ w.T).float(), sum_length=K)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["tma", "pointer", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotating_epilogue_gpu(dtype, head_dim, path, monkeypatch):
    """A q projection of 4096 positions x B = 2 (Llama's widths at TP 8: 4 heads) turned
    in the epilogue, on both schedules and the torch implementation, from a chunk's first
    row as a TP ring's GEMM is called."""
    if path == "pointer":
        from fusedpar.kernels import common

        monkeypatch.setattr(common, "tma_compatible", lambda *tensors: False)
    M, K, N, first_row = 8192, 4096, 4 * head_dim, 4096
    a, w = randn((M, K), dtype, 0).cuda(), randn((N, K), dtype, 1).cuda()
    bias = randn((N,), dtype, 2).cuda()
    cos, sin = (t.cuda() for t in rope_tables(torch.arange(6144), head_dim, 500000.0))
    rope = RowRotation(cos, sin, rows_per_position=2, first_row=first_row)
    with fp.implementation("torch" if path == "torch" else "triton"):
        c = matmul(a, w.T, bias=bias, rope=rope)
    product = a.double() @ w.T.double() + bias.double()
    ref = _rotated(product.cpu(), rope._replace(cos=cos.cpu(), sin=sin.cpu()), head_dim)
    same = _rotated(
        (a.float() @ w.T.float() + bias.float()).cpu(),
        rope._replace(cos=cos.cpu(), sin=sin.cpu()),
        head_dim,
    ).to(dtype)
    assert_close(c.cpu(), ref, same, sum_length=K)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["tma", "pointer", "torch"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_matmul_gpu(activation, path, monkeypatch):
    """A dense SwiGLU's gate and up at TP 1 (Llama-8B: d 4096, h 14336) with 8192 tokens,
    against float64, on both schedules and the torch implementation."""
    if path == "pointer":
        from fusedpar.kernels import common

        monkeypatch.setattr(common, "tma_compatible", lambda *tensors: False)
    M, K, N, dtype = 8192, 4096, 14336, torch.bfloat16
    a = randn((M, K), dtype, 0).cuda()
    wg, wu = (randn((N, K), dtype, i).cuda() for i in (1, 2))
    bg, bu = (randn((N,), dtype, i).cuda() for i in (3, 4))
    with fp.implementation("torch" if path == "torch" else "triton"):
        gate, up, h = gated_matmul(a, wg.T, wu.T, bias=bg, bias2=bu, activation=activation)
    for got, w, b in ((gate, wg, bg), (up, wu, bu)):
        assert_close(got, a.double() @ w.T.double() + b.double(), a @ w.T + b, sum_length=K)
    # h from the gate and up it was given, in float64, against torch's own in bf16
    act = {
        "silu": torch.nn.functional.silu,
        "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh"),
    }[activation]
    assert_close(h, act(gate.double()) * up.double(), act(gate) * up)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["tma", "pointer", "torch"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_grad_matmul_gpu(activation, path, monkeypatch):
    """A dense SwiGLU's hidden gradient at TP 1 (Llama-8B: d 4096, h 14336) for 4096
    tokens, the down weight read as stored, against float64, on both schedules and the
    torch implementation."""
    if path == "pointer":
        from fusedpar.kernels import common

        monkeypatch.setattr(common, "tma_compatible", lambda *tensors: False)
    M, K, N, dtype = 4096, 4096, 14336, torch.bfloat16
    dy, w_down = randn((M, K), dtype, 0).cuda(), randn((K, N), dtype, 1).cuda()
    gate, up = (randn((M, N), dtype, i).cuda() for i in (2, 3))
    with fp.implementation("torch" if path == "torch" else "triton"):
        grads, h = gated_grad_matmul(dy, w_down, gate, up, activation=activation, hidden=True)
    ref_grads, ref_h = _gated_grad_oracle(dy.double() @ w_down.double(), gate, up, activation)
    same_grads, same_h = _gated_grad_oracle((dy @ w_down).float(), gate, up, activation)
    assert_close(grads, ref_grads, same_grads.to(dtype), name="dgate | dup", sum_length=K)
    assert_close(h, ref_h, same_h.to(dtype), name="h")


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["tma", "pointer", "torch"])
def test_gated_up_matmul_gpu(path, monkeypatch):
    """A dense SwiGLU's up projection ending in silu(gate) * up at TP 1 (Llama-8B: d
    4096, h 14336) for 8192 tokens, against float64, on both schedules and the torch
    implementation."""
    if path == "pointer":
        from fusedpar.kernels import common

        monkeypatch.setattr(common, "tma_compatible", lambda *tensors: False)
    M, K, N, dtype = 8192, 4096, 14336, torch.bfloat16
    a, w_up = randn((M, K), dtype, 0).cuda(), randn((N, K), dtype, 1).cuda()
    b_up, gate = randn((N,), dtype, 2).cuda(), randn((M, N), dtype, 3).cuda()
    with fp.implementation("torch" if path == "torch" else "triton"):
        up, h = gated_up_matmul(a, w_up.T, gate, bias=b_up, activation="silu")
    assert_close(up, a.double() @ w_up.T.double() + b_up.double(), a @ w_up.T + b_up, sum_length=K)
    assert_close(h, gated_reference(gate.double(), up.double()), gated_reference(gate, up))
