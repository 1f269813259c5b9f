"""The gated delta rule under context parallelism: what the span summaries add to one
rank's forward + backward, and the bytes against the head-parallel all-to-all.

One device plays rank 0 of W = 2, 4, 8 (zigzag: spans 0 and 2W-1; every rank's work is
the same without documents) with `fp.gated_delta_rule(..., group=)`'s own code, its
all-gathers replaced by copies of the rank's own summaries (`Alone`): the summaries'
cost is real, the numbers they fold are not. Against the single-device op on the same
2 x span tokens (one sequence), forward and forward + backward.

Qwen3.5-35B-A3B's GDN (Hk 16, Hv 32, K = V = 128, bf16, g fp32) at 8k tokens a span on a
GPU (target: ``overhead`` <= 15%); a quarter of the heads, K = V = 32 and 256 tokens a
span on a CPU (torch's implementation: its ratio says little about a GPU's). Bytes per
rank and layer, forward + backward (`fusedpar.plan.linear_context`), at 32k tokens a
rank for the all-to-all: ``payload`` what the rank gives its collectives, ``wire`` what
leaves it under ring algorithms.
"""

import functools
import os

import torch

import fusedpar as fp
from bench.common import environment, host_ms, time_ms, write_results
from fusedpar.ops.linear_attention_cp import context_parallel_gated_delta
from fusedpar.ops.span_exchange import Exchange
from fusedpar.plan import model_spec
from fusedpar.plan.linear_context import LinearSizes, head_all_to_all, summaries

WORLDS = (2, 4, 8)
GPU = {"span": 8192, "Hk": 16, "Hv": 32, "K": 128, "V": 128}
CPU = {"span": 256, "Hk": 4, "Hv": 8, "K": 32, "V": 32}
ALL_TO_ALL_TOKENS = 32768  # a rank's tokens for the bytes' comparison


class Alone(Exchange):
    """Rank 0 of `size` timed alone: a gather hands back its own summaries in every rank's
    place, a sum its own part."""

    def __init__(self, size: int):
        self.group, self.rank, self.size = None, 0, size

    def gather(self, x):
        return x.repeat(self.size, *[1] * (x.dim() - 1))

    def sum(self, x):
        return x


def _inputs(T: int, shape: dict, device: str, dtype) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(T)

    def randn(*size, dt=dtype):
        return torch.randn(size, generator=gen, device=device, dtype=dt)

    Hk, Hv, K, V = shape["Hk"], shape["Hv"], shape["K"], shape["V"]
    q = randn(1, T, Hk, K)
    k = torch.nn.functional.normalize(randn(1, T, Hk, K, dt=torch.float32), dim=-1).to(dtype)
    g = -torch.nn.functional.softplus(randn(1, T, Hv, dt=torch.float32)) * 0.5
    leaves = [q, k, randn(1, T, Hv, V), g, torch.sigmoid(randn(1, T, Hv))]
    return [t.requires_grad_() for t in leaves]


def _fwd_bwd(fn, leaves, do, timer) -> tuple[float, float]:
    def forward():
        with torch.no_grad():
            fn()

    def both():
        for t in leaves:
            t.grad = None
        fn().backward(do)

    both()  # a warm-up (first calls allocate, tune, compile)
    return timer(forward), timer(both)


def point(world: int, shape: dict, device: str, dtype) -> dict:
    T = 2 * shape["span"]  # rank 0's two zigzag spans
    leaves = _inputs(T, shape, device, dtype)
    do = torch.randn(1, T, shape["Hv"], shape["V"], device=device, dtype=dtype)
    scale = shape["K"] ** -0.5
    timer = time_ms if device == "cuda" else functools.partial(host_ms, reps=3)

    def single():
        return fp.gated_delta_rule(*leaves, scale=scale)[0]

    def spans():
        return context_parallel_gated_delta(
            leaves,
            scale=scale,
            initial_state=None,
            cu_seqlens=None,
            want_final=False,
            group=Alone(world),
            layout="zigzag",
        )[0]

    row = {"W": world, "tokens_per_rank": T}
    row["single_fwd_ms"], row["single_fwd_bwd_ms"] = _fwd_bwd(single, leaves, do, timer)
    row["cp_fwd_ms"], row["cp_fwd_bwd_ms"] = _fwd_bwd(spans, leaves, do, timer)
    row["overhead"] = row["cp_fwd_bwd_ms"] / row["single_fwd_bwd_ms"] - 1
    sizes = LinearSizes.of(model_spec("qwen3.5-35b-a3b"))
    # against Megatron's head-parallel GDN (z exchanged too: 33 kB a token)
    ours, theirs = summaries(sizes, world), head_all_to_all(sizes, world, ALL_TO_ALL_TOKENS, z=True)
    row["summaries_payload_mib"] = ours.payload / 2**20
    row["summaries_wire_mib"] = ours.wire / 2**20
    row["all_to_all_wire_mib"] = theirs.wire / 2**20
    row["wire_ratio"] = theirs.wire / ours.wire
    print(row)
    return row


def main() -> None:
    gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    device, shape = ("cuda", GPU) if gpu else ("cpu", CPU)
    dtype = torch.bfloat16 if gpu else torch.float32
    rows = [point(world, shape, device, dtype) for world in WORLDS]
    meta = {
        **environment(),
        "shape": f"span {shape['span']}, Hk={shape['Hk']}, Hv={shape['Hv']}, "
        f"K={shape['K']}, V={shape['V']}, zigzag, rank 0",
        "dtype": f"{str(dtype).removeprefix('torch.')} (g fp32)",
        "bytes": f"Qwen3.5-35B-A3B, per rank and layer, fwd + bwd, all-to-all at "
        f"{ALL_TO_ALL_TOKENS} tokens a rank",
    }
    columns = list(rows[0])

    def plot(ax):
        xs = [str(r["W"]) for r in rows]
        ax.bar(xs, [100 * r["overhead"] for r in rows])
        ax.axhline(15, color="gray", linestyle="--", label="target 15%")
        ax.set_xlabel("W (context-parallel ranks)")
        ax.set_ylabel("summaries' overhead on a rank's fwd + bwd (%)")
        ax.set_title(f"gated delta rule under CP, {meta['device']}")
        ax.legend()

    write_results("linear_attention_cp", rows, columns, meta, plot)


if __name__ == "__main__":
    main()
