"""MoE permute and combine: the row kernels of the token dispatch.

Rows follow `fusedpar.kernels.moe`'s order: P (token, slot) pairs, expert-major, the
pairs a capacity limit drops last (``pos`` -1).

| function              | computes                                                   |
| --------------------- | ---------------------------------------------------------- |
| `gather_rows`         | ``out[p] = src[idx[p]] (* scale[p])``                      |
| `combine`             | ``y[t] = sum_j w[t, j] * src[pos[t, j]]`` (pos -1 skipped) |
| `combine_weight_grad` | ``dw[t, j] = <dy[t], src[pos[t, j]]>``                     |

The dispatch's metadata comes first: `expert_counts`, `dispatch_metadata` (the
expert-major order) and `offsets` (where each expert's rows start).

They are bandwidth-bound: a program moves several full rows (up to 2048 columns at a
time, looping past that) and loads its indices once. Sums run in slot order in fp32,
with no atomics. The plain-PyTorch reference closes the file.
"""

import weakref

import torch
import triton
import triton.language as tl
from fusedpar.kernels import common, impl, moe_torch, tuning
from fusedpar.kernels.common import check_launchable, is_interpreted
from fusedpar.kernels.tuning import bucket

# Permute/combine: a program moves this many elements (4 rows of 2048 at d_model 2048),
# looping over the hidden size past MAX_BLOCK_D, and loads its indices once (P11).
ROW_TILE_ELEMENTS = 8192
MAX_BLOCK_D = 2048
# The interpreter runs programs one by one in numpy: small tiles keep CPU tests fast and
# make tiny shapes cross block edges (several row blocks, a loop over D).
INTERPRETER_MAX_BLOCK = 64
# Row indices (the order, rows and positions of the pairs, the EP regroup) are kept for
# the backward: int32, half int64's bytes, wherever they count fewer than 2**31 rows
# (`index_dtype`). The kernels widen them to int64 before any address arithmetic.
INDEX_DTYPES = (torch.int32, torch.int64)


def row_tile(D: int, interpreted: bool) -> dict:
    """Rows and columns of one permute/combine program: 4 to 64 rows, the full width up
    to 2048 columns (P11 predicts 60-80% of copy bandwidth for the old 16 x 128 tiles)."""
    if interpreted:
        return dict(BLOCK_ROWS=8, BLOCK_D=_fit(D, INTERPRETER_MAX_BLOCK), num_warps=4)
    block_d = _fit(D, MAX_BLOCK_D)
    rows = max(4, min(64, ROW_TILE_ELEMENTS // block_d))
    return dict(BLOCK_ROWS=rows, BLOCK_D=block_d, num_warps=8 if rows * block_d >= 8192 else 4)


def _fit(n: int, limit: int) -> int:
    return min(limit, max(16, common.next_power_of_2(n)))


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every output of this module is allocated here (tests fill it with NaN first, so an
    element a kernel should write and does not fails them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def index_dtype(count: int) -> torch.dtype:
    """The dtype of indices into `count` rows: int32, or int64 where int32 cannot count
    them (2**31 pairs of any width are terabytes: int64 is kept for correctness only)."""
    return torch.int32 if count < 2**31 else torch.int64


# --- metadata ------------------------------------------------------------------------


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many entries of `ids` (any shape, values in [0, num_experts)) name each expert:
    (num_experts,) int64. A scatter-add, not `torch.bincount`, which reads the largest id
    back to the host on CUDA (a sync); integer adds are exact, so atomics do not matter."""
    flat = ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def dispatch_metadata(expert_ids: torch.Tensor, num_experts: int, keep: torch.Tensor | None = None):
    """Counts per expert and the stable expert-major order of the (token, slot) pairs.

    expert_ids (T, k) int; keep (T, k) bool or None (all kept). Returns ``counts`` (E,)
    int64 (kept pairs), ``order`` (T*k,) (pair indices t * k + j, expert-major, by pair
    index within an expert, the dropped last) and ``pos`` (T, k), each pair's row in that
    order or -1 if dropped: kept for the backward, so int32 (`index_dtype`). No host
    sync: `order` keeps its full length; kernels stop at ``offsets[E] = counts.sum()``."""
    flat = expert_ids.reshape(-1).to(torch.int64)
    if keep is not None:
        flat = torch.where(keep.reshape(-1), flat, num_experts)  # dropped pairs sort last
    counts = expert_counts(flat, num_experts + 1)[:num_experts]
    index = index_dtype(flat.numel())
    order = torch.argsort(flat, stable=True).to(index)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(flat.numel(), device=flat.device, dtype=index)
    if keep is not None:
        pos = torch.where(keep.reshape(-1), pos, -1)
    return counts, order, pos.view(expert_ids.shape)


# A counts tensor's offsets, made once: {id(counts): (a weak reference to counts, {(its
# version, block): offsets})}, an entry dropped when its counts is. One MoE step launches
# up to five grouped GEMMs with the same counts, forward and backward, and each rebuilt
# them (2-4 small ops and GPU kernels a launch, ~10% of the layer's host time at
# bench/host_overhead.py's shapes). (torch's WeakTensorKeyDictionary costs ~4 µs a look.)
_OFFSETS: dict[int, tuple] = {}


def _forgetter(name: int):
    return lambda _: _OFFSETS.pop(name, None)


def offsets(counts: torch.Tensor, block: int = 1) -> torch.Tensor:
    """``[0, cumsum(ceil(counts / block))]`` (E + 1,) int64: where each expert's rows
    (`block` 1) or blocks of `block` rows start. Made once per counts tensor and block
    (an in-place change to counts, a new version, makes them anew)."""
    name = id(counts)
    entry = _OFFSETS.get(name)
    if entry is None:
        entry = _OFFSETS[name] = (weakref.ref(counts, _forgetter(name)), {})
    memo = entry[1]
    key = (counts._version, block)
    found = memo.get(key)
    if found is None:
        blocks = counts if block == 1 else torch.div(counts + (block - 1), block,
                                                     rounding_mode="floor")  # fmt: skip
        found = memo[key] = torch.nn.functional.pad(torch.cumsum(blocks, 0), (1, 0))
    return found


def _check_index(name, index, count, device):
    if index is None:
        return
    if index.dim() != 1 or index.shape[0] != count or index.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64 ({count},), got {index.dtype} "
                         f"{tuple(index.shape)}")  # fmt: skip
    if index.device != device:
        raise ValueError(f"{name} is on {index.device}, the data on {device}")


# --- permute and combine ------------------------------------------------------------------


@triton.jit
def _gather_rows_kernel(
    # pointers
    src_ptr, idx_ptr, scale_ptr, out_ptr,
    # strides
    stride_sm, stride_sd, stride_om, stride_od,
    # sizes
    P, D,
    # meta-parameters
    HAS_SCALE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out[p] = src[idx[p]] (* scale[p]) for BLOCK_ROWS rows, looping over D."""
    offs_m = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rows = offs_m < P
    src_rows = tl.load(idx_ptr + offs_m, mask=rows, other=0).to(tl.int64)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + offs_m, mask=rows, other=0.0)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = rows[:, None] & (offs_d[None, :] < D)
        vals = tl.load(src_ptr + src_rows[:, None] * stride_sm + offs_d[None, :] * stride_sd,
                       mask=mask)  # fmt: skip
        if HAS_SCALE:
            vals = vals.to(tl.float32) * scale[:, None]
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :] * stride_od,
                 vals.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip


@triton.jit
def _combine_kernel(
    # pointers
    src_ptr, pos_ptr, weight_ptr, y_ptr,
    # strides
    stride_sm, stride_sd, stride_ym, stride_yd,
    # sizes
    T, D, TOP_K,
    # meta-parameters
    HAS_WEIGHT: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """y[t] = sum_j w[t, j] * src[pos[t, j]], j = 0..TOP_K-1 in order, pos -1 skipped."""
    offs_t = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    tokens = offs_t < T
    pair = offs_t.to(tl.int64) * TOP_K
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d[None, :] < D
        acc = tl.zeros((BLOCK_ROWS, BLOCK_D), dtype=tl.float32)
        for j in range(TOP_K):
            pos = tl.load(pos_ptr + pair + j, mask=tokens, other=-1)
            src_ptrs = src_ptr + pos.to(tl.int64)[:, None] * stride_sm + offs_d[None, :] * stride_sd
            vals = tl.load(src_ptrs, mask=(pos >= 0)[:, None] & d_mask, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                vals *= tl.load(weight_ptr + pair + j, mask=tokens, other=0.0)[:, None]
            acc += vals
        y_ptrs = y_ptr + offs_t.to(tl.int64)[:, None] * stride_ym + offs_d[None, :] * stride_yd
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=tokens[:, None] & d_mask)


@triton.jit
def _combine_weight_grad_kernel(
    # pointers
    dy_ptr, src_ptr, pos_ptr, dw_ptr,
    # strides
    stride_dym, stride_dyd, stride_sm, stride_sd,
    # sizes
    T, D, TOP_K,
    # meta-parameters
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dw[t, j] = <dy[t], src[pos[t, j]]> (0 where pos is -1), summed over D in order."""
    offs_t = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    tokens = offs_t < T
    pair = offs_t.to(tl.int64) * TOP_K
    for j in range(TOP_K):
        pos = tl.load(pos_ptr + pair + j, mask=tokens, other=-1)
        live = pos >= 0
        acc = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_mask = offs_d[None, :] < D
            dy_ptrs = (
                dy_ptr + offs_t.to(tl.int64)[:, None] * stride_dym + offs_d[None, :] * stride_dyd
            )
            dy = tl.load(dy_ptrs, mask=tokens[:, None] & d_mask, other=0.0).to(tl.float32)
            src_ptrs = src_ptr + pos.to(tl.int64)[:, None] * stride_sm + offs_d[None, :] * stride_sd
            src = tl.load(src_ptrs, mask=live[:, None] & d_mask, other=0.0).to(tl.float32)
            acc += tl.sum(dy * src, 1)
        tl.store(dw_ptr + pair + j, acc, mask=tokens)


# --- launchers -------------------------------------------------------------------------


def _launch_rows(kernel, n_rows, D, args, meta, device_tensor, torch_run):
    """Launch a row kernel with its fixed tile, or on CUDA under ``FUSEDPAR_IMPL=auto``
    whichever of that tile and `torch_run` (torch indexing) the tuner measured faster for
    (kernel, rows bucket, D, dtypes). Gathering and combining sum in the same order
    either way (the same bits); the combine's weight gradient, a dot over D, to
    rounding. The ranks of an EP group pick on their own: each computes its own rows."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    key = (bucket(n_rows), D, *sorted(meta.items()), *(str(t.dtype) for t in tensors))

    def grid(tile):
        return (common.cdiv(n_rows, tile["BLOCK_ROWS"]),)

    tuning.run_tile_or_torch(kernel, row_tile(D, is_interpreted(kernel)), grid, args, meta, key,
                              device_tensor, torch_run)  # fmt: skip


def gather_rows(src, idx, scale=None, *, out_dtype=None):
    """``out[p] = src[idx[p]] (* scale[p])``: (P, D) from src (R, D), idx (P,) int32/64,
    scale (P,) float32 (float64 for float64 src) or None."""
    P, D = idx.shape[0], src.shape[-1]
    _check_index("idx", idx, P, src.device)
    wide = common.accumulator(src.dtype)
    bad_scale = scale is not None and (scale.shape != (P,) or scale.dtype != wide)
    if src.dim() != 2 or bad_scale:
        got = None if scale is None else (scale.dtype, tuple(scale.shape))
        name = str(wide).removeprefix("torch.")
        raise ValueError(f"gather_rows takes src (R, D) and scale {name} ({P},) or None, got "
                         f"{tuple(src.shape)} and {got}")  # fmt: skip
    out = _empty((P, D), out_dtype or src.dtype, src.device)
    if impl.runs_torch(src):
        moe_torch.gather_rows(src, idx, scale, out)
        return out
    check_launchable(_gather_rows_kernel, src, idx)
    if out.numel():
        args = (src, idx, idx if scale is None else scale, out, *src.stride(), *out.stride(), P, D)
        _launch_rows(_gather_rows_kernel, P, D, args, dict(HAS_SCALE=scale is not None), src,
                     lambda: moe_torch.gather_rows(src, idx, scale, out))  # fmt: skip
    return out


def combine(src, pos, weight=None, *, out_dtype=None):
    """``y[t] = sum_j weight[t, j] * src[pos[t, j]]``: (T, D) from src (P, D), pos (T, k)
    int32 or int64 (-1: skipped), weight (T, k) or None (all ones), summed in slot order
    in fp32 (float64 for float64 src)."""
    bad_weight = weight is not None and weight.shape != pos.shape
    if src.dim() != 2 or pos.dim() != 2 or pos.dtype not in INDEX_DTYPES or bad_weight:
        raise ValueError(f"combine takes src (P, D), pos (T, k) int32/64 and weight (T, k), got "
                         f"{tuple(src.shape)}, {pos.dtype} {tuple(pos.shape)} and "
                         f"{weight if weight is None else tuple(weight.shape)}")  # fmt: skip
    (T, top_k), D = pos.shape, src.shape[1]
    y = _empty((T, D), out_dtype or src.dtype, src.device)
    if impl.runs_torch(src):
        moe_torch.combine(src, pos, weight, y)
        return y
    check_launchable(_combine_kernel, src, pos)
    if y.numel():
        pos = pos.contiguous()
        weight = pos if weight is None else weight.float().contiguous()
        args = (src, pos, weight, y, *src.stride(), *y.stride(), T, D, top_k)
        _launch_rows(
            _combine_kernel,
            T,
            D,
            args,
            dict(HAS_WEIGHT=weight is not pos),
            src,
            lambda: moe_torch.combine(src, pos, None if weight is pos else weight, y),
        )
    return y


def combine_weight_grad(dy, src, pos):
    """``dw[t, j] = <dy[t], src[pos[t, j]]>`` (0 where pos is -1): (T, k) float32 (float64
    for float64 dy)."""
    T, top_k = pos.shape
    if dy.dim() != 2 or src.dim() != 2 or dy.shape != (T, src.shape[1]):
        raise ValueError(f"combine_weight_grad: dy must be ({T}, D) for pos {tuple(pos.shape)} "
                         f"and src (P, D) {tuple(src.shape)}, got {tuple(dy.shape)}")  # fmt: skip
    dw = _empty((T, top_k), common.accumulator(dy.dtype), dy.device)
    if impl.runs_torch(dy):
        moe_torch.combine_weight_grad(dy, src, pos, dw)
        return dw
    check_launchable(_combine_weight_grad_kernel, dy, src, pos)
    if dw.numel():
        args = (dy, src, pos.contiguous(), dw, *dy.stride(), *src.stride(), T, dy.shape[1], top_k)
        _launch_rows(
            _combine_weight_grad_kernel,
            T,
            dy.shape[1],
            args,
            {},
            dy,
            lambda: moe_torch.combine_weight_grad(dy, src, pos, dw),
        )
    return dw


# --- reference ---------------------------------------------------------------------------


def combine_reference(src, pos, weight=None):
    """`combine` in PyTorch: slots in order, -1 skipped."""
    T, top_k = pos.shape
    y = src.new_zeros((T, src.shape[1]))
    for j in range(top_k):
        live = pos[:, j] >= 0
        term = src[pos[:, j].clamp(min=0)] * live[:, None]
        y = y + (term if weight is None else term * weight[:, j, None].to(src.dtype))
    return y
