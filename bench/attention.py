"""fp.flash_attn against torch SDPA (each backend that runs) and FlexAttention.

bf16, head dim 64 and 128, d_model 2048 (H = 2048 / D), 16k tokens per batch
(B = 16k / S) for S = 1k..16k, causal and not. TFLOP/s of the forward, the backward
and both, with FLOPs = 4 * B * H * S^2 * D forward (x0.5 causal), backward 2.5x forward.
Targets (H100, D = 128, S >= 4k): at or above the best peer everywhere (`vs_best_peer`
>= 1), and the forward at >= 0.75 of the measured bf16 matmul ceiling (`vs_matmul`). A
pass a peer cannot run is null in the JSON and listed under `missing`.
"""

import functools

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
PASSES = ("fwd", "bwd", "fwd+bwd")


def _fusedpar(causal):
    import fusedpar as fp

    return "bshd", lambda q, k, v: fp.flash_attn(q, k, v, causal=causal)


def _sdpa(backend, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend)

    def run(q, k, v):
        with sdpa_kernel(chosen):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

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


def _flex(causal, S):
    from torch.nn.attention.flex_attention import create_block_mask

    compiled = _compiled_flex()
    mask = None
    if causal:
        mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S, device="cuda")
    return "bhsd", lambda q, k, v: compiled(q, k, v, block_mask=mask)


def peers(causal, S):
    yield "fusedpar", lambda: _fusedpar(causal)
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        yield f"sdpa-{backend.split('_')[0].lower()}", lambda b=backend: _sdpa(b, causal)
    yield "flex", lambda: _flex(causal, S)


def _time_passes(make, B, S, H, D):
    """{pass: ms, or the exception that stopped it}: a pass that fails (out of memory in
    the backward, say) leaves the others measured."""
    try:
        layout, fn = make()
        shape = (B, S, H, D) if layout == "bshd" else (B, H, S, D)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))  # fmt: skip
        dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
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
            torch.cuda.empty_cache()
    return result


def points():
    """(D, causal, S) in run order; BENCH_QUICK=1 keeps D = 128 at S = 1k, 4k and 16k."""
    head_dims, seq_lens = ((128,), (1024, 4096, 16384)) if quick() else (HEAD_DIMS, SEQ_LENS)
    return [(D, causal, S) for D in head_dims for causal in (False, True) for S in seq_lens]


def main() -> None:
    if not require_gpu("attention"):
        return
    impls = [name for name, _ in peers(False, 1024)]
    meta = {**environment(), **measured_ceilings(), "dtype": "bfloat16", "tokens": TOKENS,
            "d_model": D_MODEL, "quick": quick()}  # fmt: skip
    columns = ["D", "S", "B", "H", "causal", "pass_", *impls, "vs_best_peer", "vs_matmul"]
    rows, failures = [], {}
    for D, causal, S in points():
        H, B = D_MODEL // D, TOKENS // S
        fwd_flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        flops = {"fwd": fwd_flops, "bwd": 2.5 * fwd_flops, "fwd+bwd": 3.5 * fwd_flops}
        point = {p: dict(D=D, S=S, B=B, H=H, causal=causal, pass_=p) for p in PASSES}
        for name, make in peers(causal, S):
            for p, ms in _time_passes(make, B, S, H, D).items():
                if isinstance(ms, Exception):  # recorded as missing (null), with the reason
                    failures.setdefault(f"{type(ms).__name__}: {str(ms)[:120]}", []).append(
                        f"{name} D={D} S={S}{' causal' if causal else ''} {p}"
                    )
                    ms = None
                point[p][name] = None if ms is None else flops[p] / ms / 1e9
        for r in point.values():
            peer_best = max((r[n] for n in impls[1:] if r[n] is not None), default=None)
            if r["fusedpar"] is not None and peer_best:
                r["vs_best_peer"] = r["fusedpar"] / peer_best
            if r["fusedpar"] is not None and r["pass_"] == "fwd":
                r["vs_matmul"] = r["fusedpar"] / meta["matmul_bf16_tflops"]
        rows += point.values()
        both = point["fwd+bwd"]
        print(f"D={D} causal={causal} S={S}: fwd+bwd TFLOP/s " + ", ".join(
            f"{n} {both[n]:.0f}" for n in impls if both[n] is not None))  # fmt: skip
        meta["missing"] = "; ".join(f"{why} at {', '.join(at)}" for why, at in failures.items())
        write_results("attention", rows, columns, meta, announce=False)  # kept if cut short

    def plot(ax):
        shown = 128 if any(r["D"] == 128 for r in rows) else rows[0]["D"]
        for name in impls:
            for causal, style in ((False, "-"), (True, "--")):
                pts = [r for r in rows if r["D"] == shown and r["causal"] == causal
                       and r["pass_"] == "fwd+bwd" and r[name] is not None]  # fmt: skip
                ax.plot([r["S"] for r in pts], [r[name] for r in pts], style, marker="o",
                        label=f"{name}{' causal' if causal else ''}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (16k tokens per batch)")
        ax.set_ylabel("TFLOP/s, forward + backward")
        ax.set_title(f"attention, bf16, D={shown}, {meta['device']}")
        ax.legend(fontsize=7, ncol=2)

    write_results("attention", rows, columns, meta, plot)


if __name__ == "__main__":
    main()
