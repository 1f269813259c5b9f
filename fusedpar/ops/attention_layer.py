"""`ParallelAttention` on one rank as one op: ``fusedpar::attention_layer``.

Shapes: x (S, B, d); weights q (Hq hd, d), k and v (Hkv hd, d), o (d, Hq hd), then the
"head" q/k norm weights (hd,) where there are; biases q, k, v and o, each present or not;
RoPE tables cos, sin (S, r/2); the output gate's weight (Hq hd, d) and bias, or none.
The mask crosses the op boundary as its scalars (`AttentionMask.flat`), the norms'
(eps, offset) as two floats.

| direction | computes                                                                    |
| --------- | --------------------------------------------------------------------------- |
| forward   | ``q, k, v(, g) = x W^T + b``, RoPE (or the head norms) turning q and k;     |
|           | ``out = attention(q, k, v) (* sigmoid(g))`` in (S, B) rows; ``out Wo^T + bo`` |
| backward  | ``dO = dy Wo``, ``dWo = dy^T out``; attention's dq, dk, dv turned back;     |
|           | ``dx = dq Wq + dk Wk + dv Wv (+ dg Wg)`` (fp32, rounded once), ``dW = d^T x`` |

The math, kernels and order of every sum are the composed path's (`all_gather_matmul`,
`qk_rms_norm`, `flash_attn`, `matmul_reduce_scatter` over a group of one): the same bits
and the same saved tensors, as one ``autograd.Function`` (host time: docs/hot_path.md).
`ParallelAttention` takes it on one rank with sequence parallelism, no sinks, no q/k
norm or a "head" one, and RoPE tables the kernels take (`rotates_by_formula`).
"""

import torch
from torch import Tensor

from fusedpar.kernels import rms_norm as norm_kernels
from fusedpar.kernels import rope as rope_kernels
from fusedpar.kernels.attention import (
    AttentionMask,
    Gradients,
    attention_backward,
    attention_forward,
)
from fusedpar.kernels.common import accumulator
from fusedpar.kernels.matmul import RowRotation, rope_epilogue_fits
from fusedpar.kernels.matmul_sequence import GemmSequence, layout, state
from fusedpar.ops.attention import block_mask, unflat
from fusedpar.ops.registration import asked, autograd_op, direct_op, flat, row_sum, spread
from fusedpar.ops.tp_schedules import matmuls_reduce_scatter


def gated_output(out: Tensor, gate: Tensor) -> Tensor:
    """``out * sigmoid(gate)`` in fp32 (float64 for float64), rounded once to out's
    dtype: the attention output gate (`fusedpar.nn.attention_parts.sigmoid_gate`)."""
    wide = accumulator(out.dtype)
    return (out.to(wide) * torch.sigmoid(gate.to(wide))).to(out.dtype)


def gated_output_backward(dy: Tensor, out: Tensor, gate: Tensor, needs=(True, True)):
    """(d out, d gate) of `gated_output` (None where not in `needs`), the sigmoid
    recomputed from the saved gate, in fp32, each rounded once to its input's dtype."""
    wide = accumulator(out.dtype)
    s, dy = torch.sigmoid(gate.to(wide)), dy.to(wide)
    d_out = (dy * s).to(out.dtype) if needs[0] else None
    d_gate = (dy * out.to(wide) * (s * (1 - s))).to(gate.dtype) if needs[1] else None
    return d_out, d_gate


def _rotation(x2d, tables, head_dim: int, batch: int, normed: bool) -> RowRotation | None:
    """The QKV GEMMs' epilogue rotation (full rotary whose heads the tiles hold, no norm
    between), else None (`all_gather_matmul`'s rule)."""
    if not tables or normed or 2 * tables[0].shape[1] != head_dim:
        return None
    if not rope_epilogue_fits(x2d.dtype, head_dim):
        return None
    return RowRotation(*tables, rows_per_position=max(1, batch))


def _by_position(t: Tensor, S: int, B: int, N: int, hd: int) -> Tensor:
    """A row-major tensor holding (S, B, N) (a GEMM's (S B, N) output, the norms' (S, B,
    H, hd)) as the kernels' (B, S, N / hd, hd): one strided view (a view and a transpose
    cost twice its host time)."""
    return t.as_strided((B, S, N // hd, hd), (N, B * N, hd, 1))


def _rows(t: Tensor, S: int, B: int, N: int) -> Tensor:
    """The (S B, N) rows of a `_by_position` view (or of a row-major (S, B, H, hd))."""
    return t.as_strided((S * B, N), (N, 1))


@torch.library.custom_op("fusedpar::attention_layer", mutates_args=())
def _attention_layer_op(
    x: Tensor,
    weights: list[Tensor],
    biases: list[Tensor],
    has_bias: list[bool],
    tables: list[Tensor],
    cu_seqlens: Tensor | None,
    head_dim: int,
    mask: list[float],
    norm: list[float],
    gate: list[Tensor],
) -> tuple[Tensor, list[Tensor]]:
    """(y (S, B, d), saved): saved is [q, k, v, out (B, S, H, hd) as attention reads and
    writes them, rows in (S, B) order in memory; lse (B, Hq, S)], then with the norms
    [their inputs q, k (S, B, H, hd), rstd of q, of k], then with the gate [its
    pre-sigmoid values (S B, Hq hd)]. `weights`: q, k, v, o, then the "head" norms' (q,
    k) where there are; `biases`: those flagged in `has_bias` (q, k, v, o); `tables`:
    none, or cos, sin; `norm`: the norms' (eps, offset); `gate`: none, or the output
    gate's weight (and bias)."""
    S, B, d = x.shape
    hd = head_dim
    wq, wk, wv, wo = weights[:4]
    norm_weights, (norm_eps, norm_offset) = weights[4:], norm
    bq, bk, bv, bo = spread(biases, has_bias)
    # the GEMMs' signatures follow from x, the weights, biases and tables (`GemmSequence`)
    gemm = GemmSequence(
        (
            "attention_layer",
            *map(layout, (x, *weights[:4], *biases, *tables)),
            *has_bias,
            len(norm_weights),
            *map(layout, gate),
            hd,
            *state(),
        )
    )
    x2d = flat(x)
    rotation = _rotation(x2d, tables, hd, B, bool(norm_weights))
    q, k, v = (
        gemm(x2d, w.t(), bias=b, out_dtype=x.dtype, rope=r)
        for w, b, r in ((wq, bq, rotation), (wk, bk, rotation), (wv, bv, None))
    )
    g = (
        gemm(x2d, gate[0].t(), bias=gate[1] if len(gate) > 1 else None, out_dtype=x.dtype)
        if gate
        else None
    )
    normed = []
    if norm_weights:  # the head norms, turning their output where there are tables
        rope = (tables[0], tables[1]) if tables else None
        q, k = (t.view(S, B, -1, hd) for t in (q, k))
        (qn, rq), (kn, rk) = (
            norm_kernels.rms_norm(t, w, norm_eps, norm_offset, rope)
            for t, w in ((q, norm_weights[0]), (k, norm_weights[1]))
        )
        normed = [q, k, rq, rk]
        q, k = qn, kn
    widths = [w.shape[0] for w in weights[:3]]
    q, k, v = (_by_position(t, S, B, n, hd) for t, n in zip((q, k, v), widths, strict=True))
    if tables and not norm_weights and rotation is None:  # one launch after the GEMMs
        rope_kernels.rope_pair(q, k, *tables, outs=(q, k))  # in place
    out = torch.empty((S * B, widths[0]), dtype=x.dtype, device=x.device)
    out_b = _by_position(out, S, B, widths[0], hd)
    documents = [] if cu_seqlens is None else [cu_seqlens, cu_seqlens]
    m = block_mask(q, k, documents, unflat(mask), check=True)
    _, lse = attention_forward(q, k, v, m, out=out_b)
    y = gemm(out if g is None else gated_output(out, g), wo.t(), bias=bo, out_dtype=x.dtype)
    gemm.close()
    return y.view(S, B, y.shape[1]), [q, k, v, out_b, lse, *normed, *([] if g is None else [g])]


@_attention_layer_op.register_fake
def _(x, weights, biases, has_bias, tables, cu_seqlens, head_dim, mask, norm, gate):
    S, B, _ = x.shape
    widths = [w.shape[0] for w in weights[:3]]
    q, k, v = (_by_position(x.new_empty((S * B, n)), S, B, n, head_dim) for n in widths)
    saved = [
        q,
        k,
        v,
        _by_position(x.new_empty((S * B, widths[0])), S, B, widths[0], head_dim),
        x.new_empty((B, q.shape[2], S), dtype=accumulator(x.dtype)),
    ]
    if len(weights) > 4:  # the head norms'
        wide = accumulator(x.dtype)
        heads = (S, B, q.shape[2], head_dim), (S, B, k.shape[2], head_dim)
        saved += [
            *(x.new_empty(h) for h in heads),
            *(x.new_empty(h[:-1], dtype=wide) for h in heads),
        ]
    if gate:
        saved.append(x.new_empty((S * B, widths[0])))
    return x.new_empty((S, B, weights[3].shape[0])), saved


@torch.library.custom_op("fusedpar::attention_layer_backward", mutates_args=())
def _attention_layer_backward_op(
    dy: Tensor,
    x: Tensor,
    saved: list[Tensor],
    weights: list[Tensor],
    tables: list[Tensor],
    cu_seqlens: Tensor | None,
    mask: list[float],
    norm: list[float],
    needs: list[bool],
    gate: list[Tensor],
) -> list[Tensor]:
    """[dx, dWq, dWk, dWv, dWo, dbq, dbk, dbv, dbo, dnq, dnk, dWg, dbg], `needs` the flags
    of (x, the four weights, the four biases, the two norm weights, the gate's weight and
    bias): an empty (0,) tensor for each not asked for (an op's outputs may not be None).
    `weights` and `gate` as the forward's; the head dim is the saved q's."""
    need_x, need_w, need_b = needs[0], needs[1:5], needs[5:9]
    need_n, need_g = needs[9:11], needs[11:13]
    q, k, v, out, lse, *normed = saved
    g = normed.pop() if gate else None  # the gate's pre-sigmoid values (S B, Hq hd)
    S, B, d = x.shape
    hd = q.shape[-1]
    weights, norm_weights, (norm_eps, norm_offset) = weights[:4], weights[4:], norm
    wq, wk, wv, wo = weights
    # the GEMMs' signatures follow from dy, x, the weights and where out's rows start (the
    # rest is new: dO, dq, dk, dv, the norms' dx)
    gemm = GemmSequence(
        (
            "attention_layer_backward",
            *map(layout, (dy, x, *weights)),
            out.dtype,
            out.data_ptr() % 16,
            len(normed),
            *map(layout, gate),
            hd,
            *needs,
            *state(),
        )
    )
    dy2d = flat(dy)
    grads = [None] * 13
    out_rows = _rows(out, S, B, wo.shape[1])  # (S B, Hq hd)
    if need_w[3]:  # (gated: o's input recomputed, the forward's bits)
        grads[4] = gemm(dy2d.t(), out_rows if g is None else gated_output(out_rows, g))
    if need_b[3]:
        grads[8] = row_sum(dy2d, wo.dtype)
    if need_x or any(need_w[:3]) or any(need_b[:3]) or any(need_n) or any(need_g):
        d_rows = gemm(dy2d, wo, out_dtype=dy.dtype)
        if g is not None:  # through the gate: d out, and d gate (S B, Hq hd)
            d_rows, dg = gated_output_backward(d_rows, out_rows, g)
        dout = _by_position(d_rows, S, B, wo.shape[1], hd)
        # dq, dk, dv with rows in (S, B) order: the GEMMs below read them flat
        widths = [w.shape[0] for w in weights[:3]]
        dys = [torch.empty((S * B, n), dtype=q.dtype, device=q.device) for n in widths]
        dq, dk, dv = (_by_position(t, S, B, n, hd) for t, n in zip(dys, widths, strict=True))
        documents = [] if cu_seqlens is None else [cu_seqlens, cu_seqlens]
        m = block_mask(q, k, documents, unflat(mask), check=False)
        attention_backward(
            dout,
            q,
            k,
            v,
            lse,
            m,
            delta_from=(out, None),
            grads=Gradients(dq, dk, dv),
        )
        rope = (tables[0], tables[1]) if tables else None
        if normed:  # through the head norms (which turn dq, dk back first)
            q_in, k_in, rq, rk = normed
            (dq, grads[9]), (dk, grads[10]) = (
                norm_kernels.rms_norm_backward(
                    g.view(t.shape), t, w, r, norm_offset, eps=norm_eps, need_weight=n, rope=rope
                )
                for g, t, w, r, n in (
                    (dys[0], q_in, norm_weights[0], rq, need_n[0]),
                    (dys[1], k_in, norm_weights[1], rk, need_n[1]),
                )
            )
            dys[:2] = [_rows(t, S, B, n) for t, n in zip((dq, dk), widths[:2], strict=True)]
        elif rope is not None:  # turned back in place
            rope_kernels.rope_pair(dq, dk, *rope, True, outs=(dq, dk))
        # the gate's GEMM the fourth of the projection, as `all_gather_matmul`'s backward
        ys, ws = [*dys, *([] if g is None else [dg])], [*weights[:3], *gate[:1]]
        if need_x:
            pairs = list(zip(ys, ws, strict=True))
            grads[0] = matmuls_reduce_scatter(pairs, None, 1, x.dtype, gemm=gemm).view(x.shape)
        x2d = flat(x)
        slots = ((1, 5), (2, 6), (3, 7), (11, 12))  # (dW, db) of q, k, v, the gate
        flags = [(need_w[i], need_b[i]) for i in range(3)] + [tuple(need_g)]
        for d, w, (wi, bi), (nw, nb) in zip(ys, ws, slots, flags, strict=False):
            if nw:
                grads[wi] = gemm(d.t(), x2d)
            if nb:
                grads[bi] = row_sum(d, w.dtype)
    gemm.close()
    like = (x, *weights, *weights, *(norm_weights or weights[:2]), *[*gate, x, x][:2])
    return [t.new_empty(0) if d is None else d for d, t in zip(grads, like, strict=True)]


@_attention_layer_backward_op.register_fake
def _(dy, x, saved, weights, tables, cu_seqlens, mask, norm, needs, gate):
    weights, norm_weights = weights[:4], weights[4:]
    gate_like = [*gate, x, x][:2]
    like = (x, *weights, *weights, *(norm_weights or weights[:2]), *gate_like)
    shapes = (
        x.shape,
        *(w.shape for w in weights),
        *((w.shape[0],) for w in weights),
        *(t.shape for t in norm_weights or weights[:2]),
        gate_like[0].shape,
        gate_like[0].shape[:1],
    )
    return [
        t.new_empty(shape if flag else 0)
        for t, shape, flag in zip(like, shapes, needs, strict=True)
    ]


def _setup(ctx, inputs, output):
    x, weights, biases, has_bias, tables, cu_seqlens, *options, gate = inputs
    present = spread(biases, has_bias)
    ctx.needs = [  # 13 flags: x, 4 weights, 4 biases, 2 norm weights, the gate's 2
        x.requires_grad,
        *(w.requires_grad for w in weights[:4]),
        *(b is not None and b.requires_grad for b in present),
        *[*(w.requires_grad for w in weights[4:]), False, False][:2],
        *[*(t.requires_grad for t in gate), False, False][:2],
    ]
    ctx.has_bias, ctx.options = has_bias, options
    ctx.counts = (len(output[1]), len(weights), len(tables), len(gate))
    ctx.set_materialize_grads(False)  # the saved outputs take no gradient: no zeros made
    ctx.save_for_backward(x, *output[1], *weights, *tables, *gate, cu_seqlens)


def _backward(ctx, dy, _saved):
    x, *rest = ctx.saved_tensors
    n_saved, n_weights, n_tables, n_gate = ctx.counts
    saved, rest = rest[:n_saved], rest[n_saved:]
    weights, tables = rest[:n_weights], rest[n_weights : n_weights + n_tables]
    gate, cu_seqlens = rest[n_weights + n_tables : -1], rest[-1]
    if dy is None:  # (only a saved output was used, which the layer never returns)
        dy = x.new_zeros((*x.shape[:-1], weights[3].shape[0]))
    grads = asked(
        _attention_layer_backward(
            dy, x, saved, weights, tables, cu_seqlens, *ctx.options[1:], ctx.needs, list(gate)
        ),
        ctx.needs,
    )
    biases = [g for g, has in zip(grads[5:9], ctx.has_bias, strict=True) if has]
    return (
        grads[0],
        [*grads[1:5], *grads[9 : 9 + n_weights - 4]],
        biases,
        None,
        [None] * n_tables,
        None,
        *[None] * len(ctx.options),
        grads[11 : 11 + n_gate],
    )


_attention_layer_backward = direct_op(_attention_layer_backward_op)
_attention_layer = autograd_op(_attention_layer_op, _backward, _setup)


def attention_layer(
    x: Tensor,
    weights,
    biases,
    norm_weights,
    tables,
    cu_seqlens,
    *,
    head_dim: int,
    mask: AttentionMask,
    norm_eps: float,
    norm_offset: float,
) -> Tensor:
    """`ParallelAttention`'s forward on one rank (the module doc): x (S, B, d) -> (S, B,
    d). `weights` (q, k, v, o), then the output gate's where there is one; `biases`
    aligned with them, None where absent; `norm_weights` () or the "head" norms' (q, k);
    `tables` () or (cos, sin) (S, r/2) in the kernels' dtype, needing no gradient;
    `cu_seqlens` None or packed documents (B = 1); `mask` the layer's (no sinks: the
    layer with sinks is not one op). The caller (`ParallelAttention`) has checked the
    shapes and options."""
    gate = [t for t in (*weights[4:], *biases[4:]) if t is not None]
    weights, biases = weights[:4], biases[:4]
    has_bias = [b is not None for b in biases]
    y, _ = _attention_layer(
        x,
        [*weights, *norm_weights],
        [b for b in biases if b is not None],
        has_bias,
        list(tables),
        cu_seqlens,
        head_dim,
        mask.flat(),
        [float(norm_eps), float(norm_offset)],
        gate,
    )
    return y
