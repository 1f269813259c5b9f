"""The attention family's cases: its compile-gate cases (`GATE_CASES`: every tuning
config of the forward, the backward's kernels, delta and merge; tests/test_compile_gate.py
builds them) and their scenarios."""

import torch
from fusedpar.kernels.attention import backward as attn_bwd
from fusedpar.kernels.attention import backward_fused as attn_bwd_fused
from fusedpar.kernels.attention import forward as attn
from fusedpar.kernels.attention import mask as attn_mask
from fusedpar.kernels.attention import merge as attn_merge
from fusedpar.kernels.attention.mask import AttentionMask
from fusedpar.kernels.attention.plan import Gradients

from fusedpar.nn.attention_parts import rope_tables
from tests.support.gate import Cases, _empty, _fp32_precision, _smallest, _tma
from tests.support.opcheck import leaf

GATE_CASES = Cases()
add, add_configs = GATE_CASES.add, GATE_CASES.add_configs

# --- compile-gate scenarios: the launchers called as the library calls them (see
# tests/support/gate.py) ---


def _mask(causal, window, softcap, intervals):
    """The mask arguments: the scalar mode (causal, window), or with `intervals` the
    tensor mode the ring and packed documents use (int32, one row for every batch);
    "ordered": packed documents' with the forward's query order (`query_order`)."""
    if not intervals:
        return attn_mask.AttentionMask(causal, window, softcap)
    lo, hi = (torch.empty((1, 256), dtype=torch.int32) for _ in range(2))
    order = torch.empty(2, dtype=torch.int32) if intervals == "ordered" else None
    blocks = attn_mask.Intervals(lo, hi, lo, hi, q_order=order)
    return attn_mask.AttentionMask(softcap=softcap, intervals=blocks)


def attention_forward(
    dtype,
    head_dim,
    causal=True,
    group=2,
    merge=False,
    precision="highest",
    window=(-1, -1),
    softcap=0.0,
    intervals=False,
    tma=True,
    v_dim=None,
):
    """The forward; with `merge`, a ring step: fp32 `out` and `lse` merged into in place;
    `v_dim`: V's head dim (None: head_dim)."""
    q = _empty((2, 256, 2 * group, head_dim), dtype)
    k = _empty((2, 256, 2, head_dim), dtype)
    v = _empty((2, 256, 2, v_dim or head_dim), dtype)
    buffers = {}
    if merge:
        buffers = {
            "out": _empty((*q.shape[:3], v.shape[-1]), "float32"),
            "lse": _empty((2, 2 * group, 256), "float32"),
        }
    with _fp32_precision(precision), _tma(tma):
        attn.attention_forward(
            q, k, v, _mask(causal, window, softcap, intervals), merge=merge, **buffers
        )


def attention_backward(
    dtype,
    head_dim,
    causal=True,
    group=2,
    accumulate=False,
    split=False,
    precision="highest",
    window=(-1, -1),
    softcap=0.0,
    intervals=False,
    tma=True,
    fused=False,
    v_dim=None,
):
    """Launches dQ (making delta from out) and dK/dV, as `flash_attn`'s deterministic
    backward does; `fused`: the delta kernel and the fused dK/dV/dQ kernel instead.
    `accumulate`: the ring's later steps instead (the delta kernel once, then fp32
    gradient buffers added into); `split`: with a GQA group of 4, two slices of 2 heads
    (fp32 partials), as a grid of few programs gets on a GPU. `v_dim`: V's, O's and dO's
    head dim (None: head_dim)."""
    q = _empty((2, 256, 2 * group, head_dim), dtype)
    dout, out = (_empty((2, 256, 2 * group, v_dim or head_dim), dtype) for _ in range(2))
    k = _empty((2, 256, 2, head_dim), dtype)
    v = _empty((2, 256, 2, v_dim or head_dim), dtype)
    lse = _empty((2, 2 * group, 256), "float32")
    grads = Gradients(deterministic=not fused)
    if accumulate:
        buffers = [_empty(t.shape, "float32") for t in (q, k, v)]
        grads = Gradients(*buffers, accumulate=True, deterministic=not fused)
    saved = attn_bwd.SPLIT_BELOW_PROGRAMS
    # 8 programs (2 KV blocks x B x Hkv) under 16: two slices per group
    attn_bwd.SPLIT_BELOW_PROGRAMS = 16 if split else saved
    try:
        with _fp32_precision(precision), _tma(tma):
            mask = _mask(causal, window, softcap, intervals)
            delta = {"delta": attn_merge.attention_delta(out, dout)} if accumulate else {}
            attn_bwd_fused.attention_backward(
                dout, q, k, v, lse, mask, delta_from=(out, None), grads=grads, **delta
            )
    finally:
        attn_bwd.SPLIT_BELOW_PROGRAMS = saved


def attention_backward_fused(**params):
    """`attention_backward` through the fused kernel."""
    attention_backward(**params, fused=True)


def attention_merge_call(head_dim):
    out, block = (_empty((2, 256, 4, head_dim), "float32") for _ in range(2))
    lse, block_lse = (_empty((2, 4, 256), "float32") for _ in range(2))
    attn_merge.merge_attention(out, lse, block, block_lse)


# --- compile-gate cases ---

HEAD_DIMS = (64, 128, 256)
ATTENTION = {  # kernel label: (kernel name, scenario, config function, the loop's block)
    "fwd": ("_attn_fwd_kernel", attention_forward, attn.forward_configs, "BLOCK_N"),
    "dkdv": ("_attn_bwd_dkdv_kernel", attention_backward, attn_bwd.backward_configs, "BLOCK_M"),
    "dq": ("_attn_bwd_dq_kernel", attention_backward, attn_bwd.dq_configs, "BLOCK_N"),
    "fused": (
        "_attn_bwd_dkdv_kernel",
        attention_backward_fused,
        attn_bwd_fused.fused_configs,
        "BLOCK_M",
    ),
}


for label, (kernel, scenario, configs_of, axis) in ATTENTION.items():
    family = f"attention-{label}"
    for D in HEAD_DIMS:
        for dtype in ("bfloat16", "float16", "float32"):
            if dtype == "float16" and D > 128:
                continue  # no rule applies; shared memory is bf16's (test_fp16_matches_bf16)
            # fp32 reads through pointers (TMA only for 16-bit tiles)
            tile_modes = frozenset({"pointer"} if dtype == "float32" else ())
            configs = configs_of(D, getattr(torch, dtype), tile_modes)
            if dtype == "float16":  # the largest tile: it builds exactly as bf16 does
                configs = configs[:1]
            # dK/dV at D=256 holds too much per key for the 64 keys wgmma needs
            matrix = dtype != "float32" and (label not in ("dkdv", "fused") or D < 256)
            add_configs(
                family,
                f"{dtype}-d{D}",
                scenario,
                {"dtype": dtype, "head_dim": D},
                kernel,
                configs,
                no_spill=dtype != "float32" and D <= 128,
                wgmma=matrix,
                loop_axis=axis,
                loop_spill_only=label == "fused",
            )
    # TF32 needs more shared memory than the FMA build of fp32: at the largest head dim
    fp32 = configs_of(256, torch.float32, frozenset({"pointer"}))
    tf32 = {"dtype": "float32", "head_dim": 256, "precision": "high"}
    add_configs(
        family,
        "tf32-d256",
        scenario,
        tf32,
        kernel,
        fp32,
        no_spill=False,
        wgmma=False,
        loop_axis=axis,
    )
    for dtype, params in (("bfloat16", {"dtype": "bfloat16", "head_dim": 256}), ("tf32", tf32)):
        configs = configs_of(256, getattr(torch, params["dtype"]), frozenset({"pointer"}))
        add(
            family,
            f"{dtype}-d256-smallest",
            scenario,
            params,
            kernel,
            80,
            _smallest(configs),
            no_spill=False,
            loop_axis=axis,
        )
    # The ring's modes, every 16-bit tile: a forward step merging into fp32 `out` and `lse`
    # (MHA, the mask as intervals), gradients added into fp32 buffers; the GQA split of
    # dK/dV; and the heaviest mask: causal GQA with a window and soft-capping.
    # Each with the tile modes its launches have (`fusedpar.kernels.attention.plan.kernel_modes`).
    ring = {"group": 1, "intervals": True}
    if label == "fwd":
        modes = {
            "ring-merge": ({**ring, "merge": True}, {"accumulate"}),
            "packed": ({"intervals": "ordered"}, set()),
        }  # its query order's mapping
    else:
        modes = {"ring-accumulate": ({**ring, "accumulate": True}, {"accumulate"})}
    modes["window-softcap"] = ({"window": (100, 0), "softcap": 30.0}, {"softcap"})
    modes["pointer"] = ({"tma": False}, {"pointer"})  # on Hopper: inputs TMA cannot read
    if label in ("dkdv", "fused"):
        modes["gqa-split"] = ({"group": 4, "split": True}, set())
    for mode, (extra, tile_modes) in modes.items():
        for D in (64, 128):  # where the no-spill rule applies
            configs = configs_of(D, torch.bfloat16, frozenset(tile_modes))
            if mode.startswith("ring"):  # MHA: lighter than the cases above
                configs = configs[:1]
            add_configs(
                family,
                f"{mode}-bfloat16-d{D}",
                scenario,
                {"dtype": "bfloat16", "head_dim": D, **extra},
                kernel,
                configs,
                no_spill=True,
                wgmma=True,
                loop_axis=axis,
                loop_spill_only=label == "fused",
            )
    # V narrower than Q and K, every tile of the pair's list: DeepSeek's MLA (192, 128:
    # BLOCK_D 256, BLOCK_DV 128), and (128, 64)
    for D, Dv in ((192, 128), (128, 64)):
        configs = configs_of(D, torch.bfloat16, frozenset(), v_dim=Dv)
        add_configs(
            family,
            f"v{Dv}-bfloat16-d{D}",
            scenario,
            {"dtype": "bfloat16", "head_dim": D, "v_dim": Dv},
            kernel,
            configs,
            no_spill=True,
            wgmma=label not in ("dkdv", "fused") or D <= 128,
            loop_axis=axis,
            loop_spill_only=label == "fused",
        )

for cap in (90, 80):
    add(
        "attention-delta",
        "bfloat16-d256",
        attention_backward,
        {"dtype": "bfloat16", "head_dim": 256, "accumulate": True},  # (the ring's)
        "_bwd_delta_kernel",
        cap,
        no_spill=True,
    )
    add(
        "attention-merge",
        "d256",
        attention_merge_call,
        {"head_dim": 256},
        "_merge_kernel",
        cap,
        no_spill=False,
    )
add(
    "attention-merge",
    "d128",
    attention_merge_call,
    {"head_dim": 128},
    "_merge_kernel",
    90,
    no_spill=True,
)


# --- opcheck cases (tests/test_compile.py runs them on 2 ranks) ---


def opcheck_cases(group: str) -> list:
    """(op, args) for the custom ops of flash attention (forward, backward, packed,
    strided) and the attention layer: small and random, float inputs requiring grad (the
    autograd registration is exercised); `group`: the ranks'."""
    ops = torch.ops.fusedpar
    q, k, v = leaf(1, 8, 4, 16), leaf(1, 8, 2, 16), leaf(1, 8, 2, 16)
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    causal = AttentionMask(causal=True).flat()
    out, lse = ops.flash_attn(q, k, v, [], causal, False)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    # the layer's layout: (S, B, H, D) projections viewed as (B, S, H, D), not contiguous
    qt, kt, vt = (leaf(8, 2, h, 16).transpose(0, 1) for h in (4, 2, 2))
    out_t, lse_t = ops.flash_attn(qt, kt, vt, [], causal, False)
    # the one-rank attention layer (x (4, 2, 16), heads 2/1 of 8): RoPE in the GEMMs; biases,
    # head norms turning 6 of 8 dims; packed documents with a window and softcap, no RoPE;
    # output gates (the first and the last)
    xa, wa = leaf(4, 2, 16), [leaf(16, 16), leaf(8, 16), leaf(8, 16), leaf(16, 16)]
    windowed = AttentionMask(causal=True, window=(2, 0), softcap=3.0, softmax_scale=0.5)
    layer_cases = [
        (
            xa,
            wa,
            [],
            [False] * 4,
            list(rope_tables(torch.arange(4), 8, 100.0)),
            None,
            8,
            causal,
            [1e-6, 0.0],
            [leaf(16, 16)],  # an output gate
        ),
        (
            xa,
            [*wa, leaf(8), leaf(8)],  # the head norms' weights after the projections'
            [leaf(16), leaf(8), leaf(8), leaf(16)],
            [True] * 4,
            list(rope_tables(torch.arange(4), 6, 100.0)),
            None,
            8,
            causal,
            [1e-6, 1.0],
            [],
        ),
        (
            leaf(7, 1, 16),
            wa,
            [leaf(16)],
            [False, False, False, True],
            [],
            torch.tensor([0, 3, 3, 7], dtype=torch.int32),
            8,
            windowed.flat(),
            [1e-6, 0.0],
            [leaf(16, 16), leaf(16)],  # an output gate with its bias
        ),
    ]
    layer_saved = ops.attention_layer(*layer_cases[1])[1]
    gated_saved = ops.attention_layer(*layer_cases[2])[1]
    return [
        (ops.flash_attn, (q, k, v, [], causal, False)),
        (ops.flash_attn, (q[0, None], k[0, None], v[0, None], [cu, cu], causal, False)),
        (ops.flash_attn_backward, (dout, dlse, q, k, v, out, lse, [], causal, False)),
        (
            ops.flash_attn_backward,
            (
                torch.randn_like(out_t),
                torch.randn_like(lse_t),
                qt,
                kt,
                vt,
                out_t,
                lse_t,
                [],
                causal,
                False,
            ),
        ),
        *((ops.attention_layer, args) for args in layer_cases),
        (
            ops.attention_layer_backward,
            (
                torch.randn(4, 2, 16),
                xa,
                layer_saved,
                *layer_cases[1][1:2],
                *layer_cases[1][4:6],  # (the head dim: the saved q's)
                *layer_cases[1][7:9],
                [True, False, True, True, True, True, False, True, True, True, False, False, False],
                [],
            ),
        ),
        (
            ops.attention_layer_backward,
            (
                torch.randn(7, 1, 16),
                layer_cases[2][0],
                gated_saved,
                *layer_cases[2][1:2],
                *layer_cases[2][4:6],
                *layer_cases[2][7:9],
                [
                    True,
                    True,
                    False,
                    True,
                    True,
                    False,
                    False,
                    False,
                    True,
                    False,
                    False,
                    True,
                    True,
                ],
                layer_cases[2][9],
            ),
        ),
    ]
