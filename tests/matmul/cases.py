"""The matmul family's cases: its compile-gate cases (`GATE_CASES`: every tuning config
of the GEMM and of the fused TP schedule's kernels; tests/test_compile_gate.py builds them)
and their scenarios."""

import torch
from fusedpar.kernels import (
    matmul,
    matmul_fused,
    matmul_gated,
)

from tests.support.gate import Cases, _empty, _fp32_precision, _smallest, _tma

GATE_CASES = Cases()
add, add_configs = GATE_CASES.add, GATE_CASES.add_configs

# --- compile-gate scenarios: the launchers called as the library calls them (see
# tests/support/gate.py) ---


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
        biases = [_empty((w.shape[1],), dtype) for w in ws]
        signals = matmul_fused.Signals(flags, 3, W)
        matmul_fused.gathered_matmuls(gathered, ws, biases, signals, programs=132)
        x, w = _empty((W * m, 512), dtype), _empty((N, 512), dtype)
        counts = matmul_fused.Signals(torch.zeros(W, dtype=torch.int32), 3, W)
        matmul_fused.partial_matmuls([(x, w.T)], counts, programs=131)
    matmul_fused.sum_partials(
        _empty((m, N), "float32"),
        _empty((W, m, N), "float32"),
        flags,
        3,
        getattr(torch, dtype),
        _empty((N,), dtype),
    )
    matmul_fused.wait_count(torch.zeros(W, dtype=torch.int32), 4, 16, 3)


# --- compile-gate cases ---

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
