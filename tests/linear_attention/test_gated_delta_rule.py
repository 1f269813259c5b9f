"""fp.gated_delta_rule (and its launchers on torch's implementation) against the float64
token loop, `gated_delta_rule_reference`: the output, the final state and the gradients
of q, k, v, g, beta and the initial state.

Tolerance (DESIGN): twice plain PyTorch's own error in the op's dtype, plus a floor; in
float64 the reference is PyTorch's own math, so the floor alone (1e-12 at magnitude 1).
Gates mix near-0 and very negative values, beta spans (0, 2), K != V and Hv = 2 Hk.
"""

import pytest
import torch
from fusedpar.kernels.linear_attention import (
    gated_delta_backward,
    gated_delta_forward,
    torch_impl,
)
from fusedpar.kernels.linear_attention.chunk import chunk_gated_delta_forward
from fusedpar.kernels.linear_attention.chunk_backward import chunk_gated_delta_backward
from hypothesis import given
from hypothesis import strategies as st

import fusedpar as fp
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import randn, seeds
from tests.linear_attention.helpers import (
    NAMES,
    RESULT_NAMES,
    differentiable_copy,
    gdn_inputs,
    reference,
    run_with_grads,
)

# The implementations the op tests run: torch's (the CPU default). Triton's kernels are
# held to float64 in test_gdn_kernels.py (their launchers, in the interpreter: a
# hypothesis sweep of them here took 3 minutes) and reached through the op below.
IMPLEMENTATIONS = ["torch"]


def _upstream(inputs, seed, dtype=torch.float64):
    """do (o's shape) and dfinal (the final state's) for `inputs`."""
    B, T, Hv, V = inputs["v"].shape
    K = inputs["q"].shape[-1]
    N = B if inputs["cu_seqlens"] is None else inputs["cu_seqlens"].numel() - 1
    return randn((B, T, Hv, V), dtype, seed + 10), randn((N, Hv, K, V), dtype, seed + 11)


def _check(got, want, want_torch=None, names=RESULT_NAMES):
    """Every result of `run_with_grads` against the reference's (None where absent)."""
    for name, a, b, c in zip(names, got, want, want_torch or want, strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            assert_close(a, b, c, name=name)


@pytest.mark.parametrize(
    ("B", "T", "per_channel"),
    [(1, 1, False), (1, 63, False), (1, 64, False), (2, 65, False), (1, 200, False)]
    + [(1, 1, True), (2, 65, True), (1, 200, True)],
)
def test_float64_matches_the_token_loop(B, T, per_channel):
    """Scalar gates (GDN) and per-channel ones (KDA), around the chunk's 64 tokens."""
    inputs = gdn_inputs(B, T, 1, 2, 8, 12, dtype=torch.float64, seed=T, per_channel=per_channel)
    do, dfinal = _upstream(inputs, T)
    got = run_with_grads(fp.gated_delta_rule, inputs, do, dfinal, scale=0.4)
    _check(got, run_with_grads(reference, inputs, do, dfinal, scale=0.4))


@pytest.mark.parametrize("layout", ["time-major", "sliced"])
def test_strided_inputs(layout):
    inputs = gdn_inputs(2, 70, 2, 2, 8, 4, dtype=torch.float64, seed=3, layout=layout)
    assert not inputs["q"].is_contiguous() and not inputs["g"].is_contiguous()
    do, dfinal = _upstream(inputs, 3)
    got = run_with_grads(fp.gated_delta_rule, inputs, do, dfinal)
    _check(got, run_with_grads(reference, inputs, do, dfinal))


def test_l2norm_default_scale_and_no_initial_state():
    """use_qk_l2norm_in_kernel on raw q and k, scale K^-1/2, no initial state (dinit
    None), and o's gradient alone (the final state unused)."""
    inputs = gdn_inputs(1, 90, 2, 1, 16, 8, dtype=torch.float64, seed=5, initial=False)
    inputs["k"] = inputs["k"] * 3  # not unit: the op normalizes
    do, _ = _upstream(inputs, 5)
    options = {"use_qk_l2norm_in_kernel": True}
    got = run_with_grads(fp.gated_delta_rule, inputs, do, None, **options)
    assert got[-1] is None
    _check(got, run_with_grads(reference, inputs, do, None, **options))


def test_packed_documents_match_the_token_loop_and_each_document_alone():
    """Documents of 1, 0, 63 and 130 tokens in one stream: the state restarts at each
    (from its own initial state), and each document run alone gives the same output,
    final state and gradients."""
    lengths = [1, 0, 63, 130]
    inputs = gdn_inputs(
        1, sum(lengths), 2, 2, 8, 12, dtype=torch.float64, seed=7, documents=lengths
    )
    do, dfinal = _upstream(inputs, 7)
    got = run_with_grads(fp.gated_delta_rule, inputs, do, dfinal)
    _check(got, run_with_grads(reference, inputs, do, dfinal))
    bounds = inputs["cu_seqlens"].tolist()
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        alone = {
            name: t[:, start:end] for name, t in inputs.items() if name in ("q", "k", "v", "g")
        }
        alone["beta"] = inputs["beta"][:, start:end]
        alone["initial_state"] = inputs["initial_state"][n : n + 1]
        alone["cu_seqlens"] = None
        one = run_with_grads(fp.gated_delta_rule, alone, do[:, start:end], dfinal[n : n + 1])
        packed = [
            got[0][:, start:end],
            got[1][n : n + 1],
            *(t[:, start:end] for t in got[2:7]),
            got[7][n : n + 1],
        ]
        for name, a, b in zip(RESULT_NAMES, one, packed, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-13, msg=f"document {n}: {name}")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@given(
    T=st.integers(1, 140),
    Hk=st.integers(1, 2),
    group=st.integers(1, 2),
    K=st.sampled_from([4, 8, 16]),
    V=st.sampled_from([4, 12, 16]),
    per_channel=st.booleans(),
    seed=seeds(),
)
def test_fp32_against_float64(implementation, T, Hk, group, K, V, per_channel, seed):
    """fp32 inputs (the float64 reference fed their exact values): within twice the fp32
    token loop's own error of the float64 one, plus the floor."""
    shape = (1, T, Hk, group, K, V)
    options = dict(seed=seed, per_channel=per_channel, exact_in=torch.float32)
    inputs = gdn_inputs(*shape, dtype=torch.float32, **options)
    wide = gdn_inputs(*shape, dtype=torch.float64, **options)
    do, dfinal = _upstream(wide, seed)
    with fp.implementation(implementation):
        got = run_with_grads(fp.gated_delta_rule, inputs, do.float(), dfinal.float())
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    plain = run_with_grads(reference, inputs, do.float(), dfinal.float())
    _check(got, run_with_grads(reference, wide, do, dfinal), plain)


def test_per_channel_decays_formed_a_block_of_chunks_at_a_time(monkeypatch):
    """torch's per-channel decays, (64, 64, K) a chunk, formed a few chunks at a time
    (`DECAY_ELEMENTS` cut to one chunk and head's worth): the same float64 results,
    forward and every gradient, packed documents across the blocks."""
    monkeypatch.setattr(torch_impl, "DECAY_ELEMENTS", 64 * 64 * 8 * 3)
    lengths = [65, 1, 66]
    options = dict(dtype=torch.float64, seed=21, per_channel=True, documents=lengths)
    inputs = gdn_inputs(1, sum(lengths), 1, 2, 8, 4, **options)
    do, dfinal = _upstream(inputs, 21)
    got = run_with_grads(fp.gated_delta_rule, inputs, do, dfinal)
    _check(got, run_with_grads(reference, inputs, do, dfinal))


def test_dtypes_of_the_results():
    """fp16 q, k, v with fp32 g and beta (Hugging Face's mix): o in v's dtype, the final
    state fp32, each gradient in its input's dtype."""
    inputs = gdn_inputs(1, 20, 1, 2, 8, 8, dtype=torch.float16, seed=9)
    inputs["g"], inputs["beta"] = inputs["g"].float(), inputs["beta"].float()
    inputs["initial_state"] = inputs["initial_state"].float()
    do, dfinal = _upstream(inputs, 9, torch.float32)
    got = run_with_grads(fp.gated_delta_rule, inputs, do, dfinal)
    dtypes = [torch.float16, torch.float32, *(torch.float16,) * 3, *(torch.float32,) * 3]
    assert [t.dtype for t in got] == dtypes
    assert all(torch.isfinite(t).all() for t in got)


def test_launchers_on_torch():
    """The launchers as the layers call them: the final state's gradient may be None, and
    so is dinit without an initial state."""
    inputs = gdn_inputs(1, 70, 1, 2, 8, 4, dtype=torch.float64, seed=11, initial=False)
    tensors = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    o, final = gated_delta_forward(*tensors, scale=0.5)
    ref_o, ref_final = reference(*tensors, scale=0.5)
    assert_close(o, ref_o, ref_o, name="o")
    assert_close(final, ref_final, ref_final, name="final_state")
    do, _ = _upstream(inputs, 11)
    grads = gated_delta_backward(do, None, *tensors, scale=0.5)
    want = run_with_grads(reference, inputs, do, None, scale=0.5)
    assert grads[5] is None
    for name, a, b in zip(RESULT_NAMES[2:7], grads[:5], want[2:7], strict=True):
        assert_close(a, b, b, name=name)


def test_compiles_full_graph_and_matches_eager():
    """torch.compile(fullgraph=True) of fp.gated_delta_rule (the l2norm around the op,
    packed documents): no graph break, and the same output and gradients as eager."""
    inputs = gdn_inputs(1, 80, 1, 2, 8, 4, dtype=torch.float32, seed=13, documents=[30, 50])
    do, dfinal = _upstream(inputs, 13, torch.float32)

    def fn(*args, **kwargs):
        return fp.gated_delta_rule(*args, **kwargs)

    eager = run_with_grads(fn, inputs, do, dfinal, use_qk_l2norm_in_kernel=True)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = run_with_grads(compiled, inputs, do, dfinal, use_qk_l2norm_in_kernel=True)
    torch._dynamo.reset()
    for name, a, b in zip(RESULT_NAMES, got, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def _bad(**changes):
    inputs = gdn_inputs(2, 10, 2, 2, 8, 4, dtype=torch.float32, seed=0)
    inputs.update(changes)
    return inputs


BAD = [
    ({"v": torch.randn(2, 10, 3, 4)}, ValueError, "multiple of"),
    ({"k": torch.randn(2, 10, 2, 6)}, ValueError, r"k must be q's shape"),
    ({"v": torch.randn(2, 9, 4, 4)}, ValueError, "same B and T"),
    ({"q": torch.randn(2, 10, 8)}, ValueError, r"\(B, T, Hk, K\)"),
    ({"g": torch.randn(2, 10, 2)}, ValueError, r"g must be \(B, T, Hv\) = \(2, 10, 4\)"),
    ({"beta": torch.rand(2, 10, 4, 1)}, ValueError, r"beta must be \(B, T, Hv\)"),
    ({"initial_state": torch.randn(2, 4, 4, 8)}, ValueError, r"initial_state must be"),
    ({"v": torch.randn(2, 10, 4, 4, dtype=torch.float16)}, TypeError, "share a dtype"),
    ({"g": torch.randn(2, 10, 4, dtype=torch.float64)}, TypeError, "float64"),
    ({"beta": torch.ones(2, 10, 4, dtype=torch.int64)}, TypeError, "beta must be one of"),
    ({"cu_seqlens": torch.tensor([0, 4, 10], dtype=torch.int32)}, ValueError, "one batch row"),
    ({"cu_seqlens": torch.tensor([0, 10])}, TypeError, "int32"),
]


@pytest.mark.parametrize(("changes", "error", "match"), BAD)
def test_bad_inputs_are_refused(changes, error, match):
    inputs = _bad(**changes)
    with pytest.raises(error, match=match):
        fp.gated_delta_rule(
            *(inputs[n] for n in ("q", "k", "v", "g", "beta")),
            initial_state=inputs["initial_state"],
            cu_seqlens=inputs["cu_seqlens"],
        )


def test_bad_sizes_and_documents_are_refused():
    big = gdn_inputs(1, 4, 1, 1, 260, 4, dtype=torch.float32, seed=0, initial=False)
    tensors = [big[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="K = 260"):
        fp.gated_delta_rule(*tensors)
    inputs = gdn_inputs(1, 10, 1, 1, 8, 4, dtype=torch.float32, seed=0, initial=False)
    tensors = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="end at T = 10"):
        fp.gated_delta_rule(*tensors, cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="never decrease"):
        fp.gated_delta_rule(*tensors, cu_seqlens=torch.tensor([0, 6, 4, 10], dtype=torch.int32))
    with pytest.raises(TypeError, match="float64"), fp.implementation("triton"):
        fp.gated_delta_rule(*(t.double() for t in tensors))


@pytest.mark.gpu
def test_torch_implementation_on_cuda_gpu():
    """torch's implementation forced on CUDA, fp32, packed documents: within the rule of
    the float64 token loop, output, final state and every gradient."""
    shape = (1, 194, 2, 2, 16, 16)
    options = dict(seed=1, documents=[1, 63, 130], exact_in=torch.float32)
    inputs = gdn_inputs(*shape, dtype=torch.float32, **options)
    wide = gdn_inputs(*shape, dtype=torch.float64, **options)
    cuda = {n: None if t is None else t.cuda() for n, t in inputs.items()}
    do, dfinal = _upstream(wide, 1)
    with fp.implementation("torch"):
        got = run_with_grads(fp.gated_delta_rule, cuda, do.float().cuda(), dfinal.float().cuda())
    plain = run_with_grads(reference, inputs, do.float(), dfinal.float())
    got = [None if t is None else t.cpu() for t in got]
    _check(got, run_with_grads(reference, wide, do, dfinal), plain)


def test_the_op_runs_the_triton_kernels_when_asked():
    """Under ``fp.implementation("triton")`` the op's results and every gradient are the
    kernels' own (bit for bit: the op adds nothing to them), packed documents and GVA."""
    inputs = gdn_inputs(1, 20, 1, 2, 8, 4, dtype=torch.float32, seed=3, documents=[7, 13])
    do, dfinal = _upstream(inputs, 3, torch.float32)
    with fp.implementation("triton"):
        got = run_with_grads(fp.gated_delta_rule, inputs, do, dfinal, scale=0.5)
    forward = chunk_gated_delta_forward(
        *(inputs[n] for n in NAMES[:5]),
        scale=0.5,
        initial_state=inputs["initial_state"],
        cu_seqlens=inputs["cu_seqlens"],
    )
    backward = chunk_gated_delta_backward(
        do,
        dfinal,
        *(inputs[n] for n in NAMES[:5]),
        scale=0.5,
        initial_state=inputs["initial_state"],
        cu_seqlens=inputs["cu_seqlens"],
    )
    for name, a, b in zip(RESULT_NAMES, got, (*forward, *backward), strict=True):
        assert torch.equal(a, b), name


def test_the_kernels_take_any_layout_and_dtype_of_the_states():
    """Triton's path reads states as fp32 contiguous: a transposed bf16-free initial state,
    a 16-bit one, and the expanded dfinal of ``final.sum()`` give torch's results."""
    inputs = gdn_inputs(2, 9, 1, 2, 8, 4, dtype=torch.float32, seed=5)
    h0 = inputs["initial_state"]
    layouts = {
        "transposed": h0.transpose(-1, -2).contiguous().transpose(-1, -2),
        "fp16": h0.half(),
    }
    for name, state in layouts.items():
        results = {}
        for implementation in ("torch", "triton"):
            leaves = {n: differentiable_copy(inputs[n]) for n in NAMES[:5]}
            init = state.detach().clone().requires_grad_()
            with fp.implementation(implementation):
                o, final = fp.gated_delta_rule(
                    *leaves.values(), initial_state=init, output_final_state=True
                )
                (o.sum() + final.sum()).backward()  # dfinal: an expanded scalar
            results[implementation] = [o, final, *(t.grad for t in leaves.values()), init.grad]
        for a, b in zip(*results.values(), strict=True):
            assert a.dtype == b.dtype and torch.isfinite(b).all(), name
            torch.testing.assert_close(b, a, rtol=2e-3, atol=2e-3, msg=name)


def test_the_kernels_refuse_documents_past_the_sequence():
    inputs = gdn_inputs(1, 9, 1, 1, 4, 4, dtype=torch.float32, seed=6, documents=[4, 5])
    inputs["cu_seqlens"] = torch.tensor([0, 4, 12], dtype=torch.int32)
    with fp.implementation("triton"), pytest.raises(ValueError, match="end at the total"):
        fp.gated_delta_rule(*(inputs[n] for n in NAMES[:5]), cu_seqlens=inputs["cu_seqlens"])


def test_the_kernels_refuse_sizes_past_their_int32_offsets():
    """Meta tensors: no memory, only the sizes (Qwen3.5's 32 value heads of 128, 300k tokens)."""
    q = k = torch.empty((1, 300_000, 16, 128), device="meta")
    v = torch.empty((1, 300_000, 32, 128), device="meta")
    g = beta = torch.empty((1, 300_000, 32), device="meta")
    with fp.implementation("triton"), pytest.raises(ValueError, match="int32 offsets"):
        gated_delta_forward(q, k, v, g, beta, scale=0.1)
