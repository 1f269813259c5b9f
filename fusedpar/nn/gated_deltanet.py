"""`GatedDeltaNet`: the linear-attention layer of Qwen3-Next, Qwen3.5 and OLMo Hybrid,
heads split over TP, built from a `GatedDeltaNetSpec` and a placement. x is
sequence-first (S_loc, B, d), S_loc = S / TP under sequence parallelism. On a rank
(hk, hv = Hk / TP, Hv / TP):

| step         | op                                                  | shape on a rank     |
| ------------ | --------------------------------------------------- | ------------------- |
| projections  | `all_gather_matmul(x, [wq, wk, wv, wz, wb, wa], tp)` | q (S, B, hk K), ... |
| conv + SiLU  | `causal_conv1d` over q, k and v, each its own        | (B, S, hk K), ...   |
| gates        | beta = sigmoid(b) (x2), g = -exp(A_log) softplus(a + dt_bias) | (B, S, hv) |
| recurrence   | `gated_delta_rule(q, k, v, g, beta, l2norm)`        | (B, S, hv, V)       |
| gated norm   | `rms_norm_gated(o, z, w)` per head, w (V,) whole    | (B, S, hv, V)       |
| out          | `matmul_reduce_scatter(o, wo, tp)`                  | (S_loc, B, d)       |

Each section (q, k, v, z, b, a, the conv's q, k, v channels, A_log, dt_bias) is its
own parameter, head-major, split by whole heads: a TP split (or a DCP reshard) cannot
mix sections. Packed documents: `forward(x, cu_seqlens)` resets the conv and the state
at each document. Context parallelism: `fusedpar.nn.gated_deltanet_cp`. `from_dense`:
`fusedpar.nn.gated_deltanet_dense`. docs/linear_attention_layer.md.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from fusedpar import comm
from fusedpar.kernels.common import accumulator
from fusedpar.nn.gated_deltanet_cp import SequenceSplit
from fusedpar.nn.gated_deltanet_dense import dense_parts, detect_layout
from fusedpar.nn.head_parts import HeadParts
from fusedpar.nn.rotary import RotaryPositions
from fusedpar.nn.specs import FromSpec, GatedDeltaNetSpec
from fusedpar.ops.linear import all_gather_matmul, matmul_reduce_scatter
from fusedpar.ops.norm import rms_norm_gated
from fusedpar.placement import Placement
from fusedpar.plan.linear_context import LinearSizes

# our full tensors: name -> the dim split over TP (None: whole on every rank)
SPLIT_DIMS = {
    **{s: 0 for s in ("q", "k", "v", "z", "b", "a", "conv_q", "conv_k", "conv_v")},
    "A_log": 0,
    "dt_bias": 0,
    "norm": None,
    "o": 1,
}


class GatedDeltaNet(FromSpec, HeadParts, RotaryPositions, nn.Module):
    """Gated DeltaNet over TP (heads). See the module doc.

    | parameter                            | shape on a rank   |
    | ------------------------------------ | ----------------- |
    | `q_weight`, `k_weight`               | (hk K, d)         |
    | `v_weight`, `z_weight`               | (hv V, d)         |
    | `b_weight`, `a_weight`               | (hv, d)           |
    | `conv_q_weight`, `conv_k_weight`     | (hk K, W)         |
    | `conv_v_weight`                      | (hv V, W)         |
    | `A_log`, `dt_bias`                   | (hv,)             |
    | `norm_weight`                        | (V,), whole       |
    | `o_weight`                           | (d, hv V)         |

    ``GatedDeltaNet(d_model, n_k_heads, n_v_heads, head_k_dim=K, ...)``: the spec's
    fields (`GatedDeltaNetSpec`) and the placement's (`fusedpar.Placement`: tp_group,
    sequence_parallel, overlap, reduce_dtype) as keywords, or ``from_spec(spec,
    placement)``; the same layer either way (``self.spec``, ``self.placement``).
    """

    GROUP_AXES = {"tp_group": ("tp",)}
    SPLIT_DIMS = SPLIT_DIMS
    SPEC = GatedDeltaNetSpec
    _fusedpar_checked = False  # until the first call's checks pass (`fusedpar.checks`)

    def __init__(
        self,
        d_model,
        n_k_heads,
        n_v_heads=None,
        *,
        head_k_dim,
        device=None,
        dtype=None,
        **options,
    ):
        spec_options, placement_options = self.split_options(options, "GatedDeltaNet")
        spec = GatedDeltaNetSpec(
            d_model,
            n_k_heads,
            n_v_heads,
            head_k_dim=head_k_dim,
            **spec_options,
        )
        placement = Placement(**placement_options)
        self._build(spec, placement, device, dtype)

    def _build(self, spec: GatedDeltaNetSpec, placement: Placement, device, dtype) -> None:
        """The layer of `spec` on `placement`: the checks that need the groups (no CP,
        heads over TP), then the parameters."""
        super().__init__()
        Hk, Hv, K, V = spec.sizes
        tp_group = placement.tp_group
        tp = comm.group_size(tp_group)
        if Hk % tp:
            raise ValueError(
                f"GatedDeltaNet: n_k_heads ({Hk}) is not divisible by the TP degree ({tp}) "
                f"(n_v_heads {Hv} follow their k-heads)"
            )
        split = SequenceSplit(
            placement.cp_group,
            placement.ulysses_group,
            placement.cp_layout,
            placement.linear_cp_mode,
        )
        split.check(Hk // tp, Hv // tp)
        self.spec, self.placement, self.split = spec, placement, split
        self.d_model, self.n_k_heads, self.n_v_heads = spec.d_model, Hk, Hv
        self.head_k_dim, self.head_v_dim = K, V
        self.tp_group, self.tp, self.tp_rank = tp_group, tp, comm.group_rank(tp_group)
        self.sequence_parallel = placement.sequence_parallel
        self.overlap, self.reduce_dtype = placement.overlap, placement.reduce_dtype
        # what `RotaryPositions._start_call` reads: no rotary embedding
        self.rope, self.rotary_dim, self.rope_theta = None, None, None
        self.cp_group, self.ulysses_group = placement.cp_group, placement.ulysses_group
        self.cp_layout = placement.cp_layout
        self._rope_tables, self._rope_layout_checked = {}, True
        hk, hv, d, W = Hk // tp, Hv // tp, spec.d_model, spec.conv_size
        factory = {"device": device, "dtype": dtype}
        shapes = {
            "q_weight": (hk * K, d),
            "k_weight": (hk * K, d),
            "v_weight": (hv * V, d),
            "z_weight": (hv * V, d),
            "b_weight": (hv, d),
            "a_weight": (hv, d),
            "conv_q_weight": (hk * K, W),
            "conv_k_weight": (hk * K, W),
            "conv_v_weight": (hv * V, W),
            "A_log": (hv,),
            "dt_bias": (hv,),
            "norm_weight": (V,),
            "o_weight": (d, hv * V),
        }
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, **factory)))
        if self.q_weight.device.type != "meta":
            self.reset_parameters()

    @property
    def linear_sizes(self) -> LinearSizes:
        """This rank's heads and sizes, for the CP mode's byte count."""
        Hk, Hv, K, V = self.spec.sizes
        return LinearSizes(Hk // self.tp, Hv // self.tp, K, V, self.spec.conv_size)

    def sizes_text(self) -> str:
        return f"Hk {self.n_k_heads}, Hv {self.n_v_heads}, K {self.head_k_dim}, V {self.head_v_dim}"

    def reset_parameters(self) -> None:
        """The full model drawn on the CPU in float32 from the current RNG state (the same
        for any TP degree), then this rank's heads: ``nn.Linear``'s and a depthwise
        ``nn.Conv1d``'s initialization, A = exp(A_log) uniform in [1, 16], dt_bias 1,
        norm weight 1."""
        parts = {}
        for part, shape in self.full_shapes().items():
            if part in ("A_log", "dt_bias", "norm"):
                continue
            bound = 1 / math.sqrt(shape[1])  # nn.Linear's and a depthwise conv's fan-in
            parts[part] = torch.empty(shape).uniform_(-bound, bound)
        Hv = self.n_v_heads
        parts["A_log"] = torch.empty(Hv).uniform_(1, 16).log()
        parts["dt_bias"] = torch.ones(Hv)
        parts["norm"] = torch.ones(self.head_v_dim)
        self.load_parts(parts)

    @classmethod
    def from_dense(cls, module, placement=None, *, device=None, dtype=None, **options):
        """The layer of a Hugging Face GDN module (``Qwen3NextGatedDeltaNet``,
        ``Qwen3_5GatedDeltaNet``, ``OlmoHybridGatedDeltaNet``; the layout read off its
        projections' names, `fusedpar.nn.gated_deltanet_dense`) holding this TP rank's
        heads; `placement`, or its fields as keywords (tp_group, sequence_parallel,
        overlap, reduce_dtype). dtype and device: the module's unless given."""
        if placement is None:
            placement = Placement(**cls.split_options(options, "from_dense")[1])
        elif options:
            raise TypeError(f"from_dense: a placement and keywords {sorted(options)}")
        layout = detect_layout(module)
        activation = getattr(module, "activation", "silu")
        if activation not in ("silu", "swish"):
            raise ValueError(f"GatedDeltaNet.from_dense: conv activation {activation!r}, not silu")
        norm = module.o_norm if layout == "olmo_hybrid" else module.norm
        spec = GatedDeltaNetSpec(
            module.hidden_size,
            module.num_k_heads,
            module.num_v_heads,
            head_k_dim=module.head_k_dim,
            head_v_dim=module.head_v_dim,
            conv_size=module.conv_kernel_size,
            norm_eps=norm.variance_epsilon,
            norm_gate=getattr(norm, "activation", "silu"),
            allow_neg_eigval=bool(getattr(module, "allow_neg_eigval", False)),
            layout=layout,
        )
        parts = dense_parts(module, layout, spec.sizes)
        weight = parts["o"]
        layer = cls.from_spec(spec, placement, device="meta", dtype=dtype or weight.dtype)
        layer.to_empty(device=device or weight.device)
        layer.load_parts(parts)
        return layer

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x (S_loc, B, d_model) -> the same shape. `cu_seqlens` (int32, the same on every
        rank): the documents packed into the full sequence (B = 1), as in
        `ParallelAttention`; the conv and the recurrent state restart at each."""
        self._start_call(x, cu_seqlens, self.q_weight)
        Hk, Hv = self.n_k_heads // self.tp, self.n_v_heads // self.tp
        K, V = self.head_k_dim, self.head_v_dim
        # each section its own GEMM and conv, on its own parameter: no per-call copy of
        # the weights (q|k|v concatenated was 34 MB a layer at Qwen3.5-35B, TP 1)
        weights = [self.q_weight, self.k_weight, self.v_weight, self.z_weight]
        weights += [self.b_weight, self.a_weight]
        if self.sequence_parallel:  # one all-gather of x feeds every projection
            q, k, v, z, b, a = all_gather_matmul(
                x, weights, self.tp_group, overlap=self.overlap, reduce_dtype=self.reduce_dtype
            )
        else:  # classic TP: every rank holds x whole
            x = comm.copy_to_region(x, self.tp_group)
            q, k, v, z, b, a = all_gather_matmul(x, weights, None)
        seq, batch = q.shape[:2]
        convs = [self.conv_q_weight, self.conv_k_weight, self.conv_v_weight]
        A_log, dt_bias = self.A_log, self.dt_bias
        # (S, B, C) -> (B, S, C): strided views, as every fusedpar op takes them
        q, k, v, b, a = (t.transpose(0, 1) for t in (q, k, v, b, a))
        mode = self.split.mode_for(self.linear_sizes, seq)
        if mode == "ulysses":  # this rank's heads over its ring rank's whole share
            q, k, v, b, a = self.split.exchange_heads([q, k, v, b, a], [Hk, Hk, Hv, Hv, Hv])
            Hk, Hv = Hk // self.split.ulysses_size, Hv // self.split.ulysses_size
            convs, A_log, dt_bias = (
                [self.split.heads_of(w) for w in convs],
                *(self.split.heads_of(t) for t in (A_log, dt_bias)),
            )
        q, k, v = (
            self.split.conv(t, w, cu_seqlens, mode) for t, w in zip((q, k, v), convs, strict=True)
        )
        length = q.shape[1]
        q, k = q.reshape(batch, length, Hk, K), k.reshape(batch, length, Hk, K)
        v = v.reshape(batch, length, Hv, V)
        beta = b.sigmoid() * 2 if self.spec.allow_neg_eigval else b.sigmoid()
        acc = accumulator(x.dtype)  # the decay in fp32 (float64 for float64)
        g = -A_log.to(acc).exp() * F.softplus(a.to(acc) + dt_bias.to(acc))
        o = self.split.recurrence((q, k, v, g, beta), cu_seqlens, mode)  # (B, S, hv, V)
        if mode == "ulysses":
            o, Hv = self.split.return_heads(o), Hv * self.split.ulysses_size
        z = z.transpose(0, 1).reshape(batch, seq, Hv, V)
        o = rms_norm_gated(o, z, self.norm_weight, eps=self.spec.norm_eps, gate=self.spec.norm_gate)
        o = o.transpose(0, 1).reshape(seq, batch, Hv * V)  # (S, B, hv V)
        if self.sequence_parallel:
            return matmul_reduce_scatter(
                o,
                self.o_weight,
                self.tp_group,
                overlap=self.overlap,
                reduce_dtype=self.reduce_dtype,
            )
        return comm.reduce_from_region(F.linear(o, self.o_weight), self.tp_group)
