"""fp.flash_attn against torch SDPA (each backend that runs) and FlexAttention.

bf16, 16k tokens per batch (B = 16k / S) for S = 1k..16k, causal and not:

- multi-head: head dim 64 and 128, d_model 2048 (H = 2048 / D);
- GQA: 32 query heads over 8 and over 1 KV heads at D = 128 (the dK/dV grid of a few
  KV heads is what the backward's GQA split is for, review P6).

TFLOP/s of the forward, the backward and both, with FLOPs = 4 * B * Hq * S^2 * D
forward (x0.5 causal), backward 2.5x forward. Targets (H100, D = 128, S >= 4k): at or
above the best peer everywhere (`vs_best_peer` >= 1), and the forward at >= 0.75 of the
measured bf16 matmul ceiling (`vs_matmul`). A pass a peer cannot run is null in the JSON
and listed under `missing`. The tiles the tuner picked are in the results' meta
(`bench.common.write_results` adds them).

Environment: ``BENCH_QUICK=1`` keeps D = 128 at S = 1k, 4k, 16k and GQA at 16k;
``BENCH_PEERS=fusedpar,sdpa-cudnn`` runs only the peers named (of `PEERS`). FlexAttention
recompiles for every point, so it runs after every other peer has measured every point.
"""

import functools
import os

import torch

from bench.common import (
    environment,
    measured_ceilings,
    quick,
    require_gpu,
    time_ms,
    write_results,
)

HEAD_DIMS = (64, 128)
SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
TOKENS = 16384
D_MODEL = 2048
GQA_HEADS = 32
GQA_KV_HEADS = (8, 1)
PASSES = ("fwd", "bwd", "fwd+bwd")
PEERS = ("fusedpar", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")
DTYPE = torch.bfloat16  # a CPU test runs the whole bench in fp32 (the interpreter)


def selected_peers() -> list[str]:
    """`PEERS`, or those named in ``BENCH_PEERS`` (comma-separated), in `PEERS` order."""
    named = os.environ.get("BENCH_PEERS")
    if not named:
        return list(PEERS)
    wanted = {n.strip() for n in named.split(",") if n.strip()}
    unknown = wanted - set(PEERS)
    if unknown:
        raise ValueError(f"BENCH_PEERS: unknown peers {sorted(unknown)}; known: {', '.join(PEERS)}")
    return [n for n in PEERS if n in wanted]


def _fusedpar(causal, gqa):
    import fusedpar as fp

    return "bshd", lambda q, k, v: fp.flash_attn(q, k, v, causal=causal)


def _sdpa(backend, causal, gqa):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend)
    extra = {"enable_gqa": True} if gqa else {}

    def run(q, k, v):
        with sdpa_kernel(chosen):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                    **extra)  # fmt: skip

    return "bhsd", run


@functools.cache
def _compiled_flex():
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    # Every (shape, mask) is a recompile of one function: past dynamo's limit (8 by
    # default) flex would silently run its unfused path (S x S scores). Raise the limit,
    # and make hitting it an error, which the run records as a missing point.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, dynamic=False)


def _flex(causal, gqa, S, device):
    from torch.nn.attention.flex_attention import create_block_mask

    compiled = _compiled_flex()
    mask = None
    if causal:
        mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S, device=device)
    return "bhsd", lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=gqa)


def make_peer(name, causal, S, gqa, device="cuda"):
    """(layout, fn(q, k, v)) of the peer called `name`."""
    if name == "fusedpar":
        return _fusedpar(causal, gqa)
    if name == "flex":
        return _flex(causal, gqa, S, device)
    backend = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
               "sdpa-efficient": "EFFICIENT_ATTENTION"}[name]  # fmt: skip
    return _sdpa(backend, causal, gqa)


def _time_passes(make, B, S, Hq, Hkv, D, device="cuda"):
    """{pass: ms, or the exception that stopped it}: a pass that fails (out of memory in
    the backward, say) leaves the others measured."""
    try:
        layout, fn = make()

        def tensor(H):
            shape = (B, S, H, D) if layout == "bshd" else (B, H, S, D)
            return torch.randn(shape, device=device, dtype=DTYPE, requires_grad=True)

        q, k, v = tensor(Hq), tensor(Hkv), tensor(Hkv)
        dout = torch.randn_like(q)
        out = fn(q, k, v)
    except Exception as e:  # the peer does not run at this point at all
        return dict.fromkeys(PASSES, e)
    runs = {
        "fwd": lambda: fn(q, k, v),
        "bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
        "fwd+bwd": lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout),
    }
    result = {}
    for p, run in runs.items():
        try:
            result[p] = time_ms(run)
        except Exception as e:  # drop the traceback, whose frames hold the pass's memory
            result[p] = e.with_traceback(None)
            del e
            if device == "cuda":
                torch.cuda.empty_cache()
    return result


def points():
    """(D, causal, S, Hq, Hkv) in run order: multi-head, then GQA."""
    head_dims, seq_lens = ((128,), (1024, 4096, 16384)) if quick() else (HEAD_DIMS, SEQ_LENS)
    mha = [(D, causal, S, D_MODEL // D, D_MODEL // D)
           for D in head_dims for causal in (False, True) for S in seq_lens]  # fmt: skip
    gqa_lens = (16384,) if quick() else SEQ_LENS
    gqa = [(128, causal, S, GQA_HEADS, Hkv)
           for Hkv in GQA_KV_HEADS for causal in (False, True) for S in gqa_lens]  # fmt: skip
    return mha + gqa


def _best_peer_ratios(row, names) -> None:
    peers = [row.get(n) for n in names if n != "fusedpar" and row.get(n) is not None]
    if row.get("fusedpar") is not None and peers:
        row["vs_best_peer"] = row["fusedpar"] / max(peers)


def main(device: str = "cuda") -> None:
    """The whole grid on `device` (a CPU test runs it in the interpreter, timers faked)."""
    if device == "cuda" and not require_gpu("attention"):
        return
    names = selected_peers()
    dtype = str(DTYPE).removeprefix("torch.")
    meta = {**environment(), **measured_ceilings(), "dtype": dtype, "tokens": TOKENS,
            "d_model": D_MODEL, "quick": quick(), "peers": ",".join(names)}  # fmt: skip
    columns = ["D", "S", "B", "Hq", "Hkv", "causal", "pass_", *names, "vs_best_peer",
               "vs_matmul"]  # fmt: skip
    table, failures = {}, {}
    for point in points():
        D, causal, S, Hq, Hkv = point
        table[point] = {p: dict(D=D, S=S, B=TOKENS // S, Hq=Hq, Hkv=Hkv, causal=causal, pass_=p)
                        for p in PASSES}  # fmt: skip

    def measure(name, point):
        D, causal, S, Hq, Hkv = point
        B = TOKENS // S
        fwd_flops = 4 * B * Hq * S * S * D * (0.5 if causal else 1.0)
        flops = {"fwd": fwd_flops, "bwd": 2.5 * fwd_flops, "fwd+bwd": 3.5 * fwd_flops}
        make = functools.partial(make_peer, name, causal, S, Hkv != Hq, device)
        for p, ms in _time_passes(make, B, S, Hq, Hkv, D, device).items():
            if isinstance(ms, Exception):  # recorded as missing (null), with the reason
                failures.setdefault(f"{type(ms).__name__}: {str(ms)[:120]}", []).append(
                    f"{name} D={D} S={S} Hq={Hq} Hkv={Hkv}{' causal' if causal else ''} {p}"
                )
                ms = None
            table[point][p][name] = None if ms is None else flops[p] / ms / 1e9
        for r in table[point].values():
            _best_peer_ratios(r, names)
            if r.get("fusedpar") is not None and r["pass_"] == "fwd":
                r["vs_matmul"] = r["fusedpar"] / meta["matmul_bf16_tflops"]
        both = table[point]["fwd+bwd"]
        print(f"{name} D={D} causal={causal} S={S} Hq={Hq} Hkv={Hkv}: fwd+bwd TFLOP/s "
              f"{both[name] if both[name] is None else round(both[name])}")  # fmt: skip
        meta["missing"] = "; ".join(f"{why} at {', '.join(at)}" for why, at in failures.items())
        rows = [r for per_pass in table.values() for r in per_pass.values()]
        write_results("attention", rows, columns, meta, announce=False)  # kept if cut short

    # Point by point for every peer but flex, which recompiles per point: it comes last.
    for point in table:
        for name in names:
            if name != "flex":
                measure(name, point)
    if "flex" in names:
        for point in table:
            measure("flex", point)
    rows = [r for per_pass in table.values() for r in per_pass.values()]

    def plot(ax):
        shown = 128 if any(r["D"] == 128 for r in rows) else rows[0]["D"]
        for name in names:
            for causal, style in ((False, "-"), (True, "--")):
                pts = [r for r in rows if r["D"] == shown and r["causal"] == causal
                       and r["Hq"] == r["Hkv"] and r["pass_"] == "fwd+bwd"
                       and r.get(name) is not None]  # fmt: skip
                ax.plot([r["S"] for r in pts], [r[name] for r in pts], style, marker="o",
                        label=f"{name}{' causal' if causal else ''}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (16k tokens per batch)")
        ax.set_ylabel("TFLOP/s, forward + backward")
        ax.set_title(f"attention, {dtype}, D={shown}, multi-head, {meta['device']}")
        ax.legend(fontsize=7, ncol=2)

    write_results("attention", rows, columns, meta, plot)


if __name__ == "__main__":
    main()
