"""`clip_grad_norm_`: torch's, for parameters that live on more than one mesh.

    loss.backward()
    fp.clip_grad_norm_(model.parameters(), 1.0)  # the total norm, every rank the same
    optimizer.step()

``torch.nn.utils.clip_grad_norm_`` stacks the gradients' norms, which DTensor refuses
across meshes ("All operands in aten.stack.default must have the same mesh"). FSDP2
leaves a model's parameters on two where experts take part of dp (the dense ones on
its flattened dp mesh, each `MoE` on the full mesh) and on torch 2.11's path with
experts over dp (the experts on the full mesh, the rest without dp). This takes each
mesh's norm with torch's ``get_total_norm`` (reduced over that mesh), combines them,
and scales each mesh's gradients with torch's ``clip_grads_with_norm_``, as torchtitan
clips with EP. Gradients on one mesh (or plain tensors): torch's own, called as is.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grad_norm_ as torch_clip_grad_norm_
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over `parameters` whose gradients may be
    DTensors on several meshes (the module doc). Returns the total norm: a plain
    tensor, the same on every rank (torch's own returns a DTensor on one mesh)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    by_mesh: dict = {}  # the mesh's id (None: plain tensors) -> the parameters
    for p in params:
        if p.grad is not None:
            key = id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(p)
    if len(by_mesh) <= 1:
        total = torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        return total.full_tensor() if isinstance(total, DTensor) else total
    norms = []
    for group in by_mesh.values():
        norm = get_total_norm([p.grad for p in group], norm_type, error_if_nonfinite)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device
    norms = torch.stack([n.to(device) for n in norms])
    if norm_type == float("inf"):
        total = norms.max()
    else:
        total = norms.pow(norm_type).sum().pow(1.0 / norm_type)
    for group in by_mesh.values():
        clip_grads_with_norm_(group, max_norm, total)
    return total
