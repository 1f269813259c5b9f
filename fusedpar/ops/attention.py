"""`flash_attn` and `flash_attn_varlen`: the custom op ``fusedpar::flash_attn`` (with its
backward op and autograd registered through ``torch.library``) over the flash-attention
kernels.

| input   | shape             | gradient                                      |
| ------- | ----------------- | --------------------------------------------- |
| q       | (B, Sq, Hq, D)    | ``dQ = scale * dS K``                         |
| k       | (B, Skv, Hkv, D)  | ``dK = scale * dS^T Q``                       |
| v       | (B, Skv, Hkv, Dv) | ``dV = P^T dO`` (out and dO: (B, Sq, Hq, Dv)) |

summed over each GQA group's query heads, with ``dS = P * (dO V^T - rowsum(dO * O) +
dLSE)`` (times ``1 - tanh^2`` of the capped scores under ``softcap``): a gradient into
the returned LSE folds into the same backward. The varlen form runs the same kernels on
the packed stream as one batch row, documents as key intervals
(`fusedpar.kernels.attention.mask`). Attention sinks (gpt-oss) are an exact epilogue on
(out, lse) shared by every entry point, `apply_sinks`: ``out * sigmoid(L - s)``,
``logaddexp(L, s)``; a row that sees no key gives out 0, never NaN; under the ring the
sink enters once, after the merge. float64 runs torch's implementation
(`fusedpar.kernels.impl`), its LSE and sinks float64 (`common.accumulator`).
"""

import torch
from torch import Tensor

from fusedpar.kernels import rope as rope_kernels
from fusedpar.kernels.attention import (
    AttentionMask,
    Gradients,
    attention_backward,
    attention_forward,
    check_attention_inputs,
    check_cu_seqlens,
    packed_intervals,
)
from fusedpar.kernels.common import TensorCache, accumulator
from fusedpar.ops.registration import autograd_op, direct_op

# --- custom ops: fusedpar::flash_attn and its backward ---------------------------------
# The mask crosses the op boundary as its scalars, one ``float[]`` (`AttentionMask.flat`,
# read back by `unflat`), and the packed documents as ``documents``: none for one sequence
# per batch row, or the cu_seqlens of the queries and keys (causality and the window then
# apply within each document). Their values are checked inside the op: a compiled graph
# never sees the read.


def unflat(values: list[float], sinks: Tensor | None = None) -> AttentionMask:
    """A custom op's ``mask`` argument as the `AttentionMask` it was flattened from
    (`AttentionMask.from_flat`; `sinks` beside it). The masks without sinks are kept per
    value (the same few every call: a layer's, a model's), so an op call builds none."""
    if sinks is not None:
        return AttentionMask.from_flat(values, sinks)
    key = tuple(values)
    mask = _UNFLAT.get(key)
    if mask is None:
        if len(_UNFLAT) >= 64:
            _UNFLAT.clear()
        mask = _UNFLAT[key] = AttentionMask.from_flat(values)
    return mask


_UNFLAT: dict[tuple, AttentionMask] = {}


def block_mask(q, k, documents: list[Tensor], mask: AttentionMask, *, check: bool):
    """`mask` as the kernels take it for q against k: itself for one sequence per batch
    row, else on the packed documents' intervals (`AttentionMask.on_block`). The
    intervals are built (and with `check` the cu_seqlens' values read: a host sync) once
    per cu_seqlens tensors: the layers of a model, forward and backward, pass the same
    ones (`_PACKED`, a `TensorCache`)."""
    if not documents:
        return mask
    cu_q, cu_k = documents
    key = (q.shape[1], k.shape[1], mask.causal, mask.window, q.device)
    checked, intervals = _PACKED.get((cu_q, cu_k), key) or (False, None)
    if intervals is None or (check and not checked):
        if check:
            check_cu_seqlens(cu_q, q.shape[1], "cu_seqlens_q")
            check_cu_seqlens(cu_k, k.shape[1], "cu_seqlens_k")
        intervals = packed_intervals(
            cu_q.to(q.device),
            cu_k.to(q.device),
            q.shape[1],
            k.shape[1],
            causal=mask.causal,
            window=mask.window,
        )
        _PACKED.put((cu_q, cu_k), key, (check, intervals))
    return mask.on_block(intervals)


# the last few packed masks, each kept for the very cu_seqlens tensors it was built from
# and the call's lengths, mask and device, with whether their values were checked: an
# entry made without the check serves only calls that do not ask for it
_PACKED = TensorCache(8)


@torch.library.custom_op("fusedpar::flash_attn", mutates_args=())
def _flash_attn_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    documents: list[Tensor],
    mask: list[float],
    deterministic: bool,
) -> tuple[Tensor, Tensor]:
    # (`deterministic` is the backward's: it travels in the op's options. No argument has
    # a default: the dispatcher leaves out one given at its default, and the gradients
    # must match the inputs given, list by list, with `documents` a list)
    m = block_mask(q, k, documents, unflat(mask), check=True)
    return attention_forward(q, k, v, m)


@_flash_attn_op.register_fake
def _(q, k, v, documents, mask, deterministic):
    B, Sq, Hq, _ = q.shape
    return (
        q.new_empty((B, Sq, Hq, v.shape[-1])),
        q.new_empty((B, Hq, Sq), dtype=accumulator(q.dtype)),
    )


@torch.library.custom_op("fusedpar::flash_attn_backward", mutates_args=())
def _flash_attn_backward_op(
    dout: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    documents: list[Tensor],
    mask: list[float],
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    # d(LSE_i)/d(S_ij) = P_ij: a gradient of the LSE folds into delta (None when the
    # LSE is unused), made from out and dlse as the backward starts
    m = block_mask(q, k, documents, unflat(mask), check=False)
    return attention_backward(
        dout,
        q,
        k,
        v,
        lse,
        m,
        delta_from=(out, dlse),
        grads=Gradients(deterministic=deterministic),
    )


@_flash_attn_backward_op.register_fake
def _(dout, dlse, q, k, v, out, lse, documents, mask, deterministic):
    # fresh, contiguous (the kernels' layout), any inputs
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, documents, mask, deterministic = inputs
    ctx.save_for_backward(q, k, v, *output, *documents)
    ctx.options, ctx.documents = (mask, deterministic), len(documents)
    # an unused output's gradient comes as None, not zeros: with no LSE gradient the
    # backward may run PyTorch's own kernels (`fusedpar.kernels.attention.torch_impl`)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *documents = ctx.saved_tensors
    if dout is None:  # only the LSE was used
        dout = torch.zeros_like(out)
    dq, dk, dv = _flash_attn_backward(dout, dlse, q, k, v, out, lse, documents, *ctx.options)
    return dq, dk, dv, [None] * ctx.documents, None, None


_flash_attn_backward = direct_op(_flash_attn_backward_op)
_flash_attn = autograd_op(_flash_attn_op, _backward, _setup)


def masked_flash_attn(q, k, v, mask: AttentionMask, cu_seqlens=None, deterministic=False):
    """(out, lse) of ``fusedpar::flash_attn`` under `mask` (its sinks left out: the
    caller applies them, `apply_sinks`), `cu_seqlens`: None, or the packed documents of
    both q and k (B = 1)."""
    documents = [] if cu_seqlens is None else [cu_seqlens, cu_seqlens]
    return _flash_attn(q, k, v, documents, mask.flat(), deterministic)


# --- custom op: fusedpar::rope (its backward is itself, by -angle) -----------------------
# One tensor, or two at the same positions (q and k) in one launch each way.


@torch.library.custom_op("fusedpar::rope", mutates_args=())
def _rope_op(xs: list[Tensor], cos: Tensor, sin: Tensor, inverse: bool) -> list[Tensor]:
    if len(xs) == 1:
        return [rope_kernels.rope(xs[0], cos, sin, inverse)]
    return list(rope_kernels.rope_pair(*xs, cos, sin, inverse))


@_rope_op.register_fake
def _(xs, cos, sin, inverse):  # new and contiguous, as the kernel's
    return [x.new_empty(x.shape) for x in xs]


def _rope_setup(ctx, inputs, output):
    xs, cos, sin, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse = inverse
    ctx.outputs = [(x.shape, x.dtype) for x in xs]


def _rope_backward(ctx, dys):
    cos, sin = ctx.saved_tensors
    dys = [
        torch.zeros(shape, dtype=dtype, device=cos.device) if dy is None else dy
        for dy, (shape, dtype) in zip(dys, ctx.outputs, strict=True)
    ]
    return _rope_again(dys, cos, sin, not ctx.inverse), None, None, None


_rope_again = direct_op(_rope_op)  # inside the backward: no graph of its own
_rope = autograd_op(_rope_op, _rope_backward, _rope_setup)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embeddings of x (B, S, H, hd), any strides, by cos, sin (S, r/2) fp32 (r <=
    hd rotated; the rest passes), in fp32, into a new tensor of x's dtype (float64 x:
    float64 tables, computed in float64)
    (`fusedpar.kernels.rope`). The tables take no gradient: pass ones that need it to
    the PyTorch formula (`fusedpar.nn.attention_parts.apply_rope` does)."""
    rope_kernels.check_rope(x, cos, sin)
    return _rope([x], cos, sin, False)[0]


def rope_pair(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """`rope` of q (B, S, Hq, hd) and k (B, S, Hkv, hd) at the same positions, one launch
    each way (two with `rope` each)."""
    rope_kernels.check_rope(q, cos, sin)
    rope_kernels.check_rope(k, cos, sin)
    q, k = _rope([q, k], cos, sin, False)
    return q, k


def check_sinks(sinks, q: torch.Tensor, what: str) -> None:
    """`sinks`: None, or a float32 (Hq,) tensor on q's device, Hq = q.shape[-2] (float64
    for float64 q)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{what}: sinks must be a tensor (Hq,), got {type(sinks).__name__}")
    heads, wide = q.shape[-2], accumulator(q.dtype)
    if sinks.shape != (heads,) or sinks.dtype != wide or sinks.device != q.device:
        name = str(wide).removeprefix("torch.")
        raise ValueError(
            f"{what}: sinks must be {name} ({heads},) (one logit per query head) "
            f"on {q.device}, got {sinks.dtype} {tuple(sinks.shape)} on "
            f"{sinks.device}"
        )


def apply_sinks(out: Tensor, lse: Tensor, mask: AttentionMask) -> tuple[Tensor, Tensor]:
    """out (..., S, H, D) and lse (..., H, S) of attention without sinks -> with one
    more logit per head, ``mask.sinks`` (H,), in every row's denominator (see the module
    doc); (out, lse) as they are without sinks. Differentiable in all three; computed in
    fp32 (the LSE's dtype: float64 for a float64 out), out returned in its dtype."""
    if mask.sinks is None:
        return out, lse
    sink = mask.sinks.to(lse.dtype)[:, None]  # (H, 1) against lse (..., H, S)
    new_lse = torch.logaddexp(lse, sink)
    kept = torch.exp(lse - new_lse)  # sigmoid(L - s): the keys' share; 0 where L = -inf
    return (out.to(lse.dtype) * kept.transpose(-1, -2)[..., None]).to(out.dtype), new_lse


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
):
    """Scaled dot-product attention, flash-style: ``softmax(q k^T * scale) v``.

    q (B, Sq, Hq, D); k (B, Skv, Hkv, D) and v (B, Skv, Hkv, Dv) with Hq a multiple of
    Hkv (GQA/MQA: KV is read in place, never repeated); D and Dv multiples of 8 up to 256,
    Dv may differ from D (DeepSeek's MLA: 192 and 128; V is not padded); fp16, bf16 or fp32, or
    float64 on torch's implementation (computed in float64, its LSE and sinks float64);
    any strides (views into a fused QKV projection are read without copies).

    The mask is aligned bottom-right: query i sits at key position ``i + Skv - Sq``.
    ``causal``: it sees keys up to there. ``window=(left, right)`` (flash-attn's): keys
    in ``[i + Skv - Sq - left, i + Skv - Sq + right]``, -1 unbounded; causal means
    right = 0 (Hugging Face's ``sliding_window=W`` is ``(W - 1, 0)``). Blocks outside
    the window are skipped, not masked. ``softcap > 0`` caps the scaled scores at
    ``softcap * tanh(s / softcap)`` (Gemma 2), before the mask. A row that sees no key
    returns 0 (LSE -inf, zero gradients). ``softmax_scale`` defaults to ``1 / sqrt(D)``.
    ``sinks`` (Hq,) float32: attention sinks, a learned logit per query head in every
    row's softmax denominator (gpt-oss), with their gradient; a row that sees no key
    then returns 0 with LSE = its sink. Returns ``out`` (B, Sq, Hq, Dv), or
    ``(out, lse)`` with lse (B, Hq, Sq) float32 in natural log when ``return_lse``.
    ``deterministic`` (or ``torch.use_deterministic_algorithms(True)``): the backward
    whose every sum has a fixed order (otherwise dQ's last bits may vary from run to
    run: `fusedpar.kernels.attention.backward_fused`).
    """
    check_attention_inputs(q, k, v)
    check_sinks(sinks, q, "flash_attn")
    mask = AttentionMask(causal, window, softcap, softmax_scale, sinks)
    out, lse = apply_sinks(*masked_flash_attn(q, k, v, mask, deterministic=deterministic), mask)
    return (out, lse) if return_lse else out


def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = None,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
):
    """`flash_attn` over packed documents (flash-attn's ``flash_attn_varlen_func``).

    q (Tq, Hq, D), k (Tk, Hkv, D) and v (Tk, Hkv, Dv): documents back to back, document b in rows
    ``cu_seqlens[b]:cu_seqlens[b + 1]`` (int32, B + 1 entries from 0 to the total;
    `cu_seqlens_k` defaults to `cu_seqlens_q`). A query sees keys of its own document
    only, with `causal`, `window`, `softcap`, `sinks` and `deterministic` as in
    `flash_attn`, aligned bottom-right
    within the document where its query and key lengths differ. Zero-length documents
    are legal. The kernels run over the packed stream and skip the blocks that share no
    document, so ``max_seqlen_q`` / ``max_seqlen_k`` are not needed (accepted for
    flash-attn's signature, and never read). The values of the cu_seqlens are checked,
    which reads them: a host sync when they are on a GPU.

    Returns out (Tq, Hq, Dv), or ``(out, lse)`` with lse (Hq, Tq) float32.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(
                f"flash_attn_varlen: {name} must be packed (T, H, D), got shape {tuple(t.shape)}"
            )
    q, k, v = q[None], k[None], v[None]
    check_attention_inputs(q, k, v)
    check_sinks(sinks, q, "flash_attn_varlen")
    mask = AttentionMask(causal, window, softcap, softmax_scale, sinks)
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    check_cu_seqlens(cu_seqlens_q, q.shape[1], "cu_seqlens_q", values=False)
    check_cu_seqlens(cu_seqlens_k, k.shape[1], "cu_seqlens_k", values=False)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k describe {cu_seqlens_q.numel() - 1} "
            f"and {cu_seqlens_k.numel() - 1} documents"
        )
    documents = [cu_seqlens_q, cu_seqlens_k]
    out, lse = _flash_attn(q, k, v, documents, mask.flat(), deterministic)
    out, lse = apply_sinks(out, lse, mask)
    return (out[0], lse[0]) if return_lse else out[0]


def check_shards(q, k, v, what: str) -> None:
    """The checks of a sharded attention's inputs: q, k, v one sequence's shards (the
    mask is checked where it is built, `AttentionMask`)."""
    check_attention_inputs(q, k, v)
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"{what}: q has {q.shape[1]} local tokens, k and v have "
            f"{k.shape[1]}: they must be shards of one sequence"
        )


def check_packed(q: torch.Tensor, cu_seqlens, total: int, what: str, *, values=False) -> None:
    """A packed stream is one batch row whose documents `cu_seqlens` covers `total`; its
    values are read here with `values` (else inside the op)."""
    if cu_seqlens is None:
        return
    if q.shape[0] != 1:
        raise ValueError(
            f"{what}: with cu_seqlens the documents are packed into one batch "
            f"row: q must be (1, T, H, D), got batch {q.shape[0]}"
        )
    check_cu_seqlens(cu_seqlens, total, values=values)
