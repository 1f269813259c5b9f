"""fp.flash_attn against torch SDPA (each backend that runs) and FlexAttention.

bf16, head dim 64 and 128, d_model 2048 (H = 2048 / D), 16k tokens per batch
(B = 16k / S) for S = 1k..16k, causal and not. TFLOP/s of the forward, the backward
and both, with FLOPs = 4 * B * H * S^2 * D forward (x0.5 causal), backward 2.5x forward.
Targets (H100, D = 128, S >= 4k): at or above the best peer everywhere, and the forward
at >= 0.75 of the measured bf16 matmul ceiling.
"""

import torch

from bench.common import environment, measured_ceilings, require_gpu, time_ms, write_results

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


def _flex(causal, S):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    mask = None
    if causal:
        mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S, device="cuda")
    return "bhsd", lambda q, k, v: compiled(q, k, v, block_mask=mask)


def peers(causal, S):
    yield "fusedpar", lambda: _fusedpar(causal)
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        yield f"sdpa-{backend.split('_')[0].lower()}", lambda b=backend: _sdpa(b, causal)
    yield "flex", lambda: _flex(causal, S)


def _time_passes(fn, layout, B, S, H, D):
    shape = (B, S, H, D) if layout == "bshd" else (B, H, S, D)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    out = fn(q, k, v)
    fwd = time_ms(lambda: fn(q, k, v))
    bwd = time_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    both = time_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout))
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": both}


def main() -> None:
    if not require_gpu("attention"):
        return
    rows, skipped = [], {}
    for D in HEAD_DIMS:
        H = D_MODEL // D
        for causal in (False, True):
            for S in SEQ_LENS:
                B = TOKENS // S
                fwd_flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
                flops = {"fwd": fwd_flops, "bwd": 2.5 * fwd_flops, "fwd+bwd": 3.5 * fwd_flops}
                point = {p: dict(D=D, S=S, B=B, H=H, causal=causal, pass_=p) for p in PASSES}
                for name, make in peers(causal, S):
                    try:
                        layout, fn = make()
                        ms = _time_passes(fn, layout, B, S, H, D)
                    except Exception as e:  # a backend that does not run here: say so, once
                        skipped.setdefault(name, f"{type(e).__name__}: {str(e)[:120]}")
                        ms = dict.fromkeys(PASSES, float("nan"))
                    for p in PASSES:
                        point[p][name] = flops[p] / ms[p] / 1e9
                rows += point.values()
                both = point["fwd+bwd"]
                print(f"D={D} causal={causal} S={S}: fwd+bwd TFLOP/s " + ", ".join(
                    f"{k} {v:.0f}" for k, v in both.items() if isinstance(v, float)))  # fmt: skip
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")

    impls = [name for name, _ in peers(False, 1024)]
    meta = {**environment(), **measured_ceilings(), "dtype": "bfloat16", "tokens": TOKENS,
            "d_model": D_MODEL}  # fmt: skip
    meta["skipped"] = "; ".join(f"{k} ({v})" for k, v in skipped.items()) or "none"

    def plot(ax):
        for name in impls:
            for causal, style in ((False, "-"), (True, "--")):
                pts = [r for r in rows if r["D"] == 128 and r["causal"] == causal
                       and r["pass_"] == "fwd+bwd"]  # fmt: skip
                ax.plot([r["S"] for r in pts], [r[name] for r in pts], style, marker="o",
                        label=f"{name}{' causal' if causal else ''}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (16k tokens per batch)")
        ax.set_ylabel("TFLOP/s, forward + backward")
        ax.set_title(f"attention, bf16, D=128, {meta['device']}")
        ax.legend(fontsize=7, ncol=2)

    columns = ["D", "S", "B", "H", "causal", "pass_", *impls]
    write_results("attention", rows, columns, meta, plot)


if __name__ == "__main__":
    main()
