"""What a layer computes, apart from where it runs: one frozen spec per layer, validated
when made, and `FromSpec`, the layers' ``from_spec(spec, placement)``.

| layer               | spec                | the placement's fields it reads             |
| ------------------- | ------------------- | ------------------------------------------- |
| `ParallelAttention` | `AttentionSpec`     | tp, cp, ulysses groups, cp_mode, cp_layout, |
|                     |                     | sequence_parallel, overlap, reduce_dtype    |
| `ParallelMLA`       | `MLASpec`           | the same                                    |
| `MoE`               | `MoESpec`           | ep_group (cp, ulysses, tp: aux "sequence")  |
| `ParallelSwiGLU`    | `MLPSpec`           | tp_group, sequence_parallel, overlap,       |
|                     |                     | reduce_dtype, chunks_per_rank               |
| `GatedDeltaNet`     | `GatedDeltaNetSpec` | the same but chunks_per_rank (cp: refused)  |

    spec = fp.nn.AttentionSpec(d_model=512, n_heads=8, n_kv_heads=2)
    attn = fp.nn.ParallelAttention.from_spec(spec, dims.placement(mesh))

A spec's fields are the layer's keywords of the same names, defaults and meanings; the
keyword constructors build a spec and a placement and hand over to the same build. A
spec checks what needs no group (a misspelt field: TypeError, a bad value: ValueError),
the build what does; fields hold what was given (``head_dim=None`` stays None).
"""

import dataclasses
import math
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import NamedTuple

import torch.nn.functional as F

from fusedpar.kernels.attention import AttentionMask
from fusedpar.kernels.linear_attention import MAX_HEAD_DIM
from fusedpar.kernels.linear_attention.conv1d import MAX_WIDTH
from fusedpar.kernels.moe import SWIGLU_ALPHA, SWIGLU_LIMIT, check_activation
from fusedpar.kernels.moe_route import SCORES, check_groups
from fusedpar.nn.attention_parts import QK_NORMS
from fusedpar.nn.moe_balance import check_rate
from fusedpar.ops.moe_routing import AUX_LOSSES
from fusedpar.placement import Placement

DEFAULT_ROPE = "default"  # `rope` left out: Llama's tables (None: no rotary embedding)
CP_RINGS = ("auto", "latent", "expanded")  # what `ParallelMLA`'s ring over cp moves
# A Gated DeltaNet checkpoint's layout -> the dense projection its output gate z comes from
GDN_LAYOUTS = {"qwen3_next": "in_proj_qkvz", "qwen3_5": "in_proj_z", "olmo_hybrid": "g_proj"}
NORM_GATES = ("silu", "sigmoid")  # the gated RMSNorm's act(z): GDN's, Kimi's KDA's


class AttentionSizes(NamedTuple):
    """An `AttentionSpec`'s values left out, derived (`AttentionSpec.resolved`)."""

    n_kv_heads: int
    head_dim: int
    rotary_dim: int  # head_dim without a rotary embedding
    qk_norm: str | None  # "head", "full" or None


@dataclass(frozen=True)
class AttentionSpec:
    """`ParallelAttention`'s model: its keywords but the groups', the placement's.

    ``output_gate`` (Qwen3-Next, Qwen3.5): q's projection also emits a gate per query
    head, ``out * sigmoid(gate)`` before the o projection (`gate_weight`; a dense q in
    Hugging Face's layout is [q_h | gate_h] per head). ``n_kv_heads`` may be smaller than
    the TP degree if it divides it: each KV head is replicated on the TP / n_kv_heads
    ranks whose query heads read it (`ParallelAttention`'s param_layouts)."""

    d_model: int
    n_heads: int
    n_kv_heads: int | None = None
    _: KW_ONLY
    head_dim: int | None = None
    bias: bool = False
    o_bias: bool = False
    qk_norm: bool | str = False
    norm_eps: float = 1e-6
    norm_offset: float = 0.0
    sinks: bool = False
    rope: Callable | str | None = DEFAULT_ROPE
    rotary_dim: int | None = None
    softmax_scale: float | None = None
    sliding_window: int | None = None
    softcap: float | None = None
    causal: bool = True
    rope_theta: float = 10000.0
    output_gate: bool = False

    def __post_init__(self):
        if not isinstance(self.output_gate, bool):
            raise TypeError(f"output_gate must be a bool, got {self.output_gate!r}")
        window, rope, rotary_dim = self.sliding_window, self.rope, self.rotary_dim
        if window is not None:
            if isinstance(window, bool) or not isinstance(window, int):
                raise TypeError(f"sliding_window must be an int, got {window!r}")
            if window < 1 or not self.causal:
                raise ValueError(
                    f"sliding_window={window} is Hugging Face's causal "
                    f"window of W >= 1 keys (causal={self.causal})"
                )
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be > 0 (or None), got {self.softcap!r}")
        scale = self.softmax_scale
        if scale is not None and not 0 < scale < float("inf"):
            raise ValueError(f"softmax_scale must be > 0 and finite (or None), got {scale!r}")
        if not (rope is None or rope == DEFAULT_ROPE or callable(rope)):
            raise TypeError(
                f"rope must be a callable positions -> (cos, sin), None (no rotary "
                f"embedding) or left out (Llama's tables), got {rope!r}"
            )
        qk_norm = "head" if self.qk_norm is True else self.qk_norm or None
        if qk_norm is not None and qk_norm not in QK_NORMS:
            raise ValueError(
                f'qk_norm must be False, True ("head") or one of {QK_NORMS}, got {qk_norm!r}'
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) is not divisible by n_heads ({self.n_heads}): "
                f"pass head_dim"
            )
        head_dim = self.d_model // self.n_heads if self.head_dim is None else self.head_dim
        if rope is None and rotary_dim is not None:
            raise ValueError(f"rotary_dim={rotary_dim} with rope=None (no rotary embedding)")
        if rope is not None and rotary_dim is None and head_dim % 2:
            raise ValueError(
                f"head_dim ({head_dim}) must be even for the rotary embedding "
                f"(or pass rotary_dim, or rope=None)"
            )
        rotary_dim = head_dim if rotary_dim is None or rope is None else rotary_dim
        if rope is not None and (rotary_dim % 2 or not 0 < rotary_dim <= head_dim):
            raise ValueError(
                f"rotary_dim ({rotary_dim}) must be even and in (0, head_dim "
                f"{head_dim}] for the rotary embedding"
            )
        n_kv_heads = self.n_kv_heads or self.n_heads
        if self.n_heads % n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})"
            )

    @property
    def mask(self) -> AttentionMask:
        """The layer's mask (`AttentionMask`), its sinks aside (a parameter: the layer
        joins them per call): Hugging Face's ``sliding_window=W`` keys (the query's own
        included) is flash-attn's ``window=(W - 1, 0)``."""
        W = self.sliding_window
        window = (-1, -1) if W is None else (W - 1, 0)
        return AttentionMask(self.causal, window, self.softcap or 0.0, self.softmax_scale)

    def resolved(self) -> AttentionSizes:
        """The values left out, derived: n_kv_heads (n_heads), head_dim (d_model /
        n_heads), rotary_dim (head_dim), qk_norm (True: "head"; False: None)."""
        head_dim = self.d_model // self.n_heads if self.head_dim is None else self.head_dim
        rotary = head_dim if self.rotary_dim is None or self.rope is None else self.rotary_dim
        qk_norm = "head" if self.qk_norm is True else self.qk_norm or None
        return AttentionSizes(self.n_kv_heads or self.n_heads, head_dim, rotary, qk_norm)


@dataclass(frozen=True)
class MLASpec:
    """`ParallelMLA`'s model: its keywords but the groups', the placement's."""

    d_model: int
    n_heads: int
    _: KW_ONLY
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    bias: bool = False
    norm_eps: float = 1e-6
    rope: Callable | str | None = DEFAULT_ROPE
    rope_theta: float = 10000.0
    softmax_scale: float | None = None
    cp_ring: str = "auto"

    def __post_init__(self):
        rope = self.rope
        if not (rope is None or rope == DEFAULT_ROPE or callable(rope)):
            raise TypeError(
                f"ParallelMLA: rope must be a callable positions -> (cos, sin), None (NoPE: "
                f"Kimi Linear's; the shared k dims stay, unrotated) or left out (the tables "
                f"of rope_theta), got {rope!r}"
            )
        sizes = {
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "q_lora_rank": 1 if self.q_lora_rank is None else self.q_lora_rank,
        }
        for name, value in sizes.items():
            if value < (0 if name == "qk_rope_head_dim" and rope is None else 1):  # NoPE: 0 dims
                raise ValueError(f"ParallelMLA: {name} must be positive, got {value}")
        if rope is not None and self.qk_rope_head_dim % 2:
            raise ValueError(
                f"ParallelMLA: qk_rope_head_dim ({self.qk_rope_head_dim}) must be even"
            )
        if self.cp_ring not in CP_RINGS:
            raise ValueError(
                f"ParallelMLA: cp_ring must be one of {CP_RINGS}, got {self.cp_ring!r}"
            )

    @property
    def mask(self) -> AttentionMask:
        """The layer's mask: causal, scaled by `softmax_scale` or (dn + dr) ** -0.5."""
        qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        return AttentionMask(causal=True, softmax_scale=self.softmax_scale or qk_dim**-0.5)


@dataclass(frozen=True)
class MoESpec:
    """`MoE`'s model: its keywords but ``ep_group``, the placement's."""

    d_model: int
    d_hidden: int
    num_experts: int
    top_k: int
    _: KW_ONLY
    score: str = "softmax"
    norm_topk_prob: bool = True
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    shared_hidden: int = 0
    shared_gate: bool = False
    bias: bool = False
    router_bias: bool = False
    activation: str = "silu"
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    bias_update_rate: float | None = None  # loss-free balancing's step (`moe_balance`)
    aux_loss: str = "switch"  # or DeepSeek-V3's "sequence" (`fusedpar.ops.moe_routing`)

    def __post_init__(self):
        check_rate(self.bias_update_rate, self.score)
        if self.aux_loss not in AUX_LOSSES:
            raise ValueError(f"aux_loss must be one of {AUX_LOSSES}, got {self.aux_loss!r}")
        if self.shared_gate and not self.shared_hidden:
            raise ValueError("shared_gate needs a shared expert: pass shared_hidden > 0")
        given = [
            n
            for n, v in (("swiglu_alpha", self.swiglu_alpha), ("swiglu_limit", self.swiglu_limit))
            if v is not None
        ]
        if given and self.activation != "clamped_swiglu":
            raise ValueError(
                f"{' and '.join(given)} apply to activation='clamped_swiglu' "
                f"only, got activation={self.activation!r}"
            )
        check_activation(self.activation, *self.swiglu())
        num_experts, top_k = self.num_experts, self.top_k
        if num_experts < 1:  # (a multiple of the EP group's size: checked by the layer)
            raise ValueError(
                f"num_experts ({num_experts}) must be a positive multiple of the EP group size"
            )
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k ({top_k}) must be between 1 and num_experts ({num_experts})")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
        capacity = self.capacity_factor
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity_factor must be positive, got {capacity}")
        check_groups(num_experts, top_k, self.n_group, self.topk_group)
        if not 0 < self.routed_scaling_factor < math.inf:
            raise ValueError(
                f"routed_scaling_factor must be positive and finite, got "
                f"{self.routed_scaling_factor}"
            )

    def swiglu(self) -> tuple[float, float]:
        """(alpha, limit) of the clamped SwiGLU, their defaults where left out."""
        alpha = SWIGLU_ALPHA if self.swiglu_alpha is None else self.swiglu_alpha
        return alpha, SWIGLU_LIMIT if self.swiglu_limit is None else self.swiglu_limit


@dataclass(frozen=True)
class MLPSpec:
    """`ParallelSwiGLU`'s model: its keywords but the group's, the placement's."""

    d_model: int
    d_hidden: int
    _: KW_ONLY
    bias: bool = False
    activation: Callable = F.silu


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """`GatedDeltaNet`'s model: its keywords but the groups', the placement's.

    n_k_heads (Hk) q/k heads of head_k_dim (K); n_v_heads (Hv, default Hk, a multiple of
    Hk: v-head j reads k-head j // (Hv / Hk)) v heads of head_v_dim (V, default K); a
    depthwise causal conv of `conv_size` taps over the q|k|v channels; the gated RMSNorm
    (eps `norm_eps`, act `norm_gate` of z); beta = sigmoid(b), or 2 sigmoid(b) with
    `allow_neg_eigval` (OLMo Hybrid). `layout`: the checkpoint layout `from_dense` reads
    and where z comes from (`GDN_LAYOUTS`). No family has biases: the layer has none."""

    d_model: int
    n_k_heads: int
    n_v_heads: int | None = None
    _: KW_ONLY
    head_k_dim: int
    head_v_dim: int | None = None
    conv_size: int = 4
    norm_eps: float = 1e-6
    norm_gate: str = "silu"
    allow_neg_eigval: bool = False
    layout: str = "qwen3_5"

    def __post_init__(self):
        sizes = {
            "d_model": self.d_model,
            "n_k_heads": self.n_k_heads,
            "n_v_heads": self.n_v_heads or self.n_k_heads,
            "head_k_dim": self.head_k_dim,
            "head_v_dim": self.head_v_dim or self.head_k_dim,
            "conv_size": self.conv_size,
        }
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"GatedDeltaNet: {name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"GatedDeltaNet: {name} must be positive, got {value}")
        limits = {"head_k_dim": MAX_HEAD_DIM, "head_v_dim": MAX_HEAD_DIM, "conv_size": MAX_WIDTH}
        for name, limit in limits.items():  # the ops' bounds, refused here rather than at a call
            if sizes[name] > limit:
                raise ValueError(f"GatedDeltaNet: {name} ({sizes[name]}) must be <= {limit}")
        if sizes["n_v_heads"] % self.n_k_heads:
            raise ValueError(
                f"GatedDeltaNet: n_v_heads ({sizes['n_v_heads']}) must be a multiple of "
                f"n_k_heads ({self.n_k_heads})"
            )
        if not 0 < self.norm_eps < math.inf:
            raise ValueError(f"GatedDeltaNet: norm_eps must be > 0, got {self.norm_eps!r}")
        if self.norm_gate not in NORM_GATES:
            raise ValueError(
                f"GatedDeltaNet: norm_gate must be one of {NORM_GATES}, got {self.norm_gate!r}"
            )
        if self.layout not in GDN_LAYOUTS:
            raise ValueError(
                f"GatedDeltaNet: layout must be one of {tuple(GDN_LAYOUTS)}, got {self.layout!r}"
            )

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """(Hk, Hv, K, V), the defaults filled in."""
        return (
            self.n_k_heads,
            self.n_v_heads or self.n_k_heads,
            self.head_k_dim,
            self.head_v_dim or self.head_k_dim,
        )

    @property
    def gate_source(self) -> str:
        """The dense projection the output gate z comes from, in `layout`'s checkpoints."""
        return GDN_LAYOUTS[self.layout]


class FromSpec:
    """``from_spec(spec, placement)`` for a layer of spec type `SPEC` whose build is
    ``_build(spec, placement, device, dtype)`` (its keyword constructor's too)."""

    SPEC: type

    @classmethod
    def from_spec(cls, spec, placement: Placement | None = None, *, device=None, dtype=None):
        """The layer of `spec` on `placement` (None: one rank, ``fp.Placement()``),
        its parameters initialized as its keyword constructor's (on the meta device:
        not). Built without ``__init__``: a subclass that sets state of its own in
        ``__init__`` sets it in ``_build`` too (after ``super()._build``)."""
        if not isinstance(spec, cls.SPEC):
            raise TypeError(
                f"{cls.__name__}.from_spec takes a {cls.SPEC.__name__}, got {type(spec).__name__}"
            )
        placement = Placement() if placement is None else placement
        if not isinstance(placement, Placement):
            raise TypeError(
                f"{cls.__name__}.from_spec takes a fusedpar.Placement, got "
                f"{type(placement).__name__}"
            )
        layer = cls.__new__(cls)
        layer._build(spec, placement, device, dtype)
        return layer

    @classmethod
    def split_options(cls, options: dict, what: str) -> tuple[dict, dict]:
        """A keyword constructor's `options` as (the spec's fields, the placement's);
        TypeError, in `what`'s name, for a keyword that is neither."""
        spec_fields = {f.name for f in dataclasses.fields(cls.SPEC)} - {"_"}
        placement_fields = {f.name for f in dataclasses.fields(Placement)}
        unknown = set(options) - spec_fields - placement_fields
        if unknown:
            raise TypeError(f"{what} got unexpected keyword(s) {sorted(unknown)}")
        spec = {k: v for k, v in options.items() if k in spec_fields}
        return spec, {k: v for k, v in options.items() if k in placement_fields}
