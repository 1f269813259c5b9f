"""A Hugging Face decoder layer's parts as fusedpar's layers take them, typed: the spec
of each layer (`attention_spec`, `mla_spec`, `moe_spec`, `mlp_spec`: what
`hf.parallelize` builds with ``from_spec(spec, placement)``) and the dense tensors it
then loads (`attention_weights`, `mla_weights`, `expert_weights`: their ``load_into``).
What differs per family is read with `hf_families`' tables and helpers."""

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusedpar.integrations.hf_families import (
    ACTIVATIONS,
    FUSED_QKV,
    NORM_OFFSET,
    activation_name,
    correction_name,
    expert_stacks,
    fused_parts,
    kv_heads,
    layer_window,
    mlp_parts,
    rope,
    rope_interleave,
    shared_expert,
)
from fusedpar.nn.attention_parts import norm_weight
from fusedpar.nn.linear import linear_parts
from fusedpar.nn.specs import AttentionSpec, MLASpec, MLPSpec, MoESpec


@dataclass(frozen=True)
class AttentionWeights:
    """A Hugging Face attention's projections as `ParallelAttention.load_dense` takes
    them: modules, or (fused projections, split) weight tensors with their biases."""

    q: Any
    k: Any
    v: Any
    o: Any
    bias: tuple | None = None  # (q, k, v, o) beside weight tensors
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    sinks: torch.Tensor | None = None

    def load_into(self, layer) -> None:
        layer.load_dense(
            self.q,
            self.k,
            self.v,
            self.o,
            q_norm=self.q_norm,
            k_norm=self.k_norm,
            sinks=self.sinks,
            bias=self.bias,
        )

    @property
    def like(self) -> torch.Tensor:
        """The tensor whose dtype and device the layer takes (`ParallelAttention.from_dense`'s):
        q's weight."""
        return linear_parts("q", self.q, None if self.bias is None else self.bias[0])[0]


def attention_weights(attn: nn.Module, config) -> AttentionWeights:
    """An attention's projections (a fused one split: `fused_parts`), q/k norms and
    sinks."""
    q_norm = getattr(attn, "q_norm", None)
    k_norm = None if q_norm is None else attn.k_norm
    sinks = getattr(attn, "sinks", None)  # gpt-oss: a learned logit per head
    if config.model_type in FUSED_QKV:
        (q, k, v), biases = fused_parts(attn, config)
        o = getattr(attn, FUSED_QKV[config.model_type][1])
        bias = None if biases[0] is None else (*biases, None)
    else:
        (q, k, v, o), bias = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj), None
    return AttentionWeights(q, k, v, o, bias=bias, q_norm=q_norm, k_norm=k_norm, sinks=sinks)


def attention_spec(i: int, attn: nn.Module, config, rotary_emb) -> AttentionSpec:
    """The `ParallelAttention` of layer i's attention: head dims, biases, the scale,
    the rotary embedding (the model's own module's tables, partial where the config
    says; none for learned positions or a NoPE layer), window, soft-capping, sinks and
    q/k norms (their width: per head or full)."""
    weights = attention_weights(attn, config)
    biases = (None,) * 4 if weights.bias is None else weights.bias
    q_weight, q_bias = linear_parts("q", weights.q, biases[0])
    heads = config.num_attention_heads
    # Qwen3-Next's and Qwen3.5's q_proj emits [q_h | gate_h] per head: twice the rows of
    # heads x the head dim that k's rows tell
    k_rows = linear_parts("k", weights.k, biases[1])[0].shape[0]
    output_gate = q_weight.shape[0] == 2 * heads * (k_rows // kv_heads(config))
    head_dim = q_weight.shape[0] // heads // (2 if output_gate else 1)
    factor = getattr(config, "partial_rotary_factor", None)
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", factor)
    rotary_dim = int(head_dim * (factor or 1.0))
    types = getattr(config, "layer_types", None)
    layer_type = types[i] if types else None
    # no RoPE: learned positions (GPT-2), or a NoPE layer (SmolLM3's use_rope)
    rotary = rotary_emb is not None and getattr(attn, "use_rope", True)
    qk_norm, norm_eps, norm_offset = False, 1e-6, 0.0
    if weights.q_norm is not None:
        width = norm_weight("q_norm", weights.q_norm).numel()
        qk_norm = "full" if width == heads * head_dim != head_dim else "head"
        norm_eps = getattr(weights.q_norm, "variance_epsilon", None) or weights.q_norm.eps
        norm_offset = NORM_OFFSET.get(config.model_type, 0.0)
    return AttentionSpec(
        config.hidden_size,
        heads,
        kv_heads(config),
        head_dim=head_dim,
        bias=q_bias is not None,
        o_bias=linear_parts("o", weights.o, biases[3])[1] is not None,
        qk_norm=qk_norm,
        norm_eps=norm_eps,
        norm_offset=norm_offset,
        sinks=weights.sinks is not None,
        rope=functools.partial(rope, rotary_emb, rotary_dim, layer_type) if rotary else None,
        rotary_dim=rotary_dim if rotary else None,
        softmax_scale=attn.scaling,
        sliding_window=layer_window(config, i),
        softcap=getattr(config, "attn_logit_softcapping", None) or None,
        output_gate=output_gate,
    )


@dataclass(frozen=True)
class MLAWeights:
    """An MLA module's projections and norms as `ParallelMLA.load_dense` takes them."""

    q: Any  # (q_a_proj, q_b_proj), or q_proj
    kv_a: nn.Module
    kv_b: nn.Module
    o: nn.Module
    q_a_norm: nn.Module | None
    kv_a_norm: nn.Module
    rope_interleave: bool

    def load_into(self, layer) -> None:
        layer.load_dense(
            self.q,
            self.kv_a,
            self.kv_b,
            self.o,
            q_a_norm=self.q_a_norm,
            kv_a_norm=self.kv_a_norm,
            rope_interleave=self.rope_interleave,
        )

    @property
    def like(self) -> torch.Tensor:
        """The tensor whose dtype and device the layer takes (`ParallelMLA.from_dense`'s)."""
        return linear_parts("kv_a", self.kv_a)[0]


def mla_weights(attn: nn.Module, config) -> MLAWeights:
    """The projections of an MLA module (q's latent pair, or q_proj) and its norms."""
    lora = getattr(attn, "q_a_proj", None) is not None
    return MLAWeights(
        q=(attn.q_a_proj, attn.q_b_proj) if lora else attn.q_proj,
        kv_a=attn.kv_a_proj_with_mqa,
        kv_b=attn.kv_b_proj,
        o=attn.o_proj,
        q_a_norm=attn.q_a_layernorm if lora else None,
        kv_a_norm=attn.kv_a_layernorm,
        rope_interleave=rope_interleave(config),
    )


def mla_spec(attn: nn.Module, config, rotary_emb) -> MLASpec:
    """The `ParallelMLA` of an MLA module: its ranks and head dims, scale (YaRN's
    mscale squared included, as the module computed it), biases and the model's rotary
    tables over the rotary dims (none without a rotary module: Kimi Linear's NoPE)."""
    weights = mla_weights(attn, config)
    lora = isinstance(weights.q, tuple)
    norm = weights.kv_a_norm
    rope_dim = config.qk_rope_head_dim
    return MLASpec(
        config.hidden_size,
        config.num_attention_heads,
        q_lora_rank=linear_parts("q_a", weights.q[0])[0].shape[0] if lora else None,
        kv_lora_rank=norm_weight("kv_a_norm", norm).numel(),
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=config.v_head_dim,
        bias=linear_parts("kv_a", weights.kv_a)[1] is not None,
        softmax_scale=attn.scaling,
        norm_eps=getattr(norm, "variance_epsilon", None) or norm.eps,
        # Kimi Linear's MLA: NoPE (its model has no rotary module)
        rope=None if rotary_emb is None else functools.partial(rope, rotary_emb, rope_dim, None),
    )


def _correction(mlp: nn.Module):
    """An MoE block's sigmoid router's selection bias (`e_score_correction_bias`, on the
    gate in GLM-4.5 and DeepSeek-V3, on the block in MiniMax-M2), or None."""
    where = correction_name(mlp)
    return None if where is None else functools.reduce(getattr, where.split("."), mlp)


@dataclass(frozen=True)
class ExpertWeights:
    """An MoE block's dense tensors as `MoE.load_dense` takes them (`expert_weights`)."""

    router_weight: torch.Tensor  # (E, d)
    w1: torch.Tensor  # (E, h, d)
    w2: torch.Tensor  # (E, d, h)
    w3: torch.Tensor  # (E, h, d)
    bias: tuple | None = None  # (b1, b2, b3)
    router_bias: torch.Tensor | None = None
    shared: tuple | None = None  # the shared expert's (w1, w2, w3)
    shared_gate_weight: torch.Tensor | None = None
    expert_bias: torch.Tensor | None = None

    def load_into(self, layer) -> None:
        layer.load_dense(
            self.router_weight,
            self.w1,
            self.w2,
            self.w3,
            shared=self.shared,
            shared_gate_weight=self.shared_gate_weight,
            bias=self.bias,
            router_bias=self.router_bias,
            expert_bias=self.expert_bias,
        )


def expert_weights(mlp: nn.Module, config) -> ExpertWeights:
    """An MoE block's router and experts (`expert_stacks`), and where it has them its
    shared expert, that expert's gate and its sigmoid router's selection bias; detached."""
    (router_weight, w1, w2, w3), bias, router_bias = expert_stacks(mlp, config)
    stacks = tuple(t.detach() for t in (router_weight, w1, w2, w3))
    if config.model_type == "gpt_oss":  # biases (the router's too); no shared expert
        return ExpertWeights(
            *stacks,
            bias=None if bias is None else tuple(t.detach() for t in bias),
            router_bias=None if router_bias is None else router_bias.detach(),
        )
    shared, gate, correction = shared_expert(mlp), None, _correction(mlp)
    if shared is not None:
        shared = tuple(
            lin.weight.detach() for lin in (shared.gate_proj, shared.down_proj, shared.up_proj)
        )
        gate = getattr(mlp, "shared_expert_gate", None)
    return ExpertWeights(
        *stacks,
        shared=shared,
        shared_gate_weight=None if gate is None else gate.weight.detach(),
        expert_bias=None if correction is None else correction.detach(),
    )


def moe_spec(mlp: nn.Module, config) -> MoESpec:
    """The `MoE` of a Hugging Face MoE block: its sizes, the shared expert and its gate;
    a sigmoid router where it has a selection bias (`_correction`), its groups and
    scaling; `norm_topk_prob` where the router says (MiniMax-M2's always renormalizes;
    Mixtral's too); gpt-oss's biases and clamped SwiGLU. No auxiliary loss: Hugging
    Face's model adds its own."""
    weights = expert_weights(mlp, config)
    num_experts, d_model = weights.router_weight.shape
    if config.model_type == "gpt_oss":
        experts = mlp.experts
        return MoESpec(
            d_model,
            weights.w1.shape[1],
            num_experts,
            config.num_experts_per_tok,
            aux_loss_coef=0.0,
            norm_topk_prob=True,
            bias=weights.bias is not None,
            router_bias=weights.router_bias is not None,
            activation="clamped_swiglu",
            swiglu_alpha=experts.alpha,
            swiglu_limit=experts.limit,
        )
    gate = mlp.gate
    sigmoid = weights.expert_bias is not None
    return MoESpec(
        d_model,
        weights.w1.shape[1],
        num_experts,
        config.num_experts_per_tok,
        aux_loss_coef=0.0,
        norm_topk_prob=getattr(gate, "norm_topk_prob", True),
        shared_hidden=0 if weights.shared is None else weights.shared[0].shape[0],
        shared_gate=weights.shared_gate_weight is not None,
        score="sigmoid" if sigmoid else "softmax",
        n_group=(getattr(gate, "num_group", None) or getattr(gate, "n_group", 1)) if sigmoid else 1,
        topk_group=getattr(gate, "topk_group", 1) if sigmoid else 1,
        routed_scaling_factor=getattr(gate, "routed_scaling_factor", 1.0) if sigmoid else 1.0,
    )


def mlp_spec(mlp: nn.Module, config) -> MLPSpec:
    """The `ParallelSwiGLU` of a gated MLP (`mlp_parts`): its sizes, biases (read off
    the gate) and activation."""
    gate, _, _, bias = mlp_parts(mlp)
    weight, gate_bias = linear_parts("gate", gate, None if bias is None else bias[0])
    d_hidden, d_model = weight.shape
    activation = ACTIVATIONS[activation_name(config)]
    return MLPSpec(d_model, d_hidden, bias=gate_bias is not None, activation=activation)
