"""Context parallelism at W ranks: the ring, Ulysses and the hybrid, side by side.

For one shape, each mode's forward and backward run for real on gloo, with
torch.distributed's calls wrapped to count what this rank sends: the collectives it
launches, the messages (an all-to-all over P ranks sends P - 1, a ring step one per
tensor) and the bytes that leave the rank. So the counts come from the code, not from a
formula. The same run times forward + backward (slowest rank, median): on CPU, Triton's
interpreter computes the attention, so those times say little about a GPU.

    W = 4: ring 4 | Ulysses 4 | hybrid ring 2 x Ulysses 2

Expectation, per rank, tokens S/W each, Hq query and Hkv KV heads of D (P = W):
the ring sends K and V W - 1 times forward, and K, V plus the fp32 dK, dV sums backward;
Ulysses sends (P - 1)/P of q, k, v and out forward (k, v replicated to P heads when
Hkv < P) and as much backward, independent of W in total size per rank.

GPU: the modes need one GPU per rank; a one-GPU machine has nothing to compare, so the
GPU part is the message counts (device independent) until a multi-GPU run.

Then linear attention (`bench.linear_attention_cp`, its own results file): one rank's
gated delta rule under CP at W = 2, 4, 8, against the op on the same tokens alone.
"""

import contextlib
import os
import statistics
import time

import torch

from bench import linear_attention_cp
from bench.common import paired_bars, write_results

CPU_SHAPE = {"batch": 1, "seq_len": 512, "heads": 8, "kv_heads": 2, "head_dim": 32}
CPU_REPS = 3
WORLD = 4


def modes(world: int) -> dict:
    """name -> (ring degree, Ulysses degree) of the three modes at `world` ranks."""
    half = (2, world // 2) if world >= 4 else None
    named = {f"ring {world}": (world, 1), f"ulysses {world}": (1, world)}
    return named | ({f"hybrid {half[0]}x{half[1]}": half} if half else {})


class SentCounter:
    """Counts what this rank sends through torch.distributed while active: data
    collectives (all-to-all, ring sends) and the rest (shape checks, tuning)."""

    def __init__(self):
        self.collectives = self.messages = self.bytes = self.other = 0

    @contextlib.contextmanager
    def active(self):
        import torch.distributed as dist

        originals = {
            n: getattr(dist, n)
            for n in ("all_to_all_single", "batch_isend_irecv", "all_gather", "all_reduce")
        }

        def all_to_all_single(out, x, *args, group=None, **kwargs):
            peers = dist.get_world_size(group)
            self.collectives += 1
            self.messages += peers - 1
            self.bytes += x.numel() * x.element_size() * (peers - 1) // peers
            return originals["all_to_all_single"](out, x, *args, group=group, **kwargs)

        def batch_isend_irecv(ops):
            sends = [op for op in ops if op.op is dist.isend]
            self.collectives += 1
            self.messages += len(sends)
            self.bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in sends)
            return originals["batch_isend_irecv"](ops)

        def counted(name):
            def call(*args, **kwargs):
                self.other += 1
                return originals[name](*args, **kwargs)

            return call

        patched = {
            "all_to_all_single": all_to_all_single,
            "batch_isend_irecv": batch_isend_irecv,
            "all_gather": counted("all_gather"),
            "all_reduce": counted("all_reduce"),
        }
        for name, fn in patched.items():
            setattr(dist, name, fn)
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def _groups(ring: int, ulysses: int):
    import fusedpar as fp

    dims = fp.ParallelDims(cp=ring, ulysses=ulysses)
    groups = dims.groups(dims.build_mesh("cpu"))
    return groups["cp"], groups["ulysses"]


def _cpu_rank(ring, ulysses, batch, seq_len, heads, kv_heads, head_dim, reps, causal=True):
    """This rank's counts (forward, backward) and times for one mode."""
    import torch.distributed as dist

    import fusedpar as fp

    ring, ulysses = _groups(ring, ulysses)
    torch.manual_seed(0)
    full = [torch.randn(batch, seq_len, h, head_dim) for h in (heads, kv_heads, kv_heads)]
    local = [fp.shard_sequence(t, ring, ulysses_group=ulysses).requires_grad_() for t in full]

    def forward():
        return fp.ring_attn(*local, ring, causal=causal, ulysses_group=ulysses)

    counts = {}
    for part in ("fwd", "bwd"):
        counter = SentCounter()
        if part == "fwd":
            with counter.active():
                out = forward()
        else:
            with counter.active():
                torch.autograd.grad(out, local, torch.ones_like(out))
        counts[part] = counter
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        out = forward()
        torch.autograd.grad(out, local, torch.ones_like(out))
        times.append((time.perf_counter() - start) * 1e3)
    row = {"time_ms": statistics.median(times)}
    for part, c in counts.items():
        row.update(
            {
                f"{part}_collectives": c.collectives,
                f"{part}_messages": c.messages,
                f"{part}_kib": c.bytes / 1024,
                f"{part}_checks": c.other,
            }
        )
    return row


def cpu_modes(world: int = WORLD, shape=None, reps: int = CPU_REPS, pool=None) -> list[dict]:
    """One row per mode: rank 0's counts, the slowest rank's time. `pool`: a running
    `World` of `world` ranks to use (a test's), else one is started and closed here."""
    from fusedpar.testing import World

    if pool is not None and pool.world_size != world:
        raise ValueError(f"cpu_modes: the pool has {pool.world_size} ranks, not {world}")
    shape = shape or CPU_SHAPE
    rows = []
    with contextlib.nullcontext(pool) if pool is not None else World(world) as pool:
        for mode, (ring, ulysses) in modes(world).items():
            per_rank = pool.run(_cpu_rank, ring, ulysses, **shape, reps=reps)
            row = dict(mode=mode, ring=ring, ulysses=ulysses, **per_rank[0])
            row["time_ms"] = max(r["time_ms"] for r in per_rank)
            rows.append(row)
            print(
                f"{mode}: forward {row['fwd_messages']} messages, {row['fwd_kib']:.0f} KiB; "
                f"backward {row['bwd_messages']} messages, {row['bwd_kib']:.0f} KiB; "
                f"{row['time_ms']:.0f} ms"
            )
    return rows


def main() -> None:
    rows = cpu_modes()
    meta = dict(
        cpu_shape=str(CPU_SHAPE),
        causal=True,
        dtype="float32",
        cpu_reps=CPU_REPS,
        cpu_cores=os.cpu_count(),
        torch=torch.__version__,
        device=f"CPU ({os.cpu_count()} cores), gloo",
    )
    columns = [
        "mode",
        "fwd_collectives",
        "fwd_messages",
        "fwd_kib",
        "bwd_collectives",
        "bwd_messages",
        "bwd_kib",
        "fwd_checks",
        "bwd_checks",
        "time_ms",
    ]

    def plot(ax):
        paired_bars(
            ax,
            [r["mode"] for r in rows],
            [r["fwd_kib"] + r["bwd_kib"] for r in rows],
            [r["fwd_messages"] + r["bwd_messages"] for r in rows],
            "KiB sent per rank (fwd + bwd)",
            "messages per rank (fwd + bwd)",
            "count",
            f"context parallelism at W={WORLD}, {CPU_SHAPE}",
        )

    write_results("context_parallel", rows, columns, meta, plot)
    linear_attention_cp.main()  # the gated delta rule's spans: their own file
