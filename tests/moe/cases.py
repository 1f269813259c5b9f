"""The MoE family's cases: its compile-gate cases (`GATE_CASES`: the grouped GEMMs in
each mode, the permute/combine kernels, the router; tests/test_compile_gate.py builds
them) and their scenarios."""

import torch
from fusedpar.kernels import (
    moe,
    moe_permute,
    moe_route,
    moe_weight_grad,
)

import fusedpar as fp
from tests.support.gate import Cases, _empty, _smallest
from tests.support.opcheck import leaf

GATE_CASES = Cases()
add, add_configs = GATE_CASES.add, GATE_CASES.add_configs

# --- compile-gate scenarios: the launchers called as the library calls them (see
# tests/support/gate.py) ---


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


# --- compile-gate cases ---

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


# --- opcheck cases (tests/test_compile.py runs them on 2 ranks) ---


def opcheck_cases(group: str) -> list:
    """(op, args) for the custom ops of the experts' SwiGLU, permute, combine, routing, and
    EP's dispatch and return: small and random, float inputs requiring grad (the
    autograd registration is exercised); `group`: the ranks'."""
    ops = torch.ops.fusedpar
    T, E, top_k, d, h = 5, 4, 2, 8, 6
    xm = leaf(T, d)
    ids = torch.stack([torch.randperm(E)[:top_k] for _ in range(T)])
    counts, order, pos = fp.kernels.moe_permute.dispatch_metadata(ids, E)
    wts = torch.rand(T, top_k).requires_grad_()
    ew1, ew3, ew2 = leaf(E, h, d), leaf(E, h, d), leaf(E, d, h)
    rows = order // top_k
    silu = (True, "silu", [1.702, 7.0])  # save_hidden, the activation
    experts = (xm, [ew1, ew3, ew2], counts, rows, pos)
    eout, h13 = ops.expert_swiglu(*experts, *silu)
    # gpt-oss's experts: biases (b1, b3, b2) and the clamped SwiGLU
    oss = (True, "clamped_swiglu", [1.702, 7.0])
    oss_experts = (xm, [ew1, ew3, ew2, leaf(E, h), leaf(E, h), leaf(E, d)], counts, rows, pos)
    oss_out, oss_h13 = ops.expert_swiglu(*oss_experts, *oss)
    ep = (xm, order, pos, counts, top_k, group)
    recv, *_, splits = ops.moe_dispatch(*ep)
    _, route_ids, route_probs = ops.moe_route(torch.randn(T, 5), None, 2, "softmax", True)
    return [
        (ops.expert_swiglu, (*experts, *silu)),
        (
            ops.expert_swiglu_backward,
            (torch.randn_like(eout), *experts, h13, [True] * 4, *silu[1:]),
        ),
        (ops.expert_swiglu, (*oss_experts, *oss)),
        (
            ops.expert_swiglu_backward,
            (torch.randn_like(oss_out), *oss_experts, oss_h13, [True] * 7, *oss[1:]),
        ),
        (ops.moe_permute, (xm, rows, pos)),
        (ops.moe_permute_backward, (torch.randn(T * top_k, d), pos)),
        (ops.moe_combine, (leaf(T * top_k, d), wts, pos, order)),
        (
            ops.moe_combine_backward,
            (torch.randn(T, d), torch.randn(T * top_k, d), wts.detach(), pos, order, True, True),
        ),
        # the routing: softmax and sigmoid (with the selection's bias), some gradients absent
        (ops.moe_route, (leaf(T, 5), None, 2, "softmax", True)),
        (ops.moe_route, (leaf(T, 6), torch.randn(6), 3, "sigmoid", False)),
        (
            ops.moe_route_backward,
            (torch.randn(T, 2), torch.randn(T, 5), route_probs, route_ids, "softmax", True),
        ),
        (
            ops.moe_route_backward,
            (None, torch.randn(T, 5), route_probs, route_ids, "sigmoid", False),
        ),
        (ops.moe_dispatch, ep),
        (ops.moe_return, (recv.detach().requires_grad_(), splits, group, False)),
    ]
