"""Helpers of the tests in this folder: `held_state` and `check_peaks` (moved from
test_plan.py), and `real_ops`: `GatedDeltaNet`'s recurrence as the planner counts it
(test_plan_gdn.py), its CPU backward's workspace kept out of the saved bytes."""

import contextlib

import torch

import fusedpar as fp
import fusedpar.nn.gated_deltanet_cp as gdn_module


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
    """`fusedpar.nn.gated_deltanet_cp`'s recurrence run as `_rule`."""
    ops = {"gated_delta_rule": _rule}
    before = {name: getattr(gdn_module, name) for name in ops}
    try:
        for name, op in ops.items():
            setattr(gdn_module, name, op)
        yield
    finally:
        for name, op in before.items():
            setattr(gdn_module, name, op)
