"""MoE dispatch: permute/combine bandwidth, grouped expert GEMMs, and the whole layer.

Fine-grained shapes (E = 64 and 128 experts, d_model 2048, d_hidden 768 and 1536, top-8,
16k tokens), bf16, uniform and skewed routing (Zipf-like expert popularity):

- permute (gather rows with top-k replication) and combine (weighted sum of k rows per
  token): GB/s against torch index ops (``x[idx]``, ``index_add_``) and against the
  measured device copy bandwidth (target >= 0.7 of it);
- grouped GEMM (the first expert projection): TFLOP/s against a loop of ``torch.matmul``
  per expert and ``torch._grouped_mm`` where it exists (target >= 1.2x the loop), all
  reading the permuted rows; `grouped_gather_tflops` is ours with the gather fused, as
  the layer runs it;
- the fused gate/up GEMM (`grouped_swiglu`: both projections and the SwiGLU, gathering
  from x) against two ``torch._grouped_mm`` and ``silu * mul`` on the permuted rows;
- the weight gradient (`grouped_weight_grad`) against a loop of ``dy_e.T @ x_e``;
- `fp.nn.MoE` forward + backward against a naive torch MoE (loop over experts) and a
  torchtitan-style layer on ``torch._grouped_mm`` (permute, three grouped GEMMs,
  weighted ``index_add_``). The layers route with the same router weights; our layer's
  times do not depend on the routing column.

The tuner's picks (`all_picks`) go in the results' meta. Runs on a GPU only (exits 0
without one); the peers' math is device-agnostic and tested on CPU (tests/moe/test_moe.py).

Anchors: CUTLASS SM90 grouped GEMM 160 TFLOP/s against a cuBLAS loop at 129.5 on
Qwen3-30B-A3B shapes (H100); permute kernels at 1.5-2.4 TB/s on H200.
"""

import torch
from fusedpar.kernels.tuning import all_picks

from bench.common import (
    environment,
    measured_ceilings,
    paired_bars,
    require_gpu,
    time_ms,
    write_results,
)

SHAPES = [(64, 2048, 768), (128, 2048, 1536)]  # (experts, d_model, d_hidden)
TOKENS, TOP_K = 16384, 8


def _routing(E, skewed, gen, tokens=TOKENS, top_k=TOP_K, device="cuda"):
    """ids (T, k) distinct per token; skewed: expert popularity ~ 1 / (rank + 1)."""
    popularity = 1.0 / torch.arange(1, E + 1, dtype=torch.float32) if skewed else torch.ones(E)
    return torch.multinomial(popularity.expand(tokens, E), top_k, generator=gen).to(device)


def _route(x, router_weight, top_k):
    """The peers' router: softmax, top-k, weights renormalized (as `fp.nn.MoE` defaults)."""
    weights, ids = (x.float() @ router_weight.float().T).softmax(-1).topk(top_k, -1)
    return (weights / weights.sum(-1, keepdim=True)).to(x.dtype), ids


def _naive_moe(x, router_weight, w1, w2, w3, top_k):
    """A loop over experts with boolean indexing (one host sync per expert)."""
    weights, ids = _route(x, router_weight, top_k)
    y = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, slot = torch.where(ids == e)
        h = torch.nn.functional.silu(x[token] @ w1[e].T) * (x[token] @ w3[e].T)
        y.index_add_(0, token, (h @ w2[e].T) * weights[token, slot, None])
    return y


def _grouped_mm_moe(x, router_weight, w1, w2, w3, top_k):
    """The layer as torchtitan runs it on ``torch._grouped_mm``: sort the (token, slot)
    pairs by expert, gather x, one grouped GEMM per projection (w1, w3, w2) with the
    experts' row offsets, SwiGLU between, and a weighted ``index_add_`` back to tokens."""
    weights, ids = _route(x, router_weight, top_k)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w1.shape[0], dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # no host sync (bincount has one)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    tokens = order // top_k
    xs = x[tokens]
    h1 = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
    h3 = torch._grouped_mm(xs, w3.transpose(-2, -1), offs=offs)
    out = torch._grouped_mm(torch.nn.functional.silu(h1) * h3, w2.transpose(-2, -1), offs=offs)
    return torch.zeros_like(x).index_add_(0, tokens, out * weights.reshape(-1)[order, None])


def _grouped_mm_or_reason(fn):
    """``fn()``'s value, or "n/a (why)" where torch._grouped_mm is missing or refuses."""
    if not hasattr(torch, "_grouped_mm"):
        return "n/a (no torch._grouped_mm in this torch)"
    try:
        return fn()
    except (RuntimeError, NotImplementedError) as e:  # device, dtype or layout unsupported
        return f"n/a ({type(e).__name__}: {str(e)[:60]})"


def _point(E, d, h, skewed, copy_gbps):
    from fusedpar.kernels.moe import grouped_matmul, grouped_swiglu
    from fusedpar.kernels.moe_permute import combine, dispatch_metadata, gather_rows
    from fusedpar.kernels.moe_weight_grad import grouped_weight_grad

    gen = torch.Generator().manual_seed(0)
    ids = _routing(E, skewed, gen)
    x = torch.randn(TOKENS, d, device="cuda", dtype=torch.bfloat16)
    counts, order, pos = dispatch_metadata(ids, E)
    rows = order // TOP_K
    weights = torch.rand(TOKENS, TOP_K, device="cuda")
    permuted = gather_rows(x, rows)
    row_bytes = d * x.element_size()
    moved = 2 * rows.numel() * row_bytes  # read + write of every routed row
    perm = {"fusedpar": time_ms(lambda: gather_rows(x, rows)), "torch": time_ms(lambda: x[rows])}

    def torch_combine():
        y = torch.zeros_like(x)
        return y.index_add_(0, rows, permuted * weights.reshape(-1)[order, None].to(x.dtype))

    comb = {
        "fusedpar": time_ms(lambda: combine(permuted, pos, weights)),
        "torch": time_ms(torch_combine),
    }
    combined = (rows.numel() + TOKENS) * row_bytes  # read every routed row, write each token
    row = dict(
        E=E,
        d_model=d,
        d_hidden=h,
        routing="skewed" if skewed else "uniform",
        permute_gbps=moved / perm["fusedpar"] / 1e6,
        permute_torch_gbps=moved / perm["torch"] / 1e6,
        combine_gbps=combined / comb["fusedpar"] / 1e6,
        combine_torch_gbps=combined / comb["torch"] / 1e6,
    )
    row["permute_vs_copy"] = row["permute_gbps"] / copy_gbps
    row["combine_vs_copy"] = row["combine_gbps"] / copy_gbps

    w1 = torch.randn(E, h, d, device="cuda", dtype=torch.bfloat16) / d**0.5
    flops = 2 * rows.numel() * d * h
    offsets = [0, *torch.cumsum(counts, 0).tolist()]

    def loop():
        for e in range(E):
            torch.matmul(permuted[offsets[e] : offsets[e + 1]], w1[e].T)

    # The peers read the permuted copy; ours also runs gathering from x (what the layer does)
    row["grouped_tflops"] = flops / time_ms(lambda: grouped_matmul(permuted, w1, counts)) / 1e9
    row["grouped_gather_tflops"] = (
        flops / time_ms(lambda: grouped_matmul(x, w1, counts, rows)) / 1e9
    )
    row["loop_tflops"] = flops / time_ms(loop) / 1e9
    ends = torch.cumsum(counts, 0).to(torch.int32)
    w1_t = w1.transpose(1, 2)
    row["torch_grouped_mm_tflops"] = _grouped_mm_or_reason(
        lambda: flops / time_ms(lambda: torch._grouped_mm(permuted, w1_t, offs=ends)) / 1e9
    )
    row["grouped_vs_loop"] = row["grouped_tflops"] / row["loop_tflops"]

    # gate + up + SwiGLU: ours fused (gathering from x), the peer on the permuted copy
    w3 = torch.randn_like(w1) / d**0.5
    w3_t = w3.transpose(1, 2)
    row["gate_up_tflops"] = (
        2 * flops / time_ms(lambda: grouped_swiglu(x, w1, w3, counts, rows)) / 1e9
    )

    def grouped_mm_gate_up():
        h1 = torch._grouped_mm(permuted, w1_t, offs=ends)
        return torch.nn.functional.silu(h1) * torch._grouped_mm(permuted, w3_t, offs=ends)

    row["gate_up_grouped_mm_tflops"] = _grouped_mm_or_reason(
        lambda: 2 * flops / time_ms(grouped_mm_gate_up) / 1e9
    )

    # weight gradient of w1: ours (gathering from x) against a loop over experts
    dy_h = torch.randn(rows.numel(), h, device="cuda", dtype=torch.bfloat16)

    def wgrad_loop():
        for e in range(E):
            dy_h[offsets[e] : offsets[e + 1]].T @ permuted[offsets[e] : offsets[e + 1]]

    row["wgrad_tflops"] = flops / time_ms(lambda: grouped_weight_grad(dy_h, x, counts, rows)) / 1e9
    row["wgrad_loop_tflops"] = flops / time_ms(wgrad_loop) / 1e9

    import fusedpar as fp

    torch.manual_seed(0)
    layer = fp.nn.MoE(d, h, E, TOP_K, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    dy = torch.randn_like(x)

    def ours():
        y, aux = layer(xg)
        torch.autograd.grad((y * dy).sum() + aux, [xg, *layer.parameters()])

    def peer(moe):
        def run():
            y = moe(xg, layer.router_weight, layer.w1, layer.w2, layer.w3, TOP_K)
            torch.autograd.grad((y * dy).sum(), [xg, *layer.parameters()], allow_unused=True)

        return run

    # rep is milliseconds of timing: the naive layer takes tens of ms a call
    row["layer_ms"] = time_ms(ours, rep=500)
    row["naive_layer_ms"] = time_ms(peer(_naive_moe), rep=500)
    row["grouped_mm_layer_ms"] = _grouped_mm_or_reason(
        lambda: time_ms(peer(_grouped_mm_moe), rep=500)
    )
    print(row)
    return row


def main() -> None:
    if not require_gpu("moe"):
        return
    ceilings = measured_ceilings()
    rows = [
        _point(E, d, h, skewed, ceilings["copy_gbps"])
        for E, d, h in SHAPES
        for skewed in (False, True)
    ]
    meta = {
        **environment(),
        **ceilings,
        "dtype": "bfloat16",
        "tokens": TOKENS,
        "top_k": TOP_K,
        "tuning_picks": all_picks(),
    }
    columns = [
        "E",
        "d_model",
        "d_hidden",
        "routing",
        "permute_gbps",
        "permute_torch_gbps",
        "permute_vs_copy",
        "combine_gbps",
        "combine_torch_gbps",
        "combine_vs_copy",
        "grouped_tflops",
        "grouped_gather_tflops",
        "loop_tflops",
        "torch_grouped_mm_tflops",
        "grouped_vs_loop",
        "gate_up_tflops",
        "gate_up_grouped_mm_tflops",
        "wgrad_tflops",
        "wgrad_loop_tflops",
        "layer_ms",
        "naive_layer_ms",
        "grouped_mm_layer_ms",
    ]

    def plot(ax):
        paired_bars(
            ax,
            [f"E={r['E']} {r['routing']}" for r in rows],
            [r["grouped_tflops"] for r in rows],
            [r["loop_tflops"] for r in rows],
            "fusedpar",
            "matmul loop",
            "grouped GEMM TFLOP/s",
            f"MoE expert GEMM, bf16, {meta['device']}",
        )

    write_results("moe", rows, columns, meta, plot)


if __name__ == "__main__":
    main()
