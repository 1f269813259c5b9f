"""The attention launchers' host side. The checks of a call's inputs
(`check_attention_inputs`, `check_buffer`) and what every kernel takes for its mask and
scores (`mask_arguments`, `kernel_meta`, `softcap_mode`): every launcher takes the mask
as one value, an `AttentionMask`, and how it meets the tuner as one `tuning.Launch`;
a backward takes where it writes as one `Gradients`. The plans: what a launcher
works out once per call signature, looked up by later calls with the same shapes,
strides, dtypes, devices, alignment, mask scalars and flags (host time per call at
bench/host_overhead.py's shapes: forward 37 -> 15 µs, dK/dV 41 -> 18 µs, dQ 30 -> 15
µs): the forward's `ForwardPlan`, the backward's `BackwardPlan` (`plan_backward`, with
the backward's checks and torch's entry), and the bounded store both use (`remember`).
The launch through the tuner (`launch`): the kernel's tile list for the call's
specialisation (`kernel_modes`) pruned to the sequences, one tile sized to the problem
in the interpreter, torch's implementation and PyTorch's own kernels as candidates
beside the tiles, and a planned launcher's settled pick launched past the tuner. The
kernels are in `forward`, `backward` and `backward_fused`."""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton
from fusedpar.kernels import common, impl, tuning
from fusedpar.kernels.attention import torch_impl
from fusedpar.kernels.attention.mask import AttentionMask, block_ranges, resolve_scale
from fusedpar.kernels.common import (
    accumulator,
    check_float_dtype,
    check_launchable,
    device_guard,
    fp32_dot_precision,
    is_interpreted,
    next_power_of_2,
    tma_paths,
)
from fusedpar.kernels.tuning import LAUNCH, Launch, bucket

MAX_HEAD_DIM = 256
# SOFTCAP's values (`softcap_mode`); 0: scores not capped
SOFTCAP_EXACT, SOFTCAP_APPROX = 1, 2  # (plain ints in the host's meta and keys)
# The interpreter runs one program at a time in numpy: a few large tiles beat many small.
INTERPRETER_MAX_BLOCK = 64


# --- checks ----------------------------------------------------------------------------


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError/TypeError naming the sizes for anything the kernels cannot take."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, S, H, D), got shape {tuple(t.shape)}")
    (B, _, Hq, D), (B_kv, _, Hkv, D_kv), Dv = q.shape, k.shape, v.shape[-1]
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have one (B, S, H), got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")  # fmt: skip
    if B_kv != B:
        raise ValueError(f"batch sizes differ: q has B={B}, k and v have B={B_kv}")
    if D_kv != D:
        raise ValueError(f"head dims differ: q has D={D}, k has D={D_kv}")
    check_float_dtype("q", q)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if len({q.device, k.device, v.device}) > 1:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads (Hq={Hq}) must be a multiple of KV heads (Hkv={Hkv})")
    for name, d in (("D", D), ("v's head dim Dv", Dv)):
        if d == 0 or d % 8 or d > MAX_HEAD_DIM:
            raise ValueError(f"{name}={d} must be a positive multiple of 8, at most "
                             f"{MAX_HEAD_DIM}")  # fmt: skip


def check_buffer(name, t, shape, dtypes, device):
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must be {tuple(shape)}, got {tuple(t.shape)}")
    check_float_dtype(name, t, dtypes)
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the inputs on {device}")


def softcap_mode(dtype: torch.dtype, softcap: float, interpreted: bool) -> int:
    """The kernels' SOFTCAP: 0 (no capping), SOFTCAP_EXACT (`_tanh`) or SOFTCAP_APPROX
    (`_tanh_approx`: 627 instructions per 128 keys in the forward's loop at D=128 against
    the exact formula's 1076 and 499 uncapped, `docs/generated/resources.md`).
    The approximation is taken for bf16 inputs in compiled kernels only: its relative
    error on a capped score (2^-11) is an eighth of the rounding bf16 itself puts on one
    (2^-8), which the numerics contract already allows (PyTorch's bf16 scores carry
    it). fp16 rounds a score to 2^-11, the approximation's own size, and fp32 far
    finer: both keep the exact formula, as the interpreter does (it has no PTX)."""
    if not softcap:
        return 0
    return SOFTCAP_APPROX if dtype == torch.bfloat16 and not interpreted else SOFTCAP_EXACT


def kernel_meta(q: torch.Tensor, v: torch.Tensor, *, intervals: bool = False,
                softcap: float = 0.0) -> dict:  # fmt: skip
    D, Dv = q.shape[-1], v.shape[-1]
    return dict(
        HEAD_DIM=D,
        BLOCK_D=max(16, next_power_of_2(D)),  # tl.dot needs K >= 16
        HEAD_DIM_V=Dv,  # V's, O's and dO's (DeepSeek's MLA: 192 for Q and K, 128 for V)
        BLOCK_DV=max(16, next_power_of_2(Dv)),
        INTERVALS=intervals,
        # (whether the kernels run interpreted: every @triton.jit of the package is
        # decorated on its import, this mask helper as the forward's kernel)
        SOFTCAP=softcap_mode(q.dtype, softcap, is_interpreted(block_ranges)),
        INPUT_PRECISION=fp32_dot_precision() if q.dtype == torch.float32 else "tf32",
    )


def mask_arguments(q, k, v, mask: AttentionMask, side: str):
    """The one place a mask becomes what the attention kernels take: ``(tensors,
    scalars, meta, key, scores)``. tensors: the intervals of `side` ("query": keys each
    query row sees; "key": queries that see each key row) and their batch stride;
    scalars: ``(qk_scale, cap_in, shift, left, right)`` (`AttentionMask.scalars`); key:
    for the tuner; scores: the same for the torch implementation (`torch_impl.Scores`).
    With ``mask.intervals`` (the tensor mode) they hold the whole mask."""
    (B, Sq, _, D), Skv = q.shape, k.shape[1]
    if not isinstance(mask, AttentionMask):
        raise TypeError(f"mask must be an AttentionMask, got {type(mask).__name__}")
    intervals = mask.intervals
    if intervals is None:
        tensors = (q, q, 0)  # never read
    else:
        intervals.check(B, Sq, Skv, q.device)
        lo, hi = ((intervals.kv_lo, intervals.kv_hi) if side == "query"
                  else (intervals.q_lo, intervals.q_hi))  # fmt: skip
        tensors = (lo, hi, intervals.batch_stride(lo))
    meta = kernel_meta(q, v, intervals=intervals is not None, softcap=mask.softcap)
    key = (("masked", mask.masked),)
    return tensors, mask.scalars(Sq, Skv, D), meta, key, torch_impl.Scores.of_mask(mask, Sq, Skv, D)


def strides(t: torch.Tensor) -> tuple:
    return tuple(t.stride())


# --- the forward's plan ----------------------------------------------------------------


def launch_key(args, meta, Sq, Skv, key_extra, torch_candidate: bool) -> tuple:
    """The tuner's key of a launch: the buckets, the meta, the tensors' dtypes, and
    whether torch's implementation may run (it depends on the exact sizes, a memory
    bound, which the buckets do not hold)."""
    dtypes = (str(a.dtype) for a in args if isinstance(a, torch.Tensor))
    return (bucket(Sq), bucket(Skv), *sorted(meta.items()), *dtypes, *key_extra,
            ("torch", torch_candidate))  # fmt: skip


@dataclass(frozen=True)
class ForwardPlan:
    """What `attention_forward` works out once per call signature (shapes, strides,
    dtypes, alignment, the mask's scalars, flags): the inputs checked, the kernel's
    scalars and meta, the tuner's key. Calls with the tensor mask (``mask.intervals``),
    with ``tune_only`` or on torch's implementation are not kept (their plan serves the
    one launch, with no `settled`)."""

    out_shape: tuple
    out_dtype: torch.dtype
    scalars: tuple  # Sq, Skv, group, qk_scale, cap_in, shift, left, right
    meta: dict
    key: tuple
    scores: object  # for torch's implementation, a candidate on CUDA
    torch_candidate: bool
    # per implementation asked for, the pick and its launch once made (`tuning.Settled`);
    # None: a plan not kept
    settled: dict | None = field(default_factory=dict, compare=False)


FORWARD_PLANS: dict[tuple, ForwardPlan] = {}
MAX_PLANS = 4096  # a property test's many shapes: start over rather than grow


def forward_signature(q, k, v, mask: AttentionMask, out, lse, out_dtype, merge) -> tuple:
    return (
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
        v.dtype, q.device, k.device, v.device, mask.key(), out_dtype, merge,
        out is not None and (out.shape, out.stride(), out.dtype, out.data_ptr() % 16),
        lse is not None and (lse.shape, lse.stride(), lse.dtype), q.data_ptr() % 16,
        k.data_ptr() % 16, v.data_ptr() % 16, torch.get_float32_matmul_precision(),
        common.tma_compatible,  # the TMA rule in force (tests swap it for the pointer path)
    )  # fmt: skip


def remember(plans: dict, signature: tuple, plan):
    """Keep `plan` under `signature` (starting over past `MAX_PLANS`); returns it."""
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[signature] = plan
    return plan


# --- launch ----------------------------------------------------------------------------


def kernel_modes(meta: dict) -> frozenset:
    """What of a launch's specialisation a tile list may depend on: ``softcap`` (the
    tanh on every score), ``pointer`` (tiles read through pointers, not TMA) and
    ``accumulate`` (an fp32 output read back: a ring step's merge or added gradients).
    A tile that spills or serializes in a mode is left out of it."""
    return frozenset(mode for mode, on in (
        ("softcap", meta["SOFTCAP"]),
        ("pointer", not meta.get("TMA")),
        ("accumulate", meta.get("ACCUMULATE") or meta.get("MERGE")),
    ) if on)  # fmt: skip


def prune_configs(configs, Sq: int, Skv: int):
    """Drop tiles far larger than the sequences; keep at least the smallest."""
    limit_m = max(32, next_power_of_2(Sq))
    limit_n = max(32, next_power_of_2(Skv))
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= limit_m and c.kwargs["BLOCK_N"] <= limit_n]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


def interpreter_blocks(Sq: int, Skv: int) -> dict:
    def block(n):
        return min(INTERPRETER_MAX_BLOCK, max(16, next_power_of_2(n)))

    return {"BLOCK_M": block(Sq), "BLOCK_N": block(Skv)}


def launch(kernel, configs, grid, args, plan, *, launch_as: Launch = LAUNCH, restore=(),
           torch_runs=None) -> None:  # fmt: skip
    """Launch `kernel` with the tile tuned for `plan.key` (`launch_key`: the Sq and Skv
    buckets, the meta, the dtypes): one sized to the problem in the interpreter, else
    the best of ``configs()``. `plan`: a `ForwardPlan` or `BackwardPlan` (its meta, key
    and `settled`; its scalars start with Sq, Skv). `grid(tile)` builds the grid;
    `restore`: buffers the kernel reads back (adds into, or merges with);
    `launch_as`: the tuner's agreement and tune_only. `torch_runs`: ``torch_runs()``
    gives ``{candidate: run()}`` of torch's implementation of the same call
    (`impl.TORCH`) and of PyTorch's own kernels (`torch_impl`), candidates beside the
    tiles (CUDA, ``FUSEDPAR_IMPL=auto``); the key must name them. A kept plan's settled
    pick (`tuning.Settled`, per implementation asked for) is launched past the tuner
    once made (and kept there after it)."""
    name, settled, meta, key = kernel.__name__, plan.settled, plan.meta, plan.key
    request = None
    if settled is not None and launch_as.plain:
        request = impl.requested()
        kept = settled.get(request)
        if kept is not None and tuning.kept(name, kept.scope) is kept.config:
            kept.launch(kernel, args)
            return
    Sq, Skv = plan.scalars[:2]

    def candidates():
        if is_interpreted(kernel):
            tiles = [triton.Config(interpreter_blocks(bucket(Sq), bucket(Skv)))]
        else:
            configs_here = configs(meta["HEAD_DIM"], args[0].dtype, kernel_modes(meta),
                                   v_dim=meta["HEAD_DIM_V"])  # fmt: skip
            tiles = prune_configs(configs_here, bucket(Sq), bucket(Skv))
        if not impl.tunes_torch():
            return tiles
        return tiles + list(alternatives())

    runs = {}

    def alternatives():  # built once per call, when first needed
        if torch_runs is not None and not runs:
            runs.update(torch_runs())
        return runs

    def run(config):
        if isinstance(config, impl.Torch):
            alternatives()[config]()
        else:
            kernel[grid(config.kwargs)](*args, **meta, **config.all_kwargs())

    with device_guard(args[0]):
        config = tuning.tuner(name).run(key, candidates, run, device=args[0].device,
                                         restore=restore, launch_as=launch_as)  # fmt: skip
    if request is not None and not isinstance(config, impl.Torch):
        scope = tuning.local_scope(key, request)
        if tuning.kept(name, scope) is config:  # the pick (not a forced config)
            kwargs = {**meta, **config.all_kwargs()}
            settled[request] = tuning.Settled.of(kernel, config, scope, grid(config.kwargs),
                                                  kwargs, len(args))  # fmt: skip


def torch_alternatives(torch_run, platform=None):
    """`launch`'s ``torch_runs``: torch's implementation `torch_run` (None: not a
    candidate) and ``platform()``'s PyTorch kernels (None: none)."""

    def runs():
        found = {impl.TORCH: torch_run} if torch_run is not None else {}
        return {**found, **(platform() if platform is not None else {})}

    return runs


# --- the backward's plan ---------------------------------------------------------------


@dataclass(frozen=True)
class BackwardPlan:
    """What `attention_backward_dkdv` or `attention_backward_dq` works out once per call
    signature: the inputs checked, the kernel's strides (every tensor argument's, in the
    kernel's order), its scalars after the mask's batch stride, meta and tuner key, and
    the dtype of new gradients. ``split``: dK/dV's programs per KV head (1 for dQ).
    ``dq_direct``: the fused backward adds dQ straight into the caller's fp32 buffer
    (else into fp32 scratch, converted after). ``accumulate``: the call adds into the
    caller's gradients."""

    grad_dtype: torch.dtype
    accumulate: bool
    split: int
    dq_direct: bool
    strides: tuple
    scalars: tuple
    meta: dict
    key: tuple
    scores: object  # for torch's implementation, a candidate on CUDA
    torch_candidate: bool
    # per implementation asked for, the pick and its launch once made (`tuning.Settled`)
    settled: dict = field(default_factory=dict, compare=False)


BACKWARD_PLANS: dict[tuple, BackwardPlan] = {}


def _layout(t: torch.Tensor | None):
    return t is not None and (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


@dataclass(frozen=True, eq=False)
class Gradients:
    """Where a backward call writes dQ, dK and dV, as one value: the caller's buffers
    (any strides; None: new ones, or scratch when the call only tunes), overwritten, or
    added into with `accumulate`; new ones in `dtype` (q's unless given: q's or fp32).
    Each launcher writes its own: dK/dV's `dk` and `dv`, dQ's `dq`, the fused one all
    three. `deterministic` (read by `attention_backward`): every sum in a fixed order,
    dQ's too, i.e. the split backward."""

    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    accumulate: bool = False
    dtype: torch.dtype | None = None
    deterministic: bool = False

    def of(self, kind: str) -> list:
        """The buffers a `kind` of launch writes ("dkdv": dk, dv; "dq": dq; "fused": dk,
        dv, dq), None where new."""
        return [getattr(self, name) for name in _GRADIENTS[kind]]


NEW_GRADIENTS = Gradients()  # new gradients in q's dtype, written
NO_SOURCES = (None, None)  # delta read, not made from (out, dlse)
_GRADIENTS = {"dkdv": ("dk", "dv"), "dq": ("dq",), "fused": ("dk", "dv", "dq")}


def backward_signature(kind, inputs, grads: Gradients, mask: AttentionMask, split_below,
                       delta_from=NO_SOURCES) -> tuple:  # fmt: skip
    """`kind` ("dkdv", "dq" or "fused"), the layouts of the `inputs` (dout, q, k, v, lse,
    delta), of the caller's gradient buffers (or None) and of dQ's `delta_from` (out,
    dlse; or None), the mask's scalars (``mask.intervals`` None), the flags and what
    decides the GQA split and TMA."""
    return (
        kind, *(_layout(t) for t in (*inputs, *grads.of(kind), *delta_from)), mask.key(),
        grads.accumulate, grads.dtype, split_below, torch.get_float32_matmul_precision(),
        common.tma_compatible,
    )  # fmt: skip


def check_backward_inputs(dout, q, k, v, lse, delta, delta_from=NO_SOURCES):
    """Raise for anything the backward kernels cannot take (`delta_from`: delta's out
    and dlse, either None). The LSE, delta and dLSE are fp32 (float64 for float64 q:
    `accumulator`)."""
    check_attention_inputs(q, k, v)
    (B, Sq, Hq, _) = q.shape
    out_shape = (B, Sq, Hq, v.shape[-1])  # out's and dout's: V's head dim
    if tuple(dout.shape) != out_shape:
        raise ValueError(f"dout must be out's shape {out_shape}, got {tuple(dout.shape)}")
    wide = accumulator(q.dtype)
    check_buffer("lse", lse, (B, Hq, Sq), (wide,), q.device)
    if delta is not None:
        check_buffer("delta", delta, (B, Hq, Sq), (wide,), q.device)
    out, dlse = delta_from
    if out is not None:
        check_buffer("out", out, out_shape, (q.dtype, wide), q.device)
    if dlse is not None:
        check_buffer("dlse", dlse, (B, Hq, Sq), (wide,), q.device)


def write_delta(delta, dout, out, dlse) -> None:
    """``delta = rowsum(dO * O) - dLSE`` (dlse None: 0) into `delta` (B, Hq, Sq), as
    dQ's kernel makes it."""
    made = torch_impl.delta(out, dout)
    delta.copy_(made if dlse is None else made - dlse)


def gradient_buffer(buf, like, dtype, tune_only):
    """The caller's buffer; a new one; or, for ``tune_only``, scratch of the dtype the
    call would write (nothing of the caller's is touched)."""
    if buf is None or tune_only:
        return torch.empty(like.shape, dtype=dtype if buf is None else buf.dtype,
                           device=like.device)  # fmt: skip
    return buf


def checked_buffers(kind, inputs, grads: Gradients, tune_only: bool,
                    delta_from=NO_SOURCES) -> list:  # fmt: skip
    """Check a dK/dV (`kind` "dkdv": writes dk, dv), dQ ("dq": dq) or fused ("fused": dk,
    dv, dq) call of `inputs` (dout, q, k, v, lse, delta); returns the gradient buffers
    it writes (`gradient_buffer`)."""
    dout, q, k, v, lse, delta = inputs
    check_backward_inputs(dout, q, k, v, lse, delta, delta_from)
    names = _GRADIENTS[kind]
    given = grads.of(kind)
    if grads.accumulate and not tune_only and any(g is None for g in given):
        raise ValueError(f"accumulate=True adds into {' and '.join(names)}: give "
                         f"{'both' if len(names) > 1 else 'it'}")  # fmt: skip
    buffers = []
    likes = {"dkdv": (k, v), "dq": (q,), "fused": (k, v, q)}[kind]
    for name, g, like in zip(names, given, likes, strict=True):
        g = gradient_buffer(g, like, grads.dtype or q.dtype, tune_only)
        check_buffer(name, g, like.shape, (q.dtype, accumulator(q.dtype)), q.device)
        buffers.append(g)
    return buffers


def torch_backward(kind, inputs, mask: AttentionMask, grads: Gradients, launch_as: Launch,
                   delta_from=NO_SOURCES):  # fmt: skip
    """A dK/dV or dQ call on torch's implementation, checked as the kernels' are (dQ
    with delta's `delta_from` writes delta from them first, as its kernel does)."""
    buffers = checked_buffers(kind, inputs, grads, launch_as.tune_only, delta_from)
    dout, q, k, v, lse, delta = inputs
    side = "query" if kind == "dq" else "key"
    scores = mask_arguments(q, k, v, mask, side)[-1]
    if launch_as.tune_only:
        return None
    if delta_from[0] is not None:
        write_delta(delta, dout, *delta_from)
    if kind == "dq":
        if q.numel():
            torch_impl.backward_dq(*inputs, scores, *buffers, grads.accumulate)
        return buffers[0]
    if k.numel():
        torch_impl.backward_dkdv(*inputs, scores, *buffers, grads.accumulate)
    return tuple(buffers)


def plan_backward(kind, kernel, split_of: Callable[[], int] | None, split_below, inputs,
                  mask: AttentionMask, grads: Gradients, launch_as: Launch,
                  delta_from=NO_SOURCES):  # fmt: skip
    """Check a dK/dV, dQ or fused call of `inputs` (dout, q, k, v, lse, delta;
    `checked_buffers`) and work out its `BackwardPlan`, kept per signature unless the
    mask is in tensors or the call only tunes. `kernel`: the kernel it launches;
    ``split_of()``: dK/dV's GQA split (called once the inputs are checked), which
    `split_below` decides; `delta_from`: dQ's (out, dlse) when it makes delta itself
    (out None: it reads delta). Returns (plan, the mask's tensors: lo, hi and their
    batch stride)."""
    tune_only, accumulate = launch_as.tune_only, grads.accumulate
    cached = mask.intervals is None and not tune_only
    if cached:
        signature = backward_signature(kind, inputs, grads, mask, split_below, delta_from)
        plan = BACKWARD_PLANS.get(signature)
        if plan is not None:
            return plan, (inputs[1], inputs[1], 0)
    buffers = checked_buffers(kind, inputs, grads, tune_only, delta_from)
    dout, q, k, v, lse, delta = inputs
    (B, Sq, Hq, D), (_, Skv, Hkv, _), Dv = q.shape, k.shape, v.shape[-1]
    side = "query" if kind == "dq" else "key"
    tensors, (qk_scale, cap_in, shift, left, right), meta, key, scores = mask_arguments(
        q, k, v, mask, side)  # fmt: skip
    given = [t for t in delta_from if t is not None]
    check_launchable(kernel, *inputs, *buffers, *tensors[:2], *given)
    split = split_of() if kind != "dq" else 1
    if split > 1:  # the kernel writes fp32 partials (contiguous), summed after it
        buffers[:2] = [torch.empty((B, Skv, Hkv * split, d), dtype=torch.float32,
                                   device=q.device) for d in (D, Dv)]  # fmt: skip
    dq_direct = kind == "fused" and buffers[2].dtype == accumulator(q.dtype)
    if kind == "fused" and not dq_direct:  # fp32 scratch: contiguous, made per call
        buffers[2] = torch.empty(q.shape, dtype=accumulator(q.dtype), device=q.device)
    scale = resolve_scale(mask.softmax_scale, D)
    if kind != "dq":
        tma, out_tma = tma_paths((q, dout), buffers[:2])
        # dQ's reduce-add through TMA on a GPU (the interpreter has no descriptor atomics)
        dq_tma = (kind == "fused" and not common.is_interpreted(kernel)
                  and common.tma_compatible(buffers[2]))  # fmt: skip
        meta = {**meta, "ACCUMULATE": accumulate and split == 1, "TMA": tma,
                "OUT_TMA": out_tma, "DQ": kind == "fused", "DQ_TMA": dq_tma}  # fmt: skip
        key = (*key, ("SPLIT", split))
        scalars = (Sq, Skv, Hq, Hq // Hkv, split, qk_scale, cap_in, scale, shift, left, right)
    else:
        out, dlse = delta_from
        meta = {**meta, "ACCUMULATE": accumulate, "TMA": tma_paths((k, v), ())[0],
                "DELTA": out is not None, "DLSE": dlse is not None}  # fmt: skip
        scalars = (Sq, Skv, Hq, Hq // Hkv, qk_scale, cap_in, scale, shift, left, right)
    strides = tuple(s for t in (q, k, v, dout, lse, *buffers) for s in t.stride())
    if kind == "dkdv":  # no dQ: its strides are zeros (not read)
        strides += (0,) * 4
    if kind == "dq":  # out's and dlse's, zeros for those absent (not read)
        strides += (*(out.stride() if out is not None else (0,) * 4),
                    *(dlse.stride() if dlse is not None else (0,) * 3))  # fmt: skip
    # (split > 1 writes partials, summed after: a torch pick would write dk, dv itself)
    # (the fused kernel's alternative is the split backward, torch's among its candidates)
    # (torch's exact tanh would not recompute the P of a forward on the approximate one)
    torch_candidate = (split == 1 and kind != "fused" and torch_impl.capable_on_cuda(q, k)
                       and meta["SOFTCAP"] != SOFTCAP_APPROX)  # fmt: skip
    args = (q, k, v, dout, lse, delta, *buffers, *tensors[:2])
    plan = BackwardPlan(grads.dtype or q.dtype, accumulate, split, dq_direct, strides, scalars,
                        meta, launch_key(args, meta, Sq, Skv, key, torch_candidate), scores,
                        torch_candidate, {} if cached else None)  # fmt: skip
    if cached:
        remember(BACKWARD_PLANS, signature, plan)
    return plan, tensors
