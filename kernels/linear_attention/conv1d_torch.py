"""The depthwise causal conv1d's torch implementation and its float64 reference, beside
the Triton kernels of `fusedpar.kernels.linear_attention.conv1d` (the contract: the
module doc there).

| function                       | computes                                              |
| ------------------------------ | ----------------------------------------------------- |
| `causal_conv1d_torch`          | y and final_states: one shifted slice a tap           |
| `causal_conv1d_backward_torch` | dx, dweight, dbias, dinitial_states: shifted slices   |
| `causal_conv1d_reference`      | a loop over the sequences (or documents) and taps     |

Both directions compute in fp32 (float64 for float64 x) and round once. A tap before a
packed document's start reads the document's own initial states (or zero), never the
previous document; only the W - 1 state entries of each sequence are gathered.
"""

import torch
from fusedpar.kernels import common


def _gather(x, initial_states, W: int, row, p, start, doc):
    """(*p.shape, C) in fp32 (float64 for float64 x): the input at position p of
    sequence `row`, from initial_states[doc] before `start` (zeros without them)."""
    wide = common.accumulator(x.dtype)
    inside = (p >= start)[..., None]
    T = x.shape[1]
    read = x[row, p.clamp(0, T - 1)] if T else x.new_zeros((*p.shape, x.shape[2]))
    values = torch.where(inside, read.to(wide), 0.0)
    if initial_states is not None and W > 1:
        i = (p - start + W - 1).clamp(0, W - 2)
        values = values + torch.where(inside, 0.0, initial_states.transpose(1, 2)[doc, i].to(wide))
    return values


def _positions(x, cu_seqlens):
    """Packed (B = 1): each token's position, document, and its document's start and
    end, (1, T) each (else None: a sequence is its row); per sequence or document (N,):
    its row, start and end. Device tensors, no host read."""
    B, T, _ = x.shape
    if cu_seqlens is None:
        rows = torch.arange(B, device=x.device)
        return None, (rows, rows * 0, rows * 0 + T)
    cu = cu_seqlens.long()
    t = torch.arange(T, device=x.device)
    doc = torch.searchsorted(cu, t, right=True) - 1  # a zero-length document: skipped
    tokens = (t[None], doc[None], cu[doc][None], cu[doc + 1][None])
    return tokens, (torch.zeros_like(cu[:-1]), cu[:-1], cu[1:])


def _stream(x, initial_states, W: int, packed: bool) -> torch.Tensor:
    """``[before ; x]`` (B, W - 1 + T, C) in fp32 (float64 for float64 x): before a
    sequence its initial states, or zeros (packed: each document reads its own)."""
    B, _, C = x.shape
    wide = common.accumulator(x.dtype)
    if initial_states is not None and not packed:
        before = initial_states.transpose(1, 2).to(wide)  # (B, W - 1, C)
    else:
        before = x.new_zeros((B, W - 1, C), dtype=wide)
    return torch.cat([before, x.to(wide)], 1)


def _tap_input(stream, shift: int, W: int, initial_states, tokens):
    """x at t - shift (B, T, C), what tap W - 1 - shift reads: a slice of the stream;
    packed (`tokens`), a position before the document's start reads the document's own
    initial states (or zero) instead."""
    T = stream.shape[1] - (W - 1)
    shifted = stream[:, W - 1 - shift : W - 1 - shift + T]
    if tokens is None:
        return shifted
    t, doc, start, _ = tokens
    outside = (t - shift < start)[..., None]
    own = 0.0
    if initial_states is not None:
        i = (t - shift - start + W - 1).clamp(0, W - 2)
        own = initial_states.transpose(1, 2)[doc, i].to(stream.dtype)
    return torch.where(outside, own, shifted)


def _pre(x, weight, bias, initial_states, tokens):
    """(the pre-activation (B, T, C), the stream): ``sum_s x[t - s] w[:, W - 1 - s]``
    (+ bias), one shifted slice a tap (gathering every tap's input, (B T, W, C), had
    the GDN layer's CPU forward at T = 2k take 330 ms instead of 155)."""
    W = weight.shape[1]
    stream = _stream(x, initial_states, W, tokens is not None)
    taps = weight.to(stream.dtype)
    pre = stream[:, W - 1 :] * taps[:, W - 1]
    for shift in range(1, W):
        # a product, then a sum: the same bits at any alignment (addcmul_ fuses a
        # multiply-add where vectorized: packed documents differed from each one alone)
        pre += _tap_input(stream, shift, W, initial_states, tokens) * taps[:, W - 1 - shift]
    if bias is not None:
        pre += bias.to(pre.dtype)
    return pre, stream


def causal_conv1d_torch(x, weight, bias, activation, cu_seqlens, initial_states, y, final):
    """`causal_conv1d`'s contract in PyTorch, into y (and final, if not None): the taps
    as shifted slices, the final states gathered."""
    W = weight.shape[1]
    tokens, (n_row, n_start, n_end) = _positions(x, cu_seqlens)
    pre, _ = _pre(x, weight, bias, initial_states, tokens)
    y.copy_(torch.nn.functional.silu(pre) if activation == "silu" else pre)
    if final is not None:
        docs = torch.arange(n_row.shape[0], device=x.device)[:, None]
        v = n_end[:, None] - (W - 1) + torch.arange(W - 1, device=x.device)  # the last W - 1
        values = _gather(x, initial_states, W, n_row[:, None], v, n_start[:, None], docs)
        final.copy_(values.transpose(1, 2))


def _initial_grad(padded, w, dfinal, ends, W: int):
    """initial_states' gradient (N, C, W - 1): entry i is read by the output start + i - j
    through tap j <= i (inside the document), and is final_states' i - (end - start)
    where the document is shorter than W - 1. `padded`: dpre (B, T + W - 1, C), zero
    past T; `ends`: the sequences' (row, start, end)."""
    n_row, n_start, n_end = ends
    L = padded.shape[1]
    i = torch.arange(W - 1, device=padded.device)[:, None]
    j = torch.arange(W, device=padded.device)[None, :]
    u = n_start[:, None, None] + i - j  # (N, W - 1, W)
    inside = (j <= i) & (u < n_end[:, None, None])
    rows = n_row[:, None, None] * L
    flat = padded.reshape(-1, padded.shape[2])
    reads = flat[torch.where(inside, rows + u, rows + L - 1)]  # row L - 1: a zero
    per_entry = (reads * w).sum(2)  # (N, W - 1, C)
    if dfinal is not None:
        fi = i.T - (n_end - n_start)[:, None]  # (N, W - 1)
        docs = torch.arange(fi.shape[0], device=padded.device)[:, None]
        finals = dfinal.transpose(1, 2).to(per_entry.dtype)  # (N, W - 1, C)
        per_entry += torch.where((fi >= 0)[..., None], finals[docs, fi.clamp(min=0)], 0.0)
    return per_entry.transpose(1, 2)


def causal_conv1d_backward_torch(dy, dfinal, x, weight, bias, activation, cu_seqlens,
                                 initial_states, accumulate=False):  # fmt: skip
    """`causal_conv1d_backward`'s contract in PyTorch, shifted slices (no scatter over
    the tokens, no atomics): ``(dx, dweight, dbias, dinitial_states)`` (None for an
    absent input), in fp32 (float64 for float64 x) rounded once to each input's dtype;
    with `accumulate`, dweight and dbias stay in fp32."""
    B, T, C = x.shape
    W = weight.shape[1]
    tokens, ends = _positions(x, cu_seqlens)
    pre, stream = _pre(x, weight, bias, initial_states, tokens)
    dpre = dy.to(pre.dtype)
    if activation == "silu":
        s = torch.sigmoid(pre)
        dpre = dpre * s * (1 + pre * (1 - s))
    w = weight.T.to(pre.dtype)  # (W, C)
    dweight = pre.new_empty((W, C))
    for shift in range(W):  # tap W - 1 - shift reads x at t - shift
        read = _tap_input(stream, shift, W, initial_states, tokens) if shift else stream[:, W - 1 :]
        dweight[W - 1 - shift] = (dpre * read).sum((0, 1))
    # dx[t] = sum_s w[W - 1 - s] dpre[t + s] within t's document; one spare row last
    padded = torch.cat([dpre, dpre.new_zeros((B, W - 1, C))], 1)  # (B, T + W - 1, C)
    dx_rows = dpre.new_empty((B * T + 1, C))
    dx = dx_rows[: B * T].view(B, T, C)
    torch.mul(dpre, w[W - 1], out=dx)
    for shift in range(1, W):
        later = padded[:, shift : shift + T]
        if tokens is not None:  # the output at t + shift is in t's document
            later = torch.where((tokens[0] + shift < tokens[3])[..., None], later, 0.0)
        dx += later * w[W - 1 - shift]
    if dfinal is not None and W > 1:  # final_states[n, :, f] is x at end - (W - 1) + f
        n_row, n_start, n_end = ends
        p = n_end[:, None] - (W - 1) + torch.arange(W - 1, device=x.device)  # (N, W - 1)
        at = torch.where(p >= n_start[:, None], n_row[:, None] * T + p, B * T)
        dx_rows[B * T] = 0
        dx_rows.index_add_(0, at.reshape(-1), dfinal.transpose(1, 2).reshape(-1, C).to(dx.dtype))
    dinit = None
    if initial_states is not None:
        dinit = torch.zeros(initial_states.shape, dtype=w.dtype, device=x.device)
        if W > 1:
            dinit = _initial_grad(padded, w, dfinal, ends, W)
    grads = (dx, dweight.T, dpre.sum((0, 1)), dinit)
    inputs = (x, weight, bias, initial_states)
    keep = (False, accumulate, accumulate, False)
    return tuple(
        None if t is None else (g.contiguous() if k else g.to(t.dtype).contiguous())
        for g, t, k in zip(grads, inputs, keep, strict=True)
    )


def causal_conv1d_reference(x, weight, bias=None, activation="silu", cu_seqlens=None,
                            initial_states=None, output_final_states=False):  # fmt: skip
    """``(y, final_states)`` by a loop over the sequences (or documents) and taps, in the
    inputs' promoted dtype (float64 in: the oracle), differentiable by autograd."""
    dtype = torch.promote_types(x.dtype, weight.dtype)
    B, T, C = x.shape
    W = weight.shape[1]
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        bounds = cu_seqlens.tolist()
        spans = [(0, s, e) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    ys, finals = [], []
    for n, (b, s, e) in enumerate(spans):
        before = (x.new_zeros((W - 1, C), dtype=dtype) if initial_states is None
                  else initial_states[n].T.to(dtype))  # fmt: skip
        xd = torch.cat([before, x[b, s:e].to(dtype)])  # (W - 1 + L, C)
        y = sum(weight[:, j].to(dtype) * xd[j : j + e - s] for j in range(W))
        if bias is not None:
            y = y + bias.to(dtype)
        ys.append(torch.nn.functional.silu(y) if activation == "silu" else y)
        finals.append(xd[xd.shape[0] - (W - 1) :].T)
    y = torch.stack(ys) if cu_seqlens is None else torch.cat(ys)[None]
    return y, (torch.stack(finals) if output_final_states else None)
