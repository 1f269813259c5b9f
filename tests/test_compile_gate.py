"""The compile and resource gate: every tuning config of every Triton kernel, built for
sm_90 (and sm_80 where a config must serve an A100) with no GPU present.

Each case records a launcher's real call on CPU tensors (see
`fusedpar.testing.compile_gate`), swaps in one tuning config and compiles it. A case
fails when

- it does not compile (what the interpreter forgives);
- its shared memory (static + dynamic) is over the device's: such a config is dead
  weight on every GPU run, so the config function prunes it by head dim and dtype;
- it spills in fp16/bf16 at head dim <= 128, or in any 16-bit GEMM: a silent slowdown;
- it is the largest tile of a matrix kernel and its sm_90 PTX does not use wgmma;
- it is the smallest config of a key built for sm_80 and does not fit an A100: the
  launchers' pruning always keeps that config, so every key has a candidate there (the
  tuner skips the larger ones that do not fit).

Everything else (registers, spills at D=256 and in fp32) is reported in
docs/generated/resources.md;
``FUSEDPAR_WRITE_RESOURCES=1 pytest tests/test_compile_gate.py`` rewrites it.
Combinations left out, and why (each checked on a sample):

- fp16 GEMMs are built for every tile (conversions move their registers by a few);
  fp16 attention builds exactly as bf16 does, so only its largest tiles are built, and
  `test_fp16_matches_bf16` keeps checking both claims.
- Attention is built causal with a GQA group of 2, the heaviest specialisation measured
  (non-causal or MHA spill less: 128x128 forward, 0 B instead of 120 B; 64x64 dK/dV,
  16-128 B instead of 336 B), and in bf16 at D <= 128 with dK/dV's GQA split (every
  tile) and in the ring's modes (the largest tile: a forward step merging into fp32
  partials, gradients added into fp32 buffers; MHA and not causal, they use fewer
  registers than the causal GQA builds, e.g. 222 against 246 for the D=128 forward).
- On sm_80 only D=256 is built: shared memory grows with the head dim.
- fp32 attention is built at full precision (PyTorch's default, FMA dots: the slow and
  spilling builds) and, at D=256 only, in TF32 (the larger shared memory).
- The MoE kernels' expert flags (biases, the clamped SwiGLU) are built, every tile, in
  the two combinations a model uses: neither (the default) and both (gpt-oss), in the
  modes they change; the gate/up's mixed two (bias with silu, clamp without bias, each
  a part of gpt-oss's epilogue) at its largest tile only.
"""

import contextlib
import math
import os
from pathlib import Path

import pytest
import torch
from fusedpar.kernels import (
    _common,
    gated,
    matmul,
    matmul_fused,
    matmul_gated,
    moe,
    moe_permute,
    moe_route,
    moe_weight_grad,
    rms_norm,
    rope,
)
from fusedpar.kernels.attention import backward as attn_bwd
from fusedpar.kernels.attention import backward_fused as attn_bwd_fused
from fusedpar.kernels.attention import forward as attn
from fusedpar.kernels.attention import merge as attn_merge
from fusedpar.kernels.attention import plan as attn_plan

from fusedpar.testing import compile_gate as gate

RESOURCES_DOC = Path(__file__).resolve().parent.parent / "docs" / "generated" / "resources.md"
# The gate's cache: each build's results under its key (`compile_gate.build_key`).
RESOURCES_CACHE = RESOURCES_DOC.with_suffix(".json")

# --- scenarios: the launchers called as the library calls them -------------------------
# They run in the gate's worker processes, on CPU tensors whose contents do not matter
# (nothing is launched), with shapes that give the specialisation of a real run: sizes
# divisible by 16, contiguous (unit inner strides), B and Hkv > 1.


def _empty(shape, dtype):
    return torch.empty(shape, dtype=getattr(torch, dtype))


@contextlib.contextmanager
def _fp32_precision(precision):
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def _mask(causal, window, softcap, intervals):
    """The mask arguments: the scalar mode (causal, window), or with `intervals` the
    tensor mode the ring and packed documents use (int32, one row for every batch);
    "ordered": packed documents' with the forward's query order (`query_order`)."""
    if not intervals:
        return {"causal": causal, "window": window, "softcap": softcap}
    lo, hi = (torch.empty((1, 256), dtype=torch.int32) for _ in range(2))
    order = torch.empty(2, dtype=torch.int32) if intervals == "ordered" else None
    return {"intervals": attn.Intervals(lo, hi, lo, hi, q_order=order), "softcap": softcap}


@contextlib.contextmanager
def _tma(allowed):
    """With `allowed` False, the launchers find no input TMA can read: the kernels'
    pointer path, as an A100 (or tiles TMA cannot address) gets it, on aligned tensors."""
    saved = _common.tma_compatible
    if not allowed:
        _common.tma_compatible = lambda *tensors: False
    try:
        yield
    finally:
        _common.tma_compatible = saved


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
            q, k, v, merge=merge, **_mask(causal, window, softcap, intervals), **buffers
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
    grads = {}
    if accumulate:
        grads = {name: _empty(t.shape, "float32") for name, t in (("dq", q), ("dk", k), ("dv", v))}
    saved = attn_bwd.SPLIT_BELOW_PROGRAMS
    # 8 programs (2 KV blocks x B x Hkv) under 16: two slices per group
    attn_bwd.SPLIT_BELOW_PROGRAMS = 16 if split else saved
    try:
        with _fp32_precision(precision), _tma(tma):
            mask = _mask(causal, window, softcap, intervals)
            delta = {"delta": attn_merge.attention_delta(out, dout)} if accumulate else {}
            attn_bwd_fused.attention_backward(
                dout,
                q,
                k,
                v,
                lse,
                out=out,
                accumulate=accumulate,
                deterministic=not fused,
                **mask,
                **grads,
                **delta,
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


def matmul_call(
    dtype,
    accumulate=False,
    precision="highest",
    huge_stride=False,
    tma=True,
    rope=0,
    gated="",
    gated_grad="",
    gated_up="",
):
    """``x @ w.T + bias`` (a linear layer's forward), or with ``accumulate`` an fp32 C added
    into without bias (reduce-scatter partials, weight gradients). ``huge_stride``: rows
    of A 2**31 elements apart, so the strides are passed as i64 (4 GiB of address space
    is reserved, never touched). ``rope``: heads of that size rotated in the epilogue (a
    q or k projection, rows in (S, B) order with B = 2). ``gated``: a dense gated MLP's
    gate and up projections with this activation (`gated_matmul`); ``gated_up``: its up
    projection ending in the product, the gate read (`gated_up_matmul`); ``gated_grad``:
    its hidden gradient, dh's GEMM (the down weight read as stored) ending in dgate, dup
    and h (`gated_grad_matmul`)."""
    M, N, K = 256, 512, 256
    if huge_stride:
        M = 2
        a = _empty((2**31 + K,), dtype).as_strided((M, K), (2**31, 1))
    else:
        a = _empty((M, K), dtype)
    w = _empty((N, K), dtype)
    with _fp32_precision(precision), _tma(tma):
        if accumulate:
            matmul.matmul(a, w.T, out=_empty((M, N), "float32"), accumulate=True)
        elif gated_up:
            matmul_gated.gated_up_matmul(
                a, w.T, _empty((M, N), dtype), bias=_empty((N,), dtype), activation=gated_up
            )
        elif gated_grad:
            gate, up = _empty((M, N), dtype), _empty((M, N), dtype)
            matmul_gated.gated_grad_matmul(
                a, _empty((K, N), dtype), gate, up, activation=gated_grad, hidden=True
            )
        elif gated:
            matmul_gated.gated_matmul(
                a,
                w.T,
                _empty((N, K), dtype).T,
                bias=_empty((N,), dtype),
                bias2=_empty((N,), dtype),
                activation=gated,
            )
        elif rope:
            cos, sin = (_empty((M // 2, rope // 2), "float32") for _ in range(2))
            matmul.matmul(
                a,
                w.T,
                bias=_empty((N,), dtype),
                rope=matmul.RowRotation(cos, sin, rows_per_position=2),
            )
        else:
            matmul.matmul(a, w.T, bias=_empty((N,), dtype))


def fused_calls(dtype, weights=3, tma=True):
    """The fused schedule's kernels as `fusedpar.ops.linear_fused` calls them at TP 8 (the
    widths of Llama-3 8B's QKV a rank, K cut to 1024; the output projection's partials):
    the gather GEMM of `weights` weights with biases, the reduce-scatter's partials, their
    sum and a copy stream's count wait."""
    W, m, K, N = 8, 256, 1024, 1024
    flags = torch.ones(W, dtype=torch.int32)
    gathered = _empty((W * m, K), dtype)
    ws = [_empty((n, K), dtype).T for n in (512, 128, 128)[:weights]]
    with _tma(tma):
        matmul_fused.gathered_matmuls(
            gathered, ws, [_empty((w.shape[1],), dtype) for w in ws], flags, 3, W, programs=132
        )
        x, w = _empty((W * m, 512), dtype), _empty((N, 512), dtype)
        matmul_fused.partial_matmuls(
            [(x, w.T)], torch.zeros(W, dtype=torch.int32), 3, W, programs=131
        )
    matmul_fused.sum_partials(
        _empty((m, N), "float32"),
        _empty((W, m, N), "float32"),
        flags,
        3,
        getattr(torch, dtype),
        _empty((N,), dtype),
    )
    matmul_fused.wait_count(torch.zeros(W, dtype=torch.int32), 4, 16, 3)


def moe_calls(dtype, bias=False, activation="silu"):
    """The MoE kernels as the layer uses them (Qwen3-30B-A3B's widths: d 2048, h 768),
    each mode of the grouped GEMM once: the gathered gate/up with the SwiGLU epilogue, a
    plain gathered GEMM, the down projection, the SwiGLU's backward, the input gradient
    over both halves, the weight gradients (split over gate/up, and plain), permute,
    combine and the combine's weight gradient. `bias`: the experts' biases (in the
    gate/up and down projections' epilogues, and their gradients from the weight
    gradients' launches); `activation`: the SwiGLU's (gpt-oss: ``"clamped_swiglu"``)."""
    T, top_k, E, d, h = 256, 2, 8, 2048, 768
    ids = torch.arange(T * top_k).reshape(T, top_k) % E
    counts, order, pos = moe_permute.dispatch_metadata(ids, E)
    rows, P = order // top_k, T * top_k
    x = _empty((T, d), dtype)
    w1, w3, w2 = _empty((E, h, d), dtype), _empty((E, h, d), dtype), _empty((E, d, h), dtype)
    b13 = (_empty((E, h), dtype), _empty((E, h), dtype)) if bias else None
    b2 = _empty((E, d), dtype) if bias else None
    a, h13 = moe.grouped_swiglu(x, w1, w3, counts, rows, bias=b13, activation=activation)
    moe.grouped_matmul(x, w1, counts, rows)
    y = moe.grouped_matmul(a, w2, counts, bias=b2)
    d_h13, a = moe.grouped_swiglu_backward(y, w2, h13, counts, activation=activation)
    moe.grouped_swiglu_input_grad(d_h13, w1, w3, counts)
    moe_weight_grad.grouped_weight_grad(d_h13, x, counts, rows, split=True, bias_grad=bias)
    moe_weight_grad.grouped_weight_grad(y, a, counts, bias_grad=bias)
    moe_permute.gather_rows(x, rows, _empty((P,), "float32"))
    moe_permute.combine(y, pos, _empty((T, top_k), "float32"))
    moe_permute.combine_weight_grad(_empty((T, d), dtype), y, pos)


def route_calls(experts, top_k, score, groups=(1, 1)):
    """The MoE router's top-k of 4096 tokens, forward and backward (both gradients);
    `groups`: group-limited (DeepSeek-V3's 4 of 8)."""
    logits = _empty((4096, experts), "float32")
    bias = _empty((experts,), "float32") if score == "sigmoid" else None
    weights, ids, probs = moe_route.route_top_k(logits, top_k, score, True, bias, tuple(groups))
    moe_route.route_top_k_backward(weights, probs, probs, ids, score, True)


def rms_norm_calls(dtype, dim, rotary=0):
    """RMSNorm's forward and backward over 256 rows of `dim` features; with `rotary`, a
    q/k head norm whose kernel turns that many dims by RoPE (32 positions of 8 heads)."""
    x, weight = _empty((256, dim), dtype), _empty((dim,), dtype)
    rope = None
    if rotary:
        x = x.view(32, 8, dim)
        rope = tuple(_empty((32, rotary // 2), "float32") for _ in range(2))
    _, rstd = rms_norm.rms_norm(x, weight, rope=rope)
    rms_norm.rms_norm_backward(_empty(x.shape, dtype), x, weight, rstd, eps=1e-5, rope=rope)


def gated_calls(dtype, activation):
    """The dense MLP's gated activation, forward and backward, over 256 rows of a
    14336-wide hidden layer (Llama 8B's)."""
    gate, up = _empty((256, 14336), dtype), _empty((256, 14336), dtype)
    gated.gated(gate, up, activation)
    gated.gated_backward(_empty((256, 14336), dtype), gate, up, activation)
    gated.gated_backward(
        _empty((256, 14336), dtype), gate, up, activation, hidden=True, stacked=True
    )


def rope_calls(dtype, rotary, pair=False):
    """Rotary embeddings of q at Llama 8B's shapes (32 heads of 128, 512 positions) as a
    strided view of a fused QKV projection, forward and backward; `rotary` dims rotate;
    `pair`: q and k (its 8 KV heads) in one launch each way."""
    qkv = _empty((1, 512, 48, 128), dtype)
    q, k = qkv[:, :, :32], qkv[:, :, 32:40]
    cos, sin = _empty((512, rotary // 2), "float32"), _empty((512, rotary // 2), "float32")
    for inverse in (False, True):
        if pair:
            rope.rope_pair(q, k, cos, sin, inverse=inverse)
        else:
            rope.rope(q, cos, sin, inverse=inverse)


# --- cases --------------------------------------------------------------------------------

CASES: dict[str, dict] = {}
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
MOE_PLAIN = {"HAS_ROWS": False, "GATE_UP": False, "SWIGLU_GRAD": False, "SECOND_K": False}
GPT_OSS = {"bias": True, "activation": "clamped_swiglu"}  # moe_calls' gpt-oss experts
MOE_GEMM_MODES = {  # variant: (kernel, flags that pick its launch, config list, scenario)
    "gather-swiglu": (
        "_grouped_matmul_kernel",
        {"GATE_UP": True},
        moe.grouped_matmul_configs("gate_up"),
        {},
    ),
    "gather": (
        "_grouped_matmul_kernel",
        {"HAS_ROWS": True, "GATE_UP": False},
        moe.grouped_matmul_configs(),
        {},
    ),
    "plain": ("_grouped_matmul_kernel", MOE_PLAIN, moe.grouped_matmul_configs(), {}),
    "swiglu-backward": (
        "_grouped_matmul_kernel",
        {"SWIGLU_GRAD": True},
        moe.grouped_matmul_configs("swiglu_grad"),
        {},
    ),
    "input-grad": ("_grouped_matmul_kernel", {"SECOND_K": True}, moe.grouped_matmul_configs(), {}),
    "weight-grad-split": (
        "_grouped_weight_grad_kernel",
        {"SPLIT": True},
        moe_weight_grad.weight_grad_configs(),
        {},
    ),
    "weight-grad": (
        "_grouped_weight_grad_kernel",
        {"SPLIT": False},
        moe_weight_grad.weight_grad_configs(),
        {},
    ),
    # gpt-oss's experts: the modes its flags change (the gathered GEMM and the input
    # gradient take neither), every tile
    "gather-swiglu-bias-clamped": (
        "_grouped_matmul_kernel",
        {"GATE_UP": True},
        moe.grouped_matmul_configs("gate_up"),
        GPT_OSS,
    ),
    "plain-bias": ("_grouped_matmul_kernel", MOE_PLAIN, moe.grouped_matmul_configs(), GPT_OSS),
    "swiglu-backward-clamped": (
        "_grouped_matmul_kernel",
        {"SWIGLU_GRAD": True},
        moe.grouped_matmul_configs("swiglu_grad"),
        GPT_OSS,
    ),
    "weight-grad-split-bias": (
        "_grouped_weight_grad_kernel",
        {"SPLIT": True},
        moe_weight_grad.weight_grad_configs(),
        GPT_OSS,
    ),
    "weight-grad-bias": (
        "_grouped_weight_grad_kernel",
        {"SPLIT": False},
        moe_weight_grad.weight_grad_configs(),
        GPT_OSS,
    ),
}
# The gate/up's other two flag combinations (a bias with silu, the clamp without bias):
# each a part of the gpt-oss build's epilogue, built at the largest tile only.
MOE_GATE_UP_MIXED = {
    "gather-swiglu-bias": {"bias": True},
    "gather-swiglu-clamped": {"activation": "clamped_swiglu"},
}
MOE_ROW_KERNELS = ("_gather_rows_kernel", "_combine_kernel", "_combine_weight_grad_kernel")


BLOCKS = ("BLOCK_M", "BLOCK_N", "BLOCK_K")
# Kernels that read tiles through TMA descriptors where the launcher finds them usable
# (`_common.tma_compatible`): always on the gate's aligned CPU tensors, never on an A100.
TMA_KERNELS = {
    "_attn_fwd_kernel": ("TMA", "OUT_TMA"),
    "_attn_bwd_dq_kernel": ("TMA",),
    "_attn_bwd_dkdv_kernel": ("TMA", "OUT_TMA", "DQ_TMA"),
    "_matmul_kernel": ("TMA", "A_T", "B_T", "C_TMA"),
}


def _tile(config) -> str:
    if config is None:
        return "fixed"
    sizes = "x".join(str(config.kwargs[k]) for k in BLOCKS if k in config.kwargs)
    return f"{sizes} s{config.num_stages} w{config.num_warps}"


def add(
    family,
    variant,
    scenario,
    params,
    kernel,
    cap,
    config=None,
    *,
    no_spill,
    wgmma=False,
    match=None,
    loop_axis=None,
    loop_spill_only=False,
):
    """One case. `family`/`variant` group the report's rows; `no_spill` and `wgmma` say
    which rules apply beyond compiling within the shared-memory limit (every 16-bit
    sm_90 build also must not serialize its wgmma: ``no_serial``); `match` picks, among
    the scenario's launches of `kernel`, the first whose keyword arguments (constexpr
    flags) have these values; `loop_axis`: the config's block the hot loop advances by
    (the report gives instructions per 128 rows of it); ``loop_spill_only``: `no_spill`
    (and no_serial's spill check) hold for the hot loop only, the rest is reported."""
    tile = _tile(config)
    config = None if config is None else gate.config_kwargs(config)
    if cap == 80 and kernel in TMA_KERNELS:  # an A100 has no TMA: the launcher says so
        config = {**config, **dict.fromkeys(TMA_KERNELS[kernel], False)}
    sixteen_bit = params.get("dtype") in ("bfloat16", "float16")
    name = f"{family}-{variant}-{tile.replace(' ', '-')}-sm{cap}"
    assert name not in CASES, name
    CASES[name] = {
        "name": name,
        "scenario": gate.scenario_name(scenario),
        "params": params,
        "kernel": kernel,
        "cap": cap,
        "config": config,
        "family": family,
        "variant": variant,
        "tile": tile,
        "no_spill": no_spill and not loop_spill_only,
        "no_loop_spill": no_spill and loop_spill_only,
        "no_serial": sixteen_bit and cap == 90,
        "wgmma": wgmma,
        "match": match,
        "loop_step": config.get(loop_axis) if config and loop_axis else None,
    }


def _smallest(configs):
    """The config with the smallest tile: the one the launchers' pruning always keeps."""
    return min(configs, key=lambda c: math.prod(c.kwargs.get(k, 1) for k in BLOCKS))


def add_configs(
    family,
    variant,
    scenario,
    params,
    kernel,
    configs,
    *,
    no_spill,
    wgmma,
    match=None,
    loop_axis="BLOCK_K",
    loop_spill_only=False,
):
    """Every config for sm_90 (`wgmma`: the first, the largest, must use it)."""
    for i, config in enumerate(configs):
        add(
            family,
            variant,
            scenario,
            params,
            kernel,
            90,
            config,
            no_spill=no_spill,
            wgmma=wgmma and i == 0,
            match=match,
            loop_axis=loop_axis,
            loop_spill_only=loop_spill_only,
        )


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
    # Each with the tile modes its launches have (`plan.kernel_modes`).
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

MATMUL_VARIANTS = {  # variant: scenario params
    "bfloat16-bias": {"dtype": "bfloat16"},
    "float16-bias": {"dtype": "float16"},
    "bfloat16-accumulate-fp32": {"dtype": "bfloat16", "accumulate": True},
    "float16-accumulate-fp32": {"dtype": "float16", "accumulate": True},
    "ieee-bias": {"dtype": "float32"},
    "tf32-bias": {"dtype": "float32", "precision": "high"},
    # on Hopper, operands TMA cannot read (and an A100's path)
    "bfloat16-bias-pointer": {"dtype": "bfloat16", "tma": False},
    "bfloat16-accumulate-fp32-pointer": {"dtype": "bfloat16", "accumulate": True, "tma": False},
    # a q/k projection with its rotary embedding in the epilogue (Llama's heads of 128)
    "bfloat16-rope128": {"dtype": "bfloat16", "rope": 128},
    "bfloat16-rope64": {"dtype": "bfloat16", "rope": 64},
    "bfloat16-rope128-pointer": {"dtype": "bfloat16", "rope": 128, "tma": False},
    "tf32-rope64": {"dtype": "float32", "precision": "high", "rope": 64},
    # a dense gated MLP's gate and up GEMMs in one, act(gate) * up in the epilogue (read
    # through pointers: from TMA, ptxas serialized the two accumulators' wgmma)
    "bfloat16-gated-silu": {"dtype": "bfloat16", "gated": "silu"},
    "bfloat16-gated-gelu_tanh": {"dtype": "bfloat16", "gated": "gelu_tanh"},
    "tf32-gated-silu": {"dtype": "float32", "precision": "high", "gated": "silu"},
    # its up GEMM ending in act(gate) * up, the gate read (the K loop is matmul's)
    "bfloat16-gated-up-silu": {"dtype": "bfloat16", "gated_up": "silu"},
    "bfloat16-gated-up-gelu_tanh": {"dtype": "bfloat16", "gated_up": "gelu_tanh"},
    "bfloat16-gated-up-silu-pointer": {"dtype": "bfloat16", "gated_up": "silu", "tma": False},
    "tf32-gated-up-silu": {"dtype": "float32", "precision": "high", "gated_up": "silu"},
    # its hidden gradient: dh's GEMM ending in dgate, dup and h (the K loop is matmul's)
    "bfloat16-gated-grad-silu": {"dtype": "bfloat16", "gated_grad": "silu"},
    "bfloat16-gated-grad-gelu_tanh": {"dtype": "bfloat16", "gated_grad": "gelu_tanh"},
    "bfloat16-gated-grad-silu-pointer": {"dtype": "bfloat16", "gated_grad": "silu", "tma": False},
    "tf32-gated-grad-silu": {"dtype": "float32", "precision": "high", "gated_grad": "silu"},
}
for variant, params in MATMUL_VARIANTS.items():
    dtype = getattr(torch, params["dtype"])
    mode = (
        "forward"
        if params.get("gated")
        else "product"
        if params.get("gated_up")
        else "backward"
        if params.get("gated_grad")
        else ""
    )
    configs = matmul.matmul_configs(
        dtype, params.get("accumulate", False), params.get("rope", 0), mode, params.get("tma", True)
    )
    add_configs(
        "matmul",
        variant,
        matmul_call,
        params,
        "_matmul_kernel",
        configs,
        no_spill=dtype != torch.float32,
        wgmma=variant != "ieee-bias",
    )
    if variant.startswith(("bfloat16", "tf32")):
        add(
            "matmul",
            f"{variant}-smallest",
            matmul_call,
            params,
            "_matmul_kernel",
            80,
            _smallest(configs),
            no_spill=False,
        )
add(
    "matmul",
    "bfloat16-i64-strides",
    matmul_call,
    {"dtype": "bfloat16", "huge_stride": True, "tma": False},
    "_matmul_kernel",
    90,
    matmul.matmul_configs(torch.bfloat16, False)[0],
    no_spill=True,
)

# The fused TP schedule: its persistent GEMM gathering (QKV: three weights a launch, every
# tile; one weight and the pointer path, the largest) and producing reduce-scatter
# partials (every tile), built for sm_90 only (symmetric memory's copy engine and TMA);
# its sum and count-wait kernels at their fixed tiles. `test_fused_k_loop_is_the_plain_gemms`
# holds their K loops to matmul's.
SOFTCAP_LOOP_RATIO = 1.3  # issue #42's bound
FUSED_K_LOOP_EXCESS = 0.05  # instructions a K step may take over matmul's
FUSED_VARIANTS = {  # variant: (scenario params, match, every tile)
    "gather-qkv-bfloat16": ({"dtype": "bfloat16"}, {"GATHER": True}, True),
    "gather-one-bfloat16": ({"dtype": "bfloat16", "weights": 1}, {"GATHER": True}, False),
    "gather-qkv-bfloat16-pointer": ({"dtype": "bfloat16", "tma": False}, {"GATHER": True}, False),
    "scatter-bfloat16": ({"dtype": "bfloat16"}, {"GATHER": False}, True),
}
for variant, (params, match, every) in FUSED_VARIANTS.items():
    configs = matmul_fused.fused_configs(torch.bfloat16, 256, 1024)
    add_configs(
        "matmul-fused",
        variant,
        fused_calls,
        params,
        "_fused_matmul_kernel",
        configs if every else configs[:1],
        no_spill=True,
        wgmma=True,
        match=match,
    )
for kernel in ("_sum_partials_kernel", "_wait_count_kernel"):
    add(
        "matmul-fused",
        kernel.strip("_").removesuffix("_kernel"),
        fused_calls,
        {"dtype": "bfloat16"},
        kernel,
        90,
        no_spill=True,
    )

# MoE: the grouped GEMM kernels run in several modes (constexpr flags) in one scenario,
# each picked with `match`; the permute/combine kernels take their launcher's fixed tile
# (no config: the recorded one is built).
for variant, (kernel, match, configs, scenario) in MOE_GEMM_MODES.items():
    family = "moe-" + kernel.strip("_").removesuffix("_kernel")
    params = {"dtype": "bfloat16", **scenario}
    add_configs(
        family,
        f"{variant}-bfloat16",
        moe_calls,
        params,
        kernel,
        configs,
        no_spill=True,
        wgmma=True,
        match=match,
        loop_axis="BLOCK_M" if "weight_grad" in kernel else "BLOCK_K",
    )
    add(
        family,
        f"{variant}-bfloat16-smallest",
        moe_calls,
        params,
        kernel,
        80,
        _smallest(configs),
        no_spill=False,
        match=match,
    )
for variant, scenario in MOE_GATE_UP_MIXED.items():
    add(
        "moe-grouped_matmul",
        f"{variant}-bfloat16",
        moe_calls,
        {"dtype": "bfloat16", **scenario},
        "_grouped_matmul_kernel",
        90,
        moe.grouped_matmul_configs("gate_up")[0],
        no_spill=True,
        wgmma=True,
        match={"GATE_UP": True},
        loop_axis="BLOCK_K",
    )
for cap in (90, 80):
    for kernel in MOE_ROW_KERNELS:
        add(
            "moe-" + kernel.strip("_").removesuffix("_kernel"),
            "bfloat16",
            moe_calls,
            {"dtype": "bfloat16"},
            kernel,
            cap,
            no_spill=cap == 90,
        )

# The MoE routing: its launcher's fixed tile (whole rows), at Qwen3-MoE's 128 experts
# (no spill allowed, and on an A100) and DeepSeek-V3's 256 (sigmoid, the selection's
# bias), and reported at the most a program holds.
for kernel in ("_route_fwd_kernel", "_route_bwd_kernel"):
    family = "moe-route-" + ("forward" if "fwd" in kernel else "backward")
    for experts, score, cap in (
        (128, "softmax", 90),
        (128, "softmax", 80),
        (256, "sigmoid", 90),
        (1024, "softmax", 90),
    ):
        add(
            family,
            f"E{experts}-k8-{score}",
            route_calls,
            {"experts": experts, "top_k": 8, "score": score},
            kernel,
            cap,
            no_spill=experts <= 256,
        )
# DeepSeek-V3's router whole: 4 of 8 groups (the forward's group scores and masks)
add(
    "moe-route-forward",
    "E256-k8-sigmoid-groups8-4",
    route_calls,
    {"experts": 256, "top_k": 8, "score": "sigmoid", "groups": [8, 4]},
    "_route_fwd_kernel",
    90,
    no_spill=True,
    match={"N_GROUP": 8},
)

# RMSNorm: its launcher's fixed tile (whole rows), at Llama 8B's width in 16-bit (no spill
# allowed, and on an A100), and reported at 70B's width and in fp32; as a q/k head norm
# turning its output by RoPE, no spill allowed.
RMS_NORM_KERNELS = ("_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel")
for kernel in RMS_NORM_KERNELS:
    family = "rms_norm-" + kernel.strip("_").removesuffix("_kernel").removeprefix("rms_norm_")
    for cap in (90, 80):
        add(
            family,
            "bfloat16-d4096",
            rms_norm_calls,
            {"dtype": "bfloat16", "dim": 4096},
            kernel,
            cap,
            no_spill=True,
        )
    for dtype, dim in (("bfloat16", 8192), ("float32", 4096)):
        add(
            family,
            f"{dtype}-d{dim}",
            rms_norm_calls,
            {"dtype": dtype, "dim": dim},
            kernel,
            90,
            no_spill=False,
        )
    # a q/k head norm joined by RoPE: heads of 128, all turned (and on an A100) or half
    for rotary, cap in ((128, 90), (128, 80), (64, 90)):
        add(
            family,
            f"bfloat16-d128-rope{rotary}",
            rms_norm_calls,
            {"dtype": "bfloat16", "dim": 128, "rotary": rotary},
            kernel,
            cap,
            no_spill=True,
        )


# The gated activation: its launcher's fixed tile, each activation and mode (forward;
# backward; backward writing h again, the one-rank MLP's), in 16-bit (no spill, and on an
# A100) and reported in fp32.
for activation in gated.ACTIVATIONS:
    for backward, store_h in ((False, True), (True, False), (True, True)):
        family = "gated-" + ("backward" if backward else "forward") + ("-h" * backward * store_h)
        match = {"ACTIVATION": activation, "BACKWARD": backward, "STORE_H": store_h}
        for dtype, cap in (("bfloat16", 90), ("bfloat16", 80), ("float32", 90)):
            add(
                family,
                f"{activation}-{dtype}",
                gated_calls,
                {"dtype": dtype, "activation": activation},
                "_gated_kernel",
                cap,
                no_spill=dtype == "bfloat16",
                match=match,
            )


# RoPE: its launcher's fixed tile, each direction, whole and partial (GPT-NeoX's quarter)
# rotary, in 16-bit (no spill, and on an A100) and reported in fp32.
for inverse in (False, True):
    family = "rope-" + ("backward" if inverse else "forward")
    for rotary, dtype, cap in (
        (128, "bfloat16", 90),
        (128, "bfloat16", 80),
        (32, "bfloat16", 90),
        (128, "float32", 90),
    ):
        add(
            family,
            f"r{rotary}-{dtype}",
            rope_calls,
            {"dtype": dtype, "rotary": rotary},
            "_rope_kernel",
            cap,
            no_spill=dtype == "bfloat16",
            match={"INVERSE": inverse, "PAIR": False},
        )
    for cap in (90, 80):  # q and k in one launch, as ParallelAttention rotates them
        add(
            family,
            "pair-r128-bfloat16",
            rope_calls,
            {"dtype": "bfloat16", "rotary": 128, "pair": True},
            "_rope_kernel",
            cap,
            no_spill=True,
            match={"INVERSE": inverse, "PAIR": True},
        )


# --- tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built():
    """Every case's result: from the cache where its build is unchanged, else built."""
    cases = list(CASES.values())
    results = gate.run_cases(cases, cache=gate.load_cache(RESOURCES_CACHE))
    return {c["name"]: r for c, r in zip(cases, results, strict=True)}


@pytest.mark.parametrize("name", list(CASES))
def test_config_fits(built, name):
    case, result = CASES[name], built[name]
    assert result["ok"], result["error"]
    limit = gate.SHARED_LIMIT[case["cap"]]
    assert result["shared"] <= limit, (
        f"{result['shared']} B of shared memory, over sm_{case['cap']}'s {limit} B: prune this "
        f"tile in the config function (it is dead weight on every GPU run)"
    )
    if case["no_spill"]:
        assert result["spill"] == 0, f"spills {result['spill']} B ({result['regs']} registers)"
    loop = result["loop"] or {}
    if case.get("no_loop_spill"):
        assert loop.get("local", 0) == 0, f"{loop['local']} local accesses in the hot loop"
    if case["wgmma"]:
        assert result["wgmma"], "the sm_90 PTX should use wgmma (Hopper's warpgroup MMA)"
    if case["no_serial"] and result["wgmma"]:
        assert not result["serialized"], (
            f"ptxas serialized the wgmma ({', '.join(result['notes'])}): a wait after every "
            f"HGMMA, {result['loop'] and result['loop']['wgmma_waits']} per iteration of the "
            "hot loop"
        )
        if not case.get("no_loop_spill"):
            assert result["spill"] == 0, f"a tensor-core build spills {result['spill']} B"


def _twin(name):
    case = CASES[name]
    variant = case["variant"].replace("float16", "bfloat16", 1)
    same = ("family", "tile", "cap")
    return next(
        n
        for n, c in CASES.items()
        if c["variant"] == variant and all(c[k] == case[k] for k in same)
    )


@pytest.mark.parametrize(
    "name", [n for n, c in CASES.items() if c["variant"].startswith("float16")]
)
def test_fp16_matches_bf16(built, name):
    """Why fp16 is built for only some tiles. Attention: fp16 builds exactly as bf16
    (registers, spills, shared memory: all 27 tiles at D <= 128 on triton 3.6 and 3.9),
    so its largest tile stands for the rest. GEMMs: the bias and output conversions move
    registers by a few (a 128x256 tile with bias: 181 in fp16, 170 in bf16 on triton
    3.6), so every tile is built in both; shared memory is always bf16's, which is why
    fp16 is not built at D=256 (where only shared memory is checked)."""
    usage = ("shared",) if CASES[name]["family"] == "matmul" else ("regs", "spill", "shared")
    assert {k: built[name][k] for k in usage} == {k: built[_twin(name)][k] for k in usage}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("label", ATTENTION)
def test_pruning_keeps_the_smallest_attention_tile(label, dtype):
    """The sm_80 cases build the smallest tile of each list: every sequence length's
    candidates must include it, so an A100 always has a config that fits."""
    for D in HEAD_DIMS:
        configs = ATTENTION[label][2](D, dtype, frozenset({"pointer"}))
        for n in (1, 16, 32, 64, 128, 1024):
            assert _smallest(configs) in attn_plan.prune_configs(configs, n, n)


def test_pruning_keeps_the_smallest_matmul_tile():
    for dtype in (torch.bfloat16, torch.float32):
        for accumulate in (False, True):
            configs = matmul.matmul_configs(dtype, accumulate)
            for m in (1, 16, 32, 256, 4096):
                assert _smallest(configs) in matmul._prune_configs(configs, m, m)


@pytest.mark.parametrize("variant", ["gather-qkv-bfloat16", "scatter-bfloat16"])
def test_fused_k_loop_is_the_plain_gemms(built, variant):
    """The fused GEMM's waits and counts stay out of its K loop: at every tile, the hot
    loop has matmul's HGMMA, wgmma waits and TMA loads, no local memory, and at most 5%
    more instructions. (triton 3.9 at 128x256: 77-83 against matmul's 105, the same 4
    HGMMA.64x256x16 and one wait: matmul's loop is flattened over tiles and carries
    their bookkeeping, ours is the K loop alone.)"""
    for name, case in CASES.items():
        if case["family"] != "matmul-fused" or case["variant"] != variant:
            continue
        plain = f"matmul-bfloat16-bias-{case['tile'].replace(' ', '-')}-sm90"
        ours, theirs = built[name]["loop"], built[plain]["loop"]
        assert ours["hgmma"] == theirs["hgmma"] and ours["wgmma_waits"] == theirs["wgmma_waits"]
        assert ours["loads"]["tma"] == theirs["loads"]["tma"] > 0 and ours["local"] == 0
        excess = ours["insts_min"] / theirs["insts_min"] - 1
        assert excess <= FUSED_K_LOOP_EXCESS, (name, ours["insts_min"], theirs["insts_min"])


def _macs_per_iteration(loop: dict, num_warps: int) -> int:
    """Multiply-adds one iteration of a hot loop issues: wgmma shapes (MxNxK) per
    warpgroup, mma.sync (16816: m16 n8 k16) per warp."""
    macs = 0
    for shape, count in loop["hgmma"].items():
        if shape == "16816":
            macs += 16 * 8 * 16 * count * num_warps
        else:
            m, n, k = map(int, shape.split("x"))
            macs += m * n * k * count * (num_warps // 4)
    return macs


def test_the_fused_backward_issues_five_gemms_per_block_pair(built):
    """Per (key block, query block) the fused backward's hot loop issues the tensor-core
    work of 5 GEMMs (S, dP, dV, dK, dQ), where the split backward's two kernels issue 7
    (dK/dV 4: S, dP, dV, dK; dQ 3: S, dP, dQ); at every 16-bit sm_90 wgmma tile, and with
    TMA reads dQ's share leaves through one TMA reduce-add per iteration. S, dK and dQ
    run over Q/K's head dim, dP and dV over V's, each padded to a power of two (MLA's 192:
    256). (Tiles without wgmma are left out: with 8 warps over 16 or 32 rows, warps
    repeat each other's mma.sync.)"""
    # (GEMMs over D, GEMMs over Dv)
    gemms = {"attention-fused": (3, 2), "attention-dkdv": (2, 2), "attention-dq": (2, 1)}
    checked = 0
    for name, case in CASES.items():
        if case["family"] not in gemms or not case["no_serial"] or not built[name]["wgmma"]:
            continue
        loop, config = built[name]["loop"], case["config"]
        D = _common.next_power_of_2(case["params"]["head_dim"])
        Dv = _common.next_power_of_2(case["params"].get("v_dim") or D)
        over_d, over_dv = gemms[case["family"]]
        macs = config["BLOCK_M"] * config["BLOCK_N"] * (over_d * D + over_dv * Dv)
        assert _macs_per_iteration(loop, config["num_warps"]) == macs, name
        if case["family"] == "attention-fused" and case["params"].get("tma", True):
            assert loop["tma_reduces"] == 1, name
        checked += 1
    assert checked > 60


def test_soft_capping_costs_at_most_a_third_more(built):
    """The soft-capped forward's hot loop (bf16: `tanh.approx.f32`, one MUFU.TANH and a
    multiply per score) stays within 1.3x of the plain forward's instructions per
    iteration at every tile both build. (triton 3.9, D=128 128x128: 1076 with the
    exact formula's exp2 and division, against 499 plain.)"""
    checked = 0
    for name, case in CASES.items():
        if case["family"] != "attention-fwd" or not case["variant"].startswith("window-softcap"):
            continue
        variant = case["variant"].removeprefix("window-softcap-")
        plain = next(
            (
                n
                for n, c in CASES.items()
                if c["family"] == "attention-fwd"
                and c["variant"] == variant
                and c["tile"] == case["tile"]
                and c["cap"] == case["cap"]
            ),
            None,
        )
        if plain is None:
            continue
        ratio = built[name]["loop"]["insts_min"] / built[plain]["loop"]["insts_min"]
        assert ratio <= SOFTCAP_LOOP_RATIO, (name, round(ratio, 2))
        checked += 1
    assert checked >= 4


def test_resource_table_is_current(built):
    """docs/generated/resources.md is the report of these results, and
    docs/generated/resources.json holds every build (so CI rebuilds nothing it need
    not). ``FUSEDPAR_WRITE_RESOURCES=1`` rewrites both (``=path``: writes the table there
    instead, e.g. to compare two triton versions)."""
    cases, results = list(CASES.values()), list(built.values())
    table = gate.resource_table(cases, results)
    target = os.environ.get("FUSEDPAR_WRITE_RESOURCES")
    if target == "1":
        RESOURCES_DOC.write_text(table)
        gate.save_cache(RESOURCES_CACHE, results)
    elif target:
        Path(target).write_text(table)
    stale = "stale: rerun with FUSEDPAR_WRITE_RESOURCES=1"
    rebuilt = sorted(r["name"] for r in results if not r["cached"] and target != "1")
    assert not rebuilt, f"docs/generated/resources.json is {stale} (built anew: {rebuilt[:5]})"
    assert RESOURCES_DOC.read_text() == table, f"docs/generated/resources.md is {stale}"
