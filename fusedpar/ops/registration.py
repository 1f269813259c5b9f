"""One way to call fusedpar's custom ops: the op where a tool looks at ops, its bodies
straight in plain eager.

Each op is a ``torch.library.custom_op`` with its fake, backward op and autograd
registered, so torch.compile traces it whole, selective checkpointing names it and fake
or meta tensors get its shapes. That dispatch costs host time on every call
(docs/hot_path.md), so in plain eager the same forward body, ``setup_context`` and
backward run as an ``autograd.Function``, and a backward op's body is called directly:

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
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor

from fusedpar import local_params
from fusedpar.kernels.common import accumulator

__all__ = ["asked", "autograd_op", "direct_op", "flat", "row_sum", "spread"]


def _first_tensor(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0]  # an op's list[Tensor] (the Ulysses exchanges take only lists)
    return None


def _op_wanted(args) -> bool:
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return True
    first = _first_tensor(args)
    return first is not None and (first.is_meta or isinstance(first, FakeTensor))


def direct_op(op):
    """`op` (a custom op with no autograd of its own: a backward op) as fusedpar calls
    it: its body directly in plain eager, the op otherwise (see the module doc)."""
    body = op._init_fn

    def call(*args):
        return op(*args) if _op_wanted(args) else body(*args)

    call.op = op
    return call


def _flatten(values) -> tuple[list, tuple]:
    """Entries that are lists (an op's ``list[Tensor]``) spread out: autograd.Function
    tracks only the tensors it is given directly."""
    leaves, spec = [], []
    for value in values:
        if isinstance(value, (list, tuple)):
            spec.append(len(value))
            leaves.extend(value)
        else:
            spec.append(None)
            leaves.append(value)
    return leaves, tuple(spec)


def _unflatten(leaves, spec) -> list:
    out, i = [], 0
    for n in spec:
        if n is None:
            out.append(leaves[i])
            i += 1
        else:
            out.append(list(leaves[i : i + n]))
            i += n
    return out


def autograd_op(op, backward, setup_context):
    """Register `backward` and `setup_context` as `op`'s autograd (``torch.library``) and
    return the callable fusedpar calls: `op` where a tool looks at ops, else an
    ``autograd.Function`` running `op`'s body, `setup_context` and `backward` (see the
    module doc). Arguments are positional, all of them (a custom op fills defaults);
    list arguments and outputs (``list[Tensor]``) are spread out for autograd and put
    back together for the bodies, as ``torch.library`` does. So ``ctx.needs_input_grad``
    is not per argument here: `setup_context` reads ``requires_grad`` off the inputs
    (as fusedpar's do)."""
    op.register_autograd(backward, setup_context=setup_context)
    body = op._init_fn

    def forward(ctx, spec, output_spec, *leaves):
        ctx.taken = None
        if DTensor in map(type, leaves):  # a module's parameters (`local_params.take_locals`)
            leaves, ctx.taken = local_params.take_locals(leaves)
        args = tuple(_unflatten(leaves, spec))
        output = body(*args)
        setup_context(ctx, args, output)
        ctx.input_spec = spec
        if isinstance(output, torch.Tensor):
            ctx.output_spec = None
            return output
        # a tuple of outputs, or one list of them (returned as a list again)
        ctx.one_list = isinstance(output, list)
        flat, ctx.output_spec = _flatten((output,) if ctx.one_list else output)
        output_spec.append((ctx.output_spec, ctx.one_list))  # for the caller: the lists
        return tuple(flat)

    def backward_leaves(ctx, *grads):
        if ctx.output_spec is not None:
            grads = _unflatten(grads, ctx.output_spec)  # (a list for one list output)
        given = backward(ctx, *grads)
        given = given if isinstance(given, tuple) else (given,)
        flat = []
        for grad, n in zip(given, ctx.input_spec, strict=True):
            if n is None:
                flat.append(grad)
            else:
                flat.extend([None] * n if grad is None else grad)
        if ctx.taken:  # the parameters' gradients as DTensors, or accumulated
            local_params.give_grads(ctx, flat)
        return (None, None, *flat)

    # named after the op (its backward node: "<op>_eagerBackward" in a graph's grad_fn)
    Function = type(
        f"{op._name}_eager",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(forward),
            "backward": staticmethod(backward_leaves),
        },
    )

    def call(*args):
        if _op_wanted(args):
            return op(*args)
        leaves, spec = _flatten(args)
        output_spec = []
        output = Function.apply(spec, output_spec, *leaves)
        if not output_spec:
            return output
        spec, one_list = output_spec[0]
        outputs = _unflatten(output, spec)
        return outputs[0] if one_list else tuple(outputs)

    call.op = op
    return call


# --- what the ops' bodies share ---------------------------------------------------------


def flat(t: torch.Tensor) -> torch.Tensor:
    """(tokens, features) of `t`: itself when 2-D (a view costs ~1 µs of host time)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def row_sum(dy2d: torch.Tensor, dtype) -> torch.Tensor:
    """A bias's gradient: dy's rows summed in fp32 (float64 for float64), rounded once."""
    return dy2d.sum(0, dtype=accumulator(dy2d.dtype)).to(dtype)


def spread(present: list, has: list[bool]) -> list:
    """One entry per flag: the next of `present` where True, None where False."""
    it = iter(present)
    return [next(it) if flag else None for flag in has]


def asked(grads, needs) -> list:
    """The backward ops return an empty tensor for a gradient not asked for: None here.
    Decided by the flags, never by the tensor's size (unbacked under torch.compile)."""
    return [g if need else None for g, need in zip(grads, needs, strict=True)]
