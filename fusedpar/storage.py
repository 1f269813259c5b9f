"""Parameters stored as DTensors on the full mesh, computed on as local tensors.

    mesh = dims.build_mesh("cuda")          # axes ("dp", "cp", "tp")
    fp.distribute(model, mesh)              # every parameter -> a DTensor on that mesh
    dims.fully_shard(model, mesh)           # optional: FSDP2 over "dp"

PyTorch's tools (DCP, FSDP2, ``clip_grad_norm_``, foreach optimizers) need every
parameter a DTensor on one mesh, so `distribute` stores each as one and a forward
pre-hook (or the layer, `forward_params`) takes its local tensors (`fusedpar.local_params`),
declaring each gradient's placements:

| parameter (placements on (dp, cp, tp))      | gradient placements declared      |
| ------------------------------------------- | --------------------------------- |
| TP shard `q_weight`: (R, R, Shard(d))       | (Partial(avg), Partial, Shard(d)) |
| `MoE` experts, ep over tp: (R, R, Shard(0)) | (Partial(avg), Partial, Shard(0)) |
| whole (norm, embedding, router): (R, R, R)  | (Partial(avg), Partial, Partial)  |

dp averages, the token axes (`token_axes`) sum: FSDP2, or one collective per (partial
axes, dtype) at the end of the backward. Axes are read off the layers' groups
(`param_layouts`, `_place`), never their names; replaced parameters are `retire`d.
"""

import contextlib
import itertools
import math
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fusedpar import comm
from fusedpar.axes import DATA_AXES, TOKEN_AXES, mesh_axes_of, resolve_axes
from fusedpar.local_params import swap_back, swap_in_locals


@dataclass(frozen=True)
class ParamLayout:
    """How a layer holds one parameter: split along `dim` over `group` (``dim=None``:
    whole on every rank); `complete_over`, the groups over which the layer already
    makes the gradient complete (the group it is split over always counts); and
    `partial_over`, groups over which the gradient is a partial sum whatever the tokens
    (a per-head norm's weight, whole, applied to other heads on each TP rank)."""

    dim: int | None = None
    group: object = None
    complete_over: tuple = ()
    partial_over: tuple = ()


WHOLE = ParamLayout()
# Stock modules whose forward uses their children's parameters directly (the hooks swap
# each module's own parameters for its own forward): refused by name.
_READS_CHILD_PARAMETERS = (nn.MultiheadAttention,)


# Parameters replaced by new ones (`retire`): an optimizer built before the replacement
# holds the old ones, which the model no longer uses, and would train nothing with no
# error. id -> (weakref, what replaced it, its name); an entry leaves with its tensor.
_retired: dict[int, tuple] = {}
_retirements = 0  # bumped by each `retire`: an optimizer checked before is checked again
_checked = weakref.WeakKeyDictionary()  # optimizer -> the key it passed the check at
_hook = None  # the global optimizer step pre-hook, registered at the first `retire`


def retire(params: dict, by: str) -> None:
    """Mark the parameters of `params` (name -> Parameter) as replaced by `by` ("distribute",
    "parallelize", "fully_shard"): from then on an optimizer step over a param group that
    holds one raises ValueError ("build the optimizer after {by}"). Marking one again
    relabels it (parallelize calls distribute). Registers the check, a global optimizer
    step pre-hook, at the first call (never at import)."""
    global _retirements, _hook
    if not params:
        return
    for name, param in params.items():
        key = id(param)  # the callback runs when the tensor dies, before its id is reused
        _retired[key] = (weakref.ref(param, lambda _, key=key: _retired.pop(key, None)), by, name)
    _retirements += 1
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_refuse_retired)


def retire_replaced(model: nn.Module, before: dict, by: str) -> None:
    """`retire` each parameter of `before` (name -> Parameter, `model`'s earlier) that
    `model` no longer holds."""
    kept = {id(p) for p in model.parameters()}
    retire({name: p for name, p in before.items() if id(p) not in kept}, by)


def _refuse_retired(optimizer, args, kwargs) -> None:
    """Global optimizer step pre-hook: ValueError if `optimizer` holds a retired parameter.

    Its cost on every step of every optimizer: nothing while no retired parameter is
    alive (they die with the modules that held them, unless an optimizer built before
    keeps them: the case to catch); otherwise a dictionary lookup and the sizes of the
    param groups, the parameters themselves scanned only when the optimizer is new to
    the check, its groups changed size, or parameters were retired since it passed.
    Every rank built its optimizer the same way, so every rank raises at the same step
    (no collective). Skipped inside a compiled optimizer step (Dynamo would trace it)."""
    if not _retired or torch.compiler.is_compiling():
        return
    key = (_retirements, tuple(len(group["params"]) for group in optimizer.param_groups))
    if _checked.get(optimizer) == key:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            found = _retired.get(id(param))
            if found is not None and found[0]() is param:
                _, by, name = found
                raise ValueError(
                    f"{type(optimizer).__name__}.step: the optimizer holds {name}, a parameter "
                    f"that {by} replaced (the model holds a new one in its place, so this step "
                    f"would train nothing): build the optimizer after {by}"
                )
    _checked[optimizer] = key


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local tensor behind a DTensor (a view: writes reach the parameter); t else."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class _Placed:
    """A parameter's placements and the placements of its gradient from forward, by axis
    name, so either can be read off any mesh holding those axes (FSDP2 on torch < 2.12
    keeps the parameters on the mesh without dp). `grad_scale` multiplies the gradient
    from forward (`_place`)."""

    placements: dict
    grad_placements: dict
    grad_scale: float = 1.0  # experts over dp: 1 / the dp ranks of their EP group

    def grad_on(self, mesh: DeviceMesh) -> tuple:
        return tuple(self.grad_placements[name] for name in mesh.mesh_dim_names)


def _place(layout: ParamLayout, mesh: DeviceMesh, token_axes, axis_of: dict, where: str) -> _Placed:
    """`layout` on `mesh`; `axis_of` maps the mesh's axis names to fusedpar's (token and
    data axes are fusedpar's names); `where` names the parameter in errors.

    A parameter's reduction groups come from the layer that owns it, never from an axis's
    name: the mesh axes of the group it is split over and of the groups it is completed
    over or partial over (`mesh_axes_of` of `layout`'s groups). On each axis of more
    than one rank, the gradient from forward is, in this order:

    1. split there (`layout.group`): ``Shard(dim)``, complete (the layer's own
       collectives, the TP all-gather or the EP all-to-all, brought it every rank's
       tokens); `complete_over`: the parameter's own placement, likewise;
    2. `partial_over`: a partial sum, whatever the tokens;
    3. otherwise by the activations' layout: a token axis (`token_axes`, split tokens)
       sums; a data axis (`DATA_AXES`) averages, as FSDP2 does; any other axis holds the
       same gradient on each rank (``Replicate``).

    On a data axis of more than one rank, step 1 (experts over dp: their all-to-all
    brings each expert every dp rank's tokens of its EP group) makes a gradient that
    sums those ranks' batches, where data parallelism averages them: `grad_scale`
    divides it by their count, and the dp ranks outside the EP group (where the
    parameter is whole) average as step 3 says, so it ends the average over all of dp.
    Step 2 there is refused (ValueError). The verdict reads only the layer's groups
    and the mesh: the same on every rank whose layer holds a group of the same axes,
    as a collective over that group needs of its members."""
    split = mesh_axes_of(layout.group, mesh) if layout.dim is not None else ()
    complete, partial = set(split), set()
    for group in layout.complete_over:
        complete.update(mesh_axes_of(group, mesh))
    for group in layout.partial_over:
        partial.update(mesh_axes_of(group, mesh))
    scale = 1.0
    for i, name in enumerate(mesh.mesh_dim_names):  # (mesh_axes_of leaves out axes of one rank)
        if axis_of[name] not in DATA_AXES:
            continue
        if name in partial:
            raise ValueError(
                f"distribute: {where} is declared partial over the mesh's data-parallel "
                f"axis {name!r} ({mesh.size(i)} ranks) by its layer's groups: data "
                "parallelism averages every parameter's gradient there"
            )
        if name in complete:
            scale /= mesh.size(i)
    placements, grads = {}, {}
    for i, name in enumerate(mesh.mesh_dim_names):
        placements[name] = Shard(layout.dim) if name in split else Replicate()
        # No Partial on an axis of one rank: nothing to reduce, and torch 2.11 to 2.13
        # get (Partial(avg) on a 1-rank dp, Partial(sum) on cp and tp) -> Replicate wrong
        # where "cp_tp" is flattened: it averages over cp and tp.
        if name in complete or mesh.size(i) == 1:
            grads[name] = placements[name]
        elif axis_of[name] in token_axes or name in partial:
            grads[name] = Partial("sum")
        elif axis_of[name] in DATA_AXES:
            grads[name] = Partial("avg")
        else:
            grads[name] = Replicate()
    return _Placed(placements, grads, scale)


_deferred = 0  # > 0: inside `deferred_grad_reduction`
_pending: dict[int, nn.Parameter] = {}  # partial gradients this backward, reduced at its end
_order = itertools.count()  # `distribute`'s parameter order, kept on each parameter


def _needs_reduction(param) -> bool:
    grad = param.grad
    return isinstance(grad, DTensor) and grad.placements != param.placements


def reduce_grad(param: DTensor) -> None:
    """Post-accumulate-grad hook of the parameters whose gradient from forward is partial
    on some axis (`_place`; the others' never is: a hook each would cost ~2 µs a step for
    nothing): a partial gradient waits for the end of this backward,
    when `_reduce_grads` sums (or averages) every waiting one to its parameter's
    placements in a few collectives, as FSDP2 does before its reduce-scatter. Where the
    ranks' backwards may accumulate different parameters (`deferred_grad_reduction`),
    the sums wait for the end of the step."""
    global _queued_for
    if _deferred or not _needs_reduction(param):
        return
    _pending[id(param)] = param
    task = torch._C._current_graph_task_id()
    if task != _queued_for:  # the first of this backward: reduce them all when it ends
        _queued_for = task  # (one that raised before its end leaves its own to the next)
        torch.autograd.Variable._execution_engine.queue_callback(_reduce_pending)


_queued_for = -1  # the backward (autograd graph task) whose end reduces `_pending`


def _reduce_pending() -> None:
    global _queued_for
    params = list(_pending.values())
    _pending.clear()
    _queued_for = -1
    _reduce_grads(params)


def _reduce_grads(params) -> None:
    """Reduce the partial gradients of `params` to their parameters' placements, bucketed:
    one collective per (mesh, partial axes, dtype) for all of them, not one per parameter.
    Each bucket concatenates the local gradients (in `distribute`'s parameter order, the
    same on every rank: the collectives pair up) and is reduced as one DTensor (the same
    collective DTensor runs for each parameter alone: a sum, or an average over dp, over
    the flattened partial axes); each gradient becomes its part of the result, with its
    parameter's placements."""
    buckets: dict[tuple, list] = {}
    seen = set()
    # (sorted is stable: parameters without an order keep the order they come in)
    for param in sorted(params, key=lambda p: getattr(p, "_fusedpar_order", math.inf)):
        if id(param) in seen or not _needs_reduction(param):
            continue
        seen.add(id(param))
        grad = param.grad
        partial = tuple(p if p.is_partial() else Replicate() for p in grad.placements)
        key = (id(grad.device_mesh), partial, grad.dtype, grad.device)
        buckets.setdefault(key, []).append(param)
    with torch.no_grad():
        for (_, partial, _, _), bucket in buckets.items():
            mesh = bucket[0].grad.device_mesh
            locals_ = [p.grad.to_local() for p in bucket]
            flat = torch.cat([t.reshape(-1) for t in locals_])
            flat = DTensor.from_local(flat, mesh, partial, run_check=False)
            flat = flat.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
            parts = flat.split([t.numel() for t in locals_])
            for param, local, part in zip(bucket, locals_, parts, strict=True):
                # the sums are views of the bucket: no copy back, and no write into a
                # gradient the autograd graph may share
                part = part.view(local.shape)
                param.grad = DTensor.from_local(part, mesh, param.placements, run_check=False)


@contextlib.contextmanager
def deferred_grad_reduction(module: nn.Module):
    """Leave the gradients of `module`'s parameters partial (summed over every backward
    inside) and reduce them on leaving, bucketed, in `module`'s parameter order.

    For runtimes whose backwards accumulate parameters in an order that differs from rank
    to rank: the zero-bubble pipeline schedules compute weight gradients in a pass of
    their own, whose accumulation order is not the graph's, so the ranks of a TP or CP
    group would pair one parameter's all-reduce with another's (measured: DualPipeV at
    PP2 x CP2, q and k weights 3e-3 off, same shapes, no error). Also fewer collectives:
    a few per step instead of a few per microbatch."""
    global _deferred
    _deferred += 1
    try:
        yield
    finally:
        _deferred -= 1
    if not _deferred:
        _reduce_grads(list(module.parameters()))


def _check_token_axes(model: nn.Module, mesh: DeviceMesh, token_axes, axis_of: dict) -> None:
    """A fusedpar TP layer's sequence parallelism says whether the tokens between layers
    are split over its axis, and CP groups (ring and Ulysses) always split them:
    `token_axes` (fusedpar's names; `axis_of` maps the mesh's to them) must agree."""

    def axes_of(group):
        return tuple(axis_of[name] for name in mesh_axes_of(group, mesh))

    for name, module in model.named_modules():
        cp_axes = axes_of(getattr(module, "cp_group", None))
        cp_axes += axes_of(getattr(module, "ulysses_group", None))
        if hasattr(module, "param_layouts") and any(a not in token_axes for a in cp_axes):
            what = name or type(module).__name__
            raise ValueError(
                f"{what} splits the sequence over {cp_axes}, but "
                f"token_axes={tuple(token_axes)} leaves it out"
            )
        sequence_parallel = getattr(module, "sequence_parallel", None)
        if not hasattr(module, "param_layouts") or sequence_parallel is None:
            continue
        group = getattr(module, "group", getattr(module, "tp_group", None))
        axes = axes_of(group)
        if axes and sequence_parallel != all(axis in token_axes for axis in axes):
            raise ValueError(
                f"{name or type(module).__name__} runs with sequence_parallel="
                f"{sequence_parallel} over {axes}, but token_axes={tuple(token_axes)} says "
                f"the tokens between layers are {'not ' if sequence_parallel else ''}split "
                f"there: pass the axes the activations are split over"
            )


def _check_group_axes(model: nn.Module, mesh: DeviceMesh, axis_of: dict) -> None:
    """Each group a fusedpar layer holds is the mesh axis its name claims (``GROUP_AXES``:
    ``tp_group`` on "tp", ...; `axis_of` maps the mesh's names to fusedpar's): groups
    passed swapped, or built by hand in another order, would compute a different model
    with no error."""
    for name, module in model.named_modules():
        for attr, claimed in getattr(module, "GROUP_AXES", {}).items():
            names = mesh_axes_of(getattr(module, attr, None), mesh)
            axes = tuple(axis_of[n] for n in names)
            if axes and axes != claimed:
                what = f"{name or type(module).__name__}.{attr}"
                shown = "x".join(names) + (f" ({'x'.join(axes)})" if axes != names else "")
                raise ValueError(
                    f"{what} is the mesh's {shown} axis, not "
                    f"{'x'.join(claimed)}: groups passed in the wrong places "
                    f"(tp for cp?) or from another mesh; take them from "
                    f"dims.groups(mesh)"
                )


def _check_replicas(plan, mesh: DeviceMesh) -> None:
    """Each parameter equal on the ranks that hold it whole or hold the same shard (its
    Replicate axes): one all-gather of a fingerprint per parameter, and the same
    ValueError on every rank naming the first that differ (ranks seeded differently
    before building the model, or loading different weights)."""
    seen, names, prints = set(), [], []
    for owner, module, placed in plan:
        for name, where in placed.items():
            param = module._parameters[name]
            if id(param) in seen or param.device.type == "meta":
                continue
            seen.add(id(param))
            names.append((f"{owner}.{name}" if owner else name, where))
            prints.append(comm.fingerprint(param).to(mesh.device_type))
    if not prints or mesh.size() == 1:
        return
    table = comm.mesh_table(torch.stack(prints), mesh)  # (*mesh.shape, P, 3)
    for axis, axis_name in enumerate(mesh.mesh_dim_names):
        if mesh.size(axis) == 1:
            continue
        differ = (table.amax(axis) != table.amin(axis)).any(-1)  # (*other axes, P)
        differ = differ.flatten(0, -2).any(0) if differ.dim() > 1 else differ
        bad = [
            name
            for (name, where), d in zip(names, differ.tolist(), strict=True)
            if d and isinstance(where.placements[axis_name], Replicate)
        ]
        if bad:
            listed = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
            raise ValueError(
                f"distribute: {listed} differ across the ranks of mesh axis "
                f"{axis_name!r}, which must hold them equal: build the model "
                "from the same seed on every rank (torch.manual_seed before "
                "building it) or load the same weights everywhere"
            )


_warned_undistributed = False


def warn_if_undistributed(module: nn.Module, *groups) -> bool:
    """Once per process: a fusedpar layer over more than one rank trains (grad enabled)
    without `distribute`, so the gradients of its whole parameters, and of shards used
    on split tokens, stay this rank's partial sums (code that sums them by hand is
    fine: this only warns). Called at a layer's first calls (`fusedpar.checks`), never
    in traced code. Returns whether `module` is settled (warned, distributed, on groups
    of one, or the warning given already); False while grad is off, to ask again."""
    global _warned_undistributed
    if _warned_undistributed or hasattr(module, "_fusedpar_placed"):
        return True
    if all(comm.group_size(g) == 1 for g in groups):
        return True
    if not torch.is_grad_enabled():
        return False
    _warned_undistributed = True
    warnings.warn(
        f"{type(module).__name__} runs over more than one rank, but its model was "
        "not passed to fusedpar.distribute(model, mesh): the gradients of whole "
        "parameters (norms, embeddings, a row bias) and of shards that saw only "
        "this rank's tokens stay partial sums unless you reduce them yourself",
        UserWarning,
        stacklevel=6,
    )
    return True


def distribute(
    model: nn.Module, mesh: DeviceMesh, *, token_axes=None, check_replicas: bool = True, names=None
) -> nn.Module:
    """Store every parameter of `model` as a DTensor on `mesh`, in place; returns `model`.

    `mesh` is the full mesh (``ParallelDims.build_mesh``), with named axes: fusedpar's
    names, or others mapped to them by `names` (``dims.names``; a name neither raises
    ValueError, `fusedpar.parallel.resolve_axes`). fusedpar layers place their
    parameters as ``param_layouts()`` says; every other parameter is whole
    (``Replicate`` on every axis). `token_axes` are the axes (fusedpar's names) the
    activations between layers are split over (default: those of cp, ulysses and tp the
    mesh has, as fusedpar's sequence-parallel layers and context parallelism split them); a layer
    whose ``sequence_parallel`` disagrees
    raises ValueError, and so does a layer whose groups are not the mesh axes they
    claim (`tp_group` on "tp", `cp_group` on "cp": swapped groups). Call it after
    moving the model to its device, before FSDP2 and before building the optimizer.

    Every parameter must be equal on the ranks that hold it whole or hold the same
    shard, as it is when every rank builds the model from the same seed:
    ``check_replicas`` (default) checks it with one all-gather of a fingerprint per
    parameter and raises ValueError on every rank naming those that differ. Every
    check runs before any parameter changes. A parameter that a layer splits, completes
    or declares partial over the data-parallel axis (dp of more than one rank: experts
    over dp) raises ValueError on every rank, naming the layout to use (`_place`).

    The plain parameters it replaces are retired (`retire`): an optimizer built before
    ``distribute`` raises at its first step, on every rank ("build the optimizer after
    distribute"), where it would train nothing.
    """
    if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names is None:
        raise TypeError("distribute needs a DeviceMesh with named axes (ParallelDims.build_mesh)")
    axis_of = {name: axis for axis, name in resolve_axes(mesh, names).items()}
    present = tuple(axis_of.values())
    if token_axes is None:
        token_axes = tuple(axis for axis in TOKEN_AXES if axis in present)
    unknown = [axis for axis in token_axes if axis not in present]
    if unknown:
        raise ValueError(
            f"token_axes {unknown} are not axes of the mesh {mesh.mesh_dim_names} "
            f"(fusedpar's names: {present})"
        )
    _check_token_axes(model, mesh, token_axes, axis_of)
    _check_group_axes(model, mesh, axis_of)
    plan = []  # (owner, module, {name: _Placed}): every check passes before anything changes
    for owner, module in model.named_modules():
        if type(module) in _READS_CHILD_PARAMETERS:
            raise ValueError(
                f"{owner or 'the model'} is an nn.{type(module).__name__}, whose "
                "forward reads its children's parameters: distribute swaps a "
                "module's own parameters for its forward only"
            )
        declared = hasattr(module, "param_layouts")
        layouts = module.param_layouts() if declared else {}
        placed = {}
        for name, param in module._parameters.items():
            where = f"{owner}.{name}" if owner else name
            if isinstance(param, DTensor):
                raise ValueError(f"{where} is already a DTensor: distribute a model once")
            if param is not None and declared and name not in layouts:
                raise ValueError(f"{where} is not in {type(module).__name__}.param_layouts()")
            if param is not None:
                layout, what = layouts.get(name, WHOLE), f"{where} ({type(module).__name__})"
                placed[name] = _place(layout, mesh, token_axes, axis_of, what)
        if placed:
            plan.append((owner, module, placed))
    if check_replicas:
        _check_replicas(plan, mesh)
    done: dict[int, nn.Parameter] = {}  # a tied parameter becomes one DTensor parameter
    partial: dict[int, nn.Parameter] = {}  # those whose gradient from forward is partial
    replaced = {}  # name -> the plain parameter, retired: an optimizer built before fails
    for owner, module, placed in plan:
        for name, where in placed.items():
            param = module._parameters[name]
            if id(param) not in done:
                replaced[f"{owner}.{name}" if owner else name] = param
                placements = tuple(where.placements.values())
                tensor = DTensor.from_local(param.detach(), mesh, placements, run_check=False)
                new = nn.Parameter(tensor, requires_grad=param.requires_grad)
                new._fusedpar_order = next(_order)
                done[id(param)] = new
            else:  # tied: its gradients from two modules are summed first, by autograd
                done[id(param)]._fusedpar_tied = True  # (`fusedpar.local_params`)
            module._parameters[name] = done[id(param)]
            if where.grad_placements != where.placements:  # partial: reduced (`reduce_grad`)
                partial[id(param)] = done[id(param)]
        module._fusedpar_placed = placed
        if getattr(type(module), "READS_FORWARD_PARAMS", False):
            module._fusedpar_unhooked = True  # its forward reads them (`forward_params`)
        else:
            module._fusedpar_saved = []
            module.register_forward_pre_hook(swap_in_locals)
            module.register_forward_hook(swap_back, always_call=True)
    for param in partial.values():  # a frozen one too: it may be unfrozen later
        frozen = not param.requires_grad
        param.requires_grad_(True)  # (torch hooks only a tensor that requires grad)
        param.register_post_accumulate_grad_hook(reduce_grad)
        param.requires_grad_(not frozen)
    retire(replaced, "distribute")
    return model
