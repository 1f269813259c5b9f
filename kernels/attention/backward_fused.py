"""The attention backward as one call: the fused kernel, the split one, and the choice.

| backward | launches                                 | GEMMs per block pair | dQ's sum          |
| -------- | ---------------------------------------- | -------------------- | ----------------- |
| split    | dQ (makes delta), dK/dV                  | 7: S, dP twice       | fixed order       |
| fused    | delta, dK/dV adding dQ, (dQ's conversion) | 5                    | atomics, any order |

The fused backward is the dK/dV kernel of `fusedpar.kernels.attention.backward` with
``DQ``: each program
adds every query block's ``scale * dS K`` into an fp32 dQ (on Hopper one TMA
reduce-add per block, FlashAttention-3's scheme), which is converted to dQ's dtype
after (or added into the caller's fp32 dQ directly). The order of those additions is
the order programs reach them, so dQ's last bits may differ from run to run; dK and dV
are summed in a fixed order as before. The split backward is the deterministic path:
`attention_backward` runs it under ``deterministic=True`` or
``torch.use_deterministic_algorithms(True)``, and otherwise lets the tuner time both,
with SDPA's own backwards where they compute the call (`torch_impl`; tuner
``attention_backward``; in the interpreter and under ``FUSEDPAR_TUNING=first`` the
fused one runs untimed).
"""

import functools
import re
from dataclasses import replace

import torch
import triton
from fusedpar.kernels import common, impl, tuning
from fusedpar.kernels.attention import backward as split_backward
from fusedpar.kernels.attention import torch_impl
from fusedpar.kernels.attention.backward import (
    DKDV_TILES,
    _attn_bwd_dkdv_kernel,
    attention_backward_dkdv,
    attention_backward_dq,
    contiguous_delta,
    group_split,
    launch_dkdv,
)
from fusedpar.kernels.attention.forward import tile_configs
from fusedpar.kernels.attention.mask import NO_MASK, AttentionMask
from fusedpar.kernels.attention.merge import attention_delta
from fusedpar.kernels.attention.plan import (
    NEW_GRADIENTS,
    NO_SOURCES,
    Gradients,
    gradient_buffer,
    plan_backward,
)
from fusedpar.kernels.attention.torch_impl import Scores
from fusedpar.kernels.tuning import LAUNCH, Launch, bucket

# The fused backward (dK/dV adding dQ): dQ's GEMM runs on wgmma only where BLOCK_M is
# 64 per warpgroup (32 queries run it as 16x8 mma.sync), so its tiles are the dK/dV
# kernel's with 64 queries. Per 128 queries and 128 keys at D=128 (causal GQA, TMA):
# 64x128 runs 1118 instructions, all five GEMMs on wgmma, against 1610 for the split
# kernels' best pair (dK/dV 32x128: 1156, dQ 128x128: 454); 32x128 1628. At D=64,
# 962 against 1186. 64x128 at D=128 keeps 255 registers: it spills 128 B outside the
# loop under GQA (none with one head per group), 264 B into the loop with soft-capping
# and 480 B on the pointer path, which take 32x128 instead.
_FUSED_TILES = {
    (64, "16-bit"): [(64, 128, 2, 8), (64, 64, 3, 4, {"pointer"}), (32, 128, 3, 8),
                     (32, 32, 2, 4)],
    (128, "16-bit"): [(64, 128, 2, 8, {"softcap", "pointer"}), (32, 128, 2, 8), (16, 32, 2, 8)],
    **{key: tiles for key, tiles in DKDV_TILES.items() if key[0] == 256 or key[1] == "fp32"},
}  # fmt: skip


def transposed_dot_miscompiles(version: str = triton.__version__) -> bool:
    """Whether this Triton is one that miscompiles ``tl.dot(tl.trans(ds), x)`` on Hopper
    when ``ds`` comes from a wgmma accumulator and the tile is 64 wide (wrong results,
    no error: fla-org/flash-linear-attention #640, #826, #983; 3.4 to 3.7.0, fixed in
    3.7.1). The fused backward's dQ is that dot; under these versions its tiles with a
    64-wide block are left out (`fused_configs`)."""
    return (3, 4) <= tuple(int(p) for p in re.findall(r"\d+", version)[:3]) < (3, 7, 1)


def fused_configs(head_dim: int, dtype: torch.dtype, modes: frozenset = frozenset(),
                  v_dim: int | None = None,
                  version: str = triton.__version__) -> list[triton.Config]:  # fmt: skip
    """The fused backward's tiles (at this head dim and V's), less the 64-wide ones
    under a Triton that miscompiles its dQ dot (`transposed_dot_miscompiles`;
    `version`: Triton's)."""
    configs = tile_configs(_FUSED_TILES, head_dim, dtype, modes, v_dim)
    if transposed_dot_miscompiles(version):
        configs = [c for c in configs if 64 not in (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"])]
    return configs


# The two candidates of tuner "attention_backward" (their kwargs name them in its file).
FUSED = triton.Config({"backward": "fused"})
SPLIT = triton.Config({"backward": "split"})


def attention_backward_fused(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    mask: AttentionMask = NO_MASK,
    *,
    grads: Gradients = NEW_GRADIENTS,
    launch_as: Launch = LAUNCH,
    delta_from: tuple = NO_SOURCES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(dq, dk, dv)`` of one attention block in one kernel; arguments as in
    `attention_backward`. With `delta_from` ``(out, dlse)`` (dlse None: 0) ``delta =
    rowsum(dO * O) - dLSE`` is first written into `delta` (a (B, Hq, Sq) fp32 buffer),
    after the checks; without, `delta` is read. dQ is summed in fp32: in the caller's
    buffer when it is fp32 (zeroed first unless ``grads.accumulate``), else in scratch
    converted (or added) after. On torch's implementation: the split halves."""
    out, dlse = delta_from
    if dlse is not None and out is None:
        raise ValueError("attention_backward_fused: dlse folds into the delta made from "
                         "`out`: give out too, or subtract it from a precomputed "
                         "delta")  # fmt: skip
    if grads.deterministic:
        raise ValueError("attention_backward_fused adds dQ by atomics, in no fixed order: "
                         "a deterministic backward is the split one")  # fmt: skip
    tune_only, accumulate = launch_as.tune_only, grads.accumulate
    if impl.runs_torch(q):
        grad_q = attention_backward_dq(dout, q, k, v, lse, delta, mask, grads=grads,
                                       launch_as=launch_as, delta_from=delta_from)  # fmt: skip
        grads_kv = attention_backward_dkdv(dout, q, k, v, lse, delta, mask, grads=grads,
                                           launch_as=launch_as)  # fmt: skip
        return None if tune_only else (grad_q, *grads_kv)
    inputs = (dout, q, k, v, lse, contiguous_delta(delta))
    plan, tensors = plan_backward("fused", _attn_bwd_dkdv_kernel,
                                  functools.partial(group_split, q, k, v),
                                  split_backward.SPLIT_BELOW_PROGRAMS, inputs, mask, grads,
                                  launch_as, delta_from)  # fmt: skip
    dk, dv, dq = (gradient_buffer(g, like, plan.grad_dtype, tune_only)
                  for g, like in ((grads.dk, k), (grads.dv, v), (grads.dq, q)))  # fmt: skip
    B, Skv, Hkv, _ = k.shape
    if out is not None and not tune_only:
        attention_delta(out, dout, dlse, inputs[-1])
    if B * Hkv * Skv == 0:  # no key: dQ is 0 (with Sq == 0 the kernel writes dK, dV zeros)
        if not tune_only and not accumulate:
            dq.zero_()
        return None if tune_only else (dq, dk, dv)
    if plan.dq_direct:  # the caller's fp32 dQ takes the sums itself
        dq_sums = dq if accumulate or tune_only else dq.zero_()
    else:
        dq_sums = torch.zeros(q.shape, dtype=common.accumulator(q.dtype), device=q.device)
    # every launch adds into dQ's sums: tuning restores them
    launch_dkdv(plan, tensors, fused_configs, inputs, (dk, dv, dq_sums), launch_as,
                restore=[dq_sums])  # fmt: skip
    if tune_only:
        return None
    if dq_sums is not dq and accumulate:
        dq.add_(dq_sums)
    elif dq_sums is not dq:
        dq.copy_(dq_sums)
    return dq, dk, dv


def _backward_key(q, k, v, mask: AttentionMask, accumulate: bool, buffers) -> tuple:
    """Tuner ``attention_backward``'s key: what the two backwards' relative speed depends
    on (the lengths bucketed as the kernels' tiles are)."""
    (B, Sq, Hq, D), (_, Skv, Hkv, _) = q.shape, k.shape
    return (str(q.dtype), D, v.shape[-1], bucket(B), bucket(Sq), bucket(Skv), Hq, Hkv,
            mask.intervals is not None or mask.masked, mask.softcap > 0, accumulate,
            *(str(g.dtype) for g in buffers))  # fmt: skip


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    mask: AttentionMask = NO_MASK,
    *,
    delta: torch.Tensor | None = None,
    delta_from: tuple = NO_SOURCES,
    grads: Gradients = NEW_GRADIENTS,
    launch_as: Launch = LAUNCH,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | triton.Config | impl.Torch:
    """Returns ``(dq, dk, dv)`` from dO, the inputs and the forward's LSE, under `mask`
    (`AttentionMask`, as in `attention_forward`).

    `delta` (B, Hq, Sq) fp32 is ``rowsum(dO * O)`` (minus dLSE when the LSE has a
    gradient); when not given it is made from `delta_from` ``(out, dlse)`` (dlse None:
    0): by the split backward's dQ kernel as it starts, or by the delta kernel before the
    fused one. `grads` (`Gradients`): the caller's dq, dk, dv (any strides; None: new
    ones in ``grads.dtype``, q's unless given: q's or fp32), overwritten, or added into
    with ``grads.accumulate``. `launch_as`: as in `attention_forward`; with ``tune_only``
    it makes the pick on scratch gradients and returns it (`FUSED`, `SPLIT` or one of
    `torch_impl`'s), as the ring does before its loop. ``grads.deterministic`` (or
    PyTorch's `torch.use_deterministic_algorithms`) runs the split backward, whose every
    sum has a fixed order; otherwise the fastest of it, the fused one and, on CUDA under
    ``FUSEDPAR_IMPL=auto``, PyTorch's own backwards where they compute the call
    (`torch_impl`; no dlse among them) for these sizes (module docstring). The ring
    launches the fused kernel or the split halves itself, by this pick for its own block.
    """
    out, dlse = delta_from
    if delta is not None and dlse is not None:
        raise ValueError("attention_backward: dlse folds into delta: give it with `out`, or "
                         "subtract it from the precomputed delta yourself")  # fmt: skip
    if delta is None and out is None:
        raise ValueError("attention_backward needs `out` or a precomputed `delta`")
    accumulate = grads.accumulate

    def halves(given: Gradients, launch_as: Launch):
        made, sources = delta, NO_SOURCES
        if made is None:  # dQ writes it (lse's shape, which dQ checks before any launch)
            made = split_backward.delta_buffer(lse.shape, lse.device, lse.dtype)
            sources = delta_from
        grad_q = attention_backward_dq(dout, q, k, v, lse, made, mask, grads=given,
                                       launch_as=launch_as, delta_from=sources)  # fmt: skip
        grads_kv = attention_backward_dkdv(dout, q, k, v, lse, made, mask, grads=given,
                                           launch_as=launch_as)  # fmt: skip
        return None if launch_as.tune_only else (grad_q, *grads_kv)

    if grads.deterministic or torch.are_deterministic_algorithms_enabled() or impl.runs_torch(q):
        ran = halves(grads, launch_as)
        return SPLIT if launch_as.tune_only else ran

    def fused(given: Gradients, launch_as: Launch):
        made, sources = delta, NO_SOURCES
        if made is None:  # written by the launcher, after its checks
            made = split_backward.delta_buffer(lse.shape, lse.device, lse.dtype)
            sources = delta_from
        return attention_backward_fused(dout, q, k, v, lse, made, mask, grads=given,
                                        launch_as=launch_as, delta_from=sources)  # fmt: skip

    # Both write into the same buffers, so the tuner can time one after the other: the
    # caller's, or new ones (scratch when only tuning; the launchers check them all).
    given = [grads.dq, grads.dk, grads.dv]
    if accumulate and not launch_as.tune_only and None in given:
        raise ValueError("accumulate=True adds into dq, dk and dv: give all three")
    buffers = [gradient_buffer(g, like, grads.dtype or q.dtype, launch_as.tune_only)
               for g, like in zip(given, (q, k, v), strict=True)]  # fmt: skip
    into = replace(grads, dq=buffers[0], dk=buffers[1], dv=buffers[2])
    platform = {}  # PyTorch's own backwards, where they compute this call (not deterministic)
    if q.device.type == "cuda" and mask.intervals is None and impl.tunes_torch():
        scores = Scores.of_mask(mask, q.shape[1], k.shape[1], q.shape[-1])
        platform = torch_impl.backward_candidates(
            dout, q, k, v, out, lse, scores, buffers, dlse, accumulate)  # fmt: skip
    ran = []
    launched = Launch(launch_as.agreement)  # each candidate launches, with the agreement

    def run(config):
        if config is FUSED or config is SPLIT:
            ran.append((fused if config is FUSED else halves)(into, launched))
        else:
            platform[config]()
            ran.append(tuple(buffers))

    def candidates():
        if common.is_interpreted(_attn_bwd_dkdv_kernel):
            return [FUSED]
        return [FUSED, SPLIT, *platform]

    key = (*_backward_key(q, k, v, mask, accumulate, buffers),
           ("platform", tuple(c.name for c in platform)))  # fmt: skip
    restore = buffers if accumulate and not launch_as.tune_only else []
    tuner = tuning.tuner("attention_backward")
    pick = tuner.run(key, candidates, run, device=q.device, restore=restore, launch_as=launch_as)
    return pick if launch_as.tune_only else ran[-1]
