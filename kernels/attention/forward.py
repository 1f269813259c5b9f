"""Flash attention's forward: blockwise ``softmax(Q K^T * scale) V`` with an online softmax.

| tensor     | shape             | dtype                              |
| ---------- | ----------------- | ---------------------------------- |
| q          | (B, Sq, Hq, D)    | fp16, bf16 or fp32, any strides    |
| k          | (B, Skv, Hkv, D)  | q's; Hq % Hkv == 0 (GQA / MQA)     |
| v          | (B, Skv, Hkv, Dv) | q's; Dv may differ from D (MLA)    |
| o          | (B, Sq, Hq, Dv)   | q's or fp32 (ring partials)        |
| lse        | (B, Hq, Sq)       | fp32, natural log                  |

``P = softmax(S)``, ``O = P V``, ``LSE = logsumexp(S)``, with S = scale * Q K^T capped
(``softcap * tanh(S / softcap)``) and masked: one key interval per query row, in global
coordinates (`fusedpar.kernels.attention.mask`); blocks outside every row's interval are
skipped, blocks inside all of them run unmasked, a row that sees no key gets 0 and LSE
-inf. Query head h reads KV head ``h // (Hq / Hkv)``; KV is never repeated. With
``merge=True`` (ring steps) the kernel folds its O, LSE into the fp32 ``out, lse`` given,
through the LSE (`fusedpar.kernels.attention.merge`). It works in base 2 (``exp2``,
log2(e) folded into the scale); the LSE is natural at the boundary. The launcher is
`attention_forward`; the backward (`backward`) recomputes P from the LSE. The masks,
numerics, tiles and machine code: docs/attention.md.
"""

from dataclasses import replace

import torch
import triton
import triton.language as tl
from fusedpar.kernels import common, impl
from fusedpar.kernels.attention import torch_impl
from fusedpar.kernels.attention.mask import (
    NO_MASK,
    ORDER_CHUNK,
    AttentionMask,
    block_ranges,
    load_intervals,
    scalar_intervals,
)
from fusedpar.kernels.attention.merge import merge_partials
from fusedpar.kernels.attention.plan import (
    FORWARD_PLANS,
    SOFTCAP_APPROX,
    ForwardPlan,
    check_attention_inputs,
    check_buffer,
    forward_signature,
    launch,
    launch_key,
    mask_arguments,
    remember,
    strides,
    torch_alternatives,
)
from fusedpar.kernels.common import (
    cdiv,
    check_launchable,
    ensure_tma_allocator,
    next_power_of_2,
    tma_paths,
)
from fusedpar.kernels.tuning import LAUNCH, Launch

LN2 = 0.6931471805599453  # log(x) = log2(x) * LN2


def tile_configs(table: dict, head_dim: int, dtype: torch.dtype, modes: frozenset = frozenset(),
                 v_dim: int | None = None) -> list[triton.Config]:  # fmt: skip
    """The configs of `table` ``{(padded head dim, "fp32" or "16-bit"[, padded V head
    dim]): [(BLOCK_M, BLOCK_N, num_stages, num_warps[, modes it is left out of]), ...]}``
    for one head dim and dtype and a call's `modes` (`kernel_modes`). V of another head
    dim (`v_dim`) takes the list of its pair where the table has one, else the wider
    dim's."""
    v_dim = v_dim or head_dim
    block_d = max(64, next_power_of_2(max(head_dim, v_dim)))
    size = "fp32" if dtype == torch.float32 else "16-bit"
    pair = (block_d, size, max(64, next_power_of_2(v_dim)))
    tiles = table[pair] if v_dim != head_dim and pair in table else table[(block_d, size)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_stages=s, num_warps=w)
            for bm, bn, s, w, *skip in tiles if not modes & set(*skip)]  # fmt: skip


# Every tile here passes the resource gate (tests/test_compile_gate.py,
# docs/generated/resources.md): it fits an H100's shared memory; in fp16/bf16 its wgmma
# are not serialized and it does not spill (causal GQA, the heaviest specialisation,
# triton 3.9). 128-key tiles halve the per-key cost of the loop's bookkeeping: at D=128
# with TMA, 128x128 runs 499 instructions per 128 keys on the unmasked path, 128x64 702,
# 64x64 752 (the Triton tutorial's 128x128: 520). Measured drops: 128x128 with 4 warps
# serializes its wgmma (C7511: too few registers for the pipeline); at D=256, 128x64 costs
# more per key (900) than 64x64 (770); 64x32 takes 4 warps (with 8, each of its wgmma is
# 64x16); 32x32 at D=64 spills 8 B on the pointer path. fp32 is the correctness path: its
# full-precision dots are FMA loops (64x32 with 4 warps spills 7-10 KB at D >= 128 and
# compiles in 14-48 s), so it gets one small 8-warp tile: no spill, about 2 s to build.
_FORWARD_TILES = {
    (64, "16-bit"): [(128, 128, 3, 8), (128, 64, 3, 8), (64, 64, 4, 4), (64, 32, 3, 4),
                     (32, 32, 2, 4, {"pointer"})],
    (128, "16-bit"): [(128, 128, 2, 8), (128, 128, 3, 8), (128, 64, 3, 8), (64, 64, 4, 4),
                      (64, 32, 3, 4), (32, 32, 2, 4)],
    (256, "16-bit"): [(64, 64, 2, 8), (128, 32, 2, 8), (64, 32, 2, 4), (32, 32, 2, 4)],
    # MLA's (192, 128): Q and K 256 wide in registers, O 128: 128x64 fits where D=256's
    # does not (150 registers, 393 instructions per 128 x 64 pair against 64x64's 353
    # per 64 x 64: 1.8x fewer per pair)
    (256, "16-bit", 128): [(128, 64, 2, 8), (128, 64, 3, 8), (64, 64, 2, 8), (64, 32, 2, 4),
                           (32, 32, 2, 4)],
    (64, "fp32"): [(32, 32, 2, 8)],
    (128, "fp32"): [(32, 32, 2, 8)],
    (256, "fp32"): [(32, 32, 2, 8)],
}  # fmt: skip


def forward_configs(head_dim: int, dtype: torch.dtype, modes: frozenset = frozenset(),
                    v_dim: int | None = None) -> list[triton.Config]:  # fmt: skip
    """Forward tiles for the tuner at this head dim (and V's) and dtype: 128-row query
    tiles feed Hopper's wgmma; the smallest (kept for short sequences by
    `plan.prune_configs`) fits an A100 too."""
    return tile_configs(_FORWARD_TILES, head_dim, dtype, modes, v_dim)


# --- forward ---------------------------------------------------------------------------


# The forward's QUERY_ORDER chunk (`mask.query_order`)
QUERY_CHUNK: tl.constexpr = tl.constexpr(ORDER_CHUNK)
# SOFTCAP's values (`plan.softcap_mode`); 0: scores not capped
_TANH_APPROX: tl.constexpr = tl.constexpr(SOFTCAP_APPROX)


@triton.jit
def _tanh(x):
    """tanh in fp32 as ``1 - 2 / (2^(2 x log2 e) + 1)``: one fast exp2 and one fast
    division (``div.full``, 2 ulp) on a GPU, exact at +-inf. Its error is absolute,
    about 1e-7: near 0 it loses tanh's relative precision, which the scores (softcap *
    tanh, then exponentiated) and the backward's 1 - tanh^2 do not need."""
    return 1.0 - tl.fdiv(2.0, tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _tanh_approx(x):
    """tanh in fp32 by the SFU's ``tanh.approx.f32`` (one MUFU.TANH; relative error
    about 2^-11, as FlashAttention's and FlexAttention's soft-capping), compiled builds
    only: the interpreter has no PTX."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x],
                                     dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def scores(qk, qk_scale, cap_in, SOFTCAP: tl.constexpr):
    """Base-2 scores from raw dots ``qk = q . k``: ``qk * scale * log2(e)``, or soft-capped
    ``softcap * tanh(qk * scale / softcap) * log2(e)`` (``qk_scale`` holds softcap *
    log2(e) and ``cap_in`` scale / softcap; SOFTCAP: which tanh, `softcap_mode`).
    Also returns the tanh, for the backward's ``1 - tanh^2`` (the raw dots when not
    capped)."""
    t = qk
    if SOFTCAP == _TANH_APPROX:
        t = _tanh_approx(qk * cap_in)
        s = t * qk_scale
    elif SOFTCAP:
        t = _tanh(qk * cap_in)
        s = t * qk_scale
    else:
        s = qk * qk_scale
    return s, t


@triton.jit
def load_rows(src, start, stride, d_mask, n, TMA: tl.constexpr, BLOCK: tl.constexpr):
    """Rows [start, start + BLOCK) of a (n, D) tile source: a TMA descriptor (rows and
    columns past the tensor read as zeros, no mask code) or a block of pointers to
    rows 0.. (masked by row < n and `d_mask`)."""
    if TMA:
        return src.load([start, 0])
    else:
        rows = start + tl.arange(0, BLOCK)
        mask = d_mask[None, :] & (rows[:, None] < n)
        return tl.load(src + start.to(tl.int64) * stride, mask=mask, other=0.0)


@triton.jit
def tile_source(ptr, n, stride_s, stride_d, HEAD_DIM: tl.constexpr, TMA: tl.constexpr,
                BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """What `load_rows` reads from: a TMA descriptor of the (n, HEAD_DIM) matrix at
    `ptr` (the launcher checked the alignment TMA needs: 16-byte base and row stride,
    unit column stride), or pointers to its first BLOCK rows."""
    if TMA:
        return tl.make_tensor_descriptor(ptr, shape=[n, HEAD_DIM], strides=[stride_s, 1],
                                         block_shape=[BLOCK, BLOCK_D])  # fmt: skip
    else:
        rows = tl.arange(0, BLOCK).to(tl.int64)
        cols = tl.arange(0, BLOCK_D).to(tl.int64)
        return ptr + rows[:, None] * stride_s + cols[None, :] * stride_d


@triton.jit
def store_tile(ptr, x, start, rows, cols, stride_s, stride_d, mask, n, HEAD_DIM: tl.constexpr,
                ACCUMULATE: tl.constexpr, TMA: tl.constexpr, BLOCK: tl.constexpr,
                BLOCK_D: tl.constexpr):  # fmt: skip
    """Store the (BLOCK, BLOCK_D) fp32 tile `x` at rows [start, start + BLOCK) of the (n,
    HEAD_DIM) matrix at `ptr`, or with ACCUMULATE add it to what is there: through a TMA
    descriptor (rows past n are dropped; a block no query sees adds its zeros), or
    through pointers `rows` x `cols` under `mask`. The pointers of dK/dV's 128-key fp32
    tile at D=128 took 64-bit registers enough to spill 120 B reading it back; TMA none."""
    if TMA:
        desc = tl.make_tensor_descriptor(ptr, shape=[n, HEAD_DIM], strides=[stride_s, 1],
                                         block_shape=[BLOCK, BLOCK_D])  # fmt: skip
        if ACCUMULATE:
            x += desc.load([start, 0]).to(tl.float32)
        desc.store([start, 0], x.to(ptr.dtype.element_ty))
    else:
        ptrs = ptr + rows[:, None] * stride_s + cols[None, :] * stride_d
        if ACCUMULATE:
            x += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q,
    k_src, v_src, stride_ks, stride_vs,
    d_mask, dv_mask, lo, hi, start, mid_lo, mid_hi, end, Skv, qk_scale, cap_in,
    SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Fold KV blocks [start, end) into the running (acc, l_i, m_i). Blocks outside
    [mid_lo, mid_hi) are masked: there a row sees keys [lo, hi) only (and none past
    Skv); the others it sees whole. One loop, the mask under a per-block branch: a
    loop per kind of block put code between them that ptxas answered by serializing
    every wgmma (C7515, a wait after each HGMMA). Rows and intervals are int32 (fewer
    registers); pointer offsets int64."""
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = load_rows(k_src, start_n, stride_ks, d_mask, Skv, TMA, BLOCK_N)
        v = load_rows(v_src, start_n, stride_vs, dv_mask, Skv, TMA, BLOCK_N)
        # t: the raw dots, or their tanh when soft-capped; the scores are t * qk_scale
        _, t = scores(tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION), qk_scale,
                      cap_in, SOFTCAP)  # fmt: skip
        if (start_n < mid_lo) | (start_n >= mid_hi):  # (qk_scale > 0: -inf stays -inf)
            kv_rows = start_n + tl.arange(0, BLOCK_N)
            visible = (kv_rows[None, :] >= lo[:, None]) & (kv_rows[None, :] < hi[:, None])
            t = tl.where(visible, t, float("-inf"))
        # The scale goes into one FMA per score: max(t) * scale is max(s) as scale > 0.
        m_new = tl.maximum(m_i, tl.max(t, 1) * qk_scale)
        # A row may have seen nothing yet: keep exp2 away from -inf - -inf, but keep m_i
        # at -inf (a stand-in max of 0 would scale later blocks' p towards fp16
        # underflow: a row whose keys start in a later block, e.g. a document's). Per
        # row, not per score: two selects a thread.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(t * qk_scale - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, kv_lo_ptr, kv_hi_ptr, order_ptr,
    # strides
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_ib,
    # sizes
    Sq, Skv, GROUP, qk_scale, cap_in, shift, left, right,
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, INTERVALS: tl.constexpr,
    SOFTCAP: tl.constexpr, MERGE: tl.constexpr, QUERY_ORDER: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr, OUT_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Grid (query blocks, B, Hq): batch and heads on their own axes (each up to 65535).
    # Query blocks run last first: under a causal mask they see the most keys, and the
    # longest programs starting first shorten the tail. With QUERY_ORDER (packed
    # documents) the widest first: chunk `order[i]` of QUERY_CHUNK rows (`query_order`),
    # each chunk's blocks last first; a chunk past Sq's end has programs that write
    # nothing. Offsets are 64-bit: a strided view's sequence stride times its length (a
    # KV view into a (S, B, H*D) projection, say) can pass 2**31.
    if QUERY_ORDER:
        per_chunk: tl.constexpr = QUERY_CHUNK // BLOCK_M
        chunk = tl.load(order_ptr + tl.program_id(0) // per_chunk)
        pid_m = chunk * per_chunk + per_chunk - 1 - tl.program_id(0) % per_chunk
    else:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    h_kv = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_mask = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV).to(tl.int64)  # V's and O's columns (Dv may differ)
    dv_mask = offs_dv < HEAD_DIM_V
    row_mask = offs_m < Sq

    # Each row's visible keys [lo, hi) (`mask`), and the key blocks they give:
    # masked [start, mid_lo), whole [mid_lo, mid_hi), masked [mid_hi, end); no others.
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if INTERVALS:
        lo, hi = load_intervals(kv_lo_ptr + b * stride_ib, kv_hi_ptr + b * stride_ib, rows,
                                row_mask, Skv)  # fmt: skip
    else:
        lo, hi = scalar_intervals(rows, shift, left, right, Skv)
    start, mid_lo, mid_hi, end = block_ranges(lo, hi, row_mask, BLOCK_N)

    q_src = tile_source(q_ptr + b * stride_qb + h * stride_qh, Sq, stride_qs, stride_qd,
                        HEAD_DIM, TMA, BLOCK_M, BLOCK_D)  # fmt: skip
    q = load_rows(q_src, pid_m * BLOCK_M, stride_qs, d_mask, Sq, TMA, BLOCK_M)
    k_src = tile_source(k_ptr + b * stride_kb + h_kv * stride_kh, Skv, stride_ks, stride_kd,
                        HEAD_DIM, TMA, BLOCK_N, BLOCK_D)  # fmt: skip
    v_src = tile_source(v_ptr + b * stride_vb + h_kv * stride_vh, Skv, stride_vs, stride_vd,
                        HEAD_DIM_V, TMA, BLOCK_N, BLOCK_DV)  # fmt: skip

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, d_mask, dv_mask, lo, hi, start,
        mid_lo, mid_hi, end, Skv, qk_scale, cap_in, SOFTCAP, INPUT_PRECISION, TMA, BLOCK_N,
    )  # fmt: skip

    # A row that saw no key has l_i == 0: output 0 and LSE -inf, never 0/0.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)  # ln 2
    o_base = o_ptr + b * stride_ob + h * stride_oh
    lse_ptrs = lse_ptr + b * stride_lb + h * stride_lh + offs_m * stride_ls
    if MERGE:  # a ring step: fold this block into the running fp32 (out, lse) in place,
        # instead of writing a block partial that a second pass reads back (review P10);
        # a block that saw no key leaves them as they are
        row_mask = row_mask & (rows * 0 + start < end)  # (a vector: the interpreter's masks)
        o_mask = row_mask[:, None] & dv_mask[None, :]
        o_ptrs = o_base + offs_m[:, None] * stride_os + offs_dv[None, :] * stride_od
        o_prev = tl.load(o_ptrs, mask=o_mask, other=0.0)
        lse_prev = tl.load(lse_ptrs, mask=row_mask, other=float("-inf"))
        o, lse = merge_partials(o_prev, lse_prev, o, lse)
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=o_mask)
    else:
        store_tile(o_base, o, pid_m * BLOCK_M, offs_m, offs_dv, stride_os, stride_od,
                   row_mask[:, None] & dv_mask[None, :], Sq, HEAD_DIM_V, False, OUT_TMA,
                   BLOCK_M, BLOCK_DV)  # fmt: skip
    tl.store(lse_ptrs, lse, mask=row_mask)


# --- launchers -------------------------------------------------------------------------


def _planned_forward(plan: ForwardPlan, q, k, v, out, lse, merge, launch_as):
    """`attention_forward` from its plan: allocate, build the arguments, launch."""
    if out is None:
        out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=q.device)
    if lse is None:
        B, Sq, Hq, _ = plan.out_shape
        lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    meta = plan.meta
    if meta["TMA"] or meta["OUT_TMA"]:
        ensure_tma_allocator(q.device)  # per thread: autograd's backward runs on its own
    args = (q, k, v, out, lse, q, q, q, *q.stride(), *k.stride(), *v.stride(),
            *out.stride(), *lse.stride(), 0, *plan.scalars)  # fmt: skip
    B, Sq, Hq, _ = plan.out_shape

    def grid(tile):
        return (cdiv(Sq, tile["BLOCK_M"]), B, Hq)

    def torch_run():
        torch_impl.forward(q, k, v, plan.scores, out, lse, merge)

    def platform():
        return torch_impl.forward_candidates(q, k, v, plan.scores, out, lse, merge)

    launch(_attn_fwd_kernel, forward_configs, grid, args, plan, launch_as=launch_as,
           restore=[out, lse] if merge else [],
           torch_runs=torch_alternatives(torch_run if plan.torch_candidate else None,
                                         platform))  # fmt: skip
    return out, lse


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask = NO_MASK,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    merge: bool = False,
    launch_as: Launch = LAUNCH,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Returns ``(out, lse)``: out (B, Sq, Hq, Dv) in `out_dtype` (q's, or fp32 for ring
    partials), lse (B, Hq, Sq) fp32. `out` and `lse` may be given, with any strides.
    (fp32 here is ``accumulator(q.dtype)``: float64 for float64 q, which runs on torch's
    implementation only.)

    `mask` (`AttentionMask`): causality and the window (see
    `fusedpar.kernels.attention.mask`), or ``mask.intervals`` (packed documents, ring
    blocks: the whole mask in tensors); ``mask.softcap`` > 0 caps the scaled scores at
    ``softcap * tanh(s / softcap)`` before masking; ``mask.sinks`` is not read here (the
    ops fold sinks into the result through the LSE).

    ``merge``: `out` (fp32) and `lse` hold attention over other keys; this call's result
    is merged into them in place through the LSE (a ring step) rather than overwriting
    them. `launch_as`: its agreement, the ranks that pick one tile together; its
    ``tune_only``: make the pick for this call (on scratch buffers) and return None: the
    ring does so before its loop."""
    tune_only = launch_as.tune_only
    planned = mask.intervals is None and not tune_only and not impl.runs_torch(q)
    signature = None
    if planned:
        signature = forward_signature(q, k, v, mask, out, lse, out_dtype, merge)
        plan = FORWARD_PLANS.get(signature)
        if plan is not None:
            return _planned_forward(plan, q, k, v, out, lse, merge, launch_as)
    check_attention_inputs(q, k, v)
    (B, Sq, Hq, _), (_, Skv, Hkv, _), Dv = q.shape, k.shape, v.shape[-1]
    tensors, scalars, meta, key, scores = mask_arguments(q, k, v, mask, "query")
    wide = common.accumulator(q.dtype)  # fp32, float64 for float64 q
    if merge and not tune_only and (out is None or lse is None):
        raise ValueError("merge=True folds the result into `out` and `lse`: give both")
    if tune_only:  # the key depends on the dtypes only: write nothing of the caller's
        out_dtype = out.dtype if out is not None else out_dtype
        out = lse = None
    if out is None:
        out = torch.empty((B, Sq, Hq, Dv), dtype=out_dtype or q.dtype, device=q.device)
    check_buffer("out", out, (B, Sq, Hq, Dv), (q.dtype, wide), q.device)
    if merge and out.dtype != wide:
        raise TypeError(f"merge=True accumulates in {wide}: out is {out.dtype}")
    if lse is None:
        lse = torch.empty((B, Hq, Sq), dtype=wide, device=q.device)
    check_buffer("lse", lse, (B, Hq, Sq), (wide,), q.device)

    def torch_run():
        torch_impl.forward(q, k, v, scores, out, lse, merge)

    if impl.runs_torch(q):
        if not tune_only and B * Sq * Hq:
            torch_run()
        return None if tune_only else (out, lse)
    check_launchable(_attn_fwd_kernel, q, k, v, out, lse, *tensors[:2])
    if B * Sq * Hq == 0:
        return None if tune_only else (out, lse)
    qk_scale, cap_in, shift, left, right = scalars
    order = None if mask.intervals is None else mask.intervals.q_order
    args = (
        q, k, v, out, lse, *tensors[:2], q if order is None else order,
        *strides(q), *strides(k), *strides(v), *strides(out), *strides(lse), tensors[2],
        Sq, Skv, Hq // Hkv, qk_scale, cap_in, shift, left, right,
    )  # fmt: skip

    def grid(meta):
        if order is None:
            return (cdiv(Sq, meta["BLOCK_M"]), B, Hq)
        return (order.numel() * (ORDER_CHUNK // meta["BLOCK_M"]), B, Hq)

    # A merging launch reads its output: tuning must put it back (scratch when tune_only).
    restore = [out, lse] if merge and not tune_only else []
    # Q, K, V through TMA where they are 16-bit and aligned, and O where it is aligned
    # (a merge reads it back row by row: through pointers)
    tma, out_tma = tma_paths((q, k, v), () if merge else (out,))
    meta = {**meta, "MERGE": merge, "QUERY_ORDER": order is not None, "TMA": tma,
            "OUT_TMA": out_tma}  # fmt: skip
    # (not beside the approximate tanh: a forward and backward of two tanh would disagree)
    torch_candidate = torch_impl.capable_on_cuda(q, k) and meta["SOFTCAP"] != SOFTCAP_APPROX

    def platform():
        return torch_impl.forward_candidates(q, k, v, scores, out, lse, merge)

    if q.device.type == "cuda":  # which of PyTorch's kernels compute this call: in the key
        key = (*key, ("platform", tuple(c.name for c in platform())))
    # (this launch goes through the tuner: the kept plan's later calls settle its pick)
    plan = ForwardPlan((B, Sq, Hq, Dv), out.dtype, args[-8:], meta,
                       launch_key(args, meta, Sq, Skv, key, torch_candidate), scores,
                       torch_candidate, None)  # fmt: skip
    if signature is not None:
        remember(FORWARD_PLANS, signature, replace(plan, settled={}))
    launch(_attn_fwd_kernel, forward_configs, grid, args, plan, launch_as=launch_as,
           restore=restore,
           torch_runs=torch_alternatives(torch_run if torch_candidate else None,
                                         platform))  # fmt: skip
    return None if tune_only else (out, lse)
