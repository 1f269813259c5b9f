"""`ParallelAttention`: GQA self-attention with heads split over TP and the sequence
split over CP (ring attention), plus the rotary embedding it uses.

Activations are sequence-first, as in Megatron: x (S_loc, B, d_model), where S_loc is
this rank's share of the sequence: S / CP tokens (in `cp_layout`), and under sequence
parallelism a further 1 / TP of them (dim 0 split over TP).

| step        | op                                        | shape on a rank               |
| ----------- | ----------------------------------------- | ----------------------------- |
| QKV         | `all_gather_matmul(x, [wq, wk, wv], tp)`  | (S/CP, B, (Hq+2Hkv)/TP * hd)  |
| RoPE        | at `sequence_positions(S, cp)`            | q (B, S/CP, Hq/TP, hd)        |
| attention   | `ring_attn(q, k, v, cp, causal)`          | (B, S/CP, Hq/TP, hd)          |
| projection  | `matmul_reduce_scatter(o, wo, tp)`        | (S/CP/TP, B, d_model)         |
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from fusedpar import comm
from fusedpar.ops.linear import all_gather_matmul, matmul_reduce_scatter
from fusedpar.ops.ring_attention import ring_attn
from fusedpar.ops.sequence import sequence_positions
from fusedpar.storage import ParamLayout, local_tensor


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32):
    """cos, sin (len(positions), head_dim / 2) for rotary embeddings at `positions`, built
    on positions' device (no host-to-device copy)."""
    dims = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
    inv_freq = 1.0 / theta ** (dims / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., i], x[..., i + hd/2]) of x (B, S, H, hd) by the angles of its
    positions; cos, sin (S, hd/2). Computed in fp32, returned in x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class ParallelAttention(nn.Module):
    """GQA self-attention over TP (heads) and CP (sequence). See the module doc.

    Parameters (no biases): q_weight (Hq/TP * hd, d), k_weight and v_weight
    (Hkv/TP * hd, d), o_weight (d, Hq/TP * hd): this TP rank's heads.
    """

    def __init__(self, d_model, n_heads, n_kv_heads=None, *, tp_group=None, cp_group=None,
                 causal=True, sequence_parallel=True, cp_layout="zigzag", rope_theta=10000.0,
                 device=None, dtype=None):  # fmt: skip
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        tp = comm.group_size(tp_group)
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        for name, heads in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            if heads % tp:
                raise ValueError(f"{name} ({heads}) is not divisible by the TP degree ({tp})")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.tp_group, self.cp_group, self.tp, self.tp_rank = (
            tp_group,
            cp_group,
            tp,
            comm.group_rank(tp_group),
        )
        self.causal, self.sequence_parallel = causal, sequence_parallel
        self.cp_layout, self.rope_theta = cp_layout, rope_theta
        hd, factory = self.head_dim, {"device": device, "dtype": dtype}
        self.q_weight = nn.Parameter(torch.empty(n_heads // tp * hd, d_model, **factory))
        self.k_weight = nn.Parameter(torch.empty(n_kv_heads // tp * hd, d_model, **factory))
        self.v_weight = nn.Parameter(torch.empty(n_kv_heads // tp * hd, d_model, **factory))
        self.o_weight = nn.Parameter(torch.empty(d_model, n_heads // tp * hd, **factory))
        self._rope_tables: dict = {}  # (length, device) -> (cos, sin); not state
        if self.q_weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear`` initialization of the full projections (float32, CPU, current RNG
        state: the same model for any TP degree), then this rank's heads."""
        d, hd = self.d_model, self.head_dim

        def full(out_features, in_features):
            return torch.empty(out_features, in_features).uniform_(-1, 1) / math.sqrt(in_features)

        self.load_dense(full(self.n_heads * hd, d), full(self.n_kv_heads * hd, d),
                        full(self.n_kv_heads * hd, d), full(d, self.n_heads * hd))  # fmt: skip

    def load_dense(self, q, k, v, o) -> None:
        """Copy this rank's heads of dense projections (weights or bias-free ``nn.Linear``):
        q (Hq*hd, d), k and v (Hkv*hd, d), o (d, Hq*hd)."""
        q, k, v, o = (t.weight if isinstance(t, nn.Linear) else t for t in (q, k, v, o))
        d, hd = self.d_model, self.head_dim
        expected = {"q": (self.n_heads * hd, d), "k": (self.n_kv_heads * hd, d),
                    "v": (self.n_kv_heads * hd, d), "o": (d, self.n_heads * hd)}  # fmt: skip
        for name, t in zip("qkvo", (q, k, v, o), strict=True):
            if tuple(t.shape) != expected[name]:
                raise ValueError(f"dense {name} must be {expected[name]}, got {tuple(t.shape)}")
        with torch.no_grad():
            for param, full, dim in ((self.q_weight, q, 0), (self.k_weight, k, 0),
                                     (self.v_weight, v, 0), (self.o_weight, o, 1)):  # fmt: skip
                local_tensor(param).copy_(full.detach().chunk(self.tp, dim)[self.tp_rank])

    def param_layouts(self) -> dict:
        """For `fusedpar.distribute`: the heads split over the TP group."""
        heads, o = ParamLayout(0, self.tp_group), ParamLayout(1, self.tp_group)
        return {"q_weight": heads, "k_weight": heads, "v_weight": heads, "o_weight": o}

    @classmethod
    def from_dense(cls, q, k, v, o, d_model, n_heads, n_kv_heads=None, **kwargs):
        """A layer holding this TP rank's heads of dense q, k, v, o projections."""
        weight = q.weight if isinstance(q, nn.Linear) else q
        kwargs.setdefault("dtype", weight.dtype)
        device = kwargs.pop("device", weight.device)
        layer = cls(d_model, n_heads, n_kv_heads, device="meta", **kwargs)
        layer.to_empty(device=device)
        layer.load_dense(q, k, v, o)
        return layer

    def _rope(self, full_len: int, device: torch.device):
        """cos, sin at this rank's global positions, built on the device once per length."""
        key = (full_len, device)
        if key not in self._rope_tables:
            if len(self._rope_tables) >= 4:  # lengths that vary (evaluation): keep a few
                self._rope_tables.clear()
            positions = sequence_positions(full_len, self.cp_group, layout=self.cp_layout,
                                           device=device)  # fmt: skip
            self._rope_tables[key] = rope_tables(positions, self.head_dim, self.rope_theta)
        return self._rope_tables[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (S_loc, B, d_model) -> the same shape (see the module doc)."""
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"ParallelAttention takes x (S_loc, B, d_model={self.d_model}), "
                             f"got {tuple(x.shape)}")  # fmt: skip
        weights = [self.q_weight, self.k_weight, self.v_weight]
        if self.sequence_parallel:
            q, k, v = all_gather_matmul(x, weights, self.tp_group)
        else:
            x = comm.copy_to_region(x, self.tp_group)
            q, k, v = (F.linear(x, w) for w in weights)
        seq, batch, hd = q.shape[0], q.shape[1], self.head_dim
        # (S, B, H*hd) -> (B, S, H, hd): a strided view, read in place by the kernels
        q, k, v = (t.view(seq, batch, -1, hd).transpose(0, 1) for t in (q, k, v))
        cos, sin = self._rope(seq * comm.group_size(self.cp_group), x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = ring_attn(q, k, v, self.cp_group, causal=self.causal, layout=self.cp_layout)
        out = out.transpose(0, 1).reshape(seq, batch, -1)  # (S, B, Hq/TP * hd)
        if self.sequence_parallel:
            return matmul_reduce_scatter(out, self.o_weight, self.tp_group)
        return comm.reduce_from_region(F.linear(out, self.o_weight), self.tp_group)
