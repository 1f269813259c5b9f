"""fusedpar's Triton GEMM against torch.matmul (cuBLAS) on tensor-parallel shapes.

Shapes: Llama-3 8B and 70B projections split 2, 4 and 8 ways, as one rank of TP sees
them: QKV and gate/up column-parallel (N split), output and down row-parallel (K split),
at M = 2k..16k tokens, bf16, ``x @ weight.T`` with an ``nn.Linear``-layout weight.
Target: >= 0.95x cuBLAS. ``BENCH_QUICK=1``: TP = 8 at M = 4k and 16k only.

The qkv rows also time q and k (heads of 128) with RoPE two ways (ms): turned in the
GEMM's epilogue (`rope=RowRotation`) and the GEMM then `fusedpar.kernels.rope`.
The gate/up rows also time a dense SwiGLU's first projection four ways (ms): fused
(`gated_matmul`: both GEMMs and silu(gate) * up in one launch), product (the gate GEMM,
then the up GEMM ending in the product, `gated_up_matmul`: what the one-rank layer
runs), unfused (fusedpar's GEMM twice and `fusedpar.kernels.gated`), and torch (cuBLAS
twice, ``F.silu(g) * u``).
The down rows also time its backward's hidden gradient three ways (ms): fused
(`gated_grad_matmul`: dh's GEMM ending in dgate, dup and h), apart (the GEMM, then
`fusedpar.kernels.gated.gated_backward`), and torch (cuBLAS, then eager elementwise ops).

The small points (TP = 8, M <= 4k: down to about 20 us of GPU time, predicted) are also
timed replaying a CUDA graph of the same call (`time_ms_graph`): ``*_graph_tflops``
beside ``*_tflops`` shows how much of the eager number is host launch overhead rather
than the kernel (a failed capture leaves them null with the reason in ``graph_note``).
"""

import torch

from bench.common import (
    GRAPH_TIMING,
    environment,
    measured_ceilings,
    quick,
    require_gpu,
    time_ms,
    time_ms_graph,
    write_results,
)

# name: (d_model, d_ffn, q + k + v width)
MODELS = {"llama3-8b": (4096, 14336, 4096 + 2 * 1024), "llama3-70b": (8192, 28672, 8192 + 2 * 1024)}
TP_SIZES = (2, 4, 8)
TOKENS = (2048, 4096, 8192, 16384)
COLUMNS = [
    "model",
    "tp",
    "proj",
    "M",
    "N",
    "K",
    "fusedpar_tflops",
    "torch_tflops",
    "ratio",
    "fusedpar_graph_tflops",
    "torch_graph_tflops",
    "graph_note",
    "rope_fused_ms",
    "rope_apart_ms",
    "gated_fused_ms",
    "gated_product_ms",
    "gated_unfused_ms",
    "gated_torch_ms",
    "gated_grad_fused_ms",
    "gated_grad_apart_ms",
    "gated_grad_torch_ms",
]
# Points whose eager time can be launch-bound: timed through a CUDA graph as well.
GRAPH_TP, GRAPH_MAX_M = 8, 4096


def graph_timed(tp: int, M: int) -> bool:
    return tp == GRAPH_TP and M <= GRAPH_MAX_M


def tp_shapes():
    """(model, tp, projection, N, K) for one rank's weight (N, K)."""
    for model, (d, ffn, qkv) in MODELS.items():
        for tp in (8,) if quick() else TP_SIZES:
            yield model, tp, "qkv", qkv // tp, d
            yield model, tp, "out", d, d // tp
            yield model, tp, "gate_up", 2 * ffn // tp, d
            yield model, tp, "down", d, ffn // tp


def _graph_point(matmul, x, weight, flops) -> dict:
    """TFLOP/s of both GEMMs replayed from a CUDA graph (None + the reason if capture fails)."""
    ours_ms, ours_note = time_ms_graph(lambda: matmul(x, weight.T))
    torch_ms, torch_note = time_ms_graph(lambda: x @ weight.T)
    notes = [
        f"{who}: {note}" for who, note in (("fusedpar", ours_note), ("torch", torch_note)) if note
    ]
    return dict(
        fusedpar_graph_tflops=None if ours_ms is None else flops / ours_ms / 1e9,
        torch_graph_tflops=None if torch_ms is None else flops / torch_ms / 1e9,
        graph_note="; ".join(notes) or None,
    )


def _rope_point(x, N: int, K: int, head_dim: int = 128) -> dict:
    """ms of q and k (N wide, whole heads) with RoPE, in the epilogue and apart."""
    from fusedpar.kernels.matmul import RowRotation, matmul
    from fusedpar.kernels.rope import rope

    from fusedpar.nn.attention_parts import rope_tables

    M, N = x.shape[0], N - N % head_dim
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    cos, sin = rope_tables(torch.arange(M, device="cuda"), head_dim, 500000.0)

    def apart():
        y = matmul(x, w.T)
        return rope(y.view(1, M, N // head_dim, head_dim), cos, sin)

    return dict(
        rope_fused_ms=time_ms(lambda: matmul(x, w.T, rope=RowRotation(cos, sin))),
        rope_apart_ms=time_ms(apart),
    )


def _gated_point(x, N: int, K: int) -> dict:
    """ms of a SwiGLU's gate and up (each N wide) and silu(gate) * up, four ways."""
    from fusedpar.kernels.gated import gated
    from fusedpar.kernels.matmul import matmul
    from fusedpar.kernels.matmul_gated import gated_matmul, gated_up_matmul
    from torch.nn import functional as F

    wg, wu = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in "gu")
    return dict(
        gated_fused_ms=time_ms(lambda: gated_matmul(x, wg.T, wu.T, activation="silu")),
        gated_product_ms=time_ms(
            lambda: gated_up_matmul(x, wu.T, matmul(x, wg.T), activation="silu")
        ),
        gated_unfused_ms=time_ms(lambda: gated(matmul(x, wg.T), matmul(x, wu.T), "silu")),
        gated_torch_ms=time_ms(lambda: F.silu(x @ wg.T) * (x @ wu.T)),
    )


def _gated_grad_point(M: int, N: int, K: int) -> dict:
    """ms of a SwiGLU's dgate, dup and h from dy (M, N) and the down weight (N, K) as
    stored, three ways."""
    from fusedpar.kernels.gated import gated_backward
    from fusedpar.kernels.matmul import matmul
    from fusedpar.kernels.matmul_gated import gated_grad_matmul

    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w_down = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / N**0.5
    gate, up = (torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in "gu")

    def apart():
        return gated_backward(matmul(dy, w_down), gate, up, "silu", hidden=True, stacked=True)

    def eager():  # what autograd's recompute and backward of silu(gate) * up run
        dh, s = dy @ w_down, torch.sigmoid(gate)
        a = gate * s
        return dh * up * (s * (1 + gate * (1 - s))), dh * a, a * up

    return dict(
        gated_grad_fused_ms=time_ms(
            lambda: gated_grad_matmul(dy, w_down, gate, up, activation="silu", hidden=True)
        ),
        gated_grad_apart_ms=time_ms(apart),
        gated_grad_torch_ms=time_ms(eager),
    )


def main() -> None:
    if not require_gpu("matmul"):
        return
    from fusedpar.kernels.matmul import matmul

    torch.manual_seed(0)
    rows, env = [], environment()
    for model, tp, proj, N, K in tp_shapes():
        weight = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
        for M in (4096, 16384) if quick() else TOKENS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            flops = 2 * M * N * K
            ours = flops / time_ms(lambda x=x, w=weight: matmul(x, w.T)) / 1e9
            cublas = flops / time_ms(lambda x=x, w=weight: x @ w.T) / 1e9
            row = dict(model=model, tp=tp, proj=proj, M=M, N=N, K=K)
            row.update(fusedpar_tflops=ours, torch_tflops=cublas, ratio=ours / cublas)
            if graph_timed(tp, M):
                row.update(_graph_point(matmul, x, weight, flops))
            if proj == "qkv":  # q and k: the width less v's (kv = (qkv - d) / 2)
                d, _, qkv = MODELS[model]
                row.update(_rope_point(x, (qkv - (qkv - d) // 2) // tp, K))
            if proj == "gate_up":
                row.update(_gated_point(x, N // 2, K))
            if proj == "down":
                row.update(_gated_grad_point(M, N, K))
            rows.append(row)
            write_results("matmul", rows, COLUMNS, {**env, "partial": True}, announce=False)
            print(
                f"{model} tp{tp} {proj:8s} M={M:6d} N={N:6d} K={K:6d}: fusedpar {ours:6.1f}"
                f"  cuBLAS {cublas:6.1f}  ({ours / cublas:.2f}x)"
            )

    ratios = sorted(r["ratio"] for r in rows)
    meta = {
        **env,
        **measured_ceilings(),
        "dtype": "bfloat16",
        "quick": quick(),
        "graph_timing": GRAPH_TIMING,
        "median_ratio": ratios[len(ratios) // 2],
        "min_ratio": ratios[0],
    }

    def plot(ax):
        ax.plot([r["ratio"] for r in rows], "o", label="fusedpar / cuBLAS")
        ax.axhline(0.95, color="gray", ls="--", label="target 0.95")
        ax.set_xlabel("shape (model x TP x projection x M, in table order)")
        ax.set_ylabel("TFLOP/s ratio")
        ax.set_title(f"Triton GEMM vs torch.matmul, bf16, {meta['device']}")
        ax.legend()

    write_results("matmul", rows, COLUMNS, meta, plot)


if __name__ == "__main__":
    main()
