"""The benchmark helpers that run without a GPU: the comm stand-in's arithmetic and copy
(in the interpreter), the stand-in driving the real TP ring loops, the CUDA-graph timing's
fallback, host timing, GPU clocks, and the result files."""

import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import bench.common as common
import fusedpar as fp
from bench.linear import gpu_points, layer_widths, make_case
from bench.standin import PIECE_BYTES, Link, StandInRing, copy_plan, links_from_env, paced_copy
from fusedpar.testing import assert_close

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


# --- the stand-in's arithmetic -------------------------------------------------------


@pytest.mark.parametrize(
    "nbytes", [1, 4 * 3, PIECE_BYTES - 4, PIECE_BYTES + 4, MiB, 4 * MiB + 12, 64 * MiB]
)
@pytest.mark.parametrize("link", [Link(), Link(150.0, 0.0, 16), Link(900.0, 10.0, 1)])
def test_copy_plan_moves_every_byte_once_and_ends_at_the_link_models_time(nbytes, link):
    elem = 4 if nbytes % 4 == 0 else 1
    plan = copy_plan(nbytes, elem, link)
    assert (plan.pieces - 1) * plan.block < plan.numel <= plan.pieces * plan.block
    assert plan.block * elem == PIECE_BYTES
    assert 1 <= plan.grid <= link.ctas
    owned = [p for cta in range(plan.grid) for p in plan.cta_pieces(cta)]
    assert sorted(owned) == list(range(plan.pieces))  # each piece, one CTA
    dues = [plan.due_ns(p) for p in range(plan.pieces)]
    assert dues == sorted(dues) and dues[0] >= plan.latency_ns
    # The last piece is due at latency + bytes / bandwidth: the kernel's integer ps
    # arithmetic is off by at most half a ps per piece plus the final ns truncation.
    nominal_ns = link.nominal_ms(nbytes) * 1e6
    assert abs(dues[-1] - nominal_ns) <= plan.pieces / 2 / 1000 + 1
    # each CTA paces its own pieces evenly: grid pieces' worth of time apart
    for cta in range(plan.grid):
        mine = [plan.due_ns(p) for p in plan.cta_pieces(cta)]
        gaps = [b - a for a, b in zip(mine, mine[1:], strict=False)]
        assert all(abs(g - plan.grid * plan.piece_ps / 1000) <= 1 for g in gaps)


def _finish_ns(plan, *, tick_ns, copy_ns, phase_ns):
    """When the kernel's last CTA finishes, simulating its loop: every CTA starts at 0
    and reads a timer that advances in ticks (first tick at -phase_ns); each piece
    takes copy_ns, then the CTA spins while the timer reads less than start + due."""
    timer = lambda t: math.floor((t + phase_ns) / tick_ns) * tick_ns
    start, end = timer(0), 0.0
    for cta in range(plan.grid):
        t = 0.0
        for p in plan.cta_pieces(cta):
            t += copy_ns
            due = start + plan.due_ns(p)
            if timer(t) < due:  # the first tick at or past the due time ends the spin
                t = max(t, math.ceil(due / tick_ns) * tick_ns - phase_ns)
        end = max(end, t)
    return end


@pytest.mark.parametrize("tick_ns", [1, 32, 1000])
@pytest.mark.parametrize("mib", [4, 16, 64])
def test_pacing_ends_within_a_timer_tick_of_the_link_model(tick_ns, mib):
    # The ring's messages are 4 MiB and up (8B QKV, TP = 8, 4k tokens: 512 rows x 8 KiB);
    # a copy CTA moving 32 KiB in 1 us is far slower than an SM can, and still keeps pace.
    link = Link()
    plan = copy_plan(mib * MiB, 4, link)
    nominal_ns = link.nominal_ms(mib * MiB) * 1e6
    for phase in (0.0, 0.25, 0.5, 0.99):
        end = _finish_ns(plan, tick_ns=tick_ns, copy_ns=1000, phase_ns=phase * tick_ns)
        assert abs(end - nominal_ns) <= tick_ns + 1, (end, nominal_ns)
    assert (tick_ns + 1) / nominal_ns < 0.07  # well inside the 10% the bench aims for


def test_a_copy_slower_than_its_pace_shows_in_the_time():
    plan = copy_plan(4 * MiB, 4, Link())
    per_cta_pieces = math.ceil(plan.pieces / plan.grid)
    end = _finish_ns(plan, tick_ns=1, copy_ns=10_000, phase_ns=0)
    assert end == per_cta_pieces * 10_000 > Link().nominal_ms(4 * MiB) * 1e6


def test_link_model_numbers():
    link = Link(350.0, 3.0, 32)
    # 3.5 MB at 350 GB/s is 10 us, plus 3 us of latency
    assert math.isclose(link.nominal_ms(3_500_000), 0.013)
    plan = copy_plan(64 * MiB, 4, link)
    assert (plan.pieces, plan.grid) == (2048, 32)
    # per CTA, 350 / 32 GB/s: the pace a copy CTA must keep up with (it can: ~11 GB/s)
    per_cta_gbps = PIECE_BYTES / (plan.grid * plan.piece_ps / 1000)
    assert math.isclose(per_cta_gbps, 350 / 32, rel_tol=1e-3)


@pytest.mark.parametrize(
    "kwargs", [dict(gbps=0.0), dict(gbps=math.inf), dict(latency_us=-1.0), dict(ctas=0)]
)
def test_bad_links_raise(kwargs):
    with pytest.raises(ValueError):
        Link(**kwargs)


def test_links_from_the_environment(monkeypatch):
    for name in ("BENCH_COMM_GBPS", "BENCH_COMM_LATENCY_US", "BENCH_COMM_CTAS"):
        monkeypatch.delenv(name, raising=False)
    assert links_from_env() == [Link()]
    monkeypatch.setenv("BENCH_COMM_GBPS", "350, 150")
    monkeypatch.setenv("BENCH_COMM_CTAS", "16")
    assert links_from_env() == [Link(350.0, Link().latency_us, 16), Link(150.0, 3.0, 16)]
    monkeypatch.setenv("BENCH_COMM_GBPS", "fast")
    with pytest.raises(ValueError, match="BENCH_COMM_GBPS"):
        links_from_env()
    monkeypatch.setenv("BENCH_COMM_GBPS", "350")
    monkeypatch.setenv("BENCH_COMM_CTAS", "16,32")
    with pytest.raises(ValueError, match="one value each"):
        links_from_env()


# --- the copy kernel (interpreter: unpaced) -------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(3 * PIECE_BYTES // 4 + 5),  # fp32, several pieces, a short last one
        lambda: torch.randn(4099).to(torch.float16),  # odd count of 2-byte elements
        lambda: torch.randint(0, 255, (70001,), dtype=torch.uint8),  # odd bytes, never 255
        lambda: torch.randn(2, 9000).to(torch.float16)[:, 1:].contiguous()[1:],  # offset view
        lambda: torch.empty(0),
    ],
)
def test_paced_copy_copies_every_byte(make):
    src = make()
    dst = torch.full_like(src, float("nan") if src.is_floating_point() else 255)  # poisoned
    plan = paced_copy(src, dst, Link(ctas=3), pace=False)
    assert torch.equal(src, dst)
    assert plan.nbytes == src.nbytes and plan.grid <= 3


def test_paced_copy_rejects_bad_input():
    a, b = torch.randn(64), torch.randn(65)
    with pytest.raises(ValueError, match="bytes"):
        paced_copy(a, b, Link(), pace=False)
    with pytest.raises(ValueError, match="contiguous"):
        paced_copy(torch.randn(8, 8).T, torch.randn(8, 8), Link(), pace=False)
    with pytest.raises(ValueError, match="pace=False"):
        paced_copy(a, torch.empty_like(a), Link())


# --- the stand-in ring in the real loops ----------------------------------------------


def test_stand_in_ring_drives_the_all_gather_loop():
    from fusedpar.ops.tp_schedules import gather_matmuls

    torch.manual_seed(0)
    world, n, k, widths = 3, 5, 24, (17, 9)
    x = torch.randn(n, k)
    weights = [torch.randn(w, k) for w in widths]
    ring = StandInRing(world, Link(), device="cpu")
    outs, gathered = gather_matmuls(x, [w.T for w in weights], [None, None], None, 1, ring=ring)
    # every "rank" holds the same rows, so the gathered input is x repeated
    assert torch.equal(gathered, x.repeat(world, 1))
    assert ring.sent_bytes == (world - 1) * x.nbytes
    for out, w in zip(outs, weights, strict=True):
        ref = gathered.double() @ w.double().T
        assert_close(out, ref, gathered @ w.T, name="gathered GEMM")


def test_stand_in_ring_drives_the_reduce_scatter_loop():
    from fusedpar.ops.tp_schedules import matmuls_reduce_scatter

    torch.manual_seed(1)
    world, rows, n = 4, 3, 19
    pairs = [(torch.randn(world * rows, kk), torch.randn(kk, n)) for kk in (13, 6)]
    ring = StandInRing(world, Link(), device="cpu")
    out = matmuls_reduce_scatter(pairs, None, 1, torch.float32, ring=ring)

    # the running sum passes every block of rows once: the sum over blocks of sum_i A_i B_i
    def blocks_sum(dtype):
        total = sum(a.to(dtype) @ b.to(dtype) for a, b in pairs)
        return total.view(world, rows, n).sum(0)

    assert_close(out, blocks_sum(torch.float64), blocks_sum(torch.float32), name="rs sum")
    assert ring.sent_bytes == (world - 1) * rows * n * 4  # fp32 running sums


def test_copy_engine_stand_ins_drive_the_fused_schedule(triton_kernels):
    """The fused schedule's two sides against the copy-engine stand-ins (on CPU: copies at
    once, the kernels in the interpreter): the gather equals the plain GEMMs over the
    peers' rows; the reduce-scatter is this rank's partial plus the peers' incoming ones."""
    from bench.standin import CopyEngineGather, CopyEngineScatter
    from fusedpar.ops.linear_fused import gather_matmuls_fused, matmuls_reduce_scatter_fused

    gen = torch.Generator().manual_seed(5)
    world, m, k, widths = 3, 7, 24, (17, 9)
    peers = [torch.randn(m, k, generator=gen) for _ in range(world)]
    weights = [torch.randn(w, k, generator=gen) for w in widths]
    side = CopyEngineGather(peers, 1, Link())
    outs, gathered = gather_matmuls_fused(
        peers[1], [w.T for w in weights], [None, None], None, side=side
    )
    assert torch.equal(gathered, torch.cat(peers)) and side.flags.tolist() == [1] * world
    for out, w in zip(outs, weights, strict=True):
        assert_close(out, gathered.double() @ w.double().T, gathered @ w.T, name="fused gather")
    pairs = [
        (torch.randn(world * m, kk, generator=gen), torch.randn(kk, 19, generator=gen))
        for kk in (13, 6)
    ]
    incoming = torch.randn(world, m, 19, generator=gen)
    side = CopyEngineScatter(incoming, 2, Link())
    out = matmuls_reduce_scatter_fused(pairs, None, torch.float32, side=side)
    own = sum(a.double() @ b.double() for a, b in pairs)[2 * m :]
    ref = own + incoming.double()[:2].sum(0)
    assert_close(out, ref, (own + incoming.double()[:2].sum(0)).float(), name="fused rs")
    assert side.counts.tolist() == [side.counts[0].item()] * world  # every chunk counted
    exact = sum(a.double() @ b.double() for a, b in pairs).view(world, m, 19)
    sent = (side.sink[:2].double() - exact[:2]).abs().max()  # rank 2's partials for 0 and 1
    assert sent <= 1e-5 * exact.abs().max()


def test_stand_in_ring_without_a_link_moves_nothing():
    ring = StandInRing(2, None, device="cpu")
    sent = torch.randn(4, 4)
    recv = ring.send_recv(sent)
    assert ring.wait() is recv and torch.equal(recv, torch.zeros(4, 4))
    # two buffers per shape, used in turn (as `Ring`)
    assert ring.send_recv(sent) is not recv and ring.wait() is not None
    with pytest.raises(RuntimeError, match="no send_recv"):
        ring.wait()
    ring.send_recv(sent)
    with pytest.raises(RuntimeError, match="before wait"):
        ring.send_recv(sent)


@pytest.mark.parametrize("side", ["ag"])  # "rs": test_the_gpu_part_runs_end_to_end_on_cpu
def test_a_gpu_point_runs_its_calls_on_cpu(side):
    case = make_case(side, d=32, widths=[16, 8], tp=2, tokens=16, device="cpu")
    case.loop(StandInRing(2, Link(), device="cpu"))
    case.loop(StandInRing(2, None, device="cpu"))
    case.gemms()
    case.unchunked()
    case.cublas()
    # one rank's rows travel: x rows (ag) or fp32 running sums (rs), (tokens / tp, d)
    assert case.message.shape == case.peer_message.shape == (8, 32)
    assert case.message.dtype == torch.float32


def test_gpu_grid_and_shapes(monkeypatch):
    assert layer_widths("llama3-8b", "qkv", 8) == (4096, [512, 128, 128])
    assert layer_widths("llama3-70b", "gate_up", 2) == (8192, [14336, 14336])
    monkeypatch.delenv("BENCH_QUICK", raising=False)
    points = list(gpu_points())
    # two sides per point, and the reduce-scatter with bf16 partials at TP 8
    assert len(points) == 2 * 2 * 3 * (2 + 2 + 3) and len(set(points)) == len(points)
    assert {p[3] for p in points} == {4096, 8192, 16384}
    assert {p[2] for p in points if p[4] == "rs-bf16"} == {8}
    monkeypatch.setenv("BENCH_QUICK", "1")
    assert len(list(gpu_points())) == 2 * 2 * 1 * (2 + 3)


def test_the_gpu_part_runs_end_to_end_on_cpu(monkeypatch, tmp_path, triton_kernels):
    """`gpu_main` with tiny shapes and each timer replaced by one call of its function:
    every call a GPU run makes, the row assembly, the result files and the plot."""
    import bench.linear as linear

    monkeypatch.setattr(linear, "MODELS", {"tiny": (32, 48, 32, 16)})
    # the "ag" calls: test_a_gpu_point_...; "rs-bf16": the partials travel in bf16
    points = [("tiny", "gate_up", 4, 16, "rs"), ("tiny", "gate_up", 4, 16, "rs-bf16")]
    monkeypatch.setattr(linear, "gpu_points", lambda: iter(points))
    monkeypatch.setattr(linear, "STANDIN_SIZES_MB", (1,))
    monkeypatch.setattr(linear, "time_ms", lambda fn, **kw: (fn(), 1.0)[1])
    monkeypatch.setattr(linear, "time_ms_graph", lambda fn, **kw: (fn(), (0.5, None))[1])
    monkeypatch.setattr(linear, "host_ms", lambda fn, **kw: (fn(), 0.25)[1])
    monkeypatch.setattr(linear, "environment", lambda: {"device": "cpu stand-in"})
    monkeypatch.setattr(linear, "nccl_p2p_issue_us", lambda: (None, "no NCCL here"))
    for name in ("BENCH_COMM_GBPS", "BENCH_COMM_LATENCY_US", "BENCH_COMM_CTAS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    linear.gpu_main("cpu")
    folder = tmp_path / common.device_slug()
    data = json.loads((folder / "linear.json").read_text())
    standin, *gpu = data["rows"]
    assert standin["part"] == "standin" and standin["msg_mb"] == 1.0
    assert math.isclose(standin["comm_nominal_ms"], Link().nominal_ms(MiB))
    assert [(r["side"], r["world"], r["N"], r["K"]) for r in gpu] == [("rs", 4, 24, 32)] * 2
    for r, tp, wire in zip(gpu, (4, 4), (torch.float32, torch.bfloat16), strict=True):
        assert r["part"] == "gpu" and set(linear.GPU_COLUMNS) - {"unpaced_ms"} <= set(r)
        assert r["vs_max"] == 1.0 and r["serialized_ms"] == 2.0 and r["speedup"] == 1.0
        assert (r["host_us_step"], r["gpu_us_step"]) == (250 / tp, 500 / tp)
        assert r["host_bound"] is False and r["graph_note"] is None
        assert r["reduce_dtype"] == str(wire) and r["auto"] == "serial"  # the first of equals
        assert r["serial_ms"] == r["auto_ms"] == 1.0 and r["auto_speedup"] == 1.0
        assert r["fused_ms"] == r["fused_speedup"] == 1.0 and r["symm_mem_ms"] is None
        assert r["symm_mem_note"].startswith("n/a")
        nbytes = 16 // tp * 32 * wire.itemsize  # the ring and its peer send the same bytes
        assert math.isclose(r["comm_nominal_ms"], (tp - 1) * Link().nominal_ms(nbytes))
    meta = data["meta"]
    assert meta["nccl_p2p_issue_us"] is None and meta["nccl_p2p_issue_note"] == "no NCCL here"
    assert meta["links"] == [vars(Link())] and meta["worst_vs_max"] == 1.0
    assert meta["tuning_picks"]["matmul"] and "partial" not in meta
    assert (folder / "linear.md").exists()
    # the plot needs matplotlib (the "bench" extra; the test command installs "test" only)
    assert (folder / "linear.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_paced_copy_compiles_for_gpus_with_its_timer_and_vector_loads():
    """The interpreter never runs the pacing branch: compile it for sm_80 and sm_90."""
    script = """
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from bench.standin import _paced_copy_kernel as k
sig = {"src_ptr": "*i32", "dst_ptr": "*i32", "numel": "i32", "pieces": "i32",
       "latency_ns": "i32", "piece_ps": "i64", "BLOCK": "constexpr", "PACE": "constexpr"}
# the launcher's runtime specialisation: 16-byte aligned pointers, numel % 16 == 0
attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
out = {}
for cap in (80, 90):
    src = ASTSource(fn=k, signature=sig, constexprs={"BLOCK": 8192, "PACE": True}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", cap, 32),
                         options={"num_warps": 8, "num_stages": 1}).asm["ptx"]
    out[cap] = {"timer": ptx.count("%globaltimer"),
                "ops": sorted(set(re.findall(r"(?:ld|st)\\.global\\S*", ptx)))}
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for cap, found in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        assert found["timer"] >= 2, f"sm_{cap}: the spin loop lost its timer reads"
        assert found["ops"] == ["ld.global.v4.b32", "st.global.v4.b32"], (cap, found)


# --- bench/common.py ---------------------------------------------------------------


def test_time_ms_graph_without_cuda_says_why_and_runs_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ms, reason = common.time_ms_graph(lambda: pytest.fail("must not run"))
    assert ms is None and reason == "no CUDA device"


class _FakeGraph:
    def replay(self):
        pass


def _fake_cuda(monkeypatch, capture):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)


def test_time_ms_graph_records_a_failed_capture(monkeypatch):
    @contextlib.contextmanager
    def failing_capture(graph):
        yield
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    _fake_cuda(monkeypatch, failing_capture)
    calls = []
    ms, reason = common.time_ms_graph(lambda: calls.append(1))
    assert ms is None
    assert reason == "RuntimeError: operation not permitted when stream is capturing"
    assert len(calls) == 2  # once eagerly (tuner picks, compiles), once in the capture


def test_time_ms_graph_times_the_replay(monkeypatch):
    captured = []

    @contextlib.contextmanager
    def capture(graph):
        captured.append(graph)
        yield

    _fake_cuda(monkeypatch, capture)
    timed = []
    monkeypatch.setattr(common, "time_ms", lambda fn, **kw: timed.append(fn) or 0.25)
    assert common.time_ms_graph(lambda: None) == (0.25, None)
    assert timed[0].__self__ is captured[0]  # do_bench timed graph.replay, not fn


def test_host_ms_times_the_issuing():
    calls = []
    ms = common.host_ms(lambda: calls.append(time.sleep(0.002)), reps=3)
    assert len(calls) == 3 and 2.0 <= ms < 200


def test_gpu_clocks(monkeypatch, tmp_path):
    monkeypatch.setattr(common.shutil, "which", lambda name: None)
    assert common.gpu_clocks() is None
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\necho 'clocks.current.sm [MHz], clocks.current.memory [MHz], "
        "clocks.max.sm [MHz]'\necho '1755 MHz, 2619 MHz, 1980 MHz'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(common.shutil, "which", lambda name: str(fake))
    assert common.gpu_clocks() == [
        {
            "clocks.current.sm [MHz]": "1755 MHz",
            "clocks.current.memory [MHz]": "2619 MHz",
            "clocks.max.sm [MHz]": "1980 MHz",
        }
    ]
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert common.gpu_clocks() is None
    assert common.parse_csv_query("only a header\n") is None


def test_write_results_records_nulls_and_tuner_picks(monkeypatch, tmp_path, triton_kernels):
    from fusedpar.kernels.matmul import matmul

    matmul(torch.randn(5, 7), torch.randn(7, 3))  # makes (at least) one pick
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    rows = [{"a": 1, "b": None, "c": 0.123456}, {"a": 2, "b": 1001.4, "c": 98765.4}]
    folder = common.write_results(
        "fam", rows, ["a", "b", "c"], {"device": "dev", "k": 2}, announce=False
    )
    assert folder == tmp_path / common.device_slug()
    data = json.loads((folder / "fam.json").read_text())
    assert data["rows"] == rows and data["meta"]["k"] == 2
    picks = data["meta"]["tuning_picks"]
    assert picks == common.tuning_picks() and picks["matmul"]
    assert data["meta"]["implementation"] == fp.implementation_summary("cpu")
    assert "Triton kernels" in data["meta"]["implementation"]
    table = (folder / "fam.md").read_text()
    assert "| 1 | n/a | 0.123 |" in table
    assert "| 2 | 1001 | 98765 |" in table  # three figures, but never "1e+03"
    assert "## Tuner picks" in table and "- matmul (" in table
    assert "tuning_picks:" not in table


def test_matmul_bench_graph_columns(monkeypatch):
    import bench.matmul as mm

    assert mm.graph_timed(8, 4096) and not mm.graph_timed(8, 8192) and not mm.graph_timed(4, 2048)
    results = iter([(None, "RuntimeError: capture failed"), (0.5, None)])
    monkeypatch.setattr(mm, "time_ms_graph", lambda fn: next(results))
    row = mm._graph_point(None, None, None, flops=1e9)
    assert row == {
        "fusedpar_graph_tflops": None,
        "torch_graph_tflops": 1e9 / 0.5 / 1e9,
        "graph_note": "fusedpar: RuntimeError: capture failed",
    }


# --- context parallelism: what each mode sends, counted from the code --------------------


def test_the_context_parallel_counts_match_the_closed_forms(world):
    """Per rank, fp32, B = 1, s = S/W tokens, W = 4: the ring sends K and V W - 1 times
    forward; backward K, V W - 1 times and the fp32 dK, dV sums W times. Ulysses sends
    (P - 1)/P of q, k, v (k, v replicated to P heads when Hkv < P) and out forward,
    and of dout, dq, dk, dv backward. The hybrid does Ulysses' exchange over U, then
    the ring over R on the exchanged tensors."""
    from bench.context_parallel import cpu_modes

    W, S, Hq, Hkv, D = 4, 16, 4, 1, 8
    shape = dict(batch=1, seq_len=S, heads=Hq, kv_heads=Hkv, head_dim=D)
    rows = {r["mode"]: r for r in cpu_modes(W, shape, reps=1, pool=world(W))}  # the session's
    s, f32 = S // W, 4

    def kib(n):
        return n * f32 / 1024

    ring, ulysses, hybrid = rows["ring 4"], rows["ulysses 4"], rows["hybrid 2x2"]
    kv = s * Hkv * D  # one rank's K (or V) block
    assert (ring["fwd_messages"], ring["fwd_kib"]) == (2 * (W - 1), kib(2 * (W - 1) * kv))
    assert (ring["bwd_messages"], ring["bwd_kib"]) == (2 * (2 * W - 1), kib(2 * (2 * W - 1) * kv))
    q_part, kv_part = s * Hq * D * (W - 1) // W, s * W * D * (W - 1) // W  # KV replicated to W
    assert (ulysses["fwd_messages"], ulysses["fwd_kib"]) == (
        4 * (W - 1),
        kib(2 * q_part + 2 * kv_part),
    )
    assert (ulysses["bwd_messages"], ulysses["bwd_kib"]) == (
        4 * (W - 1),
        kib(2 * q_part + 2 * kv_part),
    )
    R = U = 2  # exchange over U (Hkv = 1 replicated to 2), then a ring of 2 on s U tokens
    exchange = 2 * s * Hq * D // U + 2 * s * U * D // U
    ring_kv = s * U * 1 * D
    assert (hybrid["fwd_messages"], hybrid["fwd_kib"]) == (
        4 * (U - 1) + 2 * (R - 1),
        kib(exchange + 2 * (R - 1) * ring_kv),
    )
    assert hybrid["bwd_messages"] == 4 * (U - 1) + 2 * (2 * R - 1)
    assert hybrid["bwd_kib"] == kib(exchange + 2 * (2 * R - 1) * ring_kv)


def test_the_host_overhead_bench_measures_every_row():
    """`python -m bench host_overhead` at one round per slice: every row timed beside its
    floor, the layers' launches counted (stubbed), nothing launched for real."""
    from bench import host_overhead

    threads = torch.get_num_threads()
    rows = host_overhead.measure(rounds=host_overhead.SLICES, threads=1)
    assert torch.get_num_threads() == threads and all(r["threads"] == 1 for r in rows)
    assert [r["layer"] for r in rows][:2] == [
        "fusedpar op dispatch (empty)",
        "torch.library op (empty)",
    ]
    assert len(rows) == 9 and all(r["host_us"] > 0 and r["floor_us"] > 0 for r in rows)
    launches = {r["layer"]: r["launches"] for r in rows}
    assert launches["fusedpar op dispatch (empty)"] == 0 and launches["ParallelSwiGLU"] > 0
    assert all(r["aten_ops"] > 0 for r in rows)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_the_step_time_bench_builds_a_training_step(moe, capsys):
    """`bench/step_time.py`'s step on the CPU (its torch implementations): a step moves
    the parameters; without a GPU the bench says so and measures nothing."""
    from bench import step_time

    step, model = step_time.build(
        moe, ("tiny", 32, 4, 2, 64, 8), torch.device("cpu"), torch.float32
    )
    before = [p.detach().clone() for p in model.parameters()]
    step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    step_time.main()
    assert "no CUDA device" in capsys.readouterr().out
