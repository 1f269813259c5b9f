"""Tiny random Hugging Face models of every family `fusedpar.integrations.hf.parallelize`
converts, built from their configs (nothing downloaded), fp32, every parameter re-drawn:
the models tests/hf/test_hf*.py and tests/plan/test_plan_hf.py run, and the packed batch
(`DOCUMENTS`) and the padded mask (`PADDED`) some of them take."""

import itertools

import torch

SEQ, BATCH, VOCAB = 16, 2, 64
DOCUMENTS = [0, 5, 11, 16]  # three packed documents of 5, 6 and 5 tokens in SEQ
SPANS = list(itertools.pairwise(DOCUMENTS))
# a (B, S) attention mask with padding (the last token of each row)
PADDED = torch.ones(BATCH, SEQ, dtype=torch.long).index_fill_(1, torch.tensor([SEQ - 1]), 0)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
WINDOWED = dict(num_hidden_layers=2, sliding_window=5)  # a window that bites at SEQ tokens
FAMILIES = {  # family: (config class, model class, options that family exercises)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),  # q/k norms, head dim
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
        ),
    ),  # shared expert + gate
    # Qwen3's q/k norms and head dim, no shared expert; layers 0 and 2 MoE, 1 dense
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            num_hidden_layers=3,
            mlp_only_layers=[1],
        ),
    ),
    # DeepSeek-V3's router (sigmoid, correction bias, 1 of 2 groups, scaled), ungated
    # shared expert, a dense first layer; q/k/v biases, per-head q/k norms, half rotary
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            head_dim=16,
            attention_bias=True,
            use_qk_norm=True,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
    ),
    # full-width q/k norms, partial RoPE by rotary_dim, a sigmoid router with its bias
    "minimax_m2": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        dict(
            head_dim=16,
            rotary_dim=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=24,
        ),
    ),
    # latent attention (q's latent, interleaved rotary pairs, V narrower than Q/K) with
    # YaRN's mscale in its scale; the grouped router, a shared expert, a dense first layer
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            num_hidden_layers=2,
            q_lora_rank=16,
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=8,
            rope_interleave=True,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            n_shared_experts=1,
            moe_intermediate_size=24,
            routed_scaling_factor=2.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",  # sliding then global, soft-capping
        dict(
            WINDOWED,
            head_dim=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",  # (1 + w) q/k norms, two bases
        dict(
            WINDOWED,
            head_dim=16,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=5, pad_token_id=0)),  # fused
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),  # full-width q/k norms, post-norms
    # OLMo 2's attention with sliding and full layers, each with its own RoPE base
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(
            WINDOWED,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    # NoPE on the second layer (no_rope_layers: 1 = RoPE), a window on the first
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(
            num_hidden_layers=2,
            no_rope_layers=[1, 0],
            use_sliding_window=True,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            pad_token_id=0,
        ),
    ),
    # fused per-head qkv, partial rotary, parallel residual, LayerNorm and MLP biases
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.5)),
    # Conv1D, learned absolute positions, tied embeddings, per-layer scaling
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            scale_attn_by_inverse_layer_idx=True,
            num_hidden_layers=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    ),
    # attention sinks, alternating windows, YaRN; MoE with biases, clamped SwiGLU, router bias
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            WINDOWED,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        ),
    ),
}
# the hybrids: Gated DeltaNet layers ("linear_attention") among gated full attention
# (Qwen's: q/k norms scaling by 1 + w, partial rotary) or OLMo's post-norm attention;
# 4 k-heads (TP4: one a rank) of K 8, 8 v-heads of V 12 (K != V, two v-heads a k-head)
LINEAR = dict(
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    head_dim=16,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
)
QWEN_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
)
HYBRIDS = {  # not in FAMILIES: their tests are tests/hf/test_hf_hybrid.py's
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(LINEAR, **QWEN_MOE)),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(LINEAR)),
    "qwen3_5_moe_text": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(LINEAR, **QWEN_MOE),
    ),
    "olmo_hybrid": (
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        dict(LINEAR, pad_token_id=0, eos_token_id=1),
    ),
}
NO_GQA = ("gpt_neox", "gpt2")  # configs without num_key_value_heads
MOE = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "glm4_moe",
    "minimax_m2",
    "deepseek_v3",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5_moe_text",
)  # experts over ep = tp


def tiny_model(family: str, seed: int, head: str | None = None, **changes):
    """A tiny random causal LM of `family` (its options of `FAMILIES`, then `changes`),
    fp32, every parameter and the routers' choice bias re-drawn from `seed` (Hugging
    Face's init zeroes biases and sets norms to 1, which would hide a mix-up). `head`:
    another head's class suffix ("ForSequenceClassification", ...) in place of the
    causal LM's."""
    import transformers  # the [test] extra's; a test module skips itself without it

    config_cls, model_cls, options = {**FAMILIES, **HYBRIDS}[family]
    # the eager expert loop: the default grouped GEMM has no float64 (the oracle's dtype)
    common = {k: v for k, v in COMMON.items() if family not in NO_GQA or "key_value" not in k}
    config = getattr(transformers, config_cls)(
        **{**common, **options, **changes}, experts_implementation="eager"
    )
    torch.manual_seed(seed)
    if head is not None:
        model_cls = config_cls.removesuffix("Config") + head
    model = getattr(transformers, model_cls)(config).float()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
        for name, buffer in model.named_buffers():  # the routers' choice bias: it must bite
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
    return model
