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
