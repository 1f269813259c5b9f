"""Host time per layer: fusedpar's own Python, Triton launches stubbed, beside the floors.

A GPU runs ahead of Python only while the host enqueues faster than the GPU drains. This
times what the host does for one forward and backward of each layer with every Triton
launch replaced by a counter (the kernels' own launch path is Triton's, not ours), so it
runs on any machine (denormals flushed to zero: a stubbed kernel's output is whatever its
memory held); the floors are measured in the same run:

| row               | fusedpar (launches stubbed)       | floor beside it                   |
| ----------------- | --------------------------------- | --------------------------------- |
| dispatch          | an op with flash-attention's      | the same empty bodies as an       |
|                   | signature, empty bodies, as       | ``autograd.Function``             |
|                   | fusedpar registers it, and as     |                                   |
|                   | ``torch.library`` dispatches it   |                                   |
| flash_attn        | `fp.flash_attn`                   | SDPA (tiny CPU compute included)  |
| ParallelAttention | one rank, groups None             | nn.Linear x4, RoPE (HF's rotation;|
|                   |                                   | tables made once), SDPA           |
| ... + q/k norm    | the same with Qwen3's per-head    | the same with ``nn.RMSNorm(hd)``  |
|                   | q/k RMSNorm (``qk_norm=True``)    | on q and k before RoPE            |
| ParallelSwiGLU    | one rank                          | nn.Linear x3, silu                |
| MoE (EP 1)        | top-2 of 4 experts                | a loop over the experts in torch  |
| ..., distributed  | `ParallelAttention` and           | the same plain layers (plain      |
|                   | `ParallelSwiGLU` after            | tensors: what one GPU runs        |
|                   | ``fp.distribute`` on a one-rank   | without fusedpar)                 |
|                   | mesh (DTensor parameters, their   |                                   |
|                   | local tensors swapped in per call)|                                   |

Columns: host µs (the median over ``SLICES`` slices, alternating with the floor's, of
the median of ``ROUNDS / SLICES`` fwd+bwd each, after warm-up), Triton launches and
aten ops per call (the profiler's, inside custom ops included; an aten op called by
another is not counted again), and the ratio to the floor; at one thread (a GPU job's
host thread) and at torch's default count. The floors compute at tiny sizes on the CPU
(one batch row), so their time is mostly host time too. Run ``python -m bench
host_overhead`` on any machine, on its own (it sets ``TRITON_INTERPRET=1`` itself when
triton is not imported yet). The distributed rows need a process group of one rank: the
bench makes one (gloo, its store in memory) where none is, and ends it after.
"""

import contextlib
import gc
import math
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROUNDS = 60
SLICES = 6  # ROUNDS timed in this many alternating slices of ours and the floor's
# Tiny, and one batch row: the floors compute on the CPU while fusedpar's launches are
# stubbed, so every row of compute the floors do hides host time of theirs behind it.
S, B, D, HEADS, KV_HEADS, HIDDEN = 16, 1, 64, 4, 2, 128


class _Stubbed:
    """Triton's interpreter launches replaced by a counter while active. A stubbed
    kernel's outputs are whatever memory held, except the routing's expert ids: experts
    0 to k-1 for every token, so that the dispatch after it indexes within bounds."""

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self.launches, self._cls, self._run = 0, InterpretedFunction, InterpretedFunction.run

        def run(fn, *args, **kwargs):
            self.launches += 1
            if fn.__name__ == "_route_fwd_kernel":  # its ids index the dispatch: in range
                ids, top_k = args[4].numpy(), kwargs["TOP_K"]  # (numpy's: no aten op)
                ids[:] = np.arange(top_k, dtype=ids.dtype)

        InterpretedFunction.run = run
        return self

    def __exit__(self, *exc):
        self._cls.run = self._run


def _aten_ops(step) -> int:
    """The aten ops of ``step()`` called from outside another aten op, as PyTorch's
    profiler records them (it sees inside custom ops' bodies; dispatch modes do not)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()

    def aten(event) -> bool:
        return event is not None and event.name.startswith("aten::")

    return sum(aten(e) and not aten(e.cpu_parent) for e in prof.events())


def host_us(step, rounds: int = ROUNDS) -> float:
    """Median host µs of ``step()`` (a forward and backward), garbage collection off."""
    for _ in range(3):
        step()
    times = []
    gc.disable()
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return statistics.median(times) * 1e6


def counts(step) -> tuple[int, int]:
    """(Triton launches, aten ops) of one ``step()``."""
    with _Stubbed() as stub:
        step()
        launches = stub.launches
        ops = _aten_ops(step)
    return launches, ops


# --- the floors ---------------------------------------------------------------------------


class _Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)

    @staticmethod
    def backward(ctx, dout, dlse):
        return torch.empty_like(dout), torch.empty_like(dout), torch.empty_like(dout)


@torch.library.custom_op("fusedpar_bench::empty_attention", mutates_args=())
def _empty_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@_empty_op.register_fake
def _(q, k, v):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _empty_backward(ctx, dout, dlse):
    return torch.empty_like(dout), torch.empty_like(dout), torch.empty_like(dout)


def _fusedpar_empty_op():
    """The empty op registered as fusedpar registers its ops (`ops.registration`)."""
    from fusedpar.ops.registration import autograd_op

    return autograd_op(_empty_op, _empty_backward, lambda ctx, inputs, output: None)


def rope_tables(seq: int, hd: int, theta: float = 10000.0):
    """cos, sin (S, 1, 1, hd): Hugging Face's layout (each angle in both halves), made once
    per model forward for every layer (its rotary embedding module), not per layer."""
    freqs = theta ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = torch.arange(seq, dtype=torch.float32)[:, None] * freqs  # (S, hd/2)
    angles = torch.cat([angles, angles], -1)[:, None, None]
    return angles.cos(), angles.sin()


def _rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


def _rope(x, cos, sin):  # (S, B, H, hd): Hugging Face's apply_rotary_pos_emb
    return x * cos + _rotate_half(x) * sin


class PlainAttention(nn.Module):
    """nn.Linear q/k/v/o, RoPE, SDPA (causal, GQA): the layer a user would write; with
    `qk_norm`, Qwen3's ``nn.RMSNorm(hd)`` on q and k before RoPE. Its RoPE tables are
    made once (Hugging Face's models make them once per forward for all layers), as
    fusedpar's layer keeps its own per sequence length."""

    def __init__(self, qk_norm: bool = False):
        super().__init__()
        hd = D // HEADS
        self.q, self.o = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.k, self.v = (nn.Linear(D, KV_HEADS * hd, bias=False) for _ in range(2))
        self.q_norm, self.k_norm = (nn.RMSNorm(hd) if qk_norm else nn.Identity() for _ in "qk")
        self.cos, self.sin = rope_tables(S, hd)

    def forward(self, x):  # (S, B, d)
        s, b, _ = x.shape
        hd = D // HEADS
        q = _rope(self.q_norm(self.q(x).view(s, b, HEADS, hd)), self.cos, self.sin)
        k = _rope(self.k_norm(self.k(x).view(s, b, KV_HEADS, hd)), self.cos, self.sin)
        v = self.v(x).view(s, b, KV_HEADS, hd)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # (B, H, S, hd)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(out.permute(2, 0, 1, 3).reshape(s, b, D))


class PlainSwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(D, HIDDEN, bias=False), nn.Linear(D, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, D, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LoopMoE(nn.Module):
    """Top-2 of 4 SwiGLU experts, a loop over the experts: what a user writes first."""

    def __init__(self, experts=4, top_k=2):
        super().__init__()
        self.router = nn.Linear(D, experts, bias=False)
        self.experts = nn.ModuleList(PlainSwiGLU() for _ in range(experts))
        self.top_k = top_k

    def forward(self, x):
        flat = x.reshape(-1, D)
        weights, chosen = self.router(flat).softmax(-1).topk(self.top_k, -1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return out.view_as(x)


# --- the rows -----------------------------------------------------------------------------


@contextlib.contextmanager
def one_rank_world():
    """A default process group of one rank while inside (gloo, its store in memory),
    unless one is there already (then it must be of one rank)."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(
                "bench/host_overhead runs in one process: a process group "
                f"of {dist.get_world_size()} ranks is initialized"
            )
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _distributed(layer):
    """`layer` after ``fp.distribute`` on the one-rank mesh (dp, cp, tp all 1)."""
    import fusedpar as fp

    return fp.distribute(layer, fp.ParallelDims().build_mesh("cpu"))


def _fwd_bwd(module, x):
    def step():
        out = module(x)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()

    return step


def cases():
    """(name, fusedpar's step, floor name, floor step) per row (the distributed rows inside
    `one_rank_world`)."""
    import fusedpar as fp

    torch.manual_seed(0)
    q = torch.randn(1, S, HEADS, D // HEADS, requires_grad=True)
    k, v = (torch.randn(1, S, HEADS, D // HEADS, requires_grad=True) for _ in range(2))
    x = torch.randn(S, B, D, requires_grad=True)

    registered = _fusedpar_empty_op()

    def op_step():
        out, lse = registered(q, k, v)
        out.sum().backward()

    def library_step():
        out, lse = _empty_op(q, k, v)  # torch.library's own dispatch, for comparison
        out.sum().backward()

    def function_step():
        out, lse = _Empty.apply(q, k, v)
        out.sum().backward()

    def flash_step():
        fp.flash_attn(q, k, v, causal=True).sum().backward()

    def sdpa_step():
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).sum().backward()

    attention = fp.nn.ParallelAttention(D, HEADS, KV_HEADS)
    normed = fp.nn.ParallelAttention(D, HEADS, KV_HEADS, qk_norm=True)
    swiglu = fp.nn.ParallelSwiGLU(D, HIDDEN)
    moe = fp.nn.MoE(D, HIDDEN, 4, 2)
    return [
        ("fusedpar op dispatch (empty)", op_step, "autograd.Function (empty)", function_step),
        ("torch.library op (empty)", library_step, "autograd.Function (empty)", function_step),
        ("fp.flash_attn", flash_step, "SDPA", sdpa_step),
        (
            "ParallelAttention",
            _fwd_bwd(attention, x),
            "nn.Linear + RoPE + SDPA",
            _fwd_bwd(PlainAttention(), x),
        ),
        (
            "ParallelAttention + q/k norm",
            _fwd_bwd(normed, x),
            "the same + nn.RMSNorm(hd)",
            _fwd_bwd(PlainAttention(qk_norm=True), x),
        ),
        ("ParallelSwiGLU", _fwd_bwd(swiglu, x), "nn.Linear x3 + silu", _fwd_bwd(PlainSwiGLU(), x)),
        ("MoE (EP 1)", _fwd_bwd(moe, x), "a loop over the experts", _fwd_bwd(LoopMoE(), x)),
        (
            "ParallelAttention, distributed",
            _fwd_bwd(_distributed(fp.nn.ParallelAttention(D, HEADS, KV_HEADS)), x),
            "nn.Linear + RoPE + SDPA",
            _fwd_bwd(PlainAttention(), x),
        ),
        (
            "ParallelSwiGLU, distributed",
            _fwd_bwd(_distributed(fp.nn.ParallelSwiGLU(D, HIDDEN)), x),
            "nn.Linear x3 + silu",
            _fwd_bwd(PlainSwiGLU(), x),
        ),
    ]


def measure(rounds: int = ROUNDS, threads: int | tuple[int, ...] = 1) -> list[dict]:
    """One row per case and thread count: host µs of fusedpar's (stubbed) and the floor's
    with torch on that many `threads`, and their counts. Every row is timed before any is
    counted: a profiler session leaves every later op slower (torch 2.13: an empty
    ``autograd.Function``'s forward and backward 45 -> 103 µs after one), which would
    add the same time to both sides and pull every ratio towards 1."""
    import fusedpar as fp

    rows, before = [], torch.get_num_threads()
    with fp.implementation("triton"), one_rank_world():
        for n in (threads,) if isinstance(threads, int) else threads:
            torch.set_num_threads(n)
            for name, ours, floor_name, floor in cases():
                # in alternating slices, so that the machine's drift (10-20% between runs,
                # more while other work runs) falls on both sides of the ratio alike
                ours_us, floor_times = [], []
                for _ in range(SLICES):
                    with _Stubbed():
                        ours_us.append(host_us(ours, max(1, rounds // SLICES)))
                    floor_times.append(host_us(floor, max(1, rounds // SLICES)))
                us, floor_us = statistics.median(ours_us), statistics.median(floor_times)
                rows.append(
                    {
                        "layer": name,
                        "threads": n,
                        "host_us": us,
                        "floor": floor_name,
                        "floor_us": floor_us,
                        "ratio": us / floor_us,
                        "steps": (ours, floor),
                    }
                )
        torch.set_num_threads(before)
        counted = {}
        for row in rows:
            ours, floor = row.pop("steps")
            if row["layer"] not in counted:
                counted[row["layer"]] = (*counts(ours), counts(floor)[1])
            row["launches"], row["aten_ops"], row["floor_aten_ops"] = counted[row["layer"]]
    return rows


def main() -> None:
    from bench.common import environment, write_results

    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        print(
            "bench/host_overhead: triton was imported without TRITON_INTERPRET=1; run it "
            "on its own (python -m bench host_overhead)"
        )
        return
    os.environ["TRITON_INTERPRET"] = "1"  # launches are stubbed; only their Python runs
    # Stubbed launches leave their outputs as they were allocated: whatever memory held,
    # denormals among it. The CPU computes on denormals up to ~100x slower (measured: an
    # F.silu over a stubbed GEMM's (32, 128) output took a third of ParallelSwiGLU's
    # forward), which no GPU run would see: flushed to zero for every row, floors too.
    torch.set_flush_denormal(True)
    # one thread (a GPU job's host thread) and torch's default (the machine's cores): a
    # floor's tiny CPU compute may or may not gain from a second thread
    thread_counts = sorted({1, torch.get_num_threads()})
    rows = measure(threads=tuple(thread_counts))
    columns = [
        "layer",
        "threads",
        "host_us",
        "launches",
        "aten_ops",
        "floor",
        "floor_us",
        "floor_aten_ops",
        "ratio",
    ]

    def plot(ax):
        one = [r for r in rows if r["threads"] == 1]
        labels = [r["layer"] for r in one]
        xs = range(len(one))
        ax.bar([i - 0.2 for i in xs], [r["host_us"] for r in one], 0.4, label="fusedpar")
        ax.bar([i + 0.2 for i in xs], [r["floor_us"] for r in one], 0.4, label="floor")
        ax.set_xticks(list(xs), labels, rotation=15)
        ax.set_ylabel("host µs per forward + backward")
        ax.set_title("Host time per layer (Triton launches stubbed, one thread)")
        ax.legend()

    meta = {
        **environment(),
        "rounds": ROUNDS,
        "shape": f"S={S} B={B} d={D} heads={HEADS}/{KV_HEADS} hidden={HIDDEN}",
        "threads": thread_counts,
    }
    for threads in thread_counts:
        ratios = [math.log(r["ratio"]) for r in rows if r["threads"] == threads]
        meta[f"gmean_ratio_{threads}_thread{'s' if threads > 1 else ''}"] = math.exp(
            statistics.fmean(ratios)
        )
    import fusedpar as fp

    with fp.implementation("triton"):  # what fusedpar's rows ran (launches stubbed)
        write_results("host_overhead", rows, columns, meta, plot)
    for r in rows:
        print(
            f"{r['layer']:28s} {r['threads']}t {r['host_us']:8.0f} µs  {r['launches']:3d} "
            f"launches "
            f"{r['aten_ops']:4d} aten ops | {r['floor']:26s} {r['floor_us']:7.0f} µs "
            f"{r['floor_aten_ops']:4d} ops | {r['ratio']:.2f}x"
        )
