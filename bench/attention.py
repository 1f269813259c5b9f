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
(`bench.common.write_results` adds them). ``fusedpar`` is what a user gets: per key the
tuner's pick of our tiles and, under ``FUSEDPAR_IMPL=auto``, SDPA's own kernels where they
compute the call (the picks say which ran); its backward the pick of the fused, the split
and those (`fusedpar.kernels.attention.backward_fused`), whose times per key are in the
meta (``backward_fused_split_ms``); ``fusedpar-split`` is the deterministic (split)
backward alone, not a peer.

Masked points (`masked_points`, causal, one packed stream, B = 1, D = 128, 16 heads and
GQA 32 over 8): documents of `DOC_LENGTHS` (16k tokens) and a sliding window of `WINDOW`
keys at 32k tokens. fp.flash_attn_varlen / fp.flash_attn(window=(W - 1, 0)) against SDPA
given the dense boolean mask (`sdpa-mask`), FlexAttention with a block mask of the same
mask_mod, and flash-attn's varlen / window_size functions where `flash_attn` imports
(`flash-attn`; otherwise null with a note in the row); and, for the documents, the forward
kernel alone with the intervals built once (`fusedpar-prebuilt`: what the call's cu_seqlens
check and interval building cost, not a peer). FLOPs count the visible pairs as
above: sum L^2 / 2 over documents, T W - W^2 / 2 in a window; the `mask` column names it.

Environment: ``BENCH_QUICK=1`` keeps D = 128 at S = 1k, 4k, 16k, GQA at 16k and the
masked points at 16 heads; ``BENCH_PEERS=fusedpar,sdpa-cudnn`` runs only the peers named
(of `PEERS` and `MASKED_PEERS`). FlexAttention recompiles for every point, so it runs
after every other peer has measured every point, masked points first.
"""

import functools
import itertools
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
PEERS = ("fusedpar", "fusedpar-split", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")
DOC_LENGTHS = (4096, 2048, 1000, 7000, 2240)  # fixed: 16384 tokens, ragged against tiles
WINDOW, WINDOW_TOKENS = 4096, 32768
MASKED_HEADS = ((16, 16), (32, 8))  # (Hq, Hkv) at D = 128; BENCH_QUICK keeps the first
MASKED_PEERS = ("fusedpar", "fusedpar-prebuilt", "sdpa-mask", "flex", "flash-attn")
ALL_PEERS = (*PEERS, *(n for n in MASKED_PEERS if n not in PEERS))
DTYPE = torch.bfloat16  # a CPU test runs the whole bench in fp32 (the interpreter)


def selected_peers() -> list[str]:
    """`ALL_PEERS`, or those named in ``BENCH_PEERS`` (comma-separated), in that order."""
    named = os.environ.get("BENCH_PEERS")
    if not named:
        return list(ALL_PEERS)
    wanted = {n.strip() for n in named.split(",") if n.strip()}
    unknown = wanted - set(ALL_PEERS)
    if unknown:
        raise ValueError(
            f"BENCH_PEERS: unknown peers {sorted(unknown)}; known: {', '.join(ALL_PEERS)}"
        )
    return [n for n in ALL_PEERS if n in wanted]


def _fusedpar(causal, gqa, deterministic=False):
    import fusedpar as fp

    return "bshd", lambda q, k, v: fp.flash_attn(
        q, k, v, causal=causal, deterministic=deterministic
    )


def backward_times() -> dict:
    """Per key the tuner timed, the backwards' times (ms: fused, split, then SDPA's where
    they apply): what ``fusedpar`` chose between (``fusedpar-split`` is the split alone)."""
    from fusedpar.kernels import tuning

    timed = tuning.tuner("attention_backward").timings
    return {repr(key): [round(t, 4) for t in times] for (_, key), times in timed.items()}


def _sdpa(backend, causal, gqa):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend)
    extra = {"enable_gqa": True} if gqa else {}

    def run(q, k, v):
        with sdpa_kernel(chosen):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, **extra
            )

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
    if name in ("fusedpar", "fusedpar-split"):
        return _fusedpar(causal, gqa, deterministic=name == "fusedpar-split")
    if name == "flex":
        return _flex(causal, gqa, S, device)
    backend = {
        "sdpa-flash": "FLASH_ATTENTION",
        "sdpa-cudnn": "CUDNN_ATTENTION",
        "sdpa-efficient": "EFFICIENT_ATTENTION",
    }[name]
    return _sdpa(backend, causal, gqa)


class Unavailable(Exception):
    """A peer not installed here: null with a note in its rows, not listed as missing."""


def mask_mod(mask, spec, device):
    """FlexAttention's mask_mod of a masked point: causal within a document (`spec`: the
    lengths) or within the last `spec` keys. Called on (T, 1) and (1, T) positions it is
    the dense boolean mask SDPA is given, so the peers see the same mask."""
    if mask == "documents":
        lengths = torch.tensor(spec, device=device)
        doc = torch.repeat_interleave(torch.arange(len(spec), device=device), lengths)
        return lambda b, h, q, kv: (q >= kv) & (doc[q] == doc[kv])
    return lambda b, h, q, kv: (q >= kv) & (q < kv + spec)


def cu_seqlens(lengths, device):
    """int32 document boundaries (B + 1 entries from 0 to the total)."""
    ends = [0, *itertools.accumulate(lengths)]
    return torch.tensor(ends, dtype=torch.int32, device=device)


def _masked_fusedpar(mask, spec, device):
    """flash_attn_varlen as users call it: it checks the cu_seqlens (a host sync) and
    derives the blocks' document intervals on every call, and the timings include both."""
    import fusedpar as fp

    if mask == "documents":
        cu = cu_seqlens(spec, device)
        return "thd", lambda q, k, v: fp.flash_attn_varlen(q, k, v, cu, causal=True)
    return "bshd", lambda q, k, v: fp.flash_attn(q, k, v, causal=True, window=(spec - 1, 0))


def _masked_fusedpar_prebuilt(mask, spec, T, device):
    """The documents' forward kernel alone: `attention_forward` with the intervals built
    once, outside the timed call (no cu_seqlens check, no host sync, no interval
    building). Forward only: it has no autograd, so its backward passes are missing.
    Beside `fusedpar`'s row it tells the call's own cost from the kernel's (the first
    H100 run: the documents forward at 0.47 of flex, its backward at 0.89)."""
    from fusedpar.kernels.attention import AttentionMask, attention_forward, packed_intervals

    if mask != "documents":
        raise Unavailable("fusedpar-prebuilt: the documents point only")
    cu = cu_seqlens(spec, device)
    documents = AttentionMask(
        intervals=packed_intervals(cu, cu, T, T, causal=True, window=(-1, -1))
    )

    def forward(q, k, v):
        return attention_forward(q[None], k[None], v[None], documents)[0][0]

    return "thd", forward


def _masked_sdpa(mask, spec, T, group, device):
    """SDPA with the dense (T, T) boolean mask, built once; torch picks the backend. KV
    heads are repeated to the query heads inside the timed call, as Hugging Face does
    when there is a mask (its reason: enable_gqa with a mask can leave only SDPA's math
    path)."""
    pos = torch.arange(T, device=device)
    dense = mask_mod(mask, spec, device)(0, 0, pos[:, None], pos[None, :])

    def run(q, k, v):
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)

    return "bhsd", run


def _masked_flex(mask, spec, T, gqa, device):
    from torch.nn.attention.flex_attention import create_block_mask

    compiled = _compiled_flex()
    blocks = create_block_mask(mask_mod(mask, spec, device), None, None, T, T, device=device)
    return "bhsd", lambda q, k, v: compiled(q, k, v, block_mask=blocks, enable_gqa=gqa)


def _masked_flash_attn(mask, spec, device):
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except Exception as e:  # usually not installed; a broken build fails here too
        raise Unavailable(f"flash-attn: not importable ({type(e).__name__})") from None
    if mask == "documents":
        cu, longest = cu_seqlens(spec, device), max(spec)
        return "thd", lambda q, k, v: flash_attn_varlen_func(
            q, k, v, cu, cu, longest, longest, causal=True
        )
    return "bshd", lambda q, k, v: flash_attn_func(q, k, v, causal=True, window_size=(spec - 1, 0))


def make_masked_peer(name, point, device="cuda"):
    """(layout, fn(q, k, v)) of the peer called `name` at a point of `masked_points`."""
    mask, _, T, Hq, Hkv, spec = point
    if name == "fusedpar":
        return _masked_fusedpar(mask, spec, device)
    if name == "fusedpar-prebuilt":
        return _masked_fusedpar_prebuilt(mask, spec, T, device)
    if name == "sdpa-mask":
        return _masked_sdpa(mask, spec, T, Hq // Hkv, device)
    if name == "flex":
        return _masked_flex(mask, spec, T, Hq != Hkv, device)
    return _masked_flash_attn(mask, spec, device)


def _time_passes(make, B, S, Hq, Hkv, D, device="cuda"):
    """{pass: ms, or the exception that stopped it}: a pass that fails (out of memory in
    the backward, say) leaves the others measured."""
    try:
        layout, fn = make()

        def tensor(H):
            shape = {"bshd": (B, S, H, D), "bhsd": (B, H, S, D), "thd": (B * S, H, D)}[layout]
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
    mha = [
        (D, causal, S, D_MODEL // D, D_MODEL // D)
        for D in head_dims
        for causal in (False, True)
        for S in seq_lens
    ]
    gqa_lens = (16384,) if quick() else SEQ_LENS
    gqa = [
        (128, causal, S, GQA_HEADS, Hkv)
        for Hkv in GQA_KV_HEADS
        for causal in (False, True)
        for S in gqa_lens
    ]
    return mha + gqa


def masked_points():
    """(mask, D, T, Hq, Hkv, spec) in run order, causal over one packed stream of T
    tokens: documents (`spec`: their lengths), then a sliding window (`spec`: W keys)."""
    heads = MASKED_HEADS[:1] if quick() else MASKED_HEADS
    return [
        pt
        for Hq, Hkv in heads
        for pt in (
            ("documents", 128, sum(DOC_LENGTHS), Hq, Hkv, DOC_LENGTHS),
            ("window", 128, WINDOW_TOKENS, Hq, Hkv, WINDOW),
        )
    ]


def _masked(point) -> bool:
    return isinstance(point[0], str)


def describe(point):
    """(row fields, forward FLOPs) of a point of `points` or `masked_points`: FLOPs are
    4 * Hq * D per visible (query, key) pair, a causal square counted as S^2 / 2."""
    if not _masked(point):
        D, causal, S, Hq, Hkv = point
        B = TOKENS // S
        fields = dict(D=D, S=S, B=B, Hq=Hq, Hkv=Hkv, causal=causal)
        return fields, 4 * B * Hq * S * S * D * (0.5 if causal else 1.0)
    mask, D, T, Hq, Hkv, spec = point
    if mask == "documents":
        pairs, label = sum(n * n for n in spec) / 2, "documents " + "+".join(map(str, spec))
    else:
        pairs, label = T * spec - spec * spec / 2, f"window {spec}"
    return dict(D=D, S=T, B=1, Hq=Hq, Hkv=Hkv, causal=True, mask=label), 4 * Hq * D * pairs


def peers_at(point, names) -> list[str]:
    """The peers of `names` that a point compares: `PEERS`, or `MASKED_PEERS`."""
    return [n for n in names if n in (MASKED_PEERS if _masked(point) else PEERS)]


def _best_peer_ratios(row, names) -> None:
    peers = [row.get(n) for n in names if not n.startswith("fusedpar") and row.get(n) is not None]
    if row.get("fusedpar") is not None and peers:
        row["vs_best_peer"] = row["fusedpar"] / max(peers)


def main(device: str = "cuda") -> None:
    """The whole grid on `device` (a CPU test runs it in the interpreter, timers faked)."""
    if device == "cuda" and not require_gpu("attention"):
        return
    names = selected_peers()
    dtype = str(DTYPE).removeprefix("torch.")
    meta = {
        **environment(),
        **measured_ceilings(),
        "dtype": dtype,
        "tokens": TOKENS,
        "d_model": D_MODEL,
        "quick": quick(),
        "peers": ",".join(names),
    }
    columns = [
        "D",
        "S",
        "B",
        "Hq",
        "Hkv",
        "causal",
        "mask",
        "pass_",
        *names,
        "vs_best_peer",
        "vs_matmul",
        "note",
    ]
    dense, masked = points(), masked_points()
    table = {pt: {p: {**describe(pt)[0], "pass_": p} for p in PASSES} for pt in dense + masked}
    failures = {}

    def measure(name, point):
        fields, fwd_flops = describe(point)
        D, S, B, Hq, Hkv, causal = (fields[k] for k in ("D", "S", "B", "Hq", "Hkv", "causal"))
        flops = {"fwd": fwd_flops, "bwd": 2.5 * fwd_flops, "fwd+bwd": 3.5 * fwd_flops}
        if _masked(point):
            make = functools.partial(make_masked_peer, name, point, device)
        else:
            make = functools.partial(make_peer, name, causal, S, Hkv != Hq, device)
        where = " ".join(
            filter(
                None,
                (
                    name,
                    fields.get("mask"),
                    f"D={D} S={S} Hq={Hq} Hkv={Hkv}",
                    "causal" if causal else "",
                ),
            )
        )
        for p, ms in _time_passes(make, B, S, Hq, Hkv, D, device).items():
            row = table[point][p]
            if isinstance(ms, Unavailable):  # not installed: a note in the row
                row["note"] = "; ".join(filter(None, (row.get("note"), str(ms))))
                ms = None
            elif isinstance(ms, Exception):  # recorded as missing (null), with the reason
                failures.setdefault(f"{type(ms).__name__}: {str(ms)[:120]}", []).append(
                    f"{where} {p}"
                )
                ms = None
            row[name] = None if ms is None else flops[p] / ms / 1e9
        for r in table[point].values():
            _best_peer_ratios(r, names)
            if r.get("fusedpar") is not None and r["pass_"] == "fwd":
                r["vs_matmul"] = r["fusedpar"] / meta["matmul_bf16_tflops"]
        both = table[point]["fwd+bwd"][name]
        print(f"{where}: fwd+bwd TFLOP/s {both if both is None else round(both)}")
        meta["missing"] = "; ".join(f"{why} at {', '.join(at)}" for why, at in failures.items())
        meta["backward_fused_split_ms"] = backward_times()
        rows = [r for per_pass in table.values() for r in per_pass.values()]
        write_results("attention", rows, columns, meta, announce=False)  # kept if cut short

    # Point by point for every peer but flex, which recompiles per point: it comes last,
    # masked points first (the comparison FlexAttention's block masks are made for).
    for point in table:
        for name in peers_at(point, names):
            if name != "flex":
                measure(name, point)
    for point in masked + dense:
        if "flex" in peers_at(point, names):
            measure("flex", point)
    rows = [r for per_pass in table.values() for r in per_pass.values()]

    def plot(ax):  # the unmasked multi-head points; the masked ones are in the table
        plain = [r for r in rows if "mask" not in r and r["Hq"] == r["Hkv"]]
        shown = 128 if any(r["D"] == 128 for r in plain) else plain[0]["D"]
        for name in (n for n in names if n in PEERS):
            for causal, style in ((False, "-"), (True, "--")):
                pts = [
                    r
                    for r in plain
                    if r["D"] == shown
                    and r["causal"] == causal
                    and r["pass_"] == "fwd+bwd"
                    and r.get(name) is not None
                ]
                ax.plot(
                    [r["S"] for r in pts],
                    [r[name] for r in pts],
                    style,
                    marker="o",
                    label=f"{name}{' causal' if causal else ''}",
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (16k tokens per batch)")
        ax.set_ylabel("TFLOP/s, forward + backward")
        ax.set_title(f"attention, {dtype}, D={shown}, multi-head, {meta['device']}")
        ax.legend(fontsize=7, ncol=2)

    write_results("attention", rows, columns, meta, plot)


if __name__ == "__main__":
    main()
