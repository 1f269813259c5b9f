"""A module's DTensor parameters as local tensors for one forward: one autograd node.

`fusedpar.distribute`'s forward pre-hook puts each DTensor parameter's local tensor in
its place for the module's forward, declaring the placements of its gradient. Done per
parameter with ``DTensor.to_local(grad_placements=...)``, each is an autograd node whose
backward computes the gradient's global stride, copies or builds a ``DTensorSpec`` and
wraps the local gradient through ``DTensor.from_local`` (an ``autograd.Function`` of its
own and another new spec): about 60 µs a parameter in the backward on the 2-core CPU
machine (torch 2.13), where a one-rank ``ParallelSwiGLU``'s whole forward and backward
take 230 µs (bench/host_overhead.py's distributed rows, docs/hot_path.md).

`local_views` makes all of a module's parameters one node (about 9 µs a gradient in
its backward). Its backward wraps each local
gradient in a DTensor whose spec is copied from one kept per (the parameter's spec, the
gradient placements, as objects; the gradient's stride and dtype): at a miss the spec
``DTensor.from_local`` makes from the gradient, the global shape and the global stride
(as ``to_local``'s backward calls it), so each gradient is the DTensor ``to_local``'s
backward returns: the same local tensor, placements, shape, stride and dtype
(tests/test_storage.py). While ``torch.compile`` traces, and for a parameter that is not
a plain DTensor, the parameters go through ``to_local`` as before; in a double backward
(``create_graph``) each gradient goes through ``DTensor.from_local``, which records it.

The parameters' gradients reach autograd together, when the module's backward has made
them all, not one by one: the post-accumulate-grad hooks (`fusedpar.storage`'s, FSDP2's)
see the same gradients, in the same backward.
"""

import copy
import warnings

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_global_tensor_info

__all__ = ["local_views"]


class _LocalViews(torch.autograd.Function):
    """DTensors -> views of their local tensors; gradients -> DTensors (module doc)."""

    @staticmethod
    def forward(ctx, plan, *params):
        # plan: per parameter (gradient placements, the module's spec cache)
        ctx.plan, ctx.specs = plan, [p._spec for p in params]
        ctx.set_materialize_grads(False)  # an unused parameter gets no gradient, as before
        views, frozen = [], []
        for p in params:
            local = p._local_tensor
            view = local.view_as(local)  # a fresh tensor: autograd's metadata goes on it
            if getattr(p, "_is_param", False):
                view._is_param = True  # a Parameter's local is one too (to_local, gh-166156)
            views.append(view)
            if not p.requires_grad:
                frozen.append(view)
        # a frozen parameter's view needs no gradient, as to_local's would not (a Function
        # marks every output differentiable: the layers would compute dW to drop it)
        ctx.mark_non_differentiable(*frozen)
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads):
        out = [None]
        for grad, spec, (placements, specs) in zip(grads, ctx.specs, ctx.plan, strict=True):
            out.append(None if grad is None else _as_dtensor(grad, spec, placements, specs))
        return tuple(out)


def _as_dtensor(grad: Tensor, spec, placements: tuple, specs: dict) -> DTensor:
    """`grad` (the local gradient) as the DTensor of `placements` whose global shape is
    the parameter's (`spec`): ``to_local``'s backward, its spec kept in `specs`."""
    # Keyed by identity (hashing a spec and its placements is a Python call each): the
    # entry holds both objects, so their ids stay theirs while it is kept.
    key = (id(spec), id(placements), grad.stride(), grad.dtype)
    entry = specs.get(key)
    if entry is None or torch.is_grad_enabled():  # (grad mode: a double backward)
        _, stride = compute_global_tensor_info(grad, spec.mesh, spec.placements)
        made = DTensor.from_local(
            grad, spec.mesh, placements, shape=spec.shape, stride=tuple(stride)
        )
        kept = copy.copy(made._spec)
        hash(kept)  # kept in the spec (and in its copies): DTensor's dispatch hashes specs
        specs[key] = (spec, placements, kept)
        return made
    kept = entry[2]
    # A spec of its own per gradient, as DTensor's do (a spec can be changed in place).
    # ``__new__`` alone: ``__init__`` only marks the constructor for export's tracing, in a
    # wrapper that costs more than the DTensor (this is never traced: `local_views`).
    return DTensor.__new__(DTensor, grad.view_as(grad), copy.copy(kept), requires_grad=False)


def local_views(params: list, grad_placements: list, specs: dict) -> list[Tensor]:
    """The local tensors of `params` (DTensors) for one forward, each the view
    ``p.to_local(grad_placements=g)`` returns, in one autograd node (the module doc);
    `specs` is the caller's cache of gradient specs (a dict kept per module)."""
    if torch.compiler.is_compiling() or any(type(p) is not DTensor for p in params):
        if not torch.compiler.is_compiling():
            _say_once(
                "fusedpar.distribute: a parameter is a subclass of DTensor "
                f"({', '.join(sorted({type(p).__name__ for p in params}))}): its module's "
                "parameters take DTensor.to_local one by one (~110 us a parameter a step "
                "more on the host than fusedpar's one-node swap)"
            )
        return [p.to_local(grad_placements=g) for p, g in zip(params, grad_placements, strict=True)]
    plan = tuple((g, specs) for g in grad_placements)
    return list(_LocalViews.apply(plan, *params))


_said: set = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        warnings.warn(message, UserWarning, stacklevel=4)
