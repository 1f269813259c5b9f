"""Ring attention: the ring's schedule on one GPU, and the overlap of its transfers.

GPU (one device): the virtual ring (`virtual_ring_attn`: the ring's own forward and
backward loops over W simulated ranks, transfers replaced by copies) at W = 2, 4, 8
against `flash_attn` on the whole sequence, forward and forward + backward, bf16,
32 query / 8 KV heads, D = 128, zigzag. Both do the same FLOPs; the ring adds W * W
smaller launches, the merge epilogues, dK/dV carried in fp32 and the KV copies.
Target: ring time <= 1.1x flash_attn (`vs_flash`). `BENCH_QUICK=1`: S = 16k only.

CPU (gloo; run only where there is no GPU): the forward ring at W = 2 and 4 with each
transfer overlapped with the block's compute, against waiting for it first. Blocks are
computed (and merged) by torch in float32, so the comparison measures the pipelining,
not Triton's interpreter.

Anchor: ring-flash-attention reports zigzag at 90.2% of the ideal speed-up on 8 x H800
(Llama-3-8B shapes, 8k tokens per GPU).
"""

import os
import statistics
import time

import torch

from bench.common import (
    environment,
    paired_bars,
    quick,
    require_gpu,
    time_ms,
    write_results,
)

CPU_SHAPE = {"batch": 1, "tokens_per_rank": 1024, "heads": 8, "kv_heads": 2, "head_dim": 64}
CPU_REPS = 5
GPU_SHAPE = {"batch": 1, "heads": 32, "kv_heads": 8, "head_dim": 128}
GPU_WORLDS = (2, 4, 8)
GPU_SEQ_LENS = (4096, 16384)  # BENCH_QUICK: the last only
GPU_DTYPE = torch.bfloat16  # a CPU test runs the GPU part in fp32 (the interpreter)


def torch_attend(
    q,
    k,
    v,
    mask,
    *,
    out=None,
    lse=None,
    out_dtype=None,
    merge=False,
    launch_as=None,
):
    """One ring block in plain torch float32, with `attention_forward`'s contract."""
    from fusedpar.kernels.attention import attention_reference

    if launch_as is not None and launch_as.tune_only:  # nothing to tune
        return None
    visible = None
    if mask.intervals is not None:  # the ring's mask: key rows [kv_lo, kv_hi) per query row
        keys = torch.arange(k.shape[1], device=q.device)
        kv_lo, kv_hi = mask.intervals.kv_lo, mask.intervals.kv_hi
        visible = (keys >= kv_lo[0, :, None]) & (keys < kv_hi[0, :, None])
    block_out, block_lse = attention_reference(q.float(), k.float(), v.float(), mask, visible)
    if out is None:
        return block_out, block_lse
    if merge:  # the LSE merge of the kernel's epilogue
        total = torch.logaddexp(lse, block_lse)
        weight = torch.exp(lse - total).nan_to_num(0).transpose(1, 2)[..., None]
        block_weight = torch.exp(block_lse - total).nan_to_num(0).transpose(1, 2)[..., None]
        block_out = out * weight + block_out * block_weight
        block_lse = total
    out.copy_(block_out)
    lse.copy_(block_lse)
    return out, lse


def _cpu_rank(batch, tokens_per_rank, heads, kv_heads, head_dim, causal, reps):
    import torch.distributed as dist
    from fusedpar.kernels.attention import AttentionMask

    from fusedpar.ops.ring_attention import ring_attention_forward

    pg = dist.group.WORLD
    torch.manual_seed(dist.get_rank())
    q = torch.randn(batch, tokens_per_rank, heads, head_dim)
    k, v = (torch.randn(batch, tokens_per_rank, kv_heads, head_dim) for _ in range(2))
    medians = {}
    for overlap in (False, True):

        def run(overlap=overlap):
            return ring_attention_forward(
                q,
                k,
                v,
                pg,
                layout="zigzag",
                mask=AttentionMask(causal=causal),
                overlap=overlap,
                attend=torch_attend,
            )

        run()
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
        medians["overlapped" if overlap else "waited"] = statistics.median(times)
    return medians


def cpu_overlap() -> list[dict]:
    from fusedpar.testing import World

    rows = []
    for size in (2, 4):
        with World(size) as world:
            for causal in (False, True):
                per_rank = world.run(_cpu_rank, **CPU_SHAPE, causal=causal, reps=CPU_REPS)
                waited = max(r["waited"] for r in per_rank)
                overlapped = max(r["overlapped"] for r in per_rank)
                row = dict(part="cpu-gloo", world=size, causal=causal, waited_ms=waited)
                rows.append(dict(row, overlapped_ms=overlapped, speedup=waited / overlapped))
                print(
                    f"W={size} causal={causal}: waited {waited:.1f} ms, overlapped "
                    f"{overlapped:.1f} ms ({waited / overlapped:.2f}x)"
                )
    return rows


def _timed(fn, q, k, v, dout, device) -> dict:
    """fwd and fwd+bwd milliseconds; a pass that fails is None, with the reason."""
    result = {}
    runs = {"fwd_ms": fn, "fwd_bwd_ms": lambda: torch.autograd.grad(fn(), (q, k, v), dout)}
    for name, run in runs.items():
        try:
            result[name] = time_ms(run)
        except Exception as e:  # out of memory at W = 8, say: recorded, the rest measured
            result[name] = None
            result.setdefault("error", f"{type(e).__name__}: {str(e)[:120]}")
            del e
            if device == "cuda":
                torch.cuda.empty_cache()
    return result


def _gpu_point(S: int, causal: bool, device: str) -> list[dict]:
    import fusedpar as fp
    from fusedpar.ops.virtual_ring import virtual_ring_attn

    B, H, Hkv, D = (GPU_SHAPE[n] for n in ("batch", "heads", "kv_heads", "head_dim"))
    shape = dict(device=device, dtype=GPU_DTYPE, requires_grad=True)
    q = torch.randn(B, S, H, D, **shape)
    k, v = torch.randn(B, S, Hkv, D, **shape), torch.randn(B, S, Hkv, D, **shape)
    dout = torch.randn_like(q)

    def attend(W):
        if W == 1:
            return fp.flash_attn(q, k, v, causal=causal)
        return virtual_ring_attn(q, k, v, W, causal=causal)

    rows = []
    for W in (1, *GPU_WORLDS):
        row = dict(
            part="gpu-virtual-ring",
            seq_len=S,
            causal=causal,
            impl="flash_attn" if W == 1 else "virtual ring",
            world=W,
            **_timed(lambda W=W: attend(W), q, k, v, dout, device),
        )
        for t in ("fwd_ms", "fwd_bwd_ms"):
            if W > 1 and row[t] is not None and rows[0][t] is not None:
                row[f"{t[:-3]}_vs_flash"] = row[t] / rows[0][t]
        rows.append(row)
        print(
            f"S={S} causal={causal} {row['impl']} W={W}: fwd {row['fwd_ms']} ms, "
            f"fwd+bwd {row['fwd_bwd_ms']} ms"
        )
    return rows


def gpu_virtual_ring(device: str = "cuda") -> list[dict]:
    """The GPU part's rows on `device` (a CPU test runs it in the interpreter)."""
    seq_lens = GPU_SEQ_LENS[-1:] if quick() else GPU_SEQ_LENS
    return [
        row for S in seq_lens for causal in (False, True) for row in _gpu_point(S, causal, device)
    ]


def main() -> None:
    meta = {"layout": "zigzag", "torch": torch.__version__}
    if require_gpu("ring_attention (GPU part; the CPU part runs instead)"):
        meta.update(environment(), gpu_shape=str(GPU_SHAPE), dtype=str(GPU_DTYPE), quick=quick())
        rows = gpu_virtual_ring()
        columns = [
            "part",
            "world",
            "causal",
            "seq_len",
            "impl",
            "fwd_ms",
            "fwd_bwd_ms",
            "fwd_vs_flash",
            "fwd_bwd_vs_flash",
            "error",
        ]
    else:  # the CPU part needs no GPU and says nothing about one: only where there is none
        rows = cpu_overlap()
        meta.update(
            cpu_shape=str(CPU_SHAPE),
            cpu_reps=CPU_REPS,
            cpu_cores=os.cpu_count(),
            device=f"CPU ({os.cpu_count()} cores), gloo",
        )
        columns = ["part", "world", "causal", "waited_ms", "overlapped_ms", "speedup"]

    def plot(ax):
        gpu = [r for r in rows if r["part"] == "gpu-virtual-ring" and r["world"] > 1]
        if gpu:  # the ring against flash_attn on the same sequence, forward + backward
            flash = {(r["seq_len"], r["causal"]): r for r in rows if r.get("impl") == "flash_attn"}
            paired_bars(
                ax,
                [
                    f"S={r['seq_len'] // 1024}k W={r['world']}{' causal' if r['causal'] else ''}"
                    for r in gpu
                ],
                [r["fwd_bwd_ms"] or 0 for r in gpu],
                [flash[(r["seq_len"], r["causal"])]["fwd_bwd_ms"] or 0 for r in gpu],
                "virtual ring",
                "flash_attn, whole sequence",
                "forward + backward ms",
                f"ring attention on one GPU, zigzag, {meta['device']}",
            )
            ax.tick_params(axis="x", labelrotation=45)
            return
        cpu = [r for r in rows if r["part"] == "cpu-gloo"]
        paired_bars(
            ax,
            [f"W={r['world']}{' causal' if r['causal'] else ''}" for r in cpu],
            [r["overlapped_ms"] for r in cpu],
            [r["waited_ms"] for r in cpu],
            "overlapped",
            "wait, then compute",
            "forward ms (slowest rank, median)",
            f"ring attention, zigzag, {meta['device']}",
        )

    write_results("ring_attention", rows, columns, meta, plot)


if __name__ == "__main__":
    main()
