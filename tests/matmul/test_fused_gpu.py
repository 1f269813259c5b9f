"""The fused schedule's GPU tier: its persistent GEMM waiting while the data lands, on one
GPU against the copy-engine stand-in (`bench.standin.CopyEngineGather`: chunks copied
on a side stream, each flagged by a stream write), the watchdog's stop in a subprocess,
and a capture replayed bit for bit. W ranks' chunks are those of one process: the
kernel sees what it would on rank `rank` of W."""

import os
import subprocess
import sys
import time

import pytest
import torch
from fusedpar.kernels import matmul_fused as mf
from fusedpar.kernels.tuning import Launch

from bench.standin import CopyEngineGather
from fusedpar import symmetric

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]


def _operands(W, m=512, K=1024, Ns=(512, 128, 128), dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shards = [torch.randn(m, K, device="cuda", dtype=dtype, generator=gen) for _ in range(W)]
    weights = [torch.randn(n, K, device="cuda", dtype=dtype, generator=gen) / 32 for n in Ns]
    biases = [torch.randn(n, device="cuda", dtype=dtype, generator=gen) for n in Ns]
    return shards, weights, biases


def _fused(side, shard, weights, biases):
    gathered = shard.new_empty((side.world * shard.shape[0], shard.shape[1]))
    side.start(shard, gathered)
    outs = mf.gathered_matmuls(
        gathered,
        [w.t() for w in weights],
        biases,
        mf.Signals(side.flags, side.rank, side.world, side.status),
        programs=side.programs,
    )
    side.finish()
    return outs


@pytest.mark.parametrize("W", [2, 4, 8])
def test_fused_gather_with_random_producer_delays_matches_float64(W):
    shards, weights, biases = _operands(W)
    full = torch.cat(shards)
    ref = [
        full.double() @ w.double().t() + b.double() for w, b in zip(weights, biases, strict=True)
    ]
    plain = None
    for rank in range(W):
        delays = torch.rand(W, generator=torch.Generator().manual_seed(rank)) * 200
        side = CopyEngineGather(shards, rank, None, delays_us=delays.tolist())
        outs = _fused(side, shards[rank], weights, biases)
        torch.cuda.synchronize()
        if plain is None:  # the same tiles with every flag set before the launch
            ones = torch.ones(W, dtype=torch.int32, device="cuda")
            signals = mf.Signals(ones, rank, W)
            plain = mf.gathered_matmuls(full, [w.t() for w in weights], biases, signals)
        for out, p, r in zip(outs, plain, ref, strict=True):
            assert torch.equal(out, p)  # arrival order changes nothing
            err = (out.double() - r).abs().max().item()
            assert err <= 2**-7 * r.abs().max().item(), err


def test_kernel_waits_for_flags_set_from_the_host_after_a_delay():
    W = 4
    shards, weights, biases = _operands(W)
    full = torch.cat(shards)
    flags = torch.zeros(W, dtype=torch.int32, device="cuda")
    # the pick first (its timing launches on scratch, flags set): the call below waits once
    waiting = mf.Signals(flags, 1, W)
    tuning = Launch(tune_only=True)
    mf.gathered_matmuls(full, [w.t() for w in weights], biases, waiting, launch_as=tuning)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        outs = mf.gathered_matmuls(full, [w.t() for w in weights], biases, waiting)
    time.sleep(0.2)
    assert not side.query(), "the kernel ran before its chunks were flagged"
    flags.copy_(torch.ones(W, dtype=torch.int32).pin_memory(), non_blocking=True)
    side.synchronize()
    ones = torch.ones(W, dtype=torch.int32, device="cuda")
    plain = mf.gathered_matmuls(full, [w.t() for w in weights], biases, mf.Signals(ones, 1, W))
    assert all(torch.equal(o, p) for o, p in zip(outs, plain, strict=True))


def test_capture_and_replay_bit_for_bit():
    W = 4
    shards, weights, biases = _operands(W)
    side = CopyEngineGather(shards, 2, None)
    eager = _fused(side, shards[2], weights, biases)  # compiles and tunes outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _fused(side, shards[2], weights, biases)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(c, e) for c, e in zip(captured, eager, strict=True))


_STOPPED = """
import torch
from fusedpar import symmetric
from fusedpar.kernels import matmul_fused as mf
x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
flags = torch.tensor([1, 0], dtype=torch.int32, device="cuda")  # chunk 1 never comes
status = symmetric.Watchdog.of(x.device).status
mf.gathered_matmuls(x, [w], [None], mf.Signals(flags, 0, 2, status, symmetric.wait_seconds()))
torch.cuda.synchronize()
"""


def test_a_wait_past_the_bound_stops_naming_rank_chunk_and_op():
    env = {**os.environ, "FUSEDPAR_WAIT_S": "1", "FUSEDPAR_TUNING": "first"}
    proc = subprocess.run(
        [sys.executable, "-c", _STOPPED], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode != 0
    assert "all_gather_matmul (overlap='fused') on rank 0 waited more than" in proc.stderr
    assert "for chunk 1" in proc.stderr, proc.stderr[-2000:]


def test_reduce_scatter_pieces_count_wait_and_sum():
    """partial_matmuls counts every tile of each chunk; a count wait on a side stream
    releases each chunk's copy; sum_partials waits on flags set as the copies land."""
    W, m, N, K = 4, 256, 1024, 512
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(W * m, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) / 16
    scratch = mf.Signals(torch.zeros(W, dtype=torch.int32, device="cuda"), 1, W)
    config = mf.partial_matmuls([(x, w.t())], scratch, launch_as=Launch(tune_only=True))
    tiles = mf.partial_tiles(config, m, N)
    counts = torch.zeros(W, dtype=torch.int32, device="cuda")
    partials = torch.empty(W * m, N, device="cuda")
    received = torch.randn(W, m, N, device="cuda", generator=gen)
    landed = torch.zeros(W, m, N, device="cuda")
    flags = torch.zeros(W, dtype=torch.int32, device="cuda")
    copy = torch.cuda.Stream(priority=-1)
    copy.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(copy):
        for d in (2, 3, 0):  # rank 1's destinations, in its order
            mf.wait_count(counts, d, tiles, 1)
            landed[d].copy_(partials[d * m : (d + 1) * m])  # where rank d would receive it
            symmetric.signal(flags, d)
    programs = torch.cuda.get_device_properties(0).multi_processor_count - 1
    mf.partial_matmuls([(x, w.t())], mf.Signals(counts, 1, W), out=partials, programs=programs)
    out = mf.sum_partials(partials[m : 2 * m], received, flags, 1, torch.bfloat16)
    torch.cuda.current_stream().wait_stream(copy)
    torch.cuda.synchronize()
    assert counts.tolist() == [tiles] * W
    exact = (x.double() @ w.double().t()).view(W, m, N)
    assert (landed[[0, 2, 3]] - exact[[0, 2, 3]]).abs().max() < 1e-2 * exact.abs().max()
    total = received.double().clone()
    total[1] = partials[m : 2 * m].double()
    assert (out.double() - total.sum(0)).abs().max() <= 2**-7 * total.sum(0).abs().max()


_TWO_RANKS = """
import os, sys, torch, torch.distributed as dist
rank, path = int(sys.argv[1]), sys.argv[2]
os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
torch.cuda.set_device(0)
dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
import fusedpar as fp
from fusedpar import symmetric
symmetric.unavailable = lambda pg: None  # gloo holds the group; symmetric memory the data
gen = torch.Generator().manual_seed(0)
X, w1 = torch.randn(512, 256, generator=gen), torch.randn(384, 256, generator=gen) / 16
w2 = torch.randn(256, 384, generator=gen) / 16
x = X[256 * rank : 256 * (rank + 1)].cuda().bfloat16()
cols = slice(192 * rank, 192 * (rank + 1))
try:  # what the shared device may not allow: a rendezvous (the rest must work)
    from torch.distributed import _symmetric_memory as symm_mem
    probe = symm_mem.empty(16, device="cuda")
    symm_mem.rendezvous(probe, dist.group.WORLD.group_name)
except Exception as error:
    print(f"UNSUPPORTED {type(error).__name__}: {error}", flush=True)
    sys.exit(3)
h = fp.all_gather_matmul(x, w1[cols].cuda().bfloat16(), dist.group.WORLD, overlap="fused")
y = fp.matmul_reduce_scatter(h, w2[:, cols].cuda().bfloat16(), dist.group.WORLD,
                             overlap="fused")
torch.cuda.synchronize()
ref = ((X.double() @ w1.double().T) @ w2.double().T)[256 * rank : 256 * (rank + 1)]
err = (y.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
print(f"RESULT rank {rank} relative error {err:.2e}", flush=True)
sys.exit(0 if err < 2e-2 else 1)
"""


def test_symmetric_transport_two_processes_on_one_gpu(tmp_path):
    """The real transport (`symmetric.Gather` and `Scatter`: rendezvous, barriers, peer
    copies, flags written in the peer's memory) between two processes sharing one GPU
    (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES``), a gloo group standing in for NCCL's
    (NCCL refuses two ranks on one device). Skipped, with torch's reason, where
    symmetric memory refuses the shared device."""
    env = {**os.environ, "FUSEDPAR_TUNING": "first", "FUSEDPAR_WAIT_S": "20"}
    store = tmp_path / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TWO_RANKS, str(r), str(store)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    if all(p.returncode == 3 for p in procs):
        pytest.skip("symmetric memory on one shared GPU: " + outs[0].split("UNSUPPORTED")[-1][:300])
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0 and "RESULT" in out, out[-3000:]
