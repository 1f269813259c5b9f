"""Helpers of the tests in this folder: `held_state` and `check_peaks` (moved from
test_plan.py), and `real_ops`: `GatedDeltaNet`'s three ops as the planner counts them
(test_plan_gdn.py): `fp.gated_delta_rule` (the real op), and `fp.ops.causal_conv1d`
and `fp.ops.rms_norm_gated` where they exist, else the layer's stand-ins run under an
autograd Function saving what the real op's contract says (docs/linear_attention_parts.md
and ops/norm.py on their branch): the conv its input and weight, the gated norm x, z,
the weight and one fp32 rstd a row. At the merge the fallbacks fall away unused."""

import contextlib

import torch

import fusedpar as fp
import fusedpar.nn.gated_deltanet as gdn_module


def held_state(model, optimizer) -> dict:
    """Bytes of the parameters, gradients and optimizer state this rank holds (local
    shards of DTensors)."""
    held = [
        model.parameters(),
        (p.grad for p in model.parameters()),
        (t for s in optimizer.state.values() for t in s.values()),
    ]
    local = (
        sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in ts) for ts in held
    )
    return dict(zip(("parameters", "gradients", "optimizer"), local, strict=True))


def check_peaks(results: list, where, summed: bool) -> None:
    """The most bytes of saved activations each rank held at once in its step (`peak`:
    real, planned, slack), or their sum over the ranks (`summed`: with EP, a rank's rows
    follow the routing), equal the planner's. Slack: in a pipeline the microbatches'
    token ids and labels are views of the whole batch's (int64) storages, which the
    real count holds whole and the planner counts per microbatch. (Not with EP in a
    pipeline: a rank's peak is the most its routed microbatches hold at once, above the
    balanced one's, and a sum of peaks is not the peak of a sum.)"""
    for group in [results] if summed else [[r] for r in results]:
        real, planned, slack = (sum(r["peak"][i] for r in group) for i in range(3))
        assert 0 <= real - planned <= slack, (where, real, planned, slack)


def _same(t):
    return t


class _Contract(torch.autograd.Function):
    """``fn(*tensors)`` saving `tensors` and ``extra(*tensors)``; its backward recomputes
    `fn` under autograd (the stand-in's math, the real op's saved set)."""

    @staticmethod
    def forward(ctx, fn, extra, *tensors):
        ctx.fn, ctx.count = fn, len(tensors)
        with torch.no_grad():
            out = fn(*tensors)
            more = extra(*tensors)
        ctx.save_for_backward(*tensors, *more)
        return out

    @staticmethod
    def backward(ctx, grad):
        tensors = ctx.saved_tensors[: ctx.count]
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        # (inner hooks that keep the tensors as they are: the recompute's own saved
        # tensors, the stand-in's, are no part of the real op's and go uncounted)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            out = ctx.fn(*inputs)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad))
        return (None, None, *(next(grads) if t.requires_grad else None for t in inputs))


def _conv(x, weight, bias=None, *, cu_seqlens=None, **_):
    from fusedpar.ops import linear_attention_stand_in as stand_in  # (deleted at the merge)

    def fn(x, weight):
        return stand_in.causal_conv1d(x, weight, bias, cu_seqlens=cu_seqlens)[0]

    return _Contract.apply(fn, lambda *t: (), x, weight), None


def _norm(x, z, weight, *, eps, gate="silu"):
    from fusedpar.ops import linear_attention_stand_in as stand_in

    def fn(x, z, weight):
        return stand_in.rms_norm_gated(x, z, weight, eps=eps, gate=gate)

    def rstd(x, z, weight):  # one fp32 a row
        return ((x.float().pow(2).mean(-1) + eps).rsqrt(),)

    return _Contract.apply(fn, rstd, x, z, weight)


def _rule(*args, **kwargs):
    """`fp.gated_delta_rule`, its backward run under neutral hooks: torch's CPU backward
    recomputes its chunks under autograd, a workspace of the backward (the GPU's kernels
    keep theirs in registers), not a tensor the forward saved."""
    o, final = fp.gated_delta_rule(*args, **kwargs)
    if o.grad_fn is not None:
        hooks = torch.autograd.graph.saved_tensors_hooks(_same, _same)
        o.grad_fn.register_prehook(lambda grads: hooks.__enter__())
        o.grad_fn.register_hook(lambda inputs, outputs: hooks.__exit__(None, None, None))
    return o, final


@contextlib.contextmanager
def real_ops():
    """`fusedpar.nn.gated_deltanet`'s ops replaced by the real ones (or their contracts)."""
    ops = {
        "gated_delta_rule": _rule,
        "causal_conv1d": getattr(fp.ops, "causal_conv1d", _conv),
        "rms_norm_gated": getattr(fp.ops, "rms_norm_gated", _norm),
    }
    before = {name: getattr(gdn_module, name) for name in ops}
    try:
        for name, op in ops.items():
            setattr(gdn_module, name, op)
        yield
    finally:
        for name, op in before.items():
            setattr(gdn_module, name, op)
