"""The attention forward's plan: what a call works out once per call signature (its
checks, the kernel's scalars and meta, the tuner's key), looked up by later calls with
the same shapes, strides, dtypes, devices, alignment, mask scalars and flags (host time
per call at bench/host_overhead.py's shapes: 37 -> 15 µs); and the tuner key and the
bounded store every attention plan uses (the backward's: `attention_backward_plan`)."""

from dataclasses import dataclass, field

import torch
from fusedpar.kernels import _common
from fusedpar.kernels._tuning import bucket


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
