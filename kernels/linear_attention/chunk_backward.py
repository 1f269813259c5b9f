"""The chunked gated delta rule's backward in Triton (the forward: `chunk`).

Five launches, nothing saved by the forward but its inputs:

| launch                      | computes                                                  |
| --------------------------- | --------------------------------------------------------- |
| `chunk.gdn_prepare_kernel`  | w, u, T = (I + A)⁻¹, M again, per chunk                   |
| `chunk.gdn_state_kernel`    | the chunk-start states S_c and new values U, recomputed   |
| `gdn_state_backward_kernel` | dS in fp32 registers, chunk after chunk in reverse: dU =  |
|                             | Mᵀ dO + (K∘Γ_L/Γ) dS', dS = Γ_L dS' + scale (Q∘Γ)ᵀ dO − wᵀ dU |
| `gdn_state_grads_kernel`    | per chunk and K block: dq's, dk's state parts, dw = −dU Sᵀ |
| `gdn_chunk_grads_kernel`    | per chunk: dv, dβ, dg, and dq, dk completed in place      |

Within a chunk: dT = dU (βV)ᵀ + dw (βK∘Γ)ᵀ, dA = −Tᵀ dT Tᵀ; the log decays' gradient
follows from every Γ multiplying q (+G) or k (+G or −G): dG = q∘dq + k∘(dk₊ − dk₋),
plus the chunk total's terms at G_L, then a reverse cumulative sum. Two kernels, not
one, so that neither spills (docs/linear_attention_kernels.md). GVA: dq and dk are made
per value head in fp32 and summed over each key head's group.
"""

import torch
import triton
import triton.language as tl
from fusedpar.kernels.attention import transposed_dot_miscompiles
from fusedpar.kernels.common import cdiv, check_launchable, next_power_of_2
from fusedpar.kernels.linear_attention.chunk import (
    CHUNK,
    check_inputs,
    chunk_grid,
    chunk_of,
    chunk_table,
    decay_gram,
    document_of,
    g_strides,
    kernel_flags,
    load_decay,
    load_tile,
    mm,
    per_row,
    per_state_row,
    prepare,
    run_states,
    segment_sums,
    tail_args,
)


def state_backward_configs(K: int, V: int) -> list[triton.Config]:
    """The state backward's tiles over V, largest first: in bf16 at K = 128, BV = 32 with
    8 warps builds without spilling (254 registers); BV = 64 spills 80-552 B."""
    bk = max(16, next_power_of_2(K))
    widths = [bv for bv in (32, 16) if bk * bv <= 128 * 32 or bv == 16]
    return [triton.Config({"BV": bv}, num_warps=8, num_stages=1) for bv in widths]


def state_grads_configs(K: int, V: int) -> list[triton.Config]:
    """The state-side gradient kernel's tiles: BK of K per program (a grid axis), V in
    steps of BV; it holds three (64, BK) fp32 accumulators."""
    bk = min(128, max(16, next_power_of_2(K)))
    return [triton.Config({"BK": bk, "BV": 32}, num_warps=8, num_stages=1)]


def grads_configs(K: int, V: int) -> list[triton.Config]:
    """The chunk-local gradient kernel's steps: V by BV with two (64, 64) fp32
    accumulators, then K by BK with (64, BK) tiles."""
    bk = min(32, max(16, next_power_of_2(K)))
    return [triton.Config({"BK": bk, "BV": bv}, num_warps=8, num_stages=1) for bv in (32, 16)]


@triton.jit
def transposed(X, spill, square, row_mask, VIA_MEMORY: tl.constexpr):
    """X^T for a (BT, BT) X made in registers, to feed a dot. Triton 3.4-3.7.0 miscompile
    ``tl.dot(tl.trans(acc), y)`` on Hopper: under VIA_MEMORY, X is stored to `spill` at
    `square` (its rows' scratch offsets) and read back transposed (a barrier between)."""
    if VIA_MEMORY:
        tl.store(spill + square, X, mask=row_mask[:, None])
        tl.debug_barrier()  # the CTA's stores are visible to its loads
        return tl.load(spill + tl.trans(square), mask=row_mask[None, :], other=0)
    else:
        return tl.trans(X)


@triton.jit
def gdn_state_backward_kernel(
    q, k, g, do, sqb, sqt, sqh, sqk, skb, skt, skh, skk, sgb, sgt, sgh, sgk,
    sdb, sdt, sdh, sdv,
    w, M,  # the prepare kernel's scratch
    dht, dh0,  # (N, Hv, K, V) fp32: the final state's gradient (HAS_DHT), the initial's
    dstates, dnew,  # (chunks, Hv, K, V) chunk-end state gradients, (B, T, Hv, V) dU: fp32
    cu_seqlens, chunk_doc, chunk_first,  # packed documents (chunk_doc unused here)
    scale, T, N, NT, Hv, GROUP, K, V,
    PER_CHANNEL: tl.constexpr, VARLEN: tl.constexpr, HAS_DHT: tl.constexpr,
    HAS_H0: tl.constexpr, DOT: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    DT = q.dtype.element_ty  # the dots' operands: 16-bit inputs' dtype, or fp32
    n, h, b, bos, eos, first = document_of(cu_seqlens, chunk_first, T, NT, Hv, VARLEN)
    hk = h // GROUP
    rows, kcols = tl.arange(0, BT), tl.arange(0, BK)
    vcols = tl.program_id(0) * BV + tl.arange(0, BV)
    state_mask = (kcols[:, None] < K) & (vcols[None, :] < V)
    state_off = kcols[:, None] * V + vcols[None, :]
    dS = tl.zeros((BK, BV), dtype=tl.float32)
    if HAS_DHT:
        dS = tl.load(dht + (n * Hv + h) * K * V + state_off, mask=state_mask, other=0)
    chunks = tl.cdiv(eos - bos, BT)
    for i in range(0, chunks):
        c = chunks - 1 - i
        start = bos + c * BT
        row_mask = start + rows < eos
        kmask = row_mask[:, None] & (kcols[None, :] < K)
        vmask = row_mask[:, None] & (vcols[None, :] < V)
        base = (b * T + start + rows) * Hv + h
        tl.store(dstates + ((first + c) * Hv + h) * K * V + state_off, dS, mask=state_mask)
        gp = g + b * sgb + start * sgt + h * sgh
        G, GL, after = load_decay(gp, rows, row_mask, sgt, kcols, K, sgk, PER_CHANNEL)
        dot_ = load_tile(do + b * sdb + start * sdt + h * sdh, rows, row_mask, sdt, vcols, V, sdv)
        dot_ = dot_.to(tl.float32)
        Mt = tl.load(M + base[:, None] * BT + rows[None, :], mask=row_mask[:, None], other=0)
        kt = load_tile(k + b * skb + start * skt + hk * skh, rows, row_mask, skt, kcols, K, skk)
        kd = kt.to(tl.float32) * tl.exp(per_row(after, PER_CHANNEL))
        dU = mm(tl.trans(Mt), dot_, DT, DOT)
        dU += mm(kd, dS, DT, DOT)  # (BT, BV)
        tl.store(dnew + base[:, None] * V + vcols[None, :], dU, mask=vmask)
        qt = load_tile(q + b * sqb + start * sqt + hk * sqh, rows, row_mask, sqt, kcols, K, sqk)
        qg = qt.to(tl.float32) * tl.exp(per_row(G, PER_CHANNEL))
        wt = tl.load(w + base[:, None] * K + kcols[None, :], mask=kmask, other=0)
        dS = dS * tl.exp(per_state_row(GL, PER_CHANNEL))
        dS += scale * mm(tl.trans(qg), dot_, DT, DOT)
        dS -= mm(tl.trans(wt), dU, DT, DOT)
    if HAS_H0:
        tl.store(dh0 + (n * Hv + h) * K * V + state_off, dS, mask=state_mask)


@triton.jit
def gdn_state_grads_kernel(
    g, do, sgb, sgt, sgh, sgk, sdb, sdt, sdh, sdv,
    states, dstates, new_values, dnew,  # recomputed and backward scratch (fp32)
    dq, dk, dw, dgl,  # out: (B, T, Hv, K) fp32 dq's, dk's state parts, dw; (chunks, Hv, K)
    cu_seqlens, chunk_doc, chunk_first,
    scale, T, N, NT, Hv, GROUP, K, V,  # GROUP unused: every GDN kernel's tail is the same
    PER_CHANNEL: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    DT = do.dtype.element_ty  # the inputs' dtype (dO is o's, v's)
    h, b, start, eos, chunk, live = chunk_of(
        cu_seqlens, chunk_doc, chunk_first, T, N, NT, Hv, VARLEN, BT
    )
    if live:
        rows, vcols = tl.arange(0, BT), tl.arange(0, BV)
        kcols = tl.program_id(2) * BK + tl.arange(0, BK)
        row_mask = start + rows < eos
        base = (b * T + start + rows) * Hv + h
        dqt = tl.zeros((BT, BK), dtype=tl.float32)  # d(Q∘Γ) / scale
        dkd = tl.zeros((BT, BK), dtype=tl.float32)  # d(K∘Γ_L/Γ)
        dwt = tl.zeros((BT, BK), dtype=tl.float32)
        dGL = tl.zeros((BK,), dtype=tl.float32)  # sum_v S dS' per channel
        state = ((chunk * Hv + h) * K + kcols[:, None]) * V
        for v0 in range(0, V, BV):
            cols = v0 + vcols
            vmask = row_mask[:, None] & (cols[None, :] < V)
            smask = (kcols[:, None] < K) & (cols[None, :] < V)
            S = tl.load(states + state + cols[None, :], mask=smask, other=0)  # (BK, BV)
            dS = tl.load(dstates + state + cols[None, :], mask=smask, other=0)
            U = tl.load(new_values + base[:, None] * V + cols[None, :], mask=vmask, other=0)
            dU = tl.load(dnew + base[:, None] * V + cols[None, :], mask=vmask, other=0)
            dO = load_tile(do + b * sdb + start * sdt + h * sdh, rows, row_mask, sdt, cols, V, sdv)
            dqt += mm(dO, tl.trans(S), DT, DOT)
            dkd += mm(U, tl.trans(dS), DT, DOT)
            dwt -= mm(dU, tl.trans(S), DT, DOT)
            dGL += tl.sum(S * dS, axis=1)
        gp = g + b * sgb + start * sgt + h * sgh
        G, GL, after = load_decay(gp, rows, row_mask, sgt, kcols, K, sgk, PER_CHANNEL)
        kmask = row_mask[:, None] & (kcols[None, :] < K)
        out = base[:, None] * K + kcols[None, :]
        tl.store(dq + out, scale * dqt * tl.exp(per_row(G, PER_CHANNEL)), mask=kmask)
        tl.store(dk + out, dkd * tl.exp(per_row(after, PER_CHANNEL)), mask=kmask)
        tl.store(dw + out, dwt, mask=kmask)
        # G_L scales the incoming state: its share of dG_L, per channel
        tl.store(dgl + (chunk * Hv + h) * K + kcols, tl.exp(GL) * dGL, mask=kcols < K)


@triton.jit
def gdn_chunk_grads_kernel(
    q, k, v, g, beta, do,  # inputs and dO, any strides
    sqb, sqt, sqh, sqk, skb, skt, skh, skk, svb, svt, svh, svv,
    sgb, sgt, sgh, sgk, sbb, sbt, sbh, sdb, sdt, sdh, sdv,
    Tinv, new_values, dnew, dw, dgl,  # recomputed and backward scratch (fp32)
    dq, dk,  # (B, T, Hv, K) fp32: in, the state parts; out, the gradients per value head
    dv, dg, dbeta,  # (B, T, Hv, V), g's shape, (B, T, Hv)
    spill_m, spill_a,  # (B, T, Hv, 64) fp32: dM, dA transposed through memory (VIA_MEMORY)
    cu_seqlens, chunk_doc, chunk_first,
    scale, T, N, NT, Hv, GROUP, K, V,
    PER_CHANNEL: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
    VIA_MEMORY: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    DT = q.dtype.element_ty
    h, b, start, eos, chunk, live = chunk_of(
        cu_seqlens, chunk_doc, chunk_first, T, N, NT, Hv, VARLEN, BT
    )
    if live:
        rows, kcols, vcols = tl.arange(0, BT), tl.arange(0, BK), tl.arange(0, BV)
        row_mask = start + rows < eos
        base = (b * T + start + rows) * Hv + h
        hk = h // GROUP
        qp = q + b * sqb + start * sqt + hk * sqh
        kp = k + b * skb + start * skt + hk * skh
        gp = g + b * sgb + start * sgt + h * sgh
        G, GL, after = load_decay(gp, rows, row_mask, sgt, kcols, K, sgk, PER_CHANNEL)
        bet = tl.load(beta + b * sbb + (start + rows) * sbt + h * sbh, mask=row_mask, other=0)
        bet = bet.to(tl.float32)
        Ti = tl.load(Tinv + base[:, None] * BT + rows[None, :], mask=row_mask[:, None], other=0)
        dM = tl.zeros((BT, BT), dtype=tl.float32)
        dT = tl.zeros((BT, BT), dtype=tl.float32)
        dbet = tl.zeros((BT,), dtype=tl.float32)
        for v0 in range(0, V, BV):
            cols = v0 + vcols
            vmask = row_mask[:, None] & (cols[None, :] < V)
            U = tl.load(new_values + base[:, None] * V + cols[None, :], mask=vmask, other=0)
            dU = tl.load(dnew + base[:, None] * V + cols[None, :], mask=vmask, other=0)
            dO = load_tile(do + b * sdb + start * sdt + h * sdh, rows, row_mask, sdt, cols, V, sdv)
            vt = load_tile(v + b * svb + start * svt + h * svh, rows, row_mask, svt, cols, V, svv)
            vt = vt.to(tl.float32)
            dM += mm(dO, tl.trans(U), DT, DOT)
            dbv = mm(tl.trans(Ti), dU, DT, DOT)  # d(beta v)
            tl.store(dv + base[:, None] * V + cols[None, :], (bet[:, None] * dbv), mask=vmask)
            dbet += tl.sum(dbv * vt, axis=1)
            dT += mm(dU, tl.trans(bet[:, None] * vt), DT, DOT)
        # then K in blocks of BK: (64, BK) tiles, one block's at a time. First the (64, 64)
        # products over K: dT's share from dw = d(beta K∘Γ) and (scalar gate) K Kᵀ
        KK = tl.zeros((BT, BT), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kc = k0 + kcols
            kmask = row_mask[:, None] & (kc[None, :] < K)
            if PER_CHANNEL:
                G, GL, after = load_decay(gp, rows, row_mask, sgt, kc, K, sgk, PER_CHANNEL)
            kt = load_tile(kp, rows, row_mask, skt, kc, K, skk)
            bk = bet[:, None] * kt.to(tl.float32) * tl.exp(per_row(G, PER_CHANNEL))
            dwt = tl.load(dw + base[:, None] * K + kc[None, :], mask=kmask, other=0)
            dT += mm(dwt, tl.trans(bk), DT, DOT)
            if not PER_CHANNEL:
                KK += mm(kt, tl.trans(kt), DT, DOT)
        strict = (rows[:, None] > rows[None, :]) & row_mask[:, None] & row_mask[None, :]
        causal = (rows[:, None] >= rows[None, :]) & row_mask[:, None] & row_mask[None, :]
        dA = -mm(mm(tl.trans(Ti), dT, DT, DOT), tl.trans(Ti), DT, DOT)
        dA = tl.where(strict, dA, 0.0)
        if PER_CHANNEL:  # the Gram matrix channel by channel (the decays do not factor)
            strides = (skt, skk, skt, skk, sgt, sgk)
            Ahat = decay_gram(
                KK, KK, G, kp, kp, gp, rows, row_mask, strides, K, False, True, DT, DOT, BT
            )
        else:
            diff = segment_sums(gp, rows, row_mask, sgt)  # log decays, 0 on and above
            Ahat = tl.where(strict, KK * tl.exp(diff), 0.0)
        dbet += tl.sum(dA * Ahat, axis=1)
        dAh = bet[:, None] * dA  # d(K K^T ∘ decay), strictly lower
        dMg = tl.where(causal, dM, 0.0) * scale  # d(Q K^T ∘ decay), lower
        if not PER_CHANNEL:
            DM = tl.where(causal, dMg * tl.exp(diff), 0.0)
            DA = tl.where(strict, dAh * tl.exp(diff), 0.0)
            square = base[:, None] * BT + rows[None, :]
            DMt = transposed(DM, spill_m, square, row_mask, VIA_MEMORY)
            DAt = transposed(DA, spill_a, square, row_mask, VIA_MEMORY)
        dG_rows = tl.zeros((BT,), dtype=tl.float32)
        dGL_all = 0.0
        # then each block's dq and dk: the state parts (the first kernel's) plus the
        # chunk's own, split by the sign G enters with (dk₊, dk₋) for dG
        for k0 in range(0, K, BK):
            kc = k0 + kcols
            kmask = row_mask[:, None] & (kc[None, :] < K)
            out = base[:, None] * K + kc[None, :]
            if PER_CHANNEL:
                G, GL, after = load_decay(gp, rows, row_mask, sgt, kc, K, sgk, PER_CHANNEL)
            kt = load_tile(kp, rows, row_mask, skt, kc, K, skk)
            qt = load_tile(qp, rows, row_mask, sqt, kc, K, sqk)
            decay = tl.exp(per_row(G, PER_CHANNEL))
            dbk = mm(tl.trans(Ti), tl.load(dw + out, mask=kmask, other=0), DT, DOT)
            dbet += tl.sum(dbk * kt.to(tl.float32) * decay, axis=1)
            dkp = bet[:, None] * decay * dbk
            dkm = tl.load(dk + out, mask=kmask, other=0)
            dqs = tl.load(dq + out, mask=kmask, other=0)
            # G_L scales the incoming state (the first kernel's share) and every k's path
            # to the chunk's end (dk's state part)
            dGL = tl.load(dgl + (chunk * Hv + h) * K + kc, mask=kc < K, other=0)
            dGL += tl.sum(kt.to(tl.float32) * dkm, axis=0)  # (BK,)
            if PER_CHANNEL:
                for ch in range(k0, k0 + BK):
                    cm = row_mask & (rows * 0 + ch < K)
                    qc = tl.load(qp + rows * sqt + ch * sqk, mask=cm, other=0).to(tl.float32)
                    kc_ = tl.load(kp + rows * skt + ch * skk, mask=cm, other=0).to(tl.float32)
                    gc = tl.load(gp + rows * sgt + ch * sgk, mask=cm, other=0).to(tl.float32)
                    Gc = tl.cumsum(gc, axis=0)
                    Ec = tl.exp(tl.where(causal, Gc[:, None] - Gc[None, :], 0.0))
                    DM = tl.where(causal, dMg * Ec, 0.0)
                    DA = tl.where(strict, dAh * Ec, 0.0)
                    at = kc[None, :] == ch
                    dqs += tl.where(at, tl.sum(DM * kc_[None, :], axis=1)[:, None], 0.0)
                    dkp += tl.where(at, tl.sum(DA * kc_[None, :], axis=1)[:, None], 0.0)
                    minus = tl.sum(DM * qc[:, None], axis=0) + tl.sum(DA * kc_[:, None], axis=0)
                    dkm += tl.where(at, minus[:, None], 0.0)
            else:
                dqs += mm(DM, kt, DT, DOT)
                dkp += mm(DA, kt, DT, DOT)
                dkm += mm(DMt, qt, DT, DOT)
                dkm += mm(DAt, kt, DT, DOT)
            dG = qt.to(tl.float32) * dqs + kt.to(tl.float32) * (dkp - dkm)  # (BT, BK)
            tl.store(dq + out, dqs, mask=kmask)
            tl.store(dk + out, dkp + dkm, mask=kmask)
            if PER_CHANNEL:
                # g_j enters every G_i with i >= j, and G_L: a reverse cumulative sum
                dg_ = tl.sum(dG, axis=0) - tl.cumsum(dG, axis=0) + dG + dGL
                tl.store(dg + out, dg_, mask=kmask)
            else:
                dG_rows += tl.sum(dG, axis=1)
                dGL_all += tl.sum(dGL, axis=0)
        tl.store(dbeta + base, dbet, mask=row_mask)
        if not PER_CHANNEL:
            dg_ = tl.sum(dG_rows, axis=0) - tl.cumsum(dG_rows, axis=0) + dG_rows + dGL_all
            tl.store(dg + base, dg_, mask=row_mask)


# Tests set it to run the guarded path under any Triton (None: follow the version).
TRANSPOSE_VIA_MEMORY: bool | None = None


def transposed_through_memory(g: torch.Tensor) -> bool:
    """Whether the chunk-gradient kernel transposes dM and dA through memory: under the
    Triton versions that miscompile ``tl.dot(tl.trans(acc), x)`` with a 64-wide wgmma
    accumulator (`fusedpar.kernels.attention.transposed_dot_miscompiles`: FLA's dK bug,
    its issues #640, #826, #983), with a scalar gate (the per-channel path has no such dot)."""
    if g.dim() == 4:
        return False
    if TRANSPOSE_VIA_MEMORY is not None:
        return TRANSPOSE_VIA_MEMORY
    return transposed_dot_miscompiles()


def check_grads(do, dfinal, dims) -> None:
    B, T, Hk, Hv, K, V, N = dims
    if do.shape != (B, T, Hv, V):
        raise ValueError(f"do (B, T, Hv, V) = {(B, T, Hv, V)} expected, got {tuple(do.shape)}")
    if dfinal is not None and (dfinal.shape != (N, Hv, K, V) or dfinal.dtype != torch.float32):
        raise ValueError(
            f"dfinal (N, Hv, K, V) = {(N, Hv, K, V)} fp32 expected, got "
            f"{tuple(dfinal.shape)} {dfinal.dtype}"
        )


def chunk_gated_delta_backward(
    do, dfinal, q, k, v, g, beta, *, scale, initial_state=None, cu_seqlens=None
):
    """``(dq, dk, dv, dg, dbeta, dinit)`` in their inputs' dtypes (dinit fp32, None without
    an initial state) for the forward's ``(o, final_state)`` gradients `do` (B, T, Hv, V)
    and `dfinal` (N, Hv, K, V) fp32 or None. The chunk states are recomputed."""
    dims = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    check_grads(do, dfinal, dims)
    extra = [t for t in (initial_state, cu_seqlens, dfinal) if t is not None]
    check_launchable(gdn_chunk_grads_kernel, do, q, k, v, g, beta, *extra)
    B, T, Hk, Hv, K, V, N = dims
    table = chunk_table(cu_seqlens, T, B)
    slots, NT, _, _ = table
    varlen = cu_seqlens is not None
    scratch = prepare(q, k, v, g, beta, scale, cu_seqlens, table, dims)
    chunks = slots if varlen else B * NT
    states, dstates = q.new_empty((2, chunks, Hv, K, V), dtype=torch.float32)
    new_values, dnew = q.new_empty((2, B, T, Hv, V), dtype=torch.float32)
    run_states(
        q,
        k,
        g,
        scratch,
        initial_state,
        cu_seqlens,
        table,
        dims,
        scale=scale,
        writes=(None, (states, new_values)),
    )
    w, _, Tinv, M = scratch
    dinit = None if initial_state is None else torch.empty_like(initial_state)
    config = state_backward_configs(K, V)[0]
    gdn_state_backward_kernel[(cdiv(V, config.kwargs["BV"]), N * Hv)](
        q,
        k,
        g,
        do,
        *q.stride(),
        *k.stride(),
        *g_strides(g),
        *do.stride(),
        w,
        M,
        dfinal,
        dinit,
        dstates,
        dnew,
        *tail_args(table, dims, cu_seqlens, scale),
        **kernel_flags(q, g, cu_seqlens),
        HAS_DHT=dfinal is not None,
        HAS_H0=initial_state is not None,
        BK=max(16, next_power_of_2(K)),
        **config.all_kwargs(),
    )
    # w's scratch is free once the state backward has run: the state-side kernel writes
    # dw there, and dq's and dk's state parts (fp32, per value head) into dq_h and dk_h,
    # which the chunk-local kernel completes in place
    dw = w
    dq_h, dk_h = q.new_empty((2, B, T, Hv, K), dtype=torch.float32)
    dgl = q.new_empty((chunks, Hv, K), dtype=torch.float32)
    config = state_grads_configs(K, V)[0]
    grid = (*chunk_grid(table, dims, cu_seqlens), cdiv(K, config.kwargs["BK"]))
    gdn_state_grads_kernel[grid](
        g,
        do,
        *g_strides(g),
        *do.stride(),
        states,
        dstates,
        new_values,
        dnew,
        dq_h,
        dk_h,
        dw,
        dgl,
        *tail_args(table, dims, cu_seqlens, scale),
        **kernel_flags(q, g, cu_seqlens),
        **config.all_kwargs(),
    )
    via_memory = transposed_through_memory(g)
    spills = q.new_empty((2, B, T, Hv, CHUNK) if via_memory else (2, 1), dtype=torch.float32)
    dv = v.new_empty((B, T, Hv, V))
    dg = g.new_empty(g.shape)
    dbeta = beta.new_empty(beta.shape)
    gdn_chunk_grads_kernel[chunk_grid(table, dims, cu_seqlens)](
        q,
        k,
        v,
        g,
        beta,
        do,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *g_strides(g),
        *beta.stride(),
        *do.stride(),
        Tinv,
        new_values,
        dnew,
        dw,
        dgl,
        dq_h,
        dk_h,
        dv,
        dg,
        dbeta,
        *spills,
        *tail_args(table, dims, cu_seqlens, scale),
        **kernel_flags(q, g, cu_seqlens),
        VIA_MEMORY=via_memory,
        **grads_configs(K, V)[0].all_kwargs(),
    )
    # GVA: each key head's gradient is its group's value heads' sum
    dq = dq_h.view(B, T, Hk, Hv // Hk, K).sum(3).to(q.dtype)
    dk = dk_h.view(B, T, Hk, Hv // Hk, K).sum(3).to(k.dtype)
    return dq, dk, dv, dg, dbeta, dinit
