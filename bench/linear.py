"""Tensor-parallel GEMMs: the ring pipeline against the serialized collective + GEMM.

CPU (gloo, runs anywhere): `all_gather_matmul`'s and `matmul_reduce_scatter`'s ring
pipelines against "all-gather, then GEMM" and "GEMM, then reduce-scatter" at W = 2 and 4,
both with torch doing the GEMMs, so the comparison measures the pipelining alone.

GPU (one device): the cost of cutting a GEMM into W chunk GEMMs (fusedpar's Triton GEMM)
against one cuBLAS GEMM of the same size (target <= 1.1x; `chunking_cost` against one
fusedpar GEMM separates the chunking from the kernel), and the overlap of those chunk
GEMMs with a communication stand-in on a side stream that sleeps bytes / 450 GB/s (NVLink)
per chunk: target time <= 1.1 x max(comm, gemm), against the serialized sum, with the
stand-in's time measured alone.
"""

import os
import statistics
import time

import torch

from bench.common import environment, paired_bars, require_gpu, time_ms, write_results

CPU_SHAPE = {"tokens": 2048, "k": 1024, "n": 1024}  # per TP group, fp32
CPU_WORLDS = (2, 4)
CPU_REPS = 7
NVLINK_GBPS = 450.0


def torch_gemm(
    a, b, *, out=None, bias=None, accumulate=False, out_dtype=None, agreement=None, tune_only=False
):
    """The GEMM callback of the ring pipelines, done by torch (for the CPU comparison):
    `matmul`'s signature, with nothing to tune."""
    if tune_only:
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
    from fusedpar.ops.linear import gather_matmuls, matmuls_reduce_scatter

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
            rows.append(dict(world=size, op=op, serial_ms=serial, ring_ms=ring,
                             speedup=serial / ring))  # fmt: skip
            print(f"W={size} {op}: serialized {serial:.1f} ms, ring {ring:.1f} ms "
                  f"({serial / ring:.2f}x)")  # fmt: skip
    return rows


def _sleep_cycles_per_ms() -> float:
    """How many `torch.cuda._sleep` cycles make a millisecond on this GPU (measured)."""
    cycles = 10_000_000
    return cycles / time_ms(lambda: torch.cuda._sleep(cycles))


def _gpu_point(tokens, k, n, world, cycles_per_ms, side) -> dict:
    from fusedpar.kernels.matmul import matmul

    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
    rows = [slice(c * tokens // world, (c + 1) * tokens // world) for c in range(world)]
    comm_ms = tokens // world * k * 2 / (NVLINK_GBPS * 1e9) * 1e3  # one chunk's transfer
    comm_cycles = int(comm_ms * cycles_per_ms)

    def chunked():
        for r in rows:
            matmul(x[r], w.T, out=out[r])

    def overlapped():  # chunk c's GEMM runs while chunk c + 1 "arrives" on the side stream
        main = torch.cuda.current_stream()
        for c, r in enumerate(rows):
            arrived = torch.cuda.Event()
            if c + 1 < world:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    torch.cuda._sleep(comm_cycles)
                    arrived.record()
            matmul(x[r], w.T, out=out[r])
            if c + 1 < world:
                main.wait_event(arrived)

    def comm_alone():
        for _ in range(world - 1):
            torch.cuda._sleep(comm_cycles)

    def whole():
        matmul(x, w.T, out=out)

    cublas, single, decomposed, pipelined, comm = (
        time_ms(fn) for fn in (lambda: x @ w.T, whole, chunked, overlapped, comm_alone)
    )
    # decomposition_cost mixes two gaps (Triton vs cuBLAS, and chunking); chunking_cost is
    # the chunking alone. The stand-in's time is measured, not the nominal bytes / 450 GB/s.
    return dict(tokens=tokens, k=k, n=n, world=world, cublas_ms=cublas, fusedpar_ms=single,
                chunked_ms=decomposed, decomposition_cost=decomposed / cublas,
                chunking_cost=decomposed / single, comm_ms=comm,
                serialized_ms=comm + decomposed, overlapped_ms=pipelined,
                vs_max=pipelined / max(comm, decomposed))  # fmt: skip


def gpu_decomposition() -> list[dict]:
    cycles_per_ms = _sleep_cycles_per_ms()
    side = torch.cuda.Stream()
    rows = []
    # Llama-3 8B gate/up and 70B gate/up per rank at TP=8, and a square projection
    for tokens, k, n in [(8192, 4096, 14336 // 8), (8192, 8192, 28672 // 8), (16384, 4096, 4096)]:
        for world in (2, 4, 8):
            rows.append(_gpu_point(tokens, k, n, world, cycles_per_ms, side))
            print(rows[-1])
    return rows


def main() -> None:
    rows = [dict(part="cpu-gloo", **r) for r in cpu_overlap()]
    meta = {"cpu_shape": str(CPU_SHAPE), "cpu_reps": CPU_REPS, "cpu_cores": os.cpu_count(),
            "torch": torch.__version__}  # fmt: skip
    columns = ["part", "world", "op", "serial_ms", "ring_ms", "speedup"]
    if require_gpu("linear (GPU part: decomposition, overlap)"):
        meta.update(environment())
        rows += [dict(part="gpu", **r) for r in gpu_decomposition()]
        columns += ["tokens", "k", "n", "cublas_ms", "fusedpar_ms", "chunked_ms",
                    "decomposition_cost", "chunking_cost", "comm_ms", "serialized_ms",
                    "overlapped_ms", "vs_max"]  # fmt: skip
    else:
        meta["device"] = f"CPU ({os.cpu_count()} cores), gloo"

    def plot(ax):  # the GPU rows when there are some, else the CPU ones
        gpu = [r for r in rows if r["part"] == "gpu"]
        if gpu:
            paired_bars(ax, [f"{r['k']}x{r['n']} W={r['world']}" for r in gpu],
                        [r["overlapped_ms"] for r in gpu], [r["serialized_ms"] for r in gpu],
                        "overlapped", "serialized", "ms (median)",
                        f"chunk GEMMs + comm stand-in, bf16, {meta['device']}")  # fmt: skip
            return
        cpu = [r for r in rows if r["part"] == "cpu-gloo"]
        paired_bars(ax, [f"{r['op']} W={r['world']}" for r in cpu],
                    [r["ring_ms"] for r in cpu], [r["serial_ms"] for r in cpu],
                    "ring pipeline", "serialized", "ms (slowest rank, median)",
                    f"TP GEMM + collective, {meta['device']}")  # fmt: skip

    write_results("linear", rows, columns, meta, plot)


if __name__ == "__main__":
    main()
