"""What `fusedpar.integrations.hf.parallelize` accepts of a Hugging Face model, read off its
config alone: the families it converts (`FAMILIES`) and every refusal a config tells
(`check_config`). A leaf: it imports nothing of fusedpar's layers, nor torch, so the
planner (`fusedpar.plan.model`) runs the very same check before it plans a config and
refuses, with `parallelize`'s message, what `parallelize` would refuse.

A config is a ``PretrainedConfig`` or its dict (a ``config.json``, as the planner reads
it); a name it lacks reads as unset. `check_dims`: what a config refuses at given
degrees (its Gated DeltaNet layers' k-heads over tp, in the planner's words too).
"""

FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "glm4_moe",
    "minimax_m2",
    "deepseek_v3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "olmo3",
    "smollm3",
    "gpt_neox",
    "gpt2",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "olmo_hybrid",
    "kimi_linear",
)
# the layer kinds `parallelize` converts (``layer_types``); "linear_attention": Gated
# DeltaNet (`fp.nn.GatedDeltaNet`)
LAYER_KINDS = ("full_attention", "sliding_attention", "linear_attention")
# the MLP activations fusedpar computes (`hf_families.ACTIVATIONS` maps them to functions)
ACTIVATION_NAMES = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new")
DROPOUTS = (
    "attention_dropout",
    "router_jitter_noise",
    "hidden_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
)


def field(config, name: str, default=None):
    """`config`'s `name` (a dict's key or an attribute), `default` where it has none."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def refuse(condition: bool, what: str) -> None:
    if condition:
        raise ValueError(
            f"parallelize: {what} is not supported (the result would not compute "
            "what the model does)"
        )


def activation_name(config) -> str:
    for name in ("hidden_activation", "hidden_act", "activation_function"):
        if field(config, name):
            return field(config, name)
    return "silu"


def check_config(config) -> None:
    """Raise `parallelize`'s ValueError for what `config` alone says it cannot convert:
    another family, layer kinds but full and sliding attention, dropout, router jitter,
    ``pretraining_tp``, router logits as outputs, another activation, bidirectional or
    cross-attention, RoPE whose tables depend on the whole sequence's length."""
    model_type = field(config, "model_type")
    refuse(
        model_type not in FAMILIES, f"model_type {model_type!r} (supported: {', '.join(FAMILIES)})"
    )
    kinds = set(field(config, "layer_types") or ())
    refuse(bool(kinds - set(LAYER_KINDS)), f"layer_types {sorted(kinds)}")
    for name in DROPOUTS:
        value = field(config, name, 0.0)
        refuse(value not in (0, 0.0, None), f"{name}={value}")
    tp_slices = field(config, "pretraining_tp", 1)
    refuse(tp_slices != 1, f"pretraining_tp={tp_slices}")
    refuse(field(config, "output_router_logits", False), "output_router_logits=True")
    act = activation_name(config)
    refuse(act not in ACTIVATION_NAMES, f"hidden_act={act!r}")
    refuse(field(config, "use_bidirectional_attention", False), "bidirectional attention")
    refuse(field(config, "add_cross_attention", False), "cross-attention")
    params = field(config, "rope_parameters") or field(config, "rope_scaling")
    # per layer type (Gemma 3) or one set; these tables depend on the whole sequence's
    # length, which a CP rank's positions do not tell (zigzag: rank 0 holds the end)
    for rope in params.values() if "rope_type" not in (params or {"rope_type": 0}) else [params]:
        rope_type = (rope or {}).get("rope_type") if isinstance(rope, dict) else None
        refuse(rope_type in ("dynamic", "longrope"), f"rope_type {rope_type!r}")


def linear_layers(config) -> list[int]:
    """The indices of `config`'s Gated DeltaNet layers (``layer_types``' "linear_attention")."""
    return [
        i for i, kind in enumerate(field(config, "layer_types") or ()) if kind == "linear_attention"
    ]


def check_dims(config, cp: int, ulysses: int = 1, tp: int = 1) -> None:
    """Raise `parallelize`'s ValueError where `config`'s model cannot run at these
    degrees whatever its weights: its Gated DeltaNet layers' k-heads not divisible by
    tp (any cp x ulysses split runs: `fusedpar.nn.gated_deltanet_cp`); Kimi Linear's KDA
    layers (`check_kda_dims`)."""
    linear = linear_layers(config)
    if linear and field(config, "model_type") == "kimi_linear":
        check_kda_dims(config, tp)
    k_heads = field(config, "linear_num_key_heads")
    if linear and k_heads is not None and k_heads % tp:
        raise ValueError(
            f"GatedDeltaNet: n_k_heads ({k_heads}) is not divisible by the TP degree ({tp}) "
            f"(n_v_heads {field(config, 'linear_num_value_heads')} follow their k-heads)"
        )


def check_kda_dims(config, tp: int) -> None:
    """Kimi Linear's KDA layers (`fp.nn.KimiDeltaAttention`): their heads split over tp."""
    heads = field(config, "linear_num_heads") or 32  # (Hugging Face's default)
    if heads % tp:
        raise ValueError(
            f"KimiDeltaAttention: n_heads ({heads}) is not divisible by the TP degree ({tp})"
        )
