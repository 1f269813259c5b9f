"""Loss-free balancing (`fusedpar.nn.moe_balance`): the bias update against a plain loop
over steps, loads summed over the ranks in one all-reduce, microbatches counted, the
bias through a checkpoint, `load_stats`, refusals."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fusedpar as fp
from fusedpar.testing import Collectives, HostSyncs

RATE, STEPS, MICRO, D = 0.05, 3, 2, 8
# (num_experts, top_k, score, bias_update_rate); the softmax layer is counted, not moved
LAYERS = ((4, 2, "sigmoid", RATE), (6, 1, "softmax", None), (5, 2, "sigmoid", 2 * RATE))


def _model(ep: bool) -> nn.ModuleList:
    """The three layers, the same on every rank (seeded); the first over the world as EP."""
    torch.manual_seed(0)
    group = dist.group.WORLD if ep and dist.is_initialized() else None
    return nn.ModuleList(
        fp.nn.MoE(
            D, 6, E, k, group if i == 0 else None, score=score, bias_update_rate=rate
        ).double()
        for i, (E, k, score, rate) in enumerate(LAYERS)
    )


def _inputs(step: int, rank: int, layer: int, micro: int) -> torch.Tensor:
    """A microbatch's tokens for one layer: (3 + rank + micro, D), its own seed."""
    gen = torch.Generator().manual_seed(1000 * step + 100 * rank + 10 * layer + micro)
    return torch.randn(3 + rank + micro, D, generator=gen, dtype=torch.float64)


def _step(model, step: int, rank: int) -> None:
    """Two microbatches' forwards and backwards (no optimizer: only the bias moves)."""
    for micro in range(MICRO):
        for i, layer in enumerate(model):
            y, aux = layer(_inputs(step, rank, i, micro))
            (y.sum() + aux).backward()


def _reference(model, world: int, steps: int):
    """A plain loop: per step and layer, every rank's microbatches' top-k choices counted
    (sigmoid scores plus the bias pick, softmax scores alone), then b_e += u sign(mean -
    load_e). The biases after `steps` and the last step's loads, float64."""
    weights = [layer.router_weight.detach().double() for layer in model]
    biases = [torch.zeros(E, dtype=torch.float64) for E, *_ in LAYERS]
    loads = []
    for step in range(steps):
        loads = [torch.zeros(E, dtype=torch.float64) for E, *_ in LAYERS]
        for rank in range(world):
            for micro in range(MICRO):
                for i, (_, k, score, _) in enumerate(LAYERS):
                    logits = _inputs(step, rank, i, micro) @ weights[i].T
                    if score == "sigmoid":
                        pick = torch.sigmoid(logits) + biases[i]
                    else:
                        pick = torch.softmax(logits, -1)
                    for e in pick.topk(k, dim=-1).indices.flatten().tolist():
                        loads[i][e] += 1
        for i, (E, _, _, rate) in enumerate(LAYERS):
            if rate is None:
                continue
            mean = sum(loads[i].tolist()) / E
            for e in range(E):
                load = loads[i][e].item()
                biases[i][e] += rate * ((mean > load) - (mean < load))
    return biases, loads


def _run_steps(ep: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(ep)
    # at 4 ranks the group given as a 2 x 2 DeviceMesh (taken whole); at 2 the default
    group = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b")) if world == 4 else None
    for step in range(STEPS):
        with Collectives() as seen:
            _step(model, step, rank)
            fp.nn.moe.update_expert_bias(model, group)
        # the forwards' dispatch exchanges aside, one all-reduce for every layer's loads
        assert seen.counts[("all_reduce", world)] == 1, seen.counts
        assert all(layer.step_load is None for layer in model)  # reset
    biases, loads = _reference(model, world, STEPS)
    for layer, bias in zip(model, biases, strict=True):
        if layer.expert_bias is not None:
            torch.testing.assert_close(layer.expert_bias.double(), bias, rtol=0, atol=1e-6)
    stats = fp.nn.moe.load_stats(model)
    assert list(stats) == ["0", "1", "2"]
    for (_, s), load in zip(stats.items(), loads, strict=True):
        assert s.tokens_per_expert.tolist() == load.long().tolist()
        assert s.max_over_mean.item() == pytest.approx((load.max() / load.mean()).item())
    return True


@pytest.mark.parametrize("size, ep", [(2, False), (4, True)])
def test_bias_follows_the_reference_loop(world, size, ep):
    """Loads summed over 2 or 4 ranks of different token counts (EP over the world for
    the first layer at 4, the group a 2 x 2 mesh), two microbatches a step, three steps."""
    assert all(world(size).run(_run_steps, ep))


def _run_resume(path: str):
    rank = dist.get_rank()
    whole = _model(ep=False)
    for step in range(STEPS):
        _step(whole, step, rank)
        fp.nn.moe.update_expert_bias(whole)
    first = _model(ep=False)
    for step in range(STEPS - 1):
        _step(first, step, rank)
        fp.nn.moe.update_expert_bias(first)
    fp.checkpoint.save(path, first)
    resumed = _model(ep=False)  # a fresh process's model: zero biases
    fp.checkpoint.load(path, resumed)
    _step(resumed, STEPS - 1, rank)
    fp.nn.moe.update_expert_bias(resumed)
    for a, b in zip(whole, resumed, strict=True):
        if a.expert_bias is not None:
            assert torch.equal(a.expert_bias, b.expert_bias)
            assert b.expert_bias.abs().sum() > 0  # it moved
    return True


def test_a_resumed_run_continues_the_bias_trajectory(world, tmp_path):
    assert all(world(2).run(_run_resume, str(tmp_path / "ckpt")))


def test_eval_forwards_and_recomputes_count_nothing():
    layer = fp.nn.MoE(D, 6, 4, 2, score="sigmoid", bias_update_rate=RATE).double()
    x = torch.randn(7, D, dtype=torch.float64)
    layer.eval()
    layer(x)
    assert layer.step_load is None
    layer.train()
    fp.nn.moe.update_expert_bias(layer)  # a step without tokens: zero loads, no move
    assert torch.equal(layer.expert_bias, torch.zeros(4))
    assert fp.nn.moe.load_stats(layer)[""].max_over_mean.item() == 1.0
    checkpointed = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    checkpointed[0].sum().backward()  # its recompute counts nothing again
    assert layer.step_load.sum().item() == 7 * 2


def test_capacity_drops_still_count_the_choice():
    """With a capacity factor the load is the router's choice, before the drops."""
    layer = fp.nn.MoE(
        D, 6, 4, 2, score="sigmoid", bias_update_rate=RATE, capacity_factor=0.5
    ).double()
    layer(torch.randn(9, D, dtype=torch.float64))
    assert layer.step_load.sum().item() == 9 * 2
    assert layer.last_stats["tokens_per_expert"].sum().item() < 9 * 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bias_update_rate": 0.001}, "needs score='sigmoid'.*got score='softmax'"),
        ({"score": "sigmoid", "bias_update_rate": 0.0}, "positive number, got 0.0"),
        ({"score": "sigmoid", "bias_update_rate": float("nan")}, "positive number"),
    ],
)
def test_bad_rates_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fp.nn.MoE(D, 6, 4, 2, **kwargs)
    with pytest.raises(ValueError, match=match):
        fp.nn.MoESpec(D, 6, 4, 2, **kwargs)


def test_the_spec_builds_the_same_layer():
    spec = fp.nn.MoESpec(D, 6, 4, 2, score="sigmoid", bias_update_rate=RATE)
    assert fp.nn.MoE.from_spec(spec).bias_update_rate == RATE


def test_no_host_sync_and_no_gradient_touched():
    """Counting (with a capacity: the choices' scatter-add) and the update read nothing
    back to the host; the update leaves every gradient as it was, and the bias is no
    parameter (the optimizer never sees it)."""
    layer = fp.nn.MoE(D, 6, 4, 2, score="sigmoid", bias_update_rate=RATE, capacity_factor=1.0)
    with HostSyncs() as syncs:
        y, aux = layer(torch.randn(6, D))
        fp.nn.moe.update_expert_bias(layer)
    assert syncs.found == []
    (y.sum() + aux).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer(torch.randn(6, D))
    fp.nn.moe.update_expert_bias(layer)
    assert all(torch.equal(p.grad, grads[n]) for n, p in layer.named_parameters())
    assert "expert_bias" not in dict(layer.named_parameters())
    assert "expert_bias" in layer.state_dict() and "step_load" not in layer.state_dict()
