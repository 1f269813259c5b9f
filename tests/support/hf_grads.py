"""The oracle the Hugging Face tests hold a converted model's gradients against:
`reference_grad(original, name)`, the gradient of the unconverted model's parameter
that the converted parameter `name` came from, in the converted layer's layout (read
off Hugging Face's modules here, independently of `fusedpar.integrations`' own
conversion and its inverse)."""

import torch

from fusedpar.nn.mla import layer_rows

# ParallelMLA's parameters -> Hugging Face's (o_proj's: as every family's)
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
}


def reference_grad(model, name: str) -> torch.Tensor:
    """The gradient of the original parameter a converted one came from."""
    prefix, leaf = name.rsplit(".", 1)
    module = model.get_submodule(prefix)
    plain = {
        "q_weight": "q_proj.weight",
        "k_weight": "k_proj.weight",
        "v_weight": "v_proj.weight",
        "o_weight": "o_proj.weight",
        "q_bias": "q_proj.bias",
        "k_bias": "k_proj.bias",
        "v_bias": "v_proj.bias",
        "o_bias": "o_proj.bias",
        "q_norm_weight": "q_norm.weight",
        "k_norm_weight": "k_norm.weight",
        "gate_weight": "gate_proj.weight",
        "up_weight": "up_proj.weight",
        "down_weight": "down_proj.weight",
        "gate_bias": "gate_proj.bias",
        "up_bias": "up_proj.bias",
        "down_bias": "down_proj.bias",
        "router_weight": "gate.weight",
        "w2": "experts.down_proj",
        "shared_w1": "shared_expert.gate_proj.weight",
        "shared_w2": "shared_expert.down_proj.weight",
        "shared_w3": "shared_expert.up_proj.weight",
        "shared_gate_weight": "shared_expert_gate.weight",
    }
    if hasattr(module, "shared_experts"):  # GLM-4.5's and DeepSeek-V3's name
        plain = {k: v.replace("shared_expert.", "shared_experts.") for k, v in plain.items()}
    config = model.config
    if hasattr(module, "conv1d") and hasattr(module, "A_log"):  # a hybrid's Gated DeltaNet
        return gdn_grads(module)[leaf]
    if leaf in ("q_weight", "gate_weight") and _gated_q(module, config):
        grad = module.q_proj.weight.grad  # [q_h | gate_h] per head
        hd = grad.shape[0] // config.num_attention_heads // 2
        halves = grad.view(config.num_attention_heads, 2, hd, -1)
        return halves[:, int(leaf == "gate_weight")].flatten(0, 1)
    if hasattr(module, "kv_a_proj_with_mqa"):  # latent attention: HF's rows in the layer's layout
        grad = module.get_parameter(MLA_NAMES.get(leaf, plain.get(leaf))).grad
        return layer_rows(
            leaf,
            grad,
            nope=config.qk_nope_head_dim,
            rope=config.qk_rope_head_dim,
            kv_lora_rank=config.kv_lora_rank,
            rope_interleave=config.rope_interleave,
        )
    fused = next(
        (
            getattr(module, n)
            for n in ("qkv_proj", "query_key_value", "c_attn")
            if hasattr(module, n)
        ),
        None,
    )
    if fused is not None and leaf[:2] in ("q_", "k_", "v_"):  # Phi-3, GPT-NeoX, GPT-2
        grad = fused.weight.grad if leaf.endswith("weight") else fused.bias.grad[:, None]
        grad = grad.t() if type(fused).__name__ == "Conv1D" and leaf.endswith("weight") else grad
        heads = config.num_attention_heads
        if config.model_type == "gpt_neox":  # per head: (H, [q, k, v], hd)
            grad = grad.view(heads, 3, -1, grad.shape[-1]).transpose(0, 1).flatten(0, 2)
        kv = getattr(config, "num_key_value_heads", heads)
        hd = grad.shape[0] // (heads + 2 * kv)
        part = grad.split([heads * hd, kv * hd, kv * hd])["qkv".index(leaf[0])]
        return part if leaf.endswith("weight") else part[:, 0]
    if leaf.startswith("o_") and (hasattr(module, "dense") or hasattr(module, "c_attn")):
        out = module.dense if hasattr(module, "dense") else module.c_proj
        grad = out.weight.grad if leaf == "o_weight" else out.bias.grad
        return grad.t() if leaf == "o_weight" and type(out).__name__ == "Conv1D" else grad
    if type(module).__name__ == "Conv1D":  # GPT-2's MLP, stored (in, out)
        grad = module.get_parameter(leaf).grad
        return grad.t() if leaf == "weight" else grad
    if getattr(module, "gate_up_proj", None) is not None and leaf in ("gate_weight", "up_weight"):
        return module.gate_up_proj.weight.grad.chunk(2)[leaf != "gate_weight"]
    if config.model_type == "gpt_oss" and leaf in ("w1", "w3", "w2", "b1", "b2", "b3"):
        experts = module.experts  # gate, up interleaved in (E, d, 2h); stored (in, out)
        half = slice(0, None, 2) if leaf in ("w1", "b1") else slice(1, None, 2)
        if leaf == "w2":
            return experts.down_proj.grad.transpose(1, 2)
        if leaf == "b2":
            return experts.down_proj_bias.grad
        if leaf.startswith("w"):
            return experts.gate_up_proj.grad[..., half].transpose(1, 2)
        return experts.gate_up_proj_bias.grad[:, half]
    if config.model_type == "gpt_oss" and leaf.startswith("router_"):
        return module.router.get_parameter(leaf.removeprefix("router_")).grad
    if leaf in ("w1", "w3"):  # halves of the fused (E, 2h, d) gate_up_proj
        grad = module.get_parameter("experts.gate_up_proj").grad
        h = grad.shape[1] // 2
        return grad[:, :h] if leaf == "w1" else grad[:, h:]
    if leaf in plain:
        return module.get_parameter(plain[leaf]).grad
    return model.get_parameter(name).grad  # embeddings, norms, head: unchanged names


def _gated_q(module, config) -> bool:
    """Whether `module` is an attention whose q_proj also emits a gate per head
    (Qwen3-Next's, Qwen3.5's): twice the rows that k_proj's per KV head tell."""
    q, k = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
    if q is None or k is None or not hasattr(q, "weight"):
        return False
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return q.weight.shape[0] == 2 * config.num_attention_heads * (k.weight.shape[0] // kv)


def gdn_grads(module) -> dict:
    """A Hugging Face Gated DeltaNet's gradients as `fp.nn.GatedDeltaNet`'s parameters
    (its names), split as Hugging Face's own forward splits its projections (Qwen3-Next's
    per-k-head groups by its ``fix_query_key_value_ordering``, applied to W^T)."""
    grads = {n: p.grad for n, p in module.named_parameters()}
    kd, vd = module.key_dim, module.value_dim
    parts = {}
    if "in_proj_qkvz.weight" in grads:
        mixed = grads["in_proj_qkvz.weight"].T[None]  # (1, d, N): d "tokens"
        split = module.fix_query_key_value_ordering(mixed, grads["in_proj_ba.weight"].T[None])
        for name, t in zip("qkvzba", split, strict=True):  # (1, d, H, D) or (1, d, H)
            parts[name] = t[0].reshape(t.shape[1], -1).T
    elif "in_proj_qkv.weight" in grads:
        parts.update(
            zip("qkv", torch.split(grads["in_proj_qkv.weight"], [kd, kd, vd]), strict=True)
        )
        parts.update(z=grads["in_proj_z.weight"], b=grads["in_proj_b.weight"])
        parts["a"] = grads["in_proj_a.weight"]
    else:  # OLMo Hybrid's: one projection each, z from g_proj
        for ours, theirs in zip("qkvzba", "qkvgba", strict=True):
            parts[ours] = grads[f"{theirs}_proj.weight"]
    out = {f"{name}_weight": t for name, t in parts.items()}
    conv = torch.split(grads["conv1d.weight"].squeeze(1), [kd, kd, vd])
    out.update({f"conv_{s}_weight": t for s, t in zip("qkv", conv, strict=True)})
    norm = "o_norm.weight" if "o_norm.weight" in grads else "norm.weight"
    o = "o_proj.weight" if "o_proj.weight" in grads else "out_proj.weight"
    out.update(A_log=grads["A_log"], dt_bias=grads["dt_bias"])
    out.update(norm_weight=grads[norm], o_weight=grads[o])
    return out
