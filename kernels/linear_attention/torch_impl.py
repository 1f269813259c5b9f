"""The gated delta rule's torch implementation: the chunked algorithm of the kernels in
torch ops, vectorized over batch, heads and chunks (``fusedpar.kernels.linear_attention``).

Per chunk of `CHUNK` tokens (G the gates' cumulative sum in the chunk, Γ = exp(G)):

| step        | forward                                        | backward (`backward`)          |
| ----------- | ---------------------------------------------- | ------------------------------ |
| intra       | ``A = tril(KΓ (K/Γ)^T, -1)``, ``P = tril(QΓ    | dlog(decay) = dA A + dP P      |
|             | (K/Γ)^T)`` (decays as ``exp(G_t - G_i)``)       | (row sums minus column sums)   |
| WY/UT form  | ``T = (I + beta A)^-1``, ``U = T beta V``,     | ``d(beta V) = T^T dU``, ``dM = |
|             | ``W = T beta K Γ``                             | -(T^T dX) X^T``, X = [U, W]    |
| state       | ``Δ = U - W S``; ``S <- Γ_last S + Kd^T Δ``    | dS in reverse over chunks      |
| output      | ``O = (Q Γ) S + P Δ``                          | batched GEMMs around the loop  |

The chunk loops are the only sequential parts (two GEMMs a chunk each way); the
backward recomputes the chunk states. A per-channel gate (B, T, Hv, K) forms its
(64, 64, K) decays `DECAY_ELEMENTS` at a time. Computed in fp32 (float64 for float64
q). Packed documents (`cu_seqlens`) are cut into chunks of their own (the last padded
with tokens that change nothing: k = 0, beta = 0, g = 0); reading them is a host sync.
"""

from itertools import pairwise

import torch
from fusedpar.kernels.common import accumulator

CHUNK = 64  # the kernels' chunk: one triangular solve per 64 tokens
# A per-channel gate's decays, (64, 64, K) a chunk and head, held at once: at most this
# many elements (64 MiB in fp32). All at once they would take 4 GiB at Qwen3.5's 32
# heads of 128 and T = 4k.
DECAY_ELEMENTS = 2**24


def _chunks(x: torch.Tensor, Hk: int, chunks: int) -> torch.Tensor:
    """(B, chunks * CHUNK, H, X) -> (B, Hk, H // Hk, chunks, CHUNK, X): heads as
    (k-head, member of its group)."""
    B, _, H, X = x.shape
    x = x.reshape(B, chunks, CHUNK, Hk, H // Hk, X)
    return x.permute(0, 3, 4, 1, 2, 5)


def _unchunk(x: torch.Tensor) -> torch.Tensor:
    """`_chunks`' inverse: (B, Hk, G, NC, C, X) -> (B, NC * C, Hk * G, X)."""
    B, Hk, G, NC, C, X = x.shape
    return x.permute(0, 3, 4, 1, 2, 5).reshape(B, NC * C, Hk * G, X)


def _segment_sums(g: torch.Tensor) -> torch.Tensor:
    """``sum(g[i+1..t])`` for t >= i, -inf above: g (..., C, X) -> (..., C, C, X). Each is
    its own running sum, never a difference of two cumulative sums: a gate of -20
    early in a chunk would cost the later decays ~1e-4 of relative precision in fp32."""
    C = g.shape[-2]
    strict = torch.ones(C, C, dtype=torch.bool, device=g.device).tril(-1)[..., None]
    rows = g[..., :, None, :].expand(*g.shape[:-2], C, C, g.shape[-1])  # [t, i] = g_t
    sums = rows.masked_fill(~strict, 0).cumsum(-3)  # [t, i] = sum(g[i+1..t])
    return sums.masked_fill(strict.transpose(0, 1), float("-inf"))  # i > t


def _decay_blocks(g: torch.Tensor):
    """Per-channel gates g (B, Hk, G, NC, C, K): (slice of the chunks, their decays
    (B, Hk, G, n, C, C, K), exp(G_t - G_i), 0 above the diagonal), `DECAY_ELEMENTS` at
    a time."""
    NC = g.shape[3]
    per_chunk = g[:, :, :, 0].numel() * g.shape[-2]
    step = max(1, DECAY_ELEMENTS // max(1, per_chunk))
    for first in range(0, NC, step):
        part = slice(first, first + step)
        yield part, _segment_sums(g[:, :, :, part]).exp()


def _intra(q, k, g):
    """``(A, P)`` of every chunk (B, Hk, G, NC, C, C): q, k (B, Hk, 1, NC, C, K);
    g (B, Hk, G, NC, C, 1 or K)."""
    if g.shape[-1] == 1:  # a scalar per head: one (C, C) decay matrix
        decay = _segment_sums(g).exp()[..., 0]
        A = (k @ k.transpose(-1, -2)) * decay  # k k^T once per k-head (GVA)
        return A.tril(-1), (q @ k.transpose(-1, -2)) * decay
    B, Hk, G, NC, C, _ = g.shape
    A, P = (q.new_empty((B, Hk, G, NC, C, C)) for _ in range(2))
    for part, decay in _decay_blocks(g):  # (.., n, t, i, K)
        kd = decay * k[:, :, :, part, None, :, :]  # decay[t, i] k_i
        A[:, :, :, part] = (kd @ k[:, :, :, part, :, :, None])[..., 0]
        P[:, :, :, part] = (kd @ q[:, :, :, part, :, :, None])[..., 0]
    return A.tril(-1), P


def _gates(g):
    """``(Γ, Γ_last, Γ_last / Γ)`` of every chunk from g (..., C, 1 or K)."""
    gates = g.cumsum(-2)  # G_t: sums of one sign, exact to rounding
    # G_last - G_t as the sum of the gates after t (a reversed running sum)
    after = g.flip(-2).cumsum(-2).flip(-2)
    after = torch.cat([after[..., 1:, :], torch.zeros_like(after[..., :1, :])], -2)
    return gates.exp(), gates[..., -1:, :].exp(), after.exp()


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
    empty = [zero if initial is None else initial[d : d + 1] for d in range(resets[2])]
    rows = [finals.get(d, e) for d, e in enumerate(empty)]
    return torch.stack(states, 3), torch.stack(deltas, 3), torch.cat(rows)


def _reverse(pdo, sdo, W, Kd, decay_last, dfinal, resets):
    """`_recurrence` backward: the deltas' gradients dΔ (B, Hk, G, NC, C, V), each
    chunk's outgoing state's dS (.., NC, K, V) and the initial states'. pdo = P^T dO and
    sdo = (QΓ)^T dO of every chunk; dfinal (N, Hk, G, K, V) or None."""
    B, Hk, G, NC, C, V = pdo.shape
    zero = pdo.new_zeros((B, Hk, G, W.shape[-1], V))
    dS = zero if dfinal is None or resets is not None else dfinal
    ddeltas, outgoing, dinits = [None] * NC, [None] * NC, {}
    for n in reversed(range(NC)):
        if resets is not None and n in resets[1]:  # a document's last chunk
            doc = resets[1][n]
            dS = zero if dfinal is None else dfinal[doc : doc + 1]
        outgoing[n] = dS
        ddeltas[n] = pdo[:, :, :, n] + Kd[:, :, :, n] @ dS
        decayed = decay_last[:, :, :, n, 0, :, None] * dS
        dS = sdo[:, :, :, n] + decayed - W[:, :, :, n].transpose(-1, -2) @ ddeltas[n]
        if resets is not None and n in resets[0]:
            dinits[resets[0][n]] = dS
    if resets is None:
        return torch.stack(ddeltas, 3), torch.stack(outgoing, 3), dS
    empty = [zero if dfinal is None else dfinal[d : d + 1] for d in range(resets[2])]
    dinit = torch.cat([dinits.get(d, e) for d, e in enumerate(empty)])
    return torch.stack(ddeltas, 3), torch.stack(outgoing, 3), dinit


def _recompute(q, k, v, g, beta, scale, initial, resets) -> dict:
    """Every chunk's intermediates by name: q, k (B, NC * C, Hk, K), v (B, NC * C, Hv, V),
    g (B, NC * C, Hv, 1 or K), beta (B, NC * C, Hv), in the computation's dtype, padded
    to whole chunks; initial (N, Hv, K, V) or None."""
    Hk, K = q.shape[-2:]
    Hv, V = v.shape[-2:]
    NC = q.shape[1] // CHUNK
    p = {"q": _chunks(q * scale, Hk, NC), "k": _chunks(k, Hk, NC)}  # (B, Hk, 1, NC, C, K)
    p["v"] = _chunks(v, Hk, NC)  # (B, Hk, G, NC, C, V)
    p["beta"] = _chunks(beta[..., None], Hk, NC)  # (B, Hk, G, NC, C, 1)
    p["g"] = _chunks(g, Hk, NC)  # (B, Hk, G, NC, C, 1 or K)
    p["A"], p["P"] = _intra(p["q"], p["k"], p["g"])
    p["gamma"], p["last"], to_last = _gates(p["g"])
    # the WY/UT form: (I + beta A)^-1 from one unit-triangular solve (its diagonal is not
    # read), then two batched GEMMs (a solve against V + K columns ran slower on a CPU)
    A, beta_c = p["A"], p["beta"]
    eye = torch.eye(CHUNK, dtype=A.dtype, device=A.device).expand(A.shape).contiguous()
    p["inverse"] = torch.linalg.solve_triangular(beta_c * A, eye, upper=False, unitriangular=True)
    p["kg"] = p["k"] * p["gamma"]
    p["U"], p["W"] = p["inverse"] @ (beta_c * p["v"]), p["inverse"] @ (beta_c * p["kg"])
    p["to_last"], p["Kd"] = to_last, p["k"] * to_last
    if initial is not None:
        initial = initial.reshape(initial.shape[0], Hk, Hv // Hk, K, V)
    p["S"], p["delta"], p["final"] = _recurrence(
        p["U"], p["W"], p["Kd"], p["last"], initial, resets
    )
    return p


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


def _stream(tensors, T: int, cu_seqlens):
    """`tensors` (B, T, ...) in the computation's layout: whole chunks, padded at the end
    or, with `cu_seqlens`, each document on chunks of its own (the padding rows zero).
    Returns (tensors, each token's row (T,) or None, `_recurrence`'s resets or None)."""
    if cu_seqlens is None:
        Tp = -(-T // CHUNK) * CHUNK
        return [_pad(t, Tp) for t in tensors], None, None
    index, chunks, resets = _documents(cu_seqlens.to(tensors[0].device), T)
    Tp = chunks * CHUNK
    padded = [t.new_zeros((1, Tp, *t.shape[2:])).index_copy(1, index, t) for t in tensors]
    return padded, index, resets


def forward(q, k, v, g, beta, *, scale, initial_state=None, cu_seqlens=None):
    """``(o, final_state)``: o (B, T, Hv, V) in v's dtype, final_state (N, Hv, K, V) fp32
    (float64 for float64 q), N = B or the documents. Inputs checked by the launcher."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[-2:]
    wide, out_dtype = accumulator(q.dtype), v.dtype
    g = g[..., None] if g.dim() == 3 else g  # (B, T, Hv, 1 or K)
    tensors = [t.to(wide) for t in (q, k, v, g, beta)]
    (q, k, v, g, beta), index, resets = _stream(tensors, T, cu_seqlens)
    initial = None if initial_state is None else initial_state.to(wide)
    if q.shape[1] == 0:  # T = 0, or documents of length 0 only
        N = B if resets is None else resets[2]
        final = q.new_zeros((N, Hv, K, V)) if initial is None else initial.clone()
        return v.new_zeros((B, T, Hv, V), dtype=out_dtype), final
    p = _recompute(q, k, v, g, beta, scale, initial, resets)
    O = (p["q"] * p["gamma"]) @ p["S"] + p["P"] @ p["delta"]  # (B, Hk, G, NC, C, V)
    o = _unchunk(O)
    o = o[:, :T] if index is None else o.index_select(1, index)
    final = p["final"]
    return o.to(out_dtype).contiguous(), final.reshape(final.shape[0], Hv, K, V).contiguous()


def _sum_before(x):
    """``sum(x[..., :j, :])`` at j along dim -2 (an exclusive running sum)."""
    return torch.cat([torch.zeros_like(x[..., :1, :]), x[..., :-1, :]], -2).cumsum(-2)


def _decay_grad(Z):
    """The gates' gradient (.., C, X) through the decays ``exp(sum(g[i+1..t]))`` from
    dlog(decay) Z (.., C, C, X): ``dg_j = sum_{t >= j} sum_{i < j} Z[t, i]``, a direct
    sum of the terms that hold g_j (row sums less column sums of a running total would
    cancel: fp32 lost 10% of its digits on the decay's parameters)."""
    C = Z.shape[-2]
    before = _sum_before(Z)  # [t, j] = sum_{i < j} Z[t, i]
    later = torch.ones(C, C, dtype=torch.bool, device=Z.device).tril()[..., None]  # t >= j
    return before.masked_fill(~later, 0).sum(-3)


def _intra_backward(p, dA, dP):
    """The gradients of q (scaled), k and g through A and P: (B, Hk, G or 1, NC, C, K)
    and (B, Hk, G, NC, C, 1 or K). With decay[t, i, c] = exp(G_tc - G_ic), dlog(decay) is
    ``dA k_t k_i decay + dP q_t k_i decay`` (for a scalar gate, ``dA A + dP P``)."""
    q, k, g = p["q"], p["k"], p["g"]
    if g.shape[-1] == 1:
        decay = _segment_sums(g).exp()[..., 0]
        # q and k are shared by the k-head's group: its members' (C, C) terms summed first
        EA, EP = (dA * decay).sum(2, keepdim=True), (dP * decay).sum(2, keepdim=True)
        dq = EP @ k  # (B, Hk, 1, NC, C, K)
        dk = (EA + EA.transpose(-1, -2)) @ k + EP.transpose(-1, -2) @ q
        return dq, dk, _decay_grad((dA * p["A"] + dP * p["P"])[..., None])
    B, Hk, G, NC, C, K = g.shape
    dq, dk, dg = (q.new_empty((B, Hk, G, NC, C, K)) for _ in range(3))
    for part, decay in _decay_blocks(g):  # (.., n, t, i, K)
        qn, kn = q[:, :, :, part], k[:, :, :, part]
        dAn, dPn = dA[:, :, :, part], dP[:, :, :, part]
        kd = decay * kn[..., None, :, :]  # decay[t, i] k_i
        rows = (dAn[..., :, None, :] @ kd)[..., 0, :]  # sum_i
        dq[:, :, :, part] = (dPn[..., :, None, :] @ kd)[..., 0, :]
        reads = dAn[..., None] * kn[..., :, None, :] + dPn[..., None] * qn[..., :, None, :]
        dg[:, :, :, part] = _decay_grad(kd * reads)  # Z[t, i] = decay k_i (dA k_t + dP q_t)
        decay = decay.transpose(-3, -2)  # (.., i, t, K)
        seen = dAn.transpose(-1, -2)[..., :, None, :] @ (decay * kn[..., None, :, :])
        seen += dPn.transpose(-1, -2)[..., :, None, :] @ (decay * qn[..., None, :, :])
        dk[:, :, :, part] = rows + seen[..., 0, :]  # sum_t
    return dq, dk, dg


@torch.no_grad()
def backward(do, dfinal, q, k, v, g, beta, *, scale, initial_state=None, cu_seqlens=None):
    """``(dq, dk, dv, dg, dbeta, dinit)`` of `forward` for the gradients do (of o) and
    dfinal (of the final state, or None): the chunk states recomputed, dS in reverse over
    the chunks, each gradient fresh, contiguous and in its input's dtype, dinit None
    without `initial_state`."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[-2:]
    wide = accumulator(q.dtype)
    inputs = (q, k, v, g, beta)
    g_ = g[..., None] if g.dim() == 3 else g  # (B, T, Hv, 1 or K)
    tensors = [t.to(wide) for t in (q, k, v, g_, beta, do)]
    (q_, k_, v_, g_, beta_, do_), index, resets = _stream(tensors, T, cu_seqlens)
    initial = None if initial_state is None else initial_state.to(wide)
    if q_.shape[1] == 0:  # nothing but the final state passed the initial one on
        zeros = [torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in inputs]
        if initial_state is None:
            return (*zeros, None)
        dinit = torch.zeros_like(initial) if dfinal is None else dfinal.to(wide)
        return (*zeros, dinit.to(initial_state.dtype).contiguous())
    p = _recompute(q_, k_, v_, g_, beta_, scale, initial, resets)
    G = Hv // Hk
    dO = _chunks(do_, Hk, q_.shape[1] // CHUNK)  # (B, Hk, G, NC, C, V)
    if dfinal is not None:
        dfinal = dfinal.to(wide).reshape(dfinal.shape[0], Hk, G, K, V)
    per_gate = (lambda x: x) if g_.shape[-1] > 1 else (lambda x: x.sum(-1, keepdim=True))
    # the output: O = (QΓ) S + P Δ
    qg = p["q"] * p["gamma"]
    dP = (dO @ p["delta"].transpose(-1, -2)).tril()
    dqg = dO @ p["S"].transpose(-1, -2)  # (.., C, K)
    pdo, sdo = p["P"].transpose(-1, -2) @ dO, qg.transpose(-1, -2) @ dO
    ddelta, dnext, dinit = _reverse(pdo, sdo, p["W"], p["Kd"], p["last"], dfinal, resets)
    # the state's step: S' = Γ_last S + Kd^T Δ, Δ = U - W S
    dW = -(ddelta @ p["S"].transpose(-1, -2))
    dKd = p["delta"] @ dnext.transpose(-1, -2)  # (.., C, K)
    dlast = per_gate((p["S"] * dnext).sum(-1))[..., None, :] * p["last"]  # (.., NC, 1, X)
    # the WY/UT form: U = T beta V, W = T beta KΓ, T = (I + beta A)^-1
    inverse_t = p["inverse"].transpose(-1, -2)
    dbv, dbkg = inverse_t @ ddelta, inverse_t @ dW  # of beta V and of beta KΓ
    dM = -(dbv @ p["U"].transpose(-1, -2) + dbkg @ p["W"].transpose(-1, -2)).tril(-1)
    beta_c = p["beta"]
    dbeta = (dM * p["A"]).sum(-1, keepdim=True) + (dbv * p["v"]).sum(-1, keepdim=True)
    dbeta += (dbkg * p["kg"]).sum(-1, keepdim=True)
    dkg = beta_c * dbkg
    dq, dk, dg = _intra_backward(p, beta_c * dM, dP)
    dq = dq.sum(2, keepdim=True) + (dqg * p["gamma"]).sum(2, keepdim=True)  # (.., 1, NC, C, K)
    dk = dk.sum(2, keepdim=True) + (dkg * p["gamma"] + dKd * p["to_last"]).sum(2, keepdim=True)
    # g_j reaches G_t (t >= j: QΓ, KΓ), G_last (Γ_last) and G_last - G_t (t < j: Kd), each
    # summed directly (a difference of two sums would cancel)
    dG = per_gate(dqg * qg + dkg * p["kg"])
    dg += dG.flip(-2).cumsum(-2).flip(-2) + dlast
    after = per_gate(dKd * p["Kd"])
    dg += _sum_before(after)
    grads = [
        _unchunk(dq) * scale,
        _unchunk(dk),
        _unchunk(beta_c * dbv),
        _unchunk(dg),
        _unchunk(dbeta)[..., 0],
    ]
    grads[3] = grads[3][..., 0] if g.dim() == 3 else grads[3]
    grads = [t[:, :T] if index is None else t.index_select(1, index) for t in grads]
    grads = [d.to(t.dtype).contiguous() for d, t in zip(grads, inputs, strict=True)]
    if initial_state is None:
        return (*grads, None)
    return (*grads, dinit.reshape(-1, Hv, K, V).to(initial_state.dtype).contiguous())
