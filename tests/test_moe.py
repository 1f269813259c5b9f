"""fp.nn.MoE against a naive float64 loop over tokens and experts, at W = 1, 2 and 4.

Every rank builds the full router and expert stacks and every rank's tokens from the
seed, runs its share, and checks y, the aux loss and the gradients of x, of its experts
and (summed over ranks, as data parallelism would) of the router.
"""

import re

import pytest
import torch
import torch.distributed as dist
from fusedpar.kernels.moe import (
    combine,
    dispatch_metadata,
    gather_rows,
    grouped_matmul,
    grouped_matmul_reference,
    grouped_weight_grad,
)
from hypothesis import example, given
from hypothesis import strategies as st

import fusedpar as fp
from fusedpar.ops.moe import moe_reference
from fusedpar.testing import WorldError, assert_close
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds


def _group():
    return dist.group.WORLD if dist.get_world_size() > 1 else None


def _problem(p, size):
    """Full float64 stacks, and each rank's tokens and upstream gradient."""
    E, d, h, seed, skew = p["E"], p["d"], p["h"], p["seed"], p["skew"]
    router = randn((E, d), torch.float64, seed)
    router[0] += skew  # with x shifted by skew too, expert 0 draws the tokens
    w1, w3 = randn((E, h, d), torch.float64, seed + 1), randn((E, h, d), torch.float64, seed + 2)
    w2 = randn((E, d, h), torch.float64, seed + 3)
    stacks = [router, w1 / d**0.5, w2 / h**0.5, w3 / d**0.5]
    xs = [randn((n, d), torch.float64, seed + 10 + r) + skew for r, n in enumerate(p["tokens"])]
    dys = [randn((n, d), torch.float64, seed + 20 + r) for r, n in enumerate(p["tokens"])]

    def exact(t):  # the oracle sees exactly the values the layer gets
        return t.to(p["dtype"]).double()

    return [exact(t) for t in stacks], [exact(x) for x in xs[:size]], [exact(g) for g in dys[:size]]


def _reference(p, stacks, xs, dys, dtype):
    """Naive loop over every rank's tokens: y and aux per rank, grads of the summed loss."""
    params = [t.to(dtype, copy=True).requires_grad_() for t in stacks]
    xr = [t.to(dtype, copy=True).requires_grad_() for t in xs]
    kwargs = dict(top_k=p["k"], score=p["score"], capacity_factor=p["capacity"],
                  z_loss_coef=p["z_loss"])  # fmt: skip
    outs = [moe_reference(x, *params, **kwargs) for x in xr]
    loss = sum((y * dy.to(dtype)).sum() + aux for (y, aux), dy in zip(outs, dys, strict=True))
    if loss.requires_grad:
        loss.backward()

    def grad(t):  # None where no token touched t: its gradient is zero
        return torch.zeros_like(t) if t.grad is None else t.grad

    return outs, [grad(x) for x in xr], [grad(t) for t in params]


def _run_moe(p):
    rank, size = dist.get_rank(), dist.get_world_size()
    dtype = p["dtype"]
    stacks, xs, dys = _problem(p, size)
    layer = fp.nn.MoE.from_dense(*(t.to(dtype) for t in stacks), _group(), top_k=p["k"],
                                 score=p["score"], capacity_factor=p["capacity"],
                                 z_loss_coef=p["z_loss"])  # fmt: skip
    x = xs[rank].to(dtype).requires_grad_()
    y, aux = layer(x)
    ((y * dys[rank].to(dtype)).sum() + aux).backward()

    ref = _reference(p, stacks, xs, dys, torch.float64)
    same = _reference(p, stacks, xs, dys, dtype)
    mine = slice(rank * p["E"] // size, (rank + 1) * p["E"] // size)
    router_grad = layer.router_weight.grad.clone()
    if size > 1:
        dist.all_reduce(router_grad)  # the sum data parallelism takes over EP ranks
    checks = [
        ("y", y, ref[0][rank][0], same[0][rank][0]),
        ("aux", aux.reshape(1), ref[0][rank][1].reshape(1), same[0][rank][1].reshape(1)),
        ("dx", x.grad, ref[1][rank], same[1][rank]),
        ("d router", router_grad, ref[2][0], same[2][0]),
        ("dw1", layer.w1.grad, ref[2][1][mine], same[2][1][mine]),
        ("dw2", layer.w2.grad, ref[2][2][mine], same[2][2][mine]),
        ("dw3", layer.w3.grad, ref[2][3][mine], same[2][3][mine]),
    ]
    for name, got, r, t in checks:
        assert_close(got, r, t, name=name)
    return float(layer.last_stats["dropped_fraction"])


@st.composite
def moe_problems(draw):
    size = draw(st.sampled_from([1, 2, 4]))
    E = size * draw(st.integers(1, 3))
    return dict(
        world_size=size, E=E, k=draw(st.integers(1, min(E, 4))),
        d=draw(st.integers(1, 12)), h=draw(st.integers(1, 12)),
        tokens=draw(st.lists(st.integers(0, 6), min_size=size, max_size=size)),
        score=draw(st.sampled_from(["softmax", "sigmoid"])),
        capacity=draw(st.sampled_from([None, None, 1.0, 0.5])),
        z_loss=draw(st.sampled_from([0.0, 1e-3])), skew=draw(st.sampled_from([0.0, 0.5, 2.0])),
        dtype=draw(cpu_dtypes()), seed=draw(seeds()),
    )  # fmt: skip


BASE = dict(E=4, k=2, d=8, h=6, score="softmax", capacity=None, z_loss=0.0, skew=0.0,
            dtype=torch.float32, seed=0)  # fmt: skip


@given(p=moe_problems())
@example(p={**BASE, "world_size": 2, "tokens": [0, 5]})  # a rank with no tokens
@example(p={**BASE, "world_size": 4, "tokens": [3, 0, 0, 2]})  # two of them
@example(p={**BASE, "world_size": 2, "E": 6, "tokens": [1, 1]})  # T = 1, idle experts
@example(p={**BASE, "world_size": 2, "tokens": [6, 6], "skew": 8.0})  # all to expert 0
@example(p={**BASE, "world_size": 1, "E": 3, "k": 3, "tokens": [5]})  # top_k = E
@example(p={**BASE, "world_size": 2, "tokens": [6, 4], "capacity": 0.5, "skew": 2.0,
            "score": "sigmoid", "z_loss": 1e-3, "dtype": torch.float16})  # dropping  # fmt: skip
def test_moe_matches_naive_loop(world, p):
    p = dict(p)
    size = p.pop("world_size")
    world(size).run(_run_moe, p)


def _run_determinism(p):
    stacks, xs, dys = _problem(p, dist.get_world_size())
    layer = fp.nn.MoE.from_dense(*(t.float() for t in stacks), _group(), top_k=p["k"])
    results = []
    for _ in range(2):
        layer.zero_grad()
        x = xs[dist.get_rank()].float().requires_grad_()
        y, aux = layer(x)
        ((y * dys[dist.get_rank()].float()).sum() + aux).backward()
        results.append([y, x.grad] + [q.grad.clone() for q in layer.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("world_size", [1, 2])
def test_two_runs_are_bitwise_equal(world, world_size):
    p = {**BASE, "tokens": [7] * world_size, "skew": 0.5}
    assert all(world(world_size).run(_run_determinism, p))


def _run_capacity_stats():
    torch.manual_seed(0)
    layer = fp.nn.MoE(8, 4, 4, 2, _group(), capacity_factor=0.5)
    x = torch.randn(10, 8) + 3.0  # a skewed batch: some experts are over capacity
    layer(x)
    stats = layer.last_stats
    capacity = 3  # ceil(0.5 * 10 * 2 / 4)
    kept = stats["tokens_per_expert"]
    return (
        bool((kept <= capacity).all())
        and abs(float(stats["dropped_fraction"]) - (20 - int(kept.sum())) / 20) < 1e-6
    )


def test_capacity_caps_experts_and_reports_drops(world):
    assert all(world(2).run(_run_capacity_stats))


def _run_bad(case):
    if case == "experts":
        fp.nn.MoE(8, 4, 3, 1, _group())
    elif case == "top_k":
        fp.nn.MoE(8, 4, 4, 5, _group())
    elif case == "shape":
        fp.nn.MoE(8, 4, 4, 2, _group())(torch.ones(3, 7))
    elif case == "dtype":
        fp.nn.MoE(8, 4, 4, 2, _group())(torch.ones(3, 8, dtype=torch.float16))


@pytest.mark.parametrize(
    "case, error, match",
    [("experts", ValueError, r"num_experts \(3\).*EP group size \(2\)"),
     ("top_k", ValueError, r"top_k \(5\).*num_experts \(4\)"),
     ("shape", ValueError, r"d_model=8.*\(3, 7\)"), ("dtype", TypeError, "float16")],
)  # fmt: skip
def test_bad_input_fails_on_every_rank(world, case, error, match):
    with pytest.raises(WorldError) as info:
        world(2).run(_run_bad, case)
    assert sorted(info.value.exceptions) == [0, 1]
    for e in info.value.exceptions.values():
        assert isinstance(e, error) and re.search(match, str(e)), repr(e)


def test_leading_dims_and_no_group():
    torch.manual_seed(0)
    layer = fp.nn.MoE(6, 5, 4, 2, score="sigmoid", z_loss_coef=1e-3)
    x = torch.randn(2, 3, 6)
    y, aux = layer(x)
    ref, ref_aux = moe_reference(x.reshape(-1, 6), layer.router_weight, layer.w1, layer.w2,
                                 layer.w3, top_k=2, score="sigmoid", z_loss_coef=1e-3)  # fmt: skip
    assert y.shape == x.shape
    torch.testing.assert_close(y.reshape(-1, 6), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux, ref_aux)


def test_expert_bias_steers_selection_only():
    torch.manual_seed(0)
    layer = fp.nn.MoE(6, 5, 4, 1, score="sigmoid", norm_topk_prob=False)
    x = torch.randn(8, 6)
    layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    layer(x)
    assert layer.last_stats["tokens_per_expert"].tolist() == [0, 0, 0, 8]


# --- the kernels on their own --------------------------------------------------------------


@given(T=st.integers(0, 20), k=st.integers(1, 3), E=st.integers(1, 5), K=st.integers(1, 40),
       N=st.integers(1, 40), dtype=cpu_dtypes(), seed=seeds())  # fmt: skip
def test_grouped_kernels(T, k, E, K, N, dtype, seed):
    ids = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(seed))
    counts, order, pos = dispatch_metadata(ids, E)
    assert counts.sum() == T * k and torch.equal(order, torch.argsort(ids.reshape(-1), stable=True))
    x, w = randn((T, K), dtype, seed), randn((E, N, K), dtype, seed + 1)
    rows = order // k
    y = grouped_matmul(x, w, counts, rows)
    ref = grouped_matmul_reference(x.double(), w.double(), counts, rows)
    assert_close(y, ref, grouped_matmul_reference(x, w, counts, rows), name="grouped y")
    dy = randn((T * k, N), dtype, seed + 2)
    dw = grouped_weight_grad(dy, x, counts, rows)
    offsets = [0, *torch.cumsum(counts, 0).tolist()]
    for e in range(E):  # an empty expert's gradient is exactly zero
        a, b = offsets[e], offsets[e + 1]
        expected = dy[a:b].double().T @ x[rows[a:b]].double()
        assert_close(dw[e], expected, dy[a:b].T @ x[rows[a:b]], name=f"dw[{e}]")
    assert torch.equal(gather_rows(x, rows), x[rows])
    summed = combine(gather_rows(x, rows), pos)
    assert_close(summed, x.double() * k, x * k, name="combine")
