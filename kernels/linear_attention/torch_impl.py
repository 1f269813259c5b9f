"""The gated delta rule's torch implementation: the chunked algorithm of the kernels in
torch ops, vectorized over batch, heads and chunks (``fusedpar.kernels.linear_attention``).

Per chunk of `CHUNK` tokens (G the gates' cumulative sum in the chunk, Γ = exp(G)):

| step        | math                                                                    |
| ----------- | ----------------------------------------------------------------------- |
| intra       | ``A = tril(KΓ (K/Γ)^T, -1)``, ``P = tril(QΓ (K/Γ)^T)`` (decays as       |
|             | ``exp(G_t - G_i)``, never a ratio that overflows)                       |
| WY/UT form  | ``T = (I + beta A)^-1`` (one unit-triangular solve), ``U = T beta V``,  |
|             | ``W = T beta K Γ``                                                      |
| state       | ``Δ = U - W S``; ``S <- Γ_last S + (K Γ_last / Γ)^T Δ``                 |
| output      | ``O = (Q Γ) S + P Δ``                                                   |

The chunk loop is the only sequential part. A per-channel gate (B, T, Hv, K) forms its
decays per channel, (64, 64, K) a chunk. Computed in fp32 (float64 for float64 q).
Packed documents (`cu_seqlens`) are cut into chunks of their own (the last padded with
tokens that change nothing: k = 0, beta = 0, g = 0); reading the boundaries is a host
sync. The backward recomputes the forward under autograd (``torch.autograd.grad``): no
chunk state is kept between forward and backward.
"""

import contextlib
from itertools import pairwise

import torch
from fusedpar.kernels.common import accumulator

CHUNK = 64  # the kernels' chunk: one triangular solve per 64 tokens


def _chunks(x: torch.Tensor, Hk: int, chunks: int) -> torch.Tensor:
    """(B, chunks * CHUNK, H, X) -> (B, Hk, H // Hk, chunks, CHUNK, X): heads as
    (k-head, member of its group)."""
    B, _, H, X = x.shape
    x = x.reshape(B, chunks, CHUNK, Hk, H // Hk, X)
    return x.permute(0, 3, 4, 1, 2, 5)


def _segment_sums(g: torch.Tensor) -> torch.Tensor:
    """``sum(g[i+1..t])`` for t >= i, -inf above: g (..., C, X) -> (..., C, C, X). Each is
    its own running sum, never a difference of two cumulative sums: a gate of -20
    early in a chunk would cost the later decays ~1e-4 of relative precision in fp32."""
    C = g.shape[-2]
    strict = torch.ones(C, C, dtype=torch.bool, device=g.device).tril(-1)[..., None]
    rows = g[..., :, None, :].expand(*g.shape[:-2], C, C, g.shape[-1])  # [t, i] = g_t
    sums = rows.masked_fill(~strict, 0).cumsum(-3)  # [t, i] = sum(g[i+1..t])
    return sums.masked_fill(strict.transpose(0, 1), float("-inf"))  # i > t


def _intra(q, k, g):
    """``(A, P, Γ, Γ_last, Γ_last / Γ)`` of every chunk: q, k (B, Hk, 1, NC, C, K);
    g (B, Hk, G, NC, C, 1 or K)."""
    decay = _segment_sums(g).exp()  # (..., C, C, 1 or K): exp(G_t - G_i), 0 above
    if g.shape[-1] == 1:  # a scalar per head: one (C, C) decay matrix
        decay = decay[..., 0]
        A = (k @ k.transpose(-1, -2)) * decay  # k k^T once per k-head (GVA)
        P = (q @ k.transpose(-1, -2)) * decay
    else:  # per channel: (C, C, K) decays
        A = (k[..., :, None, :] * k[..., None, :, :] * decay).sum(-1)
        P = (q[..., :, None, :] * k[..., None, :, :] * decay).sum(-1)
    gates = g.cumsum(-2)  # G_t: sums of one sign, exact to rounding
    # G_last - G_t as the sum of the gates after t (a reversed running sum)
    after = g.flip(-2).cumsum(-2).flip(-2)
    after = torch.cat([after[..., 1:, :], torch.zeros_like(after[..., :1, :])], -2)
    return A.tril(-1), P, gates.exp(), gates[..., -1:, :].exp(), after.exp()


def _recurrence(U, W, Kd, decay_last, initial, resets):
    """The chunk loop: entering states S (B, Hk, G, NC, K, V), deltas Δ (.., NC, C, V)
    and the final state of every sequence (or document). `resets`: None, or (starts,
    ends, count) for packed documents: chunk -> document whose state restarts there /
    is final after it."""
    B, Hk, G, NC, C, V = U.shape
    K = W.shape[-1]
    zero = U.new_zeros((B, Hk, G, K, V))
    S = zero if initial is None else initial
    states, deltas, finals = [], [], {}
    for n in range(NC):
        if resets is not None and n in resets[0]:
            doc = resets[0][n]
            S = zero if initial is None else initial[doc : doc + 1]
        states.append(S)
        delta = U[:, :, :, n] - W[:, :, :, n] @ S  # (B, Hk, G, C, V)
        deltas.append(delta)
        decayed = decay_last[:, :, :, n, 0, :, None] * S  # rows of S: (.., 1 or K, 1)
        S = decayed + Kd[:, :, :, n].transpose(-1, -2) @ delta
        if resets is not None and n in resets[1]:
            finals[resets[1][n]] = S
    if resets is None:
        return torch.stack(states, 3), torch.stack(deltas, 3), S
    count = resets[2]
    rows = [finals.get(d, zero if initial is None else initial[d : d + 1]) for d in range(count)]
    return torch.stack(states, 3), torch.stack(deltas, 3), torch.cat(rows)


def _chunked(q, k, v, g, beta, scale, initial, resets):
    """o (B, NC * C, Hv, V) and the final states (N, Hv, K, V): q, k (B, NC * C, Hk, K),
    v (B, NC * C, Hv, V), g (B, NC * C, Hv, 1 or K), beta (B, NC * C, Hv), all in the
    computation's dtype, padded to whole chunks."""
    B, Tp, Hk, K = q.shape
    Hv, V = v.shape[-2:]
    NC = Tp // CHUNK
    qc, kc = _chunks(q * scale, Hk, NC), _chunks(k, Hk, NC)  # (B, Hk, 1, NC, C, K)
    vc = _chunks(v, Hk, NC)  # (B, Hk, G, NC, C, V)
    betac = _chunks(beta[..., None], Hk, NC)  # (B, Hk, G, NC, C, 1)
    gates = _chunks(g, Hk, NC)  # (B, Hk, G, NC, C, 1 or K)
    A, P, gamma, decay_last, to_last = _intra(qc, kc, gates)
    # the WY/UT form: (I + beta A)^-1 from one unit-triangular solve (its diagonal is not
    # read), then two batched GEMMs (a solve against V + K columns ran slower on a CPU)
    eye = torch.eye(CHUNK, dtype=A.dtype, device=A.device).expand(A.shape).contiguous()
    inverse = torch.linalg.solve_triangular(betac * A, eye, upper=False, unitriangular=True)
    U, W = inverse @ (betac * vc), inverse @ (betac * kc * gamma)
    if initial is not None:
        initial = initial.reshape(initial.shape[0], Hk, Hv // Hk, K, V)
    states, deltas, final = _recurrence(U, W, kc * to_last, decay_last, initial, resets)
    O = (qc * gamma) @ states + P @ deltas  # (B, Hk, G, NC, C, V)
    o = O.permute(0, 3, 4, 1, 2, 5).reshape(B, Tp, Hv, V)
    return o, final.reshape(final.shape[0], Hv, K, V)


def _pad(x: torch.Tensor, length: int) -> torch.Tensor:
    if x.shape[1] == length:
        return x
    shape = (x.shape[0], length - x.shape[1], *x.shape[2:])
    return torch.cat([x, x.new_zeros(shape)], 1)


def _documents(cu_seqlens: torch.Tensor, T: int):
    """The packed stream's chunks: each token's row in the chunked layout (int64 (T,)),
    the chunks' count and `_recurrence`'s resets. Reads `cu_seqlens` (a host sync)."""
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != T or any(b < a for a, b in pairwise(bounds)):
        raise ValueError(
            f"cu_seqlens must start at 0, never decrease and end at T = {T}, got {bounds}"
        )
    rows, starts, ends, chunk = [], {}, {}, 0
    for doc, (start, end) in enumerate(pairwise(bounds)):
        length = end - start
        if length == 0:
            continue
        count = -(-length // CHUNK)
        starts[chunk], ends[chunk + count - 1] = doc, doc
        rows.extend(range(chunk * CHUNK, chunk * CHUNK + length))
        chunk += count
    index = torch.tensor(rows, dtype=torch.int64, device=cu_seqlens.device)
    return index, chunk, (starts, ends, len(bounds) - 1)


def forward(q, k, v, g, beta, *, scale, initial_state=None, cu_seqlens=None):
    """``(o, final_state)``: o (B, T, Hv, V) in v's dtype, final_state (N, Hv, K, V) fp32
    (float64 for float64 q), N = B or the documents. Inputs checked by the launcher."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[-2:]
    wide, out_dtype = accumulator(q.dtype), v.dtype
    q, k, v, g, beta = (t.to(wide) for t in (q, k, v, g, beta))
    g = g[..., None] if g.dim() == 3 else g  # (B, T, Hv, 1 or K)
    initial = None if initial_state is None else initial_state.to(wide)
    resets = None
    if cu_seqlens is not None:
        index, chunks, resets = _documents(cu_seqlens.to(q.device), T)
        Tp = chunks * CHUNK
        if Tp == 0:  # documents of length 0 only
            final = q.new_zeros((resets[2], Hv, K, V)) if initial is None else initial.clone()
            return v.new_zeros((B, T, Hv, V), dtype=out_dtype), final
        # each document on its own chunks: the padding rows stay zero
        q, k, v, g, beta = (
            t.new_zeros((1, Tp, *t.shape[2:])).index_copy(1, index.to(t.device), t)
            for t in (q, k, v, g, beta)
        )
    else:
        Tp = -(-T // CHUNK) * CHUNK
        if Tp == 0:
            final = q.new_zeros((B, Hv, K, V)) if initial is None else initial.clone()
            return v.new_zeros((B, 0, Hv, V), dtype=out_dtype), final
        q, k, v, g, beta = (_pad(t, Tp) for t in (q, k, v, g, beta))
    o, final = _chunked(q, k, v, g, beta, scale, initial, resets)
    o = o[:, :T] if cu_seqlens is None else o.index_select(1, index)
    return o.to(out_dtype).contiguous(), final.contiguous()


# Autograd's dispatch keys. A custom op's body runs below autograd (torch excludes these
# keys around it: a compiled backward, opcheck), where the recompute needs them back.
# (``torch.func.vjp`` instead breaks under opcheck's schema check.)
_AUTOGRAD_KEYS = (
    torch._C.DispatchKey.AutogradFunctionality,
    torch._C.DispatchKey.AutogradOther,
    torch._C.DispatchKey.AutogradNestedTensor,
)


@contextlib.contextmanager
def _autograd_on():
    with contextlib.ExitStack() as stack:
        for key in _AUTOGRAD_KEYS:
            stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
        stack.enter_context(torch.enable_grad())
        yield


def backward(do, dfinal, q, k, v, g, beta, *, scale, initial_state=None, cu_seqlens=None):
    """``(dq, dk, dv, dg, dbeta, dinit)`` of `forward` for the gradients do (of o) and
    dfinal (of the final state, or None): the forward recomputed under autograd and
    differentiated (``torch.autograd.grad``), each gradient in its input's dtype, dinit
    None without `initial_state`."""
    inputs = [t.detach().requires_grad_() for t in (q, k, v, g, beta)]
    if initial_state is not None:
        inputs.append(initial_state.detach().requires_grad_())
    with _autograd_on():
        init = inputs[5] if initial_state is not None else None
        o, final = forward(*inputs[:5], scale=scale, initial_state=init, cu_seqlens=cu_seqlens)
        pairs = [(o, do)] + ([] if dfinal is None else [(final, dfinal.to(final.dtype))])
        pairs = [(out, grad) for out, grad in pairs if out.requires_grad]  # (T = 0: o is not)
        found = [None] * len(inputs)
        if pairs:
            outputs, grads = zip(*pairs, strict=True)
            found = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
    # fresh and contiguous, as the op's fake says (the kernels' layout)
    found = [
        torch.zeros(t.shape, dtype=t.dtype, device=t.device) if d is None else d.contiguous()
        for t, d in zip(inputs, found, strict=True)
    ]
    return (*found[:5], found[5] if initial_state is not None else None)
