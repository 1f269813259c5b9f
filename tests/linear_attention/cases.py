"""The linear-attention family's cases: the chunked gated delta rule's compile-gate cases
(`GATE_CASES`: each kernel of the forward and the backward at every tuning config;
tests/test_compile_gate.py builds them) and their scenarios, and the opcheck cases of
its custom ops (`opcheck_cases`, run by tests/test_compile.py). The short convolution's
are in conv_cases.py."""

import torch
from fusedpar.kernels.linear_attention import chunk as gdn
from fusedpar.kernels.linear_attention import chunk_backward as gdn_bwd

from tests.support.gate import Cases, _empty, _fp32_precision
from tests.support.opcheck import leaf

GATE_CASES = Cases()
add = GATE_CASES.add

# --- compile-gate scenarios: the launchers called as the library calls them ---------------


def _gdn_inputs(dtype, K, V, per_channel, documents):
    """q, k, v, g, beta and the keywords: B = 2 (1 with packed documents), T = 256, two
    key heads, four value heads (GVA), an initial state."""
    B, T, Hk, Hv = (1 if documents else 2), 256, 2, 4
    q, k = (_empty((B, T, Hk, K), dtype) for _ in range(2))
    v = _empty((B, T, Hv, V), dtype)
    g = _empty((B, T, Hv, K) if per_channel else (B, T, Hv), dtype)
    beta = _empty((B, T, Hv), dtype)
    N = 3 if documents else B
    cu = torch.tensor([0, 100, 200, 256], dtype=torch.int32) if documents else None
    kwargs = {"scale": K**-0.5, "initial_state": _empty((N, Hv, K, V), "float32")}
    return (q, k, v, g, beta), {**kwargs, "cu_seqlens": cu}


def gdn_forward(dtype, K, V, per_channel=False, documents=False, precision="highest"):
    """`chunk_gated_delta_forward`: the prepare and state kernels."""
    inputs, kwargs = _gdn_inputs(dtype, K, V, per_channel, documents)
    with _fp32_precision(precision):
        gdn.chunk_gated_delta_forward(*inputs, **kwargs)


def gdn_backward(dtype, K, V, per_channel=False, documents=False, precision="highest"):
    """`chunk_gated_delta_backward` with a final-state gradient: prepare, the state kernel
    storing the chunk states, the state backward and the chunk gradients."""
    inputs, kwargs = _gdn_inputs(dtype, K, V, per_channel, documents)
    do = _empty(inputs[2].shape, dtype)
    dfinal = _empty(kwargs["initial_state"].shape, "float32")
    with _fp32_precision(precision):
        gdn_bwd.chunk_gated_delta_backward(do, dfinal, *inputs, **kwargs)


# --- compile-gate cases ----------------------------------------------------------------------

GDN_HEAD_DIMS = ((128, 128), (256, 256))  # (K, V): Qwen3-Next / Qwen3.5, Kimi; the largest
GDN = {  # label: (kernel, scenario, configs function, launch flags to match)
    "prepare": ("gdn_prepare_kernel", gdn_forward, gdn.prepare_configs, None),
    "state": ("gdn_state_kernel", gdn_forward, gdn.state_configs, {"OUTPUT": True}),
    "state-store": ("gdn_state_kernel", gdn_backward, gdn.state_configs, {"STORE": True}),
    "state-bwd": (
        "gdn_state_backward_kernel",
        gdn_backward,
        gdn_bwd.state_backward_configs,
        None,
    ),
    "state-grads": (
        "gdn_state_grads_kernel",
        gdn_backward,
        gdn_bwd.state_grads_configs,
        None,
    ),
    "grads": ("gdn_chunk_grads_kernel", gdn_backward, gdn_bwd.grads_configs, None),
}


def tile_name(config) -> str:
    """The K and V tiles for a case's name ('' where the kernel has none)."""
    return "".join(f"-{b.lower()}{config.kwargs[b]}" for b in ("BK", "BV") if b in config.kwargs)


def gdn_gate_cases():
    """For sm_90, bf16 with a scalar gate (GDN): each kernel's largest tile at K = V = 128
    and 256, the prepare kernel per channel (KDA) too; for sm_80 the state kernel's
    smallest tile at 256. (The gate's 2 CPUs build a case in about half a minute: the
    other tiles, fp32 and packed documents are left for a machine with time; the
    interpreter tests cover packed documents.) The tile goes into the variant (the
    gate's names read BLOCK_M/N/K only)."""
    for label, (kernel, scenario, configs_of, match) in GDN.items():
        family = f"gdn-{label}"
        for K, V in GDN_HEAD_DIMS:
            if label == "state-store" and K == 256:
                continue
            config = configs_of(K, V)[0]
            params = {"dtype": "bfloat16", "K": K, "V": V}
            variant = f"bfloat16-k{K}-v{V}{tile_name(config)}"
            add(
                family,
                variant,
                scenario,
                params,
                kernel,
                90,
                config,
                no_spill=False,
                wgmma=True,
                match=match,
            )
    config = gdn.prepare_configs(128, 128)[0]
    params = {"dtype": "bfloat16", "K": 128, "V": 128, "per_channel": True}
    add(
        "gdn-prepare",
        "per-channel-k128-v128",
        gdn_forward,
        params,
        "gdn_prepare_kernel",
        90,
        config,
        no_spill=False,
    )
    config = gdn.state_configs(256, 256)[-1]
    params = {"dtype": "bfloat16", "K": 256, "V": 256}
    add(
        "gdn-state",
        f"bfloat16-k256-v256{tile_name(config)}",
        gdn_forward,
        params,
        "gdn_state_kernel",
        80,
        config,
        no_spill=False,
        match={"OUTPUT": True},
    )


gdn_gate_cases()

# Waived, and reported (docs/linear_attention_kernels.md): as DESIGN's rule asks no-spill at
# head dims <= 128 only, the state kernels at 256 (bf16, 255 registers: 304 B spilled
# forward, 40 B backward).
for _case in GATE_CASES.values():
    if _case["family"] in ("gdn-state", "gdn-state-bwd") and _case["params"]["K"] > 128:
        _case["no_serial"] = False


# --- opcheck cases (tests/test_compile.py runs them on 2 ranks) ---


def _gdn_leaves(B, T, Hk, Hv, K, V, *, per_channel=False):
    """q, k, v, g, beta of the op, small and random, requiring grad: unit keys, gates
    <= 0 and beta in (0, 2)."""
    q = leaf(B, T, Hk, K)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, K), dim=-1).requires_grad_()
    v = leaf(B, T, Hv, V)
    g = (-torch.rand((B, T, Hv, K) if per_channel else (B, T, Hv)) * 3).requires_grad_()
    beta = (2 * torch.rand(B, T, Hv)).requires_grad_()
    return q, k, v, g, beta


def opcheck_cases(group: str) -> list:
    """(op, args) for ``fusedpar::gated_delta_rule`` and its backward: two sequences past
    a chunk (GVA, K != V) with an initial state; packed documents with a per-channel gate
    and no initial state; the backward with and without the final state's gradient.
    `group` is unused (the ops do not communicate)."""
    ops = torch.ops.fusedpar
    batched = (*_gdn_leaves(2, 70, 1, 2, 8, 4), leaf(2, 2, 8, 4), None, 0.5)
    cu = torch.tensor([0, 5, 5, 20], dtype=torch.int32)
    packed = (*_gdn_leaves(1, 20, 2, 2, 4, 8, per_channel=True), None, cu, 0.25)
    o, final = ops.gated_delta_rule(*batched)
    o_packed, _ = ops.gated_delta_rule(*packed)
    return [
        (ops.gated_delta_rule, batched),
        (ops.gated_delta_rule, packed),
        (ops.gated_delta_rule_backward, (torch.randn_like(o), torch.randn_like(final), *batched)),
        (ops.gated_delta_rule_backward, (torch.randn_like(o_packed), None, *packed)),
    ]
