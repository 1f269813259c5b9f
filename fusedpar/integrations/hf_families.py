"""What `fusedpar.integrations.hf.parallelize` reads off each Hugging Face family: the
refusals (checked for every layer before anything is built) and the readings of one
decoder layer's attention and MLP that `hf_specs` makes fusedpar's layers' specs and
dense weights of; beside each its inverse (`dense_attention`, `dense_mla`, `dense_mlp`,
`dense_experts`: a converted layer's full parameters as the Hugging Face module holds
them), which `hf_export` writes.

Families (`FAMILIES` of `fusedpar.hf_config`, by ``model_type``): llama, mistral, qwen2,
qwen3, mixtral, qwen2_moe, qwen3_moe, glm4_moe, minimax_m2, deepseek_v3 (MLA:
`fp.nn.ParallelMLA`), gemma2, gemma3_text, phi3, olmo2, olmo3, smollm3, gpt_neox, gpt2,
gpt_oss, and the hybrids qwen3_next, qwen3_5_text, qwen3_5_moe_text, olmo_hybrid (their
"linear_attention" layers: `fp.nn.GatedDeltaNet`, `dense_gdn`) and kimi_linear (KDA:
`fp.nn.KimiDeltaAttention`, `dense_kda`; NoPE MLA). What each reads is in
the table of docs/dropin.md.

Hugging Face's ``sliding_window=W`` is the layer's own (a query sees itself and W - 1
keys before it); layers are windowed by ``config.layer_types`` where the config has
them, else all of them when ``sliding_window`` is set. Norms, embeddings (Gemma's
scaling included), residual wiring and the LM head (with Gemma 2's final soft-capping)
stay Hugging Face's own modules.
"""

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from fusedpar.hf_config import (  # noqa: F401  (re-exported: hf.py's names)
    ACTIVATION_NAMES,
    FAMILIES,
    activation_name,
    check_config,
    check_dims,
    refuse,
)
from fusedpar.nn.attention_parts import join_gate
from fusedpar.nn.gated_deltanet_dense import conv_rows, detect_layout, index_maps
from fusedpar.nn.kimi_delta import dense_kda  # noqa: F401 (hf_export's inverse, here)
from fusedpar.nn.linear import is_conv1d, linear_parts, linear_weight

_TANH_GELU = functools.partial(F.gelu, approximate="tanh")
# hf_config.ACTIVATION_NAMES, each with its function
ACTIVATIONS = dict(
    zip(ACTIVATION_NAMES, (F.silu, F.silu, F.gelu, _TANH_GELU, _TANH_GELU), strict=True)
)
# model_type: (the decoder's attribute, its layers', a layer's attention's); else Llama's
TREES = {"gpt_neox": ("gpt_neox", "layers", "attention"), "gpt2": ("transformer", "h", "attn")}
LLAMA_TREE = ("model", "layers", "self_attn")
# a plain MLP's (fc, proj) attributes, by family
PLAIN_MLPS = {"gpt_neox": ("dense_h_to_4h", "dense_4h_to_h"), "gpt2": ("c_fc", "c_proj")}
# Gemma's RMSNorm scales by (1 + weight); so do Qwen3-Next's and Qwen3.5's q/k norms
NORM_OFFSET = dict.fromkeys(("gemma3_text", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"), 1.0)
LINEAR_ATTENTION = "linear_attn"  # a hybrid's Gated DeltaNet layer's attribute (all four's)


def tree(model: nn.Module, config):
    """(decoder, its list of layers, the attribute of a layer's attention)."""
    decoder_name, layers_name, attention = TREES.get(config.model_type, LLAMA_TREE)
    decoder = getattr(model, decoder_name, None)
    layers = getattr(decoder, layers_name, None)
    refuse(
        layers is None,
        f"{type(model).__name__} without .{decoder_name}.{layers_name} "
        "(pass the model with its head, e.g. ForCausalLM)",
    )
    return decoder, layers, attention


def mixer_name(layer: nn.Module, config) -> str:
    """The attribute of decoder `layer`'s token mixer: its attention's (`tree`'s), or
    `LINEAR_ATTENTION` on a hybrid's Gated DeltaNet layer."""
    if getattr(layer, LINEAR_ATTENTION, None) is not None:
        return LINEAR_ATTENTION
    return TREES.get(config.model_type, LLAMA_TREE)[2]


def is_gdn(module: nn.Module) -> bool:
    """A Hugging Face Gated DeltaNet (its short conv beside the recurrence's gates)."""
    return hasattr(module, "conv1d") and hasattr(module, "A_log")


def is_kda(module: nn.Module) -> bool:
    """Kimi Linear's KDA (`KimiLinearDeltaAttention`: its short conv beside a low-rank
    forget gate)."""
    return hasattr(module, "conv1d") and hasattr(module, "forget_gate")


def kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def layer_window(config, i: int) -> int | None:
    """Hugging Face's sliding window of decoder layer i (None: full attention)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if types[i] == "sliding_attention" else None
    return window


# a fused q/k/v projection's attribute and output (o) projection's, by family
FUSED_QKV = {
    "phi3": ("qkv_proj", "o_proj"),
    "gpt_neox": ("query_key_value", "dense"),
    "gpt2": ("c_attn", "c_proj"),
}


def _qkv_rows(t: torch.Tensor, config, inverse: bool = False) -> torch.Tensor:
    """A fused projection's rows (a weight (out, in) or a bias) in the order q, k, v;
    GPT-NeoX's per-head (H, [q, k, v], hd) regrouped so, or back with `inverse`."""
    if config.model_type != "gpt_neox" or t is None:
        return t
    heads = config.num_attention_heads
    shape = (3, heads) if inverse else (heads, 3)
    return t.reshape(*shape, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def fused_parts(attn, config):
    """q, k, v weights (out, in) and biases of a fused projection: Phi-3's and GPT-2's
    are q rows, then k, then v (GPT-2's a transposed ``Conv1D``); GPT-NeoX's are per
    head, (H, [q, k, v], hd). `dense_attention` is the inverse."""
    fused = getattr(attn, FUSED_QKV[config.model_type][0])
    weight, bias = (_qkv_rows(t, config) for t in linear_parts("qkv", fused))
    heads, hd = (
        config.num_attention_heads,
        weight.shape[0] // (config.num_attention_heads + 2 * kv_heads(config)),
    )
    sizes = [heads * hd, *[kv_heads(config) * hd] * 2]
    return weight.split(sizes), [None] * 3 if bias is None else bias.split(sizes)


def _linear_like(t) -> bool:
    return isinstance(t, nn.Linear) or is_conv1d(t)


SHARED_EXPERTS = ("shared_expert", "shared_experts")  # Qwen2-MoE's; GLM-4.5's, DeepSeek-V3's


def _shared_name(mlp: nn.Module) -> str | None:
    return next((name for name in SHARED_EXPERTS if getattr(mlp, name, None) is not None), None)


def shared_expert(mlp: nn.Module) -> nn.Module | None:
    """An MoE block's shared expert: Qwen2-MoE's (gated), GLM-4.5's and DeepSeek-V3's
    (ungated, `n_shared_experts` wide), or None."""
    name = _shared_name(mlp)
    return None if name is None else getattr(mlp, name)


def correction_name(mlp: nn.Module) -> str | None:
    """Where an MoE block keeps its sigmoid router's selection bias (None: none)."""
    if getattr(mlp.gate, "e_score_correction_bias", None) is not None:
        return "gate.e_score_correction_bias"  # GLM-4.5, DeepSeek-V3
    return "e_score_correction_bias" if hasattr(mlp, "e_score_correction_bias") else None


def is_mla(attn: nn.Module) -> bool:
    """DeepSeek-V2/V3's multi-head latent attention (a KV latent with a shared k_rope)."""
    return hasattr(attn, "kv_a_proj_with_mqa")


def rope_interleave(config) -> bool:
    return bool(getattr(config, "rope_interleave", False))


# a converted `ParallelMLA`'s parameters -> Hugging Face's (relative to the attention)
MLA_NAMES = {
    "q_a_weight": "q_a_proj.weight",
    "q_a_bias": "q_a_proj.bias",
    "q_a_norm_weight": "q_a_layernorm.weight",
    "q_b_weight": "q_b_proj.weight",
    "q_weight": "q_proj.weight",
    "kv_a_weight": "kv_a_proj_with_mqa.weight",
    "kv_a_bias": "kv_a_proj_with_mqa.bias",
    "kv_a_norm_weight": "kv_a_layernorm.weight",
    "kv_b_weight": "kv_b_proj.weight",
    "o_weight": "o_proj.weight",
    "o_bias": "o_proj.bias",
}


def dense_mla(layer, config, params: dict) -> dict:
    """The inverse of `hf_specs.mla_weights` (and `ParallelMLA.load_dense`'s row permutations):
    the full parameters `params` of the converted `layer` (its names) under the Hugging
    Face module's names, in its layout (`ParallelMLA.dense_rows`)."""
    return {
        MLA_NAMES[name]: layer.dense_rows(name, t, rope_interleave=rope_interleave(config))
        for name, t in params.items()
    }


def check_layer(i: int, layer: nn.Module, config) -> None:
    """Every refusal for decoder layer i, before anything is built."""
    attn = getattr(layer, mixer_name(layer, config), None)
    mlp = getattr(layer, "mlp", None)
    parts = FUSED_QKV.get(config.model_type, ("q_proj", "k_proj", "v_proj", "o_proj"))
    if is_gdn(attn) or is_kda(attn):  # linear attention: no bias, a SiLU conv
        kind = "Gated DeltaNet" if is_gdn(attn) else "KDA"
        if is_gdn(attn):
            detect_layout(attn)  # a ValueError naming the projections it lacks
        biased = [m for m in attn.modules() if isinstance(m, (nn.Linear, nn.Conv1d))]
        refuse(
            any(m.bias is not None for m in biased),
            f"layer {i}: a {kind} projection or conv with a bias",
        )
        act = getattr(attn, "activation", "silu")
        refuse(act not in ("silu", "swish"), f"layer {i}: a {kind} conv with {act!r}")
        parts = ()
    elif is_mla(attn):
        lora = getattr(attn, "q_a_proj", None) is not None
        parts = (("q_a_proj", "q_b_proj") if lora else ("q_proj",)) + (
            "kv_a_proj_with_mqa",
            "kv_b_proj",
            "o_proj",
        )
        refuse(
            lora and getattr(attn.q_b_proj, "bias", None) is not None,
            f"layer {i}: a q_b_proj with a bias",
        )
        refuse(attn.kv_b_proj.bias is not None, f"layer {i}: a kv_b_proj with a bias")
        refuse(layer_window(config, i) is not None, f"layer {i}: a window on latent attention")
    refuse(
        not all(_linear_like(getattr(attn, p, None)) for p in parts),
        f"layer {i}: attention {type(attn).__name__} without {'/'.join(parts)} Linears",
    )
    refuse(attn is None, f"layer {i}: {type(layer).__name__} without an attention")
    refuse(not getattr(attn, "is_causal", True), f"layer {i}: non-causal attention")
    if hasattr(mlp, "experts"):
        router = getattr(mlp, "router", getattr(mlp, "gate", None))  # gpt-oss: router
        refuse(
            not hasattr(mlp.experts, "gate_up_proj") or router is None,
            f"layer {i}: experts of {type(mlp.experts).__name__}",
        )
        refuse(
            ACTIVATIONS[activation_name(config)] is not F.silu,
            f"layer {i}: MoE experts with hidden_act={activation_name(config)!r}",
        )
        shared = shared_expert(mlp)
        linears = () if shared is None else (shared.gate_proj, shared.up_proj, shared.down_proj)
        gate = getattr(mlp, "shared_expert_gate", None)
        refuse(
            any(lin.bias is not None for lin in (*linears, *([gate] if gate else []))),
            f"layer {i}: a shared expert (or its gate) with biases",
        )
        return
    if config.model_type in PLAIN_MLPS:
        parts = PLAIN_MLPS[config.model_type]
    elif hasattr(mlp, "gate_up_proj"):
        parts = ("gate_up_proj", "down_proj")
    else:
        parts = ("gate_proj", "up_proj", "down_proj")
    refuse(
        not all(_linear_like(getattr(mlp, p, None)) for p in parts),
        f"layer {i}: MLP {type(mlp).__name__}",
    )


def rope(rotary_emb: nn.Module, rotary_dim: int, layer_type, positions: torch.Tensor):
    """cos, sin of the model's own rotary module at `positions`: HF's (1, S, rotary_dim),
    of the layer's type where the module takes one (Gemma 3: local and global bases)."""
    probe = torch.zeros(1, dtype=torch.float32, device=positions.device)
    by_type = "layer_type" in inspect.signature(rotary_emb.forward).parameters
    args = (layer_type,) if by_type else ()
    cos, sin = rotary_emb(probe, positions[None], *args)
    # Hugging Face's layout repeats the angles (width rotary_dim); gpt-oss's module gives
    # each angle once (rotary_dim / 2), fusedpar's own layout. The width tells them apart
    # here, where the rotary dims are known.
    if cos.shape[-1] not in (rotary_dim, rotary_dim // 2):
        raise ValueError(
            f"the model's rotary module gives tables of width {cos.shape[-1]}, "
            f"neither the rotary dims {rotary_dim} nor half of them"
        )
    return cos, sin


def dense_attention(attn: nn.Module, config, params: dict) -> dict:
    """The inverse of `hf_specs.attention_weights`: the full parameters `params` of a converted
    `ParallelAttention` (its names: q_weight, q_bias, .., q_norm_weight, sinks) as the
    Hugging Face attention `attn` holds them (names relative to it; `attn` may be on the
    meta device: only its modules' kinds are read); a gated q's gate rows joined back.
    Fused projections are fused again (`_qkv_rows` back to GPT-NeoX's per-head rows),
    ``Conv1D`` weights transposed back."""
    fused = FUSED_QKV.get(config.model_type)
    out = {}
    if "gate_weight" in params:  # Qwen3-Next's, Qwen3.5's gated q: [q_h | gate_h] per head
        params = dict(params)
        hd = params["gate_weight"].shape[0] // config.num_attention_heads
        for kind in ("weight", "bias"):
            if f"gate_{kind}" in params:
                gate = params.pop(f"gate_{kind}")
                params[f"q_{kind}"] = join_gate(params[f"q_{kind}"], gate, hd)
    if fused is not None:
        qkv = [params[f"{p}_weight"] for p in "qkv"]
        weight = _qkv_rows(torch.cat(qkv), config, inverse=True)
        out[f"{fused[0]}.weight"] = linear_weight(getattr(attn, fused[0]), weight)
        if "q_bias" in params:
            bias = torch.cat([params[f"{p}_bias"] for p in "qkv"])
            out[f"{fused[0]}.bias"] = _qkv_rows(bias, config, inverse=True)
        projections = {"o": fused[1]}
    else:
        projections = {p: f"{p}_proj" for p in "qkvo"}
    for p, name in projections.items():
        out[f"{name}.weight"] = linear_weight(getattr(attn, name), params[f"{p}_weight"])
        if f"{p}_bias" in params:
            out[f"{name}.bias"] = params[f"{p}_bias"]
    for ours, theirs in (
        ("q_norm_weight", "q_norm.weight"),
        ("k_norm_weight", "k_norm.weight"),
        ("sinks", "sinks"),
    ):
        if ours in params:
            out[theirs] = params[ours]
    return out


def mlp_parts(mlp: nn.Module):
    """gate, up, down and their biases (None: taken off the modules) of a gated MLP
    (Phi-3's fused ``gate_up_proj``: gate rows first)."""
    if hasattr(mlp, "gate_up_proj"):
        fused = mlp.gate_up_proj
        gate, up = fused.weight.chunk(2)
        if fused.bias is None:
            return gate, up, mlp.down_proj, None
        bias_gate, bias_up = fused.bias.chunk(2)
        down_bias = mlp.down_proj.bias
        return gate, up, mlp.down_proj.weight, (bias_gate, bias_up, down_bias)
    return mlp.gate_proj, mlp.up_proj, mlp.down_proj, None


def dense_mlp(mlp: nn.Module, config, params: dict) -> dict:
    """The inverse of `mlp_parts` (a `ParallelSwiGLU`'s full parameters, its names, as
    the Hugging Face MLP `mlp` holds them: Phi-3's gate and up fused again) and of a
    plain MLP's conversion (`PLAIN_MLPS`: each linear under its own name, ``Conv1D``
    weights transposed back)."""
    if config.model_type in PLAIN_MLPS:
        out = {}
        for name in PLAIN_MLPS[config.model_type]:
            out[f"{name}.weight"] = linear_weight(getattr(mlp, name), params[f"{name}.weight"])
            if f"{name}.bias" in params:
                out[f"{name}.bias"] = params[f"{name}.bias"]
        return out
    if hasattr(mlp, "gate_up_proj"):
        out = {
            "gate_up_proj.weight": torch.cat([params["gate_weight"], params["up_weight"]]),
            "down_proj.weight": params["down_weight"],
        }
        if "gate_bias" in params:
            out["gate_up_proj.bias"] = torch.cat([params["gate_bias"], params["up_bias"]])
            out["down_proj.bias"] = params["down_bias"]
        return out
    return {
        f"{part}_proj.{kind}": params[f"{part}_{kind}"]
        for part in ("gate", "up", "down")
        for kind in ("weight", "bias")
        if f"{part}_{kind}" in params
    }


def expert_stacks(mlp: nn.Module, config):
    """An MoE block's router and experts in `MoE.from_dense`'s layout: ((router_weight
    (E, d), w1 (E, h, d), w2 (E, d, h), w3 (E, h, d)), the experts' biases (b1, b2, b3)
    or None, the router's bias or None). Hugging Face's experts hold gate and up in one
    (E, 2h, d) ``gate_up_proj`` (the gate rows, then the up rows); gpt-oss's in one
    (E, d, 2h), stored (in, out), gate and up interleaved (gate the even columns), with
    biases and a router with a bias. `dense_experts` is the inverse."""
    experts = mlp.experts
    if config.model_type == "gpt_oss":
        gate_up, gate_up_bias = experts.gate_up_proj, experts.gate_up_proj_bias  # (E, d, 2h)
        w1, w3 = gate_up[..., ::2].transpose(1, 2), gate_up[..., 1::2].transpose(1, 2)
        bias = (gate_up_bias[:, ::2], experts.down_proj_bias, gate_up_bias[:, 1::2])
        stacks = (mlp.router.weight, w1, experts.down_proj.transpose(1, 2), w3)
        return stacks, bias, mlp.router.bias
    h = experts.down_proj.shape[-1]
    up = experts.gate_up_proj  # (E, 2h, d)
    return (mlp.gate.weight, up[:, :h], experts.down_proj, up[:, h:]), None, None


def dense_experts(mlp: nn.Module, config, params: dict) -> dict:
    """The inverse of `hf_specs.expert_weights` (`expert_stacks`, the shared expert, its gate and
    the sigmoid router's selection bias): a converted `MoE`'s full parameters and its
    ``expert_bias`` buffer (its names) as the Hugging Face block `mlp` holds them (names
    relative to it)."""
    w1, w2, w3 = params["w1"], params["w2"], params["w3"]
    if config.model_type == "gpt_oss":  # (E, h, d) -> (E, d, h), gate and up interleaved
        out = {
            "router.weight": params["router_weight"],
            "router.bias": params["router_bias"],
            "experts.gate_up_proj": torch.stack([w1, w3], -1).transpose(1, 2).flatten(-2),
            "experts.gate_up_proj_bias": torch.stack([params["b1"], params["b3"]], -1).flatten(-2),
            "experts.down_proj": w2.transpose(1, 2),
            "experts.down_proj_bias": params["b2"],
        }
    else:
        out = {
            "gate.weight": params["router_weight"],
            "experts.gate_up_proj": torch.cat([w1, w3], dim=1),
            "experts.down_proj": w2,
        }
    shared = _shared_name(mlp)
    if shared is not None:
        for part, ours in (("gate", "shared_w1"), ("down", "shared_w2"), ("up", "shared_w3")):
            out[f"{shared}.{part}_proj.weight"] = params[ours]
    if "shared_gate_weight" in params:
        out["shared_expert_gate.weight"] = params["shared_gate_weight"]
    if "expert_bias" in params:
        out[correction_name(mlp)] = params["expert_bias"]
    return out


def dense_gdn(layer, params: dict) -> dict:
    """The inverse of `GatedDeltaNet.from_dense`: a converted layer's full parameters
    `params` (its names) as the Hugging Face module of its layout holds them (names
    relative to it): the sections' rows put back by the layout's index maps."""
    Hk, Hv, K, V = layer.spec.sizes
    layout = layer.spec.layout
    maps = index_maps(layout, Hk, Hv, K, V)
    out = {}
    for section, (name, rows) in maps.items():
        part = params[layer.param_name(section)]
        key = f"{name}.weight"
        if key not in out:  # (several sections share a fused projection)
            total = sum(idx.numel() for tensor, idx in maps.values() if tensor == name)
            out[key] = part.new_empty(total, part.shape[1])
        out[key][rows] = part
    conv = [params[f"conv_{s}_weight"] for s in conv_rows(Hk, Hv, K, V)]
    out["conv1d.weight"] = torch.cat(conv).unsqueeze(1)  # (C, 1, W)
    norm, o = ("o_norm", "o_proj") if layout == "olmo_hybrid" else ("norm", "out_proj")
    out.update({"A_log": params["A_log"], "dt_bias": params["dt_bias"]})
    out.update({f"{norm}.weight": params["norm_weight"], f"{o}.weight": params["o_weight"]})
    return out
