"""`fusedpar.ops.registration`: in plain eager an op's bodies run as an autograd.Function
(cheaper dispatch), wherever a tool looks at ops the custom op runs; the same numbers,
bit for bit, either way."""

import functools

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import fusedpar as fp
from fusedpar.testing.strategies import randn


def _inputs():
    q = randn((1, 12, 4, 16), torch.float32, 0).requires_grad_()
    k, v = (randn((1, 12, 2, 16), torch.float32, s).requires_grad_() for s in (1, 2))
    return q, k, v


def _run(attend):
    q, k, v = _inputs()
    out = attend(q, k, v)
    (out * randn(out.shape, torch.float32, 3)).sum().backward()
    return out.grad_fn, [t.detach() for t in (out, q.grad, k.grad, v.grad)]


def _flash(q, k, v):
    return fp.flash_attn(q, k, v, causal=True, window=(5, 0))


def test_plain_eager_runs_the_bodies_as_a_function_and_a_policy_sees_the_op():
    """Plain eager: the autograd.Function. Under selective checkpointing (a dispatch
    mode) the policy is asked about ``fusedpar.flash_attn`` itself, and the results are
    the same bits."""
    eager_fn, eager = _run(_flash)
    assert type(eager_fn).__name__.startswith("flash_attn_eager")
    asked = []

    def policy(ctx, op, *args, **kwargs):
        asked.append(str(op))
        return CheckpointPolicy.PREFER_RECOMPUTE

    context = functools.partial(create_selective_checkpoint_contexts, policy)
    _, checkpointed = _run(
        lambda *t: checkpoint(_flash, *t, use_reentrant=False, context_fn=context)
    )
    assert any("fusedpar.flash_attn" in name for name in asked), asked
    for a, b in zip(eager, checkpointed, strict=True):
        assert torch.equal(a, b)


def test_meta_and_fake_tensors_take_the_op():
    """Shapes without data (meta tensors, a FakeTensorMode) come from the op's fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    meta_q = torch.empty((1, 12, 4, 16), device="meta")
    meta_kv = torch.empty((1, 12, 2, 16), device="meta")
    assert fp.flash_attn(meta_q, meta_kv, meta_kv).shape == (1, 12, 4, 16)
    with FakeTensorMode():
        fake_q, fake_kv = torch.empty((1, 12, 4, 16)), torch.empty((1, 12, 2, 16))
        assert fp.flash_attn(fake_q, fake_kv, fake_kv, causal=True).shape == (1, 12, 4, 16)
