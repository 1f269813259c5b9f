"""A module's DTensor parameters as local tensors for one forward: one autograd node.

`fusedpar.distribute`'s hooks (`swap_in_locals`, `swap_back`) put every DTensor
parameter's local tensor in its place for the module's forward, all of them one autograd
node (a `LocalSwap`, worked out once per module while it holds the same parameters),
where ``DTensor.to_local(grad_placements=...)`` makes one node each. A layer whose class
says ``READS_FORWARD_PARAMS`` gets no hooks and reads them through `forward_params`;
where its forward is one op, that op's own node swaps them (`take_locals`, `give_grads`,
`fusedpar.ops.registration`). The host time saved: docs/hot_path.md.

The backward wraps each local gradient in the DTensor ``to_local``'s backward would
return (tests/storage/test_storage.py), its spec copied from one kept per (parameter
spec, gradient placements; stride, dtype). Where AccumulateGrad would accumulate that
DTensor, the node accumulates on the local tensors instead (`_accumulate`), and
AccumulateGrad still runs its hooks (a pre-hook on that node itself, which Python
cannot list, gets None). While ``torch.compile`` traces, and for a parameter that is
not a plain DTensor, the parameters go through ``to_local``; in a double backward each
gradient goes through ``DTensor.from_local``, which records it.
"""

import copy
import operator
import sys
import warnings
import weakref

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_global_tensor_info

__all__ = [
    "LocalSwap",
    "forward_params",
    "give_grads",
    "local_views",
    "scale_grad",
    "swap_back",
    "swap_in_locals",
    "take_locals",
]


class _LocalViews(torch.autograd.Function):
    """DTensors -> their local tensors; gradients -> DTensors, or accumulated (module doc).
    `plan` is the `LocalSwap`: one argument that pytree leaves whole."""

    @staticmethod
    def forward(ctx, plan, *params):
        ctx.plan, ctx.params, ctx.specs = plan, params, [p._spec for p in params]
        ctx.set_materialize_grads(False)  # an unused parameter gets no gradient, as before
        # fresh tensors, autograd's metadata goes on them: aliases (to_local's are views,
        # which autograd tracks as such: 15 -> 7 µs for three, this machine)
        views = [p._local_tensor.detach() for p in params]
        for view, is_param in zip(views, plan.is_param, strict=True):
            if is_param:  # a Parameter's local is one too (to_local, gh-166156)
                view._is_param = True
        frozen = [view for view, p in zip(views, params, strict=True) if not p.requires_grad]
        if frozen:  # its view needs no gradient, as to_local's would not (a Function marks
            ctx.mark_non_differentiable(*frozen)  # every output differentiable: dW for nothing)
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads):
        edges, adds, swap = _accumulating_edges(ctx), ([], []), ctx.plan
        out = [None]  # (the plan's)
        for i, (grad, param, spec) in enumerate(zip(grads, ctx.params, ctx.specs, strict=True)):
            edge = None if edges is None else edges[i][0]
            out.append(_param_grad(swap, i, param, spec, grad, edge, adds))
        if adds[0]:  # AccumulateGrad's in-place ``grad += new``, for all in one call
            torch._foreach_add_(*adds)
        return tuple(out)


def _accumulating_edges(ctx):
    """The node's edges, where its backward may do AccumulateGrad's work (`_accumulate`);
    None in a double backward (grad mode: AccumulateGrad builds a graph) and under
    compiled autograd (traced: its graph accumulates the gradients)."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or _compiled_autograd():
        return None
    return ctx.next_functions


def _param_grad(swap, i: int, param, spec, grad, edge, adds):
    """What autograd gets for ``swap.params[i]`` (`param`, whose spec was `spec` at the
    forward) from its local gradient `grad`: None where there is none, or where
    `_accumulate` did the work of `edge` (its AccumulateGrad; None: never), else the
    DTensor ``to_local``'s backward makes, scaled by the swap's scale."""
    if grad is None:
        return None
    if swap.scales is not None and swap.scales[i] != 1.0:
        grad = grad * swap.scales[i]  # (out of place: autograd may share the tensor)
    placements = swap.grad_placements[i]
    if (
        edge is not None
        and not swap.tied[i]  # (a tied parameter's gradients are summed by autograd first)
        and _accumulate(param, grad, spec, placements, swap.specs, edge, adds)
    ):
        return None
    return _as_dtensor(grad, spec, placements, swap.specs)


def _accumulate(param, grad: Tensor, spec, placements: tuple, specs: dict, node, adds) -> bool:
    """Do `node`'s (``param``'s AccumulateGrad's) work on the local tensors, where it is
    exactly what it would do with the DTensor `_as_dtensor` makes, and say whether it
    was done: a first gradient set, or the local tensors to add put in `adds` (the
    caller adds them before the nodes run). Then the node gets no gradient: it still
    runs, with its hooks and ``param``'s post-accumulate-grad hooks, which see
    ``param.grad`` as it would have left it. AccumulateGrad's DTensor ``detach`` or
    ``+=`` went through DTensor's dispatch: ~15-20 µs each on the host, ~3 µs here
    (docs/hot_path.md)."""
    if param._backward_hooks:
        return False  # tensor hooks see the DTensor first
    try:
        if not torch._C._will_engine_execute_node(node):
            return False  # (``backward(inputs=...)`` without this parameter)
    except RuntimeError:  # autograd.grad: the gradient is returned, not accumulated
        return False
    current = param.grad
    if current is None:  # AccumulateGrad steals a fresh gradient: ``.grad = new.detach()``
        local = param._local_tensor
        if (
            grad.shape != local.shape
            or grad.dtype != local.dtype
            or grad.stride() != local.stride()
        ):
            return False  # (it would check it or copy it to the parameter's layout)
        param.grad = _as_dtensor(grad, spec, placements, specs)
        return True
    held = current._spec if type(current) is DTensor else None
    if (
        held is None
        or held.mesh is not spec.mesh
        or (held.placements is not placements and held.placements != placements)
    ):
        return False  # (DTensor's ``+=`` redistributes the new one, or it is not a DTensor)
    local = current._local_tensor
    if local.shape != grad.shape:
        return False  # (the engine checks the shape before AccumulateGrad)
    adds[0].append(local)
    adds[1].append(grad)
    return True


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
        if kept.placements == placements:  # the same object: `_accumulate` compares by id
            kept.placements = placements
        hash(kept)  # kept in the spec (and in its copies): DTensor's dispatch hashes specs
        specs[key] = (spec, placements, kept)
        return made
    kept = entry[2]
    # A spec of its own per gradient, as DTensor's do (a spec can be changed in place).
    # ``__new__`` alone: ``__init__`` only marks the constructor for export's tracing, in a
    # wrapper that costs more than the DTensor (this is never traced: `local_views`).
    return DTensor.__new__(DTensor, grad.view_as(grad), _copy(kept), requires_grad=False)


def _copy(spec):
    """``copy.copy(spec)`` without the reduce protocol (1.7 -> 0.3 µs, this machine): the
    same new object and ``__dict__`` update."""
    if not hasattr(spec, "__dict__"):  # (a spec with slots: copy's own way)
        return copy.copy(spec)
    new = object.__new__(type(spec))
    new.__dict__.update(spec.__dict__)
    return new


def local_views(params: list, grad_placements: list, specs: dict, scales=None) -> list[Tensor]:
    """The local tensors of `params` (DTensors) for one forward, each the view
    ``p.to_local(grad_placements=g)`` returns, in one autograd node (the module doc);
    `specs` is the caller's cache of gradient specs (a dict kept per module); `scales`
    (None: all 1) multiply each gradient (experts over dp, `fusedpar.storage._place`)."""
    if torch.compiler.is_compiling():
        return _to_local(params, grad_placements, scales)
    return list(LocalSwap(params, grad_placements, specs, scales).views())


class LocalSwap:
    """`local_views` of fixed `params`, worked out once: `views()` each forward (a
    module's pre-hook keeps one while its parameters stay the same objects)."""

    # (weakly referenced from `_lent`, which must not keep a model's parameters alive)
    __slots__ = ("params", "grad_placements", "specs", "scales", "tied", "is_param", "plain")
    __slots__ += ("__weakref__",)

    def __init__(self, params, grad_placements, specs: dict, scales=None):
        self.params, self.grad_placements, self.specs = tuple(params), grad_placements, specs
        self.scales = None if scales is None or all(s == 1.0 for s in scales) else tuple(scales)
        self.tied = tuple(getattr(p, "_fusedpar_tied", False) for p in self.params)
        self.is_param = tuple(getattr(p, "_is_param", False) for p in self.params)
        self.plain = all(type(p) is DTensor for p in self.params)  # (else: to_local)

    def lend_to_op(self) -> None:
        """Register each parameter as this swap's, for `take_locals`: a module whose
        forward hands them straight to one op, which swaps them in its own node. Kept
        beside the parameters, not on them (a copy of the model, deepcopy or pickle,
        carries no stale mark: its module's swap is worked out again), and by their ids
        with a weak reference to this swap, none to them (``swap_tensors``, which
        ``model.to(dtype)`` uses, refuses a tensor that has one)."""
        keys = [id(param) for param in self.params]

        def dead(ref) -> None:  # this swap's entries, unless another swap took them since
            for key in keys:
                if _lent.get(key, (None,))[0] is ref:
                    del _lent[key]

        ref = weakref.ref(self, dead)
        for i, key in enumerate(keys):
            _lent[key] = (ref, i)  # (its parameters live as long as it does: ids kept)

    def views(self) -> tuple:
        if not self.plain or torch.compiler.is_compiling():
            if not torch.compiler.is_compiling():
                types = sorted({type(p).__name__ for p in self.params})
                _say_once(
                    f"fusedpar.distribute: a parameter is a subclass of DTensor "
                    f"({', '.join(types)}): its module's parameters take DTensor.to_local "
                    "one by one (~110 us a parameter a step more on the host than "
                    "fusedpar's one-node swap)"
                )
            return tuple(_to_local(self.params, self.grad_placements, self.scales))
        if torch._C._are_functorch_transforms_active():
            return _LocalViews.apply(self, *self.params)
        # ``Function.apply``'s own checks are for functorch (none active) and its dead
        # wrappers (a parameter is never one): ~2 µs a call, this machine
        return _apply_local_views(self, *self.params)


def _to_local(params, grad_placements, scales) -> list[Tensor]:
    views = [p.to_local(grad_placements=g) for p, g in zip(params, grad_placements, strict=True)]
    return [scale_grad(v, s) for v, s in zip(views, scales or [1.0] * len(views), strict=True)]


def take_locals(leaves) -> tuple[list, list]:
    """For an op's ``autograd.Function`` (`fusedpar.ops.registration`), given the
    DTensor parameters `lend_to_op` registered (`forward_params`): each one's local
    tensor in its place, a fresh alias asking for a gradient as the parameter does, and
    what `give_grads` needs. The op's node is then the swap's node too: its edges go to
    the parameters' AccumulateGrad."""
    leaves, taken, edge = list(leaves), [], -1
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor):  # (autograd's edges: one per tensor argument)
            edge += 1
            if type(leaf) is DTensor:
                local = leaf._local_tensor.detach()
                if leaf.requires_grad:  # (the op reads requires_grad off its inputs)
                    local.requires_grad_()
                taken.append((index, edge, leaf, leaf._spec, *_swap_of(leaf)))
                leaves[index] = local
    return leaves, taken


def give_grads(ctx, grads: list) -> None:
    """`take_locals`'s parameters' gradients in `grads` (the op's backward's, one per
    leaf) replaced, in place, by what autograd gets for each parameter (`_param_grad`);
    `ctx` is the op's node. A backward that builds a graph (``create_graph``) is
    refused: the op's backward computes on the aliases, so the parameters'
    second-order terms would be lost."""
    if torch.is_grad_enabled() and not _compiled_autograd():
        raise RuntimeError(
            "a backward with create_graph=True (a double backward) through a fusedpar layer "
            "whose one op takes its DTensor parameters (fusedpar.local_params.forward_params) "
            "would lose their second-order terms: give the layer fusedpar.distribute's hooks "
            "instead (a subclass with READS_FORWARD_PARAMS = False)"
        )
    edges, adds = _accumulating_edges(ctx), ([], [])
    for index, edge, param, spec, swap, i in ctx.taken:
        edge = None if edges is None else edges[edge][0]
        grads[index] = _param_grad(swap, i, param, spec, grads[index], edge, adds)
    if adds[0]:
        torch._foreach_add_(*adds)


def _swap_of(leaf: DTensor) -> tuple:
    """(LocalSwap, index) of a parameter `lend_to_op` registered, else TypeError."""
    found = _lent.get(id(leaf))
    swap = None if found is None else found[0]()
    if swap is None or swap.params[found[1]] is not leaf:
        raise TypeError(
            f"fusedpar's ops take local tensors, not a DTensor (shape {tuple(leaf.shape)}, "
            f"{leaf.placements}): pass .to_local(), or let fusedpar.distribute hand a "
            "layer its parameters"
        )
    return swap, found[1]


# id(parameter) -> (a weak reference to its LocalSwap, its index there): `lend_to_op`
_lent: dict[int, tuple] = {}


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(x: Tensor, scale: float) -> Tensor:
    """`x`, whose gradient is multiplied by `scale` in the backward (`x` itself at 1)."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


_said: set = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        warnings.warn(message, UserWarning, stacklevel=4)


# ``Function.apply`` past its Python layer (see `LocalSwap.views`)
_apply_local_views = torch._C._FunctionBase.__dict__["apply"].__get__(None, _LocalViews)


def _compiled_autograd() -> bool:
    """Inside a backward that compiled autograd runs (traced, or its graph's eager parts)."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")  # (loaded where it is on)
    return module is not None and module.in_compiled_autograd_region


# --- a module's swap: `fusedpar.distribute`'s hooks, or `forward_params` -----------------


def swap_in_locals(module, args):
    """Forward pre-hook: each DTensor parameter's local tensor in its place
    (`_local_views`), until `swap_back`."""
    (names, params), views = _local_views(module)
    table = module._parameters
    table.update(zip(names, views, strict=True))
    if torch.compiler.is_compiling() or "_fusedpar_cast" in module.__dict__:
        _cast_for_forward(module, table)
    module._fusedpar_saved.append((names, params))


def forward_params(module, one_op_input: Tensor | None = None) -> dict:
    """The parameters (name -> tensor) for this forward of a layer that reads them here
    (class attribute ``READS_FORWARD_PARAMS``: `distribute` gives it no swap hooks; a
    subclass overriding forward reads them here too, or sets it False). Before
    `distribute`, ``module._parameters``; after it, their local tensors (one autograd
    node, `_local_views`), or, where this call's forward hands every parameter straight
    to one fusedpar op whose input is `one_op_input` and that op runs in plain eager,
    the DTensor parameters themselves, registered for that op to swap in its own node
    (`fusedpar.ops.registration`, `take_locals`): ParallelSwiGLU's swap node and hooks
    cost ~35 µs a step on the host (docs/hot_path.md)."""
    table = module._parameters
    if not module.__dict__.get("_fusedpar_unhooked"):
        return table
    compiling = torch.compiler.is_compiling()
    cast = compiling or "_fusedpar_cast" in module.__dict__
    if (
        one_op_input is not None
        and not cast
        and not torch._C._len_torch_dispatch_stack()
        and not one_op_input.is_meta  # (the op runs as the custom op: `_op_wanted`)
        and not isinstance(one_op_input, FakeTensor)
        and _kept_swap(module).one_op
    ):
        return table
    (names, _), views = _local_views(module)
    params = {**table, **dict(zip(names, views, strict=True))}
    if cast:
        _cast_for_forward(module, params)
    return params


def _local_views(module) -> tuple[tuple, tuple]:
    """((names, parameters), local tensors): `module`'s DTensor parameters and their
    local tensors for one forward, in one autograd node (`LocalSwap`), as
    its kept `_Swap` says. While torch.compile traces, each through ``to_local`` (Dynamo
    of torch 2.11 traces neither ``id()`` of a mesh nor ``__dict__.setdefault``; the
    graph's cost is not the host's)."""
    if torch.compiler.is_compiling():
        names, params, grads, scales = [], [], [], []
        for name, placed in module._fusedpar_placed.items():
            param = module._parameters.get(name)
            if isinstance(param, DTensor):
                names.append(name)
                params.append(param)
                grads.append(placed.grad_on(param.device_mesh))
                scales.append(placed.grad_scale)
        return (names, params), _to_local(params, grads, scales)
    swap = _kept_swap(module)
    return swap.saved, (swap.locals.views() if swap.names else ())


def _kept_swap(module) -> "_Swap":
    """`module`'s `_Swap`, worked out again where it holds other parameter objects than
    the kept one's (FSDP2 swaps its own in and out), or where a copy of the module
    carried none (`_Swap.__reduce__`)."""
    table, swap = module._parameters, module.__dict__.get("_fusedpar_swap")
    if swap is None or not all(map(operator.is_, map(table.get, swap.placed), swap.held)):
        swap = module.__dict__["_fusedpar_swap"] = _Swap(module)
    return swap


class _Swap:
    """`module`'s swap while it holds the parameters `held` (those of `placed`, its
    names `distribute` placed): `names` go to their local tensors (`locals`, a
    `LocalSwap`) and back (`saved`: names, parameters); `one_op`: the DTensors may go
    to one op that swaps them (`forward_params`)."""

    __slots__ = ("placed", "held", "names", "locals", "saved", "one_op")

    def __init__(self, module):
        # (name, mesh id) -> (mesh, gradient placements), one object per pair: the
        # gradient specs (`LocalSwap`'s) are kept by its id
        kept, specs = module.__dict__.setdefault("_fusedpar_locals", ({}, {}))
        table, self.placed = module._parameters, tuple(module._fusedpar_placed)
        self.held = tuple(table.get(name) for name in self.placed)
        names, params, grads, scales = [], [], [], []
        for name, param in zip(self.placed, self.held, strict=True):
            if isinstance(param, DTensor):
                placed, mesh = module._fusedpar_placed[name], param.device_mesh
                held = kept.get((name, id(mesh)))  # (the mesh kept with it: its id stays its own)
                if held is None:
                    held = kept[name, id(mesh)] = (mesh, placed.grad_on(mesh))
                names.append(name)
                params.append(param)
                grads.append(held[1])
                scales.append(placed.grad_scale)
        self.names, self.saved = tuple(names), (tuple(names), tuple(params))
        self.locals = LocalSwap(params, grads, specs, scales)
        # a layer that reads them (`forward_params`); not a tied parameter: each
        # module's swap would register it as its own
        self.one_op = (
            module.__dict__.get("_fusedpar_unhooked", False)
            and self.locals.plain
            and not any(self.locals.tied)
        )
        if self.one_op:
            self.locals.lend_to_op()

    def __reduce__(self):  # a copy of the module (deepcopy, pickle) works its own out
        return (_no_swap, ())


def _no_swap() -> None:
    return None


def _cast_for_forward(module, params: dict) -> None:
    """The parameters `fusedpar.ParallelDims.fully_shard` left out of FSDP2 (experts over
    all of dp) in a mixed-precision policy's param_dtype for this forward, in `params`
    (name -> local tensor), as FSDP2 casts those it manages: ``_fusedpar_cast`` (name ->
    dtype). The cast's backward brings the gradient back to the parameter's dtype."""
    for name, dtype in getattr(module, "_fusedpar_cast", {}).items():
        local = params.get(name)
        if local is not None and local.dtype != dtype:
            params[name] = local.to(dtype)


def swap_back(module, args, output):
    """Forward hook (also on an exception): the DTensor parameters back."""
    if module._fusedpar_saved:  # empty if an earlier pre-hook raised before ours ran
        names, params = module._fusedpar_saved.pop()
        module._parameters.update(zip(names, params, strict=True))
