"""Ring attention: the cost of the ring on one GPU, and the overlap of its transfers.

GPU (one device): `ring_attn` with a group of one rank against `flash_attn`, forward and
backward, bf16, D = 128 (target overhead <= 5%). With one rank the ring reduces to the
flash kernel, so this checks that the wrapper adds nothing.

CPU (gloo, runs anywhere): the forward ring at W = 2 and 4 with each transfer overlapped
with the block's compute, against waiting for it first. Blocks are computed by torch
(float32) so the comparison measures the pipelining, not Triton's interpreter.

Anchor: ring-flash-attention reports zigzag at 90.2% of the ideal speed-up on 8 x H800
(Llama-3-8B shapes, 8k tokens per GPU).
"""

import os
import statistics
import time

import torch

from bench.common import environment, paired_bars, require_gpu, time_ms, write_results

CPU_SHAPE = {"batch": 1, "tokens_per_rank": 1024, "heads": 8, "kv_heads": 2, "head_dim": 64}
CPU_REPS = 5


def torch_attend(q, k, v, *, causal, softmax_scale, out=None, lse=None, out_dtype=None,
                 agreement=None, tune_only=False):  # fmt: skip
    """One ring block in plain torch float32, with `attention_forward`'s contract."""
    from fusedpar.kernels.attention import attention_reference

    if tune_only:  # nothing to tune
        return None
    block_out, block_lse = attention_reference(q.float(), k.float(), v.float(), causal=causal,
                                               softmax_scale=softmax_scale)  # fmt: skip
    if out is None:
        return block_out, block_lse
    out.copy_(block_out)
    lse.copy_(block_lse)
    return out, lse


def _cpu_rank(batch, tokens_per_rank, heads, kv_heads, head_dim, causal, reps):
    import torch.distributed as dist

    from fusedpar.ops.ring_attention import ring_attention_forward

    pg = dist.group.WORLD
    torch.manual_seed(dist.get_rank())
    q = torch.randn(batch, tokens_per_rank, heads, head_dim)
    k, v = (torch.randn(batch, tokens_per_rank, kv_heads, head_dim) for _ in range(2))
    medians = {}
    for overlap in (False, True):

        def run(overlap=overlap):
            return ring_attention_forward(
                q, k, v, pg, causal=causal, softmax_scale=None, layout="zigzag",
                overlap=overlap, attend=torch_attend,
            )  # fmt: skip

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
    # The ranks merge partials with the Triton merge kernel: on CPU, in the interpreter.
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        rows = _cpu_worlds(World)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return rows


def _cpu_worlds(World) -> list[dict]:
    rows = []
    for size in (2, 4):
        with World(size) as world:
            for causal in (False, True):
                per_rank = world.run(_cpu_rank, **CPU_SHAPE, causal=causal, reps=CPU_REPS)
                waited = max(r["waited"] for r in per_rank)
                overlapped = max(r["overlapped"] for r in per_rank)
                row = dict(part="cpu-gloo", world=size, causal=causal, waited_ms=waited)
                rows.append(dict(row, overlapped_ms=overlapped, speedup=waited / overlapped))
                print(f"W={size} causal={causal}: waited {waited:.1f} ms, overlapped "
                      f"{overlapped:.1f} ms ({waited / overlapped:.2f}x)")  # fmt: skip
    return rows


def _gpu_point(seq_len, causal):
    import torch.distributed as dist

    import fusedpar as fp

    shape = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(1, seq_len, 32, 128, **shape)
    k, v = torch.randn(1, seq_len, 8, 128, **shape), torch.randn(1, seq_len, 8, 128, **shape)
    dout = torch.randn_like(q)
    impls = {
        "flash_attn": lambda: fp.flash_attn(q, k, v, causal=causal),
        "ring_attn": lambda: fp.ring_attn(q, k, v, dist.group.WORLD, causal=causal),
    }
    rows = []
    for name, fn in impls.items():
        fwd = time_ms(fn)
        both = time_ms(lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), dout))
        rows.append(dict(part="gpu-1rank", seq_len=seq_len, causal=causal, impl=name,
                         fwd_ms=fwd, fwd_bwd_ms=both))  # fmt: skip
    return rows


def _gpu_rank(seq_len):
    return [row for causal in (False, True) for row in _gpu_point(seq_len, causal)]


def main() -> None:
    rows = cpu_overlap()
    meta = {"cpu_shape": str(CPU_SHAPE), "cpu_reps": CPU_REPS, "cpu_cores": os.cpu_count(),
            "layout": "zigzag", "torch": torch.__version__}  # fmt: skip
    columns = ["part", "world", "causal", "waited_ms", "overlapped_ms", "speedup"]
    if require_gpu("ring_attention (GPU part)"):
        from fusedpar.testing import World

        meta.update(environment())
        with World(1, backend="nccl") as world:
            for seq_len in (4096, 16384):
                rows += world.run(_gpu_rank, seq_len)[0]
        flash = {(r["seq_len"], r["causal"]): r for r in rows if r.get("impl") == "flash_attn"}
        for r in rows:
            if r.get("impl") == "ring_attn":
                base = flash[(r["seq_len"], r["causal"])]
                r["overhead"] = r["fwd_bwd_ms"] / base["fwd_bwd_ms"] - 1
        columns += ["seq_len", "impl", "fwd_ms", "fwd_bwd_ms", "overhead"]
    else:
        meta["device"] = f"CPU ({os.cpu_count()} cores), gloo"

    def plot(ax):
        cpu = [r for r in rows if r["part"] == "cpu-gloo"]
        paired_bars(ax, [f"W={r['world']}{' causal' if r['causal'] else ''}" for r in cpu],
                    [r["overlapped_ms"] for r in cpu], [r["waited_ms"] for r in cpu],
                    "overlapped", "wait, then compute", "forward ms (slowest rank, median)",
                    f"ring attention, zigzag, {meta['device']}")  # fmt: skip

    write_results("ring_attention", rows, columns, meta, plot)


if __name__ == "__main__":
    main()
