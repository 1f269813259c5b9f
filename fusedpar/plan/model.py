"""What the planner knows of a model: its sizes, read off a Hugging Face config, the
example model's `Config`, or a named preset (the published configs).

`ModelSpec`'s fields name the model's sizes (vocab, d_model, n_layers, heads, the dense
and expert MLPs' widths, MLA's ranks, biases, norms, the router's kind, tied embeddings)
and `from_hf_config` reads each off the config's names (``hidden_size``,
``num_key_value_heads``, ``n_routed_experts``, ``first_k_dense_replace``, ...); the
field-by-field table is in docs/plan.md. ``hf=True`` marks a model converted by
`parallelize`, whose norms, embedding, head and loss are Hugging Face's. MTP layers
(DeepSeek-V3's 62nd) are left out, as Hugging Face leaves them out on load.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from fusedpar.hf_config import check_config
from fusedpar.plan.accounting import layer_tensors, model_end_tensors

QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "olmo2", "olmo3", "gemma3_text", "olmo_hybrid")
# q_proj doubled: [q | gate] per head (the attention output gate), a shared expert's gate
GATED_ATTENTION = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
QK_NORM_FAMILIES += GATED_ATTENTION
SIGMOID_ROUTERS = ("deepseek_v3", "glm4_moe", "minimax_m2")  # a score-correction bias


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's sizes (see the module doc)."""

    name: str
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_hidden: int  # the dense MLP's hidden width
    v_head_dim: int = 0  # 0: head_dim
    num_experts: int = 0  # 0: every MLP dense
    top_k: int = 1
    moe_hidden: int = 0  # one expert's hidden width (0: d_hidden)
    shared_hidden: int = 0  # the shared experts' hidden width, all of them together
    dense_layers_first: int = 0  # MLPs dense in the first layers, MoE after
    moe_every: int = 1  # every n-th layer's MLP is MoE (Qwen2-MoE's decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()  # and these dense (Qwen2/3-MoE's mlp_only_layers)
    q_lora_rank: int = 0  # MLA: 0 with kv_lora_rank > 0 is q_proj straight from d_model
    kv_lora_rank: int = 0  # MLA when > 0
    rope_dim: int = 0  # the rotary part of the Q/K head (MLA's; else 0: all of it)
    qk_norm: bool = False
    attention_bias: bool = False  # q, k, v biases (MLA: q_a's and kv_a's)
    o_bias: bool = False  # the output projection's bias
    mlp_bias: bool = False  # the dense MLPs' biases
    shared_gate: bool = False  # a (1, d) gate on the shared experts (Qwen2-MoE)
    router: str = "softmax"  # "sigmoid": scores normalized over the top k (DeepSeek-V3)
    tied: bool = False
    gated: bool = True  # SwiGLU (gate, up, down); False: a plain MLP (fc, proj)
    hf: bool = False  # a Hugging Face model converted by `parallelize`: its own norms,
    # embedding, residuals, LM head and loss (their saved tensors differ from fusedpar's)
    output_gate: bool = False  # q_proj emits [q | gate] per head (Qwen3-Next, Qwen3.5)
    # hybrids: each layer's mixer, "linear_attention" (Gated DeltaNet) or
    # "full_attention" (() : every layer attention); the GDN layers' sizes
    layer_types: tuple[str, ...] = ()
    linear_k_heads: int = 0  # Hk (q and k heads)
    linear_v_heads: int = 0  # Hv (a multiple of Hk)
    linear_k_dim: int = 0  # K
    linear_v_dim: int = 0  # V
    linear_conv: int = 4  # the short conv's taps W
    linear_neg_eigval: bool = False  # beta = 2 sigmoid(b) (OLMo Hybrid)

    def __post_init__(self):
        if self.layer_types:
            kinds = set(self.layer_types) - {"linear_attention", "full_attention"}
            if len(self.layer_types) != self.n_layers or kinds:
                raise ValueError(
                    f"{self.name}: layer_types must name {self.n_layers} layers, each "
                    f"'linear_attention' or 'full_attention', got {self.layer_types}"
                )
        if "linear_attention" in self.layer_types:
            hk, hv = self.linear_k_heads, self.linear_v_heads
            if min(hk, hv, self.linear_k_dim, self.linear_v_dim, self.linear_conv) < 1 or hv % hk:
                raise ValueError(
                    f"{self.name}: GDN layers need positive linear_k_heads ({hk}), "
                    f"linear_v_heads ({hv}, a multiple of linear_k_heads), linear_k_dim "
                    f"({self.linear_k_dim}), linear_v_dim ({self.linear_v_dim}) and "
                    f"linear_conv ({self.linear_conv})"
                )

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def expert_hidden(self) -> int:
        return self.moe_hidden or self.d_hidden

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        if not self.num_experts or layer < self.dense_layers_first or layer in self.dense_layers:
            return False
        return (layer + 1) % self.moe_every == 0

    def is_linear(self, layer: int) -> bool:
        """Whether `layer`'s mixer is Gated DeltaNet (linear attention)."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    def kind(self, layer: int) -> tuple[bool, bool]:
        """(MoE MLP, GDN mixer): blocks of one kind hold, save and send alike."""
        return self.is_moe(layer), self.is_linear(layer)

    @property
    def linear_layers(self) -> int:
        return sum(self.is_linear(i) for i in range(self.n_layers))

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layers))

    def parameter_count(self, *, active: bool = False) -> int:
        """Parameters of the whole model (`active`: those one token runs through: top_k
        experts of each MoE layer)."""
        total = sum(n for n, _ in model_end_tensors(self, first=True, last=True))
        for i in range(self.n_layers):
            for shape, kind in layer_tensors(self, i):
                numel = math.prod(shape)
                if kind == "expert" and active:
                    numel = numel * self.top_k // self.num_experts
                total += numel
        return total


def _get(config, *names, default=None):
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return value
    return default


def from_hf_config(config, name: str | None = None) -> ModelSpec:
    """A ModelSpec from a Hugging Face config: a ``PretrainedConfig``, its dict, or the path
    of a ``config.json`` (or of the folder holding one). A config `parallelize` would
    refuse (another family, dropout, ...: `fusedpar.hf_config.check_config`)
    raises its ValueError here, with its message."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a JSON config: {e}") from None
    check_config(config)
    return _spec(config, name)


def _spec(config, name: str | None) -> ModelSpec:
    """`from_hf_config`'s ModelSpec of a config `check_config` passed."""
    model_type = _get(config, "model_type")
    text = _get(config, "text_config")
    if text is not None and _get(config, "hidden_size") is None:
        return _spec(text, name)
    d, heads = _get(config, "hidden_size", "n_embd"), _get(config, "num_attention_heads", "n_head")
    kv_lora = _get(config, "kv_lora_rank", default=0) or 0
    if kv_lora:
        nope, rope = _get(config, "qk_nope_head_dim"), _get(config, "qk_rope_head_dim")
        head_dim, v_head = nope + rope, _get(config, "v_head_dim")
        kv_heads = heads
    else:
        head_dim = _get(config, "head_dim") or d // heads
        factor = _get(config, "partial_rotary_factor", "rotary_pct") or _get(
            _get(config, "rope_parameters", default={}), "partial_rotary_factor", default=1.0
        )
        rope = _get(config, "rotary_dim") or (int(head_dim * factor) if factor != 1.0 else 0)
        v_head = 0
        kv_heads = _get(config, "num_key_value_heads", default=heads)
    experts = _get(config, "num_local_experts", "num_experts", "n_routed_experts", default=0)
    moe_hidden = _get(config, "moe_intermediate_size", default=0) or 0
    shared = _get(config, "shared_expert_intermediate_size", default=0) or 0
    if not shared and _get(config, "n_shared_experts"):
        shared = _get(config, "n_shared_experts") * moe_hidden
    hybrid = _hybrid(config, _get(config, "num_hidden_layers", "n_layer"))
    bias = bool(_get(config, "attention_bias", "qkv_bias", default=False))
    qkv_bias = {"qwen2": True, "qwen2_moe": bool(_get(config, "qkv_bias", default=True))}
    return ModelSpec(
        name=name or _get(config, "_name_or_path", default="") or model_type,
        vocab=_get(config, "vocab_size"),
        d_model=d,
        n_layers=_get(config, "num_hidden_layers", "n_layer"),
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head or 0,
        d_hidden=_get(config, "intermediate_size", "n_inner", default=4 * d),
        num_experts=experts or 0,
        top_k=_get(config, "num_experts_per_tok", default=1),
        moe_hidden=moe_hidden,
        shared_hidden=shared,
        dense_layers_first=_get(config, "first_k_dense_replace", default=0) or 0,
        moe_every=_get(config, "decoder_sparse_step", default=1) or 1,
        dense_layers=tuple(_get(config, "mlp_only_layers", default=()) or ()),
        q_lora_rank=_get(config, "q_lora_rank", default=0) or 0,
        kv_lora_rank=kv_lora,
        rope_dim=rope or 0,
        qk_norm=model_type in QK_NORM_FAMILIES or bool(_get(config, "use_qk_norm")),
        attention_bias=qkv_bias.get(model_type, bias),
        o_bias=bias and model_type not in ("qwen2", "qwen2_moe", "glm4_moe"),
        mlp_bias=bool(_get(config, "mlp_bias", default=False)),
        shared_gate=model_type in ("qwen2_moe", *GATED_ATTENTION) and bool(shared),
        router="sigmoid" if model_type in SIGMOID_ROUTERS else "softmax",
        tied=bool(_get(config, "tie_word_embeddings", default=True)),  # PretrainedConfig's
        gated=model_type not in ("gpt2", "gpt_neox"),
        hf=True,
        output_gate=model_type in GATED_ATTENTION or bool(_get(config, "attn_output_gate")),
        **hybrid,
    )


def _hybrid(config, n_layers: int) -> dict:
    """The GDN fields of a hybrid config (Qwen3-Next, Qwen3.5, OLMo Hybrid): its
    `layer_types`, or every ``full_attention_interval``-th layer full attention (Qwen's
    default 4), and the ``linear_*`` sizes; {} for a config without linear layers."""
    k_heads = _get(config, "linear_num_key_heads")
    if not k_heads:
        return {}
    types = _get(config, "layer_types")
    if types is None:
        types = hybrid_layers(n_layers, _get(config, "full_attention_interval", default=4))
    return {
        "layer_types": tuple(types),
        "linear_k_heads": k_heads,
        "linear_v_heads": _get(config, "linear_num_value_heads", default=k_heads),
        "linear_k_dim": _get(config, "linear_key_head_dim"),
        "linear_v_dim": _get(config, "linear_value_head_dim", "linear_key_head_dim"),
        "linear_conv": _get(config, "linear_conv_kernel_dim", default=4),
        "linear_neg_eigval": bool(_get(config, "linear_allow_neg_eigval", default=False)),
    }


def from_example_config(cfg) -> ModelSpec:
    """A ModelSpec of examples/tiny_llama.py's ``Config``."""
    return ModelSpec(
        name="tiny_llama",
        vocab=cfg.vocab,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        d_hidden=cfg.d_hidden,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
    )


# The published configs (their config.json on the Hugging Face hub), MTP layers left out.
PRESETS = {
    "llama3-8b": ModelSpec("Llama-3 8B", 128256, 4096, 32, 32, 8, 128, 14336),
    "llama3-70b": ModelSpec("Llama-3 70B", 128256, 8192, 80, 64, 8, 128, 28672),
    "llama3-405b": ModelSpec("Llama-3 405B", 128256, 16384, 126, 128, 8, 128, 53248),
    "qwen3-235b-a22b": ModelSpec(
        "Qwen3-235B-A22B",
        151936,
        4096,
        94,
        64,
        4,
        128,
        12288,
        num_experts=128,
        top_k=8,
        moe_hidden=1536,
        qk_norm=True,
    ),
    "mixtral-8x22b": ModelSpec(
        "Mixtral 8x22B", 32768, 6144, 56, 48, 8, 128, 16384, num_experts=8, top_k=2
    ),
    "deepseek-v3": ModelSpec(
        "DeepSeek-V3",
        129280,
        7168,
        61,
        128,
        128,
        192,
        18432,
        v_head_dim=128,
        num_experts=256,
        top_k=8,
        moe_hidden=2048,
        shared_hidden=2048,
        dense_layers_first=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        rope_dim=64,
        router="sigmoid",
    ),
}


def hybrid_layers(n_layers: int, interval: int = 4) -> tuple[str, ...]:
    """Qwen3-Next's and Qwen3.5's `layer_types` from ``full_attention_interval``: every
    `interval`-th layer full attention, the others Gated DeltaNet."""
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
    )


# Qwen3.5's text models (MTP layer left out): the attention layers gated (q_proj doubled),
# per-head q/k norms, a quarter of each 256-wide head rotary; the GDN layers K = V = 128,
# a 4-tap conv. Sources: 35B-A3B, transformers 5.23's Qwen3_5MoeTextConfig defaults (its
# docstring's checkpoint); 27B, THUDM/slime scripts/models/qwen3.5-27B.sh (d 5120, 64
# layers, 24 / 4 heads, ffn 17408, vocab 248320) with the GDN heads of issue #55's
# background (16 / 48); 397B-A17B, slime's scripts/models/qwen3.5-397B-A17B.sh (d 4096,
# 60 layers, 32 / 2 heads, 512 experts top 10, expert and shared widths 1024, the
# shared expert's gate) with the GDN heads of the background (16 / 64).
QWEN3_5 = dict(
    head_dim=256,
    rope_dim=64,
    qk_norm=True,
    output_gate=True,
    linear_k_dim=128,
    linear_v_dim=128,
    linear_conv=4,
    linear_k_heads=16,
)
PRESETS.update(
    {
        "qwen3.5-27b": ModelSpec(
            "Qwen3.5-27B",
            248320,
            5120,
            64,
            24,
            4,
            d_hidden=17408,
            layer_types=hybrid_layers(64),
            linear_v_heads=48,
            **QWEN3_5,
        ),
        "qwen3.5-35b-a3b": ModelSpec(
            "Qwen3.5-35B-A3B",
            248320,
            2048,
            40,
            16,
            2,
            d_hidden=512,  # every MLP MoE: the dense width is unused
            num_experts=256,
            top_k=8,
            moe_hidden=512,
            shared_hidden=512,
            shared_gate=True,
            layer_types=hybrid_layers(40),
            linear_v_heads=32,
            **QWEN3_5,
        ),
        "qwen3.5-397b-a17b": ModelSpec(
            "Qwen3.5-397B-A17B",
            248320,
            4096,
            60,
            32,
            2,
            d_hidden=1024,
            num_experts=512,
            top_k=10,
            moe_hidden=1024,
            shared_hidden=1024,
            shared_gate=True,
            layer_types=hybrid_layers(60),
            linear_v_heads=64,
            **QWEN3_5,
        ),
    }
)


def model_spec(model) -> ModelSpec:
    """A ModelSpec from any of: a ModelSpec, a preset's name, a Hugging Face config (object,
    dict or path), or the example model's Config."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str) and model.lower() in PRESETS:
        return PRESETS[model.lower()]
    if isinstance(model, (str, Path)) and not Path(model).exists():
        raise ValueError(
            f"{model!r} is neither a preset ({', '.join(PRESETS)}) nor a path to a config.json"
        )
    if hasattr(model, "head_dim") and hasattr(model, "d_model"):
        return from_example_config(model)
    return from_hf_config(model)
