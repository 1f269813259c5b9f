"""The compile gate: every Triton kernel compiles for sm_80 and sm_90 with no GPU present.

All cases compile in one subprocess without the interpreter (see
`fusedpar.testing.compile_gate`); each case is then its own test.
"""

import pytest

from fusedpar.testing.compile_gate import compile_in_subprocess

# Shared memory per block (opt-in maximum) on A100 and H100.
SHARED_LIMIT = {80: 166912, 90: 232448}


def _matmul_case(
    dtype, c_dtype, cap, bias, accumulate, tile, num_warps, num_stages, precision="tf32",
    index="i32",
):  # fmt: skip
    block_m, block_n, block_k = tile
    signature = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": f"*{c_dtype}",
                 "bias_ptr": f"*{c_dtype}"}  # fmt: skip
    signature.update({name: index for name in (
        "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn",
        "stride_bias", "M", "N", "K")})  # fmt: skip
    return {
        "kernel": "fusedpar.kernels.matmul:_matmul_kernel",
        "signature": signature,
        "constexprs": {
            "HAS_BIAS": bias,
            "ACCUMULATE": accumulate,
            "EVEN_K": False,
            "INPUT_PRECISION": precision,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_K": block_k,
            "GROUP_M": 8,
        },  # fmt: skip
        "cap": cap,
        "num_warps": num_warps,
        "num_stages": num_stages,
    }


CASES = {}
for cap in (80, 90):
    for dtype in ("fp16", "bf16"):
        # the largest tile of the autotune list, writing dtype with a bias ...
        CASES[f"matmul-{dtype}-bias-sm{cap}"] = _matmul_case(
            dtype, dtype, cap, True, False, (128, 256, 64), 8, 3
        )
        # ... and a mid tile accumulating into an fp32 C (reduce-scatter partials, dW)
        CASES[f"matmul-{dtype}-accumulate-fp32-sm{cap}"] = _matmul_case(
            dtype, "fp32", cap, False, True, (128, 128, 64), 4, 3
        )
    # strides past 2**31 (Triton passes them as i64), e.g. a huge weight read transposed
    CASES[f"matmul-bf16-i64-strides-sm{cap}"] = _matmul_case(
        "bf16", "bf16", cap, False, False, (128, 128, 64), 4, 3, index="i64"
    )
    for precision in ("ieee", "tf32"):  # torch's "highest" and "high" fp32 matmul precision
        CASES[f"matmul-fp32-{precision}-sm{cap}"] = _matmul_case(
            "fp32", "fp32", cap, True, False, (64, 64, 64), 4, 3, precision
        )


def _strides(*names, dims="bshd"):
    return {f"stride_{n}{d}": "i32" for n in names for d in dims}


def _attention_case(kernel, dtype, cap, head_dim, config):
    ptr = f"*{dtype}"
    fp32 = "*fp32"
    causal = {"CAUSAL": True, "INPUT_PRECISION": "tf32"}
    if kernel == "fwd":
        signature = {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "o_ptr": ptr, "lse_ptr": fp32,
                     **_strides("q", "k", "v", "o"), **_strides("l", dims="bhs"),
                     "Sq": "i32", "Skv": "i32", "GROUP": "i32", "qk_scale": "fp32"}  # fmt: skip
        extra = causal
    elif kernel == "delta":
        signature = {"o_ptr": ptr, "do_ptr": ptr, "delta_ptr": fp32, **_strides("o", "d"),
                     "Sq": "i32", "Hq": "i32"}  # fmt: skip
        extra = {}
    else:  # dkdv / dq write fp32 gradients, accumulating (the ring's use)
        outs = ("dk", "dv") if kernel == "dkdv" else ("dq",)
        signature = {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "do_ptr": ptr, "lse_ptr": fp32,
                     "delta_ptr": fp32, **{f"{o}_ptr": fp32 for o in outs},
                     **_strides("q", "k", "v", "do", *outs), **_strides("l", dims="bhs"),
                     "Sq": "i32", "Skv": "i32", "Hq": "i32", "GROUP": "i32",
                     "qk_scale": "fp32", "sm_scale": "fp32"}  # fmt: skip
        extra = {**causal, "ACCUMULATE": True}
    block_m, block_n, num_stages, num_warps = config
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "BLOCK_M": block_m, **extra}
    if kernel != "delta":
        constexprs["BLOCK_N"] = block_n
    name = {"fwd": "_attn_fwd_kernel", "delta": "_bwd_delta_kernel",
            "dkdv": "_attn_bwd_dkdv_kernel", "dq": "_attn_bwd_dq_kernel"}[kernel]  # fmt: skip
    module = "attention" if kernel == "fwd" else "attention_backward"
    return {"kernel": f"fusedpar.kernels.{module}:{name}", "signature": signature,
            "constexprs": constexprs, "cap": cap, "num_warps": num_warps,
            "num_stages": num_stages}  # fmt: skip


# The first (largest) tile of each autotune list.
ATTENTION_CONFIGS = {"fwd": (128, 128, 3, 8), "delta": (64, 0, 1, 4),
                     "dkdv": (64, 128, 3, 8), "dq": (64, 128, 3, 8)}  # fmt: skip
for cap in (80, 90):
    for dtype in ("fp16", "bf16"):
        for head_dim in (64, 128):
            for kernel, config in ATTENTION_CONFIGS.items():
                CASES[f"attention-{kernel}-{dtype}-d{head_dim}-sm{cap}"] = _attention_case(
                    kernel, dtype, cap, head_dim, config)  # fmt: skip

for cap in (80, 90):
    for head_dim in (64, 128):
        CASES[f"attention-merge-d{head_dim}-sm{cap}"] = {
            "kernel": "fusedpar.kernels.attention_merge:_merge_kernel",
            "signature": {"out_ptr": "*fp32", "lse_ptr": "*fp32", "blk_ptr": "*fp32",
                          "blk_lse_ptr": "*fp32", **_strides("o", "x"),
                          **_strides("l", "y", dims="bhs"), "S": "i32"},
            "constexprs": {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "BLOCK_S": 64},
            "cap": cap, "num_warps": 4, "num_stages": 1,
        }  # fmt: skip

MOE_GEMM_TILE = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}  # gemm_tiles(False)


def _moe_cases(dtype, cap):
    ptr, i32, i64 = f"*{dtype}", "i32", "*i64"
    return {
        "grouped-matmul": ("_grouped_matmul_kernel", 8, 3, {
            "x_ptr": ptr, "w_ptr": ptr, "y_ptr": ptr, "rows_ptr": i64, "offsets_ptr": i64,
            "block_offsets_ptr": i64, **{n: i32 for n in (
                "stride_xm", "stride_xk", "stride_we", "stride_wn", "stride_wk", "stride_ym",
                "stride_yn", "N", "K", "E")}},
            {"HAS_ROWS": True, "E_PAD": 128, "INPUT_PRECISION": "tf32", **MOE_GEMM_TILE}),
        "grouped-weight-grad": ("_grouped_weight_grad_kernel", 8, 3, {
            "dy_ptr": ptr, "x_ptr": ptr, "dw_ptr": ptr, "rows_ptr": i64, "offsets_ptr": i64,
            **{n: i32 for n in ("stride_dym", "stride_dyn", "stride_xm", "stride_xk",
                                "stride_we", "stride_wn", "stride_wk", "N", "K")}},
            {"HAS_ROWS": True, "INPUT_PRECISION": "tf32", **MOE_GEMM_TILE}),
        "gather-rows": ("_gather_rows_kernel", 4, 1, {
            "src_ptr": ptr, "idx_ptr": i64, "scale_ptr": "*fp32", "out_ptr": ptr,
            **{n: i32 for n in ("stride_sm", "stride_sd", "stride_om", "stride_od", "P", "D")}},
            {"HAS_SCALE": True, "BLOCK_M": 16, "BLOCK_D": 128}),
        "combine": ("_combine_kernel", 4, 1, {
            "src_ptr": ptr, "pos_ptr": i64, "weight_ptr": "*fp32", "y_ptr": ptr,
            **{n: i32 for n in ("stride_sm", "stride_sd", "stride_ym", "stride_yd", "T", "D",
                                "TOP_K")}},
            {"HAS_WEIGHT": True, "BLOCK_M": 16, "BLOCK_D": 128}),
        "combine-weight-grad": ("_combine_weight_grad_kernel", 4, 1, {
            "dy_ptr": ptr, "src_ptr": ptr, "pos_ptr": i64, "dw_ptr": "*fp32",
            **{n: i32 for n in ("stride_dym", "stride_dyd", "stride_sm", "stride_sd", "T", "D",
                                "TOP_K")}},
            {"BLOCK_M": 16, "BLOCK_D": 128}),
    }  # fmt: skip


for cap in (80, 90):
    for dtype in ("fp16", "bf16"):
        for label, (name, warps, stages, signature, constexprs) in _moe_cases(dtype, cap).items():
            CASES[f"moe-{label}-{dtype}-sm{cap}"] = {
                "kernel": f"fusedpar.kernels.moe:{name}", "signature": signature,
                "constexprs": constexprs, "cap": cap, "num_warps": warps, "num_stages": stages,
            }  # fmt: skip

# Kernels whose sm_90 PTX must use wgmma. Full-precision fp32 has no tensor-core path.
WGMMA_EXPECTED = {
    name
    for name in CASES
    if (name.startswith("matmul") and "ieee" not in name)
    or (name.startswith("attention") and "delta" not in name and "merge" not in name)
    or name.startswith("moe-grouped")
}


@pytest.fixture(scope="module")
def compiled():
    names = list(CASES)
    return dict(zip(names, compile_in_subprocess([CASES[n] for n in names]), strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_compiles(compiled, name):
    result = compiled[name]
    assert result["ok"], result["error"]
    cap = CASES[name]["cap"]
    assert result["shared"] <= SHARED_LIMIT[cap], f"{result['shared']} bytes of shared memory"
    if cap == 90 and name in WGMMA_EXPECTED:
        assert result["wgmma"], "the sm_90 PTX should use wgmma (Hopper's warpgroup MMA)"
