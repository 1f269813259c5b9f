"""The chunked gated delta rule's forward in Triton: chunks of 64 tokens, WY form.

Per value head and chunk (rows i, j; G the in-chunk cumulative log decay, per channel or
a scalar per row; Γ = exp(G); Γ_L the whole chunk's):

| kernel                | computes                                                     |
| --------------------- | ------------------------------------------------------------ |
| `gdn_prepare_kernel`  | A = tril₋(β K Kᵀ ∘ Γ_i/Γ_j), T = (I + A)⁻¹ (forward           |
|                       | substitution, once per chunk), w = T(β K∘Γ), u = T(β V),     |
|                       | M = scale tril(Q Kᵀ ∘ Γ_i/Γ_j): one program per chunk        |
| `gdn_state_kernel`    | S in fp32 registers, chunk after chunk: U = u − w S,         |
|                       | o = scale (Q∘Γ) S + M U, S ← Γ_L S + (K∘Γ_L/Γ)ᵀ U            |

The decays enter only as exp(G_i − G_j) with j <= i or exp(G_L − G_i), exponents <= 0
(no overflow; per channel, the Gram matrices loop over channels rather than factor
exp(G_i) exp(−G_j)); a scalar gate's are sums of g's segments (`segment_sums`,
`load_decay`'s `after`), not differences. One launch per phase; packed documents map
chunk slots to documents on the device (`chunk_table`, no host sync). The backward
(`chunk_backward`) recomputes the chunk states. Notes: docs/linear_attention_kernels.md.
"""

import torch
import triton
import triton.language as tl
from fusedpar.kernels import common
from fusedpar.kernels.common import cdiv, check_launchable, next_power_of_2

CHUNK = 64  # tokens per chunk: the issue's, and FLA's (a 64x64 triangular solve)
MAX_HEAD_DIM = 256  # K and V: one (K, BV) fp32 state tile per program
SOLVE_BLOCK = tl.constexpr(16)  # the triangular solve's diagonal blocks (dot's least side)


def state_configs(K: int, V: int) -> list[triton.Config]:
    """The forward state kernel's tiles over V, largest first (the launcher takes the
    first: no GPU has timed them yet). The (K, BV) fp32 state, w and q tiles share the
    registers: in bf16 at K = 128, BV = 32 with 4 warps builds without spilling (255
    registers), BV = 64 spills 232 B (144 B with 8 warps)."""
    bk = max(16, next_power_of_2(K))
    widths = [bv for bv in (32, 16) if bk * bv <= 128 * 32 or bv == 16]
    return [triton.Config({"BV": bv}, num_warps=4, num_stages=1) for bv in widths]


def prepare_configs(K: int, V: int) -> list[triton.Config]:
    """The per-chunk kernel's settings: the 64x64 solve and Gram matrices in one CTA (bf16
    on sm_90: 203 registers at K = 128, 240 at 256, no spill; with the solve's merge in
    64x64 fp32 FMA dots it spilled 632 B, 2,216 B with 4 warps)."""
    return [triton.Config({}, num_warps=8, num_stages=1)]


# --- shared device helpers -----------------------------------------------------------------


@triton.jit
def chunk_slot(pid_chunk, pid_head, Hv, NT, chunk_doc, chunk_first, N, VARLEN: tl.constexpr):
    """(document, chunk within it, valid) of a per-chunk program: unpacked, the grid is
    (NT, B * Hv); packed, (slots, Hv) with the slot's document read from `chunk_doc`."""
    if VARLEN:
        n = tl.load(chunk_doc + pid_chunk)
        valid = n < N
        n = tl.minimum(n, N - 1)
        c = pid_chunk - tl.load(chunk_first + n)
    else:
        n = pid_head // Hv
        valid = pid_chunk < NT
        c = pid_chunk
    return n, c, valid


@triton.jit
def doc_span(cu_seqlens, n, T, VARLEN: tl.constexpr):
    """(batch row, first token, end token) of document `n`."""
    if VARLEN:
        bos = tl.load(cu_seqlens + n).to(tl.int32)
        eos = tl.load(cu_seqlens + n + 1).to(tl.int32)
        b = n * 0
    else:
        bos = n * 0
        eos = bos + T
        b = n
    return b, bos, eos


@triton.jit
def chunk_of(
    cu_seqlens, chunk_doc, chunk_first, T, N, NT, Hv, VARLEN: tl.constexpr, BT: tl.constexpr
):
    """This per-chunk program's (value head, batch row, first token, its document's end,
    the chunk's index among all chunks, live: False in the unused slots)."""
    pid_chunk, pid_head = tl.program_id(0), tl.program_id(1)
    h = pid_head % Hv
    n, c, valid = chunk_slot(pid_chunk, pid_head, Hv, NT, chunk_doc, chunk_first, N, VARLEN)
    b, bos, eos = doc_span(cu_seqlens, n, T, VARLEN)
    start = bos + c * BT
    chunk = (tl.load(chunk_first + n) if VARLEN else n * NT) + c
    return h, b, start, eos, chunk, valid & (start < eos)


@triton.jit
def document_of(cu_seqlens, chunk_first, T, NT, Hv, VARLEN: tl.constexpr):
    """This per-document program's (document, value head, batch row, first token, end
    token, its first chunk's index among all chunks)."""
    n, h = tl.program_id(1) // Hv, tl.program_id(1) % Hv
    b, bos, eos = doc_span(cu_seqlens, n, T, VARLEN)
    first = tl.load(chunk_first + n) if VARLEN else n * NT
    return n, h, b, bos, eos, first


@triton.jit
def load_tile(ptr, rows, row_mask, stride_row, cols, n_cols, stride_col):
    """A (rows, cols) tile in its own dtype, 0 outside the rows and columns."""
    mask = row_mask[:, None] & (cols[None, :] < n_cols)
    offsets = rows[:, None] * stride_row + cols[None, :] * stride_col
    return tl.load(ptr + offsets, mask=mask, other=0)


@triton.jit
def load_decay(g_ptr, rows, row_mask, stride_gt, cols, K, stride_gk, PER_CHANNEL: tl.constexpr):
    """The in-chunk cumulative log decay G ((64,) or (64, BK), fp32), the chunk's total G_L
    (a scalar or (BK,): G's last row, padding rows adding 0) and `after`, the decay from
    each token to the chunk's end, sum_{t > i} g_t. A scalar gate's is its own running sum
    from the end: G_L - G_i loses ~|G| eps after an early deep gate. Per channel it is
    G_L - G (a second (64, BK) tile spilled the state kernel, 272 -> 680 B at K = 128).
    Either is 0 at the last token (tl.sum for G_L would round differently from G's)."""
    if PER_CHANNEL:
        g = load_tile(g_ptr, rows, row_mask, stride_gt, cols, K, stride_gk).to(tl.float32)
        G = tl.cumsum(g, axis=0)
        last = tl.sum(tl.where(rows[:, None] == rows.shape[0] - 1, G, 0.0), axis=0)
        after = last[None, :] - G
    else:
        g = tl.load(g_ptr + rows * stride_gt, mask=row_mask, other=0).to(tl.float32)
        G = tl.cumsum(g, axis=0)
        last = tl.sum(tl.where(rows == rows.shape[0] - 1, G, 0.0), axis=0)
        nxt = rows + 1 < tl.sum(row_mask.to(tl.int32), axis=0)  # token i + 1 is the chunk's
        g_next = tl.load(g_ptr + (rows + 1) * stride_gt, mask=nxt, other=0).to(tl.float32)
        after = tl.cumsum(g_next, axis=0, reverse=True)
    return G, last, after


@triton.jit
def segment_sums(g_ptr, rows, row_mask, stride_gt):
    """A scalar gate's log decays between rows, (BT, BT) fp32: sum_{j < t <= i} g_t at
    [i, j], 0 where j >= i; each its own running sum, not G_i - G_j (torch_impl's
    `_segment_sums`: an early gate of -30 cost the later decays ~1e-5 of their precision)."""
    g = tl.load(g_ptr + rows * stride_gt, mask=row_mask, other=0).to(tl.float32)
    return tl.cumsum(tl.where(rows[:, None] > rows[None, :], g[:, None], 0.0), axis=0)


@triton.jit
def per_row(G, PER_CHANNEL: tl.constexpr):
    """G broadcast against a (64, K) tile."""
    if PER_CHANNEL:
        return G
    else:
        return G[:, None]


@triton.jit
def per_state_row(GL, PER_CHANNEL: tl.constexpr):
    """G_L broadcast against a (K, V) state tile."""
    if PER_CHANNEL:
        return GL[:, None]
    else:
        return GL


@triton.jit
def decay_gram(a, b, D, a_ptr, b_ptr, g_ptr, rows, row_mask, strides, K,
               INCLUSIVE: tl.constexpr, PER_CHANNEL: tl.constexpr, DT, DOT: tl.constexpr,
               BT: tl.constexpr):  # fmt: skip
    """``sum_c a_ic b_jc exp(G_ic - G_jc)`` on j < i (j <= i if INCLUSIVE), (BT, BT) fp32.
    Scalar decay: one dot of the tiles `a`, `b`, D the `segment_sums`. Per channel: a loop
    over channels, reading the columns (strides: a's, b's and g's per token and channel)."""
    keep = rows[:, None] >= rows[None, :] if INCLUSIVE else rows[:, None] > rows[None, :]
    keep = keep & row_mask[:, None] & row_mask[None, :]
    if PER_CHANNEL:
        sat, sac, sbt, sbc, sgt, sgc = strides
        acc = tl.zeros((BT, BT), dtype=tl.float32)
        for c in range(K):
            ac = tl.load(a_ptr + rows * sat + c * sac, mask=row_mask, other=0).to(tl.float32)
            bc = tl.load(b_ptr + rows * sbt + c * sbc, mask=row_mask, other=0).to(tl.float32)
            gc = tl.load(g_ptr + rows * sgt + c * sgc, mask=row_mask, other=0).to(tl.float32)
            Gc = tl.cumsum(gc, axis=0)
            diff = tl.where(keep, Gc[:, None] - Gc[None, :], 0.0)
            acc += tl.where(keep, ac[:, None] * bc[None, :] * tl.exp(diff), 0.0)
        return acc
    else:
        ab = mm(a, tl.trans(b), DT, DOT)
        return tl.where(keep, ab * tl.exp(tl.where(keep, D, 0.0)), 0.0)


@triton.jit
def mm(a, b, DT, DOT: tl.constexpr):
    """``a @ b`` with fp32 accumulation, the operands rounded to DT first: 16-bit inputs'
    dtype (tensor cores at full rate, as FLA does) or fp32 (then DOT: ieee or tf32)."""
    return tl.dot(a.to(DT), b.to(DT), input_precision=DOT)


@triton.jit
def load_block(tri, i, j, stride, n_rows, BLOCK: tl.constexpr):
    """Block (i, j) of a (BT, BT) fp32 matrix stored row by row (`stride` apart) at `tri`,
    0 in rows from `n_rows` on."""
    r = tl.arange(0, BLOCK)
    at = r + i * BLOCK  # the tensor first: the interpreter keeps constexpr + tensor constexpr
    return tl.load(tri + at[:, None] * stride + j * BLOCK + r[None, :], mask=(at < n_rows)[:, None])


@triton.jit
def store_block(tri, x, i, j, stride, n_rows, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    at = r + i * BLOCK
    tl.store(tri + at[:, None] * stride + j * BLOCK + r[None, :], x, mask=(at < n_rows)[:, None])


@triton.jit
def bdot(a, b):
    """A BLOCK x BLOCK product in full fp32 (FMA: small operands, few registers)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def unit_lower_inverse(A, tri, stride, n_rows, BT: tl.constexpr, BLOCK: tl.constexpr):
    """T = (I + A)^-1 for strictly lower A (BT, BT), written to `tri` (rows `stride` apart,
    `n_rows` of them) and returned. Forward substitution inside the diagonal BLOCK x BLOCK
    blocks (all at once, BLOCK - 1 element-wise steps) gives T_ii; the blocks below follow
    block row by block row, T_ij = -T_ii sum_{j <= k < i} A_ik T_kj, in BLOCK-sized fp32
    dots read back from `tri` (a 64x64 fp32 FMA dot holds its operands in registers and
    spills). In full fp32: the solve's error grows with A's entries (beta any sign)."""
    tl.static_assert(BT == 4 * BLOCK)
    rows = tl.arange(0, BT)
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    same = (rows[:, None] // BLOCK) == (rows[None, :] // BLOCK)
    diag = tl.where(same, A, 0.0)
    Td = eye
    for r in range(1, BLOCK):
        at = (rows % BLOCK) == r  # row r of every block: its earlier rows are final
        # the blocks' rows r side by side: their columns are disjoint (one block each)
        a_r = tl.sum(tl.where(at[:, None], diag, 0.0), axis=0)  # (BT,)
        row = -tl.sum(a_r[:, None] * Td, axis=0)  # column j: block j // BLOCK's row r
        Td = tl.where(at[:, None] & same, row[None, :] + eye, Td)
    row_mask = rows < n_rows
    # T_ii on the diagonal, A_ij below it (disjoint): one store, then blocks read back
    below = tl.where(same, 0.0, A)
    tl.store(tri + rows[:, None] * stride + rows[None, :], Td + below, mask=row_mask[:, None])
    tl.debug_barrier()  # the CTA's stores are visible to its loads
    T00 = load_block(tri, 0, 0, stride, n_rows, BLOCK)
    T11 = load_block(tri, 1, 1, stride, n_rows, BLOCK)
    T22 = load_block(tri, 2, 2, stride, n_rows, BLOCK)
    T33 = load_block(tri, 3, 3, stride, n_rows, BLOCK)
    A10 = load_block(tri, 1, 0, stride, n_rows, BLOCK)
    A20 = load_block(tri, 2, 0, stride, n_rows, BLOCK)
    A21 = load_block(tri, 2, 1, stride, n_rows, BLOCK)
    A30 = load_block(tri, 3, 0, stride, n_rows, BLOCK)
    A31 = load_block(tri, 3, 1, stride, n_rows, BLOCK)
    A32 = load_block(tri, 3, 2, stride, n_rows, BLOCK)
    T10 = -bdot(T11, bdot(A10, T00))
    T21 = -bdot(T22, bdot(A21, T11))
    T32 = -bdot(T33, bdot(A32, T22))
    T20 = -bdot(T22, bdot(A20, T00) + bdot(A21, T10))
    T31 = -bdot(T33, bdot(A31, T11) + bdot(A32, T21))
    T30 = -bdot(T33, bdot(A30, T00) + bdot(A31, T10) + bdot(A32, T20))
    tl.debug_barrier()  # every A_ij is read before its T_ij overwrites it
    store_block(tri, T10, 1, 0, stride, n_rows, BLOCK)
    store_block(tri, T20, 2, 0, stride, n_rows, BLOCK)
    store_block(tri, T21, 2, 1, stride, n_rows, BLOCK)
    store_block(tri, T30, 3, 0, stride, n_rows, BLOCK)
    store_block(tri, T31, 3, 1, stride, n_rows, BLOCK)
    store_block(tri, T32, 3, 2, stride, n_rows, BLOCK)
    tl.debug_barrier()
    return tl.load(tri + rows[:, None] * stride + rows[None, :], mask=row_mask[:, None], other=0)


# --- kernels -------------------------------------------------------------------------------


@triton.jit
def gdn_prepare_kernel(
    q, k, v, g, beta,  # inputs, any strides
    sqb, sqt, sqh, sqk, skb, skt, skh, skk, svb, svt, svh, svv,
    sgb, sgt, sgh, sgk, sbb, sbt, sbh,
    w, u, Tinv, M,  # (B, T, Hv, K | V | 64 | 64) contiguous scratch
    cu_seqlens, chunk_doc, chunk_first,  # packed documents (VARLEN)
    scale, T, N, NT, Hv, GROUP, K, V,
    PER_CHANNEL: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    DT = q.dtype.element_ty  # the dots' operands: 16-bit inputs' dtype, or fp32
    h, b, start, eos, chunk, live = chunk_of(  # chunk: unused here
        cu_seqlens, chunk_doc, chunk_first, T, N, NT, Hv, VARLEN, BT
    )
    if live:
        rows = tl.arange(0, BT)
        row_mask = start + rows < eos
        kcols, vcols = tl.arange(0, BK), tl.arange(0, BV)
        hk = h // GROUP
        qp = q + b * sqb + start * sqt + hk * sqh
        kp = k + b * skb + start * skt + hk * skh
        gp = g + b * sgb + start * sgt + h * sgh
        G, GL, after = load_decay(gp, rows, row_mask, sgt, kcols, K, sgk, PER_CHANNEL)
        D = segment_sums(gp, rows, row_mask, sgt)  # scalar gate only (unused per channel)
        bet = tl.load(beta + b * sbb + (start + rows) * sbt + h * sbh, mask=row_mask, other=0)
        bet = bet.to(tl.float32)
        # q and k stay in their dtype (the dots' operands); M is stored before the solve so
        # that only A, T and k hold registers through it
        kt = load_tile(kp, rows, row_mask, skt, kcols, K, skk)
        qt = load_tile(qp, rows, row_mask, sqt, kcols, K, sqk)
        kk, qk = (skt, skk, skt, skk, sgt, sgk), (sqt, sqk, skt, skk, sgt, sgk)
        # scratch rows: token (b, start + i), head h
        base = (b * T + start + rows) * Hv + h  # (BT,)
        Mt = decay_gram(
            qt, kt, D, qp, kp, gp, rows, row_mask, qk, K, True, PER_CHANNEL, DT, DOT, BT
        )
        tl.store(M + base[:, None] * BT + rows[None, :], Mt * scale, mask=row_mask[:, None])
        A = decay_gram(
            kt, kt, D, kp, kp, gp, rows, row_mask, kk, K, False, PER_CHANNEL, DT, DOT, BT
        )
        tri = Tinv + ((b * T + start) * Hv + h) * BT  # the chunk's (BT, BT) rows
        Ti = unit_lower_inverse(bet[:, None] * A, tri, Hv * BT, eos - start, BT, SOLVE_BLOCK)
        if PER_CHANNEL:  # read again: a (BT, BK) fp32 G held through the solve spills
            G, GL, after = load_decay(gp, rows, row_mask, sgt, kcols, K, sgk, PER_CHANNEL)
        bk = bet[:, None] * kt.to(tl.float32) * tl.exp(per_row(G, PER_CHANNEL))
        wt = mm(Ti, bk, DT, DOT)
        kmask = row_mask[:, None] & (kcols[None, :] < K)
        tl.store(w + base[:, None] * K + kcols[None, :], wt, mask=kmask)
        vp = v + b * svb + start * svt + h * svh
        for v0 in range(0, V, BV):
            vt = load_tile(vp + v0 * svv, rows, row_mask, svt, vcols, V - v0, svv)
            ut = mm(Ti, bet[:, None] * vt.to(tl.float32), DT, DOT)
            vmask = row_mask[:, None] & (v0 + vcols[None, :] < V)
            tl.store(u + base[:, None] * V + v0 + vcols[None, :], ut, mask=vmask)


@triton.jit
def gdn_state_kernel(
    q, k, g, sqb, sqt, sqh, sqk, skb, skt, skh, skk, sgb, sgt, sgh, sgk,
    w, u, M,  # the prepare kernel's scratch
    o, sob, sot, soh, sov,  # (B, T, Hv, V) output (OUTPUT)
    h0, ht,  # (N, Hv, K, V) fp32: initial (HAS_H0) and final state
    states, new_values,  # (chunks, Hv, K, V) fp32 chunk-start states, (B, T, Hv, V) U (STORE)
    cu_seqlens, chunk_doc, chunk_first,  # packed documents (chunk_doc unused here)
    scale, T, N, NT, Hv, GROUP, K, V,
    PER_CHANNEL: tl.constexpr, VARLEN: tl.constexpr, HAS_H0: tl.constexpr,
    OUTPUT: tl.constexpr, STORE: tl.constexpr, DOT: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    DT = q.dtype.element_ty
    n, h, b, bos, eos, first = document_of(cu_seqlens, chunk_first, T, NT, Hv, VARLEN)
    hk = h // GROUP
    rows, kcols = tl.arange(0, BT), tl.arange(0, BK)
    vcols = tl.program_id(0) * BV + tl.arange(0, BV)
    state_mask = (kcols[:, None] < K) & (vcols[None, :] < V)
    state_off = kcols[:, None] * V + vcols[None, :]  # (BK, BV) in a (K, V) state
    S = tl.zeros((BK, BV), dtype=tl.float32)
    if HAS_H0:
        S = tl.load(h0 + (n * Hv + h) * K * V + state_off, mask=state_mask, other=0)
    for c in range(0, tl.cdiv(eos - bos, BT)):
        start = bos + c * BT
        row_mask = start + rows < eos
        kmask = row_mask[:, None] & (kcols[None, :] < K)
        vmask = row_mask[:, None] & (vcols[None, :] < V)
        base = (b * T + start + rows) * Hv + h
        G, GL, after = load_decay(
            g + b * sgb + start * sgt + h * sgh, rows, row_mask, sgt, kcols, K, sgk, PER_CHANNEL
        )
        wt = tl.load(w + base[:, None] * K + kcols[None, :], mask=kmask, other=0)
        ut = tl.load(u + base[:, None] * V + vcols[None, :], mask=vmask, other=0)
        U = ut - mm(wt, S, DT, DOT)  # (BT, BV): the chunk's new values
        if STORE:
            tl.store(states + ((first + c) * Hv + h) * K * V + state_off, S, mask=state_mask)
            tl.store(new_values + base[:, None] * V + vcols[None, :], U, mask=vmask)
        if OUTPUT:
            qt = load_tile(q + b * sqb + start * sqt + hk * sqh, rows, row_mask, sqt, kcols, K, sqk)
            qg = qt.to(tl.float32) * tl.exp(per_row(G, PER_CHANNEL))
            Mt = tl.load(M + base[:, None] * BT + rows[None, :], mask=row_mask[:, None], other=0)
            out = scale * mm(qg, S, DT, DOT)
            out += mm(Mt, U, DT, DOT)
            o_ptr = o + b * sob + (start + rows[:, None]) * sot + h * soh + vcols[None, :] * sov
            tl.store(o_ptr, out.to(o.dtype.element_ty), mask=vmask)
        kt = load_tile(k + b * skb + start * skt + hk * skh, rows, row_mask, skt, kcols, K, skk)
        kd = kt.to(tl.float32) * tl.exp(per_row(after, PER_CHANNEL))
        S = S * tl.exp(per_state_row(GL, PER_CHANNEL))
        S += mm(tl.trans(kd), U, DT, DOT)
    tl.store(ht + (n * Hv + h) * K * V + state_off, S, mask=state_mask)


# --- launchers -----------------------------------------------------------------------------


def chunk_table(cu_seqlens: torch.Tensor | None, T: int, B: int):
    """(slots, NT, chunk_doc, chunk_first): the per-chunk grid's size, chunks a sequence
    (unpacked), and for packed documents each slot's document (N past the last chunk)
    and each document's first slot, computed on the device."""
    if cu_seqlens is None:
        NT = cdiv(T, CHUNK)
        return NT, NT, None, None
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    chunks = (lengths + CHUNK - 1) // CHUNK
    ends = torch.cumsum(chunks, 0)
    slots = cdiv(T, CHUNK) + cu_seqlens.numel() - 1  # sum of ceil(len / 64) <= T/64 + N
    slot = torch.arange(slots, device=cu_seqlens.device)
    chunk_doc = torch.searchsorted(ends, slot, right=True).to(torch.int32)
    return slots, 0, chunk_doc, (ends - chunks).to(torch.int32)


def check_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> tuple[int, ...]:
    """(B, T, Hk, Hv, K, V, N) after checking shapes, dtypes and devices (ValueError or
    TypeError naming the sizes)."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q, k (B, T, Hk, K) and v (B, T, Hv, V) expected, got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2:]
    if Hv % Hk:
        raise ValueError(f"v's heads ({Hv}) must be a multiple of q's and k's ({Hk})")
    if max(K, V) > MAX_HEAD_DIM:
        raise ValueError(f"head dims up to {MAX_HEAD_DIM} are supported, got K={K}, V={V}")
    if g.shape not in ((B, T, Hv), (B, T, Hv, K)) or beta.shape != (B, T, Hv):
        raise ValueError(
            f"g (B, T, Hv) or (B, T, Hv, K) and beta (B, T, Hv) expected for "
            f"{(B, T, Hv, K)}, got g {tuple(g.shape)}, beta {tuple(beta.shape)}"
        )
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        common.check_float_dtype(name, t, (torch.float16, torch.bfloat16, torch.float32))
    if k.dtype != q.dtype:
        raise TypeError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    N = B
    if cu_seqlens is not None:
        if B != 1 or cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
            raise ValueError(
                f"cu_seqlens (N + 1,) int32 takes B == 1, got B={B}, "
                f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}"
            )
        N = cu_seqlens.numel() - 1
    if initial_state is not None and (
        initial_state.shape != (N, Hv, K, V) or initial_state.dtype != torch.float32
    ):
        raise ValueError(
            f"initial_state (N, Hv, K, V) = {(N, Hv, K, V)} fp32 expected, got "
            f"{tuple(initial_state.shape)} {initial_state.dtype}"
        )
    return B, T, Hk, Hv, K, V, N


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs follow PyTorch's matmul setting; 16-bit inputs' fp32 products use TF32."""
    return common.fp32_dot_precision() if dtype == torch.float32 else "tf32"


def g_strides(g: torch.Tensor) -> tuple[int, ...]:
    """g's (batch, token, head, channel) strides; channel 0 for a scalar decay."""
    return (*g.stride(), 0) if g.dim() == 3 else g.stride()


def chunk_grid(table, dims, cu_seqlens) -> tuple[int, int]:
    """The per-chunk kernels' grid: (chunk slots, B * Hv), or (slots, Hv) when packed."""
    B, _, _, Hv, *_ = dims
    return table[0], Hv if cu_seqlens is not None else B * Hv


def tail_args(table, dims, cu_seqlens, scale) -> tuple:
    """The arguments every GDN kernel ends with, in its signatures' order: the packed
    documents' tables, then scale, T, N, NT, Hv, GROUP, K, V."""
    B, T, Hk, Hv, K, V, N = dims
    _, NT, chunk_doc, chunk_first = table
    return cu_seqlens, chunk_doc, chunk_first, scale, T, N, NT, Hv, Hv // Hk, K, V


def kernel_flags(q, g, cu_seqlens) -> dict:
    """The constexprs every GDN kernel takes: the gate's kind, packing, the dots' fp32
    precision and the chunk."""
    return {
        "PER_CHANNEL": g.dim() == 4,
        "VARLEN": cu_seqlens is not None,
        "DOT": dot_precision(q.dtype),
        "BT": CHUNK,
    }


def prepare(q, k, v, g, beta, scale, cu_seqlens, table, dims) -> tuple[torch.Tensor, ...]:
    """Launch the prepare kernel: (w, u, Tinv, M), fp32 scratch (B, T, Hv, K | V | 64 | 64)."""
    B, T, Hk, Hv, K, V, N = dims
    scratch = q.new_empty(B * T * Hv * (K + V + 2 * CHUNK), dtype=torch.float32)
    sizes = [B * T * Hv * d for d in (K, V, CHUNK, CHUNK)]
    w, u, Tinv, M = (t.view(B, T, Hv, -1) for t in scratch.split(sizes))
    gdn_prepare_kernel[chunk_grid(table, dims, cu_seqlens)](
        q,
        k,
        v,
        g,
        beta,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *g_strides(g),
        *beta.stride(),
        w,
        u,
        Tinv,
        M,
        *tail_args(table, dims, cu_seqlens, scale),
        **kernel_flags(q, g, cu_seqlens),
        BK=max(16, next_power_of_2(K)),
        BV=min(64, max(16, next_power_of_2(V))),
        **prepare_configs(K, V)[0].all_kwargs(),
    )
    return w, u, Tinv, M


def run_states(q, k, g, scratch, initial_state, cu_seqlens, table, dims, *, scale, writes):
    """Launch the state kernel over (V tiles, N * Hv): the final state (N, Hv, K, V) fp32;
    ``writes = (o, store)``: writes `o` when given, the chunk states and new values into
    `store` when given."""
    o, store = writes
    B, T, Hk, Hv, K, V, N = dims
    w, u, _, M = scratch
    config = state_configs(K, V)[0]
    final = q.new_empty((N, Hv, K, V), dtype=torch.float32)
    states, new_values = store if store is not None else (final, final)
    out = o if o is not None else final.new_empty((1, 1, 1, 1))
    grid = (cdiv(V, config.kwargs["BV"]), N * Hv)
    gdn_state_kernel[grid](
        q,
        k,
        g,
        *q.stride(),
        *k.stride(),
        *g_strides(g),
        w,
        u,
        M,
        out,
        *out.stride(),
        initial_state,
        final,
        states,
        new_values,
        *tail_args(table, dims, cu_seqlens, scale),
        **kernel_flags(q, g, cu_seqlens),
        HAS_H0=initial_state is not None,
        OUTPUT=o is not None,
        STORE=store is not None,
        BK=max(16, next_power_of_2(K)),
        **config.all_kwargs(),
    )
    return final


def chunk_gated_delta_forward(q, k, v, g, beta, *, scale, initial_state=None, cu_seqlens=None):
    """``(o, final_state)``: o (B, T, Hv, V) in v's dtype, final_state (N, Hv, K, V) fp32.
    q, k (B, T, Hk, K); v (B, T, Hv, V); g (B, T, Hv) or (B, T, Hv, K) log decays;
    beta (B, T, Hv); initial_state (N, Hv, K, V) fp32 or None; cu_seqlens (N + 1,) int32
    with B == 1 or None. Two launches: `gdn_prepare_kernel`, `gdn_state_kernel`."""
    dims = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    extra = [t for t in (initial_state, cu_seqlens) if t is not None]
    check_launchable(gdn_prepare_kernel, q, k, v, g, beta, *extra)
    B, T, Hk, Hv, K, V, N = dims
    table = chunk_table(cu_seqlens, T, B)
    scratch = prepare(q, k, v, g, beta, scale, cu_seqlens, table, dims)
    o = v.new_empty((B, T, Hv, V))
    final = run_states(
        q, k, g, scratch, initial_state, cu_seqlens, table, dims, scale=scale, writes=(o, None)
    )
    return o, final
