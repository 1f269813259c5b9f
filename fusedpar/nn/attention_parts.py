"""The pieces of `ParallelAttention` that act on q and k one token at a time: the
rotary embedding, the q/k norms, and the output gate (`split_gate`, `sigmoid_gate`).

| `qk_norm` | statistics over                          | weight on a rank     | e.g.          |
| --------- | ---------------------------------------- | -------------------- | ------------- |
| "head"    | each head's hd dims                      | (hd,), whole         | Qwen3, Gemma 3 |
| "full"    | all heads' dims (summed over TP ranks)   | (H/TP * hd,), split  | OLMo 2        |

The weight scales the normalized values as ``weight`` or, with ``norm_offset=1``,
``(1 + weight)`` (Gemma's RMSNorm). A "head" norm is `fusedpar.rms_norm` over each head
(one Triton launch each way, saving x and one fp32 per head) that RoPE joins (the same
launch rotates its output: `fusedpar.ops.norm.rms_norm`'s ``rope=``); "full" sums its
statistics over TP in PyTorch.

RoPE rotates pairs (i, i + r/2) of each head's first r dims (Hugging Face's
"rotate-half" layout). Meta's and torchtitan's checkpoints rotate adjacent pairs
(2i, 2i + 1) instead (the "interleaved" layout, a complex multiplication):
`interleaved_to_half` permutes the q and k rows of each head from theirs to ours (the
permutation Hugging Face's Llama conversion applies), which leaves every q . k score
unchanged; `half_to_interleaved` is its inverse.
"""

import torch

from fusedpar import comm
from fusedpar.kernels.common import accumulator
from fusedpar.ops.attention import rope, rope_pair
from fusedpar.ops.attention_layer import gated_output, gated_output_backward
from fusedpar.ops.norm import rms_norm

QK_NORMS = ("head", "full")
ROPE_LAYOUTS = ("half", "interleaved")  # how dense q/k rows pair their rotary dims


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32):
    """cos, sin (len(positions), head_dim / 2) for rotary embeddings at `positions`, built
    on positions' device (no host-to-device copy): computed in float64, then rounded to
    `dtype` (fp32, the kernels' tables for fp16/bf16/fp32 x; float64 for float64 x)."""
    dims = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
    inv_freq = 1.0 / theta ** (dims / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rope_order(t: torch.Tensor, head_dim: int, rotary_dim: int | None) -> torch.Tensor:
    """Per head, the interleaved dim each half-layout dim takes: 0, 2, .., r-2, then
    1, 3, .., r-1, then the dims past r (unrotated) in place."""
    r = head_dim if rotary_dim is None else rotary_dim
    if t.dim() == 0 or t.shape[0] % head_dim:
        raise ValueError(
            f"a RoPE layout permutes whole heads: dim 0 of {tuple(t.shape)} is not "
            f"a multiple of head_dim {head_dim}"
        )
    if r % 2 or not 0 < r <= head_dim:
        raise ValueError(f"rotary_dim ({r}) must be even and in (0, head_dim {head_dim}]")
    device = t.device
    return torch.cat(
        [
            torch.arange(0, r, 2, device=device),
            torch.arange(1, r, 2, device=device),
            torch.arange(r, head_dim, device=device),
        ]
    )


def interleaved_to_half(t: torch.Tensor, head_dim: int, rotary_dim: int | None = None):
    """Rows of q or k from the interleaved RoPE layout (pairs (2i, 2i + 1) of each head's
    first `rotary_dim` dims, default head_dim) to the half layout (pairs (i, i + r/2));
    dim 0 of `t` is whole heads: a weight (H * hd, d), a bias (H * hd,), a per-head norm
    weight (hd,) or one over all heads (H * hd,). A new tensor."""
    order = _rope_order(t, head_dim, rotary_dim)
    return t.reshape(-1, head_dim, *t.shape[1:])[:, order].reshape(t.shape)


def half_to_interleaved(t: torch.Tensor, head_dim: int, rotary_dim: int | None = None):
    """The inverse of `interleaved_to_half`: a layer's q/k rows (or their gradients) in
    the layout of an interleaved checkpoint."""
    order = _rope_order(t, head_dim, rotary_dim).argsort()
    return t.reshape(-1, head_dim, *t.shape[1:])[:, order].reshape(t.shape)


def rotates_by_formula(x, cos, sin) -> bool:
    """Whether the rotation runs as the PyTorch formula rather than a kernel (one in its
    own launch, or the QKV GEMMs' epilogue): tables that need a gradient, or not of the
    dtype the kernels take for x (fp32; float64 for float64 x)."""
    wide = accumulator(x.dtype)
    return cos.requires_grad or sin.requires_grad or cos.dtype != wide or sin.dtype != wide


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., i], x[..., i + r/2]) of x (B, S, H, hd) by the angles of its
    positions; cos, sin (S, r/2). The first r <= hd dims rotate (r < hd: partial rotary,
    GPT-NeoX), the rest pass. Computed in fp32 (float64 for float64 x), returned in x's
    dtype: one kernel each way (`fusedpar.ops.attention.rope`), or the PyTorch formula
    where the tables need a gradient or are not of the kernels' dtype
    (`rotates_by_formula`)."""
    if rotates_by_formula(x, cos, sin):
        half, wide = cos.shape[-1], accumulator(x.dtype)
        x1, x2 = x[..., :half].to(wide), x[..., half : 2 * half].to(wide)
        c, s = cos[None, :, None, :].to(wide), sin[None, :, None, :].to(wide)
        rotated = [x1 * c - x2 * s, x2 * c + x1 * s]
        if 2 * half < x.shape[-1]:
            rotated.append(x[..., 2 * half :].to(wide))
        return torch.cat(rotated, dim=-1).to(x.dtype)
    return rope(x, cos, sin)


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`apply_rope` of q and k at the same positions: one kernel launch each way for both
    where the kernel runs (q and k of one dtype), else `apply_rope` of each."""
    if rotates_by_formula(q, cos, sin) or q.dtype != k.dtype:
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return rope_pair(q, k, cos, sin)


def norm_weight(name: str, t) -> torch.Tensor:
    """The weight of an RMSNorm-like module (``.weight``), or a tensor."""
    weight = getattr(t, "weight", t)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a norm module with .weight or a tensor, got {type(t)}")
    return weight


def joins_rope(kind: str | None, x, cos, sin) -> bool:
    """Whether a q/k norm of `kind` rotates its output itself (`qk_rms_norm`'s ``rope=``):
    a "head" norm in the kernel, with tables the rotation kernel takes."""
    return kind == "head" and not rotates_by_formula(x, cos, sin)


def qk_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    kind: str,
    offset: float = 0.0,
    tp_group=None,
    rope=None,
) -> torch.Tensor:
    """The q/k RMSNorm of `kind` (see the module doc) of x (..., H_loc, hd) in fp32,
    returned in x's dtype, weighted in fp32 and rounded once (as Gemma and OLMo 2 do;
    Qwen3 rounds the normalized values before weighting them, one rounding more). "head"
    is `fusedpar.rms_norm` over each head; "full" sums the squares over this rank's
    heads and all-reduces them over `tp_group` (differentiable: each rank's gradient
    reaches the others' statistics). float64 x: computed in float64.
    ``rope=(cos, sin)`` (where `joins_rope`; x (S, B, H_loc, hd)): the result rotated
    in the same kernel, before its one rounding."""
    if rope is not None and not joins_rope(kind, x, *rope):
        raise ValueError(f"qk_rms_norm: a {kind!r} norm of {x.dtype} does not rotate (rope=)")
    if kind == "head":
        return rms_norm(x, weight, eps, offset=offset, rope=rope)
    wide = accumulator(x.dtype)
    x32 = x.to(wide)
    # replicated KV heads (TP > Hkv: one a rank) are counted once a rank in the squares
    # and in the count alike, so the mean is the full width's (and so is its gradient:
    # each rank's share of it 1 / replicas of its head's)
    heads = x.shape[-2] * comm.group_size(tp_group)
    squares = comm.all_reduce(x32.square().sum((-2, -1), keepdim=True), tp_group)
    mean_square = squares / (heads * x.shape[-1])
    scale = weight.to(wide).view(x.shape[-2:]) + offset  # (H_loc, hd)
    return (x32 * torch.rsqrt(mean_square + eps) * scale).to(x.dtype)


def split_gate(t: torch.Tensor | None, head_dim: int):
    """A gated q's dense rows (Hq * 2hd, ...) in Hugging Face's layout, each head's hd q
    rows then its hd gate rows (Qwen3-Next's ``q_proj(x).view(..., Hq, 2hd).chunk(2)``),
    as (q (Hq * hd, ...), gate (Hq * hd, ...)); None: (None, None)."""
    if t is None:
        return None, None
    heads = t.reshape(-1, 2, head_dim, *t.shape[1:])  # (Hq, 2, hd, ...)
    rows = (heads.shape[0] * head_dim, *t.shape[1:])
    return heads[:, 0].reshape(rows), heads[:, 1].reshape(rows)


def join_gate(q: torch.Tensor, gate: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of `split_gate`: q and gate rows (Hq * hd, ...) as one dense q."""
    heads = torch.stack([t.reshape(-1, head_dim, *t.shape[1:]) for t in (q, gate)], 1)
    return heads.reshape(-1, *q.shape[1:])


class _SigmoidGate(torch.autograd.Function):
    """`gated_output` (fp32, rounded once); saves the two inputs as they are (no fp32
    copies) and recomputes the sigmoid in the backward (`gated_output_backward`: the
    one-rank op's math, so both paths give the same bits)."""

    @staticmethod
    def forward(ctx, out, gate):
        ctx.save_for_backward(out, gate)
        return gated_output(out, gate)

    @staticmethod
    def backward(ctx, dy):
        return gated_output_backward(dy, *ctx.saved_tensors, ctx.needs_input_grad[:2])


def sigmoid_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The output gate of Qwen3-Next's attention: ``out * sigmoid(gate)``, both (S, B,
    Hq_loc * hd), computed in fp32 and returned in out's dtype."""
    if out.shape != gate.shape:
        raise ValueError(f"sigmoid_gate: out {tuple(out.shape)} and gate {tuple(gate.shape)}")
    return _SigmoidGate.apply(out, gate)
