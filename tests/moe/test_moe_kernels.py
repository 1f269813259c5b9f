"""Each MoE kernel against its plain-PyTorch reference (`tests/moe/test_moe.py` tests the
layer).

The kernel checks (`KERNEL_CHECKS`) are plain functions of a problem dict and a device:
the CPU tier runs them on hypothesis-drawn tiny fp32/fp16 problems in the interpreter,
the GPU tier (``pytest -m gpu``) on realistic bf16/fp16 shapes. Every output a kernel
allocates starts as NaN (`poisoned_outputs`), so an element it should write and does not,
or a row past the kept pairs that something reads, fails the comparison.
"""

import pytest
import torch
import triton
from fusedpar.kernels import moe as moe_kernels
from fusedpar.kernels import moe_weight_grad, tuning
from fusedpar.kernels.moe import (
    SWIGLU_LIMIT,
    Swiglu,
    grouped_matmul,
    grouped_swiglu,
    grouped_swiglu_backward,
    grouped_swiglu_input_grad,
)
from fusedpar.kernels.moe_permute import (
    combine,
    combine_reference,
    combine_weight_grad,
    dispatch_metadata,
    gather_rows,
)
from fusedpar.kernels.moe_reference import expert_swiglu_reference, grouped_matmul_reference
from fusedpar.kernels.moe_route import SCORES, route_reference, route_top_k, route_top_k_backward
from fusedpar.kernels.moe_weight_grad import (
    expert_sums_reference,
    grouped_weight_grad,
    grouped_weight_grad_reference,
)
from hypothesis import example, given
from hypothesis import strategies as st

import fusedpar as fp
from fusedpar.ops.moe import Experts, expert_swiglu
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds
from tests.moe.helpers import GPT_OSS_KERNEL, SMALL, _kernel_problem, poisoned_outputs

# --- the kernels on their own: checks shared by the CPU and GPU tiers ----------------------


def _unwritten(t, kept, name):
    """Rows past the kept pairs stay as poisoned: no kernel writes there."""
    assert t[kept:].isnan().all(), f"{name}: a row past the kept pairs was written"


def check_grouped_matmul(p, device):
    """grouped_matmul gathering from x, and on rows already in expert order with the
    weight read transposed (the backward's use)."""
    q = _kernel_problem(p, device)
    x, w, counts, rows, n = q["x"], q["w1"], q["counts"], q["rows"], q["kept"]
    b = None if q["bias"] is None else q["b1"]
    with poisoned_outputs():
        y = grouped_matmul(x, w, counts, rows, bias=b)
        dx = grouped_matmul(q["dy"], q["w2"], counts, transpose_w=True)
    _unwritten(y, n, "gathered y")
    b64 = None if b is None else b.double()
    ref = grouped_matmul_reference(x.double(), w.double(), counts, rows, bias=b64)
    same = grouped_matmul_reference(x, w, counts, rows, bias=b)
    assert_close(y[:n], ref, same, name="gathered y")
    args = (q["dy"], q["w2"], counts, None, True)
    ref = grouped_matmul_reference(*(t.double() for t in args[:2]), *args[2:])
    assert_close(dx[:n], ref, grouped_matmul_reference(*args), name="transposed w")


def check_expert_swiglu(p, device):
    """The fused gate/up kernel, then `expert_swiglu` forward and every gradient against
    the loop over experts; the backward's recomputed a equals the forward's bit for bit."""
    q = _kernel_problem(p, device)
    counts, rows, pos, n, act = q["counts"], q["rows"], q["pos"], q["kept"], q["act"]
    b13 = None if q["bias"] is None else (q["b1"], q["b3"])
    with poisoned_outputs():
        a, h13 = grouped_swiglu(q["x"], q["w1"], q["w3"], counts, rows, bias=b13, **act)
        _, a_again = grouped_swiglu_backward(q["dy"], q["w2"], h13, counts, **act)
    for t, name in ((a, "a"), (h13, "h13"), (a_again, "a again")):
        _unwritten(t, n, name)
    assert torch.equal(a[:n], a_again[:n]), "the backward's a differs from the forward's"

    # the clamps' decisions on the kernels' own h1, h3: within their rounding of a bound,
    # the float64 oracle's own decision could differ by a whole term of dw1, dw3 (a CI
    # draw: fp16, dw3 off by 0.39 where PyTorch's fp16 route decided as float64 did)
    h1, h3 = h13[:n].double().chunk(2, dim=1)
    limit = act.get("limit", SWIGLU_LIMIT)
    passes = (h1 <= limit, (h3 >= -limit) & (h3 <= limit))

    swiglu = Swiglu(act["activation"])

    def run(operands, fused, follow=False):
        x, w1, w3, w2, *bias = (t.detach().requires_grad_() for t in operands)
        b1, b2, b3 = bias or (None, None, None)
        experts = Experts(w1, w3, w2, b1, b3, b2)
        if fused:
            with poisoned_outputs():
                out = expert_swiglu(x, experts, counts, rows, pos, swiglu)
                _unwritten(out, n, "expert outputs")
                (out[:n] * q["dy"][:n]).sum().backward()
            out = out[:n]
        else:
            follows = passes if follow else None
            out = expert_swiglu_reference(x, experts, counts, rows, act=swiglu, passes=follows)
            if out.requires_grad:
                (out * q["dy"][:n].to(out.dtype)).sum().backward()
        leaves = (x, w1, w3, w2, *bias)
        return [out, *(torch.zeros_like(t) if t.grad is None else t.grad for t in leaves)]

    names = ["x", "w1", "w3", "w2"] + (["b1", "b2", "b3"] if q["bias"] else [])
    operands = [q[n_] for n_ in names]
    got = run(operands, True)
    ref = run([t.double() for t in operands], False, follow=True)
    same = run(operands, False)
    for name, g, r, t in zip(["out"] + [f"d{n_}" for n_ in names], got, ref, same, strict=True):
        assert_close(g, r, t, name=name)


def test_the_clamp_passes_the_gradient_on_its_bounds(each_implementation):
    """torch.clamp's convention, which both implementations follow: where h1 = 7 or
    h3 = -7 or 7 exactly, the gradient passes (integer data, and biases that put one
    token's value of each column on a bound, exactly)."""
    gen = torch.Generator().manual_seed(0)
    T, E, d, h = 12, 2, 3, 8

    def ints(*shape):
        return torch.randint(-2, 3, shape, generator=gen).double()

    x, w1, w3 = ints(T, d), ints(E, h, d), ints(E, h, d)
    w2, dy = torch.randn(E, d, h, generator=gen, dtype=torch.float64), ints(T, d)
    counts, order, pos = dispatch_metadata(torch.arange(T).view(T, 1) % E, E)
    b1, b3, b2 = ints(E, h), ints(E, h), ints(E, d)
    for e in range(E):
        for j in range(h):  # token e's h1 on the upper bound, token e + E's h3 on one
            b1[e, j] = 7.0 - x[e] @ w1[e, j]
            b3[e, j] = (7.0 if j % 2 else -7.0) - x[e + E] @ w3[e, j]
    h1 = torch.einsum("td,ehd->teh", x, w1) + b1
    h3 = torch.einsum("td,ehd->teh", x, w3) + b3
    assert (h1 == 7).sum() >= E * h and (h3 == 7).any() and (h3 == -7).any()
    operands = [x, w1, w3, w2, b1, b2, b3]

    def run(operands, fused):
        x, w1, w3, w2, *bias = (t.detach().requires_grad_() for t in operands)
        b1, b2, b3 = bias
        experts, act = Experts(w1, w3, w2, b1, b3, b2), Swiglu("clamped_swiglu")
        if fused:
            out = expert_swiglu(x, experts, counts, order, pos, act)
        else:
            out = expert_swiglu_reference(x, experts, counts, order, act=act)
        (out * dy[order].to(out.dtype)).sum().backward()
        return [out] + [t.grad for t in (x, w1, w3, w2, *bias)]

    got = run([t.float() for t in operands], True)
    ref = run(operands, False)
    same = run([t.float() for t in operands], False)
    names = ["out", "dx", "dw1", "dw3", "dw2", "db1", "db2", "db3"]
    for name, g, r, t in zip(names, got, ref, same, strict=True):
        assert_close(g, r, t, name=name)


def check_weight_grad(p, device):
    """grouped_weight_grad gathering x (both halves of a split dy) and on rows in order."""
    q = _kernel_problem(p, device)
    x, counts, rows, dh, h = q["x"], q["counts"], q["rows"], q["dh13"], p["h"]
    bias = q["bias"] is not None  # the bias gradients too, from the same launches
    with poisoned_outputs():
        dw1, dw3, *db13 = grouped_weight_grad(dh, x, counts, rows, split=True, bias_grad=bias)
        dw2 = grouped_weight_grad(q["dy"], dh[:, :h], counts, bias_grad=bias)
    dw2, *db2 = dw2 if bias else (dw2,)
    cases = [
        ("dw1", dw1, dh[:, :h], x, rows),
        ("dw3", dw3, dh[:, h:], x, rows),
        ("dw2", dw2, q["dy"], dh[:, :h], None),
    ]
    for name, got, dy, src, r in cases:
        ref = grouped_weight_grad_reference(dy.double(), src.double(), counts, r)
        assert_close(got, ref, grouped_weight_grad_reference(dy, src, counts, r), name=name)
        assert (got[counts == 0] == 0).all(), f"{name}: an empty expert's gradient is not 0"
    for (name, _, dy, _, _), got in zip(cases, [*db13, *db2], strict=False):
        name = "db" + name[2:]
        ref = expert_sums_reference(dy.double(), counts)
        assert_close(got, ref, expert_sums_reference(dy, counts), name=name)
        assert (got[counts == 0] == 0).all(), f"{name}: an empty expert's gradient is not 0"


def check_permute_combine(p, device):
    """gather_rows (plain and scaled), combine (weighted, dropped slots skipped) and the
    combine's weight gradient."""
    q = _kernel_problem(p, device)
    x, rows, pos, dy = q["x"], q["rows"], q["pos"], q["dy"]
    T, k = pos.shape
    weight = torch.rand(T, k, generator=torch.Generator().manual_seed(p["seed"])).to(device)
    scale = weight.reshape(-1)[q["order"]]
    with poisoned_outputs():
        permuted = gather_rows(x, rows)
        scaled = gather_rows(x, rows, scale)
        y = combine(dy, pos, weight)
        dw = combine_weight_grad(y, dy, pos)
    assert torch.equal(permuted, x[rows]), "gather_rows must copy rows exactly"
    ref = x.double()[rows] * scale.double()[:, None]
    assert_close(scaled, ref, (x[rows].float() * scale[:, None]).to(x.dtype), name="scaled")
    ref = combine_reference(dy.double(), pos, weight.double())
    assert_close(y, ref, combine_reference(dy, pos, weight), name="combine")

    def dw_reference(yy, src):
        live = pos >= 0
        return (yy[:, None, :] * src[pos.clamp(min=0)]).sum(-1) * live

    ref = dw_reference(y.double(), dy.double())
    assert_close(dw, ref, dw_reference(y.float(), dy.float()), name="combine weight grad")


KERNEL_CHECKS = [
    check_grouped_matmul,
    check_expert_swiglu,
    check_weight_grad,
    check_permute_combine,
]


@st.composite
def kernel_problems(draw):
    E = draw(st.integers(1, 5))
    return dict(
        T=draw(st.integers(0, 24)),
        k=draw(st.integers(1, 3)),
        E=E,
        d=draw(st.integers(1, 40)),
        h=draw(st.integers(1, 40)),
        empty=draw(st.integers(0, E - 1)),
        skew=draw(st.sampled_from([0.0, 1.0, 3.0])),
        drop=draw(st.booleans()),
        strided=draw(st.booleans()),
        bias=draw(st.booleans()),
        act=draw(st.sampled_from(["silu", "clamped_swiglu"])),
        dtype=draw(cpu_dtypes()),
        seed=draw(seeds()),
    )


@pytest.mark.parametrize("check", KERNEL_CHECKS, ids=lambda c: c.__name__[6:])
@given(p=kernel_problems())
@example(p={**SMALL, "T": 0})  # no token
@example(p={**SMALL, "d": 70, "h": 67, "strided": True, "dtype": torch.float16})  # loops over D, K
@example(p={**SMALL, "T": 40, "k": 1, "E": 2, "empty": 0, "drop": False})  # many blocks/expert
@example(p={**SMALL, **GPT_OSS_KERNEL})
@example(p={**SMALL, **GPT_OSS_KERNEL, "dtype": torch.float16, "d": 70, "h": 67})
@example(
    p={**SMALL, "T": 1, "k": 2, "E": 1, "d": 1, "h": 1, "empty": 0, "drop": True, "seed": 230}
)  # a dropped slot: its unwritten (poisoned) row is never read
@example(
    p={
        "T": 18,
        "k": 1,
        "E": 3,
        "d": 7,
        "h": 34,
        "empty": 0,
        "skew": 3.0,
        "drop": False,
        "strided": True,
        "bias": True,
        "act": "clamped_swiglu",
        "dtype": torch.float16,
        "seed": 1_330_303_161,
    }
)  # an h3 within fp16 rounding of the clamp (CI)
def test_kernels_match_references(check, p, each_implementation):
    check(p, torch.device("cpu"))


GPU_PROBLEMS = {
    # fine-grained experts, top-8, 4 of 64 experts empty
    "E64-d2048": dict(
        T=2048, k=8, E=64, d=2048, h=768, empty=4, skew=1.0, drop=False, strided=False
    ),
    # few large experts, a capacity drop, strided operands, h not a multiple of 64
    "E8-d512-drop": dict(
        T=3000, k=2, E=8, d=512, h=1400, empty=1, skew=1.0, drop=True, strided=True
    ),
    # d past one permute tile (2048): the D loop; uneven experts
    "E16-d2560": dict(
        T=1000, k=4, E=16, d=2560, h=1000, empty=2, skew=2.0, drop=False, strided=False
    ),
    # gpt-oss-20b's experts: biases, the clamped SwiGLU, d = h = 2880 (not a multiple of 64)
    "E32-gpt-oss": dict(
        T=1024,
        k=4,
        E=32,
        d=2880,
        h=2880,
        empty=2,
        skew=1.0,
        drop=False,
        strided=False,
        bias=True,
        act="clamped_swiglu",
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("problem", list(GPU_PROBLEMS))
@pytest.mark.parametrize("check", KERNEL_CHECKS, ids=lambda c: c.__name__[6:])
def test_kernels_match_references_gpu(check, problem, dtype, each_implementation):
    check({**GPU_PROBLEMS[problem], "dtype": dtype, "seed": 0}, torch.device("cuda"))


def check_tile_independence(p, device, gemm_configs, wgrad_configs, exact=False):
    """Every config sums in the same order (one BLOCK_K, one row step for the weight
    gradient), so forcing each in turn must give the same bits. `exact`: integer-valued
    operands, whose sums are exact in any order (the interpreter's numpy dot orders its
    sums by tile shape, so on CPU only the forcing and the per-config grids are tested)."""
    q = _kernel_problem(p, device)
    if exact:
        q.update({n_: (q[n_] * 2).round() for n_ in ("x", "w1", "dh13")})
    x, counts, rows, n = q["x"], q["counts"], q["rows"], q["kept"]

    def gemm():
        return grouped_matmul(x, q["w1"], counts, rows)[:n]

    def wgrad():  # dw1, dw3 and the biases' db1, db3
        grads = grouped_weight_grad(q["dh13"], x, counts, rows, split=True, bias_grad=True)
        return torch.cat([t.flatten() for t in grads])

    real = moe_kernels._gemm_candidates, moe_weight_grad._weight_grad_candidates
    try:
        for module, name, configs, run in (
            (moe_kernels, "_gemm_candidates", gemm_configs, gemm),
            (moe_weight_grad, "_weight_grad_candidates", wgrad_configs, wgrad),
        ):
            outs = []
            for config in configs:
                setattr(module, name, lambda *_, c=config: [c])
                tuning.forget_picks()
                outs.append((config, run()))
            for config, out in outs[1:]:
                assert torch.equal(out, outs[0][1]), f"{config} differs from {outs[0][0]}"
    finally:
        moe_kernels._gemm_candidates, moe_weight_grad._weight_grad_candidates = real
        tuning.forget_picks()


def test_gemm_bits_do_not_depend_on_the_tile(triton_kernels):
    def tiles(m_key, n_key, k_key, k):
        return [
            triton.Config({m_key: a, n_key: b, k_key: k}) for a, b in ((16, 64), (32, 16), (64, 32))
        ]

    p = {**SMALL, "T": 30, "d": 70, "h": 40, "E": 3, "empty": 0, "strided": True}
    check_tile_independence(
        p,
        torch.device("cpu"),
        tiles("BLOCK_M", "BLOCK_N", "BLOCK_K", 64),
        tiles("BLOCK_N", "BLOCK_K", "BLOCK_M", 16),
        exact=True,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gemm_bits_do_not_depend_on_the_tile_gpu(dtype, triton_kernels):
    """The GPU tiles: 128- and 64-row wgmma ones and the 32-row mma ones alike."""
    p = {**GPU_PROBLEMS["E8-d512-drop"], "dtype": dtype, "seed": 1}
    check_tile_independence(
        p,
        torch.device("cuda"),
        moe_kernels.grouped_matmul_configs(),
        moe_weight_grad.weight_grad_configs(),
    )


def _f(*shape, dtype=torch.float32):
    return torch.ones(shape, dtype=dtype)


def _i(*shape, dtype=torch.int64):
    return torch.ones(shape, dtype=dtype)


@pytest.mark.parametrize(
    "fn, args, error, match",
    [
        (grouped_matmul, (_f(4, 3), _f(2, 5, 4), _i(2)), ValueError, r"w must be \(2, 5, 3\)"),
        (grouped_matmul, (_f(4, 3), _f(2, 5, 3), _i(3)), ValueError, r"\(3, 5, 3\).*3 experts"),
        (grouped_matmul, (_f(4, 3), _f(2, 5, 3, dtype=torch.float16), _i(2)), TypeError, "float16"),
        (grouped_matmul, (_f(4, 3), _f(2, 5, 3), _f(2)), ValueError, "counts must be int64"),
        (
            grouped_swiglu,
            (_f(4, 3), _f(2, 5, 3), _f(2, 6, 3), _i(2)),
            ValueError,
            r"w3 must be \(2, 5, 3\)",
        ),
        (
            grouped_swiglu,
            (_f(4, 3), _f(2, 5, 3), _f(2, 5, 3), _i(2), _i(3, dtype=torch.int16)),
            ValueError,
            r"rows must be int32 or int64 \(3,\)",
        ),
        (
            grouped_swiglu_backward,
            (_f(4, 3), _f(2, 3, 5), _f(4, 9), _i(2)),
            ValueError,
            r"\(4, 2h\)",
        ),
        (
            grouped_swiglu_input_grad,
            (_f(4, 8), _f(2, 5, 3), _f(2, 5, 3), _i(2)),
            ValueError,
            r"\(2, 4, 3\)",
        ),
        (grouped_weight_grad, (_f(4, 5), _f(3, 2), _i(2)), ValueError, "dy's 4 rows"),
        (gather_rows, (_f(4, 3), _i(2), _f(3)), ValueError, r"float32 \(2,\)"),
        (combine, (_f(4, 3), _i(2, 2), _f(2, 3)), ValueError, r"\(2, 3\)"),
        (combine_weight_grad, (_f(2, 4), _f(4, 3), _i(2, 2)), ValueError, r"\(2, D\)"),
        (route_top_k, (_f(3, 4, dtype=torch.float16), 2), ValueError, r"\(T, E\) float32"),
        (route_top_k, (_f(3, 4), 5), ValueError, r"top_k \(5\) must be between 1 and E \(4\)"),
        (route_top_k, (_f(3, 4), 2, "relu"), ValueError, "score must be one of"),
        (route_top_k, (_f(3, 4), 2, "sigmoid", True, _f(5)), ValueError, r"bias must be \(4,\)"),
        (route_top_k, (_f(3, 1025), 2), ValueError, "1025 experts"),
        (
            route_top_k_backward,
            (_f(3, 3), None, _f(3, 4), _i(3, 2, dtype=torch.int32)),
            ValueError,
            r"d_weights must be \(3, 2\) float32",
        ),
        (
            route_top_k_backward,
            (None, None, _f(4, 3).T, _i(3, 2, dtype=torch.int32)),
            ValueError,
            r"probs must be contiguous \(T, E\) float32",
        ),
        (
            route_top_k_backward,
            (None, None, _f(3, 4), _i(3, 2)),
            ValueError,
            r"ids must be contiguous \(3, k\) int32",
        ),
    ],
)
def test_kernel_bad_input_is_a_clear_error(fn, args, error, match):
    with pytest.raises(error, match=match):
        fn(*args)


@pytest.mark.parametrize(
    "fn, args, kwargs, match",
    [
        (
            grouped_matmul,
            (_f(4, 3), _f(2, 5, 3), _i(2)),
            {"bias": _f(2, 4)},
            r"bias must be \(2, 5\)",
        ),
        (
            grouped_swiglu,
            (_f(4, 3), _f(2, 5, 3), _f(2, 5, 3), _i(2)),
            {"bias": (_f(2, 5), _f(5, 2))},
            r"b3 must be \(2, 5\)",
        ),
        (
            grouped_swiglu,
            (_f(4, 3), _f(2, 5, 3), _f(2, 5, 3), _i(2)),
            {"activation": "gelu"},
            r"activation must be one of \('silu', 'clamped_swiglu'\), got 'gelu'",
        ),
        (
            grouped_swiglu_backward,
            (_f(4, 3), _f(2, 3, 5), _f(4, 10), _i(2)),
            {"activation": "clamped_swiglu", "limit": 0.0},
            "swiglu_limit must be a positive finite number, got 0.0",
        ),
        (
            grouped_weight_grad,
            (_f(4, 5), _f(4, 0), _i(2)),
            {"bias_grad": True},
            r"bias_grad needs x with columns, got \(4, 0\)",
        ),
    ],
)
def test_kernel_bias_and_activation_errors(fn, args, kwargs, match, each_implementation):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


# --- the routing --------------------------------------------------------------------------


def check_routing(T, E, k, score, norm, bias, grads, strided, seed, device, groups=(1, 1)):
    """probs, the top-k ids (exactly torch.topk's: random logits have no near tie, two
    scores within fp32's rounding, at these sizes) and the weights, and the logits'
    gradient from either output's or both, against autograd through `route_reference`
    in float64 (the fp32 logits upcast: the same inputs); `groups`: group-limited."""
    logits = randn((E, T) if strided else (T, E), torch.float32, seed, scale=3.0).to(device)
    logits = logits.T if strided else logits  # (T, E), the experts' stride not 1
    expert_bias = randn((E,), torch.float32, seed + 1, scale=0.1).to(device) if bias else None
    d_weights = randn((T, k), torch.float32, seed + 2).to(device) if grads != "probs" else None
    d_probs = randn((T, E), torch.float32, seed + 3).to(device) if grads != "weights" else None

    def reference(dtype):
        leaf = logits.to(dtype).requires_grad_()
        b = None if expert_bias is None else expert_bias.to(dtype)
        weights, ids, probs = route_reference(leaf, k, score, norm, b, groups)
        loss = sum(
            (out * g.to(dtype)).sum()
            for out, g in ((weights, d_weights), (probs, d_probs))
            if g is not None
        )
        (d_logits,) = torch.autograd.grad(loss, leaf) if T else (torch.zeros_like(leaf),)
        return weights, ids, probs, d_logits

    ref, fp32 = reference(torch.float64), reference(torch.float32)
    with poisoned_outputs():
        weights, ids, probs = route_top_k(logits, k, score, norm, expert_bias, groups)
        d_logits = route_top_k_backward(d_weights, d_probs, probs, ids, score, norm)
    assert ids.dtype == torch.int32 and torch.equal(ids.long().cpu(), ref[1].cpu())
    for name, out, i in (("weights", weights, 0), ("probs", probs, 2), ("d_logits", d_logits, 3)):
        assert_close(out, ref[i], fp32[i], name=name, sum_length=E)
    if norm and k == 1:  # exactly 1, and no gradient through it
        assert torch.equal(weights, torch.ones_like(weights))


@given(
    T=st.integers(0, 9),
    E=st.integers(1, 40),
    k_share=st.floats(0, 1),
    score=st.sampled_from(SCORES),
    norm=st.booleans(),
    bias=st.booleans(),
    grads=st.sampled_from(["both", "weights", "probs"]),
    strided=st.booleans(),
    seed=seeds(),
)
@example(
    T=5, E=1, k_share=1, score="softmax", norm=True, bias=False, grads="both", strided=False, seed=0
)  # one expert: the weight is 1, its gradient 0
@example(
    T=3,
    E=8,
    k_share=1,
    score="softmax",
    norm=True,
    bias=False,
    grads="weights",
    strided=True,
    seed=1,
)  # k = E: the renormalized weights are the probabilities
@example(
    T=9,
    E=33,
    k_share=0.1,
    score="sigmoid",
    norm=True,
    bias=True,
    grads="both",
    strided=False,
    seed=2,
)  # a row past 32 experts; the selection's bias
def test_routing_matches_float64(
    T, E, k_share, score, norm, bias, grads, strided, seed, each_implementation
):
    check_routing(
        T,
        E,
        max(1, round(k_share * E)),
        score,
        norm,
        bias,
        grads,
        strided,
        seed,
        torch.device("cpu"),
    )


@pytest.mark.parametrize(
    "T, E, k, score, groups",
    [
        (9, 16, 3, "sigmoid", (4, 2)),  # 2 of 4 groups of 4
        (7, 32, 8, "sigmoid", (8, 4)),  # DeepSeek-V3's shape, scaled down: 4 of 8 groups
        (6, 12, 2, "softmax", (3, 1)),  # one group kept
        (5, 10, 4, "sigmoid", (5, 2)),  # groups of 2 (the fewest a group scores with)
    ],
)
def test_group_limited_routing_matches_float64(T, E, k, score, groups, each_implementation):
    """DeepSeek-V3's router: the choice among the experts of the best groups (each
    scored by its two best selection scores, the correction bias included)."""
    check_routing(T, E, k, score, True, True, "both", False, E + k, torch.device("cpu"), groups)


@pytest.mark.parametrize(
    "E, k, groups, match",
    [
        (16, 2, (3, 1), "do not split"),
        (16, 2, (16, 1), "do not split"),
        (16, 9, (4, 2), "cannot hold top_k=9"),
        (16, 2, (4, 5), "topk_group=5"),
    ],
)
def test_bad_groups_are_refused(E, k, groups, match):
    with pytest.raises(ValueError, match=match):
        route_top_k(torch.zeros(3, E), k, "sigmoid", True, None, groups)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "problem, groups",
    [
        ((1024, 128, 8, "softmax", True, False), (1, 1)),  # Qwen3-MoE
        ((1024, 256, 8, "sigmoid", True, True), (8, 4)),  # DeepSeek-V3
        ((1024, 160, 8, "sigmoid", True, True), (1, 1)),  # GLM-4.5 (one group)
        ((512, 1024, 4, "softmax", False, False), (1, 1)),  # the most experts a program holds
    ],
)
def test_routing_matches_float64_gpu(problem, groups, each_implementation):
    check_routing(*problem, "both", False, 0, torch.device("cuda"), groups)


def check_nan_logits_stay_in_range(device):
    """A diverged step's NaN logits: every id still names an expert (the dispatch indexes
    with them; an argmax over NaN compares false everywhere)."""
    logits = randn((9, 6), torch.float32, 0).to(device)
    logits[1], logits[4, 2], logits[7] = float("nan"), float("nan"), float("inf")
    for score in SCORES:
        _, ids, _ = route_top_k(logits, 3, score, True)
        assert ((ids >= 0) & (ids < 6)).all(), ids


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's inf - inf
def test_nan_logits_route_within_range(each_implementation):
    check_nan_logits_stay_in_range(torch.device("cpu"))


@pytest.mark.gpu
def test_nan_logits_route_within_range_gpu(each_implementation):
    check_nan_logits_stay_in_range(torch.device("cuda"))


# --- torch._grouped_mm as a candidate of the grouped GEMM ------------------------------


def _down_projection(P, counts, dtype=torch.bfloat16, device="cpu"):
    x = randn((P, 64), dtype, 0).to(device)  # (P, K), in expert order
    w = randn((len(counts), 40, 64), dtype, 1).to(device)  # (E, N, K)
    return (
        x,
        w,
        torch.tensor(counts, device=device),
        torch.empty((P, 40), dtype=dtype, device=device),
    )


def test_grouped_mm_computes_the_plain_grouped_gemm():
    """Where its rules hold, torch._grouped_mm's run writes what the kernel would (against
    float64; an expert with no rows among them); elsewhere there is none to time."""
    from fusedpar.kernels import moe_torch

    x, w, counts, y = _down_projection(29, [7, 0, 13, 9])
    moe_torch.grouped_mm_run(x, w, counts, None, None, y, False)()
    ref = grouped_matmul_reference(x.double(), w.double(), counts)
    assert_close(y, ref, grouped_matmul_reference(x, w, counts), name="grouped_mm")
    wt = w.transpose(1, 2).contiguous()  # w given as (E, K, N): read in place, transposed
    assert moe_torch.grouped_mm_run(x, wt, counts, None, None, y, True) is None  # row-major
    rows, bias = torch.arange(29), torch.zeros(4, 40, dtype=torch.bfloat16)
    half = [t.half() for t in (x, w, y)]
    for refused in (
        (x, w, counts, rows, None, y, False),
        (x, w, counts, None, bias, y, False),
        (half[0], half[1], counts, None, None, half[2], False),
        (x[:, 1:], w[..., 1:], counts, None, None, y, False),
    ):
        assert moe_torch.grouped_mm_run(*refused) is None


@pytest.mark.gpu
def test_grouped_mm_candidate_gpu():
    """Forced as the grouped GEMM's pick, through grouped_matmul, against float64."""
    from fusedpar.kernels import moe_torch

    x, w, counts, _ = _down_projection(3000, [700, 0, 1300, 900, 100], device="cuda")
    with fp.implementation("auto"), tuning.forced("grouped_matmul", moe_torch.GROUPED_MM):
        y = moe_kernels.grouped_matmul(x, w, counts)
    ref = grouped_matmul_reference(x.double(), w.double(), counts)
    assert_close(y, ref, grouped_matmul_reference(x, w, counts), name="grouped_mm")
