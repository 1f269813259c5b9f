"""DeepSeek-V3's auxiliary-loss-free balancing and the step's load per expert, for `MoE`.

Every `MoE` in training adds the tokens it routed to each expert (this rank's, the
forward's (token, slot) pairs before any capacity drop) to its step's count; after
``optimizer.step()``, `update_expert_bias(model)` sums every layer's count over the
ranks that routed the step's tokens in one all-reduce, moves each sigmoid router's
``expert_bias`` by ``bias_update_rate * sign(mean load - load_e)`` where the layer has a
rate, keeps the loads for `load_stats`, and starts the next step's count at zero.

The rule reads each layer's loads only through their signs against the mean, so a token
counted on every rank of a group that sees it whole (TP without sequence parallelism)
scales all loads alike and changes nothing. ``expert_bias`` is a persistent buffer: in
every checkpoint, out of the optimizer; the step's counts are not (a checkpoint is
written between steps, when they are zero).
"""

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


class LoadStats(NamedTuple):
    """One MoE layer's loads of the last updated step (`load_stats`)."""

    tokens_per_expert: torch.Tensor  # (E,) int64, summed over the update's group
    max_over_mean: torch.Tensor  # () float32: 1 is balanced (and a step with no tokens)


def check_rate(rate, score: str) -> None:
    """A ValueError unless `rate` is None, or positive and finite with a sigmoid router
    (the only one with an ``expert_bias``)."""
    if rate is None:
        return
    if score != "sigmoid":
        raise ValueError(
            f"bias_update_rate={rate} needs score='sigmoid' (its expert_bias is what "
            f"the update moves), got score={score!r}"
        )
    if not (isinstance(rate, (int, float)) and 0 < rate < float("inf")):
        raise ValueError(f"bias_update_rate must be a positive number, got {rate!r}")


def count_step_load(layer: nn.Module, ids: torch.Tensor, counts: torch.Tensor | None) -> None:
    """Add this forward's (token, slot) pairs per expert to `layer`'s step count: ids
    (T, k) the router's choices, counts (E,) the dispatch's where nothing was dropped
    (a training forward's, not a recompute's: the caller checks)."""
    if counts is None:  # the choices before the capacity's drops (what the bias steers);
        # index_add_, not bincount: bincount syncs with the host on a GPU
        load = ids.new_zeros(layer.num_experts, dtype=torch.int64)
        load.index_add_(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1), dtype=torch.int64))
    else:
        load = counts.detach().to(torch.int64)  # (E,)
    layer.step_load = load if layer.step_load is None else layer.step_load + load


def _moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The MoE layers of `model` (itself included), in module order: every rank that
    holds the same layers lists them alike, so their counts concatenate alike."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "bias_update_rate")]


_flattened: dict[int, tuple] = {}  # id(mesh) -> (mesh, its ranks as one group)


def _group_of(group):
    """The process group of `group`: None: the world when there is one (every rank holds
    every layer when there is no pipeline); a DeviceMesh: all its ranks (flattened once
    per mesh); a process group as it is."""
    if group is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.group.WORLD
        return None
    if isinstance(group, DeviceMesh):
        if group.ndim == 1:
            return group.get_group()
        cached = _flattened.get(id(group))
        if cached is None or cached[0] is not group:
            cached = _flattened[id(group)] = (group, group._flatten().get_group())
        return cached[1]
    return group


@torch.no_grad()
def update_expert_bias(model: nn.Module, group=None) -> None:
    """After ``optimizer.step()``: the step's loads of every MoE layer in `model`, summed
    over `group` in ONE all-reduce, move each sigmoid router's bias
    ``expert_bias += bias_update_rate * sign(mean(load) - load)`` (layers with a rate
    only), are kept for `load_stats` and reset.

    `group`: the ranks that routed the step's tokens through these same layers, a
    process group or a DeviceMesh (all its ranks); None: the world (every rank of dp x
    cp x tp when there is no pipeline). Under a pipeline the stages hold different
    layers: pass ``dims.stage_mesh(mesh)`` (the world would add other stages' loads).
    A layer that ran no forward this step counts zero. Every rank of `group` calls it."""
    layers = _moe_layers(model)
    if not layers:
        return
    device = layers[0][1].router_weight.device
    loads = []
    for _, layer in layers:  # (E,) each; zeros for a layer no forward reached
        step = layer.step_load
        loads.append(step if step is not None else torch.zeros(layer.num_experts, device=device))
    flat = torch.cat([t.to(device=device, dtype=torch.int64) for t in loads])  # (sum E,)
    group = _group_of(group)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)  # the one collective of the step
    sizes = [layer.num_experts for _, layer in layers]
    for (_, layer), load in zip(layers, flat.split(sizes), strict=True):
        layer.last_step_load, layer.step_load = load, None
        if layer.bias_update_rate is not None:
            mean = load.double().mean()
            step = layer.bias_update_rate * torch.sign(mean - load.double())
            layer.expert_bias.add_(step.to(layer.expert_bias.dtype))


def load_stats(model: nn.Module) -> dict[str, LoadStats]:
    """Per MoE layer (by its name in `model`) the tokens per expert of the last step that
    `update_expert_bias` summed, and max/mean; layers never updated are left out.
    Tensors, no host sync: ``.item()`` them where the step has synced anyway."""
    stats = {}
    for name, layer in _moe_layers(model):
        load = getattr(layer, "last_step_load", None)
        if load is None:
            continue
        mean = load.float().mean()
        ratio = torch.where(mean > 0, load.max().float() / mean.clamp_min(1e-30), 1.0)
        stats[name] = LoadStats(load, ratio)
    return stats
