"""`ParallelMLA`: DeepSeek-V3's multi-head latent attention, heads split over TP and the
sequence over CP (the ring, Ulysses or both, on the expanded heads).

Activations are sequence-first, as `ParallelAttention`'s: x (S_loc, B, d_model).

| step      | op                                             | shape on a rank            |
| --------- | ---------------------------------------------- | -------------------------- |
| latents   | `all_gather_matmul(x, [w_qa, w_kva], tp)`      | (S, B, r_q), (S, B, r_kv + dr) |
| q         | ``rms_norm(c_q) @ w_qb.T`` (or ``x @ w_q.T``)  | (B, S, H/TP, dr + dn)      |
| k, v      | ``rms_norm(c_kv) @ w_kvb.T``; k_rope shared    | (B, S, H/TP, dr + dn / dv) |
| attention | `ring_attn` (V of its own head dim)            | (B, S, H/TP, dv)           |
| output    | `matmul_reduce_scatter(o, w_o, tp)`            | (S_loc, B, d_model)        |

with r_q = `q_lora_rank`, r_kv = `kv_lora_rank`, dn = `qk_nope_head_dim`, dr =
`qk_rope_head_dim`, dv = `v_head_dim`. Each head's q and k hold their rotary dims
first (half layout, pairs (i, i + dr/2)), then the rest: a permutation of Hugging
Face's (nope, rope) rows that leaves every score unchanged (`load_dense` applies it,
`dense_rows` undoes it). The latent projections and their norms are whole on every TP
rank; each rank's gradient of them is its own heads' share (`param_layouts`: partial
over TP, summed by `fusedpar.distribute`), as a per-head q/k norm's weight is.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fusedpar import comm
from fusedpar.nn.attention_parts import apply_rope, norm_weight
from fusedpar.nn.linear import linear_parts
from fusedpar.nn.rotary import RotaryPositions
from fusedpar.nn.specs import CP_RINGS, DEFAULT_ROPE, FromSpec, MLASpec  # noqa: F401 (CP_RINGS)
from fusedpar.ops.linear import all_gather_matmul, matmul_reduce_scatter
from fusedpar.ops.mla_ring import mla_ring_attn
from fusedpar.ops.norm import rms_norm
from fusedpar.ops.ring_attention import masked_ring_attn
from fusedpar.ops.ulysses import check_heads
from fusedpar.placement import Placement
from fusedpar.storage import ParamLayout, local_tensor


def _head_order(nope: int, rope: int, interleaved: bool) -> torch.Tensor:
    """Per head, the dense (nope, rope) row each of this layer's (rope, nope) rows takes;
    interleaved rotary pairs (2i, 2i + 1) to the half layout."""
    rotary = torch.arange(rope)
    if interleaved:
        rotary = torch.cat([rotary[0::2], rotary[1::2]])
    return torch.cat([nope + rotary, torch.arange(nope)])


def layer_rows(
    name: str,
    t: torch.Tensor,
    *,
    nope: int,
    rope: int,
    kv_lora_rank: int,
    rope_interleave: bool = False,
    inverse: bool = False,
) -> torch.Tensor:
    """Rows of a full `ParallelMLA` parameter `name` from Hugging Face's layout (q's
    heads (nope, rope) -> (rope, nope), kv_a's rotary rows, interleaved pairs to the
    half layout), or back with `inverse`; other parameters as they are. A tensor or a
    gradient alike."""
    order = _head_order(nope, rope, rope_interleave)
    if name in ("q_b_weight", "q_weight"):
        heads = t.shape[0] // (nope + rope)
        order = order.argsort() if inverse else order
        return t.reshape(heads, nope + rope, -1)[:, order].reshape(t.shape)
    if name in ("kv_a_weight", "kv_a_bias"):
        rows = torch.cat([torch.arange(kv_lora_rank), kv_lora_rank + order[:rope] - nope])
        return t[rows.argsort() if inverse else rows]
    return t


def latent_moves_less(heads: int, nope: int, rope: int, v_dim: int, kv_lora_rank: int) -> bool:
    """Whether the latent and k_rope (r + dr values a token) are fewer than a rank's
    `heads` expanded K and V: what ``cp_ring="auto"`` decides on a GPU (and
    `fusedpar.plan` with it)."""
    return kv_lora_rank + rope < heads * (nope + rope + v_dim)


class ParallelMLA(FromSpec, RotaryPositions, nn.Module):
    """Multi-head latent attention over TP (heads) and CP (sequence). See the module doc.

    | parameter          | shape on a rank               | notes                      |
    | ------------------ | ----------------------------- | -------------------------- |
    | `q_a_weight`       | (r_q, d)                      | whole; ``q_lora_rank``     |
    | `q_a_norm_weight`  | (r_q,)                        | whole                      |
    | `q_b_weight`       | (H/TP * (dr + dn), r_q)       | this rank's heads          |
    | `q_weight`         | (H/TP * (dr + dn), d)         | ``q_lora_rank=None``       |
    | `kv_a_weight`      | (r_kv + dr, d)                | whole                      |
    | `kv_a_norm_weight` | (r_kv,)                       | whole                      |
    | `kv_b_weight`      | (H/TP * (dn + dv), r_kv)      | this rank's heads          |
    | `o_weight`         | (d, H/TP * dv)                | this rank's heads          |
    | `q_a_bias`, `kv_a_bias`, `o_bias` | (r_q,), (r_kv + dr,), (d,) | ``bias=True``, whole |

    ``rope``: as `ParallelAttention`'s (a callable ``positions -> (cos, sin)`` of width
    dr, e.g. the model's own YaRN module; left out: the tables of `rope_theta`; None:
    NoPE, Kimi Linear's, whose dr shared k dims stay, unrotated, dr = 0 allowed).
    ``softmax_scale``: default (dn + dr) ** -0.5 (DeepSeek-V3's config carries YaRN's
    mscale squared: pass it). ``cp_ring``: "expanded" (`ring_attn` moves each rank's
    heads' K and V), "latent" (`fusedpar.ops.mla_ring`: the latent travels, each step
    expands it; a plain ring only) or "auto" (`latent_ring`).

    Built from these keywords, or ``from_spec(MLASpec, Placement)`` (`fusedpar.nn.specs`),
    the same layer either way, which keeps both (``self.spec``, ``self.placement``).
    """

    GROUP_AXES = {"tp_group": ("tp",), "cp_group": ("cp",), "ulysses_group": ("ulysses",)}
    SPEC = MLASpec
    _fusedpar_checked = False

    def __init__(
        self,
        d_model,
        n_heads,
        *,
        q_lora_rank,
        kv_lora_rank,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim,
        bias=False,
        norm_eps=1e-6,
        rope: Callable | str | None = DEFAULT_ROPE,
        rope_theta=10000.0,
        softmax_scale=None,
        tp_group=None,
        cp_group=None,
        ulysses_group=None,
        cp_mode=None,
        cp_layout="zigzag",
        cp_ring="auto",
        sequence_parallel=True,
        overlap=None,
        reduce_dtype=None,
        device=None,
        dtype=None,
    ):
        spec = MLASpec(
            d_model,
            n_heads,
            q_lora_rank=q_lora_rank,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            bias=bias,
            norm_eps=norm_eps,
            rope=rope,
            rope_theta=rope_theta,
            softmax_scale=softmax_scale,
            cp_ring=cp_ring,
        )
        placement = Placement(
            tp_group=tp_group,
            cp_group=cp_group,
            ulysses_group=ulysses_group,
            cp_mode=cp_mode,
            cp_layout=cp_layout,
            sequence_parallel=sequence_parallel,
            overlap=overlap,
            reduce_dtype=reduce_dtype,
        )
        self._build(spec, placement, device, dtype)

    def _build(self, spec: MLASpec, placement: Placement, device, dtype) -> None:
        """The layer of `spec` on `placement` (`__init__` and `from_spec`): the checks
        that need the groups (heads over TP and Ulysses, the latent ring's mode), then
        the parameters."""
        super().__init__()  # (cooperative: a subclass's other bases too)
        self.spec, self.placement = spec, placement
        n_heads, tp_group, ulysses_group = spec.n_heads, placement.tp_group, placement.ulysses_group
        tp = comm.group_size(tp_group)
        if n_heads % tp:
            raise ValueError(
                f"ParallelMLA: n_heads ({n_heads}) is not divisible by the TP degree ({tp})"
            )
        self.cp_mode = placement.cp_mode
        if spec.cp_ring == "latent" and self.cp_mode != "ring":
            raise ValueError(
                f"ParallelMLA: cp_ring='latent' moves the latent around a ring "
                f"alone; cp_mode is {self.cp_mode!r}"
            )
        # "auto": the latent ring on a GPU where it moves fewer values a token than the
        # expanded heads (DeepSeek-V3: 576 against H/TP x 320); on a CPU the expanded
        # ring (measured faster over gloo, 2 cores, 4 ranks, S = 1k: 0.41 s against 0.45
        # at 4 heads a rank, 1.09 against 1.45 at 16: each step's expansion, twice in the
        # backward, costs more there than the bytes it saves, 2.2x and 8.9x fewer)
        self.cp_ring = spec.cp_ring
        nope, rope_dim, v_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        q_lora_rank, kv_lora_rank, d_model = spec.q_lora_rank, spec.kv_lora_rank, spec.d_model
        self._latent_moves_less = latent_moves_less(
            n_heads // tp, nope, rope_dim, v_dim, kv_lora_rank
        )
        if comm.group_size(ulysses_group) > 1:
            check_heads(
                n_heads // tp,
                n_heads // tp,
                comm.group_size(ulysses_group),
                f"ParallelMLA (n_heads {n_heads}, TP {tp})",
            )
        self.overlap, self.reduce_dtype = placement.overlap, placement.reduce_dtype
        self.d_model, self.n_heads, self.norm_eps = d_model, n_heads, spec.norm_eps
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = nope, rope_dim, v_dim
        self.qk_dim = nope + rope_dim
        self._mask = spec.mask  # causal, at the scale below
        self.softmax_scale = self._mask.softmax_scale
        self.tp_group, self.cp_group, self.ulysses_group = (
            tp_group,
            placement.cp_group,
            ulysses_group,
        )
        self.tp, self.tp_rank = tp, comm.group_rank(tp_group)
        self.cp_layout, self.sequence_parallel = placement.cp_layout, placement.sequence_parallel
        # `RotaryPositions`: the tables of the rotary dims
        self.rope, self.rope_theta, self.rotary_dim = spec.rope, spec.rope_theta, rope_dim
        self._rope_tables: dict = {}
        self._rope_layout_checked = False
        heads, factory = n_heads // tp, {"device": device, "dtype": dtype}

        def param(on, *shape):
            return nn.Parameter(torch.empty(shape, **factory)) if on else None

        lora, bias = q_lora_rank is not None, spec.bias
        self.q_a_weight = param(lora, q_lora_rank or 0, d_model)
        self.q_a_norm_weight = param(lora, q_lora_rank or 0)
        self.q_b_weight = param(lora, heads * self.qk_dim, q_lora_rank or 0)
        self.q_weight = param(not lora, heads * self.qk_dim, d_model)
        self.kv_a_weight = param(True, kv_lora_rank + rope_dim, d_model)
        self.kv_a_norm_weight = param(True, kv_lora_rank)
        self.kv_b_weight = param(True, heads * (nope + v_dim), kv_lora_rank)
        self.o_weight = param(True, d_model, heads * v_dim)
        self.q_a_bias = param(bias and lora, q_lora_rank or 0)
        self.kv_a_bias = param(bias, kv_lora_rank + rope_dim)
        self.o_bias = param(bias, d_model)
        if self.kv_a_weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear`` initialization of the dense projections (fp32, CPU, the current
        RNG state: one model for any TP degree), norm weights 1."""
        d, H, lora, bias = self.d_model, self.n_heads, self.q_lora_rank, self.o_bias is not None
        q = (
            (nn.Linear(d, lora, bias=bias), nn.Linear(lora, H * self.qk_dim, bias=False))
            if lora
            else nn.Linear(d, H * self.qk_dim, bias=False)
        )
        self.load_dense(
            q,
            nn.Linear(d, self.kv_lora_rank + self.rope_dim, bias=bias),
            nn.Linear(self.kv_lora_rank, H * (self.nope + self.v_dim), bias=False),
            nn.Linear(H * self.v_dim, d, bias=bias),
            q_a_norm=torch.ones(lora) if lora else None,
            kv_a_norm=torch.ones(self.kv_lora_rank),
        )

    def load_dense(
        self, q, kv_a, kv_b, o, *, q_a_norm=None, kv_a_norm, rope_interleave: bool = False
    ) -> None:
        """Copy dense projections in Hugging Face's layout (``nn.Linear``s or weight
        tensors): q as ``(q_a_proj, q_b_proj)`` or ``q_proj``, ``kv_a_proj_with_mqa``,
        ``kv_b_proj``, ``o_proj``, the two latent norms (modules with ``.weight`` or
        tensors). ``rope_interleave``: the rotary dims pair (2i, 2i + 1) (DeepSeek-V3's
        ``rope_interleave``), permuted here into the half layout."""
        H, tp = self.n_heads, self.tp
        lora = self.q_lora_rank is not None
        if isinstance(q, tuple) != lora:
            raise ValueError(
                f"ParallelMLA: q must be {'(q_a, q_b)' if lora else 'q_proj'} for "
                f"q_lora_rank={self.q_lora_rank}"
            )
        rows = dict(
            nope=self.nope,
            rope=self.rope_dim,
            kv_lora_rank=self.kv_lora_rank,
            rope_interleave=rope_interleave,
        )
        copies = []  # (parameter, full tensor, split over TP by rows or columns or None)
        if lora:
            (q_a, q_a_bias), (q_b, _) = linear_parts("q_a", q[0]), linear_parts("q_b", q[1])
            copies += [
                (self.q_a_weight, q_a, None),
                (self.q_a_bias, q_a_bias, None),
                (self.q_a_norm_weight, norm_weight("q_a_norm", q_a_norm), None),
            ]
        else:
            q_b, _ = linear_parts("q", q)
        if q_b.shape[0] != H * self.qk_dim:
            raise ValueError(
                f"ParallelMLA: dense q has {q_b.shape[0]} rows, not heads x "
                f"(nope + rope) = {H * self.qk_dim}"
            )
        q_b = layer_rows("q_weight", q_b, **rows)
        kv_a, kv_a_bias = linear_parts("kv_a", kv_a)
        if kv_a.shape[0] != self.kv_lora_rank + self.rope_dim:
            raise ValueError(
                f"ParallelMLA: dense kv_a has {kv_a.shape[0]} rows, not "
                f"kv_lora_rank + rope = "
                f"{self.kv_lora_rank + self.rope_dim}"
            )
        (kv_b, _), (o, o_bias) = linear_parts("kv_b", kv_b), linear_parts("o", o)
        copies += [
            (self.q_b_weight if lora else self.q_weight, q_b, 0),
            (self.kv_a_weight, layer_rows("kv_a_weight", kv_a, **rows), None),
            (
                self.kv_a_bias,
                None if kv_a_bias is None else layer_rows("kv_a_bias", kv_a_bias, **rows),
                None,
            ),
            (self.kv_a_norm_weight, norm_weight("kv_a_norm", kv_a_norm), None),
            (self.kv_b_weight, kv_b, 0),
            (self.o_weight, o, 1),
            (self.o_bias, o_bias, None),
        ]
        for param, full, dim in copies:
            if (param is None) != (full is None):
                raise ValueError(
                    f"ParallelMLA: the dense projections' biases "
                    f"{'missing' if full is None else 'given'}, but this layer "
                    f"was built with bias={self.o_bias is not None}"
                )
            if param is None:
                continue
            expected = tuple(param.shape)
            if dim is not None:
                expected = tuple(s * tp if i == dim else s for i, s in enumerate(expected))
            if tuple(full.shape) != expected:
                name = next(n for n, p in self.named_parameters() if p is param)
                raise ValueError(
                    f"ParallelMLA: dense {name} must be {expected}, got {tuple(full.shape)}"
                )
            part = full if dim is None else full.chunk(tp, dim)[self.tp_rank]
            with torch.no_grad():
                local_tensor(param).copy_(part.detach())

    @classmethod
    def from_dense(
        cls,
        q,
        kv_a,
        kv_b,
        o,
        d_model,
        n_heads,
        *,
        q_a_norm=None,
        kv_a_norm,
        rope_interleave: bool = False,
        **kwargs,
    ):
        """A layer holding this TP rank's heads of dense projections (`load_dense`'s
        arguments); ``q_lora_rank``, ``kv_lora_rank`` and ``bias`` read off them. Pass
        the head dims (``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``), the
        scale and the rotary tables (``rope``, or ``rope_theta``)."""
        lora = isinstance(q, tuple)
        kwargs.setdefault("q_lora_rank", linear_parts("q_a", q[0])[0].shape[0] if lora else None)
        kwargs.setdefault("kv_lora_rank", norm_weight("kv_a_norm", kv_a_norm).numel())
        kv_a_weight, kv_a_bias = linear_parts("kv_a", kv_a)
        kwargs.setdefault("bias", kv_a_bias is not None)
        kwargs.setdefault("dtype", kv_a_weight.dtype)
        device = kwargs.pop("device", kv_a_weight.device)
        layer = cls(d_model, n_heads, device="meta", **kwargs)
        layer.to_empty(device=device)
        layer.load_dense(
            q,
            kv_a,
            kv_b,
            o,
            q_a_norm=q_a_norm,
            kv_a_norm=kv_a_norm,
            rope_interleave=rope_interleave,
        )
        return layer

    def dense_rows(self, name: str, t: torch.Tensor, rope_interleave: bool = False):
        """`t` (a full parameter of `name`, or its gradient) in Hugging Face's layout: the
        inverse of `load_dense`'s row permutations (`layer_rows`)."""
        return layer_rows(
            name,
            t,
            nope=self.nope,
            rope=self.rope_dim,
            kv_lora_rank=self.kv_lora_rank,
            rope_interleave=rope_interleave,
            inverse=True,
        )

    def latent_ring(self, x: torch.Tensor) -> bool:
        """Whether the ring moves the latent for input `x` (`cp_ring`; see `__init__`)."""
        if self.cp_mode != "ring" or comm.group_size(self.cp_group) == 1:
            return False
        auto = self.cp_ring == "auto" and self._latent_moves_less and x.device.type == "cuda"
        return self.cp_ring == "latent" or auto

    def param_layouts(self) -> dict:
        """For `fusedpar.distribute`: the heads' projections split over TP (o by columns);
        the latent projections, their norms and biases whole, each TP rank's gradient a
        partial sum over its own heads; the o bias whole, complete (added once per token
        after the reduce-scatter)."""
        heads, tp = ParamLayout(0, self.tp_group), (self.tp_group,)
        shared = ParamLayout(partial_over=tp)
        return {
            "q_a_weight": shared,
            "q_a_norm_weight": shared,
            "q_a_bias": shared,
            "q_b_weight": heads,
            "q_weight": heads,
            "kv_a_weight": shared,
            "kv_a_bias": shared,
            "kv_a_norm_weight": shared,
            "kv_b_weight": heads,
            "o_weight": ParamLayout(1, self.tp_group),
            "o_bias": ParamLayout(complete_over=tp),
        }

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x (S_loc, B, d_model) -> the same shape; `cu_seqlens` as `ParallelAttention`'s."""
        tables = self._start_call(x, cu_seqlens, self.kv_a_weight)  # None: NoPE
        group = self.tp_group if self.sequence_parallel else None
        if not self.sequence_parallel:  # every rank holds x whole: its gradient is summed
            x = comm.copy_to_region(x, self.tp_group)
        gather = dict(overlap=self.overlap, reduce_dtype=self.reduce_dtype)
        lora = self.q_lora_rank is not None
        first = self.q_a_weight if lora else self.q_weight
        q, kv = all_gather_matmul(
            x, [first, self.kv_a_weight], group, bias=[self.q_a_bias, self.kv_a_bias], **gather
        )
        if lora:  # (S, B, r_q) -> this rank's heads
            q = F.linear(rms_norm(q, self.q_a_norm_weight, self.norm_eps), self.q_b_weight)
        latent, k_rope = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = rms_norm(latent, self.kv_a_norm_weight, self.norm_eps)
        S, B = q.shape[:2]
        # (S, B, ...) -> (B, S, H/TP, ...): strided views, read in place
        q = q.view(S, B, -1, self.qk_dim).transpose(0, 1)
        k_rope = k_rope.reshape(S, B, 1, self.rope_dim).transpose(0, 1)
        if tables is not None:  # (NoPE, rope=None: Kimi Linear's k_rope dims stay unrotated)
            q, k_rope = apply_rope(q, *tables), apply_rope(k_rope, *tables)
        if self.latent_ring(x):  # (B, S, r + dr) travels; each step expands it
            moving = torch.cat([latent.transpose(0, 1), k_rope[:, :, 0]], dim=-1)
            out = mla_ring_attn(
                q,
                moving,
                self.kv_b_weight,
                self.cp_group,
                qk_nope_head_dim=self.nope,
                v_head_dim=self.v_dim,
                softmax_scale=self._mask.softmax_scale,
                layout=self.cp_layout,
                cu_seqlens=cu_seqlens,
            )
        else:
            kv = F.linear(latent, self.kv_b_weight).view(S, B, -1, self.nope + self.v_dim)
            k_nope, v = kv.transpose(0, 1).split([self.nope, self.v_dim], dim=-1)
            k = torch.cat([k_rope.expand(-1, -1, k_nope.shape[2], -1), k_nope], dim=-1)
            out = masked_ring_attn(
                q,
                k,
                v,
                self.cp_group,
                self._mask,
                layout=self.cp_layout,
                cu_seqlens=cu_seqlens,
                ulysses_group=self.ulysses_group,
            )
        out = out.transpose(0, 1).reshape(S, B, -1)  # (S, B, H/TP * dv)
        if self.sequence_parallel:
            bias = None if self.o_bias is None else comm.copy_to_region(self.o_bias, self.tp_group)
            return matmul_reduce_scatter(out, self.o_weight, self.tp_group, bias=bias, **gather)
        y = comm.reduce_from_region(F.linear(out, self.o_weight), self.tp_group)
        return y if self.o_bias is None else y + self.o_bias

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, heads={self.n_heads} ({self.n_heads // self.tp} here), "
            f"q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk=({self.nope} + {self.rope_dim}), v={self.v_dim}"
        )
