"""Launching an attention kernel through the tuner: its tile list for the call's
specialisation (`kernel_modes`) pruned to the sequences, one tile sized to the problem in
the interpreter, torch's implementation and PyTorch's own kernels as candidates beside
the tiles, and a planned launcher's settled pick launched past the tuner. Used by the
forward (`forward`), the split and the fused backward. And the attention forward's plan:
what a call works out once per call signature (its checks, the kernel's scalars and
meta, the tuner's key), looked up by later calls with the same shapes, strides, dtypes,
devices, alignment, mask scalars and flags (host time per call at
bench/host_overhead.py's shapes: 37 -> 15 µs); and the tuner key and the bounded store
every attention plan uses (the backward's: `plan`)."""

from dataclasses import dataclass, field

import torch
import triton
from fusedpar.kernels import _common, _impl, _tuning
from fusedpar.kernels._common import device_guard, is_interpreted, next_power_of_2
from fusedpar.kernels._tuning import bucket

# The interpreter runs one program at a time in numpy: a few large tiles beat many small.
INTERPRETER_MAX_BLOCK = 64


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


def launch(
    kernel, configs, grid, args, meta, Sq, Skv, *, restore=(), agreement=None, tune_only=False,
    key_extra=(), torch_run=None, key=None, settled=None, platform=None,
):  # fmt: skip
    """Launch `kernel` with the tile tuned for (Sq and Skv buckets, `meta`, the dtypes,
    `key_extra`): one sized to the problem in the interpreter, else the best of
    ``configs()``. `grid(tile)` builds the grid; `restore`: buffers the kernel reads
    back (adds into, or merges with). `torch_run`: the torch implementation of the same
    call, a candidate too where given (CUDA, ``FUSEDPAR_IMPL=auto``). `key`: the tuner's
    key as `launch_key` makes it, from a launcher's plan; `settled`: that plan's
    `_tuning.Settled` per implementation asked for, launched past the tuner once the
    pick is made (and kept there after it). `platform`: ``platform()`` gives ``{candidate:
    run()}`` of PyTorch's own kernels for this call (`torch_impl`), candidates
    too where torch's is; the key must name them."""
    name = kernel.__name__
    request = None
    if settled is not None and agreement is None and not tune_only:
        request = _impl.requested()
        kept = settled.get(request)
        if kept is not None and _tuning.kept(name, kept.scope) is kept.config:
            kept.launch(kernel, args)
            return
    if key is None:
        key = launch_key(args, meta, Sq, Skv, key_extra, torch_run is not None)

    def candidates():
        if is_interpreted(kernel):
            tiles = [triton.Config(interpreter_blocks(bucket(Sq), bucket(Skv)))]
        else:
            configs_here = configs(meta["HEAD_DIM"], args[0].dtype, kernel_modes(meta),
                                   v_dim=meta["HEAD_DIM_V"])  # fmt: skip
            tiles = prune_configs(configs_here, bucket(Sq), bucket(Skv))
        if not _impl.tunes_torch():
            return tiles
        return tiles + ([_impl.TORCH] if torch_run else []) + list(platform_runs())

    runs = {}

    def platform_runs():  # built once per call, when first needed
        if platform is not None and not runs:
            runs.update(platform())
        return runs

    def run(config):
        if isinstance(config, _impl.Torch):
            platform_runs().get(config, torch_run)()
        else:
            kernel[grid(config.kwargs)](*args, **meta, **config.all_kwargs())

    with device_guard(args[0]):
        config = _tuning.tuner(name).run(key, candidates, run, device=args[0].device,
                                         restore=restore, agreement=agreement,
                                         tune_only=tune_only)  # fmt: skip
    if request is not None and not isinstance(config, _impl.Torch):
        scope = _tuning.local_scope(key, request)
        if _tuning.kept(name, scope) is config:  # the pick (not a forced config)
            kwargs = {**meta, **config.all_kwargs()}
            settled[request] = _tuning.Settled.of(kernel, config, scope, grid(config.kwargs),
                                                  kwargs, len(args))  # fmt: skip


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
    scalars and meta, the tuner's key. Calls with the tensor mask (`intervals`), with
    ``tune_only`` or on torch's implementation are not planned."""

    out_shape: tuple
    out_dtype: torch.dtype
    scalars: tuple  # Sq, Skv, group, qk_scale, cap_in, shift, left, right
    meta: dict
    key: tuple
    scores: object  # for torch's implementation, a candidate on CUDA
    torch_candidate: bool
    # per implementation asked for, the pick and its launch once made (`_tuning.Settled`)
    settled: dict = field(default_factory=dict, compare=False)


FORWARD_PLANS: dict[tuple, ForwardPlan] = {}
MAX_PLANS = 4096  # a property test's many shapes: start over rather than grow


def forward_signature(q, k, v, causal, softmax_scale, window, softcap, out, lse, out_dtype,
                      merge) -> tuple:  # fmt: skip
    return (
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
        v.dtype, q.device, k.device, v.device, causal, softmax_scale, tuple(window), softcap,
        out_dtype, merge,
        out is not None and (out.shape, out.stride(), out.dtype, out.data_ptr() % 16),
        lse is not None and (lse.shape, lse.stride(), lse.dtype), q.data_ptr() % 16,
        k.data_ptr() % 16, v.data_ptr() % 16, torch.get_float32_matmul_precision(),
        _common.tma_compatible,  # the TMA rule in force (tests swap it for the pointer path)
    )  # fmt: skip


def remember(plans: dict, signature: tuple, plan):
    """Keep `plan` under `signature` (starting over past `MAX_PLANS`); returns it."""
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[signature] = plan
    return plan
