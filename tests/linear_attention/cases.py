"""The linear-attention family's cases: the chunked gated delta rule's compile-gate cases
(`GATE_CASES`: each kernel of the forward and the backward at every tuning config;
tests/test_compile_gate.py builds them) and their scenarios."""

import torch
from fusedpar.kernels.linear_attention import chunk as gdn
from fusedpar.kernels.linear_attention import chunk_backward as gdn_bwd

from tests.support.gate import Cases, _empty, _fp32_precision

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
    "state-bwd": ("gdn_state_backward_kernel", gdn_backward, gdn.state_configs, None),
    "grads": ("gdn_chunk_grads_kernel", gdn_backward, gdn_bwd.grads_configs, None),
}


def tile_name(config) -> str:
    """The V tile for a case's name ('' where the kernel has none)."""
    return f"-bv{config.kwargs['BV']}" if "BV" in config.kwargs else ""


def gdn_gate_cases():
    """Every config of every kernel for sm_90, bf16 with a scalar gate (GDN), the largest
    per-channel (KDA), packed-document and fp32 builds, and the smallest tile for sm_80.
    The tile goes into the variant (the gate names tiles by BLOCK_M/N/K)."""
    for label, (kernel, scenario, configs_of, match) in GDN.items():
        family = f"gdn-{label}"
        for K, V in GDN_HEAD_DIMS:
            configs = configs_of(K, V)
            for i, config in enumerate(configs):
                bv = tile_name(config)
                for mode, extra in (("", {}), ("per-channel-", {"per_channel": True})):
                    if mode and i:  # per-channel: the largest tile
                        continue
                    params = {"dtype": "bfloat16", "K": K, "V": V, **extra}
                    add(
                        family,
                        f"{mode}bfloat16-k{K}-v{V}{bv}",
                        scenario,
                        params,
                        kernel,
                        90,
                        config,
                        no_spill=False,
                        wgmma=i == 0,
                        match=match,
                    )
            params = {"dtype": "float32", "K": K, "V": V}
            add(
                family,
                f"float32-k{K}-v{V}{tile_name(configs[0])}",
                scenario,
                params,
                kernel,
                90,
                configs[0],
                no_spill=False,
                match=match,
            )
            smallest = configs[-1]
            add(
                family,
                f"bfloat16-k{K}-v{V}{tile_name(smallest)}",
                scenario,
                {"dtype": "bfloat16", "K": K, "V": V},
                kernel,
                80,
                smallest,
                no_spill=False,
                match=match,
            )
        params = {"dtype": "bfloat16", "K": 128, "V": 128, "documents": True}
        add(
            family,
            "packed-bfloat16-k128-v128",
            scenario,
            params,
            kernel,
            90,
            configs_of(128, 128)[0],
            no_spill=False,
            match=match,
        )


gdn_gate_cases()
