"""One way to call fusedpar's custom ops: the op where a tool looks at ops, its bodies
straight in plain eager.

Each op is a ``torch.library.custom_op`` with its fake, backward op and autograd
registered, so torch.compile traces it whole (full graph), selective checkpointing
names it in a policy, and fake or meta tensors get its shapes. That dispatch costs host
time: for an op with flash-attention's signature, fwd+bwd with empty bodies, 80 µs
against 56 µs as an ``autograd.Function`` (bench/host_overhead.py), on every call of
every layer. So in plain eager, where nothing looks at the op, the same forward body,
``setup_context`` and backward run as an ``autograd.Function``, and a backward op's body
is called directly:

| when                                                  | runs                          |
| ----------------------------------------------------- | ----------------------------- |
| compiling (``torch.compiler.is_compiling()``)         | the custom op                 |
| a dispatch mode is active (selective checkpointing,   | the custom op                 |
| FakeTensorMode, FlopCounterMode, ``HostSyncs``)       |                               |
| a meta or fake tensor among the inputs                | the custom op                 |
| otherwise (plain eager)                               | the bodies, as above          |

The numbers are the same either way: the same functions run.
"""

import torch

__all__ = ["autograd_op", "direct_op"]


def _op_wanted(args) -> bool:
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return True
    from torch._subclasses.fake_tensor import FakeTensor

    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first is not None and (first.is_meta or isinstance(first, FakeTensor))


def direct_op(op):
    """`op` (a custom op with no autograd of its own: a backward op) as fusedpar calls
    it: its body directly in plain eager, the op otherwise (see the module doc)."""
    body = op._init_fn

    def call(*args):
        return op(*args) if _op_wanted(args) else body(*args)

    call.op = op
    return call


def autograd_op(op, backward, setup_context):
    """Register `backward` and `setup_context` as `op`'s autograd (``torch.library``) and
    return the callable fusedpar calls: `op` where a tool looks at ops, else an
    ``autograd.Function`` running `op`'s body, `setup_context` and `backward` (see the
    module doc). Arguments are positional, all of them (a custom op fills defaults)."""
    op.register_autograd(backward, setup_context=setup_context)
    body = op._init_fn

    def forward(ctx, *args):
        output = body(*args)
        setup_context(ctx, args, output)
        return output

    # named after the op (its backward node: "<op>_eagerBackward" in a graph's grad_fn)
    Function = type(f"{op._name}_eager", (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(lambda ctx, *grads: backward(ctx, *grads)),
    })  # fmt: skip

    def call(*args):
        return op(*args) if _op_wanted(args) else Function.apply(*args)

    call.op = op
    return call
