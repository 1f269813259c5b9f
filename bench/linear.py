"""Tensor-parallel GEMMs: the ring pipeline against the serialized collective + GEMM.

CPU (gloo; skipped when a GPU is present): the ring pipelines against "all-gather, then
GEMM" and "GEMM, then reduce-scatter" at W = 2 and 4, torch doing every GEMM, so the
comparison measures the pipelining alone.

GPU (one device): the real ring loops, `gather_matmuls` and `matmuls_reduce_scatter`,
with `StandInRing` for `Ring`: its ``send_recv`` launches `paced_copy` on a side stream,
a copy kernel on ``ctas`` CTAs that moves the message's bytes through HBM at a set link
bandwidth and holds its SMs for the whole transfer, as NCCL's kernels do. Llama-3 8B and
70B QKV (three GEMMs per step) and gate/up (two) at TP = 2, 4, 8 and 4k-16k tokens,
bf16; side ``ag`` is the column-parallel forward, side ``rs`` its backward dX (fp32
running sums travel, as the library sends them by default; ``rs-bf16``, at TP 8: the
partials travel in bf16, ``reduce_dtype=torch.bfloat16``). A row's ``reduce_dtype``
names what its ring and its serial peer both send. docs/tensor_parallel.md has the link
model's sources and reads the columns:

| column (GPU rows)   | meaning                                                          |
| ------------------- | ---------------------------------------------------------------- |
| ``gemm_ms``         | the loop's chunk GEMMs alone, the same calls, one stream          |
| ``comm_ms``         | the stand-in's W - 1 transfers alone (``comm_vs_nominal``: over   |
|                     | the link model's latency + bytes / bandwidth)                     |
| ``ring_ms``         | the real loop with the stand-in (eager, ``do_bench``)             |
| ``vs_max``          | ``ring_ms / max(comm_ms, gemm_ms)``: target <= 1.1               |
| ``nocomm_ms``       | the real loop with a ring that moves nothing                      |
| ``serial_cublas_ms``| one cuBLAS GEMM (weights concatenated), then the collective's     |
|                     | bytes over the same link (``speedup`` = it / ``ring_ms``)         |
| ``serial_ms``       | fusedpar's serial schedule: its tuned GEMMs over all rows, then   |
|                     | the same bytes over the same link                                 |
| ``fused_ms``        | the fused schedule (one persistent GEMM) against the copy-engine  |
|                     | stand-in (`CopyEngineGather` / `CopyEngineScatter`: copies off    |
|                     | the SMs after the link's time); ``fused_speedup`` =               |
|                     | ``serial_cublas_ms`` / it; ``fused_vs_max`` = it / max(the link's |
|                     | nominal time, the unchunked GEMMs): target <= 1.1                 |
| ``symm_mem_ms``     | PyTorch's symm_mem fused ops: n/a on one process (the note says)  |
| ``auto``, ``auto_ms``| the schedule ``overlap="auto"`` picks (the fastest of its       |
|                     | candidates, as it measures per shape on a GPU) and its time;      |
|                     | ``auto_speedup`` = ``serial_cublas_ms`` / it (target >= 1.0)      |
| ``ring_graph_ms``   | the loop replayed from a CUDA graph (null + ``graph_note``)       |
| ``host_us_step``    | host time to issue the loop / W; ``gpu_us_step`` = graph time / W |
| ``chunking_cost``   | ``gemm_ms`` / the same GEMMs unchunked (wave quantization, P4)    |

Environment: ``BENCH_COMM_GBPS`` (comma-separated for several links),
``BENCH_COMM_LATENCY_US``, ``BENCH_COMM_CTAS``; ``BENCH_QUICK=1``: TP = 2 and 8 at 8k.
"""

import datetime
import os
import statistics
import time
from dataclasses import dataclass

import torch
from fusedpar.kernels.tuning import LAUNCH

from bench.common import (
    GRAPH_TIMING,
    environment,
    host_ms,
    paired_bars,
    quick,
    require_gpu,
    time_ms,
    time_ms_graph,
    write_results,
)
from bench.standin import PIECE_BYTES, Link, StandInRing, links_from_env, paced_copy

CPU_SHAPE = {"tokens": 2048, "k": 1024, "n": 1024}  # per TP group, fp32
CPU_WORLDS = (2, 4)
CPU_REPS = 7

# name: (d_model, d_ffn, q width, k (= v) width); per rank each width is split TP ways
MODELS = {"llama3-8b": (4096, 14336, 4096, 1024), "llama3-70b": (8192, 28672, 8192, 1024)}
PROJECTIONS = ("qkv", "gate_up")
SIDES = ("ag", "rs")  # and "rs-bf16" at TP 8 (`gpu_points`)


def torch_gemm(
    a,
    b,
    *,
    out=None,
    bias=None,
    accumulate=False,
    out_dtype=None,
    rope=None,
    launch_as=LAUNCH,
):
    """The GEMM callback of the ring pipelines, done by torch (for the CPU comparison):
    `matmul`'s signature, with nothing to tune (and no rotation: the bench asks none)."""
    assert rope is None
    if launch_as.tune_only:
        return None
    if accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)
    if bias is not None:
        out += bias


def _cpu_rank(tokens, k, n, reps):
    """Runs on every rank: medians (ms) of the four variants; the slowest rank counts."""
    import torch.distributed as dist

    from fusedpar.comm import all_gather, reduce_scatter
    from fusedpar.ops.tp_schedules import gather_matmuls, matmuls_reduce_scatter

    pg, size = dist.group.WORLD, dist.get_world_size()
    torch.manual_seed(dist.get_rank())
    x_shard = torch.randn(tokens // size, k)  # column side: this rank's tokens
    w_col = torch.randn(n // size, k)
    x_full = torch.randn(tokens, k // size)  # row side: this rank's features
    w_row = torch.randn(n, k // size)
    variants = {
        "ag_gemm_serial": lambda: all_gather(x_shard, pg) @ w_col.T,
        "ag_gemm_ring": lambda: gather_matmuls(x_shard, [w_col.T], [None], pg, 1, torch_gemm),
        "gemm_rs_serial": lambda: reduce_scatter(x_full @ w_row.T, pg),
        "gemm_rs_ring": lambda: matmuls_reduce_scatter(
            [(x_full, w_row.T)], pg, 1, torch.float32, gemm=torch_gemm
        ),
    }
    medians = {}
    for name, fn in variants.items():
        fn()  # warm-up
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        medians[name] = statistics.median(times)
    return medians


def cpu_overlap() -> list[dict]:
    from fusedpar.testing import World

    rows = []
    for size in CPU_WORLDS:
        with World(size, threads_per_rank=max(1, (os.cpu_count() or 1) // size)) as world:
            per_rank = world.run(_cpu_rank, **CPU_SHAPE, reps=CPU_REPS)
        slowest = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
        for op in ("ag_gemm", "gemm_rs"):
            serial, ring = slowest[f"{op}_serial"], slowest[f"{op}_ring"]
            rows.append(
                dict(world=size, op=op, serial_ms=serial, ring_ms=ring, speedup=serial / ring)
            )
            print(
                f"W={size} {op}: serialized {serial:.1f} ms, ring {ring:.1f} ms "
                f"({serial / ring:.2f}x)"
            )
    return rows


# --- the GPU part --------------------------------------------------------------------


def gpu_points():
    """(model, proj, tp, tokens, side) for every GPU point, in run order."""
    tps, token_counts = ((2, 8), (8192,)) if quick() else ((2, 4, 8), (4096, 8192, 16384))
    for model in MODELS:
        for proj in PROJECTIONS:
            for tp in tps:
                for tokens in token_counts:
                    for side in (*SIDES, "rs-bf16") if tp == 8 else SIDES:
                        yield model, proj, tp, tokens, side


def layer_widths(model: str, proj: str, tp: int) -> tuple[int, list[int]]:
    """d_model and one rank's output widths of the projection's weights at TP = tp."""
    d, ffn, q, kv = MODELS[model]
    widths = [q, kv, kv] if proj == "qkv" else [ffn, ffn]
    return d, [w // tp for w in widths]


@dataclass
class Case:
    """One point's work: ``loop(ring)`` is the real ring loop; the rest its parts and peer."""

    loop: object  # loop(ring): gather_matmuls or matmuls_reduce_scatter with `ring`
    fused: object  # fused(link): the fused schedule against the copy-engine stand-in
    gemms: object  # the loop's chunk GEMMs alone, the same calls
    unchunked: object  # the same GEMMs over all rows at once
    cublas: object  # one cuBLAS GEMM over the concatenated weights
    message: torch.Tensor  # what the ring sends each step
    peer_message: torch.Tensor  # what NCCL's collective would move per step for the peer


def make_case(
    side: str, d: int, widths: list[int], tp: int, tokens: int, device, reduce_dtype=None
) -> Case:
    """The tensors and calls of one point: bf16 on a GPU, fp32 on CPU (the interpreter has
    no bf16 dot); weights scaled by 1 / sqrt(d) so sums stay near 1. `reduce_dtype`
    (side "rs"): what the partial sums travel in, on the ring and for the peer (None:
    fp32)."""
    from fusedpar.kernels.matmul import matmul

    from bench.standin import CopyEngineGather, CopyEngineScatter
    from fusedpar.ops.linear_fused import gather_matmuls_fused, matmuls_reduce_scatter_fused
    from fusedpar.ops.tp_schedules import gather_matmuls, matmuls_reduce_scatter

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    kw = dict(device=device, dtype=dtype)
    n = tokens // tp  # one rank's rows: the ring's chunk
    weights = [torch.randn(w, d, **kw) / d**0.5 for w in widths]  # nn.Linear layout (N_i, K)
    w_cat = torch.cat(weights)
    chunks = [slice(c * n, (c + 1) * n) for c in range(tp)]
    if side == "ag":  # forward of the column-parallel layer: x (n, d) -> [(T, N_i)]
        x, x_full = torch.randn(n, d, **kw), torch.randn(tokens, d, **kw)
        ops = [w.T for w in weights]
        outs = [torch.empty(tokens, w, **kw) for w in widths]

        def gemms():
            for rows in chunks:
                for out, op in zip(outs, ops, strict=True):
                    matmul(x_full[rows], op, out=out[rows])

        def unchunked():
            for out, op in zip(outs, ops, strict=True):
                matmul(x_full, op, out=out)

        peers = list(x_full.view(tp, n, d))  # rank 0's view: x is its own shard

        def fused(link):
            return gather_matmuls_fused(
                peers[0], ops, [None] * len(ops), None, side=CopyEngineGather(peers, 0, link)
            )

        return Case(
            loop=lambda ring: gather_matmuls(x, ops, [None] * len(ops), None, 1, ring=ring),
            fused=fused,
            gemms=gemms,
            unchunked=unchunked,
            cublas=lambda: x_full @ w_cat.T,
            message=x,
            peer_message=x,
        )
    # "rs": its backward dX = rs(sum_i dY_i @ W_i), fp32 running sums on the ring
    dys = [torch.randn(tokens, w, **kw) for w in widths]
    dy_cat = torch.cat(dys, dim=1)
    pairs = list(zip(dys, weights, strict=True))
    partial = torch.empty(n, d, device=device, dtype=torch.float32)
    full = torch.empty(tokens, d, device=device, dtype=torch.float32)

    def gemms():
        for rows in chunks:
            for i, (a, b) in enumerate(pairs):
                matmul(a[rows], b, out=partial, accumulate=i > 0)

    def unchunked():
        for i, (a, b) in enumerate(pairs):
            matmul(a, b, out=full, accumulate=i > 0)

    wire = torch.float32 if reduce_dtype is None else reduce_dtype
    sent = torch.empty(n, d, device=device, dtype=wire)  # the peer's collective: the same bytes
    incoming = torch.randn(tp, n, d, device=device).to(wire)  # the peers' partials for rank 0

    def fused(link):
        return matmuls_reduce_scatter_fused(
            pairs, None, dtype, reduce_dtype=reduce_dtype, side=CopyEngineScatter(incoming, 0, link)
        )

    return Case(
        loop=lambda ring: matmuls_reduce_scatter(
            pairs, None, 1, dtype, ring=ring, reduce_dtype=reduce_dtype
        ),
        fused=fused,
        gemms=gemms,
        unchunked=unchunked,
        cublas=lambda: dy_cat @ w_cat,
        message=sent,
        peer_message=sent,
    )


def _gpu_point(model, proj, tp, tokens, side, link, device="cuda") -> dict:
    """One point's row (on CPU, where tests run it, the copies are unpaced)."""
    from fusedpar.ops.overlap import AUTO_CANDIDATES

    d, widths = layer_widths(model, proj, tp)
    side, _, wire = side.partition("-")
    reduce_dtype = torch.bfloat16 if wire == "bf16" else None
    case = make_case(side, d, widths, tp, tokens, device, reduce_dtype)
    ring, silent = StandInRing(tp, link, device=device), StandInRing(tp, None, device=device)
    recv, peer_recv = torch.empty_like(case.message), torch.empty_like(case.peer_message)
    pace = torch.device(device).type == "cuda"

    def comm():  # the W - 1 transfers of the ring, alone
        for _ in range(tp - 1):
            paced_copy(case.message, recv, link, pace=pace)

    def serial_cublas():  # the peer: cuBLAS and NCCL's collective, one after the other
        case.cublas()
        for _ in range(tp - 1):
            paced_copy(case.peer_message, peer_recv, link, pace=pace)

    def serial_ours():  # overlap="serial": the tuned GEMMs, then the same collective
        case.unchunked()
        for _ in range(tp - 1):
            paced_copy(case.peer_message, peer_recv, link, pace=pace)

    for fn in (
        lambda: case.loop(ring),
        lambda: case.loop(silent),
        case.gemms,
        case.unchunked,
        lambda: case.fused(link),
    ):
        fn()  # tuning picks and compiles happen here, outside every timing
    gemm_ms, comm_ms = time_ms(case.gemms), time_ms(comm)
    ring_ms = time_ms(lambda: case.loop(ring))
    graph_ms, graph_note = time_ms_graph(lambda: case.loop(ring))
    host_us_step = host_ms(lambda: case.loop(ring)) * 1e3 / tp
    gpu_us_step = None if graph_ms is None else graph_ms * 1e3 / tp
    nominal = (tp - 1) * link.nominal_ms(case.message.nbytes)
    serial_ms, unchunked_ms = time_ms(serial_cublas), time_ms(case.unchunked)
    ours_serial_ms, fused_ms = time_ms(serial_ours), time_ms(lambda: case.fused(link))
    # what "auto" measures per shape (`measured_chunks`): the fastest of its candidates
    schedule_ms = {"serial": ours_serial_ms, "ring": ring_ms, "fused": fused_ms}
    auto = min(AUTO_CANDIDATES, key=schedule_ms.__getitem__)
    auto_ms = schedule_ms[auto]
    return dict(
        side=side,
        model=model,
        proj=proj,
        world=tp,
        tokens=tokens,
        N=sum(widths),
        K=d,
        reduce_dtype=None if side == "ag" else str(reduce_dtype or torch.float32),
        serial_ms=ours_serial_ms,
        auto=auto,
        auto_ms=auto_ms,
        auto_speedup=serial_ms / auto_ms,
        msg_mb=case.message.nbytes / 2**20,
        link_gbps=link.gbps,
        cublas_ms=time_ms(case.cublas),
        fusedpar_ms=unchunked_ms,
        gemm_ms=gemm_ms,
        comm_ms=comm_ms,
        comm_nominal_ms=nominal,
        comm_vs_nominal=comm_ms / nominal,
        serialized_ms=gemm_ms + comm_ms,
        ring_ms=ring_ms,
        vs_max=ring_ms / max(comm_ms, gemm_ms),
        fused_ms=fused_ms,
        fused_speedup=serial_ms / fused_ms,
        fused_vs_max=fused_ms / max(nominal, unchunked_ms),
        symm_mem_ms=None,
        symm_mem_note=SYMM_MEM_NOTE,
        nocomm_ms=time_ms(lambda: case.loop(silent)),
        serial_cublas_ms=serial_ms,
        speedup=serial_ms / ring_ms,
        ring_graph_ms=graph_ms,
        graph_note=graph_note,
        host_us_step=host_us_step,
        gpu_us_step=gpu_us_step,
        host_bound=None if gpu_us_step is None else host_us_step > gpu_us_step,
        chunking_cost=gemm_ms / unchunked_ms,
    )


# PyTorch's torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter, the
# peer of the fused schedule, rendezvous over a group of W processes on W GPUs
# (TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES lets several share one, but the bench is one
# process): recorded as n/a.
SYMM_MEM_NOTE = "n/a: symm_mem's fused ops need W ranks (processes); this bench is one"
STANDIN_SIZES_MB = (1, 4, 16, 64)  # the ring's messages span about 1 to 64 MiB


def standin_rows(link: Link, device="cuda") -> list[dict]:
    """The stand-in alone against its link model, one message at a time (L2 flushed)."""
    rows, pace = [], torch.device(device).type == "cuda"
    for mb in STANDIN_SIZES_MB:
        src = torch.randn(mb * 2**20 // 4, device=device)
        dst = torch.full_like(src, float("nan"))
        paced_copy(src, dst, link, pace=pace)
        if not torch.equal(src, dst):  # (a host sync)
            raise RuntimeError(f"the stand-in's copy of {mb} MiB is wrong")
        measured = time_ms(lambda s=src, t=dst: paced_copy(s, t, link, pace=pace))
        unpaced = time_ms(lambda s=src, t=dst: paced_copy(s, t, link, pace=False))
        nominal = link.nominal_ms(src.nbytes)
        rows.append(
            dict(
                part="standin",
                link_gbps=link.gbps,
                msg_mb=float(mb),
                comm_ms=measured,
                comm_nominal_ms=nominal,
                comm_vs_nominal=measured / nominal,
                unpaced_ms=unpaced,
            )
        )
        flag = "" if abs(measured / nominal - 1) <= 0.1 else "  <- off by more than 10%"
        print(
            f"stand-in {mb:3d} MiB at {link.gbps:g} GB/s: {measured * 1e3:8.1f} us, model "
            f"{nominal * 1e3:8.1f} us, unpaced {unpaced * 1e3:8.1f} us{flag}"
        )
    return rows


def nccl_p2p_issue_us(nbytes: int = 4 << 20, reps: int = 20) -> tuple[float | None, str | None]:
    """Host microseconds to post a send and a receive with ``batch_isend_irecv`` (what
    `Ring.send_recv` does per step, which the stand-in does not) on a one-rank NCCL group
    sending to itself; ``(None, reason)`` when that group cannot be made."""
    import torch.distributed as dist

    from bench.common import _reason

    if dist.is_initialized():
        return None, "a process group already exists in this process"
    try:
        dist.init_process_group(
            "nccl",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
        send = torch.randn(nbytes // 4, device="cuda")
        recv = torch.empty_like(send)

        def post():
            ops = [dist.P2POp(dist.isend, send, 0), dist.P2POp(dist.irecv, recv, 0)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        post()  # the first exchange builds the communicator
        return host_ms(post, reps=reps) * 1e3, None
    except Exception as error:  # recorded with its reason: the rest of the run stands
        return None, _reason(error)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


GPU_COLUMNS = [
    "part",
    "side",
    "reduce_dtype",
    "model",
    "proj",
    "world",
    "tokens",
    "link_gbps",
    "msg_mb",
    "gemm_ms",
    "comm_ms",
    "comm_vs_nominal",
    "serialized_ms",
    "ring_ms",
    "vs_max",
    "nocomm_ms",
    "serial_cublas_ms",
    "speedup",
    "serial_ms",
    "fused_ms",
    "fused_speedup",
    "fused_vs_max",
    "symm_mem_ms",
    "auto",
    "auto_ms",
    "auto_speedup",
    "ring_graph_ms",
    "host_us_step",
    "gpu_us_step",
    "host_bound",
    "chunking_cost",
    "unpaced_ms",
]


def gpu_overlap(meta: dict, device="cuda") -> list[dict]:
    """Every GPU point for every link (results rewritten after each: a cut run keeps them)."""
    rows = []
    for link in links_from_env():
        rows += standin_rows(link, device)
        for point in gpu_points():
            rows.append(dict(part="gpu", **_gpu_point(*point, link, device)))
            r = rows[-1]
            print(
                f"{r['side']} {r['model']} {r['proj']} W={r['world']} T={r['tokens']}: ring "
                f"{r['ring_ms']:.3f} ms, gemm {r['gemm_ms']:.3f}, comm {r['comm_ms']:.3f} "
                f"(vs max {r['vs_max']:.2f}); host {r['host_us_step']:.0f} us/step, GPU "
                f"{r['gpu_us_step'] or float('nan'):.0f} us/step"
            )
            write_results("linear", rows, GPU_COLUMNS, {**meta, "partial": True}, announce=False)
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
    return rows


def main() -> None:
    if not torch.cuda.is_available():  # the CPU part: gloo ranks on this machine
        rows = [dict(part="cpu-gloo", **r) for r in cpu_overlap()]
        meta = {
            "device": f"CPU ({os.cpu_count()} cores), gloo",
            "cpu_shape": str(CPU_SHAPE),
            "cpu_reps": CPU_REPS,
            "cpu_cores": os.cpu_count(),
            "torch": torch.__version__,
        }

        def plot(ax):
            paired_bars(
                ax,
                [f"{r['op']} W={r['world']}" for r in rows],
                [r["ring_ms"] for r in rows],
                [r["serial_ms"] for r in rows],
                "ring pipeline",
                "serialized",
                "ms (slowest rank, median)",
                f"TP GEMM + collective, {meta['device']}",
            )

        write_results(
            "linear", rows, ["part", "world", "op", "serial_ms", "ring_ms", "speedup"], meta, plot
        )
        return
    if require_gpu("linear"):
        gpu_main()


def gpu_main(device="cuda") -> None:
    """The GPU part, start to end (tests run it on CPU with the timers replaced)."""
    meta = {
        **environment(),
        "dtype": "bfloat16",
        "quick": quick(),
        "piece_bytes": PIECE_BYTES,
        "links": [vars(link) for link in links_from_env()],
        "graph_timing": GRAPH_TIMING,
    }
    rows = gpu_overlap(meta, device)
    gpu = [r for r in rows if r["part"] == "gpu"]
    meta["worst_vs_max"] = max(r["vs_max"] for r in gpu)

    def plot(ax):
        for side, marker in zip(SIDES, "os", strict=True):
            points = [(i, r["vs_max"]) for i, r in enumerate(gpu) if r["side"] == side]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker, label=f"{side}: ring / max(comm, gemm)")
        ax.axhline(1.1, color="gray", ls="--", label="target 1.1")
        ax.set_xlabel("point (model x projection x TP x tokens, in table order)")
        ax.set_ylabel("ring time / max(comm, GEMM)")
        ax.set_title(f"TP ring with an NVLink-speed comm stand-in, bf16, {meta['device']}")
        ax.legend()

    write_results("linear", rows, GPU_COLUMNS, meta, plot, announce=False)
    # last, and after the files are complete: it makes an NCCL process group
    meta["nccl_p2p_issue_us"], meta["nccl_p2p_issue_note"] = nccl_p2p_issue_us()
    write_results("linear", rows, GPU_COLUMNS, meta, plot)


if __name__ == "__main__":
    main()
