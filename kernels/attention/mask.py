"""Attention masks in global coordinates: every mask is one key interval per query.

A query at global position i, in document d, sees key j when
``max(doc_start, i - left) <= j < min(doc_end, i + right + 1)``, with ``window = (left,
right)`` as in flash-attn (-1: unbounded; ``causal``: right = 0). Positions are global
(across the packed stream and the ring's ranks); a document whose query and key lengths
differ aligns its queries bottom-right.

| mode      | query row i sees keys               | needs                          |
| --------- | ----------------------------------- | ------------------------------ |
| scalar    | ``[i + sh - left, i + sh + right]`` | nothing (``sh = Skv - Sq``)    |
| intervals | ``[kv_lo[i], kv_hi[i])``            | `Intervals` (tensors)          |

`AttentionMask` is the whole mask as one frozen value (causality, window, softcap, scale,
sinks, the tensor mode's `Intervals`): built where a user's keywords enter, passed whole
to launchers, plans, the torch implementation and the references. `block_ranges` turns
rows' intervals into the blocks a program visits (skipped, unmasked, masked);
``plan.mask_arguments`` makes the kernels' scalars; a ring step's block is
``mask.on_block(intervals)``. `visible_reference`: the same rule as a dense boolean
matrix, for the references. docs/attention.md#masks-in-global-coordinates.
"""

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E)

# An unbounded side of a window, in the kernels' integer arithmetic: far past any
# sequence, and i + UNBOUNDED stays inside int32 for i < 2**30.
UNBOUNDED = 2**30
_UNBOUNDED = tl.constexpr(UNBOUNDED)


def resolve_scale(softmax_scale: float | None, head_dim: int) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)


def check_window(window, what: str = "window") -> tuple[int, int]:
    """``window`` as two ints, each -1 (unbounded) or >= 0; raises otherwise."""
    try:
        left, right = window
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a pair (left, right), got {window!r}") from None
    for side in (left, right):
        if isinstance(side, bool) or not isinstance(side, int):
            raise TypeError(f"{what} sides must be ints, got {window!r}")
        if side < -1:
            raise ValueError(f"{what} sides must be -1 (unbounded) or >= 0, got {window!r}")
    return left, right


def check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a number, got {softcap!r}")
    if not 0 <= softcap < float("inf"):  # NaN too
        raise ValueError(f"softcap must be >= 0 and finite (0: no capping), got {softcap!r}")
    return float(softcap)


def check_softmax_scale(softmax_scale) -> None:
    """None (1 / sqrt(D)) or a positive finite number: the kernels fold the scale into
    the row maximum (``max(s) * scale``), which needs it positive."""
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a number or None, got {softmax_scale!r}")
    if not 0 < softmax_scale < float("inf"):  # NaN too
        raise ValueError(f"softmax_scale must be > 0 and finite, got {softmax_scale!r}")


def window_sides(causal: bool, window) -> tuple[int | None, int | None]:
    """(left, right) with None for unbounded; causal clamps the right side to 0."""
    left, right = check_window(window)
    return (None if left < 0 else left), (0 if causal else None if right < 0 else right)


def scalar_bounds(causal: bool, window, Sq: int, Skv: int) -> tuple[int, int, int]:
    """The scalar mode's ``(shift, left, right)`` kernel arguments (UNBOUNDED for None)."""
    left, right = window_sides(causal, window)
    return Skv - Sq, UNBOUNDED if left is None else left, UNBOUNDED if right is None else right


def is_masked(causal: bool, window) -> bool:
    return window_sides(causal, window) != (None, None)


# --- the kernels' side -------------------------------------------------------------------


@triton.jit
def scalar_intervals(rows, shift, left, right, n_other):
    """The scalar mode: rows' intervals ``[rows + shift - left, rows + shift + right + 1)``
    clamped to [0, n_other). Called with (shift, left, right) from the query side and
    (-shift, right, left) from the key side."""
    lo = tl.minimum(tl.maximum(rows + shift - left, 0), n_other)
    hi = tl.minimum(tl.maximum(rows + shift + right + 1, 0), n_other)
    return lo, hi


@triton.jit
def load_intervals(lo_ptr, hi_ptr, rows, valid, n_other):
    """The tensor mode: rows' intervals (int32), loaded and clamped to [0, n_other)."""
    lo = tl.load(lo_ptr + rows, mask=valid, other=0)
    hi = tl.load(hi_ptr + rows, mask=valid, other=0)
    return tl.minimum(tl.maximum(lo, 0), n_other), tl.minimum(tl.maximum(hi, 0), n_other)


@triton.jit
def block_ranges(lo, hi, valid, BLOCK: tl.constexpr):
    """The other side's blocks a program visits, from its `valid` rows' intervals:
    masked ``[start, mid_lo)``, unmasked ``[mid_lo, mid_hi)``, masked ``[mid_hi, end)``.
    Blocks outside the union of the intervals are skipped; a block runs unmasked when it
    lies inside every interval. Nothing visible: every range is empty."""
    seen = valid & (lo < hi)
    first = tl.min(tl.where(seen, lo, _UNBOUNDED), 0)
    end = tl.max(tl.where(seen, hi, 0), 0)
    shared_lo = tl.max(tl.where(valid, lo, 0), 0)  # an empty row makes these cross
    shared_hi = tl.min(tl.where(valid, hi, _UNBOUNDED), 0)
    start = first // BLOCK * BLOCK
    end_block = tl.cdiv(end, BLOCK) * BLOCK
    mid_lo = tl.minimum(tl.maximum(tl.cdiv(shared_lo, BLOCK) * BLOCK, start), end_block)
    mid_hi = tl.minimum(tl.maximum(shared_hi // BLOCK * BLOCK, mid_lo), end_block)
    return start, mid_lo, mid_hi, end


# --- the host's side ---------------------------------------------------------------------

# Query rows per entry of `Intervals.q_order`: the forward's largest BLOCK_M, so each
# tile's blocks split a chunk evenly.
ORDER_CHUNK = 128


@dataclass(frozen=True)
class Intervals:
    """The tensor mode's intervals, in the local rows of one (query block, key block)
    pair: keys ``[kv_lo[:, i], kv_hi[:, i])`` are visible to query row i, and queries
    ``[q_lo[:, j], q_hi[:, j])`` see key row j. int32, (1 or B, Sq) and (1 or B, Skv);
    a first dim of 1 serves every batch row."""

    kv_lo: torch.Tensor
    kv_hi: torch.Tensor
    q_lo: torch.Tensor
    q_hi: torch.Tensor
    # the forward's order over chunks of ORDER_CHUNK query rows (`query_order`); None:
    # last rows first, the causal order
    q_order: torch.Tensor | None = None

    def check(self, B: int, Sq: int, Skv: int, device) -> None:
        for name, t, n in (("kv_lo", self.kv_lo, Sq), ("kv_hi", self.kv_hi, Sq),
                           ("q_lo", self.q_lo, Skv), ("q_hi", self.q_hi, Skv)):  # fmt: skip
            if t.dim() != 2 or t.shape[0] not in (1, B) or t.shape[1] != n or t.stride(1) != 1:
                raise ValueError(f"Intervals.{name} must be contiguous (1 or {B}, {n}), "
                                 f"got {tuple(t.shape)}")  # fmt: skip
            if t.dtype != torch.int32 or t.device != device:
                raise ValueError(f"Intervals.{name} must be int32 on {device}, "
                                 f"got {t.dtype} on {t.device}")  # fmt: skip
        for lo, hi in ((self.kv_lo, self.kv_hi), (self.q_lo, self.q_hi)):  # one batch stride
            if lo.shape != hi.shape or lo.stride() != hi.stride():
                raise ValueError("Intervals: each lo/hi pair must share its shape and strides")
        chunks = -(-Sq // ORDER_CHUNK)
        order = self.q_order
        if order is not None and (order.shape != (chunks,) or order.dtype != torch.int32
                                  or order.device != device or order.stride(0) != 1):  # fmt: skip
            raise ValueError(f"Intervals.q_order must be contiguous int32 ({chunks},) on "
                             f"{device}, got {order.dtype} {tuple(order.shape)} on "
                             f"{order.device}")  # fmt: skip

    def batch_stride(self, t: torch.Tensor) -> int:
        return 0 if t.shape[0] == 1 else t.stride(0)


# --- the mask as one value, on the host ----------------------------------------------


@dataclass(frozen=True, eq=False)
class AttentionMask:
    """Which keys a query sees and how its scores are shaped, as one frozen value: built
    once where a user's keywords enter (``fp.flash_attn(q, k, v, causal=True)``, a
    layer's spec) and passed whole down to the launchers, the plans, the torch
    implementation and the references.

    | field           | meaning                                                          |
    | --------------- | ---------------------------------------------------------------- |
    | `causal`        | a query sees no later key (bottom-right aligned: right side 0)   |
    | `window`        | ``(left, right)`` keys either side, -1 unbounded (flash-attn's)  |
    | `softcap`       | scores pass through ``softcap * tanh(s / softcap)``; 0: none     |
    | `softmax_scale` | the scores' scale; None: ``1 / sqrt(D)``                         |
    | `sinks`         | (Hq,) one learned logit per query head in every row's softmax    |
    | `intervals`     | the tensor mode (`Intervals`): packed documents or a ring step's |
    |                 | block, holding causality and the window (both then unset)        |

    A custom op's schema takes the scalars as one ``float[]`` (`flat` / `from_flat`);
    the kernels take them as `scalars` and the constexprs `mask_arguments` builds.
    Compared by identity; `key` is the scalars' hashable form, for plans and caches."""

    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    softmax_scale: float | None = None
    sinks: torch.Tensor | None = None
    intervals: Intervals | None = None

    def __post_init__(self):
        # Any truthy Python value reads as before the mask existed (``causal=1``); a tensor
        # would make every call a host sync, so it is refused.
        if isinstance(self.causal, torch.Tensor):
            raise TypeError("causal must be a Python bool, not a tensor")
        object.__setattr__(self, "causal", bool(self.causal))
        object.__setattr__(self, "window", check_window(self.window))
        object.__setattr__(self, "softcap", check_softcap(self.softcap))
        check_softmax_scale(self.softmax_scale)
        if self.sinks is not None and not isinstance(self.sinks, torch.Tensor):
            raise TypeError(f"sinks must be a tensor (Hq,), got {type(self.sinks).__name__}")
        if self.intervals is not None:
            if not isinstance(self.intervals, Intervals):
                raise TypeError(f"intervals must be Intervals, got {type(self.intervals).__name__}")
            if self.masked:
                raise ValueError("with intervals, causal and window are part of them: pass "
                                 "causal=False and no window")  # fmt: skip

    @property
    def masked(self) -> bool:
        """Whether causality or the window hides any key (the scalar mode's mask)."""
        return is_masked(self.causal, self.window)

    def key(self) -> tuple:
        """The scalars, hashable (plans' signatures, caches); tensors left out."""
        return (self.causal, self.window, self.softcap, self.softmax_scale)

    def flat(self) -> list[float]:
        """The scalars as a custom op's ``float[]``: causal, scale (0: the default),
        left, right, softcap. Ints below 2**53 are exact in a float."""
        left, right = self.window
        scale = 0.0 if self.softmax_scale is None else float(self.softmax_scale)
        return [float(self.causal), scale, float(left), float(right), self.softcap]

    @staticmethod
    def from_flat(values, sinks=None, intervals=None) -> "AttentionMask":
        """`flat`'s inverse, with the tensors given beside it."""
        causal, scale, left, right, softcap = values
        return AttentionMask(bool(causal), (int(left), int(right)), float(softcap),
                             None if scale == 0 else float(scale), sinks, intervals)  # fmt: skip

    def scalars(self, Sq: int, Skv: int, D: int) -> tuple[float, float, int, int, int]:
        """The kernels' ``(qk_scale, cap_in, shift, left, right)``: the scale (with
        log2(e) folded in, or the cap's in place of it), the cap's input scale, and the
        scalar mode's bounds (`scalar_bounds`)."""
        scale = resolve_scale(self.softmax_scale, D)
        if self.softcap:
            qk_scale, cap_in = self.softcap * LOG2E, scale / self.softcap
        else:
            qk_scale, cap_in = scale * LOG2E, 0.0
        return (qk_scale, cap_in, *scalar_bounds(self.causal, self.window, Sq, Skv))

    def on_block(self, intervals: Intervals | None) -> "AttentionMask":
        """This mask for one block in the tensor mode: `intervals` hold causality and
        the window (None: this mask)."""
        if intervals is None:
            return self
        return replace(self, causal=False, window=(-1, -1), intervals=intervals)


NO_MASK = AttentionMask()


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, what: str = "cu_seqlens", *,
                     values: bool = True) -> None:  # fmt: skip
    """Raise unless `cu_seqlens` is int32, 1-D of length >= 2, starts at 0, never
    decreases and ends at `total`. ``values=False`` checks the type and shape only; the
    values are read (a host sync on a GPU tensor) inside the ops that take them, where a
    compiled graph does not see the read."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{what} must be a tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{what} must be int32 (as flash-attn's), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{what} must be 1-D with B + 1 >= 2 entries, got shape "
                         f"{tuple(cu_seqlens.shape)}")  # fmt: skip
    if not values:
        return
    first, last, rises = torch.stack([cu_seqlens[0], cu_seqlens[-1],
                                      (cu_seqlens.diff() >= 0).all().int()]).tolist()  # fmt: skip
    if first != 0:
        raise ValueError(f"{what} must start at 0, got {first}")
    if not rises:
        raise ValueError(f"{what} must not decrease: {cu_seqlens.tolist()}")
    if last != total:
        raise ValueError(f"{what} must end at the total length {total}, got {last}")


def _side(pos, cu_self, cu_other, near, far):
    """The global intervals on the other side for rows at global positions `pos` (of the
    packed stream described by `cu_self`): [max(start, p - near), min(end, p + far + 1))
    in the other side's coordinates, p aligned bottom-right within the document."""
    doc = torch.searchsorted(cu_self, pos, right=True) - 1  # zero-length documents: skipped
    doc = doc.clamp(0, cu_self.numel() - 2)
    start, end = cu_other[doc], cu_other[doc + 1]
    aligned = pos + (end - cu_self[doc + 1])
    lo = start if near is None else torch.maximum(start, aligned - near)
    hi = end if far is None else torch.minimum(end, aligned + far + 1)
    return lo, hi


def intervals(q_pos, k_pos, cu_q, cu_k, *, causal: bool, window) -> Intervals:
    """`Intervals` for query rows at global positions `q_pos` and key rows at `k_pos`
    (int64, sorted, on one device) in the packed streams `cu_q` and `cu_k` (the
    documents' boundaries; one document per sequence when not packed). Positions are
    translated into local rows by counting (``searchsorted``): no host sync."""
    left, right = window_sides(causal, window)
    cu_q, cu_k = cu_q.to(q_pos.device, torch.int64), cu_k.to(q_pos.device, torch.int64)
    kv_lo, kv_hi = _side(q_pos, cu_q, cu_k, left, right)
    q_lo, q_hi = _side(k_pos, cu_k, cu_q, right, left)

    def local(bounds, positions):
        return torch.searchsorted(positions, bounds).to(torch.int32)[None]

    return Intervals(local(kv_lo, k_pos), local(kv_hi, k_pos),
                     local(q_lo, q_pos), local(q_hi, q_pos))  # fmt: skip


def packed_intervals(cu_q, cu_k, Tq: int, Tk: int, *, causal: bool, window) -> Intervals:
    """`Intervals` of a whole packed stream against itself (local rows are global), with
    the forward's longest-first order (`query_order`)."""
    device = cu_q.device
    packed = intervals(torch.arange(Tq, device=device), torch.arange(Tk, device=device),
                       cu_q, cu_k, causal=causal, window=window)  # fmt: skip
    return replace(packed, q_order=query_order(packed.kv_lo, packed.kv_hi))


def query_order(kv_lo: torch.Tensor, kv_hi: torch.Tensor) -> torch.Tensor:
    """Chunks of ORDER_CHUNK query rows, the widest first: a chunk's width is the key
    span its rows see together (the key blocks a forward program over them visits),
    summed over batch rows. The forward runs its query blocks in this order, so a long
    document's last blocks start first instead of making the tail (packed documents
    otherwise run last rows first, which puts a first document's widest blocks late).
    int32 (ceil(Sq / ORDER_CHUNK),) by device ops only (no host sync)."""
    B, Sq = kv_lo.shape
    pad = (-Sq) % ORDER_CHUNK
    seen = kv_hi > kv_lo  # a row that sees nothing widens nothing
    lo = torch.nn.functional.pad(torch.where(seen, kv_lo, torch.iinfo(torch.int32).max),
                                 (0, pad), value=torch.iinfo(torch.int32).max)  # fmt: skip
    hi = torch.nn.functional.pad(torch.where(seen, kv_hi, 0), (0, pad))
    lo, hi = lo.view(B, -1, ORDER_CHUNK).amin(-1), hi.view(B, -1, ORDER_CHUNK).amax(-1)
    width = (hi.long() - lo.long()).clamp_min(0).sum(0)
    return torch.argsort(width, descending=True, stable=True).to(torch.int32)


def visible_reference(cu_q, cu_k, *, causal: bool, window) -> torch.Tensor:
    """The rule as a dense (Tq, Tk) boolean: same document, inside the window (aligned
    bottom-right per document). Document ids by repetition, independent of `intervals`."""
    left, right = window_sides(causal, window)
    cu_q, cu_k = cu_q.long().cpu(), cu_k.long().cpu()
    docs = torch.arange(cu_q.numel() - 1)
    doc_q = docs.repeat_interleave(cu_q.diff())
    doc_k = docs.repeat_interleave(cu_k.diff())
    i = torch.arange(len(doc_q)) - cu_q[doc_q] + (cu_k.diff() - cu_q.diff())[doc_q]  # in doc
    j = torch.arange(len(doc_k)) - cu_k[doc_k]
    offset = j[None, :] - i[:, None]  # key minus aligned query, within a document
    allowed = doc_q[:, None] == doc_k[None, :]
    if left is not None:
        allowed &= offset >= -left
    if right is not None:
        allowed &= offset <= right
    return allowed
