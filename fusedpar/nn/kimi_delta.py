"""`KimiDeltaAttention`: Kimi Linear's KDA layer (Kimi Delta Attention: the gated delta
rule with a decay per channel), heads split over TP, built from a `KimiDeltaSpec` and a
placement. x is sequence-first (S_loc, B, d), S_loc = S / TP under sequence
parallelism. On a rank (h = H / TP heads of K channels, r = K the gates' rank):

| step         | op                                                      | shape on a rank |
| ------------ | ------------------------------------------------------- | --------------- |
| projections  | `all_gather_matmul(x, [wq, wk, wv, wb, wfa, wga], tp)`  | (S, B, h K), .. |
| conv + SiLU  | `causal_conv1d` of q, k, v, each its own weight         | (B, S, h K)     |
| forget gate  | g = -exp(A_log) softplus(f_b(f_a x) + dt_bias), fp32    | (B, S, h, K)    |
| recurrence   | `gated_delta_rule(q, k, v, g, sigmoid(b), l2norm)`      | (B, S, h, K)    |
| output gate  | `rms_norm_gated(o, g_b(g_a x), w, gate="sigmoid")`      | (B, S, h, K)    |
| out          | `matmul_reduce_scatter(o, wo, tp)`                      | (S_loc, B, d)   |

f_a, g_a (r, d) and the norm weight (K,) are whole on every rank, each rank's gradient
its own heads' share (partial over TP, summed by `fusedpar.distribute`); f_b, g_b, q, k,
v, b, the convs, dt_bias (per channel) and A_log (per head) are split by whole heads,
o by its columns. Packed documents: ``forward(x, cu_seqlens)``. Under CP: the halos and
span summaries over every shard (`fusedpar.nn.gated_deltanet_cp`'s "summaries").
docs/linear_attention_layer.md.
"""

import math
from dataclasses import KW_ONLY, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fusedpar import comm
from fusedpar.kernels.common import accumulator
from fusedpar.kernels.linear_attention import MAX_HEAD_DIM
from fusedpar.kernels.linear_attention.conv1d import MAX_WIDTH
from fusedpar.nn.gated_deltanet_cp import SequenceSplit
from fusedpar.nn.head_parts import HeadParts
from fusedpar.nn.rotary import RotaryPositions
from fusedpar.nn.specs import FromSpec
from fusedpar.ops.linear import all_gather_matmul, matmul_reduce_scatter
from fusedpar.ops.norm import rms_norm_gated
from fusedpar.placement import Placement

# our full tensors: name -> the dim split over TP (None: whole on every rank)
SPLIT_DIMS = {
    **{s: 0 for s in ("q", "k", "v", "b", "conv_q", "conv_k", "conv_v", "f_b", "g_b")},
    "A_log": 0,
    "dt_bias": 0,
    "f_a": None,
    "g_a": None,
    "norm": None,
    "o": 1,
}
# Hugging Face's KimiLinearDeltaAttention: our part -> its parameter
HF_NAMES = {
    "q": "q_proj.weight",
    "k": "k_proj.weight",
    "v": "v_proj.weight",
    "b": "b_proj.weight",
    "f_a": "forget_gate.f_a_proj.weight",
    "f_b": "forget_gate.f_b_proj.weight",
    "dt_bias": "forget_gate.dt_bias",
    "A_log": "forget_gate.A_log",
    "g_a": "g_a_proj.weight",
    "g_b": "g_b_proj.weight",
    "norm": "o_norm.weight",
    "o": "o_proj.weight",
}
CONV = ("conv_q", "conv_k", "conv_v")  # the rows of Hugging Face's conv1d, in order


@dataclass(frozen=True)
class KimiDeltaSpec:
    """`KimiDeltaAttention`'s model: n_heads (H) heads of head_dim (K) for q, k and v
    alike; a depthwise causal conv of `conv_size` taps (SiLU) over each; the gated
    RMSNorm's `norm_eps`. The low-rank gates' rank is K (Kimi's). No biases."""

    d_model: int
    n_heads: int
    _: KW_ONLY
    head_dim: int
    conv_size: int = 4
    norm_eps: float = 1e-5

    def __post_init__(self):
        sizes = {
            "d_model": self.d_model,
            "n_heads": self.n_heads,
            "head_dim": self.head_dim,
            "conv_size": self.conv_size,
        }
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"KimiDeltaAttention: {name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"KimiDeltaAttention: {name} must be positive, got {value}")
        for name, limit in (("head_dim", MAX_HEAD_DIM), ("conv_size", MAX_WIDTH)):
            if sizes[name] > limit:
                raise ValueError(f"KimiDeltaAttention: {name} ({sizes[name]}) must be <= {limit}")
        if not 0 < self.norm_eps < math.inf:
            raise ValueError(f"KimiDeltaAttention: norm_eps must be > 0, got {self.norm_eps!r}")


class KimiDeltaAttention(FromSpec, HeadParts, RotaryPositions, nn.Module):
    """Kimi Delta Attention over TP (heads). See the module doc.

    | parameter                                | shape on a rank |
    | ---------------------------------------- | --------------- |
    | `q_weight`, `k_weight`, `v_weight`       | (h K, d)        |
    | `conv_q/k/v_weight`                      | (h K, W)        |
    | `b_weight`                               | (h, d)          |
    | `f_a_weight`, `g_a_weight`               | (K, d), whole   |
    | `f_b_weight`, `g_b_weight`               | (h K, K)        |
    | `dt_bias`                                | (h K,)          |
    | `A_log`                                  | (h,)            |
    | `norm_weight`                            | (K,), whole     |
    | `o_weight`                               | (d, h K)        |

    ``KimiDeltaAttention(d_model, n_heads, head_dim=K, ...)``: the spec's fields and the
    placement's (tp_group, sequence_parallel, overlap, reduce_dtype) as keywords, or
    ``from_spec(spec, placement)``; ``from_dense(module, placement)`` of Hugging Face's
    ``KimiLinearDeltaAttention``.
    """

    GROUP_AXES = {"tp_group": ("tp",)}
    SPLIT_DIMS = SPLIT_DIMS
    SPEC = KimiDeltaSpec
    _fusedpar_checked = False  # until the first call's checks pass (`fusedpar.checks`)

    def __init__(self, d_model, n_heads, *, head_dim, device=None, dtype=None, **options):
        spec_options, placement_options = self.split_options(options, "KimiDeltaAttention")
        spec = KimiDeltaSpec(d_model, n_heads, head_dim=head_dim, **spec_options)
        placement = Placement(**placement_options)
        self._build(spec, placement, device, dtype)

    def _build(self, spec: KimiDeltaSpec, placement: Placement, device, dtype) -> None:
        """The layer of `spec` on `placement`: the checks that need the groups (heads over
        TP), then the parameters."""
        super().__init__()
        H, K, tp_group = spec.n_heads, spec.head_dim, placement.tp_group
        tp = comm.group_size(tp_group)
        if H % tp:
            raise ValueError(
                f"KimiDeltaAttention: n_heads ({H}) is not divisible by the TP degree ({tp})"
            )
        self.spec, self.placement = spec, placement
        self.split = SequenceSplit(
            placement.cp_group, placement.ulysses_group, placement.cp_layout, "summaries"
        )
        self.d_model, self.n_heads, self.head_dim = spec.d_model, H, K
        self.tp_group, self.tp, self.tp_rank = tp_group, tp, comm.group_rank(tp_group)
        self.sequence_parallel = placement.sequence_parallel
        self.overlap, self.reduce_dtype = placement.overlap, placement.reduce_dtype
        # what `RotaryPositions._start_call` reads: no rotary embedding
        self.rope, self.rotary_dim, self.rope_theta = None, None, None
        self.cp_group, self.ulysses_group = placement.cp_group, placement.ulysses_group
        self.cp_layout = placement.cp_layout
        self._rope_tables, self._rope_layout_checked = {}, True
        h, d, W = H // tp, spec.d_model, spec.conv_size
        shapes = {
            **{f"{p}_weight": (h * K, d) for p in "qkv"},
            **{f"{c}_weight": (h * K, W) for c in CONV},
            "b_weight": (h, d),
            "f_a_weight": (K, d),
            "f_b_weight": (h * K, K),
            "g_a_weight": (K, d),
            "g_b_weight": (h * K, K),
            "dt_bias": (h * K,),
            "A_log": (h,),
            "norm_weight": (K,),
            "o_weight": (d, h * K),
        }
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
        if self.q_weight.device.type != "meta":
            self.reset_parameters()

    def sizes_text(self) -> str:
        return f"H {self.n_heads}, K {self.head_dim}, d {self.d_model}"

    def reset_parameters(self) -> None:
        """The full model drawn on the CPU in float32 from the current RNG state (the
        same for any TP degree), then this rank's heads: ``nn.Linear``'s and a depthwise
        ``nn.Conv1d``'s initialization, A = exp(A_log) uniform in [1, 16], dt_bias the
        inverse softplus of a dt log-uniform in [1e-3, 0.1] (FLA's), norm weight 1."""
        parts = {}
        for part, shape in self.full_shapes().items():
            if len(shape) == 2:
                bound = 1 / math.sqrt(shape[1])  # nn.Linear's and a depthwise conv's fan-in
                parts[part] = torch.empty(shape).uniform_(-bound, bound)
        shapes = self.full_shapes()
        parts["A_log"] = torch.empty(shapes["A_log"]).uniform_(1, 16).log()
        dt = torch.empty(shapes["dt_bias"]).uniform_(math.log(1e-3), math.log(0.1)).exp()
        parts["dt_bias"] = dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt
        parts["norm"] = torch.ones(shapes["norm"])
        self.load_parts(parts)

    @classmethod
    def from_dense(cls, module, placement=None, *, device=None, dtype=None, **options):
        """The layer of a Hugging Face ``KimiLinearDeltaAttention`` holding this TP
        rank's heads; `placement`, or its fields as keywords. dtype and device: the
        module's unless given."""
        if placement is None:
            placement = Placement(**cls.split_options(options, "from_dense")[1])
        elif options:
            raise TypeError(f"from_dense: a placement and keywords {sorted(options)}")
        parts = dense_parts(module)
        spec = KimiDeltaSpec(
            module.hidden_size,
            module.num_heads,
            head_dim=module.head_dim,
            conv_size=module.conv_kernel_size,
            norm_eps=module.o_norm.variance_epsilon,
        )
        weight = parts["o"]
        layer = cls.from_spec(spec, placement, device="meta", dtype=dtype or weight.dtype)
        layer.to_empty(device=device or weight.device)
        layer.load_parts(parts)
        return layer

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x (S_loc, B, d_model) -> the same shape. `cu_seqlens` (int32, the same on every
        rank): the documents packed into the full sequence (B = 1); the convs and the
        recurrent state restart at each."""
        self._start_call(x, cu_seqlens, self.q_weight)
        h, K = self.n_heads // self.tp, self.head_dim
        # one all-gather of x feeds every projection; f_a, g_a whole on each rank
        weights = [self.q_weight, self.k_weight, self.v_weight, self.b_weight]
        weights += [self.f_a_weight, self.g_a_weight]
        if self.sequence_parallel:
            q, k, v, b, fa, ga = all_gather_matmul(
                x, weights, self.tp_group, overlap=self.overlap, reduce_dtype=self.reduce_dtype
            )
        else:  # classic TP: every rank holds x whole
            x = comm.copy_to_region(x, self.tp_group)
            q, k, v, b, fa, ga = all_gather_matmul(x, weights, None)
        seq, batch = q.shape[:2]
        # (S, B, h K) -> (B, S, h, K): strided views, as every fusedpar op takes them
        q, k, v = (
            self._conv(t, getattr(self, f"{c}_weight"), cu_seqlens).unflatten(-1, (h, K))
            for t, c in zip((q, k, v), CONV, strict=True)
        )
        acc = accumulator(x.dtype)  # the decay in fp32 (float64 for float64)
        # (B, S, ...) from the GEMMs: their outputs contiguous in the ops' order
        f = F.linear(fa.transpose(0, 1), self.f_b_weight).unflatten(-1, (h, K))
        dt = self.dt_bias.to(acc).view(h, K)
        g = -self.A_log.to(acc).exp()[:, None] * F.softplus(f.to(acc) + dt)  # (B, S, h, K)
        beta = b.transpose(0, 1).sigmoid()  # (B, S, h)
        o = self.split.recurrence((q, k, v, g, beta), cu_seqlens, "summaries")  # (B, S, h, K)
        gate = F.linear(ga.transpose(0, 1), self.g_b_weight).unflatten(-1, (h, K))
        o = rms_norm_gated(o, gate, self.norm_weight, eps=self.spec.norm_eps, gate="sigmoid")
        o = o.transpose(0, 1).reshape(seq, batch, h * K)  # (S, B, h K)
        if self.sequence_parallel:
            return matmul_reduce_scatter(
                o,
                self.o_weight,
                self.tp_group,
                overlap=self.overlap,
                reduce_dtype=self.reduce_dtype,
            )
        return comm.reduce_from_region(F.linear(o, self.o_weight), self.tp_group)

    def _conv(self, t: torch.Tensor, weight: torch.Tensor, cu_seqlens) -> torch.Tensor:
        """The short conv (SiLU) of one section, (S, B, C) -> (B, S, C): each section its
        own weight, so that no activation or weight is copied to join them."""
        return self.split.conv(t.transpose(0, 1), weight, cu_seqlens, "summaries")

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, heads={self.n_heads} ({self.n_heads // self.tp} "
            f"here), head_dim={self.head_dim}, conv={self.spec.conv_size}"
        )


def dense_parts(module: nn.Module) -> dict:
    """Our full tensors of a Hugging Face ``KimiLinearDeltaAttention`` (`HF_NAMES`; its
    conv1d's q | k | v rows as conv_q, conv_k, conv_v; A_log (1, 1, H, 1) as (H,)):
    ValueError for a bias or an activation it would not compute."""
    activation = getattr(module, "activation", "silu")
    if activation not in ("silu", "swish"):
        raise ValueError(f"KimiDeltaAttention.from_dense: conv activation {activation!r}")
    biased = [n for n, m in module.named_modules() if getattr(m, "bias", None) is not None]
    if biased:
        raise ValueError(f"KimiDeltaAttention.from_dense: {biased} with a bias; Kimi has none")
    params = dict(module.named_parameters())
    parts = {part: params[name] for part, name in HF_NAMES.items()}
    parts["A_log"] = parts["A_log"].reshape(-1)
    conv = params["conv1d.weight"].squeeze(1)  # (3 H K, W)
    parts.update(zip(CONV, conv.chunk(3), strict=True))
    return parts


def dense_kda(layer: KimiDeltaAttention, params: dict) -> dict:
    """The inverse of `dense_parts`: a converted layer's full parameters `params` (its
    names) under Hugging Face's names (relative to the module), in its shapes."""
    out = {HF_NAMES[p]: params[layer.param_name(p)] for p in HF_NAMES}
    out["forget_gate.A_log"] = out["forget_gate.A_log"].reshape(1, 1, -1, 1)
    conv = [params[f"{c}_weight"] for c in CONV]
    out["conv1d.weight"] = torch.cat(conv).unsqueeze(1)  # (C, 1, W)
    return out
