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
from pathlib import Path

import pytest
import torch
from fusedpar.kernels import _impl, _tuning
from fusedpar.kernels.attention import attention_forward, attention_reference
from fusedpar.kernels.matmul import matmul

import fusedpar as fp
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import randn

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ("FUSEDPAR_IMPL", "FUSEDPAR_TUNING", "FUSEDPAR_TUNING_CACHE"):
        monkeypatch.delenv(name, raising=False)
    _tuning.forget_picks()
    yield
    _tuning.forget_picks()


def test_the_request_comes_from_the_context_then_the_environment(monkeypatch):
    assert _impl.requested() == "auto"
    monkeypatch.setenv("FUSEDPAR_IMPL", "torch")
    assert _impl.requested() == "torch"
    with fp.implementation("triton"):
        assert _impl.requested() == "triton"
        with fp.implementation("auto"):
            assert _impl.requested() == "auto"
    assert _impl.requested() == "torch"
    monkeypatch.setenv("FUSEDPAR_IMPL", "cuda")
    with pytest.raises(ValueError, match="FUSEDPAR_IMPL must be one of auto, triton, torch"):
        _impl.requested()
    with pytest.raises(ValueError, match="implementation must be one of"), fp.implementation("x"):
        pass


def test_auto_runs_torch_on_a_cpu_and_tunes_nothing():
    q, k, v = (randn((1, 33, 2, 16), torch.float32, i) for i in range(3))
    with fp.implementation("auto"):
        out = fp.flash_attn(q, k, v, causal=True)
        matmul(q[0, :, 0], k[0, :, 0].T)
    assert _tuning.all_picks() == {}  # no tuner ran: torch outright
    ref, _ = attention_reference(*(t.double() for t in (q, k, v)), causal=True)
    assert_close(out, ref, attention_reference(q, k, v, causal=True)[0])


def _tuned_picks(request):
    """The picks a CUDA run makes, on the CPU: the launchers take the tuner's path (not
    torch outright) and its candidates, the interpreter's tile and, under ``auto``,
    torch's implementation, timed against each other."""
    q, k, v = (randn((1, 64, 2, 16), torch.float32, i) for i in range(3))
    a, b = randn((64, 32), torch.float32, 3), randn((32, 48), torch.float32, 4)
    with fp.implementation(request):
        out, _ = attention_forward(q, k, v, causal=True)
        c = matmul(a, b)
    ref, _ = attention_reference(*(t.double() for t in (q, k, v)), causal=True)
    assert_close(out, ref, attention_reference(q, k, v, causal=True)[0])
    assert_close(c, a.double() @ b.double(), a @ b)
    return _tuning.all_picks()


def test_the_tuner_chooses_between_tiles_and_torch(monkeypatch):
    """Under ``auto`` the tuner times torch's implementation beside the tiles, keeps the
    faster (torch: the interpreter runs programs one by one in Python) and records it
    as a pick; under ``triton`` it is no candidate, and the two requests keep their own
    picks."""
    monkeypatch.setattr(_impl, "runs_torch", lambda device: False)
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
    monkeypatch.setattr(_impl, "runs_torch", lambda device: False)
    a, b = randn((16, 32), torch.float16, 0), randn((32, 16), torch.float16, 1)
    with fp.implementation("auto"):
        matmul(a, b, out=torch.zeros(16, 16), accumulate=True)
    (pick,) = _tuning.all_picks()["matmul"].values()
    assert "kwargs" in pick


def _requested_here():
    return _impl.requested()


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
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "ok torch ops (FUSEDPAR_IMPL=auto)" in run.stdout
    assert "set TRITON_INTERPRET=1 before anything imports triton" in run.stdout
