"""Which implementation runs the ops: the request (`fp.implementation`, FUSEDPAR_IMPL),
the tuner's choice between Triton's tiles and torch's implementation, the request
carried to a World's ranks, and the CPU with no interpreter at all.

Each implementation is checked against the float64 references in the kernels' own tests
(`each_implementation`); here, what picks among them.
"""

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from fusedpar.kernels import impl, tuning
from fusedpar.kernels.attention import AttentionMask, attention_forward, attention_reference
from fusedpar.kernels.matmul import matmul

import fusedpar as fp
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import randn

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ("FUSEDPAR_IMPL", "FUSEDPAR_TUNING", "FUSEDPAR_TUNING_CACHE"):
        monkeypatch.delenv(name, raising=False)
    tuning.forget_picks()
    yield
    tuning.forget_picks()


def test_the_request_comes_from_the_context_then_the_environment(monkeypatch):
    assert impl.requested() == "auto"
    monkeypatch.setenv("FUSEDPAR_IMPL", "torch")
    assert impl.requested() == "torch"
    with fp.implementation("triton"):
        assert impl.requested() == "triton"
        with fp.implementation("auto"):
            assert impl.requested() == "auto"
    assert impl.requested() == "torch"
    monkeypatch.setenv("FUSEDPAR_IMPL", "cuda")
    with pytest.raises(ValueError, match="FUSEDPAR_IMPL must be one of auto, triton, torch"):
        impl.requested()
    with pytest.raises(ValueError, match="implementation must be one of"), fp.implementation("x"):
        pass


def test_auto_runs_torch_on_a_cpu_and_tunes_nothing():
    q, k, v = (randn((1, 33, 2, 16), torch.float32, i) for i in range(3))
    with fp.implementation("auto"):
        out = fp.flash_attn(q, k, v, causal=True)
        matmul(q[0, :, 0], k[0, :, 0].T)
    assert tuning.all_picks() == {}  # no tuner ran: torch outright
    causal = AttentionMask(causal=True)
    ref, _ = attention_reference(*(t.double() for t in (q, k, v)), causal)
    assert_close(out, ref, attention_reference(q, k, v, causal)[0])


def _tuned_picks(request):
    """The picks a CUDA run makes, on the CPU: the launchers take the tuner's path (not
    torch outright) and its candidates, the interpreter's tile and, under ``auto``,
    torch's implementation, timed against each other."""
    q, k, v = (randn((1, 64, 2, 16), torch.float32, i) for i in range(3))
    a, b = randn((64, 32), torch.float32, 3), randn((32, 48), torch.float32, 4)
    with fp.implementation(request):
        out, _ = attention_forward(q, k, v, AttentionMask(causal=True))
        c = matmul(a, b)
    causal = AttentionMask(causal=True)
    ref, _ = attention_reference(*(t.double() for t in (q, k, v)), causal)
    assert_close(out, ref, attention_reference(q, k, v, causal)[0])
    assert_close(c, a.double() @ b.double(), a @ b)
    return tuning.all_picks()


def test_the_tuner_chooses_between_tiles_and_torch(monkeypatch):
    """Under ``auto`` the tuner times torch's implementation beside the tiles, keeps the
    faster (torch: the interpreter runs programs one by one in Python) and records it
    as a pick; under ``triton`` it is no candidate, and the two requests keep their own
    picks."""
    monkeypatch.setattr(impl, "runs_torch", lambda t, name=None: False)

    def timed(fn, device):  # torch the faster: the interpreter's own times (three runs of
        # one program) came out below torch's matmul now and then on a loaded machine
        return 1.0 if isinstance(fn.__defaults__[0], impl.Torch) else 2.0

    monkeypatch.setattr(tuning, "_time_ms", timed)
    auto = _tuned_picks("auto")
    for kernel in ("_attn_fwd_kernel", "matmul"):
        (pick,) = auto[kernel].values()
        assert pick == {"implementation": "torch"}
    triton_picks = _tuned_picks("triton")
    for kernel in ("_attn_fwd_kernel", "matmul"):
        assert len(triton_picks[kernel]) == 2  # the auto pick, and the triton one beside it
        assert {"implementation": "torch"} in triton_picks[kernel].values()
        assert any("kwargs" in p for p in triton_picks[kernel].values())


def test_cuda_matmul_offers_cublas_only_for_its_contract(monkeypatch):
    """Adding into C, or an fp32 C of 16-bit operands, is not one cuBLAS call: there torch
    is no candidate (never a different answer, only a different speed)."""
    monkeypatch.setattr(impl, "runs_torch", lambda t, name=None: False)
    a, b = randn((16, 32), torch.float16, 0), randn((32, 16), torch.float16, 1)
    with fp.implementation("auto"):
        matmul(a, b, out=torch.zeros(16, 16), accumulate=True)
    (pick,) = tuning.all_picks()["matmul"].values()
    assert "kwargs" in pick


def _requested_here():
    return impl.requested()


def test_a_world_carries_the_request_to_its_ranks(world):
    assert world(2).run(_requested_here) == ["auto", "auto"]
    with fp.implementation("torch"):
        assert world(2).run(_requested_here) == ["torch", "torch"]


SCRIPT = textwrap.dedent("""
    import torch, fusedpar as fp
    q = torch.randn(1, 40, 4, 16)
    out = fp.flash_attn(q, q[:, :, :2], q[:, :, :2], causal=True)
    layer = fp.nn.MoE(16, 24, 4, 2)
    y, aux = layer(q.flatten(0, 2)[:40])
    (out.sum() + y.sum() + aux).backward()
    print("ok", fp.implementation_summary("cpu"))
    with fp.implementation("triton"):
        try:
            fp.flash_attn(q, q, q)
        except RuntimeError as e:
            print(e)
""")


def test_a_cpu_needs_no_interpreter_and_triton_without_it_says_so():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FUSEDPAR_IMPL")}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "ok torch ops (FUSEDPAR_IMPL=auto)" in run.stdout
    assert "set TRITON_INTERPRET=1 before anything imports triton" in run.stdout


def test_a_thread_without_the_context_sees_the_active_request():
    """Autograd runs a CUDA backward on its own threads, which start without the
    caller's context variables: they see the innermost request active anywhere."""

    def seen_in_a_thread():
        seen = []
        thread = threading.Thread(target=lambda: seen.append(impl.requested()))
        thread.start()
        thread.join()
        return seen[0]

    assert seen_in_a_thread() == "auto"
    with fp.implementation("torch"):
        assert seen_in_a_thread() == "torch"
        with fp.implementation("triton"):
            assert seen_in_a_thread() == "triton"
        assert seen_in_a_thread() == "torch"
    assert seen_in_a_thread() == "auto"


def test_a_pick_of_torch_never_reaches_a_call_it_cannot_run(monkeypatch):
    """Whether torch's attention may run depends on the exact sizes (a memory bound),
    not on the tuner's buckets: the two kinds of call keep their own picks."""
    from fusedpar.kernels.attention import torch_impl

    monkeypatch.setattr(impl, "runs_torch", lambda t, name=None: False)
    q, k, v = (randn((1, n, 2, 16), torch.float32, i) for i, n in enumerate((40, 60, 60)))
    monkeypatch.setattr(torch_impl, "CUDA_SCORES_LIMIT", 2 * 40 * 40)
    with fp.implementation("auto"):
        attention_forward(q, k[:, :40], v[:, :40])  # capable: torch wins the key
        attention_forward(q[:, :33], k, v)  # the same buckets (64, 64), over the bound
    picks = list(tuning.all_picks()["_attn_fwd_kernel"].values())
    assert {"implementation": "torch"} in picks and any("kwargs" in p for p in picks)


def test_cublas_is_a_candidate_only_where_it_rounds_once(monkeypatch):
    from fusedpar.kernels import matmul_torch as matmul_kernels
    from fusedpar.kernels.matmul import RowRotation
    from fusedpar.kernels.matmul_torch import cublas_computes

    a16, a32 = torch.empty(2, 2, dtype=torch.bfloat16), torch.empty(2, 2)
    monkeypatch.setattr(matmul_kernels, "_reduced_precision_sums", lambda dtype: True)
    assert not cublas_computes(a16, None, torch.bfloat16, False)  # 16-bit split-K sums
    monkeypatch.setattr(matmul_kernels, "_reduced_precision_sums", lambda dtype: False)
    assert cublas_computes(a16, None, torch.bfloat16, False)
    assert not cublas_computes(a16, a32[0], torch.bfloat16, False)  # an fp32 bias
    assert not cublas_computes(a16, None, torch.float32, False)  # an fp32 C
    assert not cublas_computes(a32, None, torch.float32, True)  # adding into C
    assert cublas_computes(a32, None, torch.float32, False)
    rotation = RowRotation(torch.ones(2, 1), torch.zeros(2, 1))
    assert not cublas_computes(a32, None, torch.float32, False, rotation)  # heads turned


def test_bench_tables_name_a_torch_pick():
    from bench.common import _picks_section

    lines = _picks_section({"matmul": {"(1,)": {"implementation": "torch"}}})
    assert "- matmul (1,): torch" in lines


def test_torch_moe_edges(each_implementation):
    """Every slot dropped with nothing to read; counts on another device than x."""
    from fusedpar.kernels.moe import grouped_matmul
    from fusedpar.kernels.moe_permute import combine, combine_weight_grad

    pos = torch.full((3, 2), -1, dtype=torch.int64)
    assert torch.equal(combine(torch.empty(0, 4), pos), torch.zeros(3, 4))
    assert torch.equal(
        combine_weight_grad(torch.ones(3, 4), torch.empty(0, 4), pos), torch.zeros(3, 2)
    )
    counts = torch.ones(2, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="one device"):
        grouped_matmul(torch.ones(4, 8), torch.ones(2, 3, 8), counts)


def test_the_row_kernels_are_tuned_against_torch_indexing(monkeypatch):
    """Permute and combine: on CUDA under ``auto``, their fixed tile and torch's indexing
    are timed per key (here on the CPU, the tuner's path forced). Gathering and combining
    sum in the same order either way, the same bits; the combine's weight gradient, a
    dot over D, sums in another order (to rounding)."""
    from fusedpar.kernels.moe_permute import combine, combine_weight_grad, gather_rows

    src = randn((10, 24), torch.float32, 0)
    idx = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    pos = torch.tensor([[0, 7], [-1, 2], [5, 4], [6, -1]])
    weight, dy = randn((4, 2), torch.float32, 1), randn((4, 24), torch.float32, 2)

    def run():
        return (
            gather_rows(src, idx, weight.flatten()),
            combine(src, pos, weight),
            combine_weight_grad(dy, src, pos),
        )

    with fp.implementation("torch"):
        expected = run()
    with fp.implementation("triton"):
        gathered, combined, dw = run()
    assert torch.equal(gathered, expected[0]) and torch.equal(combined, expected[1])
    torch.testing.assert_close(dw, expected[2])
    tuning.forget_picks()
    monkeypatch.setattr(impl, "runs_torch", lambda t, name=None: False)
    with fp.implementation("auto"):
        tuned = run()
    for got, want in zip(tuned, expected, strict=True):
        assert torch.equal(got, want)
    picks = tuning.all_picks()
    for kernel in ("_gather_rows_kernel", "_combine_kernel", "_combine_weight_grad_kernel"):
        assert list(picks[kernel].values()) == [{"implementation": "torch"}]
