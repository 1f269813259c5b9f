"""A layer whose forward is one op (`ParallelSwiGLU` on one rank) after `fp.distribute`
has no swap hooks: it reads its parameters through `fusedpar.local_params.forward_params`, and
its op swaps the DTensors in its own autograd node (`fusedpar.local_params.take_locals`).
The gradients, and the hooks autograd calls, are the swap hooks' path's bit for bit:
accumulating twice, after ``zero_grad``, ``autograd.grad``, ``backward(inputs=...)``, a
tensor hook, a hook on the AccumulateGrad node, post-accumulate-grad hooks, under a
dispatch mode, compiled, and under FSDP2 with AdamW steps."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import fusedpar as fp
from fusedpar.ops.mlp import gated_mlp

D, HIDDEN = 8, 12


class _Hooked(fp.nn.ParallelSwiGLU):
    READS_FORWARD_PARAMS = False  # the swap hooks' path, to compare with


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _build(mlp_class, fsdp: bool):
    dims = fp.ParallelDims(dp=2)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.RMSNorm(D), mlp_class(D, HIDDEN, bias=True))
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)  # (never ones: a dropped weight would hide)
    fp.distribute(model, mesh)
    if fsdp:
        dims.fully_shard(model, mesh)
    return model


def _local_grads(model) -> dict:
    return {n: p.grad.to_local().clone() for n, p in model.named_parameters()}


def _trace(model, x):
    """The gradients and the hook calls of the backwards the module doc lists."""
    params, seen, grads = dict(model.named_parameters()), [], {}

    def loss():
        return model(x).square().sum()

    loss().backward()
    loss().backward()
    grads["twice"] = _local_grads(model)
    model.zero_grad()
    got = torch.autograd.grad(loss(), list(params.values()))
    assert all(p.grad is None for p in params.values())  # returned, not accumulated
    grads["autograd.grad"] = {n: g.to_local() for n, g in zip(params, got, strict=True)}
    loss().backward(inputs=[params["1.down_weight"]])
    assert [n for n, p in params.items() if p.grad is not None] == ["1.down_weight"]
    grads["inputs="] = {"1.down_weight": params["1.down_weight"].grad.to_local().clone()}
    model.zero_grad()
    params["1.up_weight"].register_hook(lambda g: g * 3)
    node = params["1.gate_weight"].view_as(params["1.gate_weight"]).grad_fn.next_functions[0][0]
    node.register_hook(lambda *_: seen.append(("node", "1.gate_weight", None)))
    for n, p in params.items():
        p.register_post_accumulate_grad_hook(
            lambda p, n=n: seen.append(("post", n, p.grad.to_local().sum().item()))
        )
    loss().backward()
    grads["hooked"] = _local_grads(model)
    model.zero_grad()
    with _Passthrough():  # a dispatch mode: the op runs as the custom op, on local tensors
        loss().backward()
    grads["dispatch mode"] = _local_grads(model)
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(x).square().sum().backward()
    grads["compiled"] = _local_grads(model)
    torch._dynamo.reset()
    for p in params.values():
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements
    return grads, seen


def _run_one_op_is_the_hooks_path():
    ours, theirs = _build(fp.nn.ParallelSwiGLU, False), _build(_Hooked, False)
    assert not ours[1]._forward_pre_hooks and theirs[1]._forward_pre_hooks
    x = torch.randn(5, 1, D, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    # the op's node takes the DTensor parameters: no swap node between
    y = ours[1](x)
    edges = {type(node).__name__ for node, _ in y.grad_fn.next_functions if node is not None}
    assert "AccumulateGrad" in edges and not any("LocalViews" in e for e in edges), edges
    got, want = _trace(ours, x), _trace(theirs, x)
    assert got[1] == want[1] and len(got[1]) == 3 * 8, (got[1], want[1])  # (3 backwards)
    for case, grads in want[0].items():
        for name, grad in grads.items():
            assert torch.equal(got[0][case][name], grad), (case, name)
    # a DTensor that distribute did not hand to the op: refused, naming the fix
    weight = ours[1].gate_weight
    with pytest.raises(TypeError, match=r"pass \.to_local\(\)"):
        gated_mlp(x, weight.detach(), weight, weight, activation="silu")
    return True


def test_a_one_op_layer_swaps_in_its_op_as_the_hooks_did(world):
    assert world(2).run(_run_one_op_is_the_hooks_path) == [True] * 2


def _run_under_fsdp():
    """FSDP2 over dp 2 (its unsharded parameters swapped in each forward): two AdamW steps
    of the one-op path equal the hooks' path bit for bit."""
    results = []
    for mlp_class in (fp.nn.ParallelSwiGLU, _Hooked):
        model = _build(mlp_class, True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        x = torch.randn(6, 1, D, generator=torch.Generator().manual_seed(7))
        losses = []
        for _ in range(2):
            loss = model(x).square().sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        results.append([*losses, *(p.to_local().detach() for p in model.parameters())])
    return all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_a_one_op_layer_under_fsdp2_trains_as_the_hooks_did(world):
    assert world(2).run(_run_under_fsdp) == [True] * 2
